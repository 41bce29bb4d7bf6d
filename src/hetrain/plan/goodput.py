"""Time-to-accuracy planning: which devices, where the PS lives, global batch, local steps, lr.

The quantity to maximise is goodput (Pollux, Qiao et al. OSDI'21): training progress per
second, measured in samples of the base batch B0 (`train.batch_size`, the batch the base lr was
tuned for):

    goodput = throughput(plan) * efficiency(plan)            [B0-equivalent samples / s]
    efficiency = E(G) = (B_noise + B0) / (B_noise + G)        (hetrain.plan.noise)

so time to a target is (samples the base batch needs) / goodput, and the plan with the highest
goodput reaches it first. A plan is (PS site s, global batch G per step, local steps H, the
per-device shares). One round: every active device pulls, runs H steps on its share x_j / H per
step, and pushes; the PS averages the deltas by share. Its time (the cluster model, or times
measured during the run) is

    round(s, G, H) = max_j (a_j + b_j x_j)  +  k * c_member,   sum_j x_j = G H
    a_j = pull + push over the link to site s + H * step_overhead_j,  b_j = compute per sample

with c_member the PS's serial per-device cost (its NIC and per-message time) and k the number
of active devices. For fixed (s, G, H) the shares come from the exact min-makespan allocator
(plan.allocate), which also decides who takes part: a device whose fixed cost alone exceeds
the round gets nothing. With c_member = 0 that subset is the best of all subsets (the allocator
is exact); with c_member > 0 the planner also tries dropping the devices with the smallest
shares, one at a time.

Local steps. H > 1 amortises the round trip but the replicas drift apart between averages.
Modelled between the two bounds: the H steps of a round are worth H steps of batch G (no
drift) or one step of batch G H (as bad as a single large batch); the planner uses
E(G)^(1-p) E(G H)^p with p = `local_step_penalty` (`auto` uses 1, the safe bound: at 0.5 it
once chose H = 32 on hetero-8 and lost accuracy). One active device has no drift: its H steps
are plain sequential SGD. With H > 1 no device gets fewer than
`min_device_batch` samples per step (tiny batches make local updates noisy and unstable).

Learning rate: AdaScale's gain r = (G / B0) E(G) times the base lr, at most `max_lr_scale`; the
planner knows the cap (a step at a capped lr is worth cap B0 / G per sample, not E(G)), so it
does not pick batches past the knee: the lr follows the batch smoothly, never off a cliff.

The search is exhaustive over the PS sites, a geometric grid of G and the H grid: at most
sites x |G| x |H| allocations, O(n log n) each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hetrain.cluster import Cluster
from hetrain.errors import ConfigError
from hetrain.plan.allocate import allocate, water_fill
from hetrain.plan.noise import adascale_gain, statistical_efficiency


@dataclass(frozen=True)
class StatModel:
    """The statistical side of the model: how much a sample is worth at a batch size."""

    noise_scale: float
    """B_noise in samples (measured online; the prior at start-up)."""
    base_batch: int
    """B0: the batch the base learning rate was tuned for (`train.batch_size`)."""
    local_step_penalty: float = 1.0
    """p in E(G)^(1-p) E(G H)^p for H > 1 local steps on several devices."""
    min_device_batch: int = 8
    """With H > 1 on several devices, no device runs a step on fewer samples."""
    max_lr_scale: float = math.inf
    """Cap of the lr gain. A step cannot make more progress than its learning rate allows, so
    a batch whose AdaScale gain r exceeds the cap is worth only cap / (G / B0) per sample."""
    lr_exponent: float = 1.0
    """The lr scale is r^lr_exponent: 1 for SGD (AdaScale), 0.5 for Adam-type optimizers,
    whose step does not grow with the gradient (the square-root rule)."""

    def __post_init__(self) -> None:
        if not (self.noise_scale > 0 and math.isfinite(self.noise_scale)):
            raise ConfigError(f"noise_scale must be a positive number, got {self.noise_scale}")
        if self.base_batch < 1 or self.min_device_batch < 1:
            raise ConfigError("base_batch and min_device_batch must be >= 1")
        if not 0 <= self.local_step_penalty <= 1:
            raise ConfigError(f"local_step_penalty must be in [0, 1], got "
                              f"{self.local_step_penalty}")
        if not self.max_lr_scale > 0:
            raise ConfigError(f"max_lr_scale must be > 0, got {self.max_lr_scale}")
        if not 0 < self.lr_exponent <= 1:
            raise ConfigError(f"lr_exponent must be in (0, 1], got {self.lr_exponent}")

    def efficiency(self, global_batch: int, local_steps: int, n_active: int) -> float:
        gain = adascale_gain(global_batch, self.noise_scale, self.base_batch)
        e = min(gain, self.max_lr_scale ** (1 / self.lr_exponent)) * self.base_batch / global_batch
        if local_steps == 1 or n_active == 1:
            return e
        e_big = statistical_efficiency(global_batch * local_steps, self.noise_scale,
                                       self.base_batch)
        p = self.local_step_penalty
        return e ** (1 - p) * e_big ** p

    def lr_scale(self, global_batch: int) -> float:
        return min(self.max_lr_scale,
                   adascale_gain(global_batch, self.noise_scale, self.base_batch)
                   ** self.lr_exponent)


@dataclass(frozen=True)
class Costs:
    """Per-device times of one round for one PS placement (from the cluster or measured)."""

    ps_site: str
    comm_s: tuple[float, ...]
    """Pull + push of the model between device j and the PS."""
    overhead_s: tuple[float, ...]
    """Fixed cost of one optimizer step on device j."""
    per_sample_s: tuple[float, ...]
    """Compute time per training sample on device j (inf: the device takes no samples)."""
    member_s: float = 0.0
    """The PS's serial cost per active device per round (NIC queueing, message handling)."""

    @property
    def n(self) -> int:
        return len(self.comm_s)


