"""The real engine: the same strategies across real processes on torch.distributed.

Rank 0 is the parameter server, data owner and coordinator (`dist_server.Coordinator`); ranks
1..n are the workers, mapped in order to the Cluster's devices (`dist_worker.Worker`). PS
strategies use point-to-point messages (receive from whichever worker pushes first);
all-reduce strategies (ddp, local_sgd) all-reduce among a process group of the worker ranks.
Switch a config from the simulator to real processes with `engine = "dist"`; the [dist]
table (backend, emulate, time_scale, worker_timeout_s, checkpoint_every, resume, port) tunes it.

How to start it (world size = number of devices + 1):

    # one machine, hetrain spawns the processes on 127.0.0.1 (a free port):
    hetrain run --engine dist cfg.toml
    hetrain launch --nproc 5 cfg.toml            # same, explicit (cluster of 4 devices)

    # one machine under torchrun (standalone rendezvous):
    torchrun --standalone --nproc-per-node 5 --local-ranks-filter 0 \\
        -m hetrain run --engine dist cfg.toml

    # several machines (c10d rendezvous; the node with rank 0 hosts the PS):
    torchrun --nnodes 2 --nproc-per-node 3 --node-rank 0 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29400 --rdzv-id job1 -m hetrain run --engine dist cfg.toml
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29400 --rdzv-id job1 -m hetrain run --engine dist cfg.toml
    (or `hetrain launch --nnodes 2 --node-rank K --rdzv-endpoint HOST0:29400 cfg.toml`,
    which execs exactly that; set GLOO_SOCKET_IFNAME to the interface between the nodes.)

The environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) is read in `run_distributed`
only; everything below takes explicit arguments.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetrain.cluster import Cluster, load_cluster
from hetrain.compress import make_compressor
from hetrain.config import RunConfig
from hetrain.engine.checkpoint import load_checkpoint
from hetrain.engine.dist_server import Coordinator, WorkerLostError
from hetrain.engine.dist_worker import FaultPlan, Worker, fail_at
from hetrain.engine.emulate import calibrated_cluster
from hetrain.engine.setup import prepare
from hetrain.engine.sim import ProgressFn
from hetrain.engine.wire import check_port_free, free_port
from hetrain.errors import ConfigError
from hetrain.report.metrics import RunResult
from hetrain.strategies import Strategy
from hetrain.workloads import Workload, flops_per_sample, get_workload

__all__ = ["FaultPlan", "Rendezvous", "WorkerLostError", "fail_at", "run_distributed",
           "run_rank", "spawn_local"]

log = logging.getLogger("hetrain.dist")
JOIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Rendezvous:
    """Where the processes meet: a TCP store on rank 0's host."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    from_env: bool = False
    """Started by torchrun: join its store through env:// (the agent may already host it)."""


def _init(rv: Rendezvous, cfg: RunConfig) -> None:
    torch.set_num_threads(cfg.train.threads)
    try:
        dist.init_process_group(
            cfg.dist.backend,
            init_method="env://" if rv.from_env else f"tcp://{rv.master_addr}:{rv.master_port}",
            rank=rv.rank, world_size=rv.world_size,
            timeout=timedelta(seconds=cfg.dist.init_timeout_s))
    except (RuntimeError, dist.DistError) as e:
        text = str(e)
        if "address already in use" in text.lower() or "EADDRINUSE" in text:
            raise ConfigError(f"port {rv.master_port} on {rv.master_addr} is already in use; "
                              "pick another with --port PORT (or 0 for a free one)") from None
        raise


def _setup_logging() -> None:
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


def _effective_inputs(cfg: RunConfig, cluster: Cluster | None, workload: Workload | None
                      ) -> tuple[Cluster, Workload]:
    """The cluster the run emulates (calibrated for emulate = "relative") and the workload."""
    cluster = cluster or load_cluster(cfg.cluster)
    workload = workload or get_workload(cfg.workload.model, cfg.workload.dataset,
                                        model_options=cfg.workload.model_options,
                                        dataset_options=cfg.workload.dataset_options)
    if cfg.dist.emulate == "relative":
        cluster = calibrated_cluster(cluster, workload, flops_per_sample(workload),
                                     cfg.train.batch_size, cfg.dist.contention_k)
    return cluster, workload


def _worker_group(world_size: int) -> dist.ProcessGroup | None:
    """Every rank must create the worker group (a collective over the default group)."""
    return dist.new_group(ranks=list(range(1, world_size)), backend="gloo") \
        if world_size > 2 else dist.new_group(ranks=[1], backend="gloo")


