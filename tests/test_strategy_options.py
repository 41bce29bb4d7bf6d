"""Every range and every choice a strategy declares with its fields (hetrain.strategies.options)
is enforced, by the constructor and by the config check, for every registered strategy.

The cases come from the declarations themselves, so an option added with a range or a Literal
is covered without touching this file; `test_every_numeric_option_declares_a_range` makes
sure a new number option of a built-in strategy cannot leave its range out.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import pytest

from hetrain.docs_gen import builtin_strategies, field_table
from hetrain.errors import ConfigError
from hetrain.strategies import REGISTRY, make_strategy
from hetrain.strategies.options import Declared, check_declared, declarations, integer
from hetrain.validate import Limit, check_options, check_strategy, declared_limit, type_hints


def _step(x: float, integer: bool, up: bool) -> float:
    """The next value after x in the direction `up`: 1 apart for integers, one ulp for floats."""
    if integer:
        return int(x) + (1 if up else -1)
    return math.nextafter(x, math.inf if up else -math.inf)


def _outside(limit: Limit) -> list[float]:
    """The values just outside each finite end of the range."""
    out = []
    if math.isfinite(limit.lo):
        out.append(int(limit.lo) if limit.integer and limit.lo_open else
                   limit.lo if limit.lo_open else _step(limit.lo, limit.integer, up=False))
    if math.isfinite(limit.hi):
        out.append(int(limit.hi) if limit.integer and limit.hi_open else
                   limit.hi if limit.hi_open else _step(limit.hi, limit.integer, up=True))
    return out


def _edges(limit: Limit) -> list[float]:
    """The values just inside (or at) each finite end of the range."""
    out = []
    for end, is_open, up in ((limit.lo, limit.lo_open, True), (limit.hi, limit.hi_open, False)):
        if math.isfinite(end):
            out.append(_step(end, limit.integer, up) if is_open else
                       int(end) if limit.integer else end)
    return out


def _declared() -> list[tuple[str, Declared]]:
    return [(name, d) for name, cls in sorted(REGISTRY.items()) for d in declarations(cls)]


RANGES = [(name, d) for name, d in _declared() if d.limit is not None]
CHOICES = [(name, d) for name, d in _declared() if d.choices is not None]
OUTSIDE = [pytest.param(name, d.name, d.limit, v, id=f"{name}-{d.name}-{v!r}")
           for name, d in RANGES for v in _outside(d.limit)]
EDGES = [pytest.param(name, d.name, d.limit, v, id=f"{name}-{d.name}-{v!r}")
         for name, d in RANGES for v in _edges(d.limit)]


def test_the_cases_cover_every_strategy_with_options() -> None:
    """Each built-in strategy with options declares some (a refactor that loses the
    annotations would otherwise leave nothing for this file to test)."""
    for name, cls in builtin_strategies().items():
        if any(f.init for f in dataclasses.fields(cls)):
            assert declarations(cls), name
    assert {"asp", "ssp", "local_sgd", "adsp", "ashl", "cadp", "auto"} <= {n for n, _ in RANGES}
    assert len(OUTSIDE) >= len(RANGES) and len(EDGES) >= len(RANGES)


@pytest.mark.parametrize(("name", "key", "limit", "value"), OUTSIDE)
def test_a_value_just_outside_the_range_is_refused(name: str, key: str, limit: Limit,
                                                   value: float) -> None:
    want = re.escape(limit.describe())
    with pytest.raises(ConfigError, match=rf"^strategy {name}: {key} must be {want}"):
        make_strategy(name, **{key: value})
    with pytest.raises(ConfigError, match=rf"^strategy\.{key} \(strategy '{name}'\) must be "
                                          rf"{want}"):
        check_strategy(name, {key: value})


@pytest.mark.parametrize(("name", "key", "limit", "value"), EDGES)
def test_a_value_at_the_edge_is_accepted(name: str, key: str, limit: Limit,
                                         value: float) -> None:
    """By the config check and by the constructor's check of the declarations (the full
    constructor may still refuse it for a rule across fields, e.g. cadp's
    min_local_steps <= max_local_steps, which is not the declaration's business)."""
    cls = REGISTRY[name]
    check_options("strategy", name, cls, {key: value}, table="strategy")
    s = make_strategy(name)
    setattr(s, key, value)
    check_declared(s, f"strategy {name}")


@pytest.mark.parametrize(("name", "key", "limit"),
                         [pytest.param(n, d.name, d.limit, id=f"{n}-{d.name}") for n, d in RANGES])