def cluster_costs(cluster: Cluster, ps_site: str, flops_per_sample: float,
                  model_bytes: int) -> Costs:
    """The cluster model's round costs with the PS in `ps_site`."""
    placed = cluster if ps_site == cluster.ps_site else _with_ps(cluster, ps_site)
    comm = tuple(2 * placed.ps_link(j).transfer_time_s(model_bytes) for j in range(cluster.n))
    member = 2 * placed.ps_message_s
    if placed.ps_nic is not None:
        member += 2 * model_bytes / placed.ps_nic.bandwidth_Bps
    return Costs(ps_site, comm, tuple(d.step_overhead_s for d in cluster.devices),
                 tuple(flops_per_sample / d.flops for d in cluster.devices), member)


def _with_ps(cluster: Cluster, site: str) -> Cluster:
    from dataclasses import replace

    if site not in {s.name for s in cluster.sites}:
        raise ConfigError(f"cluster '{cluster.name}': no site '{site}' for the PS")
    return replace(cluster, ps_site=site)


@dataclass(frozen=True)
class GoodputPlan:
    """One candidate plan and what the model predicts for it."""

    ps_site: str
    global_batch: int
    """G: samples per optimizer step summed over the active devices."""
    local_steps: int
    """H: steps between two averages."""
    shares: tuple[int, ...]
    """Samples per round of every device (G H in all; 0: the device sits out)."""
    round_s: float
    samples_per_s: float
    efficiency: float
    """Statistical efficiency: progress per sample relative to the base batch."""
    lr_scale: float
    noise_scale: float
    alternatives: dict[str, float] = field(default_factory=dict, compare=False)
    """Goodput of named reference plans (e.g. the fastest device alone), for explanations."""

    @property
    def goodput(self) -> float:
        """Base-batch-equivalent samples per second (higher reaches the target sooner)."""
        return self.samples_per_s * self.efficiency

    @property
    def active(self) -> tuple[int, ...]:
        return tuple(j for j, x in enumerate(self.shares) if x > 0)

    def batches(self) -> tuple[int, ...]:
        """Per-step batch of every device (0: sits out)."""
        return tuple(x // self.local_steps for x in self.shares)


EXACT_UP_TO = 64
"""Clusters up to this many devices get the exact integer allocator and one-at-a-time drops
(checked against brute force); larger ones the continuous optimum rounded in one vectorised
pass and drops in batches, so 1,000 devices in 20 sites plan in about a second."""


def _rounded(fixed: np.ndarray, per_unit: np.ndarray, x_units: np.ndarray, units: int,
             eligible: np.ndarray) -> tuple[np.ndarray, float]:
    """Whole units from continuous ones in one vectorised pass: the floors, then the remaining
    units, one each, to the eligible devices that would finish their next unit first. Returns
    the units and their makespan."""
    y = np.floor(x_units + 1e-9).astype(np.int64)
    rest = units - int(y.sum())
    if rest > 0:
        nxt = np.where(eligible, fixed + per_unit * (y + 1), np.inf)
        y[np.argpartition(nxt, rest - 1)[:rest]] += 1
    active = y > 0
    return y, float((fixed[active] + per_unit[active] * y[active]).max())


def _shares(fixed: np.ndarray, per_sample: np.ndarray, total: int,
            granularity: int) -> tuple[np.ndarray, float]:
    """Integer shares (multiples of `granularity`) and their makespan."""
    if fixed.size <= EXACT_UP_TO:
        alloc = allocate(fixed, per_sample, total, granularity=granularity)
        return np.asarray(alloc.shares), alloc.makespan_s
    units, per_unit = total // granularity, per_sample * granularity
    _, x = water_fill(fixed, per_unit, np.full(fixed.size, np.inf), units)
    y, makespan = _rounded(fixed, per_unit, x, units, np.isfinite(per_unit))
    return y * granularity, makespan


def _floored_shares(fixed: np.ndarray, per_sample: np.ndarray, total: int, granularity: int,
                    floor: int) -> tuple[np.ndarray, float]:
    """Large clusters, every member at least `floor` samples: at round time T device j can
    take part only if T >= theta_j = a_j + b_j floor, so the most a round of length T absorbs,
    f(T) = sum_{theta_j <= T} (T - a_j) / b_j, is non-decreasing, and the shortest feasible
    round is the first T with f(T) >= S (one sort, cumulative sums). Where f jumps past S the
    shares are shrunk towards the floor; if the floors alone exceed S, the S // floor devices
    of largest capacity take the round."""
    ok = np.isfinite(per_sample)
    theta = np.where(ok, fixed + per_sample * floor, np.inf)
    order = np.argsort(theta, kind="stable")
    inv_b = np.where(ok, 1.0 / np.where(ok, per_sample, 1.0), 0.0)[order]
    a_b = np.where(ok, fixed / np.where(ok, per_sample, 1.0), 0.0)[order]
    slope, offset, th = np.cumsum(inv_b), np.cumsum(a_b), theta[order]
    t_solve = (total + offset) / np.where(slope > 0, slope, np.inf)
    nxt = np.append(th[1:], np.inf)
    fits = np.isfinite(th) & (t_solve < nxt)
    if not fits.any():
        return np.zeros(fixed.size, dtype=np.int64), 0.0
    k = int(np.argmax(fits))
    t_star = max(float(th[k]), float(t_solve[k]))
    members = order[:k + 1]
    x = np.zeros(fixed.size)
    x[members] = (t_star - fixed[members]) / per_sample[members]
    room = x[members].sum() - floor * members.size
    need = total - floor * members.size
    if need < 0:   # too many members for their floors: the largest capacities take the round
        keep = members[np.argsort(-x[members], kind="stable")[:max(1, total // floor)]]
        use = np.full(fixed.size, np.inf)
        use[keep] = per_sample[keep]
        return _shares(fixed, use, total, granularity)
    if room > 0:
        x[members] = floor + (x[members] - floor) * min(1.0, need / room)
    units, makespan = _rounded(fixed, per_sample * granularity, x / granularity,
                               total // granularity, x > 0)
    return units * granularity, makespan


def evaluate(costs: Costs, stat: StatModel, global_batch: int, local_steps: int,
             allowed: np.ndarray | None = None) -> GoodputPlan | None:
    """The best shares for one (PS site, G, H) and their predicted goodput; None if no device
    can take the round (e.g. every device below the per-step batch floor)."""
    n = costs.n
    comm = np.asarray(costs.comm_s)
    fixed = comm + local_steps * np.asarray(costs.overhead_s)
    per_sample = np.asarray(costs.per_sample_s, dtype=float)
    use = np.ones(n, dtype=bool) if allowed is None else allowed.copy()
    use &= np.isfinite(per_sample)
    total = global_batch * local_steps
    if n > EXACT_UP_TO and local_steps > 1:
        shares, makespan = _floored_shares(fixed, np.where(use, per_sample, np.inf), total,
                                           local_steps, stat.min_device_batch * local_steps)
        k = int((shares > 0).sum())
        if k == 0:
            return None
    while n <= EXACT_UP_TO or local_steps == 1:
        if not use.any():
            return None
        shares, makespan = _shares(fixed, np.where(use, per_sample, np.inf), total,
                                   local_steps)
        k = int((shares > 0).sum())
        too_small = (shares > 0) & (shares < stat.min_device_batch * local_steps)
        if local_steps == 1 or k == 1 or not too_small.any():
            break
        # the floor: drop the device with the smallest share and re-allocate without it
        # (large clusters with H > 1 took _floored_shares above and never get here)
        use[int(np.argmin(np.where(too_small, shares, np.iinfo(np.int64).max)))] = False
    round_s = makespan + k * costs.member_s
    eff = stat.efficiency(global_batch, local_steps, k)
    return GoodputPlan(costs.ps_site, global_batch, local_steps, tuple(shares.tolist()),
                       round_s, total / round_s, eff, stat.lr_scale(global_batch),
                       stat.noise_scale)


def best_alone(costs: Costs, stat: StatModel, global_batch: int, local_steps: int) -> GoodputPlan:
    """The best single device for one (PS site, G, H): no drift, so no local-step penalty."""
    comm, over = np.asarray(costs.comm_s), np.asarray(costs.overhead_s)
    per_sample = np.asarray(costs.per_sample_s, dtype=float)
    round_s = comm + local_steps * (over + per_sample * global_batch) + costs.member_s
    j = int(np.argmin(round_s))   # the first of equals: deterministic
    shares = [0] * costs.n
    shares[j] = global_batch * local_steps
    return GoodputPlan(costs.ps_site, global_batch, local_steps, tuple(shares),
                       float(round_s[j]), global_batch * local_steps / float(round_s[j]),
                       stat.efficiency(global_batch, local_steps, 1),
                       stat.lr_scale(global_batch), stat.noise_scale)


def best_for(costs: Costs, stat: StatModel, global_batch: int,
             local_steps: int, prune: bool = True) -> GoodputPlan | None:
    """The best of: the allocator's shares (it picks the subset), the same after dropping the
    smallest shares one at a time while that helps (only when the PS pays per member), and the
    best single device."""
    alone = best_alone(costs, stat, global_batch, local_steps)
    plan = evaluate(costs, stat, global_batch, local_steps)
    if plan is None:
        return alone
    if prune and costs.member_s > 0:
        plan = _prune(costs, stat, plan)
    return alone if alone.goodput > plan.goodput * (1 + 1e-12) else plan


def _prune(costs: Costs, stat: StatModel, plan: GoodputPlan) -> GoodputPlan:
    """Drop the smallest shares while that raises goodput (one at a time; on large clusters
    first the best of the top-k subsets for k shrinking by 20%, then one at a time, 8 at most)."""
    global_batch, local_steps = plan.global_batch, plan.local_steps
    if costs.n > EXACT_UP_TO:
        order = np.argsort(-np.asarray(plan.shares), kind="stable")
        k = len(plan.active)
        while k > 1:
            k = int(k * 0.8)
            allowed = np.zeros(costs.n, dtype=bool)
            allowed[order[:k]] = True
            fewer = evaluate(costs, stat, global_batch, local_steps, allowed)
            if fewer is not None and fewer.goodput > plan.goodput:
                plan = fewer
    for _ in range(costs.n if costs.n <= EXACT_UP_TO else 8):
        fewer = _drop_smallest(costs, stat, plan)
        if fewer is None:
            break
        plan = fewer
    return plan


def _drop_smallest(costs: Costs, stat: StatModel, plan: GoodputPlan) -> GoodputPlan | None:
    """The plan without one of its smallest shares, if that raises goodput; among equal
    smallest shares the first (by device index) that does. Trying only the first of equals
    kept a remote device at 1 sample whose round trip set the round, because dropping the
    local device beside it, at 1 sample too, did not help."""
    shares = np.asarray(plan.shares)
    active = np.flatnonzero(shares > 0)
    if len(active) <= 1:
        return None
    for j in active[shares[active] == shares[active].min()]:
        allowed = shares > 0
        allowed[j] = False
        fewer = evaluate(costs, stat, plan.global_batch, plan.local_steps, allowed)
        if fewer is not None and fewer.goodput > plan.goodput:
            return fewer
    return None


def batch_grid(min_batch: int, max_batch: int) -> tuple[int, ...]:
    """Powers of two and their 1.5 multiples within [min_batch, max_batch]."""
    if min_batch < 1 or max_batch < min_batch:
        raise ConfigError(f"batch grid: need 1 <= min_batch <= max_batch, got {min_batch}, "
                          f"{max_batch}")
    out = {min_batch, max_batch}
    p = 1
    while p <= max_batch:
        out.update(g for g in (p, 3 * p // 2) if min_batch <= g <= max_batch)
        p *= 2
    return tuple(sorted(out))


LOCAL_STEPS = (1, 2, 4, 8, 16, 32)


def search(costs: Sequence[Costs], stat: StatModel, batches: Sequence[int],
           local_steps: Sequence[int] = LOCAL_STEPS,
           max_round_samples: float = math.inf) -> GoodputPlan:
    """The plan of highest predicted goodput over the PS placements, G grid and H grid; a
    round of more than `max_round_samples` samples (G x H) only on one device alone (the
    smallest G with the smallest H on any devices, so there is always a plan).

    Ties go to the earlier placement, the smaller G, then the smaller H (so a plan is the same
    however the devices are listed). On clusters over EXACT_UP_TO devices, every candidate is
    ranked without dropping members for the PS's per-member cost, and only the best few are
    pruned."""
    large = any(c.n > EXACT_UP_TO for c in costs)
    found: list[tuple[GoodputPlan, Costs]] = []
    for c in costs:
        for g in batches:
            for h in local_steps:
                if g * h <= max_round_samples or (g, h) == (min(batches), min(local_steps)):
                    plan = best_for(c, stat, g, h, prune=not large)
                else:   # one device alone: its H steps are plain steps, only fewer messages
                    plan = best_alone(c, stat, g, h)
                if plan is not None:
                    found.append((plan, c))
    if not found:
        raise ConfigError("goodput plan: no device can take a round (check the devices' speeds "
                          "and min_device_batch)")
    if large:
        found.sort(key=lambda pc: -pc[0].goodput)
        found = [(best_for(c, stat, p.global_batch, p.local_steps) or p, c)
                 for p, c in found[:4]]
    best = found[0][0]
    for plan, _ in found[1:]:
        if plan.goodput > best.goodput * (1 + 1e-12):
            best = plan
    return best


def plan_cluster(cluster: Cluster, *, flops_per_sample: float, model_bytes: int,
                 base_batch: int, noise_scale: float, max_batch: int,
                 min_batch: int = 8, local_steps: Sequence[int] = LOCAL_STEPS,
                 local_step_penalty: float = 1.0, min_device_batch: int = 8,
                 max_lr_scale: float = math.inf,
                 sites: Sequence[str] | None = None) -> GoodputPlan:
    """Search every PS site of `cluster` (or `sites`) for the plan of highest goodput, and
    record the goodput of the fastest device alone beside it (for explanations)."""
    stat = StatModel(noise_scale, base_batch, local_step_penalty, min_device_batch,
                     max_lr_scale)
    grid = batch_grid(min(min_batch, max_batch), max_batch)
    costs = [cluster_costs(cluster, s, flops_per_sample, model_bytes)
             for s in (sites or [s.name for s in cluster.sites])]
    plan = search(costs, stat, grid, local_steps)
    lone = lone_goodput(cluster, stat, grid, flops_per_sample)
    return GoodputPlan(**{**plan.__dict__, "alternatives": {"fastest device alone": lone}})


def lone_goodput(cluster: Cluster, stat: StatModel, batches: Sequence[int],
                 flops_per_sample: float) -> float:
    """Best goodput of the fastest device training alone (no communication at all)."""
    dev = max(cluster.devices, key=lambda d: d.flops)
    return max(b / dev.compute_time_s(b, flops_per_sample) * stat.efficiency(b, 1, 1)
               for b in batches)


def explain(plan: GoodputPlan, cluster: Cluster, costs: Costs | None = None,
            min_device_batch: int = 8) -> list[str]:
    """The plan in words: who trains, where the PS runs, and why the others sit out (with
    `costs`, a device is said to sit out for the batch floor when, finishing with the others,
    it would run fewer than `min_device_batch` samples per step)."""
    active = set(plan.active)
    by_site: dict[str, list[int]] = {}
    for j, d in enumerate(cluster.devices):
        by_site.setdefault(d.site, []).append(j)
    lines = [f"global batch {plan.global_batch}, {plan.local_steps} local step(s) per average, "
             f"lr x{plan.lr_scale:.2f} (AdaScale at noise scale {plan.noise_scale:.0f})",
             f"parameter server in site {plan.ps_site}; {len(active)} of {cluster.n} devices "
             f"train; predicted {plan.samples_per_s:.0f} samples/s at statistical efficiency "
             f"{plan.efficiency:.2f} (goodput {plan.goodput:.0f})"]
    placed = _with_ps(cluster, plan.ps_site)

    def floor_bound(j: int) -> bool:
        if costs is None or plan.local_steps == 1 or len(active) < 2:
            return False
        free = plan.round_s - costs.comm_s[j] - plan.local_steps * costs.overhead_s[j]
        return free / costs.per_sample_s[j] / plan.local_steps < min_device_batch

    for site, members in by_site.items():
        out = [j for j in members if j not in active]
        if not out:
            continue
        rtt_ms = 2e3 * placed.ps_link(out[0]).latency_s
        floor = [j for j in out if floor_bound(j)]
        rest = [j for j in out if j not in floor]
        if len(out) == len(members) and not floor:
            lines.append(f"site {site} left out: its {rtt_ms:.0f} ms round trip to the PS costs "
                         f"more than its compute adds at global batch {plan.global_batch}")
            continue
        if floor:
            names = ", ".join(cluster.devices[j].name for j in floor)
            lines.append(f"in site {site}, {names} sit out: finishing with the others they "
                         f"would run fewer than {min_device_batch} samples per local step")
        if rest:
            names = ", ".join(cluster.devices[j].name for j in rest)
            lines.append(f"in site {site}, {names} sit out: paying for their {rtt_ms:.0f} ms "
                         f"round trip and step overhead would make them the slowest")
    for name, goodput in plan.alternatives.items():
        lines.append(f"predicted {plan.goodput / goodput:.2f}x the goodput of the {name}")
    return lines
