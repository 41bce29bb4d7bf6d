"""Tensor work that every engine shares: a worker's replica, the server's model, the data owner.

Engines differ only in how they move tensors and keep time; the arithmetic of a task and of
a server update lives here once, so the simulator and torch.distributed compute the same
numbers for the same seed.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from hetrain.config import OptimizerConfig
from hetrain.engine.devices import Mover
from hetrain.engine.precision import LossScaler, autocast
from hetrain.engine.schedule import LrSchedule, PlateauSchedule, make_schedule
from hetrain.plan.noise import GradProbe
from hetrain.strategies.base import Decision, OuterOptimizer, Strategy, Update, WorkTask
from hetrain.validate import optimizer_class
from hetrain.workloads import BatchLoader, Workload


def flat_params(model: nn.Module) -> Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def set_flat_params(model: nn.Module, flat: Tensor) -> None:
    """Copy `flat` into the parameters (in place: they stay on their device and keep no
    reference to `flat`, unlike torch's vector_to_parameters, which re-points them)."""
    copy_flat_into(list(model.parameters()), flat)


def copy_flat_into(params: list[nn.Parameter], flat: Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p), non_blocking=True)
            offset += n


def set_flat_grads(params: list[nn.Parameter], flat: Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.device, copy=True)
        offset += n


def float_buffers(model: nn.Module) -> list[Tensor]:
    """Floating buffers (e.g. BatchNorm statistics) travel with the parameters."""
    return [b for b in model.buffers() if b.is_floating_point()]


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def build_optimizer(cfg: OptimizerConfig, params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return optimizer_class(cfg.name)(params, lr=cfg.lr, **cfg.options)


def clip_gradients(params: list[nn.Parameter], max_norm: float) -> None:
    """optimizer.clip_grad_norm: the gradient's L2 norm clipped before a step (0: off)."""
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, max_norm)


Buffered = tuple[Any, list[Tensor], int]
"""A push the server holds until the strategy applies it: (update, float buffers, samples)."""


def take_applied(buffered: dict[int, deque[Buffered]], decision: Decision,
                 strategy: str) -> tuple[list[tuple[float, Any, list[Tensor]]], int]:
    """Pop the pushes a Decision applies, oldest first per worker, as the (weight, update,
    buffers) items `Server.apply` takes, and the samples they carry. Both engines call this,
    so a strategy that applies a push it never received fails the same way in each."""
    items, samples = [], 0
    for w, weight in decision.apply:
        if not buffered[w]:
            raise RuntimeError(f"strategy '{strategy}' applied worker {w}'s push, "
                               "but none is buffered")
        update, buffers, n = buffered[w].popleft()
        items.append((weight, update, buffers))
        samples += n
    return items, samples


def next_task(strategy: Strategy, worker: int, server: Server) -> WorkTask:
    """The task `worker` runs next, its lr scale times the schedule's factor at the server's
    current version: the simulator and the dist Coordinator both ask here, so a schedule gives
    the same numbers on both engines for the same sequence of updates."""
    task = strategy.next_task(worker)
    if server.schedule is None:
        return task
    return dataclasses.replace(task, lr_scale=task.lr_scale
                               * server.schedule.factor(server.version))


def observe_evaluations(server: Server, rows: list[dict[str, Any]]) -> None:
    """Evaluation rows, in order, to the schedule (ReduceLROnPlateau steps on each; the others
    ignore them): after each new row on both engines, and a resumed run's earlier rows again,
    which rebuilds the plateau state the uncut run had."""
    if server.schedule is not None:
        for row in rows:
            server.schedule.observe(row["updates"], row["test_loss"], row["test_accuracy"])


def plateau_factor(server: Server) -> float | None:
    """The `lr_factor` of an update message when the schedule steps on evaluations
    (ReduceLROnPlateau; None for any other): the factor of the update at the server's current
    version, which servers that never see an evaluation (all-reduce workers, PS shards) cannot
    compute."""
    if not isinstance(server.schedule, PlateauSchedule):
        return None
    return server.schedule.factor(server.version)


