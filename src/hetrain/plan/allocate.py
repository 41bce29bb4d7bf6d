"""C-ADP data allocation: each device's share of a round, minimising the round's makespan.

Cost model. A device j given x_j > 0 samples in a round finishes at

    t_j(x_j) = a_j + b_j x_j
    a_j = pull + push of the parameters over its PS link (2 latencies + bytes / bandwidth)
          + steps * step_overhead_s                        (fixed: paid once a device takes part)
    b_j = local_epochs * flops_per_sample / flops_j       (compute)
          + sample_bytes / bandwidth_j   if data is shipped (transfer of the share)

and a device with x_j = 0 takes no part (costs nothing). Problem P: minimise
T = max_{j: x_j > 0} t_j(x_j) subject to sum_j x_j = S, 0 <= x_j <= cap_j (memory or data caps).

Exact continuous solution (water-filling). Let f(T) = sum_j clip((T - a_j) / b_j, 0, cap_j),
the most samples the cluster can absorb by time T. f is continuous, non-decreasing and piecewise
linear with breakpoints a_j (device j starts) and a_j + b_j cap_j (device j is full). Then
T* = min {T : f(T) >= S} is the optimum of P:
  * lower bound: a feasible x with makespan T has x_j <= clip((T - a_j) / b_j, 0, cap_j) for
    every j (trivially when x_j = 0), so S = sum x_j <= f(T), hence T >= T*;
  * attained: x_j = clip((T* - a_j) / b_j, 0, cap_j) sums to f(T*) = S and every device with
    x_j > 0 has t_j(x_j) <= T*. Devices with a_j >= T* get zero: their fixed cost alone would
    exceed the round.
T* is found by bisecting the sorted breakpoints (f evaluated from scratch, so no error builds
up) and solving the linear piece exactly: T* = (S - sum_full cap_j + sum_lin a_j/b_j) /
sum_lin 1/b_j. O(n log n), no iterative tolerance.

Integer rounding (shares in whole units of `granularity` samples, e.g. whole batches). Work in
units: b_j per unit, caps floor(cap_j / g). Take y_j = floor(x*_j), then give the R = U - sum y_j
remaining units one at a time to the device whose t_j(y_j + 1) is smallest (a heap).
Theorem: the result is an optimal integer allocation and T* <= T_int < T* + max_j b_j (at most
one unit of the slowest device over the continuous optimum). Proof. Every value
t_j(k) = a_j + b_j k, 1 <= k <= cap_j, is one "slot"; since t_j grows with k, a min-max
allocation of U units takes the U smallest slots and T_int is the U-th smallest slot value
(any allocation uses U slots including, per device, its first y_j ones). The floors take exactly
the slots of value <= T* (y_j = floor(min(cap_j, (T* - a_j)/b_j)) is the number of such slots of
device j), and there are at most f(T*) = U of them, so they belong to the U smallest; the greedy
then adds the next smallest slots one by one, so it ends with the U smallest: optimal. For the
bound: the devices D with fractional x*_j have t_j(x*_j) = T* (not capped, x*_j > 0), and
their fractional parts sum to R, so |D| > R; at each greedy step some device of D has not yet
had its extra unit, and its next slot costs a_j + b_j (y_j + 1) < T* + b_j, so the chosen slot
is cheaper still. Hence every slot taken is < T* + max_{j in D} b_j.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetrain.cluster import Cluster
from hetrain.errors import ConfigError


@dataclass(frozen=True)
class Allocation:
    """Integer shares of one round and the continuous optimum they were rounded from."""

    shares: tuple[int, ...]
    """Samples per device, multiples of `granularity`, summing to the round's total."""
    makespan_s: float
    """max_j t_j(shares_j) over devices with a non-zero share (0 if none)."""
    continuous_makespan_s: float
    """T*, the exact optimum of the continuous problem (a lower bound on makespan_s)."""
    continuous_shares: tuple[float, ...]
    """x*_j in samples."""
    fixed_s: tuple[float, ...]
    per_sample_s: tuple[float, ...]
    granularity: int = 1

    @property
    def n(self) -> int:
        return len(self.shares)

    @property
    def total(self) -> int:
        return sum(self.shares)

    @property
    def active(self) -> tuple[int, ...]:
        """Devices with a non-zero share."""
        return tuple(j for j, x in enumerate(self.shares) if x > 0)

    def times_s(self) -> tuple[float, ...]:
        """Each device's round time t_j(x_j) (0 for zero-share devices)."""
        return tuple(a + b * x if x > 0 else 0.0
                     for a, b, x in zip(self.fixed_s, self.per_sample_s, self.shares, strict=True))


