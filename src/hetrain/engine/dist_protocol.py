"""How rank 0 of a dist run moves the model: the parameter-server or the all-reduce protocol.

The coordinator (`engine.dist_server`) runs one loop for every strategy; what depends on the
strategy's comm is one of these objects: what a task message carries, what a push brings,
one server update, where the global model is when rank 0 evaluates or checkpoints, what the
workers report of their bytes, and whether a run can go on without a lost worker.

- `PSProtocol` (comm = "ps"): rank 0 (with the PS shards, `ShardFanout`) holds the global
  model; a task carries the parameters, a push the compressed update, which rank 0 applies.
- `AllReduceProtocol` (comm = "allreduce"): the workers hold identical copies and all-reduce
  their weighted updates among themselves; rank 0 sends each its weight with its next task
  (or on its own, `flush`) and pulls the model from a worker when it needs it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from hetrain.engine.core import Buffered, plateau_factor
from hetrain.engine.devices import host_tree
from hetrain.engine.messages import Apply, Push, State, Task, expect, present
from hetrain.engine.signals import WorkerLostError
from hetrain.report.metrics import WorkerTimes
from hetrain.strategies import Decision

if TYPE_CHECKING:
    from hetrain.engine.dist_server import Coordinator


class CommProtocol:
    """The protocol-dependent part of the coordinator `c` (whose server, links and worker
    sets it uses)."""

    checkpoint_before_drain = True
    """On SIGINT/SIGTERM: checkpoint before collecting the tasks in flight (the model is at
    rank 0), or after (an all-reduce worker has it once it is waiting)."""

    def __init__(self, c: Coordinator) -> None:
        self.c = c

    def setup_state(self) -> dict[str, Any] | None:
        """The model state a worker starts from (None: its task brings the parameters)."""
        return None

    def fill_task(self, w: int, msg: Task) -> Task:
        """Worker w's task message with what it carries besides the task and its batches."""
        return msg

    def task_sent(self, w: int, nbytes: int) -> None:
        """Worker w was sent a task message of nbytes."""

    def push_item(self, w: int, msg: Push, nbytes: int) -> Buffered:
        """Worker w's push (a message of nbytes) as the server buffers it."""
        raise NotImplementedError

    def take_bytes(self, mine: WorkerTimes, times: dict[str, Any]) -> None:
        """A worker's cumulative times report, for its bytes."""

    def update(self, decision: Decision, items: list[tuple[float, Any, list[Any]]]) -> None:
        """Carry out one server update."""
        raise NotImplementedError

    def sync_model(self) -> None:
        """Bring the global model to rank 0 (before an evaluation)."""
        raise NotImplementedError

    def model_for_checkpoint(self) -> bool:
        """Bring the model to rank 0 for a checkpoint; False if no worker can send it."""
        return True

    def on_lost(self, decision: Decision | None) -> None:
        """The strategy's Decision after a worker was lost."""

    def blocked(self) -> str | None:
        """Why the run cannot go on (None: it can)."""
        return None

    def flush(self) -> None:
        """Send what is pending before the workers are stopped."""


class PSProtocol(CommProtocol):
    """comm = "ps": rank 0 and the PS shards hold the global model and apply the pushes."""

    def fill_task(self, w: int, msg: Task) -> Task:
        c = self.c
        c.base_version[w] = c.server.version
        return dataclasses.replace(msg, params=c.server.params(), buffers=c.server.buffers(),
                                   version=c.server.version)

    def task_sent(self, w: int, nbytes: int) -> None:
        self.c.log.workers[w].bytes_received += nbytes

    def push_item(self, w: int, msg: Push, nbytes: int) -> Buffered:
        times = self.c.log.workers[w]
        sent, received = msg.shard_bytes or (0, 0)  # its messages with the shards
        times.bytes_sent += nbytes + sent
        times.bytes_received += received
        return (self.c.p.compressor.extract(present(msg.payload, msg, "payload")),
                present(msg.buffers, msg, "buffers"), present(msg.samples, msg, "samples"))

    def update(self, decision: Decision, items: list[tuple[float, Any, list[Any]]]) -> None:
        c = self.c
        factor = plateau_factor(c.server)   # of this update, before it is applied
        c.server.apply(items, decision.lr_scale)
        c.shards.send(Apply(items=list(decision.apply), lr_factor=factor,
                            lr_scale=decision.lr_scale))

    def sync_model(self) -> None:
        if self.c.server.version > 0:
            self.c.shards.gather()

    def on_lost(self, decision: Decision | None) -> None:
        if decision is not None:
            self.c.loop.decide(decision)