def run_rank(rv: Rendezvous, cfg: RunConfig, *, run_dir: Path | None = None,
             progress: ProgressFn | None = None, cluster: Cluster | None = None,
             workload: Workload | None = None, strategy: Strategy | None = None,
             faults: FaultPlan | None = None, prepared: Any = None) -> RunResult | None:
    """Run this process's role. Rank 0 returns the RunResult; workers return None."""
    _setup_logging()
    if rv.rank == 0:
        prep = prepared
        if prep is None:
            cluster, workload = _effective_inputs(cfg, cluster, workload)
            prep = prepare(cfg, cluster=cluster, workload=workload, strategy=strategy)
        if rv.world_size != prep.cluster.n + 1:
            raise ConfigError(
                f"{rv.world_size} processes for a cluster of {prep.cluster.n} devices: the "
                f"dist engine needs one rank per device plus the server, i.e. "
                f"{prep.cluster.n + 1} (torchrun --nproc-per-node {prep.cluster.n + 1})")
        _init(rv, cfg)
        try:
            _worker_group(rv.world_size)
            emulation = {"mode": cfg.dist.emulate, "time_scale": cfg.dist.time_scale}
            return Coordinator(prep, run_dir, progress, emulation).run()
        finally:
            dist.destroy_process_group()
    workload = workload or get_workload(cfg.workload.model, cfg.workload.dataset,
                                        model_options=cfg.workload.model_options,
                                        dataset_options=cfg.workload.dataset_options)
    compressor = make_compressor(cfg.train.compression, **cfg.train.compression_options)
    _init(rv, cfg)
    try:
        group = _worker_group(rv.world_size)
        fault = faults.faults.get(rv.rank) if faults is not None else None
        Worker(rv.rank, cfg, workload, compressor, group, fault).run()
    finally:
        dist.destroy_process_group()
    return None


def _worker_main(rv: Rendezvous, cfg: RunConfig, conn: Connection,
                 faults: FaultPlan | None) -> None:
    """Entry of a spawned worker process: imports done, wait for the workload rank 0 built."""
    torch.set_num_threads(cfg.train.threads)
    workload = conn.recv()
    conn.close()
    if workload is None:
        return  # rank 0 failed before the run started
    run_rank(rv, cfg, workload=workload, faults=faults)


def spawn_local(cfg: RunConfig, *, run_dir: Path | None = None,
                progress: ProgressFn | None = None, cluster: Cluster | None = None,
                workload: Workload | None = None, strategy: Strategy | None = None,
                faults: FaultPlan | None = None) -> RunResult:
    """Run rank 0 in this process and spawn the workers on this machine."""
    cfg_d = cfg.dist
    if cfg_d.resume:
        load_checkpoint(run_dir, cfg.strategy.name if strategy is None else strategy.name)
    if cfg_d.port:
        check_port_free(cfg_d.master_addr, cfg_d.port)
    port = cfg_d.port or free_port(cfg_d.master_addr)
    ctx = mp.get_context("spawn")
    procs, pipes = [], []

    def start(world: int) -> None:
        for rank in range(1, world):
            mine, theirs = ctx.Pipe()
            rv = Rendezvous(rank, world, cfg_d.master_addr, port)
            p = ctx.Process(target=_worker_main, args=(rv, cfg, theirs, faults), daemon=True,
                            name=f"hetrain-worker-{rank}")
            p.start()
            procs.append(p)
            pipes.append(mine)

    # The workers import torch while this process builds the workload and plans, except when
    # calibrating (emulate = "relative" measures a solo step time: nothing else may run).
    early = cfg_d.emulate != "relative"
    if early:
        start((cluster.n if cluster is not None else load_cluster(cfg.cluster).n) + 1)
    result = None
    try:
        cluster, workload = _effective_inputs(cfg, cluster, workload)
        prep = prepare(cfg, cluster=cluster, workload=workload, strategy=strategy)
        world = prep.cluster.n + 1
        if not early:
            start(world)
        for conn in pipes:
            conn.send(workload)
        pipes.clear()
        result = run_rank(Rendezvous(0, world, cfg_d.master_addr, port), cfg, run_dir=run_dir,
                          progress=progress, prepared=prep)
    finally:
        for conn in pipes:  # rank 0 failed before sending the workload: release the workers
            conn.send(None)
        for rank in (result.summary.get("lost_workers", []) if result is not None else []):
            procs[rank].terminate()  # dropped as hung: it will not exit by itself
        for p in procs:
            p.join(JOIN_TIMEOUT_S)
            if p.is_alive():
                log.warning("hetrain: worker process %s did not exit; terminating it", p.name)
                p.terminate()
                p.join(5)
    assert result is not None
    return result


def run_distributed(cfg: RunConfig, *, run_dir: Path | None = None,
                    progress: ProgressFn | None = None, cluster: Cluster | None = None,
                    workload: Workload | None = None, strategy: Strategy | None = None,
                    faults: FaultPlan | None = None) -> RunResult:
    """Entry point (runner.py dispatches engine = "dist" here).

    Under torchrun (RANK and WORLD_SIZE set) this process runs its own rank; workers then
    return a RunResult without rows (only rank 0 evaluates and writes the run files).
    Otherwise rank 0 runs here and the workers are spawned on this machine.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rv = Rendezvous(int(env["RANK"]), int(env["WORLD_SIZE"]),
                        env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")),
                        from_env=True)
        result = run_rank(rv, cfg, run_dir=run_dir if rv.rank == 0 else None,
                          progress=progress if rv.rank == 0 else None, cluster=cluster,
                          workload=workload, strategy=strategy, faults=faults)
        if result is None:
            return RunResult(cfg.name, [], {"name": cfg.name, "engine": "dist", "role": "worker",
                                            "rank": rv.rank, "strategy": cfg.strategy.name,
                                            "final_accuracy": 0.0}, None)
        return result
    return spawn_local(cfg, run_dir=run_dir, progress=progress, cluster=cluster,
                       workload=workload, strategy=strategy, faults=faults)
