"""Turning timed steps into a device's speed, and judging whether it can be one (pure logic).

`hetrain.engine.measure` times the steps on real processes; this module fits them: a
least-squares line through every repeat, t(b) = a + c b, gives step_overhead_s = a and
flops = flops_per_sample / c (`fit_step_time`). A fit that cannot be a speed (c <= 0, more
than MAX_PLAUSIBLE_FLOPS, repeats spread more than MAX_SPREAD) is refused (ConfigError) unless
forced, and then written with a warning (`judge_fits`): never silently. `sources` and
`speed_source` say where the figures come from (this machine, or the emulated cluster).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from hetrain.errors import ConfigError

MAX_PLAUSIBLE_FLOPS = 1e16
"""10 PFLOP/s per device, above any accelerator's training throughput: a fit implying more
is timing noise (t(2b) barely above t(b)), not a speed."""
MAX_SPREAD = 0.5
"""Largest relative spread (interquartile range / median) of the repeats at one batch size
that a fit is trusted with."""
BATCH_FACTORS = (0.5, 1.0, 2.0)
"""Batch sizes timed, as multiples of train.batch_size (no larger: 4b may not fit in memory)."""
FIX = "more --steps, a quieter machine, or --force"


@dataclass(frozen=True)
class StepFit:
    """t(b) = overhead_s + per_sample_s * b, least squares over every repeat."""

    overhead_s: float
    per_sample_s: float
    spread: float
    """Largest interquartile range / median of the repeats at one batch size (0: one repeat)."""

    def flops(self, flops_per_sample: float) -> float:
        """The implied FLOP/s (inf if the per-sample cost is not positive)."""
        return flops_per_sample / self.per_sample_s if self.per_sample_s > 0 else float("inf")


def profile_batch_sizes(batch_size: int) -> tuple[int, ...]:
    """The distinct batch sizes timed for `batch_size` (at least 2: b and 2b always differ)."""
    return tuple(sorted({max(1, round(f * batch_size)) for f in BATCH_FACTORS}))


def fit_step_time(batch_sizes: Sequence[int], times: Sequence[Sequence[float]]) -> StepFit:
    """Fit t(b) = a + c b to every repeat (`times[i]` are those at `batch_sizes[i]`).

    All repeats, not their medians, so the spread between repeats weighs on the line as it
    should; the spread itself is reported for `fit_problem` to judge.
    """
    if len(batch_sizes) != len(times) or any(not ts for ts in times):
        raise ValueError("one non-empty list of times per batch size")
    if len(set(batch_sizes)) < 2:
        raise ValueError(f"need at least 2 distinct batch sizes, got {list(batch_sizes)}")
    pts = [(float(b), float(t)) for b, ts in zip(batch_sizes, times, strict=True) for t in ts]
    bm = statistics.fmean(b for b, _ in pts)
    tm = statistics.fmean(t for _, t in pts)
    c = sum((b - bm) * (t - tm) for b, t in pts) / sum((b - bm) ** 2 for b, _ in pts)
    spread = 0.0
    for ts in times:
        if len(ts) > 1:
            q1, med, q3 = statistics.quantiles(ts, n=4, method="inclusive")
            spread = max(spread, (q3 - q1) / med if med > 0 else float("inf"))
    return StepFit(tm - c * bm, c, spread)


def fit_problem(fit: StepFit, flops_per_sample: float) -> str | None:
    """Why `fit` cannot be a device's speed (None: it can)."""
    if fit.per_sample_s <= 0:
        return (f"per-sample cost {fit.per_sample_s:.3g} s is not positive (the step time "
                "does not grow with the batch)")
    if fit.flops(flops_per_sample) > MAX_PLAUSIBLE_FLOPS:
        return (f"implied {fit.flops(flops_per_sample):.3g} FLOP/s is above the "
                f"{MAX_PLAUSIBLE_FLOPS:.3g} of MAX_PLAUSIBLE_FLOPS")
    if fit.spread > MAX_SPREAD:
        return f"repeats spread {fit.spread:.0%} of their median (> {MAX_SPREAD:.0%})"
    return None


def judge_fits(names: Sequence[str], fits: Sequence[StepFit], flops_per_sample: float, *,
               force: bool) -> str | None:
    """Refuse implausible fits in one line (ConfigError) or, forced, return the warning line
    to print (None: every fit is plausible)."""
    problems = [f"{name}: {why}" for name, fit in zip(names, fits, strict=True)
                if (why := fit_problem(fit, flops_per_sample)) is not None]
    if not problems:
        return None
    if not force:
        raise ConfigError(f"profile refused, implausible timing on {'; '.join(problems)}; "
                          f"fix: {FIX}")
    return (f"writing an implausible profile (--force) for {'; '.join(problems)}; a "
            "per-sample cost that is not positive is replaced by the whole step time at "
            "batch b")


def sources(mode: str, time_scale: float, cluster_name: str) -> str:
    """One line saying where the figures come from: this machine or the emulated cluster."""
    if mode == "none":
        return "measured: device speeds and links are this machine's (dist.emulate = none)"
    what = ("the cluster's devices" if mode == "cluster" else
            "this machine's solo step time x dist.contention_k x the cluster's slowdowns")
    return (f"emulated (dist.emulate = {mode}, time_scale {time_scale:g}): device speeds are "
            f"{what} and links those of cluster '{cluster_name}', as the throttle pads them "
            "on real processes; not this machine's hardware")


def speed_source(mode: str, overruns: int, timed: int) -> str:
    """Where one device's speed comes from: a step that overran its emulated budget took this
    machine's time, not the emulated device's."""
    if mode == "none":
        return "measured"
    if overruns >= timed:
        return "measured, not emulated: every step overran the emulated budget"
    if overruns:
        return f"emulated, {overruns} of {timed} steps overran: partly this machine's"
    return "emulated"
