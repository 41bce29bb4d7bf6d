"""The strategy contract (hetrain.strategies.base, "The contract") over every registered strategy.

A hypothesis state machine plays the engine: every live worker is busy (released, its push owed)
or waiting (pushed, or joined, and not released since). Rules let a busy worker push, the one
whose task finishes first on the cluster model or any, with the metadata engines send (samples,
steps, measured compute and wire times, arrival time, loss, a noise probe when the task asked
for one); PS strategies also lose and rejoin workers, as the dist engine does. Each answer goes
through `check_decision` (rules 1-4), each "scaled" weight is compared with the strategy's
docstring, a pickled copy must answer exactly as the original (rule 6) and, at the end, the
busy workers push on until every waiting worker the strategy plans work for is released (rule
5). Derandomized, no example database: the same histories on every run (CI), ~2 s a strategy.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from helpers import run_context
from hetrain.cluster import Cluster, Link, preset
from hetrain.plan.noise import GradProbe
from hetrain.strategies import REGISTRY, Decision, Push, Strategy, WorkTask, make_strategy
from hetrain.strategies.adsp import ADSP
from hetrain.strategies.ashl import ASHL
from hetrain.strategies.asp import ASP
from hetrain.strategies.cadp import CADP
from hetrain.strategies.contract import ContractError, check_decision

OPTIONS: dict[str, list[dict[str, Any]]] = {
    "asp": [{}, {"staleness_weighting": True, "local_steps": 2}, {"push_weight": 0.3}],
    "ssp": [{}, {"staleness": 0}, {"staleness": 1, "staleness_weighting": True}],
    "adsp": [{}, {"weighting": "uniform", "comm_aware": True, "check_period_s": 0.5},
             {"commits_init": 1, "min_commits_per_epoch": 0.0}],
    "ashl": [{}, {"switch_window": 2, "shl_gap": 0, "weighting": "uniform"},
             {"ahl_gap": 0, "ahl_fastest_steps": 3, "shl_fastest_steps": 1}],
    "cadp": [{}, {"local_steps": 2, "batch_size": 32, "replan_every": 2},
             {"replan_every": 0, "ship_data": False}],
    "auto": [{}, {"local_steps": 2, "move_ps": False, "min_probes": 2},
             {"push": "gradient", "min_probes": 2}],
    "local_sgd": [{}, {"local_steps": 1}],
}
"""Options beside the defaults that take other paths (a registered strategy not listed here
runs with its defaults)."""


def _device_0_behind(latency_s: float) -> Cluster:
    """hetero-4 with device 0 behind a slow link. At 5 s cadp plans it no work (rule 5); at
    0.31 s none at setup, and some once the first round's measured times are in, while its
    1-sample probe is still on the wire (a busy worker the new round must not release)."""
    return preset("hetero-4").with_device(0, link=Link(1e9, latency_s))


CLUSTERS = {"homo-4": lambda: preset("homo-4"), "hetero-4": lambda: preset("hetero-4"),
            "hetero-8": lambda: preset("hetero-8"), "far-0": lambda: _device_0_behind(5.0),
            "marginal-0": lambda: _device_0_behind(0.31)}
SCENARIOS = [("homo-4", 1000), ("hetero-4", 1000), ("hetero-4", 20_000), ("hetero-8", 1000),
             ("hetero-8", 20_000), ("far-0", 1000), ("marginal-0", 1000)]
"""(cluster, train_samples): an epoch of 1000 samples makes the commit caps of adsp and ashl
bind and auto re-plan often; 20 000 does neither."""
SLOW_SETUP = {"auto": [("homo-4", 1000), ("hetero-4", 20_000), ("far-0", 1000)]}
"""auto's planner searches every G and H at setup (0.2 s on hetero-8): its smaller clusters."""


def parked(s: Strategy) -> set[int]:
    """Workers the strategy plans no work for, which it may leave waiting (rule 5)."""
    if isinstance(s, CADP) and s.plan is not None:
        return {w for w, x in enumerate(s.plan.shares) if x == 0}
    return set()


