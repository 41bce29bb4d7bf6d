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

import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from hetrain.errors import ConfigError

__all__ = ["HeteroBatchSampler", "HeteroDDP", "WeightState", "even_split",
           "plan_from_measurements", "weighted_allreduce_hook"]


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
    The batch sizes may change between batches (`set_batch_sizes`); the global batch may not,
    so the step count of an epoch stays len(sampler) on every rank.
    """

    def __init__(self, dataset: Any, batch_sizes: Sequence[int], rank: int | None = None, *,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = True) -> None:
        self.n = dataset if isinstance(dataset, int) else len(dataset)
        sizes = _check_sizes(batch_sizes)
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not 0 <= rank < len(sizes):
            raise ConfigError(f"rank {rank} out of range for {len(sizes)} batch sizes")
        self.global_batch = sum(sizes)
        if self.n < self.global_batch:
            raise ConfigError(f"data set of {self.n} samples is smaller than one global batch "
                              f"({self.global_batch})")
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

    def sizes_for(self, index: int) -> tuple[int, ...]:
        """The plan in force for the batch with global index `index`."""
        for start, sizes in reversed(self._schedule):
            if index >= start:
                return sizes
        return self._schedule[0][1]

    def set_batch_sizes(self, sizes: Sequence[int], from_batch: int | None = None) -> None:
        """Use `sizes` for batches with global index >= from_batch (default: the next one)."""
        sizes = _check_sizes(sizes, len(self.batch_sizes))
        if sum(sizes) != self.global_batch:
            raise ConfigError(f"new batch sizes {list(sizes)} sum to {sum(sizes)}, not the global "
                              f"batch {self.global_batch}")
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
        steps, B = len(self), self.global_batch
        if steps * B > self.n:  # drop_last=False: fill the last step from the start
            perm = torch.cat([perm, perm[: steps * B - self.n]])
        self.pending.clear()  # batches of an abandoned iteration are never trained on
        for s in range(steps):
            sizes = self.sizes_for(self.produced)
            lo = s * B + sum(sizes[: self.rank])
            self.pending.append(sizes)
            self.produced += 1
            yield perm[lo: lo + sizes[self.rank]].tolist()


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


def weighted_allreduce_hook(state: WeightState,
                            bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: bucket *= state.weight, then all-reduce SUM (sum_r w_r g_r)."""
    state.calls += 1
    if bucket.is_last() and state.on_last_bucket is not None:
        state.on_last_bucket()
    buf = bucket.buffer()
    buf.mul_(state.weight)
    fut = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=state.group,
                          async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


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


@dataclass
class _Window:
    per_sample: list[float] = field(default_factory=list)


