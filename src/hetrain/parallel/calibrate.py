"""Calibrate the plan cost model on the processes that will train: microbenchmarks only.

The cost model prices compute as FLOPs / device FLOP/s and communication by ring formulas over
the cluster's links. On real processes two more things decide which plan is fastest for a
small or medium model: a fixed cost per collective call (gloo's and DTensor's dispatch, about a
millisecond here, more than a 4 KiB transfer) and a fixed cost per op's forward + backward
(framework dispatch), and op kinds run at different fractions of the matmul rate. Without
them the search picked, on 4 equal CPU processes, a plan 2.7x slower than the fastest one
(benchmarks/results/autoddl_best_plan). `calibrate` measures them, every rank at once, no plan
timed:

* matmul FLOP/s (each rank's, their median);
* DTensor redistributions, what the executor calls, back to back: all-reduce, all-gather,
  reduce-scatter and all-to-all over the mesh of all ranks and over each axis of a
  (2, world / 2) mesh, and the all-reduce over both axes of that mesh (DTensor runs one per
  axis in turn, as a 2-D data-parallel gradient sync does). The all-reduces fit t = calls x
  (call_s + steps(p) alpha + frac(p) n / beta), the others per-collective factors against
  that ring (sbp.CollectiveFactors);
* forward + backward of one op of each kind at two sizes: t = overhead + c x FLOPs / rate,
  i.e. each kind's fixed overhead and its throughput relative to the matmul FLOP/s.

Timings are medians over repeats, not minima: ranks that share cores contend in every real
step as well. Rank 0's fit is sent to every rank (hetrain.engine.codec: plain data, nothing
unpickled), so every rank prices plans with identical numbers. `quick` (what `hetrain run`
does at start-up, a few seconds) times fewer sizes and repeats than the benchmarks' full
calibration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hetrain.plan.cost import CostOptions

_FORMULA: dict[str, Callable[[int], tuple[float, float]]] = {
    # (latency steps, byte fraction) of each ring collective over p devices
    "all_reduce": lambda p: (2 * (p - 1), 2 * (p - 1) / p),
    "all_gather": lambda p: (p - 1, (p - 1) / p),
    "reduce_scatter": lambda p: (p - 1, (p - 1) / p),
    "all_to_all": lambda p: (p - 1, (p - 1) / p**2),
}
_WEIGHTED = ("linear", "conv", "embedding", "layernorm")  # the cost model's 3x (else 2x)
FULL_SIZES = (9, 12, 14, 16, 18, 20, 22)
"""log2 of the bytes each collective moves: 512 B .. 4 MiB (the full calibration)."""
QUICK_SIZES = (9, 14, 18, 22)

Row = tuple[str, int, int, float]
"""(collective, group size p, bytes held by one group, seconds per call)."""


def _time_s(fn: Callable[[], Any], calls: int = 8, reps: int = 7) -> float:
    """Median over reps of the mean time of `calls` back-to-back calls, all ranks starting
    together: back to back, as the executor's per-tensor gradient loop and ops run. The
    median, not the least: ranks that share cores contend in every plan's step; the least
    caught moments a rank ran alone and made the replicated plan look 2.7x faster than it
    runs (4 ranks on 2 cores). 7 repeats (3 before: the fitted per-call cost varied
    309-1110 us between repeats)."""
    fn()
    out = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls)
    return statistics.median(out)


def _mesh(shape: tuple[int, ...], timeout_s: float | None) -> Any:
    """init_device_mesh, its groups' collectives bounded by `timeout_s` (None: gloo's)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape)
    if timeout_s is not None:
        from hetrain.parallel.train import set_timeouts

        set_timeouts(timeout_s)
    return mesh


