"""What the PS strategies do when a replacement process takes a lost worker's slot
(`Strategy.on_worker_joined`, hetrain join): pure state machines, no processes."""

from __future__ import annotations

from hetrain.cluster import preset
from hetrain.strategies import Push, RunContext, make_strategy
from hetrain.strategies.clock_gate import ClockGate


def ctx(train_samples: int = 16_000) -> RunContext:
    return RunContext(cluster=preset("hetero-4"), flops_per_sample=1e6, model_bytes=40_000,
                      sample_bytes=100, train_samples=train_samples, batch_size=16, lr=0.05)


def push(w: int, samples: int = 16, steps: int = 1, compute_s: float = 0.01) -> Push:
    return Push(worker=w, base_version=0, samples=samples, steps=steps, loss=1.0,
                compute_s=compute_s, comm_s=0.01, arrival_s=0.0)


def test_asynchronous_strategies_release_the_joiner_at_once() -> None:
    for name in ("asp", "adsp"):
        s = make_strategy(name)
        s.setup(ctx())
        s.on_worker_lost(2)
        d = s.on_worker_joined(2)
        assert d is not None and d.release == (2,), name


def test_the_joiner_enters_the_clock_gate_at_the_slowest_clock_and_holds_nobody() -> None:
    g = ClockGate(3, bound=1)
    for _ in range(3):
        g.tick(1)
        g.tick(2)
    g.drop(0)                    # 0 stopped at clock 0: now 1 and 2 pace each other
    assert g.min_clock() == 3
    g.join(0)
    assert g.clocks[0] == 3 and g.min_clock() == 3  # not at 0: it would hold everyone
    assert g.tick(1) == (1,)     # 1 is one ahead of the slowest: still free to go
    assert g.tick(0) == (0,)


def test_ssp_and_ashl_take_the_joiner_at_the_current_clock() -> None:
    for name in ("ssp", "ashl"):
        s = make_strategy(name)
        s.setup(ctx())
        for _ in range(4):
            for w in (1, 2, 3):
                s.on_push(push(w))
        s.on_worker_lost(0)
        d = s.on_worker_joined(0)
        assert d is not None and d.release == (0,), name
        assert s.gate.clocks[0] == min(s.gate.clocks[1:]), name
        assert 0 in s.gate.alive


def test_cadp_plans_the_device_in_again_from_the_next_round() -> None:
    s = make_strategy("cadp", local_steps=2, batch_size=32)
    s.setup(ctx())
    tasks = [s.next_task(w) for w in range(4)]
    for w in range(3):
        s.on_push(push(w, tasks[w].samples, 2, tasks[w].samples / 400))
    d = s.on_worker_lost(3)
    assert d is not None and d.release == (0, 1, 2) and s.history[-1][3] == 0
    again = {w: s.next_task(w) for w in d.release}
    assert s.on_worker_joined(3) is None       # the round under way does not wait for it
    assert s._shares[3] > 0                    # planned in again, its cap back
    for w, t in again.items():
        d = s.on_push(push(w, t.samples, 2, t.samples / 400))
    assert d.release == (0, 1, 2, 3)           # ...and released at the round boundary
    assert sum(s.next_task(w).samples for w in d.release) == s.samples_per_round


def test_auto_checks_its_plan_when_a_device_joins() -> None:
    s = make_strategy("auto")
    s.setup(ctx())
    for w in range(4):
        s.next_task(w)
    s.on_worker_lost(3)
    assert s.goodput_plan.shares[3] == 0
    s.on_worker_joined(3)
    assert 3 not in s._lost and 3 not in s._trained
    assert s._next_check > s._samples_seen     # the check ran now and the next is scheduled
    assert s._costs().per_sample_s[3] != float("inf")  # the planner may use it again
