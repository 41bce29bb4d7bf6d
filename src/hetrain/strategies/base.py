"""The strategy interface: a training protocol as a pure state machine, no I/O, no clocks.

An engine (the simulator or torch.distributed) runs this loop and a strategy decides:

    worker w:  task = strategy.next_task(w)         # batch size, local steps, lr scale
               train `task.local_steps` steps on its replica (or accumulate gradients)
               push its update (gradient or parameter delta) + a `Push` record
    server:    decision = strategy.on_push(push)    # which buffered pushes to aggregate into
                                                    # one server update, with what weights,
                                                    # and which workers' pulls to answer now
               answered workers receive the current model and their next task

`comm = "allreduce"` strategies (ddp, local_sgd) are the same protocol with a barrier of all
workers; engines charge a collective instead of point-to-point PS traffic. Strategies see
times only as data (`Push.arrival_s`, measured compute times), so the same object drives a
virtual clock or a wall clock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from hetrain.context import RunContext
from hetrain.plan.noise import GradProbe


@dataclass(frozen=True)
class WorkTask:
    """What a worker does between two synchronisations."""

    batch_size: int
    local_steps: int = 1
    lr_scale: float = 1.0
    """Multiplies the worker's inner learning rate (e.g. linear scaling for bigger batches)."""
    data_bytes: int = 0
    """Bytes shipped to the worker with this task (C-ADP's data owner sends the share)."""
    reset_optimizer: bool = False
    """Clear the worker's inner optimizer state (momentum) first: a device that (re)joins a
    plan would otherwise carry momentum built from stale gradients into the average."""
    probe_noise: bool = False
    """Measure the gradient noise on the task's first batch (two halves back-propagated one at
    a time, the same update; see hetrain.plan.noise) and send a GradProbe with the push."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.local_steps < 1:
            raise ValueError(f"bad task {self}: batch_size and local_steps must be >= 1")

    @property
    def samples(self) -> int:
        return self.batch_size * self.local_steps


@dataclass(frozen=True)
class Push:
    """The record of one worker's push, as the server sees it (tensors stay in the engine)."""

    worker: int
    base_version: int
    """Server model version the worker started from (staleness = current - base)."""
    samples: int
    steps: int
    loss: float
    """Mean training loss over the task."""
    compute_s: float
    """Measured (or simulated) compute time of the task."""
    comm_s: float
    """Time of the last pull plus this push on the wire."""
    arrival_s: float
    """Engine time at which the push reached the server."""
    probe: GradProbe | None = None
    """Gradient norms of the task's first batch, when the task asked for them."""


@dataclass(frozen=True)
class Decision:
    """The server's answer to a push: what to apply now, whom to release now."""

    apply: tuple[tuple[int, float], ...] = ()
    """(worker, weight) of buffered pushes to aggregate into ONE server update: sum w_i u_i."""
    release: tuple[int, ...] = ()
    """Workers whose pull is answered now with the (updated) model and a new task."""


@dataclass(frozen=True)
class OuterOptimizer:
    """SGD the server applies to the aggregated pseudo-gradient (delta mode)."""

    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False


Update = Literal["gradient", "delta"]
Comm = Literal["ps", "allreduce"]


@dataclass
class Strategy(ABC):
    """Base class of all protocols. Subclasses are registered by name in `strategies.REGISTRY`.

    `update = "gradient"`: a worker accumulates the mean gradient over its task's steps without
    stepping; the server steps the configured optimizer on the aggregate (synchronous SGD, ASP).
    `update = "delta"`: a worker trains its own replica with the configured optimizer and pushes
    the pseudo-gradient (start params - end params); the server applies the outer optimizer
    (plain SGD with lr 1: sum w_i delta_i is subtracted) to the aggregate.
    """

    name: ClassVar[str] = "base"
    comm: ClassVar[Comm] = "ps"
    update: ClassVar[Update] = "delta"

    ctx: RunContext | None = field(default=None, init=False, repr=False)

    def setup(self, ctx: RunContext) -> None:
        """Called once before training; planners run here."""
        self.ctx = ctx

    @abstractmethod
    def next_task(self, worker: int) -> WorkTask:
        """The task a worker runs after its (next) pull is answered."""

    @abstractmethod
    def on_push(self, push: Push) -> Decision:
        """Decide what to do with a push that has just arrived."""

    def on_worker_lost(self, worker: int) -> Decision | None:
        """A real engine dropped `worker` (dead or hung): re-plan, or release/apply what no
        longer waits for it. Default: nothing (a barrier then waits forever, and the engine
        stops the run with a checkpoint)."""
        return None

    def on_worker_joined(self, worker: int) -> Decision | None:
        """A real engine gave a lost worker's slot to a replacement process (`hetrain join`):
        plan with the device again. Default: release it at once (asynchronous strategies); a
        strategy with rounds lets it in at a round boundary instead."""
        return Decision(release=(worker,))

    def ps_placement(self) -> str | None:
        """The site where the parameter server should run, if the strategy chose one (`auto`
        does); engines that can move it do (the simulator), the others say so. None: keep."""
        return None

    def metrics(self) -> dict[str, float | int | None]:
        """Figures added to every evaluation row of metrics.jsonl (e.g. the noise scale)."""
        return {}

    def outer(self) -> OuterOptimizer:
        """The server's outer SGD in delta mode (default: apply the aggregate as it is)."""
        return OuterOptimizer()

    def stats(self) -> dict[str, float | int | str]:
        """Strategy-specific figures for the run summary (stage switches, plans)."""
        return {}

    @property
    def context(self) -> RunContext:
        if self.ctx is None:
            raise RuntimeError(f"strategy '{self.name}' used before setup()")
        return self.ctx


class BarrierMixin:
    """Collects pushes until every worker has pushed, then applies them all and releases all."""

    def barrier_init(self, n: int) -> None:
        """Call from setup(): a barrier of `n` workers (subclasses call these two; public)."""
        self._pending: dict[int, Push] = {}
        self._n = n

    def barrier_push(self, push: Push, weight_by_samples: bool = True) -> Decision:
        """Call from on_push(): nothing until all `n` pushed, then apply all, release all."""
        self._pending[push.worker] = push
        if len(self._pending) < self._n:
            return Decision()
        total = sum(p.samples for p in self._pending.values())
        apply = tuple(
            (w, (p.samples / total) if weight_by_samples else 1.0 / self._n)
            for w, p in sorted(self._pending.items()))
        self._pending = {}
        return Decision(apply=apply, release=tuple(w for w, _ in apply))

    _barrier_init = barrier_init  # the names before they were public: strategies written
    _barrier_push = barrier_push  # against them (examples/05 did) keep working
