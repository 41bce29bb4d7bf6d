"""Profiling on the real engine: time each worker's steps and its link to rank 0 (ASHL stage 0).

The same processes as a dist run (rank 0 + one worker per device, gloo, the same emulation,
joined by `dist.init_process_group`), but instead of training they answer three probes:

- steps: every worker, all at once (as in training, so contention is included), times
  `steps` SGD steps at each of the batch sizes b/2, b, 2b (interleaved); the line through
  every repeat and the judgement of whether it can be a speed are `hetrain.profile.fit`'s.
- ping: rank 0 sends a tiny message to one worker at a time and times the echo
  (round trip = 2 latency).
- pull/push: a model-sized message to the worker, and a model-sized answer back; each leg
  takes latency + bytes / bandwidth, so bandwidth = bytes / (leg - latency).

The result is the `Profile` the planners take (source "measured") and a Cluster with the
measured devices, each with its measured access link, in one site whose own LAN is made
negligible (so `ps_link(i)` is the measured link). With dist.emulate on, what is timed is the
emulated cluster as the throttle pads it (`sources`), not this machine's hardware.

`measure_overheads` / `with_overheads` calibrate the simulator for an emulated run: the real
per-message and per-synchronous-step costs of this machine, added to the emulated cluster (the
PS's per-message time, the LAN latency), give the cluster that a run emulating it behaves like.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch

from hetrain.cluster import Cluster, Link, Site
from hetrain.config import RunConfig
from hetrain.engine import auth, devices
from hetrain.engine import dist as dist_engine
from hetrain.engine.core import flat_params
from hetrain.engine.emulate import Throttle, sleep_until
from hetrain.engine.messages import (
    Echo,
    Message,
    Model,
    Ping,
    Setup,
    Steps,
    StepTimes,
    Stop,
    expect,
    present,
)
from hetrain.engine.spawn import Spawner
from hetrain.engine.wire import free_port, recv_obj, send_obj
from hetrain.profile.fit import StepFit, fit_step_time, judge_fits, profile_batch_sizes, sources
from hetrain.profile.profile import Profile, worker_profiles
from hetrain.workloads import Workload, flops_per_sample, map_tensors

FAST = Link(1e15, 0.0)


def _step_times_s(wl: Workload, throttle: Throttle, batch_sizes: Sequence[int], steps: int,
                  device: torch.device) -> list[list[float]]:
    """`steps` timed SGD steps per batch size after 2 warm-up steps each.

    Sizes interleave (b1, b2, b3, b1, ...) so a machine that gets busier mid-probe slows every
    size alike instead of tilting the line. On CUDA each step ends in a synchronise, so the
    time is the kernels' and not only their launch.
    """
    model = wl.build_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    n = len(wl.train)  # type: ignore[arg-type]

    def step(batch: int) -> None:
        data = map_tensors(lambda t: t.to(device), wl.batch(torch.arange(batch) % n))
        opt.zero_grad(set_to_none=True)
        wl.loss(model, data).backward()
        opt.step()
        devices.sync(device)

    for b in batch_sizes:
        for _ in range(2):
            throttle.run(functools.partial(step, b), b, 1)
    throttle.overruns = 0
    times: list[list[float]] = [[] for _ in batch_sizes]
    for _ in range(steps):
        for ts, b in zip(times, batch_sizes, strict=True):
            ts.append(throttle.run(functools.partial(step, b), b, 1)[1])
    return times


def _worker(rv: dist_engine.Rendezvous, cfg: RunConfig, conn: Connection) -> None:
    torch.set_num_threads(cfg.train.threads)
    wl = conn.recv()
    dist_engine.init_process_group(rv, cfg)
    try:
        setup = expect(recv_obj(0)[0], Setup)
        w, cluster = present(setup.worker, setup, "worker"), present(setup.cluster, setup,
                                                                     "cluster")
        em = present(setup.emulation, setup, "emulation")
        on = em["mode"] != "none"
        th = Throttle(cluster.devices[w] if on else None, cluster.ps_link(w) if on else None,
                      present(setup.flops_per_sample, setup, "flops_per_sample"),
                      em["time_scale"])
        # rank 0 checked this layout (check_devices) before it started the workers
        device = devices.device_of(rv.rank, rv.layout, cfg.dist, cluster.devices)
        devices.use(device)
        while True:
            msg, nbytes = recv_obj(0)
            if isinstance(msg, Stop):
                return
            if isinstance(msg, Steps):
                times = _step_times_s(wl, th, msg.batch_sizes, msg.steps, device)
                send_obj(StepTimes(times=times, overruns=th.overruns), 0)
            else:  # echo: hold the pull on my emulated link, hold my answer likewise
                th.hold(nbytes)
                reply = Echo(data=msg.data if isinstance(msg, Ping)
                             else expect(msg, Model).answer)
                th.hold(nbytes)
                send_obj(reply, 0)
    finally:
        import torch.distributed as dist
        dist.destroy_process_group()


def _timed(msg: Message, w: int) -> float:
    t = time.perf_counter()
    send_obj(msg, w + 1)
    recv_obj(w + 1)
    return time.perf_counter() - t


@dataclass(frozen=True)
class Measurement:
    """What `measure` found, with what the CLI must say about it."""

    profile: Profile
    cluster: Cluster
    fits: tuple[StepFit, ...]
    sources: str
    """Where the figures come from (`sources`)."""
    overruns: tuple[int, ...]
    """Per device, timed steps that overran the emulated budget (then partly this machine's)."""
    timed_steps: int
    """Timed steps per device (all batch sizes)."""
    warning: str | None
    """The --force warning line (None: every fit was plausible)."""


def measure(cfg: RunConfig, *, cluster: Cluster | None = None, workload: Workload | None = None,
            steps: int = 8, probes: int = 5, force: bool = False) -> Measurement:
    """Profile the cluster `cfg` describes on real processes (emulated as cfg.dist says).

    Raises ConfigError, naming the devices, if a fit is implausible and not `force`.
    """
    # the cluster a run of cfg emulates (for emulate = "relative": calibrated on this machine)
    base, wl = dist_engine.effective_inputs(cfg, cluster, workload)
    fps = flops_per_sample(wl)
    n, b = base.n, cfg.train.batch_size
    sizes = profile_batch_sizes(b)
    dist_engine.check_devices(cfg, base, "ps", (0, n + 1))  # each worker times on its device
    listener = dist_engine.bind_listener(cfg.dist.master_addr, cfg.dist.port)
    port, secret = listener.getsockname()[1], auth.new_secret()
    spawner = Spawner()
    for rank in range(1, n + 1):
        mine, theirs = spawner.pipe()
        rv = dist_engine.Rendezvous(rank, n + 1, cfg.dist.master_addr, port, secret=secret)
        spawner.start(_worker, (rv, cfg, theirs), daemon=True)
        mine.send(wl)
    rv0 = dist_engine.Rendezvous(0, n + 1, cfg.dist.master_addr, port, secret=secret,
                                 listener=listener)
    dist_engine.init_process_group(rv0, cfg)
    import torch.distributed as dist
    try:
        em = {"mode": cfg.dist.emulate, "time_scale": cfg.dist.time_scale}
        for w in range(n):
            send_obj(Setup(worker=w, cluster=base, flops_per_sample=fps, emulation=em), w + 1)
        for w in range(n):
            send_obj(Steps(batch_sizes=list(sizes), steps=steps), w + 1)
        replies = [expect(recv_obj(w + 1)[0], StepTimes) for w in range(n)]
        # A probe of at least 4 MB, so bytes / bandwidth stands out of the latency noise.
        model = flat_params(wl.build_model())
        model = torch.zeros(max(model.numel(), 1 << 20))
        tiny = torch.zeros(1)
        ping = [statistics.median(_timed(Ping(data=tiny), w)
                                  for _ in range(probes)) for w in range(n)]
        big = [statistics.median(_timed(Model(data=model, answer=model), w)
                                 for _ in range(probes)) for w in range(n)]
        for w in range(n):
            send_obj(Stop(), w + 1)
    finally:
        dist.destroy_process_group()
        spawner.reap(30, stop="terminate")
    fits = tuple(fit_step_time(sizes, r.times) for r in replies)
    warning = judge_fits([d.name for d in base.devices], fits, fps, force=force)
    at_b = [statistics.median(r.times[sizes.index(b)]) for r in replies]
    nbytes = model.numel() * 4
    model_bytes = flat_params(wl.build_model()).numel() * 4
    devices, links = [], []
    for w, d in enumerate(base.devices):
        fit = fits[w]
        # forced past a non-positive slope: charge the whole step at b per sample (slowest)
        c, a = (fit.per_sample_s, fit.overhead_s) if fit.per_sample_s > 0 else (at_b[w] / b, 0.0)
        lat = ping[w] / 2
        leg = max(big[w] / 2 - lat, 1e-9)
        link = Link(nbytes / leg, lat)
        links.append(link)
        devices.append(replace(d, flops=fps / c, step_overhead_s=max(a, 0.0), site="measured",
                               link=link))
    measured = Cluster(f"{base.name}-measured", tuple(devices),
                       (Site("measured", FAST, FAST),), ps_site="measured")
    profile = Profile(worker_profiles([d.name for d in base.devices], b, at_b,
                                      [lk.transfer_time_s(model_bytes) for lk in links],
                                      [lk.transfer_time_s(model_bytes) for lk in links]),
                      model_bytes, model_bytes, "measured")
    return Measurement(profile, measured, fits,
                       sources(cfg.dist.emulate, cfg.dist.time_scale, base.name),
                       tuple(int(present(r.overruns, r, "overruns")) for r in replies),
                       steps * len(sizes),
                       warning)


# ---- per-message and per-collective overhead (simulator calibration) ------------------------
@dataclass(frozen=True)
class Overheads:
    """This machine's real costs that an emulated cluster does not contain (real seconds)."""

    ps_message_s: float
    """One way, a model-sized message rank 0 <-> a worker (hetrain's framing): echo / 2."""
    sync_round_s: float
    """A synchronous data-parallel step minus its slowest compute budget: the wake-up of the
    padded ranks, the all-reduce of the gradients and the optimizer step, under contention."""


def _overhead_worker(rank: int, world: int, port: int, secret: str, cluster: Cluster,
                     wl: Workload, fps: float, batch: int, time_scale: float, steps: int,
                     probes: int, out: Any) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    rv = dist_engine.Rendezvous(rank, world, "127.0.0.1", port, secret=secret)
    dist.init_process_group("gloo", store=dist_engine.rendezvous_store(rv, timedelta(0, 120)),
                            rank=rank, world_size=world)
    auth.handshake(rank, world, secret)
    group = dist.new_group(list(range(1, world)), backend="gloo")
    try:
        model = flat_params(wl.build_model())
        if rank == 0:
            echo = [statistics.median(_timed(Ping(data=model), w)
                                      for _ in range(probes)) for w in range(world - 1)]
            out.put(("ps", statistics.median(echo) / 2))
            return
        for probe in range(probes * (world - 1)):  # echo rank 0's probes, worker by worker
            if rank == 1 + probe // probes:
                msg, _n = recv_obj(0)
                send_obj(msg, 0)
        th = Throttle(cluster.devices[rank - 1], None, fps, time_scale)
        net = wl.build_model()
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        idx = torch.arange(batch) % len(wl.train)  # type: ignore[arg-type]
        dist.barrier(group=group)
        ends = [time.perf_counter()]
        for _ in range(steps + 2):
            deadline = time.perf_counter() + th.compute_budget_s(batch, 1)
            data = wl.batch(idx)
            opt.zero_grad(set_to_none=True)
            wl.loss(net, data).backward()
            sleep_until(deadline)
            grads = torch.cat([p.grad.reshape(-1) if p.grad is not None  # unused in the loss
                               else torch.zeros_like(p).reshape(-1) for p in net.parameters()])
            dist.all_reduce(grads, group=group)
            opt.step()
            ends.append(time.perf_counter())
        if rank == 1:
            slowest = max(th.time_scale * d.compute_time_s(batch, fps, 1)
                          for d in cluster.devices)
            laps = [b - a for a, b in itertools.pairwise(ends[2:])]
            out.put(("sync", max(statistics.median(laps) - slowest, 0.0)))
    finally:
        dist.destroy_process_group()


def measure_overheads(cluster: Cluster, workload: Workload, batch_size: int,
                      time_scale: float, steps: int = 30, probes: int = 9) -> Overheads:
    """Measure `Overheads` with n + 1 processes laid out as the dist engine lays them."""
    world = cluster.n + 1
    port = free_port()
    spawner = Spawner()
    out = spawner.simple_queue()
    args = (world, port, auth.new_secret(), cluster, workload, flops_per_sample(workload),
            batch_size, time_scale, steps, probes, out)
    for r in range(world):
        spawner.start(_overhead_worker, (r, *args), daemon=True)
    spawner.reap(300, stop="terminate")
    got = {}
    while not out.empty():
        k, v = out.get()
        got[k] = v
    if set(got) != {"ps", "sync"}:
        raise RuntimeError(f"overhead probes failed (exit codes {spawner.exit_codes()})")
    return Overheads(got["ps"], got["sync"])


def with_overheads(cluster: Cluster, o: Overheads, time_scale: float, comm: str) -> Cluster:
    """The cluster the simulator should time a `comm` ("ps" | "allreduce") strategy's run of
    `cluster`, emulated on this machine, with (the strategy still plans from `cluster`, as
    the real run's does).

    The emulation adds the cluster's own times and the machine adds `o` on top, in the
    cluster's clock (real / time_scale):

        ps:         ps_message_s += ps_message_s(o) / ts   (the PS serialises its messages)
        allreduce:  LAN latency  += sync_round_s / (2 (n - 1) ts)   (a ring has 2 (n - 1) hops)

    A PS message's cost is the rank-0 process's: one message at a time, so a synchronous
    round of n workers pays it n times over, which a per-link latency cannot express. An
    all-reduce's is spread over the ring's hops. One figure cannot serve both: a pickled
    point-to-point message and one hop of gloo's ring under contention cost differently
    (measured here under load: 1.6-3.2 ms vs 1.3-2.6 ms per hop).
    """
    if comm == "ps":
        return replace(cluster, name=f"{cluster.name}+measured-ps-overhead",
                       ps_message_s=cluster.ps_message_s + o.ps_message_s / time_scale)
    extra = o.sync_round_s / (2 * max(cluster.n - 1, 1) * time_scale)
    sites = tuple(replace(s, lan=replace(s.lan, latency_s=s.lan.latency_s + extra))
                  for s in cluster.sites)
    return replace(cluster, name=f"{cluster.name}+measured-allreduce-overhead", sites=sites)
