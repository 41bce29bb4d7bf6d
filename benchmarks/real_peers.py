"""The peers, as themselves, on real processes with the same model, data and throttling.

- lone: the cluster's fastest device training by itself, the user's simplest alternative: ONE
  process, a plain PyTorch loop (SGD step padded to the device's budget), no process group.

- torch DDP: torch.nn.parallel.DistributedDataParallel, gloo, equal batch per rank.
- torch PostLocalSGD: DDP + post_localSGD_hook + PostLocalSGDOptimizer with
  PeriodicModelAverager (torch.distributed.algorithms model averaging), period H.

Throttling is hetrain's budget padding (`hetrain.engine.emulate.Throttle`): each step's
compute is padded to the emulated device's time before any gradient leaves the rank. The pad
sits in a DDP communication hook (called once the backward has produced the bucket, i.e. at
the end of compute: the model's 55 kB of gradients fit in DDP's one 25 MB bucket), so DDP's
all-reduce starts only when the slowest device would have finished, as on real hardware.

- DeepSpeed ZeRO stage 0 / 1 (benchmarks/real_deepspeed.py, optional): deepspeed.initialize
  over gloo on CPU, the same SGD; the pad is a gradient hook that fires once backward has
  produced every gradient, before DeepSpeed's reduction.
- torchft LocalSGD / DiLoCo (benchmarks/real_torchft.py, optional): a torchft Manager per
  worker, one LighthouseServer started here on 127.0.0.1 for the run; the pad sleeps after
  backward, before the optimizer step whose post-hook syncs every H steps.

Rank 0 evaluates the model every `eval_every` samples (the global model: after an average for
PostLocalSGD and torchft) and its evaluation pauses are left out of the clock, as in hetrain's
engines.
"""


import math
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import real_torchft
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from hetrain.cluster import Cluster
from hetrain.engine.emulate import Throttle, sleep_until
from hetrain.engine.wire import free_port
from hetrain.workloads import Workload, evaluate, gather


@dataclass(frozen=True)
class PeerRun:
    system: str
    """"lone", "torch_ddp", "torch_postlocalsgd", "deepspeed_zero0", "deepspeed_zero1",
    "torchft_localsgd" or "torchft_diloco"."""
    cluster: Cluster
    workload: Workload
    flops_per_sample: float
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    period: int = 8
    """PostLocalSGD / torchft averaging period (H local steps)."""
    time_scale: float = 1.0
    seed: int = 0
    max_epochs: float = 6.0
    target_accuracy: float = 0.7
    eval_every_epochs: float = 0.1


class _Pad:
    """DDP comm hook state: pad the step to its compute deadline, then communicate."""

    def __init__(self, inner: Any, inner_state: Any) -> None:
        self.inner, self.inner_state = inner, inner_state
        self.deadline_s = 0.0


def _padded_hook(pad: _Pad, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    sleep_until(pad.deadline_s)
    return pad.inner(pad.inner_state, bucket)


LONE = "lone"


def _worker(rank: int, run: PeerRun, port: int, out: Any, lighthouse_addr: str) -> None:
    torch.set_num_threads(1)
    n = run.cluster.n
    if run.system == LONE:
        with ExitStack() as stack:
            _train(rank, run, out, lighthouse_addr, stack)
        return
    if run.system.startswith("deepspeed"):
        import os

        from real_deepspeed import init_deepspeed
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        init_deepspeed()
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n, timeout=timedelta(seconds=120))
    try:
        with ExitStack() as stack:
            _train(rank, run, out, lighthouse_addr, stack)
    finally:
        dist.destroy_process_group()


def _build_lone(run: PeerRun) -> tuple[torch.nn.Module, Callable[[Any], None], _Pad]:
    """One process, no wrapper: the step is padded to its budget before the optimizer steps."""
    model = run.workload.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=run.lr, momentum=run.momentum)
    pad = _Pad(None, None)

    def step(batch: Any) -> None:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        run.workload.loss_fn(model(x), y).backward()
        sleep_until(pad.deadline_s)
        opt.step()
    return model, step, pad


def _build_torch(run: PeerRun) -> tuple[torch.nn.Module, Callable[[Any], None], _Pad]:
    """torch DDP or PostLocalSGD: (module to evaluate, step(loss), the pad)."""
    model = DDP(run.workload.build_model())
    if run.system == "torch_ddp":
        pad = _Pad(default_hooks.allreduce_hook, None)
        opt: Any = torch.optim.SGD(model.parameters(), lr=run.lr, momentum=run.momentum)
    else:
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
            PostLocalSGDState,
            post_localSGD_hook,
        )
        from torch.distributed.algorithms.model_averaging.averagers import (
            PeriodicModelAverager,
        )
        from torch.distributed.optim import PostLocalSGDOptimizer

        # Pure local SGD after the first step: each rank its own subgroup (no gradient
        # all-reduce), parameters averaged over the world every `period` steps.
        subgroup, _ = dist.new_subgroups(group_size=1)
        state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=1)
        pad = _Pad(post_localSGD_hook, state)
        opt = PostLocalSGDOptimizer(
            optim=torch.optim.SGD(model.parameters(), lr=run.lr, momentum=run.momentum),
            averager=PeriodicModelAverager(period=run.period, warmup_steps=1))
    model.register_comm_hook(pad, _padded_hook)

    def step(batch: Any) -> None:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        run.workload.loss_fn(model(x), y).backward()
        opt.step()
    return model.module, step, pad