def follow_plateau(server: Server, lr_factor: float | None) -> None:
    """Take rank 0's plateau factor (`plateau_factor`, if its message carried one) for this
    server's next update."""
    if lr_factor is not None and isinstance(server.schedule, PlateauSchedule):
        server.schedule.follow(server.version, float(lr_factor))


def schedule_metrics(server: Server) -> dict[str, float]:
    """The `lr` column of evaluation rows when a schedule is set (none without one)."""
    return {} if server.schedule is None else {"lr": server.lr()}


class DataOwner:
    """Hands out sample indices from per-epoch permutations, to whichever worker asks next.

    One stream for all workers: the C-ADP data owner, and, for DDP, the same distribution as a
    DistributedSampler. `samples_taken / len` is the epoch count.
    """

    def __init__(self, n_samples: int, seed: int) -> None:
        self.n = n_samples
        self._rng = np.random.default_rng(seed)
        self._perm = self._rng.permutation(self.n)
        self._pos = 0
        self.samples_taken = 0

    def take(self, k: int) -> Tensor:
        out = []
        while k > 0:
            if self._pos == self.n:
                self._perm, self._pos = self._rng.permutation(self.n), 0
            m = min(k, self.n - self._pos)
            out.append(self._perm[self._pos:self._pos + m])
            self._pos += m
            k -= m
            self.samples_taken += m
        return torch.from_numpy(np.concatenate(out))

    @property
    def epoch(self) -> float:
        return self.samples_taken / self.n


@dataclass
class TaskResult:
    update: Tensor
    """Flat gradient (gradient mode) or pseudo-gradient start - end (delta mode)."""
    buffers: list[Tensor]
    loss: float
    samples: int
    steps: int
    probe: GradProbe | None = None
    """The gradient-noise probe of the first batch, when the task asked for one."""


