"""Virtual-clock discrete-event engine: real gradients, times from the Cluster model.

Every virtual worker keeps its own model copy and computes real gradients on its own
batches; only time is simulated: compute = steps * overhead + samples * FLOPs/sample / FLOP/s,
a transfer = latency + bytes / bandwidth on the worker's path to the PS (queued on the PS's
NIC when the cluster has one, and on the PS process's per-message time `ps_message_s`), a collective = the cluster's ring all-reduce time.

Because a worker's result depends only on the model it was sent, its task is computed eagerly
when it is released and its push is scheduled at the virtual time it would finish. Events at
equal times are ordered by a sequence number, so a run is deterministic for a seed.

Checkpoints (train.checkpoint, on by default with a run directory) are taken between two
events: every train.checkpoint_every server updates, at the end of the run and, on SIGINT /
SIGTERM, before it stops (`RunInterrupted`). They hold the whole state (`Simulator.state`:
`hetrain.engine.checkpoint` format, read without unpickling), so a resumed run
(train.resume) continues exactly as the uncut run would have, row for row (with
DataLoader workers, loader num_workers > 0, a resumed run draws their seeds afresh). Taking
one reads the state only: a run's numbers are the same with checkpoints or without.
"""

from __future__ import annotations

import contextlib
import heapq
import signal
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hetrain.compress import Compressed, ErrorFeedback
from hetrain.context import ProgressFn
from hetrain.engine import codec
from hetrain.engine.checkpoint import (
    ServerState,
    checkpoint_path,
    load_checkpoint,
    save_checkpoint,
)
from hetrain.engine.core import (
    DataOwner,
    Replica,
    Server,
    TaskResult,
    next_task,
)
from hetrain.engine.devices import host_tree
from hetrain.engine.loop import RunLoop
from hetrain.engine.setup import Prepared
from hetrain.engine.signals import RunInterrupted, StopSignal
from hetrain.errors import ConfigError
from hetrain.report.metrics import MetricsLog, RunResult
from hetrain.strategies import Decision, Push, Strategy, WorkTask
from hetrain.workloads import BatchLoader

PUSH_START, PUSH_ARRIVE, COLLECTIVE_DONE = 0, 1, 2


@dataclass
class _InFlight:
    task: WorkTask
    result: TaskResult
    payload: Compressed
    base_version: int
    pull_s: float
    compute_s: float
    push_started_s: float = 0.0


SpeedSchedule = Sequence[tuple[float, int, float]]
"""(time_s, device_index, factor): from virtual time time_s on, the device runs at factor times
its cluster FLOP/s (later entries override earlier ones; a task keeps the speed it started at)."""


