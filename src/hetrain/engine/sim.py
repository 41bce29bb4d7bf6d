"""Virtual-clock discrete-event engine: real gradients, times from the Cluster model.

Every virtual worker keeps its own model copy and computes real gradients on its own
batches; only time is simulated: compute = steps * overhead + samples * FLOPs/sample / FLOP/s,
a transfer = latency + bytes / bandwidth on the worker's path to the PS (queued on the PS's
NIC when the cluster has one, and on the PS process's per-message time `ps_message_s`), a collective = the cluster's ring all-reduce time.

Because a worker's result depends only on the model it was sent, its task is computed eagerly
when it is released and its push is scheduled at the virtual time it would finish. Events at
equal times are ordered by a sequence number, so a run is deterministic for a seed.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hetrain.compress import Compressed, ErrorFeedback
from hetrain.engine.core import (
    Buffered,
    DataOwner,
    Replica,
    Server,
    TaskResult,
    next_task,
    schedule_metrics,
    take_applied,
)
from hetrain.engine.setup import Prepared
from hetrain.errors import ConfigError
from hetrain.report.metrics import MetricsLog, RunResult, WorkerTimes
from hetrain.strategies import Decision, Push, WorkTask
from hetrain.workloads import BatchLoader, evaluate_workload

PUSH_START, PUSH_ARRIVE, COLLECTIVE_DONE = 0, 1, 2
ProgressFn = Callable[[float, dict[str, Any] | None], None]
"""Called with the fraction done (0..1) and the newest evaluation row, if any."""


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
        self.strategy = prep.strategy
        self.progress = progress
        torch.manual_seed(cfg.train.seed)
        self.server = Server(wl.build_model(), self.strategy.update, cfg.optimizer,
                             self.strategy.outer())
        init = self.server.params()
        self.replicas = []
        # One loader per data set: the replicas run one task at a time in this process, so
        # DataLoader workers (loader num_workers) are shared rather than started per replica.
        self.train_loader = BatchLoader(wl.train, wl.loader)
        self.test_loader = BatchLoader(wl.test, wl.loader)
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
        self.owner = DataOwner(prep.ctx.train_samples, cfg.train.seed)
        self.log = MetricsLog(cfg.name, [WorkerTimes(d.name) for d in cluster.devices], run_dir,
                              cfg.stop.target_accuracy, cfg.stop.target_loss,
                              tensorboard=cfg.train.tensorboard)
        self.events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.inflight: dict[int, _InFlight] = {}
        self.buffered: dict[int, deque[Buffered]] = {
            w: deque() for w in range(cluster.n)}
        self.ready_at = [0.0] * cluster.n
        self.nic_free = {"in": 0.0, "out": 0.0}
        self.ps_busy_until = 0.0
        self.applied_samples = 0
        self.max_samples = int(cfg.stop.max_epochs * prep.ctx.train_samples)
        self.eval_every = max(1, int(cfg.train.eval_every_epochs * prep.ctx.train_samples))
        self.next_eval = 0
        self.eval_every_s = cfg.train.eval_every_s
        self.next_eval_s = 0.0
        self.recent_losses: list[float] = []
        self.now = 0.0
        self.done = False

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
        if self.strategy.update == "delta" and self.p.cfg.train.local_residual:
            params = self.feedback[w].local_start(params)
        rep.load(params, self.server.buffers())
        batches = [self.owner.take(task.batch_size) for _ in range(task.local_steps)]
        result = rep.run(task, self.strategy.update, batches)
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
        self.buffered[w].append((update, f.result.buffers, f.result.samples))
        self.ready_at[w] = t
        times = self.log.workers[w]
        times.samples += f.result.samples
        times.pushes += 1
        self.recent_losses.append(f.result.loss)
        decision = self.strategy.on_push(Push(
            worker=w, base_version=f.base_version, samples=f.result.samples,
            steps=f.result.steps, loss=f.result.loss, compute_s=f.compute_s,
            comm_s=f.pull_s + (t - f.push_started_s), arrival_s=t, probe=f.result.probe))
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
        if decision.apply:
            self._apply(decision, t)
        if self.done:
            return
        for w in decision.release:
            self._release(w, t, collective_s)

    def _apply(self, decision: Decision, t: float) -> None:
        items, samples = take_applied(self.buffered, decision, self.strategy.name)
        self.applied_samples += samples
        self.server.apply(items)
        self.now = t
        if (t >= self.next_eval_s if self.eval_every_s > 0
                else self.applied_samples >= self.next_eval):
            self._evaluate(t)
        if self._should_stop(t):
            self.done = True

    def _should_stop(self, t: float) -> bool:
        stop = self.p.cfg.stop
        return (self.applied_samples >= self.max_samples
                or (stop.max_time_s > 0 and t >= stop.max_time_s)
                or (stop.stop_at_target and self.log.target_reached()))

    def _evaluate(self, t: float) -> None:
        wl = self.p.workload
        loss, acc = evaluate_workload(self.server.model, wl, self.test_loader)
        train_loss = sum(self.recent_losses) / len(self.recent_losses) if self.recent_losses \
            else None
        self.recent_losses = []
        row = self.log.record(
            time_s=t, samples=self.applied_samples,
            epoch=self.applied_samples / self.p.ctx.train_samples, updates=self.server.version,
            test_loss=loss, test_accuracy=acc, train_loss=train_loss,
            bytes_total=sum(w.bytes_sent + w.bytes_received for w in self.log.workers),
            extra={**self.strategy.metrics(), **schedule_metrics(self.server)})
        while self.next_eval <= self.applied_samples:
            self.next_eval += self.eval_every
        while self.eval_every_s > 0 and self.next_eval_s <= t:
            self.next_eval_s += self.eval_every_s
        if self.progress is not None:
            self.progress(min(1.0, self.applied_samples / self.max_samples), row)

    # ---- main loop --------------------------------------------------------------------------
    def run(self) -> RunResult:
        try:
            return self._run()
        finally:
            self.train_loader.close()
            self.test_loader.close()
            self.log.close()

    def _run(self) -> RunResult:
        self._evaluate(0.0)
        for w in range(self.p.cluster.n):
            self._release(w, 0.0)
        while self.events and not self.done:
            t, _, kind, payload = heapq.heappop(self.events)
            if kind == PUSH_START:
                self._push_start(payload, t)
            elif kind == PUSH_ARRIVE:
                self._push_arrive(payload, t)
            else:
                decision, ar = payload
                self._decide(decision, t, collective_s=ar)
        if self.log.rows[-1]["samples"] != self.applied_samples:
            self._evaluate(self.now)
        # Work never applied: tasks in flight at the stop (pushing or not) and pushes buffered
        # at the server that no Decision applied. With applied_samples they account for every
        # sample drawn from the data owner.
        for w, times in enumerate(self.log.workers):
            f = self.inflight.get(w)
            times.unsent_samples = (f.result.samples if f is not None else 0) + sum(
                samples for _, _, samples in self.buffered[w])
        cluster, fps = self.p.cluster, self.p.ctx.flops_per_sample
        ideal = sum(d.samples_per_s(fps) for d in cluster.devices)
        extra = {"engine": "sim", "strategy": self.strategy.name, "cluster": cluster.name,
                 "unsent_samples": sum(t.unsent_samples for t in self.log.workers),
                 "workload": self.p.workload.name, "n_workers": cluster.n,
                 "flops_per_sample": fps, "model_bytes": self.p.ctx.model_bytes,
                 "strategy_stats": self.strategy.stats(), "config": self.p.cfg.to_dict()}
        return self.log.summarise(time_s=self.now, ideal_samples_per_s=ideal, extra=extra)


def simulate(prep: Prepared, run_dir: Path | None = None,
             progress: ProgressFn | None = None, speed_schedule: SpeedSchedule = ()) -> RunResult:
    return Simulator(prep, run_dir, progress, speed_schedule).run()
