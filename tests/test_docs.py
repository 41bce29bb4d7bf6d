"""The docs cannot rot: the config reference is generated, every strategy is in the table."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from hetrain import config as config_mod
from hetrain.docs_gen import _field_docs, builtin_strategies, field_table, generate, toml_value

DOCS = Path(__file__).resolve().parents[1] / "docs"
REGEN = "python -m hetrain.docs_gen > docs/config.md"


def test_committed_config_reference_is_the_generated_one():
    committed = (DOCS / "config.md").read_text()
    assert committed == generate(), f"docs/config.md is stale: regenerate it with `{REGEN}`"


def test_reference_covers_every_config_key_and_strategy_option():
    text = generate()
    for name, cls in config_mod._SECTIONS.items():
        assert f"## [{name}]" in text
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f"[{name}] {f.name} missing"
    for name, cls in builtin_strategies().items():
        assert f'### name = "{name}"' in text
        for f in dataclasses.fields(cls):
            if f.init:
                assert f"| `{f.name}` |" in text


def test_field_docstrings_are_read_from_the_source():
    docs = _field_docs(config_mod.StopConfig)
    assert docs["target_accuracy"] == "Time-to-accuracy target on the test set; 0: none."
    row = next(r for r in field_table(config_mod.StopConfig) if "`max_epochs`" in r)
    assert row.startswith("| `max_epochs` | float | `5.0` | Stop after")
    assert toml_value(True) == "true" and toml_value((1, "a")) == '[1, "a"]'
    assert toml_value({"k": 0.5}) == "{k = 0.5}" and toml_value(None) == "(none)"


def test_every_registered_strategy_is_in_the_strategies_table():
    text = (DOCS / "strategies.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", text, flags=re.M))
    missing = sorted(set(builtin_strategies()) - rows)
    assert not missing, f"docs/strategies.md has no row for {missing}"
    assert not rows - set(builtin_strategies()), "docs/strategies.md lists unknown strategies"


def test_docs_link_to_files_that_exist():
    root = DOCS.parent
    for page in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), f"{page.name} links to {target}"
        for path in re.findall(r"`((?:src|examples|tests)/[\w/.]+)`", page.read_text()):
            assert (root / path).exists(), f"{page.name} names {path}, which does not exist"
