"""C-ADP: the data owner / parameter server hands each device a share sized to its speed and
link, devices train locally for H steps, push their delta, and the PS averages by share.

Round r (synchronous: a barrier over the workers with a non-zero share):
  1. the PS sends the model and worker j's share x_j of samples (with the pull, when ship_data;
     with cache_data a device keeps what it received, so once it holds its partition of the
     data set, x_j / S of it, only a grown share is shipped: data moves about once);
  2. worker j runs H local steps of batch x_j / H with the inner optimizer;
  3. it pushes delta_j = theta - theta_j; the PS applies sum_j (x_j / S) delta_j (FedAvg by share,
     then the outer SGD: lr 1 without momentum is the share-weighted average of the replicas).

Batch and learning-rate rule (what keeps convergence). Every active device runs the SAME number
of local steps H, with a batch proportional to its share, so a step takes about the same time
on every device (exactly so where fixed costs are equal) and the share-weighted average of the deltas is, for H = 1 and plain SGD, exactly
one SGD step on the union of the batches (global batch G = S / H). Devices therefore differ only
in batch size, never in how far they drift (no FedNova correction is needed; with i.i.d. shares
from one shuffled stream the local objectives agree). The learning rate follows the global batch
against DDP's (n * train.batch_size): lr_scale = min(max_lr_scale, (G / (n B_ref))^p) with p = 1
(linear scaling, Goyal et al.), 0.5 (sqrt) or 0 (none), the same for all workers.

Sizes. The mean per-worker batch B is at least train.batch_size and large enough that the
per-step overhead stays under overhead_fraction of a step: a step lasts tau = B / v_mean on every
device, so B >= step_overhead_s * v_mean / overhead_fraction. H (auto) makes the speed-weighted
communication time at most comm_fraction of a round: H >= comm_w / (comm_fraction * tau)
(plan.allocate.speed_weighted_local_steps), clamped to [min_local_steps, max_local_steps] and to at
least one synchronisation per epoch; B is also capped so that an epoch has at least
min_steps_per_epoch global steps. S = H * n * B samples per round; shares come from
plan.allocate.allocate (exact water-filling + optimal integer rounding in units of H samples).

Co-adaptation. Every push updates an exponential moving average of the device's per-sample
compute time ((compute_s - steps * step_overhead_s) / samples) and its fixed communication time
(comm_s minus the modelled transfer of the shipped share); every `replan_every` rounds the shares
are re-planned from these estimates, so a device that slows down mid-run gets less work.
Zero-share devices stay idle (they are sent the model with their next non-zero share); in the
first round the engine starts every worker, so a zero-share worker runs a 1-sample probe whose
push is measured and folded in with weight 0. A device left out is otherwise never measured
again, so one slow measurement (a first task's one-time costs, another job on its GPU for a
minute) could keep it out for the whole run: while a zero-share device's measured compute per
sample is over REPROBE_RATIO x its cluster-model figure, relative to the members (their median
measured / model ratio, so a cluster file that is off by the same factor everywhere triggers
nothing), it is re-measured every `reprobe_after_s` seconds, the wait doubling while it stays
slow: released with a probe task (the plan's mean batch, one step) whose update is applied
with weight 0, its compute time taking the place of the old figure. On the simulator, whose
devices run at their modelled speeds unless a test slows one, this never fires.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import numpy as np

from hetrain.errors import ConfigError
from hetrain.plan.allocate import (
    Allocation,
    RoundWork,
    allocate,
    round_costs,
    speed_weighted_local_steps,
)
from hetrain.plan.ema import WorkerCosts
from hetrain.strategies.base import Decision, OuterOptimizer, Push, RunContext, Strategy, WorkTask
from hetrain.strategies.options import MAX_STEPS, Limit, fraction, integer
from hetrain.strategies.registry import register

LR_SCALING = {"linear": 1.0, "sqrt": 0.5, "none": 0.0}


@register
@dataclass
class CADP(Strategy):
    """Heterogeneity-aware shares, H local steps, share-weighted delta averaging at a PS."""

    name = "cadp"
    comm = "ps"
    update = "delta"
    weights = "average"

    local_steps: Annotated[int, integer(0, MAX_STEPS).with_note("0: auto")] = 0
    """H, local steps between two synchronisations; 0: auto from the comm/compute ratio."""
    min_local_steps: Annotated[int, integer(1, MAX_STEPS)] = 1
    """Lower bound of the auto H."""
    max_local_steps: Annotated[int, integer(1, MAX_STEPS)] = 32
    """Upper bound of the auto H (replicas drift apart when H grows)."""
    comm_fraction: Annotated[float, fraction()] = 0.02
    """Auto H: speed-weighted pull + push time at most this fraction of a round."""
    batch_size: Annotated[int, integer(0, 10**9).with_note("0: auto")] = 0
    """Mean per-worker batch B per step; 0: auto (>= train.batch_size, overhead bound)."""
    overhead_fraction: Annotated[float, fraction()] = 0.02
    """Auto B: per-step fixed overhead at most this fraction of a step."""
    min_steps_per_epoch: Annotated[int, integer(1)] = 16
    """Auto B: at most train_samples / (this * n) per worker (small data sets, tiny models)."""
    lr_scaling: Literal["linear", "sqrt", "none"] = "linear"
    """linear | sqrt | none: lr_scale = (global batch / DDP's global batch)^p, capped."""
    max_lr_scale: Annotated[float, Limit(1, math.inf)] = 4.0
    """Cap of lr_scale (linear scaling breaks down for very large batches)."""
    ship_data: bool = True
    """The data owner ships the shares with the pulls (charged on the worker's link)."""
    cache_data: bool = True
    """Devices keep the samples they received: once a device holds its partition of the data
    set (share / S of it), only growth of its share is shipped; False: ship every round. (The
    engine still draws every batch from the owner's shuffled stream; with i.i.d. data that is
    statistically the same as re-reading a random partition.)"""
    replan_every: Annotated[int, integer(0).with_note("0: never re-plan")] = 1
    """Re-plan the shares from measured times every K rounds; 0: never."""
    ema_weight: Annotated[float, fraction(hi_open=False)] = 0.5
    """Weight of the newest measurement in the moving averages of compute and comm times."""
    activation_bytes_per_sample: Annotated[
        int, integer(0, 10**12).with_note("0: not modelled")] = 0
    """Activation memory per sample of a batch, for the memory cap; 0: not modelled."""
    outer_lr: Annotated[float, Limit(0, 2, lo_open=True)] = 1.0
    """Outer SGD learning rate on the share-weighted delta (1: plain weighted averaging)."""
    outer_momentum: Annotated[float, fraction(lo_open=False)] = 0.0
    """Outer Nesterov momentum (DiLoCo-style; helps when rounds are few, see the benchmark)."""
    reprobe_after_s: Annotated[float, Limit(0, math.inf).with_note("0: never")] = 10.0
    """Seconds after a zero-share device's last push before it is re-measured by a probe
    task (its update discarded), while its measured compute per sample is over 1.5x the
    cluster model's, relative to the members' ratio: a first task's one-time costs or a
    passing slowdown would otherwise keep it out for the rest of the run. The wait doubles
    while it stays slow; 0: never."""

    REPROBE_RATIO = 1.5
    """A zero-share device is re-probed while its measured / modelled compute per sample is
    over this multiple of the members' median ratio."""

    plan: Allocation | None = field(default=None, init=False, repr=False)
    history: list[tuple[int, ...]] = field(default_factory=list, init=False, repr=False)
    """The shares of every plan that changed them (the first at setup): one entry per change,
    not per re-plan, so a long run's strategy state (the server snapshots it after every
    update) does not grow with its rounds."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # across two fields, so no one field's declaration can say it
        if self.min_local_steps > self.max_local_steps:
            raise ConfigError(f"strategy {self.name}: min_local_steps ({self.min_local_steps}) "
                              f"must be <= max_local_steps ({self.max_local_steps})")

    # ---- planning -------------------------------------------------------------------------
    def setup(self, ctx: RunContext) -> None:
        super().setup(ctx)
        cl, n = ctx.cluster, ctx.n_workers
        self._overhead_s = np.array([d.step_overhead_s for d in cl.devices])
        self._ship_s = np.array([ctx.sample_bytes / cl.ps_link(j).bandwidth_Bps
                                 if self.ship_data else 0.0 for j in range(n)])
        memory = RoundWork(samples=0, flops_per_sample=ctx.flops_per_sample,
                           model_bytes=ctx.model_bytes, steps=0, ship_data=False)
        comm0, compute0, _ = round_costs(cl, memory)
        # per device: seconds per sample and per pull + push; priors from the cluster model
        self.costs = WorkerCosts(compute0, comm0, self.ema_weight, "strategy cadp: ema_weight")
        self._model_compute_s: list[float] | None = [float(x) for x in compute0]
        self._pushed_at = [0.0] * n                    # when each worker last pushed
        self._reprobe_wait = [self.reprobe_after_s] * n
        self._probing: set[int] = set()                # zero-share workers sent a re-probe
        self._now = 0.0                                 # the latest push's arrival
        speed = 1.0 / np.array(self.costs.compute_s)                           # samples/s
        v_mean = float(speed.mean())
        overhead_bound = math.ceil(float(self._overhead_s.max()) * v_mean / self.overhead_fraction)
        epoch_bound = ctx.train_samples // (self.min_steps_per_epoch * n)
        self.mean_batch = self.batch_size or max(ctx.batch_size, min(overhead_bound, epoch_bound))
        self.global_batch = n * self.mean_batch
        step_s = self.mean_batch / v_mean
        self.steps = self.local_steps or min(
            speed_weighted_local_steps(self.costs.comm_s, self.costs.compute_s, step_s,
                                       self.comm_fraction, self.min_local_steps,
                                       self.max_local_steps),
            max(self.min_local_steps, ctx.train_samples // self.global_batch))
        self.samples_per_round = self.steps * self.global_batch
        ratio = self.global_batch / (n * ctx.batch_size)
        self.lr_scale = min(self.max_lr_scale, ratio ** LR_SCALING[self.lr_scaling])
        stored = ctx.sample_bytes * (ctx.train_samples / self.samples_per_round if self.cache_data
                                     else 1.0) if self.ship_data else 0.0
        per_sample_mem = stored + self.activation_bytes_per_sample / self.steps
        caps_work = RoundWork(samples=self.samples_per_round, flops_per_sample=ctx.flops_per_sample,
                              model_bytes=ctx.model_bytes, memory_fixed_bytes=4 * ctx.model_bytes,
                              memory_per_sample_bytes=per_sample_mem)
        self._caps: list[float] | np.ndarray = round_costs(cl, caps_work)[2]  # array once lost
        self._planned_caps = self._caps.copy()   # a rejoining device gets its cap back
        self.rounds = self.replans = 0
        self._held = np.zeros(n, dtype=np.int64)       # samples a device has cached
        self._shipped = np.zeros(n, dtype=np.int64)    # samples shipped with its current task
        self.plan, self.history = None, []
        self._replan()
        self._members = {j for j in range(n) if self._shares[j] > 0}
        self._pending: dict[int, Push] = {}
        self._strays: list[int] = []
        self._inflight: set[int] = set()
        self._lost: set[int] = set()

    def _partition(self, worker: int) -> int:
        """Samples of the data set device `worker` holds at its current share (cache mode)."""
        return math.ceil(self._shares[worker] * self.context.train_samples
                         / self.samples_per_round)

    def _to_ship(self, worker: int, share: int) -> int:
        if not self.ship_data:
            return 0
        if not self.cache_data:
            return share
        return int(min(share, max(0, self._partition(worker) - self._held[worker])))

    def _replan(self) -> None:
        fixed = np.array(self.costs.comm_s) + self.steps * self._overhead_s
        ships = np.array([self.ship_data and (not self.cache_data or self.plan is None
                                              or self._held[j] < self._partition(j))
                          for j in range(len(fixed))])
        self.plan = allocate(fixed, np.array(self.costs.compute_s) + self._ship_s * ships,
                             self.samples_per_round, self._caps, granularity=self.steps)
        self._shares = self.plan.shares
        self._record_shares()

    def _record_shares(self) -> None:
        if not self.history or self.history[-1] != self._shares:
            self.history.append(self._shares)

    @staticmethod
    def _upgrade_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint written before the costs were a `WorkerCosts` holds them as two arrays
        (hetrain.engine.codec calls this when it reads one back)."""
        if "_compute_s" in attrs:
            attrs["costs"] = WorkerCosts(attrs.pop("_compute_s"), attrs.pop("_comm_s"),
                                         attrs["ema_weight"])
        if "_model_compute_s" not in attrs:   # written before re-probing: it stays off
            n = len(attrs["costs"].compute_s)
            attrs.update(_model_compute_s=None, _pushed_at=[0.0] * n, _probing=set(),
                         _reprobe_wait=[0.0] * n, _now=0.0)
        return attrs

    def _observe(self, p: Push) -> None:
        """Fold one push's measured times into the moving averages: per sample without the
        step overheads, on the wire without the shipped samples. A re-probe's compute time
        replaces the old figure (that figure is what made the device look slow)."""
        j = p.worker
        compute = max(p.compute_s - p.steps * self._overhead_s[j], 1e-3 * p.compute_s) / p.samples
        comm = max(0.0, p.comm_s - self._ship_s[j] * self._shipped[j])
        self._now = max(self._now, p.arrival_s)
        self._pushed_at[j] = p.arrival_s
        if j in self._probing:
            self._probing.discard(j)
            self.costs.compute_s[j] = compute
            self.costs.update(j, None, comm)
            slow = self._looks_slow(j, self._member_ratio())
            self._reprobe_wait[j] = 2 * self._reprobe_wait[j] if slow else self.reprobe_after_s
            return
        self.costs.update(j, compute, comm)

    def _member_ratio(self) -> float:
        """The members' median measured / modelled compute per sample (1 without a model
        figure, from a checkpoint written before re-probing, or without members)."""
        model = self._model_compute_s
        active = [j for j, x in enumerate(self._shares) if x > 0]
        if model is None or not active:
            return 1.0
        return float(np.median([self.costs.compute_s[j] / model[j] for j in active]))

    def _looks_slow(self, worker: int, member_ratio: float) -> bool:
        model = self._model_compute_s
        return model is not None and (self.costs.compute_s[worker] / model[worker]
                                      > self.REPROBE_RATIO * member_ratio)

    def _reprobes_due(self) -> set[int]:
        """Waiting zero-share devices that look anomalously slow and whose wait is over."""
        if not self.reprobe_after_s or self._model_compute_s is None:
            return set()
        ratio = self._member_ratio()
        return {j for j, x in enumerate(self._shares)
                if x == 0 and self._caps[j] > 0 and j not in self._inflight
                and j not in self._lost and self._looks_slow(j, ratio)
                and self._now - self._pushed_at[j] >= self._reprobe_wait[j]}

    # ---- protocol -------------------------------------------------------------------------
    def next_task(self, worker: int) -> WorkTask:
        self._inflight.add(worker)
        share = self._shares[worker] if worker in self._members else 0
        probe = max(1, self.mean_batch) if worker in self._probing else 1
        ship = self._to_ship(worker, share) if share else probe * int(self.ship_data)
        self._shipped[worker] = ship
        self._held[worker] += ship
        data_bytes = ship * self.context.sample_bytes
        if share == 0:  # a zero-share worker: the first round's 1-sample probe, or a re-probe
            return WorkTask(probe, 1, self.lr_scale, data_bytes)
        return WorkTask(batch_size=share // self.steps, local_steps=self.steps,
                        lr_scale=self.lr_scale, data_bytes=data_bytes)

    def on_push(self, push: Push) -> Decision:
        self._observe(push)
        w = push.worker
        self._inflight.discard(w)
        if w in self._members and w not in self._pending:
            self._pending[w] = push
        else:
            self._strays.append(w)
        return self._close_round()

    def on_worker_lost(self, worker: int) -> Decision | None:
        """Re-plan without the lost device: its share goes to the others (its cap becomes 0),
        and a round that was only waiting for it completes now with the pushes it has. A push
        it made leaves the round with it: the engine drops a lost worker's pushes (applying
        one failed, and it counted towards a round it could close before a member pushed). A
        round left without members closes at once, so the waiting devices are not stranded."""
        self._lost.add(worker)
        self._inflight.discard(worker)
        self._probing.discard(worker)
        self._caps = np.where(np.arange(len(self._caps)) == worker, 0.0, self._caps)
        self._members.discard(worker)
        self._pending.pop(worker, None)
        self._strays = [w for w in self._strays if w != worker]
        self._replan()
        self.replans += 1
        return self._close_round() if self._pending or not self._members else None

    def on_worker_joined(self, worker: int) -> Decision | None:
        """A replacement process took the device's slot: plan with it again (its cap back,
        nothing cached: it is a fresh process). It enters at the next round boundary (the
        round under way does not wait for it)."""
        self._lost.discard(worker)
        self._inflight.discard(worker)
        self._probing.discard(worker)
        caps = getattr(self, "_planned_caps", self._caps)  # strategies checkpointed before it
        self._caps = np.where(np.arange(len(self._caps)) == worker, caps, self._caps)
        self._held[worker] = 0
        self._replan()
        self.replans += 1
        return None

    def _close_round(self) -> Decision:
        """Apply the round once every member has pushed; re-plan; release the next members."""
        if len(self._pending) < len(self._members):
            return Decision()
        total = sum(p.samples for p in self._pending.values())
        apply = tuple((j, p.samples / total) for j, p in sorted(self._pending.items()))
        apply += tuple((j, 0.0) for j in self._strays)
        self._pending, self._strays = {}, []
        self.rounds += 1
        if self.replan_every and self.rounds % self.replan_every == 0:
            self._replan()
            self.replans += 1
        self._members = {j for j in range(len(self._shares))
                         if self._shares[j] > 0 and j not in self._inflight
                         and j not in self._lost}
        probes = self._reprobes_due()
        self._probing |= probes
        return Decision(apply=apply, release=tuple(sorted(self._members | probes)))

    def outer(self) -> OuterOptimizer:
        return OuterOptimizer(self.outer_lr, self.outer_momentum, nesterov=self.outer_momentum > 0)

    def stats(self) -> dict[str, float | int | str]:
        plan = self.plan
        assert plan is not None
        speed_sum = float((1.0 / np.array(self.costs.compute_s)).sum())
        return {"local_steps": self.steps, "mean_batch": self.mean_batch,
                "global_batch": self.global_batch, "samples_per_round": self.samples_per_round,
                "lr_scale": self.lr_scale, "rounds": self.rounds, "replans": self.replans,
                "planned_round_s": plan.makespan_s,
                "planned_efficiency": plan.total / plan.makespan_s / speed_sum,
                "zero_share_workers": plan.n - len(plan.active),
                "shares": ",".join(str(x) for x in plan.shares)}