def _as_array(name: str, values: Sequence[float] | np.ndarray, n: int | None) -> np.ndarray:
    arr = np.asarray(values, dtype=float).reshape(-1)
    if n is not None and arr.size != n:
        raise ConfigError(f"allocate: {name} has {arr.size} entries, expected one per device ({n})")
    if np.isnan(arr).any():
        raise ConfigError(f"allocate: {name} contains NaN")
    return arr


def _check(fixed_s: np.ndarray, per_unit_s: np.ndarray, caps_u: np.ndarray, units: int) -> None:
    if fixed_s.size == 0:
        raise ConfigError("allocate: needs at least one device")
    if (fixed_s < 0).any() or not np.isfinite(fixed_s).all():
        raise ConfigError("allocate: fixed costs must be finite and >= 0 seconds")
    if (per_unit_s <= 0).any():
        raise ConfigError("allocate: per-sample costs must be > 0 seconds (inf marks a device "
                          "that cannot take samples); a free device would absorb any share")
    if units < 0:
        raise ConfigError(f"allocate: samples per round must be >= 0, got {units}")
    usable = np.isfinite(per_unit_s) & (caps_u > 0)
    if units > 0 and not usable.any():
        raise ConfigError("allocate: no device can take samples (every device has zero speed or "
                          "a zero cap); give at least one device speed and memory")
    capacity = float(caps_u[usable].sum())
    if capacity < units:
        raise ConfigError(f"allocate: the devices' caps hold {capacity:g} units but the round "
                          f"needs {units}; lower the samples per round or raise the memory caps")


def water_fill(fixed_s: np.ndarray, per_unit_s: np.ndarray, caps: np.ndarray,
               total: float) -> tuple[float, np.ndarray]:
    """The exact continuous optimum (T*, x*) of problem P (inputs already checked).

    `per_unit_s` may hold inf (the device takes nothing), `caps` may hold inf.
    """
    n = fixed_s.size
    use = np.isfinite(per_unit_s) & (caps > 0)
    if total <= 0:
        return 0.0, np.zeros(n)
    a, b, c = fixed_s[use], per_unit_s[use], caps[use]
    full_at = a + b * c                                     # inf when uncapped

    def absorbed(t: float) -> float:
        return float(np.clip((t - a) / b, 0.0, c).sum())

    points = np.unique(np.concatenate([a, full_at[np.isfinite(full_at)]]))
    lo, hi = 0, points.size                                  # first breakpoint with f >= total
    while lo < hi:
        mid = (lo + hi) // 2
        if absorbed(float(points[mid])) >= total:
            hi = mid
        else:
            lo = mid + 1
    # T* lies in (points[lo-1], points[lo]] (or beyond the last breakpoint when lo == size);
    # on that open piece the sets of linear and full devices are fixed.
    left = float(points[lo - 1]) if lo > 0 else float(points[0])
    right = float(points[lo]) if lo < points.size else math.inf
    probe = left + 1.0 if math.isinf(right) else 0.5 * (left + right)
    full = full_at <= probe
    linear = (a < probe) & ~full
    slope = float((1.0 / b[linear]).sum())
    if slope > 0:
        t_star = (total - float(c[full].sum()) + float((a[linear] / b[linear]).sum())) / slope
        t_star = min(max(t_star, left), right)
    else:  # f is flat here, so f(left) = total up to rounding (e.g. S = sum of all caps)
        t_star = left
    x = np.zeros(n)
    x[use] = np.clip((t_star - a) / b, 0.0, c)
    return t_star, x