class HeteroDDP:
    """Per-rank batch plan, weighted gradient hook and online rebalancing for one DDP job.

    Call after `dist.init_process_group`. global_batch: samples per step over all ranks (kept
    fixed). batch_sizes: an initial plan (e.g. `hetrain.plan_batches(...).batch_sizes`;
    default: an even split, which the first rebalance corrects). rebalance_every: K, steps
    between re-plans (0: never); the first re-plan comes after `first_rebalance` steps (default
    min(5, K): the median of a few steps is enough to leave an even split early, which matters
    most to short runs). min_gain: re-plan only when the predicted step time improves
    by more than this fraction. check: extra values that must agree on every rank (e.g. the
    data set's length), compared at setup with the others.
    """

    def __init__(self, global_batch: int, *, seed: int = 0, rebalance_every: int = 50,
                 batch_sizes: Sequence[int] | None = None, min_gain: float = 0.05,
                 min_batch: int = 1, group: Any = None, check: dict[str, Any] | None = None,
                 first_rebalance: int | None = None) -> None:
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
        self.rebalance_every, self.min_gain, self.min_batch = int(rebalance_every), min_gain, \
            int(min_batch)
        self.first_rebalance = min(5, self.rebalance_every) if first_rebalance is None \
            else int(first_rebalance)
        sizes = even_split(global_batch, self.world_size) if batch_sizes is None \
            else _check_sizes(batch_sizes, self.world_size)
        self.check_config({"global_batch": global_batch, "seed": self.seed,
                           "rebalance_every": self.rebalance_every, "min_gain": min_gain,
                           "first_rebalance": self.first_rebalance,
                           "min_batch": self.min_batch, "batch_sizes": list(sizes),
                           **(check or {})})
        if sum(sizes) != global_batch:
            raise ConfigError(f"batch_sizes {list(sizes)} sum to {sum(sizes)}, not the "
                              f"global_batch {global_batch}")
        if min(sizes) < self.min_batch or global_batch < self.world_size * self.min_batch:
            raise ConfigError(f"every rank needs >= {self.min_batch} samples per step: "
                              f"batch_sizes {list(sizes)}, global_batch {global_batch}")
        self.sizes = sizes
        self.hook_state = WeightState(weight=sizes[self.rank] / global_batch, group=group,
                                      on_last_bucket=self._mark_compute_done)
        self.sampler: HeteroBatchSampler | None = None
        self.steps = 0
        self.history: list[dict[str, Any]] = []
        """One record per rebalance: step, gathered seconds per sample, old and new plan."""
        self._window = _Window()
        self._t0: float | None = None
        self._t_done: float | None = None

    # -- setup --
    def check_config(self, values: dict[str, Any]) -> None:
        """All-gather `values` and raise ConfigError (on every rank) if any field differs."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, values, group=self.group)
        for key in values:
            seen = [g.get(key, "<missing>") if isinstance(g, dict) else "<missing>"
                    for g in gathered]
            if any(v != seen[0] for v in seen):
                raise ConfigError(f"hetrain.ddp: '{key}' differs across ranks: "
                                  + ", ".join(f"rank {r}={v!r}" for r, v in enumerate(seen)))

    def batch_sampler(self, dataset: Any, *, shuffle: bool = True,
                      drop_last: bool = True) -> HeteroBatchSampler:
        """The rank's `HeteroBatchSampler` (pass it as the DataLoader's batch_sampler)."""
        n = dataset if isinstance(dataset, int) else len(dataset)
        self.check_config({"dataset_len": n, "shuffle": shuffle, "drop_last": drop_last})
        self.sampler = HeteroBatchSampler(n, self.sizes, self.rank, seed=self.seed,
                                          shuffle=shuffle, drop_last=drop_last)
        return self.sampler

    def attach(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register the weighted all-reduce hook on the DDP model."""
        ddp_model.register_comm_hook(self.hook_state, weighted_allreduce_hook)

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
        self.hook_state.weight = sizes[self.rank] / self.global_batch
        self._t_done = None
        self._t0 = time.perf_counter()

    def _end(self, micro_batches: int) -> None:
        t_end = time.perf_counter()
        assert self._t0 is not None
        elapsed = (self._t_done if self._t_done is not None else t_end) - self._t0
        self._window.per_sample.append(
            elapsed / (micro_batches * self._step_sizes[self.rank]))
        self.steps += 1
        if (self.rebalance_every and self.steps % self.rebalance_every == 0) \
                or self.steps == self.first_rebalance:
            self.rebalance()

    def rebalance(self) -> tuple[int, ...]:
        """All-gather the window's median seconds per sample and re-plan (a collective: every
        rank calls it at the same step). Returns the plan in force from the next batch."""
        w = sorted(self._window.per_sample) or [float("nan")]
        mine = w[len(w) // 2]
        produced = self.sampler.produced if self.sampler is not None else self.steps
        local = torch.tensor([mine, float(produced)], dtype=torch.float64)
        out = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(out, local, group=self.group)
        per_sample = [float(t[0]) for t in out]
        from_batch = int(max(float(t[1]) for t in out))
        self._window = _Window()
        old = self.sizes
        if all(math.isfinite(x) and x > 0 for x in per_sample):
            self.sizes = plan_from_measurements(per_sample, self.global_batch, old,
                                                self.min_gain, self.min_batch)
        self.history.append({"step": self.steps, "seconds_per_sample": per_sample,
                             "old": list(old), "new": list(self.sizes)})
        if self.sizes != old:
            if self.sampler is not None:
                self.sampler.set_batch_sizes(self.sizes, from_batch)
            else:
                self.hook_state.weight = self.sizes[self.rank] / self.global_batch
        return self.sizes


class _Step:
    def __init__(self, het: HeteroDDP, micro_batches: int) -> None:
        self.het, self.micro_batches = het, int(micro_batches)

    def __enter__(self) -> HeteroDDP:
        self.het._begin(self.micro_batches)
        return self.het

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.het._end(self.micro_batches)