def check_documented_weight(s: Strategy, d: Decision, pushes: dict[int, Push],
                            version: int) -> None:
    """Rule 3 for the "scaled" strategies: each weight is what their docstrings say."""
    for w, x in d.apply:
        if isinstance(s, ASP):  # push_weight or 1/n, / (1 + staleness) if staleness_weighting
            base = s.push_weight or 1.0 / s.context.n_workers
            staleness = version - pushes[w].base_version
            want = base / (1 + staleness) if s.staleness_weighting else base
            assert x == pytest.approx(want, rel=1e-12), (s.name, w, x, want)
        elif isinstance(s, (ADSP, ASHL)):  # commit_weight x (1/n | samples / round samples)
            if s.weighting == "uniform":
                assert x == s.commit_weight / s.context.n_workers, (s.name, x)
            else:
                assert 0 < x < math.inf, (s.name, x)


SLOWDOWNS = st.sampled_from([0.25, 0.5, 1.0, 2.0, 4.0])
"""A task's compute time over the cluster model's (a device measured slower or faster)."""
LOSSES = st.floats(0.01, 5.0)


class EngineModel(RuleBasedStateMachine):
    """The engine's bookkeeping around one strategy (see the module docstring). Each released
    task has a finish time from the cluster model (its pull, compute x a drawn slowdown, its
    push); pushes mostly arrive in that order, as on the simulator, and sometimes any busy
    worker's arrives next, as a real network allows."""

    name = ""

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        options = data.draw(st.sampled_from(OPTIONS.get(self.name, [{}])), label="options")
        cluster, train_samples = data.draw(st.sampled_from(SLOW_SETUP.get(self.name, SCENARIOS)),
                                           label="cluster, train_samples")
        self.s = self.make(options)
        self.s.setup(run_context(CLUSTERS[cluster](), train_samples=train_samples))
        self.n = self.s.context.n_workers
        self.live = set(range(self.n))
        self.busy: dict[int, WorkTask] = {}
        self.base_version: dict[int, int] = {}
        self.times: dict[int, tuple[float, float, float]] = {}  # compute_s, comm_s, finish
        self.held: Counter[int] = Counter()  # pushes held, not yet applied
        self.last_push: dict[int, Push] = {}
        self.version = 0
        self.now = 0.0
        for w in range(self.n):              # the engine starts every worker, no Decision
            self._release(w, self.s.next_task(w), data.draw(SLOWDOWNS, label="slowdown"))
        self.consistent = True

    def make(self, options: dict[str, Any]) -> Strategy:
        return make_strategy(self.name, **options)

    # ---- the engine's side ------------------------------------------------------------------
    def _release(self, w: int, task: WorkTask, slowdown: float) -> None:
        ctx = self.s.context
        dev = ctx.cluster.devices[w]
        compute_s = slowdown * (task.samples * ctx.flops_per_sample / dev.flops
                                + task.local_steps * dev.step_overhead_s)
        comm_s = 0.0
        if self.s.comm == "ps":
            link = ctx.cluster.ps_link(w)
            comm_s = 2 * link.latency_s + (2 * ctx.model_bytes + task.data_bytes) \
                / link.bandwidth_Bps
        self.busy[w] = task
        self.base_version[w] = self.version
        self.times[w] = (compute_s, comm_s, self.now + compute_s + comm_s)

    def _push(self, w: int, loss: float, arrival_s: float | None = None) -> Push:
        """What an engine sends for busy worker w's finished task (then w is waiting): it
        arrives at its finish time, or at `arrival_s`."""
        self.consistent = False
        task = self.busy.pop(w)
        compute_s, comm_s, finish_s = self.times[w]
        self.now = max(self.now, finish_s if arrival_s is None else arrival_s)
        b = task.batch_size
        probe = GradProbe(1.0 + 2.0 * loss / (b / 2), b / 2, 1.0 + 2.0 * loss / b, b) \
            if task.probe_noise else None
        push = Push(worker=w, base_version=self.base_version[w], samples=task.samples,
                    steps=task.local_steps, loss=loss, compute_s=compute_s, comm_s=comm_s,
                    arrival_s=self.now, probe=probe)
        self.held[w] += 1
        self.last_push[w] = push
        return push

    def _next(self) -> int:
        return min(self.busy, key=lambda w: (self.times[w][2], w))

    def _carry_out(self, d: Decision | None, after: str, data: st.DataObject | None,
                   twin: Strategy | None = None) -> None:
        """Check the answer, then apply and release as an engine does (slowdowns drawn from
        `data`; None: 1); `twin`, a pickled copy that got the same calls, must hand out the
        same tasks."""
        self.consistent = False
        check_decision(self.s, d, n_workers=self.n, busy=self.busy, live=self.live,
                       buffered=self.held, after=after)
        if d is not None:
            check_documented_weight(self.s, d, self.last_push, self.version)
            for w, _ in d.apply:
                self.held[w] -= 1
            self.version += bool(d.apply)
            for w in d.release:
                task = self.s.next_task(w)
                if twin is not None:
                    assert twin.next_task(w) == task, (self.name, w)
                slowdown = 1.0 if data is None else data.draw(SLOWDOWNS, label="slowdown")
                self._release(w, task, slowdown)
        self.consistent = True

    # ---- rules ------------------------------------------------------------------------------
    @precondition(lambda self: self.busy)
    @rule(data=st.data(), loss=LOSSES)
    def push_next(self, data: st.DataObject, loss: float) -> None:
        """The busy worker whose task finishes first pushes."""
        self._carry_out(self.s.on_push(self._push(self._next(), loss)), "push", data)

    @precondition(lambda self: self.busy)
    @rule(data=st.data(), loss=LOSSES, gap_s=st.floats(0.0, 1.0))
    def push_any(self, data: st.DataObject, loss: float, gap_s: float) -> None:
        """Any busy worker pushes, `gap_s` after the last event."""
        w = data.draw(st.sampled_from(sorted(self.busy)), label="worker")
        self._carry_out(self.s.on_push(self._push(w, loss, self.now + gap_s)), "push", data)

    @precondition(lambda self: self.busy)
    @rule(data=st.data(), loss=LOSSES, first=st.booleans())
    def push_to_a_restored_copy(self, data: st.DataObject, loss: float, first: bool) -> None:
        """Rule 6: the strategy pickles between two calls, and the copy (what the dist server
        snapshots and a checkpoint restores) decides exactly as the original; the run goes on
        with the copy."""
        w = self._next() if first else data.draw(st.sampled_from(sorted(self.busy)), "worker")
        twin = pickle.loads(pickle.dumps(self.s))
        push = self._push(w, loss)
        d = self.s.on_push(push)
        assert twin.on_push(push) == d, self.name
        self._carry_out(d, "push", data, twin)
        self.s = twin

    @precondition(lambda self: self.s.comm == "ps" and len(self.live) > 1)
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        """A worker dies (busy or waiting); the engine drops its held pushes. (An all-reduce
        run stops at a loss; the dist engine stops when no worker is left.)"""
        w = data.draw(st.sampled_from(sorted(self.live)), label="lost")
        self.live.discard(w)
        self.busy.pop(w, None)
        self.held[w] = 0
        self._carry_out(self.s.on_worker_lost(w), "lost", data)

    @precondition(lambda self: self.s.comm == "ps" and len(self.live) < self.n)
    @rule(data=st.data())
    def join(self, data: st.DataObject) -> None:
        """A replacement process takes a lost worker's slot: it waits for its first task."""
        w = data.draw(st.sampled_from(sorted(set(range(self.n)) - self.live)), label="joined")
        self.live.add(w)
        self._carry_out(self.s.on_worker_joined(w), "joined", data)

    def teardown(self) -> None:
        """Rule 5: the busy workers push in the order their tasks finish, at nominal speed;
        every worker waiting now that the strategy plans work for is released within a bounded
        number of pushes."""
        if not getattr(self, "consistent", False):
            return  # set-up failed, or a rule did: hypothesis reports that one
        waiting = self.live - set(self.busy)
        freed: set[int] = set()
        for _ in range(DRAIN_PUSHES_PER_WORKER * self.n):
            if not waiting - freed - parked(self.s):
                return
            d = self.s.on_push(self._push(self._next(), loss=1.0))
            self._carry_out(d, "push", None)
            freed.update(d.release)
        starved = sorted(waiting - freed - parked(self.s))
        raise AssertionError(f"strategy '{self.name}' left workers {starved} waiting while the "
                             f"others pushed {DRAIN_PUSHES_PER_WORKER * self.n} times (rule 5)")


