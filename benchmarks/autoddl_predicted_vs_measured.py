"""Predicted vs measured step time of SBP plans on 4 gloo processes on this machine.

    .venv/bin/python benchmarks/autoddl_predicted_vs_measured.py [--repeats 3] [--steps 4]

Per repeat, one spawn of 4 CPU processes (one thread each):
1. calibrate a priori, with microbenchmarks only (no plan is timed for calibration): each rank
   times fp32 matmuls of the models' sizes while all four run at once (the median is every
   device's FLOP/s), and all-reduce, all-gather, reduce-scatter and all-to-all of 4 KiB..4 MiB
   are timed; the all-reduce fit to t = 2(p-1) alpha + 2(p-1)/p n / beta (the cost model's
   ring formula) gives the loopback link, the others' fits give per-collective factors
   (gloo's all-gather costs like its all-reduce, its reduce-scatter has a large latency);
2. run every plan (templates on a 1-D mesh of 4 and a 2 x 2 mesh, plus the plan the search
   picks for the calibrated cluster) for 2 warm-up and --steps timed steps of real training
   (tiny GPT and VGG, DTensor executor, SGD), the plans' steps interleaved round-robin so
   that load from other work on the machine hits all plans alike; keep each median.
The cost model then predicts each plan's iteration time on the calibrated Cluster; we report
Spearman's rank correlation between predicted and measured per model and pooled, per repeat.
Writes benchmarks/results/autoddl_predicted_vs_measured.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from scipy.stats import spearmanr

from hetrain.cluster import Cluster, Device, Link, Site
from hetrain.plan.cost import CostOptions, Plan, plan_cost
from hetrain.plan.graph import LayerGraph, gpt_graph, vgg_graph
from hetrain.plan.sbp import Mesh
from hetrain.plan.search import SearchOptions, search_plan, template_plan
from hetrain.workloads import MODELS
from hetrain.workloads.base import cross_entropy

OUT = Path(__file__).parent / "results"
M4, M22 = Mesh((4,), (0, 1, 2, 3)), Mesh((2, 2), (0, 1, 2, 3))
GPT = dict(n_layer=2, n_head=4, n_embd=128, vocab=256, T=32, B=16)
VGG = dict(image=(3, 32, 32), width=16, fc=128, B=32)
TEMPLATES_1D = ("dp", "tp", "mixed", "rep")
TEMPLATES_2D = ("dp-tp", "tp-dp", "dp-dp", "tp-tp", "dp-mixed")


def models() -> dict[str, tuple[LayerGraph, Any, Any]]:
    g = GPT
    gpt = (gpt_graph(g["n_layer"], g["n_embd"], g["n_head"], g["vocab"], g["T"], g["B"]),
           functools.partial(MODELS["gpt"], (g["T"],), g["vocab"], n_layer=g["n_layer"],
                             n_head=g["n_head"], n_embd=g["n_embd"]),
           lambda gen: (torch.randint(0, g["vocab"], (g["B"], g["T"]), generator=gen),
                        torch.randint(0, g["vocab"], (g["B"], g["T"]), generator=gen)))
    v = VGG
    vgg = (vgg_graph(v["B"], v["image"], width=v["width"], fc=v["fc"]),
           functools.partial(MODELS["vgg"], v["image"], 10, width=v["width"], fc=v["fc"]),
           lambda gen: (torch.randn(v["B"], *v["image"], generator=gen),
                        torch.randint(0, 10, (v["B"],), generator=gen)))
    return {"gpt": gpt, "vgg": vgg}


def cluster_from(flops: float, alpha_s: float, beta_Bps: float) -> Cluster:
    """The calibrated machine: 4 equal devices (the ranks are identical processes; the median
    of their concurrent matmul speeds) on one loopback "LAN"."""
    site = Site("local", Link(beta_Bps, alpha_s), Link(beta_Bps, alpha_s))
    return Cluster("local-4-gloo", tuple(Device(f"rank{i}", flops, 8e9, "local") for i in range(4)),
                   (site,))


def options_from(factors: list[tuple[str, float, float]]) -> CostOptions:
    return CostOptions(optimizer_states=0.0, collective_factors=tuple(map(tuple, factors)))  # type: ignore[arg-type]


def plans_for(graph: LayerGraph, cluster: Cluster, options: CostOptions) -> dict[str, Plan]:
    out = {t: template_plan(graph, M4, t) for t in TEMPLATES_1D}
    out |= {t: template_plan(graph, M22, t) for t in TEMPLATES_2D}
    found = search_plan(graph, cluster, SearchOptions(pipeline=False, subsets=False), options).plan
    out["searched"] = found
    return out


_FORMULA = {  # (latency steps, byte fraction) of each ring collective over p devices
    "all_reduce": lambda p: (2 * (p - 1), 2 * (p - 1) / p),
    "all_gather": lambda p: (p - 1, (p - 1) / p),
    "reduce_scatter": lambda p: (p - 1, (p - 1) / p),
    "all_to_all": lambda p: (p - 1, (p - 1) / p**2),
}


def _collective(kind: str, nbytes: int, world: int):  # type: ignore[no-untyped-def]
    full, part = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4 // world)
    return {"all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: dist.all_gather_into_tensor(full, part),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
            "all_to_all": lambda: dist.all_to_all_single(full.clone(), full)}[kind]


def _calibrate(rank: int, world: int) -> tuple[float, float, float, list[tuple[str, float, float]]]:
    """(FLOP/s, alpha_s, beta_Bps, per-collective factors), identical on every rank."""
    from scipy.optimize import nnls

    a, b = torch.randn(512, 128), torch.randn(128, 512)
    dist.barrier()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 2.0:
        for _ in range(10):
            a @ b
        n += 10
    mine = 2.0 * 512 * 128 * 512 * n / (time.perf_counter() - t0)
    flops: list[float] = [0.0] * world
    dist.all_gather_object(flops, mine)
    fits = {}
    sizes = [2**k for k in range(12, 23, 2)]
    for kind, formula in _FORMULA.items():
        times = []
        for nbytes in sizes:
            fn = _collective(kind, nbytes, world)
            fn()
            reps = []
            for _ in range(7):
                dist.barrier()
                t = time.perf_counter()
                fn()
                reps.append(time.perf_counter() - t)
            times.append(statistics.median(reps))
        steps, frac = formula(world)
        (alpha, inv_beta), _ = nnls(np.array([[steps, frac * s] for s in sizes]), np.array(times))
        fits[kind] = (max(alpha, 1e-7), max(inv_beta, 1e-12))
    alpha, inv_beta = fits["all_reduce"]
    factors = [(k, fa / alpha, fb / inv_beta) for k, (fa, fb) in fits.items() if k != "all_reduce"]
    calib = [statistics.median(flops), alpha, 1.0 / inv_beta, factors]
    dist.broadcast_object_list(calib, src=0)  # every rank searches with identical numbers
    return calib[0], calib[1], calib[2], calib[3]


def worker(rank: int, world: int, steps: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from hetrain.parallel.execute import PlanExecutor

    flops, alpha, beta, factors = _calibrate(rank, world)
    cluster, options = cluster_from(flops, alpha, beta), options_from(factors)
    runs = []  # every plan of every model stays alive; steps are interleaved round-robin so
    for name, (graph, build, make) in models().items():  # a change in machine load hits all
        gen = torch.Generator().manual_seed(1)
        batch = make(gen)
        for label, plan in plans_for(graph, cluster, options).items():
            mesh = init_device_mesh("cpu", plan.stages[0].mesh.shape)
            torch.manual_seed(0)
            model = build()
            ex = PlanExecutor(model, graph, plan, mesh, cross_entropy, cluster)
            opt = torch.optim.SGD(list(model.parameters()), lr=0.01, foreach=False)
            runs.append((name, label, ex, opt, batch, []))
    for k in range(steps + 2):
        for _, _, ex, opt, (x, y), times in runs:
            dist.barrier()
            t0 = time.perf_counter()
            ex.step(x, y, opt)
            dist.barrier()
            if k >= 2:
                times.append(time.perf_counter() - t0)
    measured: dict[str, dict[str, float]] = {}
    for name, label, _, _, _, times in runs:
        measured.setdefault(name, {})[label] = statistics.median(times)
    return {"flops": flops, "alpha_s": alpha, "beta_Bps": beta, "factors": factors,
            "measured": measured}


def main() -> None:
    from hetrain.parallel.launch import run_local

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    repeats = []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        res = run_local(worker, 4, (args.steps,), timeout_s=900)[0]
        cluster = cluster_from(res["flops"], res["alpha_s"], res["beta_Bps"])
        options = options_from(res["factors"])
        rows, per_model = [], {}
        for name, (graph, _, _) in models().items():
            plans = plans_for(graph, cluster, options)
            pred = {k: plan_cost(graph, p, cluster, options).time_s for k, p in plans.items()}
            meas = res["measured"][name]
            keys = list(plans)
            per_model[name] = float(spearmanr([pred[k] for k in keys], [meas[k] for k in keys])[0])
            rows += [dict(model=name, plan=k, signatures=sorted(set(plans[k].stages[0].signatures)),
                          mesh=plans[k].stages[0].mesh.label, predicted_s=pred[k], measured_s=meas[k])
                     for k in keys]
        pooled = float(spearmanr([x["predicted_s"] for x in rows], [x["measured_s"] for x in rows])[0])
        repeats.append(dict(calibration={k: res[k] for k in ("flops", "alpha_s", "beta_Bps", "factors")},
                            spearman=per_model | {"pooled": pooled}, rows=rows,
                            wall_s=time.perf_counter() - t0))
        print(f"repeat {r}: spearman {repeats[-1]['spearman']} ({repeats[-1]['wall_s']:.0f} s)", flush=True)
    write(repeats, args)


def write(repeats: list[dict[str, Any]], args: argparse.Namespace) -> None:
    cmd = "  ".join([".venv/bin/python", *sys.argv])
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "autoddl_predicted_vs_measured.json").write_text(
        json.dumps({"command": cmd, "gpt": GPT, "vgg": {**VGG, "image": list(VGG["image"])},
                    "repeats": repeats}, indent=1))
    keys = list(repeats[0]["spearman"])
    med = {k: statistics.median(r["spearman"][k] for r in repeats) for k in keys}
    c = repeats[0]["calibration"]
    md = [f"<!-- made by: {cmd} -->", "# Predicted vs measured step time (4 gloo processes, this machine)",
          "", f"Command: `{cmd}`; {len(repeats)} repeat(s), {args.steps} timed steps per plan "
          "(median), 2-core machine shared with other work (real processes, measured).", "",
          f"Calibration (repeat 0, microbenchmarks only): matmul {c['flops']:.3g} FLOP/s per rank "
          f"(median of the 4 running at once), all-reduce fit alpha {c['alpha_s'] * 1e6:.0f} us, "
          f"beta {c['beta_Bps'] / 1e6:.0f} MB/s; other collectives vs the ring formula "
          f"(latency x, per-byte x): "
          + ", ".join(f"{k} {fa:.2f}/{fb:.2f}" for k, fa, fb in c["factors"]) + ".", "",
          "Spearman rank correlation, predicted vs measured: " + ", ".join(
              f"{k} {med[k]:.2f} (per repeat {[round(r['spearman'][k], 2) for r in repeats]})"
              for k in keys), "",
          "Predicted: repeat 0's calibration. `searched` is the plan the search picks for each "
          "repeat's calibration (it may differ between repeats; the row shows repeat 0's).", "",
          "| model | plan | mesh | signatures | predicted s | measured s (median over repeats) | spread |",
          "|---|---|---|---|---|---|---|"]
    for i, row in enumerate(repeats[0]["rows"]):
        ms = [r["rows"][i]["measured_s"] for r in repeats]
        md.append(f"| {row['model']} | {row['plan']} | {row['mesh']} | {','.join(row['signatures'])} "
                  f"| {row['predicted_s']:.4f} | {statistics.median(ms):.4f} | "
                  f"{min(ms):.4f}-{max(ms):.4f} |")
    (OUT / "autoddl_predicted_vs_measured.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