def _meshes(world: int, timeout_s: float | None) -> list[tuple[Any, int]]:
    """(mesh, axis) pairs to time collectives on: all ranks in one group, and each axis of
    a (2, world / 2) mesh where world is even and at least 4."""
    out = [(_mesh((world,), timeout_s), 0)]
    if world >= 4 and world % 2 == 0:
        m2 = _mesh((2, world // 2), timeout_s)
        out += [(m2, 0), (m2, 1)]
    return out


def collective_times(world: int, sizes: tuple[int, ...] = FULL_SIZES, calls: int = 8,
                     reps: int = 7, timeout_s: float | None = None) -> list[Row]:
    """Rows of DTensor redistributions on the meshes of `_meshes` (every rank calls)."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import Placement

    if world < 2:
        return []
    meshes = _meshes(world, timeout_s)
    moves: dict[str, tuple[Placement, Placement]] = {
        "all_reduce": (Partial(), Replicate()), "all_gather": (Shard(0), Replicate()),
        "reduce_scatter": (Partial(), Shard(0)), "all_to_all": (Shard(0), Shard(1))}
    out: list[Row] = []
    for mesh, axis in meshes:
        p = mesh.shape[axis]
        for kind, (src, dst) in moves.items():
            for nbytes in [2**k for k in sizes]:
                full = torch.zeros(max(nbytes // 4 // 32, 4, p), 32)
                pl_src: list[Placement] = [Replicate()] * mesh.ndim
                pl_dst = list(pl_src)
                pl_src[axis], pl_dst[axis] = src, dst
                x = distribute_tensor(full, mesh, [Replicate() if isinstance(q, Partial) else q
                                                   for q in pl_src], src_data_rank=None)
                if isinstance(src, Partial):
                    x = type(x).from_local(x.to_local(), mesh, pl_src, run_check=False)
                out.append((kind, p, nbytes, _time_s(
                    functools.partial(x.redistribute, mesh, pl_dst), calls, reps)))
    if len(meshes) > 1:  # partial on both axes -> replicated: one all-reduce per axis, in turn
        mesh = meshes[1][0]
        m = mesh.shape[1]
        for nbytes in [2**k for k in sizes]:
            full = torch.zeros(max(nbytes // 4 // 32, 4, world), 32)
            x = distribute_tensor(full, mesh, [Replicate(), Replicate()], src_data_rank=None)
            x = type(x).from_local(x.to_local(), mesh, [Partial(), Partial()], run_check=False)
            out.append(("all_reduce_both_axes", m, nbytes, _time_s(
                functools.partial(x.redistribute, mesh, [Replicate(), Replicate()]),
                calls, reps)))
    return out


def fit_collectives(rows: list[Row]) -> tuple[float, float, float, list[tuple[str, float, float]]]:
    """(call_s, alpha, beta, factors): the all-reduces fit to t = calls x call_s + the ring
    formula (a fixed per-call cost plus latency steps x alpha plus bytes / beta), then each
    other collective's (latency, per-byte) factors against that ring with the same call_s.

    The all-reduce over both axes of the (2, m) mesh (a ring of 2 then a ring of m) joins the
    fit: with only single calls over p = 2 and p = 4 the split between call_s and alpha was
    ill-determined, and it decides whether a 1-D all-reduce of 4 beats two of 2 (data vs 2-D
    data parallel). Refitting the same 5 repeats' timings without those rows gave VGG's
    Spearman against the measured order 0.69 instead of 0.90 (autoddl_fit_ablation)."""
    from scipy.optimize import nnls  # type: ignore[import-untyped]

    def ring(kind: str, p: int, n: int) -> list[float]:
        steps, frac = _FORMULA[kind](p)
        return [steps, frac * n]

    ar = [(1.0, ring("all_reduce", p, n), t) for k, p, n, t in rows if k == "all_reduce"]
    ar += [(2.0, list(np.add(ring("all_reduce", 2, n), ring("all_reduce", p, n))), t)
           for k, p, n, t in rows if k == "all_reduce_both_axes"]
    a = np.array([[calls, *x] for calls, x, _ in ar])
    (call_s, alpha, inv_beta), _ = nnls(a, np.array([t for *_, t in ar]))
    alpha, inv_beta = max(alpha, 1e-7), max(inv_beta, 1e-12)
    factors = []
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        sel = [(ring(kind, p, n), t) for k, p, n, t in rows if k == kind]
        (fa, fb), _ = nnls(np.array([x for x, _ in sel]),
                           np.maximum(np.array([t for _, t in sel]) - call_s, 0.0))
        factors.append((kind, max(fa, 1e-7) / alpha, max(fb, 1e-12) / inv_beta))
    return float(call_s), float(alpha), float(1.0 / inv_beta), factors


def _op_cases(s: int) -> dict[str, tuple[Any, list[torch.Tensor], float]]:
    """kind -> (module or function, inputs, forward FLOPs by graph.py's conventions) at 1/s of
    a base size (s=1 about a tiny GPT's and VGG's sizes, s=8 nearly pure overhead)."""
    import torch.nn.functional as F
    from torch import nn

    b, t, c, h = 16 // s, 32, 128 // s, 4
    n, ch, px = b * t * c, 16 // s, 32 // s

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (z.view(b, t, -1, c // h).transpose(1, 2) for z in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)

    def x(*shape: int) -> torch.Tensor:
        return torch.randn(*shape)

    return {"linear": (nn.Linear(c, c), [x(b, t, c)], 2.0 * n * c),
            "layernorm": (nn.LayerNorm(c), [x(b, t, c)], 8.0 * n),
            "attention": (attn, [x(b, t, c), x(b, t, c), x(b, t, c)], 4.0 * b * t * t * c + 5.0 * b * h * t * t),
            "elementwise": (F.gelu, [x(b, t, 4 * c)], 8.0 * 4 * n),
            "add": (torch.add, [x(b, t, c), x(b, t, c)], 1.0 * n),
            "embedding": (nn.Embedding(256, c), [torch.randint(0, 256, (b, t))], 2.0 * n),
            "conv": (nn.Conv2d(ch, ch, 3, padding=1), [x(2 * ch, ch, px, px)], 2.0 * 2 * ch * px * px * ch * ch * 9),
            "cross_entropy": (F.cross_entropy, [x(b * t, 256), torch.randint(0, 256, (b * t,))], 4.0 * b * t * 256)}


def op_profile(world: int, flops: float, calls: int = 5, reps: int = 9,
               timeout_s: float | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """Per op kind, (fixed overhead s, throughput / matmul FLOP/s) of forward + backward of
    replicated DTensors on the mesh of all ranks, every rank at once, from a small and a base
    size: t(size) = overhead + c flops(size) / rate."""
    from torch import nn
    from torch.distributed.tensor import Replicate, distribute_tensor

    from hetrain.parallel.sdpa import register_cpu_sdpa_sharding

    register_cpu_sdpa_sharding()
    mesh = _mesh((world,), timeout_s)
    times: dict[tuple[str, int], tuple[float, float]] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for s in (1, 8):
            for kind, (fn, ins, fl) in _op_cases(s).items():
                if isinstance(fn, nn.Module):
                    for pn, p in list(fn.named_parameters()):
                        fn.register_parameter(pn, nn.Parameter(
                            distribute_tensor(p.detach(), mesh, [Replicate()])))
                args = [distribute_tensor(z, mesh, [Replicate()]).requires_grad_(z.is_floating_point())
                        for z in ins]

                def step(fn: Any = fn, args: list[Any] = args) -> None:
                    out = fn(*args)
                    out.backward(torch.ones_like(out))

                times[(kind, s)] = (_time_s(step, calls, reps), fl)
    overhead, speed = {}, {}
    for kind in _op_cases(1):
        (tb, fb), (ts, fs) = times[(kind, 1)], times[(kind, 8)]
        c = 3.0 if kind in _WEIGHTED else 2.0
        per_flop = max(tb - ts, 0.05 * tb) / (c * (fb - fs))
        overhead[kind] = max(ts - c * fs * per_flop, 0.0)
        speed[kind] = 1.0 / per_flop / flops
    return overhead, speed


def _matmul_flops(seconds: float) -> float:
    """This rank's fp32 matmul FLOP/s at the tiny models' sizes, over `seconds`."""
    a, b = torch.randn(512, 128), torch.randn(128, 512)
    dist.barrier()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ b
        n += 10
    return 2.0 * 512 * 128 * 512 * n / (time.perf_counter() - t0)


TIMED_ON_PURPOSE = ("torch.distributed.tensor._collective_utils",
                    "torch.distributed.tensor._redistribute")
"""DTensor's loggers for what the calibration times on purpose: gloo's all-to-all fallback (an
all-gather and a chunk) and the both-axes all-reduce of a 2-D mesh run one axis at a time.
Their warnings ("suboptimal", "falling back"), once per rank, would read as faults of the run."""


@contextlib.contextmanager
def quiet_timed_paths() -> Iterator[None]:
    """Mute TIMED_ON_PURPOSE's warnings (errors still show) while calibrating."""
    loggers = [logging.getLogger(name) for name in TIMED_ON_PURPOSE]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def calibrate(quick: bool = False, timeout_s: float | None = None) -> dict[str, Any]:
    """Microbenchmarks on every rank of the default group (collective: every rank calls);
    returns rank 0's figures on every rank, plain data (JSON-able): flops, call_s, alpha_s,
    beta_Bps, factors, op_overhead_s, kind_speed, collective_rows, seconds. `timeout_s`: how
    long a collective of the groups it creates waits for a peer (gloo's default: 30 min)."""
    with quiet_timed_paths():
        return _calibrate(quick, timeout_s)


def _calibrate(quick: bool, timeout_s: float | None) -> dict[str, Any]:
    from hetrain.parallel.train import broadcast_from_rank0

    t0 = time.perf_counter()
    world = dist.get_world_size()
    flops_all = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(flops_all, torch.tensor([_matmul_flops(0.5 if quick else 2.0)],
                                            dtype=torch.float64))
    flops = statistics.median(float(f.item()) for f in flops_all)
    if quick:
        rows = collective_times(world, QUICK_SIZES, calls=4, reps=5, timeout_s=timeout_s)
    else:
        rows = collective_times(world, timeout_s=timeout_s)
    call_s, alpha, beta, factors = fit_collectives(rows) if rows else (0.0, 0.0, 0.0, [])
    overhead, speed = op_profile(world, flops, *((3, 5) if quick else (5, 9)),
                                 timeout_s=timeout_s)
    calib = dict(flops=flops, alpha_s=alpha, beta_Bps=beta, factors=factors, call_s=call_s,
                 op_overhead_s=overhead, kind_speed=speed, collective_rows=rows,
                 seconds=time.perf_counter() - t0)
    return broadcast_from_rank0(calib if dist.get_rank() == 0 else None)


def median_calibration(cals: list[dict[str, Any]]) -> dict[str, Any]:
    """Each calibrated figure's median over several calibrations (raw collective rows kept,
    one list per calibration)."""
    def med(get: Any) -> float:
        return statistics.median(get(c) for c in cals)

    factors = [{k: (x, y) for k, x, y in c["factors"]} for c in cals]
    return {**{k: med(lambda c, k=k: c[k]) for k in ("flops", "alpha_s", "beta_Bps", "call_s")},
            "factors": [(k, statistics.median(f[k][0] for f in factors),
                         statistics.median(f[k][1] for f in factors)) for k in factors[0]],
            **{d: {k: med(lambda c, d=d, k=k: c[d][k]) for k in cals[0][d]}
               for d in ("op_overhead_s", "kind_speed")},
            "collective_rows": [c["collective_rows"] for c in cals]}  # raw, in order


def cost_options(calib: dict[str, Any], base: CostOptions | None = None,
                 compute: bool = True) -> CostOptions:
    """`base` with the calibration's corrections: the per-call cost and per-collective factors,
    and, with `compute`, each op kind's overhead and relative throughput (leave those out where
    compute is padded to the cluster file's figures, hetrain run's speed emulation)."""
    out = dataclasses.replace(
        base or CostOptions(),
        collective_factors=tuple((str(k), float(a), float(b)) for k, a, b in calib["factors"]),
        collective_call_s=float(calib["call_s"]))
    if not compute:
        return out
    return dataclasses.replace(
        out, op_overhead_s=tuple(sorted((str(k), float(v))
                                        for k, v in calib["op_overhead_s"].items())),
        kind_speed=tuple(sorted((str(k), float(v)) for k, v in calib["kind_speed"].items())))


def read_calibration(path: str) -> dict[str, Any]:
    """A calibration from a file: a [parallel] run's summary.json (its parallel.calibration)
    or the figures alone as JSON. Plain JSON, checked; one ConfigError line if unusable."""
    import json
    import math
    from pathlib import Path

    from hetrain.errors import ConfigError

    fix = "give a [parallel] run's summary.json with plan = \"auto\" and parallel.calibrate on"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"--calibration '{path}' cannot be read as JSON ({e}); {fix}") from None
    if isinstance(data, dict) and "parallel" in data:
        data = (data.get("parallel") or {}).get("calibration")
        if data is None:
            raise ConfigError(f"--calibration '{path}': that run was not calibrated; {fix}")

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    ok = (isinstance(data, dict) and number(data.get("call_s"))
          and isinstance(data.get("factors"), list)
          and all(isinstance(f, list) and len(f) == 3 and f[0] in _FORMULA
                  and number(f[1]) and number(f[2]) for f in data["factors"])
          and all(isinstance(data.get(k), dict) and all(isinstance(n, str) and number(v)
                                                        for n, v in data[k].items())
                  for k in ("op_overhead_s", "kind_speed"))
          and all(v > 0 for v in data["kind_speed"].values()))
    if not ok:
        raise ConfigError(f"--calibration '{path}' is not a calibration (call_s, factors, "
                          f"op_overhead_s, kind_speed, all non-negative numbers); {fix}")
    return data