DRAIN_PUSHES_PER_WORKER = 40
"""Rule 5's bound, per worker: ssp and ashl hold a runaway until the slowest catches up."""


def machine(name: str) -> type[EngineModel]:
    return type(f"Engine_{name}", (EngineModel,), {"name": name})


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_strategy_keeps_the_contract(name: str) -> None:
    run_state_machine_as_test(machine(name), settings=settings(
        max_examples=15 if name == "auto" else 40, stateful_step_count=40, deadline=None,
        derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]))


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_strategy_is_a_picklable_dataclass(name: str) -> None:
    """Rule 6 with the defaults: the options are the dataclass's init fields."""
    s = make_strategy(name)
    assert dataclasses.is_dataclass(s) and isinstance(s, Strategy)
    copy = pickle.loads(pickle.dumps(s))
    assert type(copy) is type(s) and copy == s


# ---- check_decision itself: each rule, broken on purpose ----------------------------------------
def _ddp() -> Strategy:
    s = make_strategy("ddp")
    s.setup(run_context("homo-4"))
    return s


@pytest.mark.parametrize("decision, busy, live, held, after, rule_", [
    (Decision(release=(1,)), {1, 2}, None, {}, "push", "never release a busy worker"),
    (Decision(release=(0, 0)), {1}, None, {}, "push", "release at most once"),
    (Decision(release=(3,)), {1}, {0, 1, 2}, {}, "push", "never release a lost worker"),
    (Decision(release=(4,)), {1}, None, {}, "push", "worker ids"),
    (Decision(release=(True,)), {1}, None, {}, "push", "worker ids"),
    (Decision(apply=((0, 1.0),)), {1, 2, 3}, None, {0: 0}, "push", "apply only held pushes"),
    (Decision(apply=((0, 0.5), (0, 0.5))), {1}, None, {0: 1}, "push", "apply only held"),
    (Decision(apply=((0, 0.5), (1, 0.5)), release=(0, 1)), set(), None, {0: 1}, "push",
     "apply only held pushes"),
    (Decision(apply=((0, math.nan),)), {1}, None, {0: 1}, "push", "finite and >= 0"),
    (Decision(apply=((0, -0.25), (1, 1.25))), {2}, None, {0: 1, 1: 1}, "push", ">= 0"),
    (Decision(apply=((0, 0.5), (1, 0.4))), {2}, None, {0: 1, 1: 1}, "push", "sum to 1"),
    (Decision(apply=((0, 1.0),), lr_scale=0.0), {1}, None, {0: 1}, "push", "lr scale"),
    (Decision(apply=((0, 1.0),), lr_scale=math.inf), {1}, None, {0: 1}, "push", "lr scale"),
    (Decision(), set(), None, {0: 1}, "push", "no deadlock"),
    (None, set(), {0, 1}, {}, "joined", "no deadlock"),
])
def test_check_decision_names_the_rule_broken(decision, busy, live, held, after, rule_) -> None:
    with pytest.raises(ContractError, match=f"strategy 'ddp' broke the contract.*{rule_}"):
        check_decision(_ddp(), decision, n_workers=4, busy=busy, live=live, buffered=held,
                       after=after)


