"""The real engine: the same strategies across real processes on torch.distributed.

Rank 0 is the parameter server, data owner and coordinator (`dist_server.Coordinator`); ranks
1..n are the workers, mapped in order to the Cluster's devices (`dist_worker.Worker`). PS
strategies use point-to-point messages (receive from whichever worker pushes first);
all-reduce strategies (ddp, local_sgd) all-reduce among a process group of the worker ranks.
Switch a config from the simulator to real processes with `engine = "dist"`; the [dist] table
(backend, emulate, time_scale, worker_timeout_s, port, ps_shards) tunes it; train.checkpoint /
checkpoint_every / resume set its checkpoints, as on the simulator. `ps_shards = S > 1` (PS
strategies only) splits the parameters into S blocks served by rank 0 and ranks n+1..n+S-1
(`dist_shard.Shard`), so no single server carries every worker's full pulls and pushes.

How to start it (world size = number of devices + dist.ps_shards, i.e. devices + 1 by default):

    # one machine, hetrain spawns the processes on 127.0.0.1 (a free port):
    hetrain run --engine dist cfg.toml
    hetrain launch --nproc 5 cfg.toml            # same, explicit (cluster of 4 devices)
    hetrain launch --nproc 6 --set dist.ps_shards=2 cfg.toml   # 4 workers, 2 PS ranks

    # one machine under torchrun (standalone rendezvous):
    torchrun --standalone --nproc-per-node 5 --local-ranks-filter 0 \\
        -m hetrain run --engine dist cfg.toml

    # several machines: the same command on every node (a static rendezvous: node 0 runs
    # rank 0, which hosts the store on HOST0; the last ranks are the PS shards when
    # ps_shards > 1), each node's processes started and watched by hetrain.engine.nodes:
    hetrain launch cfg.toml --nnodes 2 --node-rank 0 --nproc-per-node 3,2 \\
        --master HOST0:29400 --ifname eth1
    hetrain launch cfg.toml --nnodes 2 --node-rank 1 --nproc-per-node 3,2 \\
        --master HOST0:29400 --ifname eth1
    (with the same HETRAIN_SECRET on every node: see hetrain.engine.auth; --ifname sets
    GLOO_SOCKET_IFNAME, needed when the machines have several interfaces.)

The environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) is read in `run_distributed`
only; everything below takes explicit arguments.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetrain.cluster import Cluster, load_cluster
from hetrain.compress import make_compressor
from hetrain.config import RunConfig
from hetrain.context import ProgressFn
from hetrain.engine import auth, codec, devices, nodes
from hetrain.engine.checkpoint import check_ps_shards, checkpoint_path, load_checkpoint
from hetrain.engine.dist_server import Coordinator, WorkerLostError
from hetrain.engine.dist_shard import Shard
from hetrain.engine.dist_worker import FaultPlan, Worker, fail_at
from hetrain.engine.emulate import calibrated_cluster
from hetrain.engine.join import JoinDesk
from hetrain.engine.setup import Prepared, prepare
from hetrain.engine.signals import worker_signals
from hetrain.engine.spawn import Spawner
from hetrain.errors import ConfigError, HetrainError, ReportedElsewhereError
from hetrain.report.metrics import RunResult
from hetrain.strategies import Strategy
from hetrain.validate import check_ps_shard_count
from hetrain.workloads import Workload, flops_per_sample, workload_from_config

__all__ = ["FaultPlan", "Rendezvous", "WorkerLostError", "fail_at", "init_process_group",
           "run_distributed", "run_rank", "spawn_local"]

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
    """torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE): every rank joins it.
    Otherwise rank 0 hosts it on master_addr (spawned runs, `hetrain launch`'s own nodes)."""
    secret: str = field(default="", repr=False)
    """The run's secret when the launcher generated it (see hetrain.engine.auth)."""
    listener: socket.socket | None = field(default=None, repr=False, compare=False)
    """Rank 0, spawned runs: the socket the store listens on, bound before the workers start."""
    local_rank: int | None = None
    """This process's place among its node's processes (torchrun's LOCAL_RANK); None: every
    rank runs on this one node, local rank = rank."""
    local_world_size: int | None = None

    @property
    def layout(self) -> tuple[int, int]:
        """(local rank, local world size): which ranks share this node's GPUs."""
        if self.local_rank is None:
            return self.rank, self.world_size
        return self.local_rank, self.local_world_size or self.world_size


def bind_listener(addr: str, port: int) -> socket.socket:
    """A listening socket on exactly `addr` (never the wildcard): the store's. Port 0 picks a
    free one with no window for another process to take it."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise ConfigError(f"dist.master_addr = {addr!r} is not an address of this machine "
                          f"({e.strerror or e}); use 127.0.0.1 or one of its addresses") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        if e.errno in (errno.EADDRINUSE, errno.EACCES):
            raise ConfigError(f"port {port} on {addr} is already in use (another run or "
                              "service holds it); pick another with --port PORT, or use "
                              "--port 0 for a free one") from None
        raise ConfigError(f"cannot listen on {addr}:{port} ({e.strerror}); set "
                          "dist.master_addr to an address of this machine") from None
    return sock


_gloo_ifname_set = False


def _gloo_on_loopback(addr: str) -> None:
    """gloo listens on the address the host name resolves to unless told an interface; a run
    whose rendezvous is on loopback keeps its data connections on loopback too."""
    global _gloo_ifname_set
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        loopback = False
    if not loopback:
        if _gloo_ifname_set:  # ours, from an earlier loopback run in this process
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
            _gloo_ifname_set = False
        return
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if "GLOO_SOCKET_IFNAME" not in os.environ and names:
        os.environ["GLOO_SOCKET_IFNAME"] = names[0]
        _gloo_ifname_set = True


def _endpoint(rv: Rendezvous) -> str:
    host = f"[{rv.master_addr}]" if ":" in rv.master_addr else rv.master_addr
    return f"{host}:{rv.master_port}"


def join_rendezvous(rv: Rendezvous, timeout: timedelta) -> dist.Store:
    """`rendezvous_store`, with one line instead of c10d's traceback when the store is out of
    reach: a rank that does not host it first waits for its port to answer (plain sockets:
    c10d logs every failed try with a C++ stack), then joins."""
    hosts = rv.rank == 0 and not rv.from_env
    unreachable = nodes.unreachable_message(nodes.node_label(), _endpoint(rv),
                                            timeout.total_seconds())
    if not hosts and not nodes.wait_reachable(rv.master_addr, rv.master_port,
                                              timeout.total_seconds()):
        raise ConfigError(unreachable)
    try:
        return rendezvous_store(rv, timeout)
    except dist.DistNetworkError:
        if hosts:
            raise
        raise ConfigError(unreachable) from None


def rendezvous_store(rv: Rendezvous, timeout: timedelta) -> dist.Store:
    """The rendezvous store, its server listening on master_addr only (torch's own would
    listen on every interface). torchrun's agent keeps one store across restarts, so each
    attempt gets keys of its own: a restarted group must not read the dead one's addresses."""
    if rv.from_env:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(rv.master_addr, rv.master_port, rv.world_size, False, timeout)
        return dist.PrefixStore(f"hetrain/attempt_{attempt}/", store)
    if rv.rank != 0:
        return dist.TCPStore(rv.master_addr, rv.master_port, rv.world_size, False, timeout)
    sock = rv.listener or bind_listener(rv.master_addr, rv.master_port)
    port = sock.getsockname()[1]
    return dist.TCPStore(rv.master_addr, port, rv.world_size, True, timeout,
                         wait_for_workers=False, master_listen_fd=sock.detach())


def init_process_group(rv: Rendezvous, cfg: RunConfig, run_dir: Path | None = None
                       ) -> tuple[dist.Store, str, bool]:
    """Join the run's gloo process group at `rv` and prove the run's secret
    (hetrain.engine.auth): every process of a run joins this way (the engine's ranks, the
    [parallel] ranks, the profiler's in hetrain.engine.measure). The caller destroys the group
    (`torch.distributed.destroy_process_group`) when done.

    Sets cfg.train.threads intra-op threads; waits cfg.dist.init_timeout_s for every rank.
    The secret is rv.secret (a spawned run's), HETRAIN_SECRET, or, on rank 0 with a
    `run_dir` and neither, one generated into a file there for the other ranks to read.
    Failures a user can fix (port in use, a rank that never joined, a wrong secret, NCCL
    without a CUDA build) raise ConfigError in one line. Returns the rendezvous store, the
    secret and whether this run generated it (for `hetrain join`)."""
    torch.set_num_threads(cfg.train.threads)
    timeout = timedelta(seconds=cfg.dist.init_timeout_s)
    secret = rv.secret or auth.configured_secret()
    generated = bool(rv.secret)
    secret_file = None
    if not secret and rv.rank == 0:
        if run_dir is None:
            raise ConfigError(f"this run has no secret for its ranks to prove: set "
                              f"{auth.ENV_SECRET} on every node ({auth.HOW_TO_SET})")
        secret, secret_file = auth.write_secret_file(run_dir)
        generated = True
    check_backend(cfg)
    _gloo_on_loopback(rv.master_addr)
    store = join_rendezvous(rv, timeout)
    try:  # gloo: the PS's messages live in host memory; NCCL only joins the workers' group
        dist.init_process_group("gloo", store=store, rank=rv.rank,
                                world_size=rv.world_size, timeout=timeout)
    except (RuntimeError, dist.DistError) as e:
        text = str(e)
        if "address already in use" in text.lower() or "EADDRINUSE" in text:
            raise ConfigError(f"port {rv.master_port} on {rv.master_addr} is already in use; "
                              "pick another with --port PORT (or 0 for a free one)") from None
        if isinstance(e, dist.DistStoreError) or "timeout" in text.lower() \
                or "timed out" in text.lower():
            why = (f"rank {rv.rank}: not all {rv.world_size} ranks joined the run at "
                   f"{_endpoint(rv)} within {cfg.dist.init_timeout_s:g} s (is every node "
                   f"started with the same --nproc-per-node and --master, and is "
                   f"GLOO_SOCKET_IFNAME/--ifname right?)")
            if rv.local_rank not in (None, 0):  # the node's first process says it once
                raise ReportedElsewhereError(why) from None
            raise ConfigError(why) from None
        raise
    secret = secret or auth.read_secret_file(run_dir)
    try:
        auth.handshake(rv.rank, rv.world_size, secret)
    except ConfigError:
        dist.destroy_process_group()  # the others' next receive fails: nobody waits for us
        raise
    finally:
        if secret_file is not None:
            secret_file.unlink(missing_ok=True)
    return store, secret, generated


def _join_desk(rv: Rendezvous, cfg: RunConfig, prep: Prepared, run_dir: Path | None,
               store: dist.Store, secret: str, generated: bool) -> JoinDesk:
    """Rank 0's desk for `hetrain join` (hetrain.engine.join); with a run folder it writes
    runs/<name>/join.json (and the generated secret, 0600) while the run lasts."""
    desk = JoinDesk(store, secret, run=cfg.name, strategy=prep.strategy.name,
                    comm=prep.strategy.comm, ps_shards=cfg.dist.ps_shards,
                    n_workers=prep.cluster.n, timeout_s=cfg.dist.init_timeout_s)
    if run_dir is not None and desk.joinable:
        prefix = (f"hetrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
                  if rv.from_env else "")
        desk.write_files(run_dir, _endpoint(rv), prefix, generated)
    return desk


def _setup_logging() -> None:
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


def effective_inputs(cfg: RunConfig, cluster: Cluster | None, workload: Workload | None
                      ) -> tuple[Cluster, Workload]:
    """The cluster the run emulates (calibrated for emulate = "relative") and the workload."""
    cluster = cluster or load_cluster(cfg.cluster)
    workload = workload or workload_from_config(cfg.workload)
    if cfg.dist.emulate == "relative":
        cluster = calibrated_cluster(cluster, workload, flops_per_sample(workload),
                                     cfg.train.batch_size, cfg.dist.contention_k)
    return cluster, workload


def _n_workers(world_size: int, shards: int) -> int:
    """Ranks 1..n are the workers; the PS shards are the last shards - 1 ranks."""
    return world_size - shards


def _worker_group(world_size: int, cfg: RunConfig) -> dist.ProcessGroup | None:
    """Every rank must create the worker group of ranks 1..n (a collective over the default
    group); the PS shards n+1.. are not in it. Its backend is dist.backend (NCCL among GPU
    workers, created lazily: rank 0 and the shards are not members and need no GPU)."""
    n = _n_workers(world_size, cfg.dist.ps_shards)
    return dist.new_group(ranks=list(range(1, n + 1)), backend=cfg.dist.backend)


def check_backend(cfg: RunConfig) -> None:
    """dist.backend = "nccl" needs a torch built with NCCL (a CUDA build)."""
    if cfg.dist.backend == "nccl" and not dist.is_nccl_available():
        raise ConfigError("dist.backend = 'nccl' but this torch has no NCCL (a CPU build); "
                          "use dist.backend = 'gloo', or install a CUDA build of torch")


def check_devices(cfg: RunConfig, cluster: Cluster, strategy_comm: str, layout: tuple[int, int],
                  gpus: devices.GpuInventory | None = None) -> torch.device:
    """Rank 0's device, and, for the ranks on rank 0's node (`layout` = rank 0's local rank
    and local world size), every worker's device checked before any process joins: a device
    that does not exist, too many GPU workers for the node's GPUs, NCCL with a CPU worker,
    each in one line. Workers on other nodes check theirs at setup (Worker._device)."""
    check_backend(cfg)
    gpus = gpus or devices.GpuInventory.probe()
    ps = devices.device_of(0, layout, cfg.dist, cluster.devices, gpus=gpus)
    local, local_world = layout
    for rank in range(1, min(local_world - local, cluster.n + 1)):
        devices.device_of(rank, (local + rank, local_world), cfg.dist, cluster.devices,
                          strategy_comm, gpus)
    return ps


def check_ps_shards_fit(prep: Prepared) -> None:
    """dist.ps_shards needs a PS strategy, at least one parameter tensor per shard and at
    most one shard per device (hetrain.validate.check_ps_shard_count)."""
    shards = prep.cfg.dist.ps_shards
    if shards == 1:
        return
    if prep.cfg.optimizer.clip_grad_norm > 0 and prep.strategy.pushes == "gradient":
        raise ConfigError("optimizer.clip_grad_norm clips the whole gradient, but with "
                          f"dist.ps_shards = {shards} each PS shard steps on a block of it; "
                          "use ps_shards = 1 to clip")
    check_ps_shard_count(shards, prep.strategy.name, prep.strategy.comm, prep.cluster.n,
                    len(list(prep.workload.build_model().parameters())))


def run_rank(rv: Rendezvous, cfg: RunConfig, *, run_dir: Path | None = None,
             progress: ProgressFn | None = None, cluster: Cluster | None = None,
             workload: Workload | None = None, strategy: Strategy | None = None,
             faults: FaultPlan | None = None, prepared: Any = None) -> RunResult | None:
    """Run this process's role. Rank 0 returns the RunResult; workers return None.
    `prepared` (rank 0) has been through `check_ps_shards_fit` already."""
    _setup_logging()
    if rv.rank == 0:
        prep = prepared
        if prep is None:
            cluster, workload = effective_inputs(cfg, cluster, workload)
            prep = prepare(cfg, cluster=cluster, workload=workload, strategy=strategy)
            check_ps_shards_fit(prep)
        world = prep.cluster.n + cfg.dist.ps_shards
        if rv.world_size != world:
            raise ConfigError(
                f"{rv.world_size} processes for a cluster of {prep.cluster.n} devices and "
                f"dist.ps_shards = {cfg.dist.ps_shards}: the dist engine needs one rank per "
                f"device plus one per PS shard, i.e. {world} (torchrun --nproc-per-node "
                f"{world})")
        ps_device = check_devices(cfg, prep.cluster, prep.strategy.comm, rv.layout)
        devices.use(ps_device)
        store, secret, generated = init_process_group(rv, cfg, run_dir)
        try:
            _worker_group(rv.world_size, cfg)
            emulation = {"mode": cfg.dist.emulate, "time_scale": cfg.dist.time_scale}
            desk = _join_desk(rv, cfg, prep, run_dir, store, secret, generated)
            try:
                return Coordinator(prep, run_dir, progress, emulation, ps_device, desk).run()
            finally:
                desk.close()  # join.json and the secret go with the run, however it ends
        finally:
            dist.destroy_process_group()
    worker_signals()  # rank 0 decides when the run ends (hetrain.engine.signals)
    n = _n_workers(rv.world_size, cfg.dist.ps_shards)
    compressor = make_compressor(cfg.train.compression, **cfg.train.compression_options)
    if rv.rank <= n:  # a PS shard needs no data
        workload = workload or workload_from_config(cfg.workload)
    init_process_group(rv, cfg, run_dir)
    try:
        group = _worker_group(rv.world_size, cfg)
        if rv.rank > n:
            Shard(n, cfg, compressor).run()
            return None
        assert workload is not None
        fault = faults.faults.get(rv.rank) if faults is not None else None
        Worker(rv.rank, cfg, workload, compressor, group, fault,
               rv.layout if rv.local_rank is not None else None).run()
    except RuntimeError as e:
        if "gloo/transport" not in str(e):
            raise
        raise ConnectionLostError(f"rank {rv.rank}: {_gloo_reason(e)}: rank 0 (the server) "
                                  "stopped without ending the run (see its node's output), or "
                                  "the network between the nodes failed") from None
    finally:
        dist.destroy_process_group()
    return None


class ConnectionLostError(HetrainError):
    """A worker or PS shard lost its connection in the middle of the run."""


def _gloo_reason(e: BaseException) -> str:
    """'Connection closed by peer [10.0.0.1]:2789' from gloo's '[.../pair.cc:553] Connection
    closed by peer [10.0.0.1]:2789. This is typically caused by...'."""
    text = str(e).splitlines()[0]
    text = text.split("] ", 1)[1] if text.startswith("[") and "] " in text else text
    return text.split(". ", 1)[0].rstrip(".")[:160]


def _worker_main(rv: Rendezvous, cfg: RunConfig, conn: Connection,
                 faults: FaultPlan | None) -> None:
    """Entry of a spawned worker (or shard) process: imports done, wait for the workload
    rank 0 built."""
    torch.set_num_threads(cfg.train.threads)
    worker_signals()
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
    if cfg.train.resume:
        if strategy is not None:
            codec.allow(type(strategy))
        check_ps_shards(load_checkpoint(run_dir, cfg.strategy.name if strategy is None
                                        else strategy.name, cfg.to_dict()), cfg_d.ps_shards)
    listener = bind_listener(cfg_d.master_addr, cfg_d.port)
    port = listener.getsockname()[1]
    secret = auth.new_secret()
    spawner = Spawner()
    pipes = []

    def start(world: int) -> None:
        for rank in range(1, world):
            mine, theirs = spawner.pipe()
            rv = Rendezvous(rank, world, cfg_d.master_addr, port, secret=secret)
            # Not daemonic, so that a worker can start DataLoader workers (loader
            # num_workers > 0). Daemonic would only add multiprocessing's terminate at this
            # process's normal exit, and `reap` (the finally below, however rank 0's part
            # ends) has already joined or killed every worker by then; a SIGKILLed rank 0
            # runs neither. Workers also stop by themselves when rank 0's connection breaks.
            spawner.start(_worker_main, (rv, cfg, theirs, faults), daemon=False,
                          name=f"hetrain-worker-{rank}")
            pipes.append(mine)

    # The workers import torch while this process builds the workload and plans, except when
    # calibrating (emulate = "relative" measures a solo step time: nothing else may run) and
    # when PS shards must first be checked against the model (no processes for a bad count).
    early = cfg_d.emulate != "relative" and cfg_d.ps_shards == 1
    if early:
        start((cluster.n if cluster is not None else load_cluster(cfg.cluster).n)
              + cfg_d.ps_shards)
    result = None
    try:
        cluster, workload = effective_inputs(cfg, cluster, workload)
        prep = prepare(cfg, cluster=cluster, workload=workload, strategy=strategy)
        check_ps_shards_fit(prep)
        world = prep.cluster.n + cfg_d.ps_shards
        check_devices(cfg, prep.cluster, prep.strategy.comm, (0, world))
        if not early:
            start(world)
        for conn in pipes:
            conn.send(workload)
        pipes.clear()
        rv0 = Rendezvous(0, world, cfg_d.master_addr, port, secret=secret, listener=listener)
        result = run_rank(rv0, cfg, run_dir=run_dir, progress=progress, prepared=prep)
    finally:
        listener.close()  # still ours if rank 0 failed before its store took it over
        for conn in pipes:  # rank 0 failed before sending the workload: release the workers
            conn.send(None)
        reap(spawner, result.summary.get("lost_workers", []) if result is not None else [])
    assert result is not None
    return result


def reap(spawner: Spawner, lost: list[int]) -> None:
    """Every spawned rank has exited when this returns: a dropped worker (hung, or frozen
    by SIGSTOP) is killed at once, the others get JOIN_TIMEOUT_S to finish, then SIGKILL,
    with a warning naming it."""
    spawner.reap(JOIN_TIMEOUT_S, now=lost, warn=True)


def restarted_job_resumes(run_dir: Path | None, cfg: RunConfig) -> bool:
    """torchrun --max-restarts restarts every rank when one fails (a killed worker, a lost
    node); rank 0 checkpointed on the SIGTERM that came first, so the restarted job goes on
    from that checkpoint (with a fresh worker in the failed one's place). Only a checkpoint of
    this same job counts: a run of the same name from another job starts afresh."""
    env = os.environ
    if int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) < 1 or cfg.train.resume:
        return False
    if run_dir is None or not checkpoint_path(run_dir).is_file():
        return False
    state = load_checkpoint(run_dir, cfg.strategy.name, cfg.to_dict())
    if not state.job or state.job != env.get("TORCHELASTIC_RUN_ID", ""):
        return False
    _setup_logging()
    log.warning("hetrain: torchrun restart %s of job %s: resuming from %s at update %d",
                env["TORCHELASTIC_RESTART_COUNT"], state.job, checkpoint_path(run_dir),
                state.version)
    return True