def _round(fixed_s: np.ndarray, per_unit_s: np.ndarray, caps_u: np.ndarray, x_units: np.ndarray,
           units: int) -> np.ndarray:
    """Floors of x*, then the remaining units by smallest next-unit finishing time (see above)."""
    y = np.minimum(np.floor(x_units + 1e-9), caps_u).astype(np.int64)
    y[~np.isfinite(per_unit_s)] = 0
    while int(y.sum()) > units:  # only if floating error pushed a floor up
        j = int(np.argmax(np.where(y > 0, fixed_s + per_unit_s * y, -np.inf)))
        y[j] -= 1
    heap = [(float(fixed_s[j] + per_unit_s[j] * (y[j] + 1)), j) for j in range(y.size)
            if np.isfinite(per_unit_s[j]) and y[j] < caps_u[j]]
    heapq.heapify(heap)
    for _ in range(units - int(y.sum())):
        _, j = heapq.heappop(heap)
        y[j] += 1
        if y[j] < caps_u[j]:
            heapq.heappush(heap, (float(fixed_s[j] + per_unit_s[j] * (y[j] + 1)), j))
    return y


def allocate(fixed_s: Sequence[float] | np.ndarray, per_sample_s: Sequence[float] | np.ndarray,
             total_samples: int, caps: Sequence[float] | np.ndarray | None = None,
             granularity: int = 1) -> Allocation:
    """Integer shares (multiples of `granularity`) minimising the makespan of one round.

    fixed_s[j] = a_j, per_sample_s[j] = b_j (inf: the device cannot take samples), caps[j] the
    most samples device j may take (inf: no cap). Raises ConfigError for infeasible inputs.
    """
    a = _as_array("fixed_s", fixed_s, None)
    n = a.size
    b = _as_array("per_sample_s", per_sample_s, n)
    cap = _as_array("caps", caps, n) if caps is not None else np.full(n, np.inf)
    if isinstance(granularity, bool) or not isinstance(granularity, int | np.integer) \
            or granularity < 1:
        raise ConfigError(f"allocate: granularity must be an integer >= 1, got {granularity!r}")
    if isinstance(total_samples, bool) or not float(total_samples).is_integer():
        raise ConfigError(f"allocate: samples per round must be an integer, got {total_samples!r}")
    total = int(total_samples)
    if total % granularity:
        raise ConfigError(f"allocate: samples per round ({total}) must be a multiple of the "
                          f"granularity ({granularity})")
    if (cap < 0).any():
        raise ConfigError("allocate: caps must be >= 0 samples")
    g, units = int(granularity), total // int(granularity)
    bu = b * g
    cu = np.where(np.isfinite(cap), np.floor(cap / g), np.inf)
    _check(a, bu, cu, units)
    t_star, xu = water_fill(a, bu, cu, units)
    y = _round(a, bu, cu, xu, units)
    active = y > 0
    makespan = float((a[active] + bu[active] * y[active]).max()) if active.any() else 0.0
    return Allocation(shares=tuple(int(v) * g for v in y), makespan_s=makespan,
                      continuous_makespan_s=float(t_star),
                      continuous_shares=tuple(float(v) * g for v in xu),
                      fixed_s=tuple(float(v) for v in a), per_sample_s=tuple(float(v) for v in b),
                      granularity=g)


# ---- the cost model of a Cluster --------------------------------------------------------------
@dataclass(frozen=True)
class RoundWork:
    """What one round asks of the devices (the inputs of the cost model above)."""

    samples: int
    """S: samples handed out per round."""
    flops_per_sample: float
    """Forward + backward FLOPs of one training sample."""
    model_bytes: int
    """Bytes of one parameter pull."""
    push_bytes: int | None = None
    """Bytes of one push (a delta; compressed pushes are smaller); default: model_bytes."""
    sample_bytes: int = 0
    """Bytes of one sample when the data owner ships the share."""
    ship_data: bool = True
    """Charge the transfer of the share over the device's PS link."""
    local_epochs: float = 1.0
    """Passes a device makes over its share in a round."""
    steps: int = 1
    """Optimizer steps every active device makes in a round (charged step_overhead_s each)."""
    memory_fixed_bytes: float = 0.0
    """Memory a device needs regardless of its share (parameters, gradients, optimizer state)."""
    memory_per_sample_bytes: float = 0.0
    """Memory per sample of the share (the stored sample, its activations); 0: no memory cap."""

    def __post_init__(self) -> None:
        if self.samples < 0 or self.flops_per_sample <= 0 or self.model_bytes < 0:
            raise ConfigError("RoundWork: samples >= 0, flops_per_sample > 0, model_bytes >= 0")
        if self.local_epochs <= 0 or self.steps < 0:
            raise ConfigError("RoundWork: local_epochs must be > 0 and steps >= 0")


