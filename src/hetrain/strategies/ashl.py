"""ASHL (Shen et al., IEEE TC 2023): profile -> AHL (coarse, async) -> adaptive switch -> SHL.

Stage 0, profiling: a `Profile` of every worker's step, pull and push time (priced from the
Cluster, or a measured file from `hetrain profile` via `profile_path`), refined online from
the pushes. Local iterations are planned so that pull + H_i steps + push is the same round
time T for everyone. T is the shortest round that keeps every worker's wire time c_i under a
fraction f of it, T = max(slowest one-step round, max_i c_i / f) (`plan_for_comm_fraction`),
or, if `*_fastest_steps` is set, the round in which the fastest worker runs that many steps.
In both stages T is capped so that every worker commits at least `min_commits_per_epoch`
times per epoch: T <= epoch / min_commits_per_epoch, the epoch estimated as train_samples /
(sum of the workers' samples/s) from the current costs (`commit_round_cap_s`); a worker whose
commit time alone exceeds the cap runs one step. Without the cap a wide-area cluster and a
small, fast model plan rounds longer than the run, and some workers never commit at all.

Stage 1, AHL: asynchronous commits applied on arrival, infrequent (f = `ahl_comm_fraction`,
small, so rounds are long where links are slow), and a large tolerated gap: a worker is held
only when it has committed more than `ahl_gap` times more than the slowest (bounded
staleness on commit counts, the SSP gate). Goal: reach a good loss fast at little traffic.

The switch (once, never back): the pushes' training losses are averaged over windows of
`switch_window` pushes (0: 2 per worker). With m_j the mean of window j, window j is a
plateau when its relative improvement (m_{j-1} - m_j) / m_{j-1} is below `switch_threshold`;
after `switch_patience` consecutive plateau windows ASHL enters SHL. Losses come only from
`Push.loss`, so the rule is a pure function of the push sequence (tested on a scripted curve).

Stage 2, SHL: semi-asynchronous: the same on-arrival commits but frequent (f =
`shl_comm_fraction`, larger) and a small tolerated gap (`shl_gap`; 0: lock-step commits).
Goal: final accuracy, with fresh models and little client drift.

Weights: `weighting = "samples"` gives a commit the weight samples_i / (samples all workers
commit in one round), so one round of commits is the sample-weighted model average (FedAvg
weights; each device counts by the data it processed); "uniform" gives 1 / n. Either is
scaled by `commit_weight` (1 by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

from hetrain.errors import ConfigError
from hetrain.plan.local_steps import (
    FractionalSteps,
    LocalPlan,
    OnlineCosts,
    commit_round_cap_s,
    plan_for_comm_fraction,
    plan_for_fastest,
)
from hetrain.profile import Profile
from hetrain.strategies.base import Decision, Push, RunContext, Strategy, WorkTask
from hetrain.strategies.clock_gate import ClockGate
from hetrain.strategies.options import MAX_STEPS, fraction, integer, non_negative, positive
from hetrain.strategies.registry import register


class PlateauSwitch:
    """The AHL -> SHL rule on a stream of losses (see the module docstring)."""

    def __init__(self, window: int, threshold: float, patience: int) -> None:
        self.window, self.threshold, self.patience = window, threshold, patience
        self._buf: list[float] = []
        self._prev: float | None = None
        self._plateaus = 0
        self.switched_at: int | None = None
        """Index (0-based) of the loss that triggered the switch."""
        self.seen = 0
        self.window_means: list[float] = []

    def feed(self, loss: float) -> bool:
        """Add one loss; True exactly once, when the switch fires."""
        self.seen += 1
        if self.switched_at is not None:
            return False
        self._buf.append(loss)
        if len(self._buf) < self.window:
            return False
        mean = sum(self._buf) / len(self._buf)
        self._buf = []
        self.window_means.append(mean)
        prev, self._prev = self._prev, mean
        if prev is None:
            return False
        improvement = (prev - mean) / abs(prev) if prev != 0 else 0.0
        self._plateaus = self._plateaus + 1 if improvement < self.threshold else 0
        if self._plateaus >= self.patience:
            self.switched_at = self.seen - 1
            return True
        return False


@register
@dataclass
class ASHL(Strategy):
    """Adaptive multi-stage training: async coarse commits, then semi-async fine ones."""

    name = "ashl"
    comm = "ps"
    update = "delta"

    ahl_comm_fraction: Annotated[float, fraction(hi_open=False)] = 0.1
    """AHL: the most of a round any worker may spend on the wire (sets the round time)."""
    ahl_fastest_steps: Annotated[
        int, integer(0, MAX_STEPS).with_note("0: by ahl_comm_fraction")] = 0
    """AHL: if > 0, the fastest worker's local iterations per commit instead."""
    ahl_gap: Annotated[int, integer(0, MAX_STEPS)] = 8
    """AHL: how many commits a worker may be ahead of the slowest before it is held."""
    shl_comm_fraction: Annotated[float, fraction(hi_open=False)] = 0.3
    """SHL: the most of a round any worker may spend on the wire."""
    shl_fastest_steps: Annotated[
        int, integer(0, MAX_STEPS).with_note("0: by shl_comm_fraction")] = 0
    """SHL: if > 0, the fastest worker's local iterations per commit instead."""
    shl_gap: Annotated[int, integer(0, MAX_STEPS)] = 1
    """SHL: tolerated commit gap (0: lock-step rounds)."""
    switch_window: Annotated[int, integer(0).with_note("0: 2 x n_workers")] = 0
    """Pushes per loss window of the switch rule (0: 2 x n_workers)."""
    switch_threshold: Annotated[float, fraction(lo_open=False)] = 0.05
    """A window improving the mean loss by less than this fraction is a plateau."""
    switch_patience: Annotated[int, integer(1)] = 1
    """Consecutive plateau windows that trigger the switch."""
    weighting: Literal["samples", "uniform"] = "samples"
    """samples (a round of commits = the sample-weighted average) | uniform (1 / n each)."""
    commit_weight: Annotated[float, positive()] = 1.0
    """Scales every commit's weight."""
    profile_path: str = ""
    """A measured profile (JSON/TOML from `hetrain profile`); empty: price the Cluster."""
    min_commits_per_epoch: Annotated[float, non_negative().with_note("0: no cap")] = 4.0
    """Cap the round time at (estimated epoch time) / this, so every worker commits at least
    this many times per epoch (0: no cap)."""

    # ---- stage 0 ----------------------------------------------------------------------------
    def setup(self, ctx: RunContext) -> None:
        super().setup(ctx)
        n = ctx.n_workers
        if self.profile_path:
            profile = Profile.load(self.profile_path)
            if profile.n != n:
                raise ConfigError(f"strategy ashl: profile '{self.profile_path}' has "
                                  f"{profile.n} workers, the cluster has {n}")
        else:
            profile = Profile.from_context(ctx)
        self.profile = profile
        self.costs = OnlineCosts(profile)
        self.stage = 1
        self.gate = ClockGate(n, self.ahl_gap)
        self.switch = PlateauSwitch(self.switch_window or 2 * n, self.switch_threshold,
                                    self.switch_patience)
        self.rounder = FractionalSteps(n)
        self.switch_time_s: float | None = None
        self.stage_pushes = [0, 0]
        self.capped_plans = 0
        self._replan()

    def _replan(self) -> None:
        ahl = self.stage == 1
        steps = self.ahl_fastest_steps if ahl else self.shl_fastest_steps
        profile = self.costs.profile()
        ctx = self.context
        self.round_cap_s = commit_round_cap_s(profile, ctx.train_samples,
                                              self.min_commits_per_epoch, ctx.batch_size)
        self.plan: LocalPlan = \
            plan_for_fastest(profile, steps, max_round_time_s=self.round_cap_s) if steps else \
            plan_for_comm_fraction(profile, self.ahl_comm_fraction if ahl
                                   else self.shl_comm_fraction, max_round_time_s=self.round_cap_s)
        self.capped_plans += self.plan.capped
        self._round_samples = self.context.batch_size * sum(self.plan.targets)

    # ---- protocol ---------------------------------------------------------------------------
    def next_task(self, worker: int) -> WorkTask:
        steps = self.rounder.take(worker, self.plan.targets[worker])
        return WorkTask(batch_size=self.context.batch_size, local_steps=steps)

    def _weight(self, push: Push) -> float:
        if self.weighting == "uniform":
            return self.commit_weight / self.context.n_workers
        return self.commit_weight * push.samples / self._round_samples

    def on_push(self, push: Push) -> Decision:
        self.costs.observe(push.worker, push.compute_s, push.steps, push.comm_s)
        self.stage_pushes[self.stage - 1] += 1
        apply = ((push.worker, self._weight(push)),)
        release = list(self.gate.tick(push.worker))
        if self.switch.feed(push.loss):
            self.stage = 2
            self.switch_time_s = push.arrival_s
            release += [w for w in self.gate.set_bound(self.shl_gap) if w not in release]
        self._replan()  # cheap (one pass over the workers); follows the refined costs
        return Decision(apply=apply, release=tuple(release))

    def on_worker_lost(self, worker: int) -> Decision | None:
        return Decision(release=self.gate.drop(worker))

    def on_worker_joined(self, worker: int) -> Decision | None:
        self.gate.join(worker)
        return Decision(release=(worker,))

    def stats(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = {
            "stage": self.stage, "ahl_pushes": self.stage_pushes[0],
            "shl_pushes": self.stage_pushes[1], "max_commit_gap": self.gate.max_gap,
            "held_pushes": self.gate.holds,
            "local_steps": ",".join(map(str, self.plan.local_steps)),
            "profile_source": self.profile.source,
            "round_time_s": self.plan.round_time_s,
            "round_cap_s": self.round_cap_s if math.isfinite(self.round_cap_s) else 0.0,
            "round_capped": int(self.plan.capped),
            "capped_plans": self.capped_plans}
        if self.switch_time_s is not None:
            out["switch_time_s"] = self.switch_time_s
        return out
