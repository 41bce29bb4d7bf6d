"""Uneven per-rank batches in your own torchrun + DistributedDataParallel script.

DDP stays the engine (NCCL on GPUs, gloo on CPUs); this module adds the three things DDP lacks
for uneven devices:

* `HeteroBatchSampler`, a drop-in for `DistributedSampler` (use it as the DataLoader's
  `batch_sampler`): one seeded permutation per epoch, the same on every rank; step s of the
  epoch takes the B = sum(b) samples perm[s*B : (s+1)*B] and rank r the slice
  [s*B + b_0 + ... + b_{r-1}, ... + b_r). Every rank therefore makes the same number of steps,
  N // B per epoch, by construction (no DDP `join` needed). The epoch's tail: with
  drop_last=True (default) the last N mod B (< B) samples of the permutation are skipped (a
  different set every epoch, since the permutation is reseeded with seed + epoch); with
  drop_last=False one more step is filled up with the first samples of the permutation, so
  every sample is seen at least once and (B - N mod B) of them twice.
* `weighted_allreduce_hook`, a DDP communication hook: rank r multiplies its gradient bucket by
  w_r = b_r / B and all-reduces with SUM, so the result is sum_r (b_r / B) g_r, the gradient of
  the mean loss over the union of the ranks' batches (DDP's own hook divides by the world size,
  which over-weights the small batches). It runs on sync steps only, so `no_sync` and gradient
  accumulation work unchanged (divide the loss by the number of micro-batches as usual; every
  micro-batch of a rank has its planned size). The weight is read from the state at every call,
  so it can change between steps.
* `HeteroDDP`, the controller that ties both together and rebalances online: each rank measures
  its compute time per step (from the start of `het.step()` to the moment DDP hands the last
  gradient bucket to the hook, i.e. forward + backward without the wait for the others); every
  K steps the (seconds per sample, produced batches) of the ranks are all-gathered and
  `plan_from_measurements` re-plans the batches with hetrain's exact allocator
  (`hetrain.plan.allocate`, C-ADP's min-makespan split) keeping the global batch the user set.
  Every rank computes the same plan from the same gathered numbers; the sampler uses it for the
  batches it produces from then on and the hook weights each step by the plan of the batch it
  trains on (so DataLoader workers that prefetch are handled).
* `HeteroDDP(..., auto_batch=True, max_global_batch=M)`: the global batch itself follows the
  gradient noise scale, as hetrain's `auto` strategy does. The hook also records each rank's
  |g_r|^2 (before the all-reduce) and |G|^2 (after), summed over buckets; the window's sums
  ride on the same every-K all-gather and feed hetrain.plan.noise's estimator with the
  uneven-batch weighting of `ddp_noise_probe`. `choose_global_batch` then picks, by goodput
  (plan.goodput's efficiency model x the allocator's throughput at the measured speeds and
  step overhead), a batch between `min_global_batch` (default: global_batch) and M, changing
  it only at a rebalance, at most 2x at a time, and only when the same batch wins by over
  10% at two rebalances in a row. The lr follows from the first step on the new batch:
  `attach(model, optimizer=opt)` multiplies the param groups' lr by AdaScale's gain relative
  to global_batch (its square root for non-SGD optimizers), at most `max_lr_scale` = 2.

The diff to an existing script (see examples/06_ddp_uneven.py and the README):

    het = HeteroDDP(global_batch=256, seed=0, rebalance_every=50)   # after init_process_group
    sampler = het.batch_sampler(train_set)              # was DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_sampler=sampler)  # was batch_size=256 // world
    model = DDP(model); het.attach(model)               # registers the weighted comm hook
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            with het.step():                            # times the step, rebalances every K
                loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

Mismatched configuration across ranks (global batch, seed, rebalance period, data set size,
...) raises `ConfigError` on every rank at setup, naming the field and each rank's value.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from hetrain.errors import ConfigError
from hetrain.plan.goodput import StatModel, batch_grid
from hetrain.plan.noise import GradientNoiseScale, GradProbe

__all__ = ["HeteroBatchSampler", "HeteroDDP", "WeightState", "auto_stat_model",
           "choose_global_batch", "ddp_noise_probe", "even_split", "plan_from_measurements",
           "predict_goodput", "weighted_allreduce_hook"]


def even_split(global_batch: int, world_size: int) -> tuple[int, ...]:
    """global_batch split as evenly as possible (the first ranks get the remainder)."""
    return tuple(global_batch // world_size + (r < global_batch % world_size)
                 for r in range(world_size))


def _check_sizes(sizes: Sequence[int], world_size: int | None = None) -> tuple[int, ...]:
    out = tuple(int(b) for b in sizes)
    if not out or any(isinstance(b, bool) or int(b) != b or b < 1 for b in sizes):
        raise ConfigError(f"batch sizes must be integers >= 1 (one per rank), got {list(sizes)}")
    if world_size is not None and len(out) != world_size:
        raise ConfigError(f"{len(out)} batch sizes for {world_size} ranks: {list(out)}")
    return out


# ---- sampler ------------------------------------------------------------------------------
class HeteroBatchSampler(Sampler[list[int]]):
    """Per-rank batches of planned, uneven sizes; every sample of an epoch once across ranks.

    dataset: the data set (or its length). batch_sizes: every rank's batch (the same list on
    every rank; sum = the global batch). rank: this process's rank (default: dist's rank).
    The batch sizes may change between batches (`set_batch_sizes`); the global batch only when
    asked (`resize=True`, HeteroDDP's auto_batch): an epoch then ends where the next global
    batch no longer fits, the same step on every rank since every rank follows the same
    schedule, and len(sampler) is the step count at the latest plan's global batch.
    """

    def __init__(self, dataset: Any, batch_sizes: Sequence[int], rank: int | None = None, *,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = True) -> None:
        self.n = dataset if isinstance(dataset, int) else len(dataset)
        sizes = _check_sizes(batch_sizes)
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not 0 <= rank < len(sizes):
            raise ConfigError(f"rank {rank} out of range for {len(sizes)} batch sizes")
        if self.n < sum(sizes):
            raise ConfigError(f"data set of {self.n} samples is smaller than one global batch "
                              f"({sum(sizes)})")
        self.rank, self.seed, self.shuffle, self.drop_last = rank, int(seed), shuffle, drop_last
        self.epoch = 0
        self._schedule: list[tuple[int, tuple[int, ...]]] = [(0, sizes)]
        self.produced = 0
        """Batches produced so far (all epochs): the index of the next batch."""
        self.pending: deque[tuple[int, ...]] = deque()
        """Plans (every rank's sizes) of the batches produced but not yet trained on."""

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The plan of the latest scheduled change (what the next new batches will use)."""
        return self._schedule[-1][1]

    @property
    def global_batch(self) -> int:
        """The latest plan's global batch."""
        return sum(self.batch_sizes)

    def sizes_for(self, index: int) -> tuple[int, ...]:
        """The plan in force for the batch with global index `index`."""
        for start, sizes in reversed(self._schedule):
            if index >= start:
                return sizes
        return self._schedule[0][1]

    def set_batch_sizes(self, sizes: Sequence[int], from_batch: int | None = None, *,
                        resize: bool = False) -> None:
        """Use `sizes` for batches with global index >= from_batch (default: the next one).
        resize: the global batch may change too (else a different sum is an error)."""
        sizes = _check_sizes(sizes, len(self.batch_sizes))
        if not resize and sum(sizes) != self.global_batch:
            raise ConfigError(f"new batch sizes {list(sizes)} sum to {sum(sizes)}, not the global "
                              f"batch {self.global_batch}")
        if sum(sizes) > self.n:
            raise ConfigError(f"new batch sizes {list(sizes)} sum to {sum(sizes)}, more than the "
                              f"data set's {self.n} samples")
        start = max(self.produced if from_batch is None else int(from_batch), self.produced)
        self._schedule = [(s, b) for s, b in self._schedule if s < start] + [(start, sizes)]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        if self.drop_last:
            return self.n // self.global_batch
        return -(-self.n // self.global_batch)

    def permutation(self) -> torch.Tensor:
        """The epoch's order of the samples (identical on every rank for a seed and epoch)."""
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g)

    def __iter__(self) -> Iterator[list[int]]:
        perm = self.permutation()
        self.pending.clear()  # batches of an abandoned iteration are never trained on
        start = 0             # where the next global batch begins in the permutation
        while True:
            sizes = self.sizes_for(self.produced)  # read per batch: the plan may change
            B = sum(sizes)
            if start >= self.n or (self.drop_last and start + B > self.n):
                return
            lo = start + sum(sizes[: self.rank])
            hi = lo + sizes[self.rank]
            self.pending.append(sizes)
            self.produced += 1
            start += B
            if hi <= self.n:
                yield perm[lo:hi].tolist()
            else:  # drop_last=False: the last step is filled from the start of the permutation
                yield perm[torch.arange(lo, hi) % self.n].tolist()


# ---- gradient weighting -------------------------------------------------------------------
@dataclass
class WeightState:
    """State of `weighted_allreduce_hook`: this rank's weight b_r / B, changeable any time."""

    weight: float
    group: Any = None
    """Process group (None: the default group)."""
    on_last_bucket: Any = None
    """Optional callable run when the hook receives the step's last bucket (timing)."""
    calls: int = 0
    measure_noise: bool = False
    """Also record every bucket's squared norm before (this rank's gradient g_r) and after
    the all-reduce (the global gradient G): the gradient noise scale's two batch sizes."""
    local_sqnorms: list[torch.Tensor] = field(default_factory=list)
    global_sqnorms: list[torch.Tensor] = field(default_factory=list)
    """Per bucket, since the last `clear_norms` (lists: the all-reduce callbacks may run on
    gloo's threads, and list.append is atomic where `+=` on a float is not)."""

    def clear_norms(self) -> None:
        self.local_sqnorms, self.global_sqnorms = [], []


def _sqnorm(t: torch.Tensor) -> torch.Tensor:
    """|t|^2 as a float64 0-d tensor on t's device (no host sync)."""
    return torch.linalg.vector_norm(t, dtype=torch.float32).double().square()


def weighted_allreduce_hook(state: WeightState,
                            bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: bucket *= state.weight, then all-reduce SUM (sum_r w_r g_r)."""
    state.calls += 1
    if bucket.is_last() and state.on_last_bucket is not None:
        state.on_last_bucket()
    buf = bucket.buffer()
    measure = state.measure_noise
    if measure:
        state.local_sqnorms.append(_sqnorm(buf))
    buf.mul_(state.weight)
    fut = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=state.group,
                          async_op=True).get_future()

    def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = f.value()[0]
        if measure:
            state.global_sqnorms.append(_sqnorm(out))
        return out

    return fut.then(done)


# DDP checks the hook's annotations as objects (this module uses postponed annotations)
weighted_allreduce_hook.__annotations__.update(
    state=WeightState, bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]})


# ---- rebalancing --------------------------------------------------------------------------
def plan_from_measurements(seconds_per_sample: Sequence[float], global_batch: int,
                           current: Sequence[int] | None = None, min_gain: float = 0.05,
                           min_batch: int = 1) -> tuple[int, ...]:
    """Every rank's batch for the measured per-sample compute times (pure; identical inputs give
    identical plans on every rank).

    Cost model t_r(b) = c_r b (the measured forward + backward seconds per sample of rank r):
    hetrain.plan.allocate's exact min-makespan integer split of `global_batch`, each rank
    guaranteed `min_batch` samples (pre-assigned: fixed cost c_r min_batch, the rest
    allocated). If `current` is given and its predicted step time is within `min_gain` of the
    new plan's, `current` is kept (no churn from noise).
    """
    from hetrain.plan.allocate import allocate

    c = [float(x) for x in seconds_per_sample]
    n = len(c)
    if n == 0 or any(not math.isfinite(x) or x <= 0 for x in c):
        raise ConfigError(f"seconds per sample must be finite and > 0, got {c}")
    if global_batch < n * min_batch:
        raise ConfigError(f"global batch {global_batch} < {n} ranks x min batch {min_batch}")
    alloc = allocate([x * min_batch for x in c], c, global_batch - n * min_batch)
    new = tuple(s + min_batch for s in alloc.shares)
    if current is not None:
        cur = tuple(int(b) for b in current)
        t_cur = max(x * b for x, b in zip(c, cur, strict=True))
        t_new = max(x * b for x, b in zip(c, new, strict=True))
        if sum(cur) == global_batch and t_cur <= (1.0 + min_gain) * t_new:
            return cur
    return new


# ---- auto batch: gradient noise scale and goodput -------------------------------------------
def ddp_noise_probe(local_sqnorms: Sequence[float], local_inv_batches: Sequence[float],
                    steps: Sequence[int], global_sqnorm: float, global_inv_batch: float,
                    global_steps: int) -> GradProbe:
    """One two-batch-size probe (hetrain.plan.noise) from a window of DDP steps with uneven
    per-rank batches.

    Rank r's local gradient g_r is the mean of b_r per-sample gradients; the all-reduced one
    is G^ = sum_r (b_r / B) g_r over disjoint samples. With S = tr(Sigma) and G the true
    gradient, E|g_r|^2 = |G|^2 + S / b_r and E|G^|^2 = |G|^2 + S sum_r (b_r/B)^2 / b_r =
    |G|^2 + S / B. Averaging the ranks' |g_r|^2 over the window's (rank, step) pairs gives
    E = |G|^2 + S mean(1 / b_r): one "small batch" whose size is the HARMONIC mean of the
    b_r, not their arithmetic mean B / world (the equal-split assumption, which with uneven
    b_r biases tr(Sigma) and |G|^2, e.g. over 2x for b = 4, 10, 30). Likewise the big batch
    is the harmonic mean of B over the window's steps (B changes only with auto_batch).
    Both means are unbiased for the window's mean |G|^2 and S, so GradProbe's estimator
    (McCandlish et al. 2018, App. A) applies unchanged.

    Per rank: local_sqnorms = sum over its steps of |g_r|^2, local_inv_batches = sum of
    1 / b_r, steps = how many; global_*: the same sums of |G^|^2 and 1 / B (one rank's: the
    all-reduced gradient is the same everywhere) over global_steps steps.
    """
    n = sum(steps)
    inv_small = sum(local_inv_batches)
    if n < 1 or global_steps < 1 or inv_small <= 0 or global_inv_batch <= 0:
        raise ConfigError("ddp_noise_probe: needs at least one step with batches >= 1")
    return GradProbe(small_sqnorm=sum(local_sqnorms) / n, small_batch=n / inv_small,
                     big_sqnorm=global_sqnorm / global_steps,
                     big_batch=global_steps / global_inv_batch)


def predict_goodput(global_batch: int, seconds_per_sample: Sequence[float], stat: StatModel, *,
                    overhead_s: float = 0.0, micro_batches: int = 1,
                    min_batch: int = 1) -> float:
    """Predicted training progress per second at `global_batch` (Pollux's goodput, in samples
    of stat.base_batch): throughput x statistical efficiency.

    Step time = overhead_s (the measured per-step time beyond the slowest rank's compute:
    all-reduce, optimizer, Python) + micro_batches x the makespan of the allocator's split of
    `global_batch` at the measured per-sample compute times. The overhead is what makes a
    bigger batch pay: without it throughput is flat in G and efficiency only falls.
    """
    sizes = plan_from_measurements(seconds_per_sample, global_batch, min_batch=min_batch)
    compute_s = max(float(c) * b for c, b in zip(seconds_per_sample, sizes, strict=True))
    samples = micro_batches * global_batch
    step_s = overhead_s + micro_batches * compute_s
    return samples / step_s * stat.efficiency(samples, 1, len(sizes))


def auto_stat_model(noise_scale: float, base_batch: int, max_lr_scale: float = 2.0,
                    lr_exponent: float = 1.0) -> StatModel:
    """hetrain's statistical model (plan.goodput.StatModel, as the `auto` strategy uses it):
    efficiency E(G) = (B_noise + B0) / (B_noise + G), lr scale = AdaScale's gain
    r = (G / B0) E(G) (its square root for Adam-type optimizers: lr_exponent 0.5), capped at
    max_lr_scale; a step whose gain is capped is priced at cap B0 / G per sample."""
    return StatModel(noise_scale, base_batch, max_lr_scale=max_lr_scale,
                     lr_exponent=lr_exponent)


def choose_global_batch(noise_scale: float, seconds_per_sample: Sequence[float], current: int,
                        candidates: Sequence[int], base_batch: int, *,
                        overhead_s: float = 0.0, micro_batches: int = 1,
                        hysteresis: float = 0.1, max_growth: float = 2.0,
                        max_lr_scale: float = 2.0, lr_exponent: float = 1.0,
                        min_batch: int = 1) -> int:
    """The global batch of highest predicted goodput (pure: the same inputs give the same
    batch on every rank).

    Candidates within a factor max_growth of `current` (ramp the batch, as AdaScale and
    `auto` do: momentum built at one batch meets the next) and >= ranks x min_batch are
    searched exhaustively, ties to the smaller batch. `current` is kept unless the best one's
    goodput beats current's, at the same noise scale, by more than `hysteresis` (no flapping
    on a noisy estimate). base_batch: the batch the lr was tuned for (per micro-batch, like
    the candidates; the optimizer step sees micro_batches x it).

    Without an lr cap the choice never falls as the noise scale N grows (log goodput has
    increasing differences in (G, N)). With a cap c it can: the batch whose gain reaches c,
    c B0 N / (N - (c - 1) B0), falls towards c B0 as N grows, and past it a step's progress
    no longer grows with the batch.
    """
    stat = auto_stat_model(noise_scale, base_batch * micro_batches, max_lr_scale, lr_exponent)

    def goodput(g: int) -> float:
        return predict_goodput(g, seconds_per_sample, stat, overhead_s=overhead_s,
                               micro_batches=micro_batches, min_batch=min_batch)

    floor = len(seconds_per_sample) * min_batch
    pool = sorted({int(g) for g in candidates
                   if floor <= g and current / max_growth <= g <= current * max_growth})
    if not pool:
        return current
    scores = [goodput(g) for g in pool]
    best = pool[0]
    top = scores[0]
    for g, v in zip(pool[1:], scores[1:], strict=True):
        if v > top * (1 + 1e-12):
            best, top = g, v
    if best != current and top > goodput(current) * (1 + hysteresis):
        return best
    return current


@dataclass
class _Window:
    """What this rank measured since the last rebalance (one entry per optimizer step)."""

    per_sample: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    """Forward + backward (to the last bucket), all micro-batches."""
    step_s: list[float] = field(default_factory=list)
    """The whole `het.step()` block: compute, the wait for the all-reduce, the optimizer."""
    local_sqnorms: list[torch.Tensor] = field(default_factory=list)
    global_sqnorms: list[torch.Tensor] = field(default_factory=list)
    inv_local: float = 0.0
    """Sum over the noise steps of 1 / (this rank's samples in the step)."""
    inv_global: float = 0.0
    """Sum over the noise steps of 1 / (the global samples in the step)."""

    def row(self, produced: int) -> list[float]:
        """The numbers every rank shares at a rebalance (see HeteroDDP._gather)."""
        return [_median(self.per_sample), float(produced), _median(self.compute_s),
                _median(self.step_s), _total(self.local_sqnorms), self.inv_local,
                float(len(self.local_sqnorms)), _total(self.global_sqnorms), self.inv_global]


def _median(xs: Sequence[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def _total(ts: Sequence[torch.Tensor]) -> float:
    return float(torch.stack(list(ts)).sum().item()) if ts else 0.0


_LR_RULES = {"auto": 1.0, "adascale": 1.0, "sqrt": 0.5}


class HeteroDDP:
    """Per-rank batch plan, weighted gradient hook and online rebalancing for one DDP job.

    Call after `dist.init_process_group`. global_batch: samples per step over all ranks (kept
    fixed unless auto_batch). batch_sizes: an initial plan (e.g.
    `hetrain.plan_batches(...).batch_sizes`; default: an even split, which the first rebalance
    corrects). rebalance_every: K, steps between re-plans (0: never); the first re-plan comes
    after `first_rebalance` steps (default min(5, K): the median of a few steps is enough to
    leave an even split early, which matters most to short runs). min_gain: re-plan only when
    the predicted step time improves by more than this fraction. check: extra values that must
    agree on every rank (e.g. the data set's length), compared at setup with the others.

    auto_batch=True: the global batch follows the gradient noise scale, as hetrain's `auto`
    strategy does. The comm hook records |g_r|^2 before and |G|^2 after the all-reduce; at
    every rebalance the window's sums ride on the timing all-gather and feed
    hetrain.plan.noise's estimator (`ddp_noise_probe` for the uneven-batch weighting,
    `noise_ema_weight` per step). The batch is then chosen by goodput (`choose_global_batch`)
    over hetrain's batch grid from `min_global_batch` (default: global_batch) to
    `max_global_batch` (required: memory is the caller's to bound), at most `max_batch_growth`
    times per change; it changes only when the gain beats `batch_hysteresis` at two
    rebalances in a row. The learning rate follows (`attach(model, optimizer)` applies it):
    AdaScale's gain at the new batch relative to global_batch, its square root for non-SGD
    optimizers (`lr_rule`), at most `max_lr_scale`, which the choice prices, so the default
    2 keeps the batch near where the gain reaches 2 (raise it to let the batch grow further).
    """

    def __init__(self, global_batch: int, *, seed: int = 0, rebalance_every: int = 50,
                 batch_sizes: Sequence[int] | None = None, min_gain: float = 0.05,
                 min_batch: int = 1, group: Any = None, check: dict[str, Any] | None = None,
                 first_rebalance: int | None = None, auto_batch: bool = False,
                 max_global_batch: int | None = None, min_global_batch: int | None = None,
                 batch_hysteresis: float = 0.1, max_batch_growth: float = 2.0,
                 max_lr_scale: float = 2.0, lr_rule: str = "auto",
                 noise_ema_weight: float = 0.01) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("HeteroDDP needs torch.distributed initialised "
                              "(dist.init_process_group) first")
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) \
                or global_batch < 1:
            raise ConfigError(f"global_batch must be an integer >= 1, got {global_batch!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_batch, self.seed = global_batch, int(seed)
        self.base_batch = global_batch
        """The batch the user's lr was tuned for (auto_batch scales the lr from it)."""
        self.rebalance_every, self.min_gain, self.min_batch = int(rebalance_every), min_gain, \
            int(min_batch)
        self.first_rebalance = min(5, self.rebalance_every) if first_rebalance is None \
            else int(first_rebalance)
        sizes = even_split(global_batch, self.world_size) if batch_sizes is None \
            else _check_sizes(batch_sizes, self.world_size)
        self.auto_batch = bool(auto_batch)
        self.min_global_batch = global_batch if min_global_batch is None else min_global_batch
        self.max_global_batch = max_global_batch
        self.batch_hysteresis, self.max_batch_growth = batch_hysteresis, max_batch_growth
        self.max_lr_scale, self.lr_rule = max_lr_scale, lr_rule
        self.noise_ema_weight = noise_ema_weight
        self.check_config({"global_batch": global_batch, "seed": self.seed,
                           "rebalance_every": self.rebalance_every, "min_gain": min_gain,
                           "first_rebalance": self.first_rebalance,
                           "min_batch": self.min_batch, "batch_sizes": list(sizes),
                           "auto_batch": self.auto_batch,
                           "min_global_batch": self.min_global_batch,
                           "max_global_batch": max_global_batch,
                           "batch_hysteresis": batch_hysteresis,
                           "max_batch_growth": max_batch_growth, "max_lr_scale": max_lr_scale,
                           "lr_rule": lr_rule, "noise_ema_weight": noise_ema_weight,
                           **(check or {})})
        if sum(sizes) != global_batch:
            raise ConfigError(f"batch_sizes {list(sizes)} sum to {sum(sizes)}, not the "
                              f"global_batch {global_batch}")
        if min(sizes) < self.min_batch or global_batch < self.world_size * self.min_batch:
            raise ConfigError(f"every rank needs >= {self.min_batch} samples per step: "
                              f"batch_sizes {list(sizes)}, global_batch {global_batch}")
        self._check_auto_options()
        self.sizes = sizes
        self.hook_state = WeightState(weight=sizes[self.rank] / global_batch, group=group,
                                      on_last_bucket=self._mark_compute_done,
                                      measure_noise=self.auto_batch)
        self.sampler: HeteroBatchSampler | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.steps = 0
        self.history: list[dict[str, Any]] = []
        """One record per rebalance: step, gathered seconds per sample, old and new plan (and
        with auto_batch: the noise scale, the step overhead, the global batch, the lr scale)."""
        self.noise = GradientNoiseScale(noise_ema_weight)
        """The online noise-scale estimate (fed only with auto_batch)."""
        self.noise_scale: float | None = None
        """The estimate the last batch decision used (kept while the estimate dips to none)."""
        self.lr_scale = 1.0
        """The lr factor in force (relative to the lr at attach); applied to the attached
        optimizer's param groups, or for the caller to apply without one."""
        self._lr_exponent = _LR_RULES.get(lr_rule, 1.0)
        self._lr_for_batch: dict[int, float] = {global_batch: 1.0}
        self._candidate: int | None = None   # a better batch seen at one rebalance
        self._grid = batch_grid(self.min_global_batch, max_global_batch) \
            if self.auto_batch and max_global_batch is not None else ()
        self._window = _Window()
        self._micro = 1
        self._t0: float | None = None
        self._t_done: float | None = None

    def _check_auto_options(self) -> None:
        lo, hi = self.min_global_batch, self.max_global_batch
        if not self.auto_batch:
            if hi is not None or lo != self.global_batch:
                raise ConfigError("min_global_batch / max_global_batch need auto_batch=True")
            return

        def bad(msg: str) -> ConfigError:
            return ConfigError(f"hetrain.ddp auto_batch: {msg}")

        if hi is None:
            raise bad("give max_global_batch (the largest global batch that fits in memory "
                      "at the planned per-rank split)")
        if not (isinstance(lo, int) and isinstance(hi, int)
                and self.world_size * self.min_batch <= lo <= self.global_batch <= hi):
            raise bad(f"need ranks x min_batch <= min_global_batch <= global_batch <= "
                      f"max_global_batch, got {self.world_size} x {self.min_batch}, {lo}, "
                      f"{self.global_batch}, {hi}")
        if self.rebalance_every < 1:
            raise bad("the batch changes at rebalance points: rebalance_every must be >= 1")
        if self.lr_rule not in _LR_RULES:
            raise bad(f"lr_rule = {self.lr_rule!r}; choose one of: {', '.join(_LR_RULES)}")
        if not (self.batch_hysteresis >= 0 and self.max_batch_growth > 1
                and self.max_lr_scale > 0 and 0 < self.noise_ema_weight <= 1):
            raise bad("need batch_hysteresis >= 0, max_batch_growth > 1, max_lr_scale > 0 "
                      "and noise_ema_weight in (0, 1]")

    # -- setup --
    def check_config(self, values: dict[str, Any]) -> None:
        """All-gather `values` and raise ConfigError (on every rank) if any field differs.
        They travel as JSON (non-JSON values as their repr): nothing a peer sends is
        unpickled."""
        gathered = [json.loads(b) for b in self._all_gather_bytes(
            json.dumps(values, sort_keys=True, default=repr).encode())]
        for key in values:
            seen = [g.get(key, "<missing>") if isinstance(g, dict) else "<missing>"
                    for g in gathered]
            if any(v != seen[0] for v in seen):
                raise ConfigError(f"hetrain.ddp: '{key}' differs across ranks: "
                                  + ", ".join(f"rank {r}={v!r}" for r, v in enumerate(seen)))

    def _collective_device(self) -> torch.device:
        """NCCL reduces only GPU tensors: the small all-gathers go where the group can."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's bytes (lengths first, then the padded payloads)."""
        device = self._collective_device()
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        longest = int(max(int(x) for x in sizes))
        mine = torch.zeros(longest, dtype=torch.uint8, device=device)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return [bytes(t[:int(n)].cpu().tolist()) for t, n in zip(out, sizes, strict=True)]

    def batch_sampler(self, dataset: Any, *, shuffle: bool = True,
                      drop_last: bool = True) -> HeteroBatchSampler:
        """The rank's `HeteroBatchSampler` (pass it as the DataLoader's batch_sampler)."""
        n = dataset if isinstance(dataset, int) else len(dataset)
        self.check_config({"dataset_len": n, "shuffle": shuffle, "drop_last": drop_last})
        if self.auto_batch and self.max_global_batch is not None and self.max_global_batch > n:
            raise ConfigError(f"hetrain.ddp auto_batch: max_global_batch "
                              f"{self.max_global_batch} exceeds the data set's {n} samples")
        self.sampler = HeteroBatchSampler(n, self.sizes, self.rank, seed=self.seed,
                                          shuffle=shuffle, drop_last=drop_last)
        return self.sampler

    def attach(self, ddp_model: torch.nn.parallel.DistributedDataParallel,
               optimizer: torch.optim.Optimizer | None = None) -> None:
        """Register the weighted all-reduce hook on the DDP model. With auto_batch, an
        `optimizer` gets its param groups' lr multiplied by new_scale / old_scale whenever the
        trained batch changes (a ratio, so a chainable lr scheduler's changes are kept; one
        that sets lr from its own base, e.g. LambdaLR, would overwrite it: multiply by
        `het.lr_scale` there instead). lr_rule 'auto': AdaScale's gain for torch.optim.SGD,
        its square root for any other optimizer (Adam-type; without an optimizer: the gain)."""
        ddp_model.register_comm_hook(self.hook_state, weighted_allreduce_hook)
        if optimizer is not None:
            self.follow_lr(optimizer)

    def follow_lr(self, optimizer: torch.optim.Optimizer) -> None:
        """The lr part of `attach`, for a script that registers the hook itself (e.g. wrapped
        in its own hook): auto_batch scales this optimizer's lr."""
        self.optimizer = optimizer
        if self.lr_rule == "auto":
            self._lr_exponent = 1.0 if isinstance(optimizer, torch.optim.SGD) else 0.5

    @property
    def batch_size(self) -> int:
        """This rank's batch in the current plan."""
        return self.sizes[self.rank]

    # -- per step --
    def _mark_compute_done(self) -> None:
        self._t_done = time.perf_counter()

    def step(self, micro_batches: int = 1) -> _Step:
        """Context manager around one optimizer step (all of its `micro_batches` batches)."""
        return _Step(self, micro_batches)

    def _begin(self, micro_batches: int) -> None:
        sizes = self.sizes
        if self.sampler is not None:
            for _ in range(micro_batches):
                if self.sampler.pending:
                    sizes = self.sampler.pending.popleft()
        self._step_sizes = sizes
        self._micro = micro_batches
        self.hook_state.weight = sizes[self.rank] / sum(sizes)
        if self.auto_batch:
            self.hook_state.clear_norms()
            self._set_lr_scale(self._lr_for_batch.get(sum(sizes), self.lr_scale))
        self._t_done = None
        self._t0 = time.perf_counter()

    def _set_lr_scale(self, scale: float) -> None:
        """Move the attached optimizer's lr from the scale in force to `scale`."""
        if scale == self.lr_scale:
            return
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] *= scale / self.lr_scale
        self.lr_scale = scale

    def _end(self, micro_batches: int) -> None:
        t_end = time.perf_counter()
        assert self._t0 is not None
        elapsed = (self._t_done if self._t_done is not None else t_end) - self._t0
        mine = micro_batches * self._step_sizes[self.rank]
        self._window.per_sample.append(elapsed / mine)
        if self.auto_batch:
            self._record_auto(elapsed, t_end - self._t0, mine,
                              micro_batches * sum(self._step_sizes))
        self.steps += 1
        if (self.rebalance_every and self.steps % self.rebalance_every == 0) \
                or self.steps == self.first_rebalance:
            self.rebalance()

    def _record_auto(self, compute_s: float, step_s: float, mine: int, total: int) -> None:
        """The step's times and, if the hook saw its gradients, their squared norms."""
        w, h = self._window, self.hook_state
        w.compute_s.append(compute_s)
        w.step_s.append(step_s)
        local, glob = list(h.local_sqnorms), list(h.global_sqnorms)
        if local and len(local) == len(glob):   # a sync step: every bucket both ways
            w.local_sqnorms.append(torch.stack(local).sum())
            w.global_sqnorms.append(torch.stack(glob).sum())
            w.inv_local += 1.0 / mine
            w.inv_global += 1.0 / total
        h.clear_norms()

    # -- rebalancing --
    def _gather(self) -> torch.Tensor:
        """Every rank's window row (world x 9: median seconds per sample, batches produced,
        median compute and step seconds, the noise sums), then a fresh window."""
        produced = self.sampler.produced if self.sampler is not None else self.steps
        local = torch.tensor(self._window.row(produced), dtype=torch.float64,
                             device=self._collective_device())
        out = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(out, local, group=self.group)
        self._window = _Window()
        return torch.stack(out).cpu()

    def rebalance(self) -> tuple[int, ...]:
        """All-gather the window's median seconds per sample and re-plan (a collective: every
        rank calls it at the same step); with auto_batch, also update the noise scale and
        choose the global batch. Returns the plan in force from the next batch."""
        rows = self._gather()
        per_sample = [float(x) for x in rows[:, 0]]
        from_batch = int(rows[:, 1].max())
        old, old_global = self.sizes, self.global_batch
        record: dict[str, Any] = {"step": self.steps, "seconds_per_sample": per_sample,
                                  "old": list(old)}
        valid = all(math.isfinite(x) and x > 0 for x in per_sample)
        if self.auto_batch:
            self._observe_noise(rows, record)
            if valid:
                self._decide_batch(per_sample, rows, record)
        if valid:
            keep = old if self.global_batch == old_global else None
            self.sizes = plan_from_measurements(per_sample, self.global_batch, keep,
                                                self.min_gain, self.min_batch)
        record["new"] = list(self.sizes)
        self.history.append(record)
        if self.sizes != old:
            if self.sampler is not None:
                self.sampler.set_batch_sizes(self.sizes, from_batch, resize=self.auto_batch)
            else:
                self.hook_state.weight = self.sizes[self.rank] / self.global_batch
        return self.sizes

    def _observe_noise(self, rows: torch.Tensor, record: dict[str, Any]) -> None:
        """Fold the window's gradient norms into the noise-scale estimate (one probe for the
        window, weighted as its steps would be one by one)."""
        steps = [int(x) for x in rows[:, 6]]
        if min(steps) < 1:
            return
        probe = ddp_noise_probe([float(x) for x in rows[:, 4]], [float(x) for x in rows[:, 5]],
                                steps, float(rows[0, 7]), float(rows[0, 8]), steps[0])
        self.noise.observe(probe, weight=1 - (1 - self.noise_ema_weight) ** steps[0])
        record["probe"] = asdict(probe)   # plain numbers: history stays JSON-serialisable

    def _decide_batch(self, per_sample: list[float], rows: torch.Tensor,
                      record: dict[str, Any]) -> None:
        """Choose the global batch by goodput from the gathered (identical) numbers; adopt a
        new one only when the same one wins at two rebalances in a row."""
        measured = self.noise.noise_scale
        if measured is not None:   # an estimate that dips to none keeps the last one
            self.noise_scale = measured
        if self.noise_scale is None:
            return
        overhead = max(0.0, _median([float(x) for x in rows[:, 3]])
                       - max(float(x) for x in rows[:, 2]))
        kw: dict[str, Any] = {"max_lr_scale": self.max_lr_scale,
                              "lr_exponent": self._lr_exponent}
        best = choose_global_batch(self.noise_scale, per_sample, self.global_batch, self._grid,
                                   self.base_batch, overhead_s=overhead,
                                   micro_batches=self._micro,
                                   hysteresis=self.batch_hysteresis,
                                   max_growth=self.max_batch_growth, min_batch=self.min_batch,
                                   **kw)
        record.update(noise_scale=self.noise_scale, overhead_s=overhead)
        if best == self.global_batch:
            self._candidate = None
        elif best != self._candidate:   # confirm at the next rebalance
            self._candidate = best
        else:
            k = self._micro
            stat = auto_stat_model(self.noise_scale, k * self.base_batch, **kw)
            self._lr_for_batch[best] = stat.lr_scale(k * best)
            self.global_batch = best
            self._candidate = None
        record.update(global_batch=self.global_batch,
                      lr_scale=self._lr_for_batch[self.global_batch])


class _Step:
    def __init__(self, het: HeteroDDP, micro_batches: int) -> None:
        self.het, self.micro_batches = het, int(micro_batches)

    def __enter__(self) -> HeteroDDP:
        self.het._begin(self.micro_batches)
        return self.het

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.het._end(self.micro_batches)