def test_check_decision_accepts_what_the_contract_allows() -> None:
    s = _ddp()
    third = 1 / 3
    check_decision(s, Decision(apply=((0, third), (1, third), (2, third)), release=(0, 1, 2)),
                   n_workers=4, busy={3}, buffered={0: 1, 1: [object()], 2: 2})
    check_decision(s, Decision(apply=((0, 0.0),)), n_workers=4, busy={1}, buffered={0: 1})
    check_decision(s, Decision(), n_workers=4, busy={1, 2})
    check_decision(s, None, n_workers=4, busy=set(), live={0, 1}, after="lost")  # rule 4's
    check_decision(s, None, n_workers=4, busy=set(), live=set(), after="lost")   # exception
    check_decision(s, None, n_workers=4, busy=set(), live={0, 1}, after="push")  # and after
    with pytest.raises(ValueError, match="not live"):
        check_decision(s, Decision(), n_workers=4, busy={3}, live={0, 1})


@dataclasses.dataclass
class Eager(ASP):
    """ASP that also releases the next worker, busy or not: it breaks rule 1 (and no worker
    is lost: with losses it would release a lost one too, a second failure)."""

    name = "test_eager"
    comm = "allreduce"

    def on_push(self, push: Push) -> Decision:
        d = super().on_push(push)
        return Decision(d.apply, (*d.release, (push.worker + 1) % self.context.n_workers))


