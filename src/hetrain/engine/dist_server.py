"""Rank 0 of a dist run: the parameter server, data owner and coordinator of every strategy.

The `Coordinator` drives the `RunLoop` the simulator drives too (engine.loop: pushes buffered,
Decisions carried out, evaluations, the stop rule, the summary) with wall-clock time and
torch.distributed messages. Its collaborators: the comm protocol of the strategy
(engine.dist_protocol: `PSProtocol` or `AllReduceProtocol`), the PS shards' fan-out
(`dist_shard.ShardFanout`) and the checkpoints (`dist_checkpoints.Checkpoints`).

comm = "ps": rank 0 holds the global model (`Server`) and the strategy. A released worker is
sent (params + float buffers, its WorkTask, the sample indices the DataOwner drew for it);
it answers with (its update, compressed as configured, + metadata). Pushes are received from
whichever worker finishes first (`Inbox`), handed to `strategy.on_push`, and the Decision is
carried out exactly as the simulator does it (same RunLoop, Server and DataOwner order).

comm = "allreduce": the workers hold identical copies of the global model and all-reduce
their weighted updates among themselves (a process group of ranks 1..n); rank 0 still runs
the strategy on the pushes' metadata (a few hundred bytes), draws the samples, tells the
workers the weights, and pulls the model from one worker when it evaluates or checkpoints.

With `dist.ps_shards = S > 1` (PS strategies) rank 0 holds only block 0 of the parameters
and ranks n+1..n+S-1 the others (`dist_shard`): a task carries block 0 and the version the
worker must pull from the shards, each applied Decision is forwarded to the shards as an
ordered "apply" command, and evaluations / checkpoints fetch the shards' blocks first.

A worker whose push does not come within `dist.worker_timeout_s`, or whose connection breaks,
is dropped with a log line and `strategy.on_worker_lost(w)` is called; if the strategy then
waits for nobody (a barrier missing the lost worker), the run checkpoints and stops with
`WorkerLostError`; if every worker is lost it says so, with the checkpoint. While a slot is
free, a replacement process may take it (`hetrain join`, hetrain.engine.join): it gets the
setup a starting worker gets, `strategy.on_worker_joined(w)` is called, and it is sent tasks
through its private link; the summary lists the joins. SIGINT/SIGTERM
checkpoint the last applied update and stop the workers (`RunInterrupted`). Time is
wall-clock seconds since the start, minus the pauses of rank 0's own evaluations (the
simulator's evaluations take no virtual time either).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from hetrain.context import ProgressFn
from hetrain.engine import codec, messages
from hetrain.engine.core import Server, next_task
from hetrain.engine.dist_checkpoints import Checkpoints
from hetrain.engine.dist_protocol import protocol_for
from hetrain.engine.dist_shard import ShardFanout
from hetrain.engine.join import POLL_S, Admitted, JoinDesk
from hetrain.engine.loop import RunLoop
from hetrain.engine.messages import Drop, Message, Ready, Report, Setup, Stop, Task, present
from hetrain.engine.setup import Prepared
from hetrain.engine.signals import WORKER_GRACE_S, RunInterrupted, StopSignal, WorkerLostError
from hetrain.engine.wire import Inbox, Link, Outbox, send_obj, set_message_limit
from hetrain.errors import ConfigError
from hetrain.plan.noise import GradProbe
from hetrain.report.metrics import MetricsLog, RunResult
from hetrain.strategies import Decision, Push, Strategy

log = logging.getLogger("hetrain.dist")


class Coordinator:
    """Rank 0's loop. Workers are 0..n-1 (ranks 1..n)."""

    def __init__(self, prep: Prepared, run_dir: Path | None, progress: ProgressFn | None,
                 emulation: dict[str, Any], ps_device: torch.device | None = None,
                 joins: JoinDesk | None = None) -> None:
        self.p, self.cfg = prep, prep.cfg
        codec.allow(type(prep.strategy))  # its checkpoints hold it, even if unregistered
        self.emulation = emulation
        n = prep.cluster.n
        torch.manual_seed(self.cfg.train.seed)
        self.device = ps_device or torch.device("cpu")
        """Where the global model lives, is updated and evaluated (dist.ps_device)."""
        model = prep.workload.build_model().to(self.device)
        self.shards = ShardFanout(model, self.cfg.dist.ps_shards, n)
        self.server = Server(model, prep.strategy.pushes, self.cfg.optimizer,
                             prep.strategy.outer(), owned=self.shards.blocks[0])
        self.loop = RunLoop(prep, self.server, self, self.clock, progress)
        self.loop.open_log(run_dir)
        self.checkpoints = Checkpoints(run_dir, self.cfg, self.loop)
        self.protocol = protocol_for(self)
        self.stop_signal = StopSignal()
        self.inbox = Inbox([w + 1 for w in range(n)] + self.shards.ranks, self.stop_signal)
        self.links: dict[int, Link] = {}
        """Joined workers' private links, by rank (the others are default-group ranks)."""
        self.outbox = Outbox(self.links)
        self.shards.connect(self.outbox, self.inbox, self.cfg.dist.worker_timeout_s)
        self.joins = joins
        self.joining: set[int] = set()
        """Joined workers sent their setup, whose "ready" has not come yet."""
        self.joined: list[dict[str, Any]] = []
        self.times_base: dict[int, tuple[float, float, float]] = {}
        """A joined worker's slot: the busy/comm/idle seconds of the processes before it."""
        set_message_limit(prep.ctx.model_bytes)
        self.live = set(range(n))
        self.lost: list[int] = []
        self.busy: set[int] = set()
        self.base_version = [0] * n
        self.drawn_by = [0] * n
        """Samples handed to each worker in this process; less those applied from it
        (`RunLoop.applied_by`): its unsent work (in flight at the stop, buffered but never
        applied, or lost with it)."""
        self.overruns = [0] * n
        self.eval_pause_s = 0.0
        self.offset_s = 0.0
        self.t0 = time.perf_counter()
        self.error: str | None = None
        """Why the run cannot go on (it then checkpoints and raises WorkerLostError)."""
        self.worker_devices = ["?"] * n
        """The torch device each worker reported when it was ready."""
        self.model_time_scale = (emulation.get("time_scale", 1.0)
                                 if emulation.get("mode", "none") != "none" else 1.0)
        """Wall seconds per Cluster-model second (what Push times are divided by)."""

    # The loop's state, by short names.
    @property
    def strategy(self) -> Strategy:
        return self.loop.strategy

    @property
    def log(self) -> MetricsLog:
        return self.loop.log

    # ---- clock -------------------------------------------------------------------------
    def clock(self) -> float:
        return self.offset_s + time.perf_counter() - self.t0 - self.eval_pause_s

    # ---- RunLoop's Engine hooks -------------------------------------------------------------
    def sync_model(self) -> None:
        self.protocol.sync_model()

    def update(self, decision: Decision, items: list[tuple[float, Any, list[Any]]]) -> None:
        self.protocol.update(decision, items)
        self.checkpoints.snapshot()

    def release(self, worker: int) -> None:
        if worker in self.live:
            self._release(worker)

    def checkpoint_due(self) -> None:
        self.checkpoint()

    def busy_workers(self) -> set[int]:
        return set(self.busy)

    def live_workers(self) -> set[int] | None:
        return set(self.live)

    def evaluated(self, pause_s: float) -> None:
        """The clock leaves out rank 0's evaluations; so do the workers' deadlines."""
        self.eval_pause_s += pause_s
        for w in self.busy:
            self.inbox.postpone(w + 1, pause_s)

    # ---- setup / resume -------------------------------------------------------------------
    def _restore(self) -> None:
        st = self.checkpoints.load(len(self.shards.blocks))
        self.loop.restore(st)
        self.offset_s = st.elapsed_s
        self.shards.optimizers = st.shard_optimizers
        self.loop.restore_log(st)  # re-writes the metrics files the run had so far
        # Lost workers are not restored: a resumed run starts every worker process afresh.
        log.info("resumed '%s' at update %d, %.2f epochs, %.1f s", self.cfg.name, st.version,
                 self.loop.applied_samples / self.p.ctx.train_samples, st.elapsed_s)

    def checkpoint(self) -> Path | None:
        """Save the server state as of the last update; None if there is no run dir or no
        worker left to fetch an all-reduced model from."""
        if not self.checkpoints.enabled or not self.protocol.model_for_checkpoint():
            return None
        shard_optimizers = self.shards.gather()
        return self.checkpoints.save(elapsed_s=self.clock(), lost=list(self.lost),
                                     shard_optimizers=shard_optimizers)

    def _send_setup(self) -> None:
        self.shards.setup(self.strategy.pushes, self.strategy.outer(), self.server.version)
        shards = {"ranks": self.shards.ranks, "sizes": self.shards.sizes}
        state = self.protocol.setup_state()
        for w in sorted(self.live):
            self.outbox.send(self._setup_msg(w, state, shards), w + 1)

    def _setup_msg(self, w: int, state: dict[str, Any] | None,
                   shards: dict[str, Any]) -> Setup:
        return Setup(worker=w, cluster=self.p.cluster,
                     flops_per_sample=self.p.ctx.flops_per_sample,
                     update=self.strategy.pushes, comm=self.strategy.comm,
                     outer=self.strategy.outer(), emulation=self.emulation,
                     state=state, shards=shards)

    def _await_ready(self) -> None:
        """Start the clock only when every worker has built its replica (a send to a worker
        that is not yet receiving blocks)."""
        for w in sorted(self.live):
            self.inbox.expect(w + 1, self.cfg.dist.init_timeout_s)
        errors = []
        while self.inbox.waiting:
            kind, src, obj, _ = self.inbox.next()
            self._check_source(src, kind, obj)
            if kind == "lost":
                self._on_lost(src - 1, obj)
            elif isinstance(obj, Ready) and obj.error is not None:
                errors.append(obj.error)  # it cannot run as configured (e.g. its device)
            else:
                self.worker_devices[src - 1] = _device(obj)
        if errors:
            self._stop_workers()
            raise ConfigError(errors[0])

    # ---- protocol -------------------------------------------------------------------------
    def _release(self, w: int) -> None:
        task = next_task(self.strategy, w, self.server)
        batches = [self.loop.owner.take(task.batch_size) for _ in range(task.local_steps)]
        self.drawn_by[w] += task.samples
        msg = self.protocol.fill_task(w, Task(task=task, batches=batches))
        self.protocol.task_sent(w, self.outbox.send(msg, w + 1))
        self.busy.add(w)
        self.inbox.expect(w + 1, self.cfg.dist.worker_timeout_s)

    def _on_push(self, w: int, obj: Message, nbytes: int) -> None:
        msg = messages.expect(obj, messages.Push)
        # read before anything changes: a MessageError drops this worker (see the loop above)
        samples, steps = present(msg.samples, msg, "samples"), present(msg.steps, msg, "steps")
        loss, compute_s = present(msg.loss, msg, "loss"), present(msg.compute_s, msg, "compute_s")
        comm_s, _ = present(msg.comm_s, msg, "comm_s"), present(msg.times, msg, "times")
        self.busy.discard(w)
        self._take_times(w, obj)
        item = self.protocol.push_item(w, msg, nbytes)
        # Strategies plan on the Cluster's clock: an emulated run is `time_scale` times faster.
        k = 1.0 / self.model_time_scale
        decision = self.loop.on_push(Push(
            worker=w, base_version=self.base_version[w], samples=samples, steps=steps,
            loss=loss, compute_s=k * compute_s, comm_s=k * comm_s, arrival_s=k * self.clock(),
            probe=GradProbe(*msg.probe) if msg.probe is not None else None), item)
        self.loop.decide(decision)

    def _take_times(self, w: int, msg: Message) -> None:
        """Workers report their cumulative busy/comm/idle seconds with every message (a
        joined worker's add to those of the slot's earlier processes)."""
        if not isinstance(msg, Report):
            raise messages.MessageError(f"worker {w} sent a '{msg.kind}' message to rank 0")
        times, mine = present(msg.times, msg, "times"), self.log.workers[w]
        busy, comm, idle = self.times_base.get(w, (0.0, 0.0, 0.0))
        mine.busy_s, mine.comm_s, mine.idle_s = (busy + times["busy_s"], comm + times["comm_s"],
                                                 idle + times["idle_s"])
        self.protocol.take_bytes(mine, times)
        self.overruns[w] = msg.overruns if msg.overruns is not None else 0

    def _check_source(self, src: int, kind: str, obj: Any) -> None:
        if src in self.shards.ranks:  # a shard only ever answers a request, or fails
            raise WorkerLostError(f"parameter-server shard rank {src} failed: {kind} {obj}")

    def _on_lost(self, w: int, reason: str) -> None:
        if w in self.joining:
            self._join_failed(w, reason)
            return
        self.outbox.forget(w + 1)
        self.links.pop(w + 1, None)
        self.live.discard(w)
        self.busy.discard(w)
        self.lost.append(w)
        self.loop.buffered[w].clear()
        self.shards.send(Drop(worker=w))
        name = self.p.cluster.devices[w].name
        log.warning("hetrain: worker %d (rank %d, device %s) lost: %s; dropped, %d worker(s) "
                    "remain", w, w + 1, name, reason, len(self.live))
        if not self.live:
            self.error = (f"all {self.p.cluster.n} workers were lost (the last, worker {w} on "
                          f"{name}: {reason})")
            return
        self._publish_slots()
        self.protocol.on_lost(self.strategy.on_worker_lost(w))

    # ---- joins (hetrain.engine.join) ------------------------------------------------------
    def _free_slots(self) -> list[int]:
        return sorted(set(range(self.p.cluster.n)) - self.live - self.joining)

    def _publish_slots(self) -> None:
        if self.joins is not None:
            self.joins.publish(self._free_slots())

    def _poll_joins(self) -> None:
        """Admit the joiners that proved the secret since the last look (cheap: the desk
        asks the store for new requests only while a slot is free, every POLL_S)."""
        if self.joins is None:
            return
        admitted, _ = self.joins.poll(self._free_slots())
        for a in admitted:
            self._admit(a)

    def _admit(self, a: Admitted) -> None:
        """Send a joiner the setup a starting worker gets; it runs tasks once "ready"."""
        w, rank = a.worker, a.worker + 1
        self.links[rank] = a.link
        self.outbox.forget(rank)
        self.inbox.add(rank, a.link)
        self.joining.add(w)
        self.outbox.send(self._setup_msg(w, None, {"ranks": [],
                                                   "sizes": self.shards.sizes[:1]}), rank)
        self.inbox.expect(rank, self.cfg.dist.init_timeout_s)
        log.warning("hetrain: join request %d authenticated: worker %d (device %s) is "
                    "setting up", a.ticket, w, self.p.cluster.devices[w].name)

    def _on_ready(self, w: int, msg: Message) -> None:
        """A joiner built its replica: it is a live worker of its slot from now on."""
        self.joining.discard(w)
        if not isinstance(msg, Ready):
            self._join_failed(w, f"it sent a '{msg.kind}' message before 'ready'")
            return
        if msg.error is not None:  # it cannot run as configured: stop it, the slot stays free
            self.outbox.wait(w + 1)
            send_obj(Stop(), self.links[w + 1])
            self._join_failed(w, msg.error)
            return
        mine = self.log.workers[w]
        self.times_base[w] = (mine.busy_s, mine.comm_s, mine.idle_s)
        self.worker_devices[w] = _device(msg)
        self.live.add(w)
        self.joined.append({"worker": w, "time_s": self.clock(),
                            "version": self.server.version,
                            "applied_samples": self.loop.applied_samples,
                            "pushes_before": mine.pushes,
                            "applied_before": self.loop.applied_by[w]})
        self._publish_slots()
        log.warning("hetrain: worker %d (rank %d, device %s) joined at update %d; %d worker(s) "
                    "live", w, w + 1, self.p.cluster.devices[w].name, self.server.version,
                    len(self.live))
        decision = self.strategy.on_worker_joined(w)
        if decision is not None:
            self.loop.decide(decision)

    def _join_failed(self, w: int, reason: str) -> None:
        self.joining.discard(w)
        self.links.pop(w + 1, None)
        self.outbox.forget(w + 1)
        self.inbox.drop(w + 1)
        log.warning("hetrain: joiner of worker %d failed before it was ready: %s", w, reason)
        self._publish_slots()

    # ---- main loop ------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Train to the stop condition. SIGINT/SIGTERM (`hetrain.engine.signals`) checkpoint
        and stop the workers, then raise RunInterrupted; a run that cannot go on (its barrier
        lost a worker, or no worker is left) checkpoints and raises WorkerLostError. The
        TensorBoard events are closed however the run ends."""
        try:
            return self._run()
        finally:
            self.loop.close()
            if self.joins is not None:
                self.joins.close()

    def _run(self) -> RunResult:
        with self.stop_signal.installed():
            try:
                self._start()
            except RunInterrupted as e:
                raise RunInterrupted(f"run '{self.cfg.name}' {e} before training started; "
                                     "nothing to checkpoint", e.signum) from None
            interrupted: RunInterrupted | None = None
            try:
                self._loop()
            except RunInterrupted as e:
                interrupted = e
            self.stop_signal.stopping()  # a second signal from here on stops at once
            if interrupted is not None:
                self._stop_interrupted(interrupted)
            return self._finish()

    def _start(self) -> None:
        if self.cfg.train.resume:
            self._restore()
        self.checkpoints.snapshot()
        self._send_setup()
        self._await_ready()
        self._publish_slots()  # `hetrain join` may take a slot from now on
        self.t0 = time.perf_counter()
        if not self.log.rows:
            self.loop.evaluate()
        for w in sorted(self.live):
            self._release(w)

    def _loop(self) -> None:
        while not self.loop.done and self.error is None:
            blocked = self.protocol.blocked()
            if blocked is not None:
                self.error = blocked
                break
            if not self.inbox.waiting:
                self.error = (f"strategy '{self.strategy.name}' waits for pushes that cannot "
                              f"come (lost workers {self.lost})")
                break
            self._poll_joins()
            ev = self.inbox.next_within(POLL_S if self.joins is not None
                                        and self._free_slots() else None)
            if ev is None:
                continue
            kind, src, obj, nbytes = ev
            self._check_source(src, kind, obj)
            if kind == "lost":
                self._on_lost(src - 1, obj)
            else:
                try:
                    if src - 1 in self.joining:
                        self._on_ready(src - 1, obj)
                    else:
                        self._on_push(src - 1, obj, nbytes)
                except messages.MessageError as e:  # well encoded, but not what it must carry
                    self._on_lost(src - 1, f"rank {src} sent a malformed message: {e}")

    def _finish(self) -> RunResult:
        end_s = self.clock()
        if self.joins is not None:
            self.joins.close()
        if self.error is None:
            self.loop.evaluate_last()
        self._drain()
        ckpt = self._try_checkpoint()
        self._stop_workers()
        if self.error is not None:
            raise WorkerLostError(f"run '{self.cfg.name}' stopped: {self.error}"
                                  f"{self.checkpoints.where(ckpt)}")
        return self._summary(end_s)

    def _stop_interrupted(self, e: RunInterrupted) -> None:
        """Checkpoint the last update and stop the workers, without waiting long for tasks
        in flight (their samples were not applied and are drawn again on resume)."""
        log.warning("hetrain: %s; checkpointing and stopping the workers", e)
        first = self.protocol.checkpoint_before_drain  # the server has the model
        ckpt = self._try_checkpoint() if first else None
        self.inbox.cap(WORKER_GRACE_S)
        self._drain()
        if not first:  # a waiting worker has it
            ckpt = self._try_checkpoint()
        self._stop_workers(WORKER_GRACE_S)
        raise RunInterrupted(f"run '{self.cfg.name}' {e}{self.checkpoints.where(ckpt)}",
                             e.signum)

    def _try_checkpoint(self) -> Path | None:
        try:
            return self.checkpoint()
        except WorkerLostError as e:
            log.warning("hetrain: no checkpoint: %s", e)
            return None

    def _drain(self) -> None:
        """Collect the in-flight pushes; their samples are not applied (the run has ended)."""
        while self.inbox.waiting:
            kind, src, obj, _ = self.inbox.next()
            self._check_source(src, kind, obj)
            if kind == "lost":
                self._on_lost_quiet(src - 1, obj)
            else:
                self.busy.discard(src - 1)
                self._take_times(src - 1, obj)

    def _stop_workers(self, timeout_s: float | None = None) -> None:
        timeout_s = timeout_s or self.cfg.dist.worker_timeout_s
        self.protocol.flush()
        self.live |= self.joining  # a joiner still setting up is stopped like the others
        self.joining.clear()
        for w in sorted(self.live):
            self.outbox.send(Stop(), w + 1)
            self.inbox.expect(w + 1, timeout_s)
        while self.inbox.waiting:
            kind, src, obj, _ = self.inbox.next()
            if kind == "msg":
                self._take_times(src - 1, obj)
        self.shards.stop(timeout_s)  # after the workers, which said bye to them too
        self.outbox.wait_all()

    def _on_lost_quiet(self, w: int, reason: str) -> None:
        """Lost while the run was ending: nothing to re-plan, its task was not needed."""
        log.warning("hetrain: worker %d (rank %d) lost while the run was ending: %s", w, w + 1,
                    reason)
        self.outbox.forget(w + 1)
        self.live.discard(w)
        self.lost.append(w)
        self.shards.send(Drop(worker=w))

    def _summary(self, end_s: float) -> RunResult:
        em = self.emulation
        return self.loop.summary(
            engine="dist", time_s=end_s,
            unsent=[drawn - applied for drawn, applied in zip(self.drawn_by,
                                                              self.loop.applied_by, strict=True)],
            ideal_scale=em.get("time_scale", 1.0) if em.get("mode") != "none" else 1.0,
            emulation=em, lost_workers=self.lost,
            joined_workers=[j["worker"] for j in self.joined], joins=self.joined,
            applied_samples_by_worker=list(self.loop.applied_by),
            ps_shards=len(self.shards.blocks), emulation_overruns=self.overruns,
            eval_pause_s=self.eval_pause_s, ps_device=str(self.device),
            worker_devices=self.worker_devices)


def _device(msg: Message) -> str:
    """The torch device a worker's "ready" names (one that names none runs on the CPU)."""
    return msg.device if isinstance(msg, Ready) and msg.device is not None else "cpu"