class AllReduceProtocol(CommProtocol):
    """comm = "allreduce": the workers all-reduce their updates; rank 0 sends the weights."""

    checkpoint_before_drain = False

    def __init__(self, c: Coordinator) -> None:
        super().__init__(c)
        self.pending_apply: dict[int, float] = {}
        """Each live worker's weight in the last all-reduced update, not yet sent to it."""
        self.pending_factor: float | None = None
        """ReduceLROnPlateau: the factor of the pending update (core.plateau_factor)."""

    def setup_state(self) -> dict[str, Any] | None:
        server = self.c.server
        return {"model": host_tree(server.model.state_dict()),
                "optimizer": host_tree(server.optimizer.state_dict()),
                "version": server.version}

    def fill_task(self, w: int, msg: Task) -> Task:
        if w not in self.pending_apply:
            return msg
        return dataclasses.replace(msg, apply_weight=self.pending_apply.pop(w),
                                   lr_factor=self.pending_factor)

    def push_item(self, w: int, msg: Push, nbytes: int) -> Buffered:
        return None, [], present(msg.samples, msg, "samples")  # the update stays with the worker

    def take_bytes(self, mine: WorkerTimes, times: dict[str, Any]) -> None:
        mine.bytes_sent, mine.bytes_received = times["bytes_sent"], times["bytes_received"]

    def update(self, decision: Decision, items: list[tuple[float, Any, list[Any]]]) -> None:
        c = self.c
        weights = dict(decision.apply)
        missing = sorted(c.live - set(weights))
        if missing:
            raise RuntimeError(f"strategy '{c.strategy.name}' (comm=allreduce) applied without"
                               f" live workers {missing}: a collective needs every live worker")
        # Sent with each worker's next task (one message per round instead of two), or on
        # its own before anything else needs the all-reduced model (`flush`).
        self.pending_apply = {w: float(weights[w]) for w in sorted(c.live)}
        self.pending_factor = plateau_factor(c.server)
        c.server.version += 1

    def flush(self) -> None:
        c = self.c
        for w, weight in sorted(self.pending_apply.items()):
            if w in c.live:
                c.outbox.send(Apply(weight=weight, lr_factor=self.pending_factor), w + 1)
        self.pending_apply = {}

    def pull_state(self, src: int | None = None) -> None:
        """Fetch the global model from a waiting worker (default: the first live one)."""
        c = self.c
        self.flush()
        src = min(c.live) if src is None else src
        c.outbox.send(State(), src + 1)
        kind, _, obj, _ = c.inbox.request(src + 1, c.cfg.dist.worker_timeout_s)
        if kind == "lost":
            raise WorkerLostError(f"worker {src} was lost while sending the model: {obj}")
        state = expect(obj, State)
        c.server.model.load_state_dict(present(state.model, state, "model"))
        c.server.optimizer.load_state_dict(present(state.optimizer, state, "optimizer"))

    def sync_model(self) -> None:
        if self.c.server.version > 0:
            self.pull_state()

    def model_for_checkpoint(self) -> bool:
        c = self.c
        if c.server.version > 0:
            waiting = sorted(c.live - c.busy)
            if not waiting:
                return False
            self.pull_state(waiting[0])
        return True

    def blocked(self) -> str | None:
        if self.c.lost:
            return "a collective strategy cannot go on without its lost worker(s)"
        return None


def protocol_for(c: Coordinator) -> CommProtocol:
    """The protocol of the run's strategy (its comm)."""
    return AllReduceProtocol(c) if c.strategy.comm == "allreduce" else PSProtocol(c)
