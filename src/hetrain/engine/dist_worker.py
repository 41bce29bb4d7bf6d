"""Ranks 1..n of a dist run: a worker that runs the tasks rank 0 sends it.

Messages from rank 0: "setup" (the cluster, its device, update mode, emulation; in allreduce
mode the initial global model), "task" (WorkTask + sample indices [+ params, ps mode]),
"apply" (allreduce mode: all-reduce my last update with this weight and step my copy of the
global model), "state" (send my copy of the global model), "stop". Every answer carries the
worker's cumulative busy / comm / idle seconds, measured here:
  busy = the task's compute, padded to its emulated budget;
  comm = emulated wire time of pull and push, the real arrival of rank 0's messages and the
         sending of the worker's own, and all-reduces (padded to the ring model);
  idle = waiting for rank 0's next message to start (a barrier, a quorum, the server's turn).
The worker computes on its torch device (hetrain.engine.devices, chosen at setup; a device it
cannot have is reported to rank 0 in its "ready" message, which stops the run in one line).
With PS shards (`dist_shard`) a task carries block 0 of the parameters: the worker pulls the
other blocks from the shards at the task's version, and pushes each block of its update
(compressed with that block's own error feedback) to the shard that holds it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hetrain.cluster import Cluster
from hetrain.compress import Compressor, ErrorFeedback
from hetrain.config import RunConfig
from hetrain.engine import devices
from hetrain.engine.core import Replica, Server, TaskResult, float_buffers, follow_plateau
from hetrain.engine.emulate import Throttle, sleep_until
from hetrain.engine.messages import (
    Apply,
    Block,
    Bye,
    Message,
    Pull,
    Push,
    Ready,
    Setup,
    State,
    Stop,
    Task,
    expect,
    present,
)
from hetrain.engine.wire import Link, recv_obj, recv_obj_timed, send_obj, set_message_limit
from hetrain.errors import ConfigError
from hetrain.strategies.base import Update
from hetrain.workloads import Workload


@dataclass
class Fault:
    """Fault injection for tests: before its `task`-th task (0-based) the worker exits, hangs,
    or sends rank 0 a well-encoded push that lacks what a push must carry, then hangs."""

    task: int
    kind: str = "exit"

    def __post_init__(self) -> None:
        if self.kind not in ("exit", "hang", "malformed"):
            raise ValueError(f"fault kind must be 'exit', 'hang' or 'malformed', got "
                             f"{self.kind!r}")


@dataclass
class FaultPlan:
    """Builder: `fail_at(rank=2, task=3).fail_at(rank=1, task=5, kind="hang")`."""

    faults: dict[int, Fault] = field(default_factory=dict)

    def fail_at(self, rank: int, task: int, kind: str = "exit") -> FaultPlan:
        if rank < 1:
            raise ValueError("only worker ranks (>= 1) can be made to fail")
        self.faults[rank] = Fault(task, kind)
        return self


def fail_at(rank: int, task: int, kind: str = "exit") -> FaultPlan:
    return FaultPlan().fail_at(rank, task, kind)


class Worker:
    def __init__(self, rank: int, cfg: RunConfig, workload: Workload, compressor: Compressor,
                 group: dist.ProcessGroup | None, fault: Fault | None = None,
                 layout: tuple[int, int] | None = None, link: Link | None = None) -> None:
        self.rank, self.cfg, self.wl = rank, cfg, workload
        self.group = group
        self.server_link: Link | int = link or 0
        """How rank 0 is reached: rank 0 of the default group, or a joiner's private link."""
        self.layout = layout
        """(local rank, local world size) of this process on its node; None: one node."""
        self.fault = fault
        self.compressor = compressor
        self.times = {"busy_s": 0.0, "comm_s": 0.0, "idle_s": 0.0, "bytes_sent": 0,
                      "bytes_received": 0}
        self.tasks = 0
        self.last: TaskResult | None = None

    def _recv(self) -> Message:
        """Waiting for rank 0 is idle time; the arrival of the message (a pull on a slow
        link) is communication."""
        msg, nbytes, wait_s, transfer_s = recv_obj_timed(self.server_link)
        self.times["idle_s"] += wait_s
        self.times["comm_s"] += transfer_s
        self._nbytes = nbytes
        return msg

    def _send(self, msg: Ready | Push | State | Bye) -> int:
        """Send to rank 0; the time the send takes counts as communication from the next
        message on (a message carries the times as of its sending)."""
        msg = dataclasses.replace(msg, times=dict(self.times), overruns=self.throttle.overruns)
        t = time.perf_counter()
        nbytes = send_obj(msg, self.server_link)
        self.times["comm_s"] += time.perf_counter() - t
        return nbytes

    def run(self) -> None:
        self.throttle = Throttle(None, None, 1.0)  # replaced below; _send reads its overruns
        first = self._recv()
        if isinstance(first, Stop):  # a joiner admitted as the run ended
            self._send(Bye())
            return
        setup = expect(first, Setup)
        self.w = present(setup.worker, setup, "worker")
        cluster = present(setup.cluster, setup, "cluster")
        em = present(setup.emulation, setup, "emulation")
        self.comm = present(setup.comm, setup, "comm")
        try:
            self.device = self._device(cluster)
        except ConfigError as e:  # rank 0 reports it and stops the run
            self._send(Ready(error=str(e)))
            while not isinstance(self._recv(), Stop):
                pass
            self._send(Bye())
            return
        devices.use(self.device)
        emulate = em["mode"] != "none"
        self.throttle = Throttle(cluster.devices[self.w] if emulate else None,
                                 cluster.ps_link(self.w) if emulate else None,
                                 present(setup.flops_per_sample, setup, "flops_per_sample"),
                                 em.get("time_scale", 1.0))
        self.cluster, self.emulate = cluster, emulate
        self.update: Update = present(setup.update, setup, "update")
        shards = present(setup.shards, setup, "shards")
        self.shard_ranks: list[int] = shards["ranks"]
        self.block_sizes: list[int] = shards["sizes"]
        self.feedbacks = [ErrorFeedback(self.compressor) for _ in self.block_sizes]
        torch.manual_seed(self.cfg.train.seed + self.rank)
        self.replica = Replica(self.wl, self.wl.build_model(), self.cfg.optimizer, self.device,
                               self.cfg.train.precision)
        set_message_limit(4 * sum(p.numel() for p in self.replica.model.parameters()))
        self.replica.warm_up(self.cfg.train.batch_size)   # before any task is timed
        self.server: Server | None = None
        if self.comm == "allreduce":
            self.server = Server(self.wl.build_model(), self.update, self.cfg.optimizer,
                                 present(setup.outer, setup, "outer"))
            state = present(setup.state, setup, "state")
            self.server.model.load_state_dict(state["model"])
            if state["version"] > 0:
                self.server.optimizer.load_state_dict(state["optimizer"])
            self.server.version = state["version"]
        self._send(Ready(device=str(self.device)))
        while True:
            msg = self._recv()
            if isinstance(msg, Stop):
                for rank in self.shard_ranks:  # ends the shard's receiver of my messages
                    send_obj(Bye(), rank)
                self._send(Bye())
                self.replica.loader.close()  # its DataLoader workers, if any (num_workers > 0)
                return
            if isinstance(msg, Task):
                if msg.apply_weight is not None:  # the last round's all-reduce rides along
                    self._apply(msg.apply_weight, msg.lr_factor)
                self._task(msg)
            elif isinstance(msg, Apply):
                self._apply(present(msg.weight, msg, "weight"), msg.lr_factor)
            elif isinstance(msg, State):
                assert self.server is not None
                self._send(State(model=self.server.model.state_dict(),
                                 optimizer=self.server.optimizer.state_dict()))

    def _device(self, cluster: Cluster) -> torch.device:
        """This worker's torch device (hetrain.engine.devices), from the configuration alone."""
        world = cluster.n + self.cfg.dist.ps_shards
        return devices.device_of(self.rank, self.layout or (self.rank, world), self.cfg.dist,
                                 cluster.devices, self.comm)

    def _inject_fault(self) -> None:
        if self.fault is None or self.tasks != self.fault.task:
            return
        if self.fault.kind == "exit":
            os._exit(17)
        if self.fault.kind == "malformed":
            self._send(Push(loss=1.0))  # no samples, steps, compute or comm times
        time.sleep(3600)

    def _task(self, msg: Task) -> None:
        self._inject_fault()
        task, batches = msg.task, msg.batches
        pull_s = 0.0
        shard_bytes = [0, 0]  # sent to, received from the shards
        if self.comm == "ps":
            t = time.perf_counter()
            params = self._pull_blocks(msg, shard_bytes)
            self.throttle.hold(self._nbytes + shard_bytes[1], started_s=t)
            pull_s = time.perf_counter() - t
            self.times["comm_s"] += pull_s
            if self.update == "delta" and self.cfg.train.local_residual:
                params = torch.cat([fb.local_start(part) for fb, part in  # views suffice here
                                    zip(self.feedbacks, params.split(self.block_sizes),
                                        strict=True)])
            self.replica.load(params, present(msg.buffers, msg, "buffers"))
        else:
            assert self.server is not None
            self.replica.load(self.server.params(), self.server.buffers())
        result, compute_s = self.throttle.run(
            lambda: self.replica.run(task, self.update, batches), task.samples, task.local_steps)
        self.times["busy_s"] += compute_s
        self.tasks += 1
        out = Push(samples=result.samples, steps=result.steps, loss=result.loss,
                   compute_s=compute_s,  # the probe as plain floats on the wire
                   probe=dataclasses.astuple(result.probe) if result.probe is not None else None)
        if self.comm == "ps":
            payloads = [fb.compress(part) for fb, part in
                        zip(self.feedbacks, self._blocks(result.update), strict=True)]
            for rank, payload in zip(self.shard_ranks, payloads[1:], strict=True):
                shard_bytes[0] += send_obj(Push(payload=payload), rank)
            t = time.perf_counter()
            self.throttle.hold(sum(p.nbytes for p in payloads)
                               + 4 * sum(b.numel() for b in result.buffers))
            push_s = time.perf_counter() - t
            self.times["comm_s"] += push_s
            out = dataclasses.replace(out, payload=payloads[0], buffers=result.buffers,
                                      shard_bytes=tuple(shard_bytes), comm_s=pull_s + push_s)
        else:
            self.last = result
            out = dataclasses.replace(out, comm_s=0.0)
        self._send(out)

    def _blocks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Copies, not views: a pickled view would carry the whole tensor's storage."""
        if not self.shard_ranks:
            return [flat]
        return [part.clone() for part in flat.split(self.block_sizes)]

    def _pull_blocks(self, msg: Task, shard_bytes: list[int]) -> torch.Tensor:
        """The full parameters: block 0 from the task, the others from their shards (each
        answers once it has applied the updates rank 0 had made when it sent the task)."""
        params = present(msg.params, msg, "params")
        if not self.shard_ranks:
            return params
        version = present(msg.version, msg, "version")
        for rank in self.shard_ranks:
            shard_bytes[0] += send_obj(Pull(version=version), rank)
        blocks = [params]
        for rank in self.shard_ranks:
            reply, nbytes = recv_obj(rank)
            blocks.append(expect(reply, Block).params)
            shard_bytes[1] += nbytes
        return torch.cat(blocks)

    def _apply(self, weight: float, lr_factor: float | None) -> None:
        """All-reduce sum_i w_i [u_i, b_i, 1] over the workers; step my global copy (with
        rank 0's ReduceLROnPlateau factor when the message carries one)."""
        assert self.server is not None and self.last is not None
        follow_plateau(self.server, lr_factor)
        r = self.last
        bufs = torch.cat([b.reshape(-1) for b in r.buffers]) if r.buffers else torch.zeros(0)
        flat = torch.cat([weight * r.update, weight * bufs, torch.tensor([weight])])
        t = time.perf_counter()
        if self.cfg.dist.backend == "nccl":  # the NCCL group reduces GPU tensors
            on_gpu = flat.to(self.device)
            dist.all_reduce(on_gpu, group=self.group)
            flat = on_gpu.cpu()
        else:
            dist.all_reduce(flat, group=self.group)
        if self.emulate:
            members = list(range(self.cluster.n))
            model_s = self.cluster.ring_allreduce_time_s(r.update.numel() * 4, members)
            sleep_until(t + self.throttle.time_scale * model_s)
        self.times["comm_s"] += time.perf_counter() - t
        n = self.cluster.n
        moved = int(2 * flat.numel() * 4 * (n - 1) / n)
        self.times["bytes_sent"] += moved
        self.times["bytes_received"] += moved
        k = r.update.numel()
        total = float(flat[-1])
        avg_bufs, off = [], k
        for b in float_buffers(self.server.model):
            avg_bufs.append((flat[off:off + b.numel()] / total).view_as(b))
            off += b.numel()
        self.server.apply([(1.0, flat[:k].clone(), avg_bufs)])
        self.last = None
