"""ASP: every push applied on arrival, nobody waits (convergence on digits:
tests/test_converges.py)."""

from __future__ import annotations

import pytest

from helpers import run_context
from hetrain.errors import ConfigError
from hetrain.strategies import Push, make_strategy


def push(worker: int, base: int, loss: float = 1.0, t: float = 0.0, steps: int = 1) -> Push:
    return Push(worker=worker, base_version=base, samples=16 * steps, steps=steps, loss=loss,
                compute_s=0.01 * steps, comm_s=0.001, arrival_s=t)


def test_every_push_is_applied_at_once_and_released():
    s = make_strategy("asp", staleness_weighting=True)
    s.setup(run_context())
    d = s.on_push(push(2, base=0))
    assert d.apply == ((2, 0.25),) and d.release == (2,)
    d = s.on_push(push(0, base=0))  # one update happened since worker 0 pulled
    assert d.apply == ((0, 0.25 / 2),) and d.release == (0,)
    assert s.stats()["max_staleness"] == 1
    s2 = make_strategy("asp", local_steps=4, push_weight=1.0)
    s2.setup(run_context())
    assert s2.next_task(1).local_steps == 4
    assert s2.on_push(push(1, base=0)).apply == ((1, 1.0),)


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="local_steps"):
        make_strategy("asp", local_steps=0)
    with pytest.raises(ConfigError, match="unknown option"):
        make_strategy("asp", staleness=3)