def round_costs(cluster: Cluster, work: RoundWork) -> tuple[list[float], list[float], list[float]]:
    """(a_j, b_j, cap_j) of every device of `cluster` for `work` (formulas in the module doc)."""
    push = work.model_bytes if work.push_bytes is None else work.push_bytes
    fixed, per_sample, caps = [], [], []
    for j, dev in enumerate(cluster.devices):
        link = cluster.ps_link(j)
        fixed.append(link.transfer_time_s(work.model_bytes) + link.transfer_time_s(push)
                     + work.steps * dev.step_overhead_s)
        ship = work.sample_bytes / link.bandwidth_Bps if work.ship_data else 0.0
        per_sample.append(work.local_epochs * work.flops_per_sample / dev.flops + ship)
        if work.memory_per_sample_bytes > 0:
            free = dev.memory_bytes - work.memory_fixed_bytes
            caps.append(max(0.0, math.floor(free / work.memory_per_sample_bytes)))
        else:
            caps.append(math.inf if dev.memory_bytes > work.memory_fixed_bytes else 0.0)
    return fixed, per_sample, caps


def plan_round(cluster: Cluster, work: RoundWork, granularity: int = 1,
               data_caps: Sequence[float] | None = None) -> Allocation:
    """The optimal integer allocation of `work` on `cluster` (data_caps: extra per-device caps)."""
    fixed, per_sample, caps = round_costs(cluster, work)
    if data_caps is not None:
        caps = [min(c, d) for c, d in zip(caps, data_caps, strict=True)]
    return allocate(fixed, per_sample, work.samples, caps, granularity)


def choose_local_steps(comm_s: float, step_s: float, comm_fraction: float,
                       min_steps: int = 1, max_steps: int = 64) -> int:
    """Local steps per synchronisation H so that communication is <= comm_fraction of a round.

    A round is H steps of step_s compute plus comm_s of pull + push; comm_s / (H step_s) <= f
    gives H >= comm_s / (f step_s). Clamped to [min_steps, max_steps]: more steps between syncs
    let the replicas drift apart, so the upper bound protects convergence.
    """
    if not 0 < comm_fraction < 1:
        raise ConfigError(f"comm_fraction must be in (0, 1), got {comm_fraction}")
    if min_steps < 1 or max_steps < min_steps:
        raise ConfigError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
    if step_s <= 0:
        raise ConfigError(f"step time must be > 0 seconds, got {step_s}")
    need = math.ceil(max(0.0, comm_s) / (comm_fraction * step_s) - 1e-9)
    return int(min(max_steps, max(min_steps, need)))


def speed_weighted_local_steps(comm_s: Sequence[float] | np.ndarray,
                               compute_s: Sequence[float] | np.ndarray,
                               step_s: float, comm_fraction: float, min_steps: int = 1,
                               max_steps: int = 64) -> int:
    """H for a round whose shares follow the devices' speeds (every device busy step_s per
    step): `choose_local_steps` on the pull + push times `comm_s` weighted by each device's
    speed 1 / compute_s (seconds per sample), since a faster device carries more of the round.
    C-ADP's auto H (strategies/cadp.py) and `hetrain.plan_batches`' local_steps=0."""
    speed = 1.0 / np.asarray(compute_s)
    comm_w = float((speed * np.asarray(comm_s)).sum() / speed.sum())
    return choose_local_steps(comm_w, step_s, comm_fraction, min_steps, max_steps)
