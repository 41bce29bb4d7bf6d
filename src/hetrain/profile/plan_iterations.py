"""Plan each worker's local iterations so that pull + local compute + push is equal across workers.

ASHL stage 0's plan. Worker i costs c_i = pull_i + push_i per commit and s_i per iteration, so a
round of H_i iterations takes r_i(H_i) = c_i + H_i s_i. For a common round time T the
equalising choice is H_i = (T - c_i) / s_i, rounded to the nearest integer and clipped to
[min_steps, max_steps]. T defaults to the smallest round time that gives every worker at least
`min_steps` iterations: T = max_i (c_i + min_steps * s_i), i.e. the slowest (or worst-connected)
worker runs exactly `min_steps` and everyone else fills the same time with more iterations.
Rounding leaves each worker within s_i / 2 of T (exact balance is impossible with whole
iterations); `imbalance` reports max r_i / min r_i of the rounded plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetrain.errors import ConfigError
from hetrain.profile.profile import Profile


@dataclass(frozen=True)
class LocalPlan:
    """Local iterations per worker and the round times they give."""

    local_steps: tuple[int, ...]
    round_time_s: float
    """The target common round time T."""
    round_times_s: tuple[float, ...]
    """Predicted pull + H_i * step + push of each worker."""

    @property
    def imbalance(self) -> float:
        """max / min predicted round time (1 = perfectly balanced)."""
        return max(self.round_times_s) / min(self.round_times_s)

    def to_dict(self) -> dict[str, object]:
        return {"local_steps": list(self.local_steps), "round_time_s": self.round_time_s,
                "round_times_s": list(self.round_times_s)}


def plan_local_steps(profile: Profile, min_steps: int = 1, round_time_s: float | None = None,
                     max_steps: int = 100_000) -> LocalPlan:
    """Equalise round times (see the module docstring for the derivation)."""
    if min_steps < 1 or max_steps < min_steps:
        raise ConfigError(f"local-step plan: need 1 <= min_steps <= max_steps, got "
                          f"{min_steps}, {max_steps}")
    workers = profile.workers
    t = round_time_s if round_time_s is not None else max(
        w.comm_time_s + min_steps * w.step_time_s for w in workers)
    if t <= 0:
        raise ConfigError(f"local-step plan: round_time_s must be > 0, got {t}")
    steps = tuple(min(max_steps, max(min_steps, round((t - w.comm_time_s) / w.step_time_s)))
                  for w in workers)
    times = tuple(w.round_time_s(h) for w, h in zip(workers, steps, strict=True))
    return LocalPlan(steps, t, times)


def plan_for_fastest(profile: Profile, fastest_steps: int, min_steps: int = 1) -> LocalPlan:
    """The plan whose fastest-iterating worker runs `fastest_steps` iterations per round.

    T = c_f + fastest_steps * s_f for the worker f with the smallest step time; the others
    fill T (and get at least `min_steps`). Used to make commits infrequent (ASHL's AHL stage).
    """
    if fastest_steps < 1:
        raise ConfigError(f"local-step plan: fastest_steps must be >= 1, got {fastest_steps}")
    f = min(profile.workers, key=lambda w: w.step_time_s)
    t = max(f.comm_time_s + fastest_steps * f.step_time_s,
            max(w.comm_time_s + min_steps * w.step_time_s for w in profile.workers))
    return plan_local_steps(profile, min_steps, round_time_s=t)
