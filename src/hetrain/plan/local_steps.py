"""Plan each worker's local iterations so that pull + local compute + push is equal across workers.

ASHL stage 0's plan. Worker i costs c_i = pull_i + push_i per commit and s_i per iteration, so a
round of H_i iterations takes r_i(H_i) = c_i + H_i s_i. For a common round time T the
equalising choice is H_i = (T - c_i) / s_i, rounded to the nearest integer and clipped to
[min_steps, max_steps]. T defaults to the smallest round time that gives every worker at least
`min_steps` iterations: T = max_i (c_i + min_steps * s_i), i.e. the slowest (or worst-connected)
worker runs exactly `min_steps` and everyone else fills the same time with more iterations.
Rounding leaves each worker within s_i / 2 of T (exact balance is impossible with whole
iterations); `imbalance` reports max r_i / min r_i of the rounded plan.

`max_round_time_s` caps T (every planner here takes it): where slow links would make rounds
longer than, e.g., a quarter of an epoch (`commit_round_cap_s`), T is cut to the cap and the
same H_i = (T - c_i) / s_i follow, so every worker still commits at least once per cap; a
worker whose commit time alone exceeds the cap runs `min_steps`. A cap above the planned T
changes nothing (the plan is the uncapped one, float for float).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hetrain.errors import ConfigError
from hetrain.plan.ema import WorkerCosts
from hetrain.profile.profile import Profile, WorkerProfile


@dataclass(frozen=True)
class LocalPlan:
    """Local iterations per worker and the round times they give."""

    local_steps: tuple[int, ...]
    round_time_s: float
    """The target common round time T."""
    round_times_s: tuple[float, ...]
    """Predicted pull + H_i * step + push of each worker."""
    targets: tuple[float, ...] = field(default=())
    """The unrounded (T - c_i) / s_i, clipped to the step limits (for `FractionalSteps`)."""
    capped: bool = False
    """Whether `max_round_time_s` cut T (the plan commits more often than it would have)."""

    @property
    def imbalance(self) -> float:
        """max / min predicted round time (1 = perfectly balanced)."""
        return max(self.round_times_s) / min(self.round_times_s)

    def to_dict(self) -> dict[str, object]:
        return {"local_steps": list(self.local_steps), "round_time_s": self.round_time_s,
                "round_times_s": list(self.round_times_s)}


def epoch_time_s(profile: Profile, samples: int, batch_size: int | None = None) -> float:
    """The time one epoch of `samples` takes at the workers' summed compute rate,
    samples / sum_i (b / s_i) (b: `batch_size`, else each worker's profiled batch size), i.e.
    with no time lost to communication: a lower bound on a real epoch."""
    rate = sum((batch_size or w.batch_size) / w.step_time_s for w in profile.workers)
    return samples / rate


def commit_round_cap_s(profile: Profile, samples: int, commits_per_epoch: float,
                       batch_size: int | None = None) -> float:
    """The longest round that still gives every worker `commits_per_epoch` commits in an
    epoch (`epoch_time_s` / commits_per_epoch); inf when `commits_per_epoch` is 0 (no cap)."""
    if commits_per_epoch < 0:
        raise ConfigError(f"local-step plan: commits_per_epoch must be >= 0, "
                          f"got {commits_per_epoch}")
    if commits_per_epoch == 0:
        return math.inf
    return epoch_time_s(profile, samples, batch_size) / commits_per_epoch


def plan_local_steps(profile: Profile, min_steps: int = 1, round_time_s: float | None = None,
                     max_steps: int = 100_000, max_round_time_s: float = math.inf) -> LocalPlan:
    """Equalise round times (see the module docstring for the derivation)."""
    if min_steps < 1 or max_steps < min_steps:
        raise ConfigError(f"local-step plan: need 1 <= min_steps <= max_steps, got "
                          f"{min_steps}, {max_steps}")
    if not max_round_time_s > 0:
        raise ConfigError(f"local-step plan: max_round_time_s must be > 0, got "
                          f"{max_round_time_s}")
    workers = profile.workers
    t = round_time_s if round_time_s is not None else max(
        w.comm_time_s + min_steps * w.step_time_s for w in workers)
    if t <= 0:
        raise ConfigError(f"local-step plan: round_time_s must be > 0, got {t}")
    capped = t > max_round_time_s
    if capped:
        t = max_round_time_s
    targets = tuple(min(max_steps, max(min_steps, (t - w.comm_time_s) / w.step_time_s))
                    for w in workers)
    steps = tuple(min(max_steps, max(min_steps, round(x))) for x in targets)
    times = tuple(w.round_time_s(h) for w, h in zip(workers, steps, strict=True))
    return LocalPlan(steps, t, times, targets, capped)


def plan_for_fastest(profile: Profile, fastest_steps: int, min_steps: int = 1,
                     max_round_time_s: float = math.inf) -> LocalPlan:
    """The plan whose fastest-iterating worker runs `fastest_steps` iterations per round.

    T = c_f + fastest_steps * s_f for the worker f with the smallest step time; the others
    fill T (and get at least `min_steps`). Used to make commits infrequent (ASHL's AHL stage).
    """
    if fastest_steps < 1:
        raise ConfigError(f"local-step plan: fastest_steps must be >= 1, got {fastest_steps}")
    f = min(profile.workers, key=lambda w: w.step_time_s)
    t = max(f.comm_time_s + fastest_steps * f.step_time_s,
            max(w.comm_time_s + min_steps * w.step_time_s for w in profile.workers))
    return plan_local_steps(profile, min_steps, round_time_s=t, max_round_time_s=max_round_time_s)


class FractionalSteps:
    """Whole local-step counts whose running mean is a fractional target (error diffusion).

    Rounding a target of 1.5 steps to 2 every time makes that worker commit 25% less often
    than planned; carrying the remainder to the next round (1, 2, 1, 2, ...) keeps the long-run
    commit rate exact, which is what balances commit counts across workers.
    """

    def __init__(self, n: int) -> None:
        self.carry = [0.0] * n

    def take(self, worker: int, target: float, min_steps: int = 1) -> int:
        x = target + self.carry[worker]
        steps = max(min_steps, math.floor(x + 1e-9))
        self.carry[worker] = min(1.0, max(-1.0, x - steps))
        return steps


class OnlineCosts(WorkerCosts):
    """Per-worker step and commit times: a profile first, then EMAs of what pushes report.

    A push carries its measured compute time (`compute_s / steps` is the step time) and the
    time of its pull plus push on the wire (`comm_s`, including queueing at the server), so
    the plan follows devices that slow down without the strategy reading any clock.
    `compute_s` (alias `step_s`) holds seconds per local step, `comm_s` seconds per commit.
    """

    def __init__(self, profile: Profile, weight: float = 0.3) -> None:
        super().__init__([w.step_time_s for w in profile.workers],
                         [w.comm_time_s for w in profile.workers], weight,
                         "online costs: EMA weight")
        self.base = profile

    @property
    def step_s(self) -> list[float]:
        """Seconds per local step, per worker (`compute_s`)."""
        return self.compute_s

    @staticmethod
    def _upgrade_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint written before OnlineCosts was a `WorkerCosts` names its step times
        `step_s` (hetrain.engine.codec calls this when it reads one back)."""
        if "step_s" in attrs:
            attrs["compute_s"] = attrs.pop("step_s")
        return attrs

    def observe(self, worker: int, compute_s: float, steps: int, comm_s: float) -> None:
        """Fold in one push: `compute_s` over `steps` local steps (none, or no time: a push
        that says nothing about the step time) and `comm_s` on the wire (< 0: not measured)."""
        self.update(worker, compute_s if steps > 0 and compute_s > 0 else None,
                    comm_s if comm_s >= 0 else None, units=steps)

    def profile(self) -> Profile:
        """The current estimate as a Profile (the commit time split like the base's)."""
        workers = []
        for w, step, comm in zip(self.base.workers, self.step_s, self.comm_s, strict=True):
            share = w.pull_time_s / w.comm_time_s if w.comm_time_s > 0 else 0.5
            workers.append(WorkerProfile(w.name, w.batch_size, step, comm * (1 - share),
                                         comm * share))
        return Profile(tuple(workers), self.base.model_bytes, self.base.push_bytes,
                       self.base.source)


def plan_for_comm_fraction(profile: Profile, comm_fraction: float, min_steps: int = 1,
                           max_round_time_s: float = math.inf) -> LocalPlan:
    """The most frequent commits that keep every worker's wire time under a budget.

    Worker i spends c_i of a round of length T communicating, so c_i / T <= f for all i needs
    T >= max_i c_i / f; every worker also needs room for `min_steps` iterations, so
    T = max(max_i (c_i + min_steps * s_i), max_i c_i / f). Where links are fast the rounds
    shrink to the slowest worker's `min_steps` iterations; where they are slow (geo-distributed
    sites) the rounds grow so that communication stays a fraction f of the time.
    """
    if not 0 < comm_fraction <= 1:
        raise ConfigError(f"local-step plan: comm_fraction must be in (0, 1], got {comm_fraction}")
    floor_s = max(w.comm_time_s + min_steps * w.step_time_s for w in profile.workers)
    budget_s = max(w.comm_time_s for w in profile.workers) / comm_fraction
    return plan_local_steps(profile, min_steps, round_time_s=max(floor_s, budget_s),
                            max_round_time_s=max_round_time_s)