class Replica:
    """A worker's own model copy and inner optimizer (its state persists across rounds), on
    the worker's device; what goes in (parameters, buffers) and comes out (the update) is on
    the host."""

    def __init__(self, workload: Workload, model: nn.Module, opt_cfg: OptimizerConfig,
                 device: torch.device | None = None, precision: str = "fp32",
                 loader: BatchLoader | None = None) -> None:
        self.workload = workload
        self.device = device or torch.device("cpu")
        self.mover = Mover(self.device, workload.loader.pin_memory is not False)
        self.loader = loader or BatchLoader(workload.train, workload.loader)
        """Turns the task's planned indices into batches (the simulator shares one loader
        among its replicas: they run one at a time in one process)."""
        self.model = model.to(self.device)
        self.base_lr = opt_cfg.lr
        self.optimizer = build_optimizer(opt_cfg, self.model.parameters())
        self.precision = precision
        self.scaler = LossScaler(precision == "fp16")
        self.clip_grad_norm = opt_cfg.clip_grad_norm

    def load(self, params: Tensor, buffers: list[Tensor]) -> None:
        set_flat_params(self.model, self.mover.to_device(params))
        with torch.no_grad():
            for mine, theirs in zip(float_buffers(self.model), buffers, strict=True):
                mine.copy_(theirs)

    def warm_up(self, batch_size: int) -> None:
        """One untimed forward and backward on the first `batch_size` samples; the model (its
        buffers too), its gradients, the optimizer and the RNG are left as they were. A
        process's first step pays one-time costs (first kernels, allocations, the loader)
        that are not the device's speed: measured in a worker's first task, they ranked a
        speed-4 device below a speed-2 one on real processes (real_hetero4), and auto, which
        re-measures only the devices it uses, then trained the slower one alone."""
        n = len(self.workload.train)  # type: ignore[arg-type]
        idx = torch.arange(max(1, min(batch_size, n)))
        saved = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            self.model.train()
            for batch in self.loader.batches([idx]):   # the whole (one-batch) iterator
                self._loss(batch).backward()
        self.model.zero_grad(set_to_none=True)
        self.model.load_state_dict(saved)

    def _loss(self, batch: Any) -> Tensor:
        batch = self.mover.batch(batch)
        with autocast(self.precision, self.device):
            return self.workload.loss(self.model, batch)

    def run(self, task: WorkTask, update: Update, batches: list[Tensor]) -> TaskResult:
        """Run one task on the given index batches (one per local step)."""
        self.model.train()
        start = flat_params(self.model)
        losses = []
        probe = None
        params = list(self.model.parameters())
        probing = task.probe_noise and len(batches[0]) >= 2 if batches else False
        # What to load, in order: the noise probe splits the first step's batch in halves.
        fetch = [*_halves(batches[0]), *batches[1:]] if probing else list(batches)
        loaded = self.loader.batches(fetch)
        if update == "gradient":
            self.model.zero_grad(set_to_none=True)
            for k, idx in enumerate(batches):
                if k == 0 and probing:
                    loss_value, probe = self._probe_backward(loaded, idx, 1.0 / len(batches))
                    losses.append(loss_value)
                    continue
                loss = self._loss(next(loaded))
                self.scaler.scaled(loss / len(batches)).backward()
                losses.append(loss.item())
            finite = self.scaler.unscale(params)
            out = torch.cat([p.grad.reshape(-1) if p.grad is not None and finite
                             else torch.zeros(p.numel(), device=p.device) for p in params])
        else:
            if task.reset_optimizer:
                self.optimizer.state.clear()
            for group in self.optimizer.param_groups:
                group["lr"] = self.base_lr * task.lr_scale
            for k, idx in enumerate(batches):
                self.optimizer.zero_grad(set_to_none=True)
                if k == 0 and probing:
                    loss_value, probe = self._probe_backward(loaded, idx, 1.0)
                else:
                    loss = self._loss(next(loaded))
                    self.scaler.scaled(loss).backward()
                    loss_value = loss.item()
                if self.scaler.unscale(params):  # fp16: a step with overflowed grads is skipped
                    clip_gradients(params, self.clip_grad_norm)
                    self.optimizer.step()
                losses.append(loss_value)
            out = start - flat_params(self.model)
        return TaskResult(self.mover.to_host(out),
                          [self.mover.to_host(b.detach().clone()) for b in
                           float_buffers(self.model)],
                          float(np.mean(losses)), sum(len(b) for b in batches), len(batches),
                          probe)

    def _probe_backward(self, loaded: Iterator[Any], idx: Tensor,
                        scale: float) -> tuple[float, GradProbe | None]:
        """Back-propagate the batch `idx` as two halves (the next two batches of `loaded`),
        one at a time, leaving `scale` times the whole batch's mean gradient in .grad (added
        to what is there, in the loss scale's units), and measure the squared norms of the
        halves' and the whole batch's gradients (hetrain.plan.noise); no probe when fp16
        gradients overflowed."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        before = [p.grad.detach().clone() if p.grad is not None else None for p in params]
        halves = _halves(idx)
        grads, loss_sum = [], 0.0
        loss_scale = self.scaler.scale
        for half in halves:
            for p in params:
                p.grad = None
            loss = self._loss(next(loaded))
            self.scaler.scaled(loss).backward()
            loss_sum += loss.item() * len(half)
            grads.append([p.grad.detach() / loss_scale if p.grad is not None
                          else torch.zeros_like(p) for p in params])
        n0, n1, n = len(halves[0]), len(halves[1]), len(idx)
        small = 0.5 * sum(float(sum((g * g).sum() for g in gs)) for gs in grads)
        whole = [(n0 * g0 + n1 * g1) / n for g0, g1 in zip(*grads, strict=True)]
        big = float(sum((g * g).sum() for g in whole))
        with torch.no_grad():
            for p, g, old in zip(params, whole, before, strict=True):
                g = scale * loss_scale * g if self.scaler.enabled else scale * g
                p.grad = g if old is None else old + g
        probe = GradProbe(small, 0.5 * n, big, n)
        return loss_sum / n, probe if math.isfinite(small) and math.isfinite(big) else None


def _halves(idx: Tensor) -> tuple[Tensor, Tensor]:
    return idx[:len(idx) // 2], idx[len(idx) // 2:]


class Server:
    """The global model and the optimizer that applies aggregated pushes to it.

    Gradient mode: the configured optimizer steps on sum_i w_i g_i (w_i sum to 1 for
    synchronous SGD). Delta mode: outer SGD on sum_i w_i delta_i; lr 1 without momentum sets
    params to sum_i w_i (theta - delta_i), i.e. the weighted average of the replicas.
    """

    def __init__(self, model: nn.Module, update: Update, opt_cfg: OptimizerConfig,
                 outer: OuterOptimizer, owned: list[nn.Parameter] | None = None) -> None:
        self.model = model
        self.owned = list(model.parameters()) if owned is None else owned
        """The parameters this server updates (a block of them on a sharded PS; the optimizers
        are element-wise, so a block steps exactly as it would inside the whole model)."""
        self.version = 0
        """The global step: server updates applied so far (what the lr schedule follows)."""
        self.base_lr = opt_cfg.lr
        self.schedule: LrSchedule | None = make_schedule(opt_cfg.scheduler,
                                                         opt_cfg.scheduler_options)
        self.update = update
        self.clip_grad_norm = opt_cfg.clip_grad_norm if update == "gradient" else 0.0
        if update == "gradient":
            self.optimizer = build_optimizer(opt_cfg, iter(self.owned))
        else:
            self.optimizer = torch.optim.SGD(self.owned, lr=outer.lr,
                                             momentum=outer.momentum, nesterov=outer.nesterov)

    def params(self) -> Tensor:
        """The owned parameters, flat, in host memory (for the wire)."""
        return torch.nn.utils.parameters_to_vector(self.owned).detach().to("cpu", copy=True)

    def buffers(self) -> list[Tensor]:
        return [b.detach().to("cpu", copy=True) for b in float_buffers(self.model)]

    def lr(self) -> float:
        """optimizer.lr at the current global step (scheduled, before a strategy's scale)."""
        factor = 1.0 if self.schedule is None else self.schedule.factor(self.version)
        return self.base_lr * factor

    def apply(self, weighted: list[tuple[float, Tensor, list[Tensor]]],
              lr_scale: float = 1.0) -> None:
        """One server update from (weight, update, buffers) triples. Gradient mode: the
        optimizer steps with the lr of this update's global step (the version before it, when
        there is a schedule) times `lr_scale` (the Decision's), on every server and PS shard
        alike, and not at all when every weight is 0 (a discarded update: a step on a zero
        gradient would still move Adam's or momentum's parameters); the outer step of delta
        mode is not scheduled (its lr is the strategy's)."""
        if not weighted:
            return
        total = sum(w for w, _, _ in weighted)
        if self.update == "gradient":
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr() * lr_scale
        agg = sum(w * u for w, u, _ in weighted)
        assert isinstance(agg, Tensor)  # not sum's start 0: `weighted` is not empty
        if self.update == "delta" or total > 0:
            set_flat_grads(self.owned, agg)
            if self.clip_grad_norm > 0:  # gradient strategies: the step on the aggregate
                clip_gradients(self.owned, self.clip_grad_norm)
            self.optimizer.step()
        with torch.no_grad():
            for k, buf in enumerate(float_buffers(self.model)):
                if total > 0:
                    mean = sum(w * bufs[k] for w, _, bufs in weighted) / total
                    assert isinstance(mean, Tensor)  # `weighted` is not empty
                    buf.copy_(mean)
        self.version += 1
