"""SSP: the staleness bound holds on every step of a simulated trace (convergence on digits:
tests/test_converges.py)."""

from __future__ import annotations

import pytest

from helpers import run_context
from hetrain.config import config_from_dict
from hetrain.errors import ConfigError
from hetrain.runner import run_config
from hetrain.strategies import Decision, Push, make_strategy
from hetrain.strategies.clock_gate import ClockGate
from hetrain.strategies.ssp import SSP


def push(worker: int, base: int) -> Push:
    return Push(worker=worker, base_version=base, samples=16, steps=1, loss=1.0,
                compute_s=0.01, comm_s=0.001, arrival_s=0.0)


def test_clock_gate_holds_the_runaway_and_frees_it():
    g = ClockGate(2, bound=1)
    assert g.tick(0) == (0,)  # 1 ahead of worker 1: allowed
    assert g.tick(0) == ()  # 2 ahead: held
    assert g.tick(1) == (0, 1)  # the slowest caught up
    assert g.max_gap == 2 and g.holds == 1
    assert g.drop(1) == ()
    free = ClockGate(2, bound=None)
    assert [free.tick(0) for _ in range(5)] == [(0,)] * 5


class TracedSSP(SSP):
    """SSP that records, after every decision, the clocks and whom it released."""

    def setup(self, ctx):
        super().setup(ctx)
        self.trace: list[tuple[list[int], tuple[int, ...]]] = []

    def on_push(self, push: Push) -> Decision:
        d = super().on_push(push)
        self.trace.append((list(self.gate.clocks), d.release))
        return d


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_the_bound_is_never_exceeded_on_a_trace(bound):
    strategy = TracedSSP(staleness=bound)
    cfg = config_from_dict({"name": "t-ssp", "cluster": "hetero-4",
                            "workload": {"model": "mlp", "dataset": "digits"},
                            "strategy": {"name": "ssp"}, "train": {"batch_size": 16},
                            "stop": {"max_epochs": 2.0}})
    run_config(cfg, runs_root=None, strategy=strategy)
    assert len(strategy.trace) > 100
    running = [0] * 4  # iteration each worker is working on (clock + 1 once released)
    for clocks, released in strategy.trace:
        slowest = min(clocks)
        assert max(clocks) - slowest <= bound + 1  # completed iterations
        for w in released:
            assert clocks[w] - slowest <= bound  # started at most s ahead of the slowest
            running[w] = clocks[w] + 1
        assert max(running) - min(running) <= bound + 1
    assert strategy.gate.holds > 0  # the 1:1:2:4 devices really hit the bound
    assert strategy.gate.max_gap <= bound + 1


def test_lost_worker_releases_the_held():
    s = make_strategy("ssp", staleness=0)
    s.setup(run_context())
    assert s.on_push(push(3, 0)).release == ()
    d = s.on_worker_lost(0)
    assert d is not None and d.release == ()
    assert s.on_push(push(1, 0)).release == ()  # worker 2 is now the slowest
    assert s.on_push(push(2, 0)).release == (1, 2, 3)  # worker 0 no longer paces anyone
    assert s.stats()["held_pushes"] == 2


def test_bad_staleness_is_a_config_error():
    with pytest.raises(ConfigError, match="staleness"):
        make_strategy("ssp", staleness=-1)