class Simulator:
    """Runs one prepared run on a virtual clock (optionally changing device speeds mid-run)."""

    def __init__(self, prep: Prepared, run_dir: Path | None = None,
                 progress: ProgressFn | None = None, speed_schedule: SpeedSchedule = ()) -> None:
        self.p = prep
        for time_s, dev, factor in speed_schedule:
            if not (0 <= dev < prep.cluster.n and factor > 0 and time_s >= 0):
                raise ValueError(f"bad speed_schedule entry {(time_s, dev, factor)}: need "
                                 f"time_s >= 0, 0 <= device < {prep.cluster.n}, factor > 0")
        self.speed_schedule = sorted(speed_schedule, key=lambda e: e[0])
        cfg, cluster, wl = prep.cfg, prep.cluster, prep.workload
        torch.manual_seed(cfg.train.seed)
        self.server = Server(wl.build_model(), prep.strategy.pushes, cfg.optimizer,
                             prep.strategy.outer())
        self.now = 0.0
        self.loop = RunLoop(prep, self.server, self, lambda: self.now, progress)
        init = self.server.params()
        self.replicas = []
        # One loader for the replicas: they run one task at a time in this process, so
        # DataLoader workers (loader num_workers) are shared rather than started per replica.
        self.train_loader = BatchLoader(wl.train, wl.loader)
        for _ in range(cluster.n):
            rep = Replica(wl, wl.build_model(), cfg.optimizer, precision=cfg.train.precision,
                          loader=self.train_loader)
            rep.load(init, self.server.buffers())
            self.replicas.append(rep)
        self.feedback = [ErrorFeedback(prep.compressor) for _ in range(cluster.n)]
        # train.compress_pulls: the server tracks each worker's copy and sends it the compressed
        # difference; what is not sent stays in the next difference (implicit error feedback)
        self.shadow = None
        if cfg.train.compress_pulls and prep.compressor.lossy:
            if not prep.compressor.error_feedback:
                raise ConfigError(f"train.compress_pulls needs a compressor with error feedback "
                                  f"(topk, fp16); '{prep.compressor.name}' is not one")
            self.shadow = [init.clone() for _ in range(cluster.n)]
        self.events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.inflight: dict[int, _InFlight] = {}
        self.ready_at = [0.0] * cluster.n
        self.nic_free = {"in": 0.0, "out": 0.0}
        self.ps_busy_until = 0.0
        self.unreleased: tuple[list[int], float, float] = ([], 0.0, 0.0)
        """The releases of the Decision the run stopped at (not made: the run ended)."""
        self.run_dir = run_dir
        self.checkpointing = run_dir is not None and cfg.train.checkpoint
        """train.checkpoint with a run directory: write runs/<name>/checkpoint.pt."""
        self.checkpoint_pending = False
        self._at = (0.0, 0.0)
        """The time and all-reduce seconds of the Decision being carried out (`_decide`)."""
        self.stop_signal = StopSignal()
        self.resumed = False
        if self.checkpointing or cfg.train.resume:
            codec.allow(type(self.strategy))  # its checkpoints hold it, even if unregistered
        st = self._restore() if cfg.train.resume else None  # before the metrics files change
        if st is None and run_dir is not None and not cfg.train.checkpoint:
            checkpoint_path(run_dir).unlink(missing_ok=True)  # an earlier run's, not this one's
        self.loop.open_log(run_dir)
        if st is not None:
            self.loop.restore_log(st)  # re-writes the metrics files of the run so far

    # The loop's state, by the names callers have always used.
    @property
    def strategy(self) -> Strategy:
        return self.loop.strategy

    @property
    def owner(self) -> DataOwner:
        return self.loop.owner

    @property
    def log(self) -> MetricsLog:
        return self.loop.log

    @property
    def applied_samples(self) -> int:
        return self.loop.applied_samples

    # ---- RunLoop's Engine hooks -------------------------------------------------------------
    def update(self, decision: Decision, items: list[tuple[float, Any, list[Any]]]) -> None:
        self.server.apply(items, decision.lr_scale)
        self.now = self._at[0]

    def release(self, worker: int) -> None:
        self._release(worker, *self._at)

    def checkpoint_due(self) -> None:
        self.checkpoint_pending = True  # taken once this event is handled (`_run`)

    def busy_workers(self) -> set[int]:
        return set(self.inflight)

    def live_workers(self) -> set[int] | None:
        return None

    def sync_model(self) -> None:
        """The server's model is the global model."""

    def evaluated(self, pause_s: float) -> None:
        """Evaluations take no virtual time."""

    # ---- clock model ------------------------------------------------------------------------
    def _schedule(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.events, (t, self._seq, kind, payload))
        self._seq += 1

    def _ps_transfer(self, t: float, w: int, nbytes: int, direction: str) -> float:
        c = self.p.cluster
        link_s = c.ps_link(w).transfer_time_s(nbytes)
        if c.ps_message_s > 0:
            # The PS handles one message at a time: a pull waits for it before the link, a
            # push after (in the order the transfers start, FIFO enough for a model).
            ready = t if direction == "out" else t + link_s
            self.ps_busy_until = max(ready, self.ps_busy_until) + c.ps_message_s
            done = self.ps_busy_until + (link_s if direction == "out" else 0.0)
        else:
            done = t + link_s
        nic = c.ps_nic
        if nic is not None:
            nic_done = max(t, self.nic_free[direction]) + nbytes / nic.bandwidth_Bps
            self.nic_free[direction] = nic_done
            done = max(done, nic_done + nic.latency_s)
        return done

    # ---- protocol -------------------------------------------------------------------------
    def _release(self, w: int, t: float, collective_s: float = 0.0) -> None:
        """Answer w's pull at time t: send the model and its next task, run the task."""
        task = next_task(self.strategy, w, self.server)
        times = self.log.workers[w]
        times.idle_s += max(0.0, t - collective_s - self.ready_at[w])
        params = self.server.params()
        if self.strategy.comm == "ps":
            pull_bytes = self.p.ctx.model_bytes + task.data_bytes
            if self.shadow is not None:  # compressed pull: send what the worker's copy lacks
                sent = self.p.compressor.compress(params - self.shadow[w])
                self.shadow[w] += self.p.compressor.extract(sent)
                params = self.shadow[w].clone()
                pull_bytes += sent.nbytes - self.p.ctx.model_bytes
            start = self._ps_transfer(t, w, pull_bytes, "out")
            times.bytes_received += pull_bytes
        else:
            start = t
        times.comm_s += start - t + collective_s
        rep = self.replicas[w]
        if self.strategy.pushes == "delta" and self.p.cfg.train.local_residual:
            params = self.feedback[w].local_start(params)
        rep.load(params, self.server.buffers())
        batches = [self.loop.owner.take(task.batch_size) for _ in range(task.local_steps)]
        result = rep.run(task, self.strategy.pushes, batches)
        device = self.p.cluster.devices[w]
        factor = next((f for s, d, f in reversed(self.speed_schedule) if d == w and s <= t), 1.0)
        if factor != 1.0:
            device = replace(device, flops=device.flops * factor)
        compute = device.compute_time_s(task.samples, self.p.ctx.flops_per_sample,
                                        task.local_steps)
        times.busy_s += compute
        payload = self.feedback[w].compress(result.update)
        self.inflight[w] = _InFlight(task, result, payload, self.server.version, start - t,
                                     compute)
        self._schedule(start + compute, PUSH_START, w)

    def _push_start(self, w: int, t: float) -> None:
        f = self.inflight[w]
        f.push_started_s = t
        nbytes = f.payload.nbytes
        arrive = self._ps_transfer(t, w, nbytes, "in") if self.strategy.comm == "ps" else t
        times = self.log.workers[w]
        times.comm_s += arrive - t
        times.bytes_sent += nbytes if self.strategy.comm == "ps" else 0
        self._schedule(arrive, PUSH_ARRIVE, w)

    def _push_arrive(self, w: int, t: float) -> None:
        f = self.inflight.pop(w)
        update = self.p.compressor.extract(f.payload)
        self.ready_at[w] = t
        decision = self.loop.on_push(Push(
            worker=w, base_version=f.base_version, samples=f.result.samples,
            steps=f.result.steps, loss=f.result.loss, compute_s=f.compute_s,
            comm_s=f.pull_s + (t - f.push_started_s), arrival_s=t, probe=f.result.probe),
            (update, f.result.buffers, f.result.samples))
        if self.strategy.comm == "allreduce" and decision.apply:
            nbytes = f.payload.nbytes
            ar = self.p.cluster.ring_allreduce_time_s(nbytes, [w for w, _ in decision.apply])
            for member, _ in decision.apply:
                mt = self.log.workers[member]
                mt.bytes_sent += int(2 * nbytes * (self.p.cluster.n - 1) / self.p.cluster.n)
                mt.bytes_received += int(2 * nbytes * (self.p.cluster.n - 1) / self.p.cluster.n)
            self._schedule(t + ar, COLLECTIVE_DONE, (decision, ar))
        else:
            self._decide(decision, t)

    def _decide(self, decision: Decision, t: float, collective_s: float = 0.0) -> None:
        """Carry out a Decision at time t (after an all-reduce of collective_s seconds)."""
        self._at = (t, collective_s)
        if not self.loop.decide(decision):
            # Kept for a resumed run that goes further (a larger stop.max_epochs): it makes
            # these releases first, as this run would have without its stop.
            self.unreleased = (list(decision.release), t, collective_s)

    # ---- main loop --------------------------------------------------------------------------
    def run(self) -> RunResult:
        try:
            return self._run()
        finally:
            self.train_loader.close()
            self.loop.close()

    def _run(self) -> RunResult:
        with self._signals():
            loop = self.loop
            if self.resumed:
                loop.done = loop.should_stop()  # the config may stop later now
                if not loop.done:
                    workers, t, collective_s = self.unreleased
                    self.unreleased = ([], 0.0, 0.0)
                    for w in workers:
                        self._release(w, t, collective_s)
            else:
                loop.evaluate()
                for w in range(self.p.cluster.n):
                    self._release(w, 0.0)
            while self.events and not loop.done:
                t, _, kind, payload = heapq.heappop(self.events)
                if kind == PUSH_START:
                    self._push_start(payload, t)
                elif kind == PUSH_ARRIVE:
                    self._push_arrive(payload, t)
                else:
                    decision, ar = payload
                    self._decide(decision, t, collective_s=ar)
                # Between two events: the state is whole, a checkpoint can be taken.
                if self.checkpoint_pending:
                    self.checkpoint()
                if self.stop_signal.signum is not None:
                    self._interrupted()
            loop.evaluate_last()
            self.checkpoint()
        # Work never applied: tasks in flight at the stop (pushing or not) and pushes buffered
        # at the server that no Decision applied. With applied_samples they account for every
        # sample drawn from the data owner.
        unsent = [(self.inflight[w].result.samples if w in self.inflight else 0)
                  + sum(samples for _, _, samples in loop.buffered[w])
                  for w in range(self.p.cluster.n)]
        return loop.summary(engine="sim", time_s=self.now, unsent=unsent)

    # ---- checkpoints ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        """While a run that checkpoints lasts, SIGINT/SIGTERM are recorded and handled between
        two events (`_interrupted`); a second one stops at once. Without checkpoints Ctrl-C is
        Python's KeyboardInterrupt, as it always was."""
        if not self.checkpointing:
            yield
            return
        with self.stop_signal.installed():
            self.stop_signal.stopping()  # the first signal is recorded, a second one raises
            yield

    def _interrupted(self) -> None:
        path = self.checkpoint()
        signum = self.stop_signal.signum
        assert signum is not None and path is not None
        raise RunInterrupted(f"run '{self.p.cfg.name}' stopped by {signal.Signals(signum).name}"
                             f" at {self.now:.2f} virtual s; checkpoint of its state: {path} "
                             "(continue with the same command and --resume)", signum)

    def checkpoint(self) -> Path | None:
        """Write the whole state to runs/<name>/checkpoint.pt (None: not checkpointing)."""
        self.checkpoint_pending = False
        self.loop.updates_since_ckpt = 0
        if not self.checkpointing:
            return None
        assert self.run_dir is not None
        return save_checkpoint(self.run_dir, self.state())

    def state(self) -> ServerState:
        """Everything a resumed run needs, between two events: the dist engine's fields, and in
        `sim` the replicas, the event queue, the tasks in flight, the buffered pushes, the
        error-feedback residuals, the compressed pulls' shadows, the link clocks and the RNG
        states. Reading it changes nothing (no RNG is drawn)."""
        generator = getattr(self.p.compressor, "generator", None)
        sim = {
            "replicas": [{"model": host_tree(rep.model.state_dict()),
                          "optimizer": host_tree(rep.optimizer.state_dict()),
                          "scaler": dict(vars(rep.scaler))} for rep in self.replicas],
            "residuals": [f.residual for f in self.feedback],
            "shadow": self.shadow,
            "events": list(self.events), "seq": self._seq,
            "inflight": {w: dict(vars(f)) for w, f in self.inflight.items()},
            "buffered": {w: list(q) for w, q in self.loop.buffered.items()},
            "ready_at": list(self.ready_at), "nic_free": dict(self.nic_free),
            "ps_busy_until": self.ps_busy_until, "next_eval_s": self.loop.next_eval_s,
            "recent_losses": list(self.loop.recent_losses), "unreleased": self.unreleased,
            "torch_rng": torch.get_rng_state(),
            "compressor_rng": generator.get_state() if isinstance(generator, torch.Generator)
            else None,
        }
        return self.loop.server_state(elapsed_s=self.now, lost=[], engine="sim", sim=sim)

    def _restore(self) -> ServerState:
        """Continue from runs/<name>/checkpoint.pt (train.resume): everything but the metrics
        log, which the caller restores from the state returned. A checkpoint of another
        workload, cluster, optimizer, strategy or engine, or one whose state does not fit this
        run, is one ConfigError (before any file of the run is touched)."""
        cfg = self.p.cfg
        st = load_checkpoint(self.run_dir, self.loop.strategy.name, cfg.to_dict(), engine="sim")
        path = checkpoint_path(self.run_dir)  # type: ignore[arg-type]
        try:
            self._load_state(st)
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
            why = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            raise ConfigError(f"checkpoint '{path}' does not fit this run ({why}); resume "
                              "with the config that wrote it, or start afresh") from None
        self.resumed = True
        return st

    def _load_state(self, st: ServerState) -> None:
        s, n = st.sim, self.p.cluster.n
        if len(s["replicas"]) != n or len(st.workers) != n:
            raise ValueError(f"it holds {len(s['replicas'])} workers, the cluster has {n}")
        self.loop.restore(st)
        for rep, r in zip(self.replicas, s["replicas"], strict=True):
            rep.model.load_state_dict(r["model"])
            rep.optimizer.load_state_dict(r["optimizer"])
            rep.scaler.__dict__.update(r["scaler"])
        for f, residual in zip(self.feedback, s["residuals"], strict=True):
            f.residual = residual
        if self.shadow is not None:
            self.shadow = s["shadow"] or [self.server.params() for _ in range(n)]
        self.events = [tuple(e) for e in s["events"]]
        heapq.heapify(self.events)  # already a heap, unless the file was edited
        self._seq = s["seq"]
        self.inflight = {w: _InFlight(**f) for w, f in s["inflight"].items()}
        self.loop.buffered = {w: deque(s["buffered"].get(w, ())) for w in range(n)}
        self.ready_at, self.nic_free = list(s["ready_at"]), dict(s["nic_free"])
        self.ps_busy_until, self.loop.next_eval_s = s["ps_busy_until"], s["next_eval_s"]
        self.loop.recent_losses = list(s["recent_losses"])
        workers, t, collective_s = s["unreleased"]
        self.unreleased = (list(workers), float(t), float(collective_s))
        self.now = st.elapsed_s
        generator = getattr(self.p.compressor, "generator", None)
        if isinstance(generator, torch.Generator) and s["compressor_rng"] is not None:
            generator.set_state(s["compressor_rng"])
        torch.set_rng_state(s["torch_rng"])
        if not (isinstance(st.rows, list) and st.rows and len(st.tta) == 2):
            raise ValueError("it holds no evaluation rows")


def simulate(prep: Prepared, run_dir: Path | None = None,
             progress: ProgressFn | None = None, speed_schedule: SpeedSchedule = ()) -> RunResult:
    return Simulator(prep, run_dir, progress, speed_schedule).run()