def _train(rank: int, run: PeerRun, out: Any, lighthouse_addr: str, stack: ExitStack) -> None:
    n, wl = run.cluster.n, run.workload
    torch.manual_seed(run.seed)
    if run.system.startswith("deepspeed"):
        from real_deepspeed import build_deepspeed
        pad = _Pad(None, None)
        module, step_fn = build_deepspeed(run, pad)
    elif run.system in real_torchft.SYSTEMS:
        pad = _Pad(None, None)
        peer = real_torchft.TorchftPeer(run, rank, lighthouse_addr, pad)
        stack.callback(peer.close)
        module, step_fn = peer.model, peer.step
    elif run.system == LONE:
        module, step_fn, pad = _build_lone(run)
    else:
        module, step_fn, pad = _build_torch(run)
    throttle = Throttle(run.cluster.devices[rank], None, run.flops_per_sample, run.time_scale)
    n_train = len(wl.train)  # type: ignore[arg-type]
    per_step = run.batch_size * n
    eval_steps = max(1, round(run.eval_every_epochs * n_train / per_step))
    if run.system == "torch_postlocalsgd" or run.system in real_torchft.SYSTEMS:
        # evaluate right after an average: the global model
        eval_steps = max(run.period, eval_steps // run.period * run.period)
    max_steps = int(run.max_epochs * n_train / per_step)
    g = torch.Generator().manual_seed(run.seed)
    order = torch.randperm(n_train, generator=g)
    pos, epoch = 0, 0
    rows, tta_s, paused_s = [], None, 0.0
    flag = torch.zeros(1)
    if n > 1:
        dist.barrier()
    t0 = time.perf_counter()
    for step in range(1, max_steps + 1):
        if pos + per_step > n_train:  # a new epoch: same permutation on every rank
            epoch += 1
            order = torch.randperm(n_train, generator=torch.Generator().manual_seed(
                run.seed * 1000 + epoch))
            pos = 0
        idx = order[pos + rank * run.batch_size: pos + (rank + 1) * run.batch_size]
        pos += per_step
        pad.deadline_s = time.perf_counter() + throttle.compute_budget_s(run.batch_size, 1)
        step_fn(gather(wl.train, idx))
        if step % eval_steps == 0 or step == max_steps:
            if rank == 0:
                now = time.perf_counter() - t0 - paused_s
                e0 = time.perf_counter()
                loss, acc = evaluate(module, wl.test, wl.loss_fn)
                paused_s += time.perf_counter() - e0
                rows.append({"time_s": now, "epoch": step * per_step / n_train,
                             "test_accuracy": acc, "test_loss": loss})
                if tta_s is None and acc >= run.target_accuracy:
                    tta_s = now
                # stop at the target, or once diverged (a NaN loss never reaches it)
                flag.fill_(1.0 if tta_s is not None or not math.isfinite(loss) else 0.0)
            if n > 1:
                dist.broadcast(flag, 0)
            if flag.item() > 0:
                break
    if rank == 0:
        out.put({"system": run.system, "tta_s": tta_s, "rows": rows,
                 "final_accuracy": rows[-1]["test_accuracy"] if rows else 0.0,
                 "epochs": rows[-1]["epoch"] if rows else 0.0,
                 "time_s": rows[-1]["time_s"] if rows else 0.0,
                 "overruns": throttle.overruns})


def run_peer(run: PeerRun, timeout_s: float = 600.0) -> dict[str, Any]:
    """Spawn the peer's n processes, wait for rank 0's result (torchft: inside a lighthouse
    that lives as long as the run)."""
    torchft = run.system in real_torchft.SYSTEMS
    with real_torchft.lighthouse(run.cluster.n) if torchft else nullcontext("") as addr:
        return _spawn(run, timeout_s, addr)


def _spawn(run: PeerRun, timeout_s: float, lighthouse_addr: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, run, port, out, lighthouse_addr),
                         daemon=True)
             for r in range(run.cluster.n)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(10.0)
        if p.is_alive():
            p.kill()
            p.join(10.0)
    if out.empty():
        raise RuntimeError(f"{run.system}: no result (exit codes {[p.exitcode for p in procs]})")
    return out.get()
