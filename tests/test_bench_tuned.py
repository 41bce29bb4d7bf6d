"""The tuning benchmark's search space (benchmarks/ashl_tuned.py): which options each
strategy is searched over, and how a grid is parsed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

from ashl_tuned import _overrides, parse_grid, settings_for


def test_grid_parses_ints_floats_and_words() -> None:
    assert parse_grid(["batch_size=8,16", "commit_weight=0.7,1", "lr_scaling=none"]) == {
        "batch_size": [8, 16], "commit_weight": [0.7, 1], "lr_scaling": ["none"]}
    with pytest.raises(SystemExit, match="OPTION=V1"):
        parse_grid(["batch_size"])


def test_each_strategy_is_searched_over_the_options_it_has() -> None:
    grid = parse_grid(["batch_size=8,16", "commit_weight=0.7,1.4"])
    cadp = settings_for("cadp", (0.05, 0.1), grid)
    assert len(cadp) == 4 and {s["batch_size"] for s in cadp} == {8, 16}
    assert all("commit_weight" not in s for s in cadp)
    assert settings_for("ashl", (0.05,), grid) == [{"lr": 0.05, "commit_weight": 0.7},
                                                   {"lr": 0.05, "commit_weight": 1.4}]
    assert settings_for("fastest-alone", (0.05, 0.1), grid) == [{"lr": 0.05}, {"lr": 0.1}]


def test_a_setting_becomes_config_overrides() -> None:
    assert _overrides({"lr": 0.1}, None) == {"optimizer": {"lr": 0.1}}
    assert _overrides({"lr": 0.1, "batch_size": 8}, 6.0) == {
        "optimizer": {"lr": 0.1}, "strategy": {"batch_size": 8}, "stop": {"max_epochs": 6.0}}
