"""The run loop both engines drive: what the server side decides, once for both.

The simulator (`engine.sim`, a virtual clock) and rank 0 of the torch.distributed engine
(`engine.dist_server`, wall-clock seconds) differ in how they keep time and move tensors. What
they do with a push is the same, and lives here: the pushes buffered until a Decision applies
them, the Decision carried out (`RunLoop.decide`: every Decision of a run passes there), the
applied samples, the evaluation schedule (every train.eval_every_epochs or eval_every_s), an
evaluation's metrics row and the plateau schedule it feeds, the stop rule, when a checkpoint
is due, the checkpointed fields of the server state, the resumed state and the run summary.
Each engine hands a `RunLoop` its clock and itself as the `Engine` whose hooks carry out what
moves tensors or takes time (one server update, a release, a checkpoint, the global model
brought to rank 0 before an evaluation).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from hetrain.context import ProgressFn
from hetrain.engine.checkpoint import ServerState
from hetrain.engine.core import (
    Buffered,
    DataOwner,
    Server,
    observe_evaluations,
    schedule_metrics,
    take_applied,
)
from hetrain.engine.devices import host_tree
from hetrain.engine.setup import Prepared
from hetrain.report.metrics import MetricsLog, RunResult, WorkerTimes
from hetrain.strategies import Decision, Push, check_decision
from hetrain.workloads import BatchLoader, evaluate_workload


class Engine(Protocol):
    """What a `RunLoop` asks of the engine that drives it."""

    def update(self, decision: Decision, items: list[tuple[float, Any, list[Any]]]) -> None:
        """Carry out one server update: `items` are the applied pushes' (weight, update,
        buffers), popped from the buffer (a PS steps the server on them; an all-reduce
        run's workers combine their own updates with the Decision's weights)."""

    def release(self, worker: int) -> None:
        """Send `worker` its next task (and the model it starts from)."""

    def checkpoint_due(self) -> None:
        """train.checkpoint_every updates were applied since the last checkpoint."""

    def busy_workers(self) -> set[int]:
        """The workers running a task now (released, their push not yet received)."""

    def live_workers(self) -> set[int] | None:
        """The workers not lost (None: every worker; the simulator loses none)."""

    def sync_model(self) -> None:
        """Make `server.model` the global model before an evaluation (the simulator's always
        is; rank 0 of dist fetches the PS shards' blocks or an all-reduce worker's copy)."""

    def evaluated(self, pause_s: float) -> None:
        """An evaluation took `pause_s` wall seconds (dist leaves them out of its clock)."""


class RunLoop:
    """The server side's state and rules, shared by the simulator and the dist coordinator:
    the strategy, the global model's `Server`, the data owner, the metrics log, the applied
    samples, the evaluation schedule and the stop rule."""

    def __init__(self, prep: Prepared, server: Server, engine: Engine,
                 clock: Callable[[], float], progress: ProgressFn | None = None) -> None:
        cfg = prep.cfg
        self.p, self.server, self.engine, self.clock = prep, server, engine, clock
        self.progress = progress
        self.strategy = prep.strategy
        self.owner = DataOwner(prep.ctx.train_samples, cfg.train.seed)
        self.buffered: dict[int, deque[Buffered]] = {w: deque() for w in range(prep.cluster.n)}
        """Pushes received and not yet applied, oldest first, by worker."""
        self.applied_samples = 0
        self.applied_by = [0] * prep.cluster.n
        """Samples applied from each worker's pushes (in this process)."""
        self.updates_since_ckpt = 0
        self.max_samples = int(cfg.stop.max_epochs * prep.ctx.train_samples)
        self.eval_every = max(1, int(cfg.train.eval_every_epochs * prep.ctx.train_samples))
        self.next_eval = 0
        self.eval_every_s = cfg.train.eval_every_s
        self.next_eval_s = 0.0
        self.recent_losses: list[float] = []
        """Training losses of the pushes since the last evaluation (its train_loss)."""
        self.done = False
        self._log: MetricsLog | None = None
        self._test_loader: BatchLoader | None = None

    # ---- metrics log ------------------------------------------------------------------------
    def open_log(self, run_dir: Path | None) -> MetricsLog:
        """Start the metrics files (truncating an earlier run's: the simulator restores its
        checkpoint first, so a checkpoint that does not fit leaves them untouched)."""
        cfg = self.p.cfg
        self._log = MetricsLog(cfg.name, [WorkerTimes(d.name) for d in self.p.cluster.devices],
                               run_dir, cfg.stop.target_accuracy, cfg.stop.target_loss,
                               tensorboard=cfg.train.tensorboard)
        return self._log

    @property
    def log(self) -> MetricsLog:
        assert self._log is not None, "open_log first"
        return self._log

    def close(self) -> None:
        if self._test_loader is not None:
            self._test_loader.close()
        if self._log is not None:
            self._log.close()

    # ---- pushes and decisions ---------------------------------------------------------------
    def on_push(self, push: Push, item: Buffered) -> Decision:
        """A worker's push arrived: hold its update until a Decision applies it, count its
        samples, and ask the strategy what to do (the Decision is not carried out yet: the
        simulator first waits for an all-reduce's time; `decide` carries it out)."""
        self.buffered[push.worker].append(item)
        times = self.log.workers[push.worker]
        times.samples += push.samples
        times.pushes += 1
        self.recent_losses.append(push.loss)
        return self.strategy.on_push(push)

    def decide(self, decision: Decision) -> bool:
        """Carry out a Decision of the strategy: apply the pushes it names (one server
        update), then release its workers, unless the run stopped at that update. Every
        Decision that an engine carries out passes here. Returns whether the releases were
        made."""
        check_decision(self.strategy, decision, n_workers=len(self.buffered),
                       busy=self.engine.busy_workers(), live=self.engine.live_workers())
        if decision.apply:
            self.apply(decision)
        if self.done:
            return False
        for w in decision.release:
            self.engine.release(w)
        return True

    def apply(self, decision: Decision) -> None:
        """One server update from the buffered pushes the Decision names, then an evaluation
        when one is due, the stop rule, and a checkpoint when train.checkpoint_every says so."""
        held = {w: sum(b[2] for b in self.buffered[w]) for w, _ in decision.apply}
        items, samples = take_applied(self.buffered, decision, self.strategy.name)
        self.applied_samples += samples
        for w, before in held.items():
            self.applied_by[w] += before - sum(b[2] for b in self.buffered[w])
        self.engine.update(decision, items)
        self.updates_since_ckpt += 1
        if self.eval_due():
            self.evaluate()
        if self.should_stop():
            self.done = True
        every = self.p.cfg.train.checkpoint_every
        if every and self.updates_since_ckpt >= every and not self.done:
            self.engine.checkpoint_due()

    # ---- evaluation and stop ----------------------------------------------------------------
    def eval_due(self) -> bool:
        if self.eval_every_s > 0:
            return self.clock() >= self.next_eval_s
        return self.applied_samples >= self.next_eval

    def should_stop(self) -> bool:
        stop = self.p.cfg.stop
        return (self.applied_samples >= self.max_samples
                or (stop.max_time_s > 0 and self.clock() >= stop.max_time_s)
                or (stop.stop_at_target and self.log.target_reached()))

    @property
    def test_loader(self) -> BatchLoader:
        """Kept across evaluations: DataLoader workers (loader num_workers > 0) persist."""
        if self._test_loader is None:
            wl = self.p.workload
            self._test_loader = BatchLoader(wl.test, wl.loader)
        return self._test_loader

    def evaluate(self) -> dict[str, Any]:
        """Evaluate the global model now: one metrics row, the plateau schedule told, the next
        evaluation scheduled, progress reported."""
        t = self.clock()
        start = time.perf_counter()
        self.engine.sync_model()
        loss, acc = evaluate_workload(self.server.model, self.p.workload, self.test_loader)
        train_loss = (sum(self.recent_losses) / len(self.recent_losses)
                      if self.recent_losses else None)
        self.recent_losses = []
        row = self.log.record(
            time_s=t, samples=self.applied_samples,
            epoch=self.applied_samples / self.p.ctx.train_samples, updates=self.server.version,
            test_loss=loss, test_accuracy=acc, train_loss=train_loss,
            bytes_total=sum(w.bytes_sent + w.bytes_received for w in self.log.workers),
            extra={**self.strategy.metrics(), **schedule_metrics(self.server)})
        observe_evaluations(self.server, [row])  # ReduceLROnPlateau: from the next update on
        while self.next_eval <= self.applied_samples:
            self.next_eval += self.eval_every
        while self.eval_every_s > 0 and self.next_eval_s <= t:
            self.next_eval_s += self.eval_every_s
        self.engine.evaluated(time.perf_counter() - start)
        if self.progress is not None:
            self.progress(min(1.0, self.applied_samples / self.max_samples), row)
        return row

    def evaluate_last(self) -> None:
        """At the end of a run: evaluate unless the last row already holds every update."""
        if self.log.rows and self.log.rows[-1]["samples"] != self.applied_samples:
            self.evaluate()

    # ---- checkpoints ------------------------------------------------------------------------
    def server_state(self, *, elapsed_s: float, lost: list[int], strategy: Any = None,
                     owner: Any = None, applied_samples: int | None = None,
                     **more: Any) -> ServerState:
        """The checkpointed server state as of now (dist passes the strategy, data owner and
        applied samples as of its last update instead; `more`: the engine's own fields)."""
        return ServerState(
            model=host_tree(self.server.model.state_dict()),
            optimizer=host_tree(self.server.optimizer.state_dict()),
            version=self.server.version,
            strategy=self.strategy if strategy is None else strategy,
            owner=self.owner if owner is None else owner,
            applied_samples=(self.applied_samples if applied_samples is None
                             else applied_samples),
            next_eval=self.next_eval, elapsed_s=elapsed_s, rows=list(self.log.rows),
            workers=[dataclasses.replace(w) for w in self.log.workers],
            tta=(self.log.tta_s, self.log.tta_samples), lost=lost,
            config=self.p.cfg.to_dict(), **more)

    def restore(self, st: ServerState) -> None:
        """Take a checkpoint's server model, strategy, data owner and schedule position."""
        self.server.model.load_state_dict(st.model)
        self.server.optimizer.load_state_dict(st.optimizer)
        self.server.version = st.version
        self.strategy, self.owner = st.strategy, st.owner
        self.applied_samples, self.next_eval = st.applied_samples, st.next_eval

    def restore_log(self, st: ServerState) -> None:
        """Take a checkpoint's metrics: the workers' times, the time to target, the rows (the
        metrics files are re-written) and, from them, the plateau schedule's state."""
        self.log.workers = st.workers
        self.log.tta_s, self.log.tta_samples = st.tta
        self.log.restore(st.rows, st.version)
        observe_evaluations(self.server, st.rows)

    # ---- summary ----------------------------------------------------------------------------
    def summary(self, *, engine: str, time_s: float, unsent: list[int],
                ideal_scale: float = 1.0, **more: Any) -> RunResult:
        """The run's summary: `unsent` is each worker's work never applied (in flight at the
        stop, buffered but never applied, or lost with it); `ideal_scale` divides the
        Cluster model's ideal throughput (an emulated run's time scale); `more`: the
        engine's own fields."""
        cluster, fps = self.p.cluster, self.p.ctx.flops_per_sample
        ideal = sum(d.samples_per_s(fps) for d in cluster.devices)
        if ideal_scale != 1.0:
            ideal /= ideal_scale
        for times, samples in zip(self.log.workers, unsent, strict=True):
            times.unsent_samples = samples
        extra = {"engine": engine, "strategy": self.strategy.name, "cluster": cluster.name,
                 "unsent_samples": sum(unsent),
                 "workload": self.p.workload.name, "n_workers": cluster.n,
                 "flops_per_sample": fps, "model_bytes": self.p.ctx.model_bytes,
                 "strategy_stats": self.strategy.stats(), "config": self.p.cfg.to_dict(),
                 **more}
        return self.log.summarise(time_s=time_s, ideal_samples_per_s=ideal, extra=extra)
