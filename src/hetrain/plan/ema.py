"""Exponential moving averages of measurements, and the per-worker cost tracker built on them.

One rule everywhere: a new measurement x moves an average v to (1 - w) * v + w * x, computed in
exactly that order (so every fixed-seed figure stays bit-identical to the hand-written
averages these replaced). w in (0, 1] is the weight of the newest measurement: 1 keeps only
it, small weights smooth noisy measurements over about 1 / w of them.

`EMA` is one average. Started from zero it is biased towards zero until enough measurements
came in; `bias_corrected=True` divides by 1 - prod(1 - w_t), the weight the measurements hold
so far (Adam's correction; the noise-scale estimator's averages, plan/noise.py).

`WorkerCosts` is what the strategies that re-plan on measured times keep: per worker, compute
seconds per unit of work (a sample for cadp, a local step for ashl/adsp through
`local_steps.OnlineCosts`) and communication seconds per round (pull + push), started from a
prior (the cluster model or a profile) and moved by what each push measured. Lists of plain
floats, so a checkpoint holds them as plain data.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetrain.errors import ConfigError


def check_weight(weight: float, what: str) -> float:
    """`weight` if it is in (0, 1], else a ConfigError naming `what`."""
    if not 0 < weight <= 1:
        raise ConfigError(f"{what} must be in (0, 1] (the newest measurement's share of a "
                          f"moving average), got {weight}")
    return weight


class EMA:
    """An exponential moving average, optionally bias-corrected (see the module docstring)."""

    def __init__(self, weight: float, value: float = 0.0, bias_corrected: bool = False,
                 what: str = "EMA weight") -> None:
        if bias_corrected and value != 0:
            raise ValueError("a bias-corrected EMA starts from 0 (the correction removes that "
                             f"start), got {value}")
        self.weight = check_weight(weight, what)
        self.mean = value
        """The raw average (the start value's share not removed)."""
        self.decay = 1.0 if bias_corrected else None
        """prod(1 - w_t): what the start value still weighs; None: no bias correction."""
        self.count = 0
        """Measurements folded in."""

    def update(self, x: float, weight: float | None = None) -> float:
        """Fold in `x` with `weight` (default: the average's own); returns the new value."""
        w = self.weight if weight is None else check_weight(weight, "EMA update weight")
        self.mean = (1 - w) * self.mean + w * x
        if self.decay is not None:
            self.decay *= 1 - w
        self.count += 1
        return self.value

    @property
    def value(self) -> float:
        """The average; bias-corrected: mean / (1 - decay), which needs one measurement."""
        if self.decay is None:
            return self.mean
        if self.count == 0:
            raise ValueError("a bias-corrected EMA has no value before its first update")
        return self.mean / (1 - self.decay)


class WorkerCosts:
    """Per worker, compute seconds per unit of work and communication seconds per round:
    priors first, then moving averages of what the pushes measured."""

    def __init__(self, compute_s: Sequence[float], comm_s: Sequence[float], weight: float,
                 what: str = "cost EMA weight") -> None:
        if len(compute_s) != len(comm_s):
            raise ConfigError(f"worker costs: {len(compute_s)} compute times but "
                              f"{len(comm_s)} communication times; give one of each per worker")
        self.weight = check_weight(weight, what)
        self.compute_s = [float(x) for x in compute_s]
        """Seconds of compute per unit of work, per worker."""
        self.comm_s = [float(x) for x in comm_s]
        """Seconds of pull + push per round, per worker."""

    def update(self, worker: int, compute_s: float | None = None, comm_s: float | None = None,
               units: float = 1) -> None:
        """Fold one push of `worker` in: `compute_s` seconds of compute for `units` units of
        work (the average moves by w * compute_s / units, in that order) and `comm_s` seconds
        on the wire. None leaves that average as it is (a push that measured nothing)."""
        w = self.weight
        if compute_s is not None:
            self.compute_s[worker] = float((1 - w) * self.compute_s[worker]
                                           + w * compute_s / units)
        if comm_s is not None:
            self.comm_s[worker] = float((1 - w) * self.comm_s[worker] + w * comm_s)