def test_a_range_refuses_booleans_strings_and_non_finite_numbers(name: str, key: str,
                                                                 limit: Limit) -> None:
    bad: list[Any] = [True, "1", math.nan, math.inf]
    if limit.integer:
        bad.append(float(_edges(limit)[0]))  # 1.0 where an integer is meant
    for value in bad:
        with pytest.raises(ConfigError, match=rf"^strategy {name}: {key} must be"):
            make_strategy(name, **{key: value})


@pytest.mark.parametrize(("name", "key", "choices"),
                         [pytest.param(n, d.name, d.choices, id=f"{n}-{d.name}")
                          for n, d in CHOICES])
def test_a_choice_outside_the_literal_is_refused(name: str, key: str,
                                                 choices: tuple[Any, ...]) -> None:
    listed = re.escape(", ".join(map(str, choices)))
    for value in ("nosuch", choices[0].upper() + "x", 1, None):
        with pytest.raises(ConfigError, match=rf"^strategy {name}: {key} = .*; choose one of: "
                                              rf"{listed}$"):
            make_strategy(name, **{key: value})
    with pytest.raises(ConfigError, match=rf"^strategy\.{key} \(strategy '{name}'\) must be "
                                          r"one of "):
        check_strategy(name, {key: "nosuch"})
    for value in choices:
        assert getattr(make_strategy(name, **{key: value}), key) == value


def test_every_numeric_option_declares_a_range() -> None:
    """A built-in strategy's int or float option says what it accepts next to the field."""
    for name, cls in builtin_strategies().items():
        hints = type_hints(cls)
        for f in dataclasses.fields(cls):
            base = getattr(hints[f.name], "__origin__", hints[f.name])
            if f.init and base in (int, float):
                assert declared_limit(hints[f.name]) is not None, f"{name}.{f.name}"


def test_the_config_reference_shows_the_declarations() -> None:
    for name, cls in builtin_strategies().items():
        rows = {r.split("|")[1].strip(" `"): r for r in field_table(cls)[2:]}
        for d in declarations(cls):
            if d.limit is not None:
                assert f"Must be {d.limit.describe()}." in rows[d.name], (name, d.name)
            if d.choices is not None:
                assert "One of: " + ", ".join(f'`"{c}"`' for c in d.choices) in rows[d.name]


def test_a_cross_field_rule_stays_with_the_strategy() -> None:
    for name in ("cadp", "auto"):
        with pytest.raises(ConfigError, match=rf"^strategy {name}: min_local_steps \(4\) must "
                                              r"be <= max_local_steps \(2\)$"):
            make_strategy(name, min_local_steps=4, max_local_steps=2)
        assert make_strategy(name, min_local_steps=3, max_local_steps=3).min_local_steps == 3


def test_the_note_of_a_range_is_in_the_message() -> None:
    with pytest.raises(ConfigError, match=r"^strategy cadp: local_steps must be an integer >= 0 "
                                          r"and <= 10000 \(0: auto\), got -1$"):
        make_strategy("cadp", local_steps=-1)


@dataclass
class _Consumer:
    """Any dataclass may declare its options so: check_options reads Annotated and Literal."""

    n: Annotated[int, integer(1, 5)] = 1
    sizes: Annotated[list[int], integer(1, 9, length=(1, 2))] = dataclasses.field(
        default_factory=lambda: [1])
    mode: Literal["a", "b"] = "a"


@pytest.mark.parametrize(("options", "says"), [
    ({"n": 0}, "t.n (thing 'c') must be an integer >= 1 and <= 5, got 0"),
    ({"n": "x"}, "t.n (thing 'c') must be an integer, got 'x' (a string)"),
    ({"sizes": [1, 10]}, "t.sizes[1] (thing 'c') must be an integer >= 1 and <= 9, got 10"),
    ({"sizes": "x"}, "t.sizes (thing 'c') must be a list of integers, got 'x'"),
    ({"sizes": [1, 2, 3]}, "t.sizes (thing 'c') must have 1 to 2 entries, got 3"),
    ({"mode": "c"}, "t.mode (thing 'c') must be one of 'a', 'b', got 'c' (a string)"),
])
def test_check_options_reads_the_declarations_of_any_dataclass(options: dict[str, Any],
                                                               says: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_options("thing", "c", _Consumer, options, table="t")
    assert says in str(e.value)
    check_options("thing", "c", _Consumer, {"n": 5, "sizes": [9, 1], "mode": "b"}, table="t")
    with pytest.raises(ConfigError, match=r"^c: mode = 'z'; choose one of: a, b$"):
        check_declared(_Consumer(mode="z"), "c")