class EagerModel(EngineModel):
    name = "test_eager"

    def make(self, options: dict[str, Any]) -> Strategy:
        return Eager(**options)


def test_the_machine_catches_a_strategy_that_releases_a_busy_worker() -> None:
    with pytest.raises(ContractError, match="never release a busy worker"):
        run_state_machine_as_test(EagerModel, settings=settings(
            max_examples=20, deadline=None, derandomize=True, database=None,
            phases=[Phase.generate]))


# ---- what the machine found: cadp (and auto) after a loss ---------------------------------------
def _cadp_push(s: Strategy, w: int, task: WorkTask) -> Push:
    return Push(worker=w, base_version=0, samples=task.samples, steps=task.local_steps,
                loss=1.0, compute_s=task.samples / 400, comm_s=0.01, arrival_s=0.0)


def test_cadp_drops_a_lost_workers_push_from_its_round() -> None:
    """The engine drops a lost worker's pushes: the round neither applies its push nor counts
    it (it closed when worker 2 pushed, worker 3's push still owed, and applied worker 0's)."""
    s = make_strategy("cadp", local_steps=2, batch_size=32)
    s.setup(run_context("hetero-4", train_samples=16_000))
    tasks = {w: s.next_task(w) for w in range(4)}
    for w in (0, 1):
        assert s.on_push(_cadp_push(s, w, tasks[w])) == Decision()
    d = s.on_worker_lost(0)
    check_decision(s, d, n_workers=4, busy={2, 3}, live={1, 2, 3}, buffered={1: 1},
                   after="lost")
    d = s.on_push(_cadp_push(s, 2, tasks[2]))
    assert d == Decision()                       # worker 3 still owes its push
    d = s.on_push(_cadp_push(s, 3, tasks[3]))
    check_decision(s, d, n_workers=4, busy=set(), live={1, 2, 3}, buffered={1: 1, 2: 1, 3: 1})
    assert [w for w, _ in d.apply] == [1, 2, 3] and d.release == (1, 2, 3)


def test_cadp_round_without_members_releases_the_waiting_joiner() -> None:
    """Every member lost while a joined device waits for the round boundary: the round closes
    at the last loss and releases it (it was left waiting with nobody to push)."""
    s = make_strategy("cadp", local_steps=2, batch_size=32)
    s.setup(run_context("hetero-4", train_samples=16_000))
    for w in range(4):
        s.next_task(w)
    assert s.on_worker_lost(0) is None
    assert s.on_worker_joined(0) is None          # it enters at the next round boundary
    for w in (1, 2):
        assert not s.on_worker_lost(w)
    d = s.on_worker_lost(3)
    check_decision(s, d, n_workers=4, busy=set(), live={0}, buffered={}, after="lost")
    assert d is not None and d.release == (0,)