def run_distributed(cfg: RunConfig, *, run_dir: Path | None = None,
                    progress: ProgressFn | None = None, cluster: Cluster | None = None,
                    workload: Workload | None = None, strategy: Strategy | None = None,
                    faults: FaultPlan | None = None) -> RunResult:
    """Entry point (runner.py dispatches engine = "dist" here).

    Under torchrun (RANK and WORLD_SIZE set) this process runs its own rank; workers then
    return a RunResult without rows (only rank 0 evaluates and writes the run files).
    Otherwise rank 0 runs here and the workers are spawned on this machine.
    """
    if cfg.parallel is not None:  # an AutoDDL plan instead of a strategy
        from hetrain.parallel.train import run_parallel

        return run_parallel(cfg, run_dir=run_dir, progress=progress, cluster=cluster,
                            workload=workload)
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        if env["RANK"] == "0" and restarted_job_resumes(run_dir, cfg):
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=True))
        rv = Rendezvous(int(env["RANK"]), int(env["WORLD_SIZE"]),
                        env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")),
                        from_env=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                        local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))
        result = run_rank(rv, cfg, run_dir=run_dir,
                          progress=progress if rv.rank == 0 else None, cluster=cluster,
                          workload=workload, strategy=strategy, faults=faults)
        if result is None:
            n = _n_workers(rv.world_size, cfg.dist.ps_shards)
            role = "ps_shard" if rv.rank > n else "worker"
            return RunResult(cfg.name, [], {"name": cfg.name, "engine": "dist", "role": role,
                                            "rank": rv.rank, "strategy": cfg.strategy.name,
                                            "final_accuracy": None}, None)
        return result
    return spawn_local(cfg, run_dir=run_dir, progress=progress, cluster=cluster,
                       workload=workload, strategy=strategy, faults=faults)
