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

The contract
------------
An engine sees every live worker as *busy* (released: it computes its task and owes a push) or
*waiting* (it pushed, or a replacement process joined its slot, and nobody released it since).
The engine releases every worker once at the start, without a Decision; it calls `next_task(w)`
once per release, as it sends the task (a strategy may count w as in flight from then on); it
calls `on_push` only for a busy worker, which is waiting from then on; it carries a Decision
out by applying first (one server update, if `apply` is not empty), then releasing. A lost
worker (`on_worker_lost`; PS strategies only, an all-reduce run stops at a loss) is neither
busy nor waiting: the engine drops the pushes it held and ignores it until `on_worker_joined`
makes it a waiting worker again. A strategy's answers (a `Decision`; None from the two hooks
means an empty one) keep these rules:

1. Release only waiting workers, each at most once per Decision: never a busy one (its push is
   owed; a second task would overwrite the first) nor a lost one.
2. Apply only held pushes: a worker appears in `apply` at most as often as the engine holds
   pushes of it that no earlier Decision applied (each entry takes its oldest); a lost worker's
   are gone.
3. Weights are finite and >= 0 (0 discards a push). Where `weights = "average"` (ddp,
   local_sgd, cadp, auto) the weights of a Decision sum to 1, the update being a weighted mean,
   or are all 0 (a Decision that only discards); where "scaled" (asp, ssp, adsp, ashl) each is
   the strategy's own step size for one push, as its docstring says. A Decision's lr_scale
   is finite and > 0.
4. No deadlock: once a Decision is carried out some live worker is busy (unless none is live),
   since only a push can free a waiting one. The one exception is the default `on_worker_lost`,
   which leaves a barrier waiting for the lost worker; the engine then stops the run with a
   checkpoint.
5. Fairness: while the busy workers go on pushing, every waiting worker is released within a
   bounded number of pushes, except the ones the strategy plans no work for (cadp and auto park
   zero-share devices).
6. A strategy is a dataclass whose init fields are its options (the config's [strategy] table,
   `make_strategy`), each declaring its range or choices in its annotation
   (hetrain.strategies.options); it pickles, with its defaults and between any two calls after setup (the
   dist server snapshots it after every update; checkpoints hold it through
   `hetrain.engine.codec`); it is deterministic, with no clocks, I/O or unseeded randomness
   (times reach it as data, in `Push`), so a restored copy answers exactly as the original.

`hetrain.strategies.contract.check_decision` checks rules 1-4 one Decision at a time;
tests/test_strategy_contract.py drives every registered strategy through random engine
histories (pushes in and out of time order, losses, joins) and checks all six (the codec's
part of rule 6: tests/test_codec.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from hetrain.context import RunContext
from hetrain.plan.noise import GradProbe
from hetrain.strategies.options import check_declared


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
    lr_scale: float = 1.0
    """Multiplies the server optimizer's lr for this update, where workers push gradients
    (the server steps the configured optimizer; a task's lr_scale reaches only a worker's own
    steps). Delta pushes ignore it: their outer step is the strategy's (`outer`)."""


@dataclass(frozen=True)
class OuterOptimizer:
    """SGD the server applies to the aggregated pseudo-gradient (delta mode)."""

    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False


Update = Literal["gradient", "delta"]
Comm = Literal["ps", "allreduce"]
Weights = Literal["average", "scaled"]


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
    weights: ClassVar[Weights] = "scaled"
    """What the weights of one Decision's `apply` sum to (the contract's rule 3): "average", 1;
    "scaled", nothing fixed (each weight is the strategy's own step size for one push)."""

    ctx: RunContext | None = field(default=None, init=False, repr=False)

    @property
    def pushes(self) -> Update:
        """What this run's workers push: the class's `update`, unless the strategy chose at
        setup (auto pushes gradients with Adam-type optimizers). Engines read it after setup."""
        return self.update

    def __post_init__(self) -> None:
        """Check every option against the range or choices its field declares
        (hetrain.strategies.options); a subclass with checks across fields runs them after
        `super().__post_init__()`."""
        check_declared(self, f"strategy {self.name}")

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
