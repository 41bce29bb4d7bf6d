"""Each parameter-server strategy trains to the same bar on sklearn digits (hetero-4, 4
epochs): one test, parametrised, with each strategy's own checks of how it got there."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from helpers import run_digits
from hetrain.report.metrics import RunResult


def _asp(r: RunResult) -> None:
    assert r.summary["strategy_stats"]["mean_staleness"] > 1  # really asynchronous
    idle = [w["idle_s"] for w in r.summary["workers"]]
    assert max(idle) < 1e-9  # nobody waits


def _ssp(r: RunResult) -> None:
    assert r.summary["strategy_stats"]["max_clock_gap"] <= 3


def _ashl(r: RunResult) -> None:
    stats = r.summary["strategy_stats"]
    assert stats["ahl_pushes"] > 0 and not math.isnan(r.summary["final_loss"])


CASES: list[tuple[str, dict[str, Any], bool, Callable[[RunResult], None] | None]] = [
    ("adsp", {}, True, None),
    ("ashl", {}, True, _ashl),
    ("asp", {}, True, _asp),
    ("ssp", {"staleness": 2}, False, _ssp),
]
"""strategy, options, whether the first evaluation is checked to be near chance (< 0.3, as
each strategy's test did before), the strategy's own checks."""


@pytest.mark.parametrize(("name", "options", "starts_low", "check"), CASES,
                         ids=[c[0] for c in CASES])
def test_converges_on_digits(name: str, options: dict[str, Any], starts_low: bool,
                             check: Callable[[RunResult], None] | None) -> None:
    r = run_digits(name, **options)
    if starts_low:
        assert r.rows[0]["test_accuracy"] < 0.3
    assert r.final_accuracy > 0.85
    if check is not None:
        check(r)
