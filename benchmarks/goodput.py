"""`auto` (goodput planning) against the cluster's fastest device alone, tuned, and DDP (simulated).

    .venv/bin/python benchmarks/goodput.py [--clusters hetero-4 hetero-8 geo-16 lab-6]
        [--select-seeds 0 1 2] [--report-seeds 3 4 5] [--epochs 5] [--jobs 2]

MNIST-1D CNN on the simulator (virtual clock, real gradients), every run evaluated every
0.5 virtual seconds (the same time granularity for a lone device and a cluster), targets 85%
and 90% test accuracy. Systems:
  * auto: its DEFAULT settings (train.batch_size 32, SGD lr 0.05 momentum 0.9), no tuning;
  * ddp: its defaults on the whole cluster;
  * the fastest device alone (plain SGD on one device, no communication), TUNED: batch
    {8, 16, 32, 64} x lr {0.025, 0.05, 0.1} on the selection seeds (runs stop at the high
    target or 30 virtual s), one setting picked per target: the lowest median TTA over the
    selection seeds, settings that miss the target on any selection seed ranked after those
    that never miss. Identical lone devices (hetero-8 and geo-16 share one) are tuned once.
Reported on the held-out seeds only: per seed, lone TTA / auto TTA and ddp TTA / auto TTA; the
median and min-max over seeds. Policy for a seed that misses a target within the epochs: its
TTA is infinite (so a ratio is 0 when auto misses, inf when the other misses), and the miss
count is shown. Final accuracy is the mean of a run's last 5 evaluations (one evaluation is
noisy). The planner's predicted speed-up: over auto's run up to its TTA, the time-weighted mean
of the goodput model's ratio auto plan / tuned lone device (hetrain.plan.goodput) at the noise
scale auto planned with at that time.
Writes benchmarks/results/<--out, default goodput>.{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results"
TARGETS = (0.85, 0.90)
EVAL_EVERY_S = 0.5
LONE_BATCHES = (8, 16, 32, 64)
LONE_LRS = (0.025, 0.05, 0.1)
BASE_LR, BASE_BATCH = 0.05, 32
LAB_6: dict[str, Any] = {
    # Not a preset: two fast GPUs in a lab, four slower cloud GPUs; the cluster file puts the
    # PS (and the data) in the cloud site, 20 ms and 1 Gbit/s away from the lab.
    "name": "lab-6", "ps_site": "cloud",
    "sites": [{"name": "cloud", "lan": {"bandwidth_Bps": 1.25e9, "latency_s": 5e-5},
               "wan": {"bandwidth_Bps": 1.25e8, "latency_s": 0.01}},
              {"name": "lab", "lan": {"bandwidth_Bps": 1.25e9, "latency_s": 5e-5},
               "wan": {"bandwidth_Bps": 1.25e8, "latency_s": 0.01}}],
    "devices": [{"name": "lab-gpu", "flops": 1.2e9, "site": "lab", "count": 2,
                 "step_overhead_s": 2e-3},
                {"name": "cloud-gpu", "flops": 3e8, "site": "cloud", "count": 4,
                 "step_overhead_s": 2e-3}],
}


def cluster_spec(name: str) -> str | dict[str, Any]:
    return LAB_6 if name == "lab-6" else name


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from hetrain.cli.run import fastest_alone
    from hetrain.config import config_from_dict
    from hetrain.runner import run_config

    torch.set_num_threads(1)
    alone = job["system"] == "lone"
    cfg = config_from_dict({
        "name": "bench", "cluster": cluster_spec(job["cluster"]),
        "workload": {"model": "cnn", "dataset": "mnist1d"},
        "strategy": {"name": "ddp" if alone else job["system"]},
        "optimizer": {"name": "sgd", "lr": job["lr"], "momentum": 0.9},
        "train": {"batch_size": job["batch"], "seed": job["seed"], "eval_every_s": EVAL_EVERY_S},
        "stop": {"max_epochs": job["epochs"], "target_accuracy": job["stop_target"],
                 "stop_at_target": job["stop_target"] > 0, "max_time_s": job["max_time_s"]}})
    if alone:
        cfg = fastest_alone(cfg)
    t0 = time.perf_counter()
    r = run_config(cfg, runs_root=None)
    rows = [{k: row.get(k) for k in ("time_s", "test_accuracy", "noise_scale",
                                     "planned_noise_scale", "global_batch", "local_steps")}
            for row in r.rows]
    return {**job, "wall_s": time.perf_counter() - t0, "rows": rows,
            "strategy_stats": r.summary["strategy_stats"]}


def tta(rows: list[dict[str, Any]], target: float) -> float:
    return next((r["time_s"] for r in rows if r["test_accuracy"] >= target), math.inf)


def final_accuracy(rows: list[dict[str, Any]]) -> float:
    return statistics.mean(r["test_accuracy"] for r in rows[-5:])


def lone_key(cluster: str) -> str:
    """Runs of the fastest device alone depend only on that device: share them."""
    from hetrain.cluster import load_cluster

    d = load_cluster(cluster_spec(cluster)).fastest_alone().devices[0]
    return f"{d.flops:g}-{d.step_overhead_s:g}"


def pick(runs: list[dict[str, Any]], target: float) -> tuple[int, float]:
    """The tuned lone setting for `target` (see the module docstring)."""
    by: dict[tuple[int, float], list[float]] = {}
    for r in runs:
        by.setdefault((r["batch"], r["lr"]), []).append(tta(r["rows"], target))
    return min(by, key=lambda k: (sum(math.isinf(x) for x in by[k]), statistics.median(by[k])))


def predicted_vs_lone(auto: dict[str, Any], lone_setting: tuple[int, float], cluster: str,
                      target: float) -> float | None:
    """Time-weighted mean of the model's goodput ratio over auto's run up to its TTA."""
    from hetrain.cluster import load_cluster
    from hetrain.engine.core import model_bytes
    from hetrain.plan.goodput import StatModel, best_for, cluster_costs
    from hetrain.workloads import flops_per_sample, get_workload

    wl = get_workload("cnn", "mnist1d")
    fps, mb = flops_per_sample(wl), model_bytes(wl.build_model())
    cl = load_cluster(cluster_spec(cluster))
    st = auto["strategy_stats"]
    costs = cluster_costs(cl, st["ps_site"], fps, mb)
    lone = max(cl.devices, key=lambda d: d.flops)
    batch, lr = lone_setting
    end = tta(auto["rows"], target)
    num = den = 0.0
    rows = auto["rows"]
    for a, b in itertools.pairwise(rows):
        if a["time_s"] >= end or a["global_batch"] is None:
            break
        stat = StatModel(a["planned_noise_scale"] or BASE_BATCH, BASE_BATCH, 0.5, 8, 2.0)
        plan = best_for(costs, stat, a["global_batch"], a["local_steps"])
        if plan is None:
            continue
        lone_sps = batch / lone.compute_time_s(batch, fps)
        # the lone device's progress per sample: its lr gain over the base, at most AdaScale's
        lone_gain = min(lr / BASE_LR, stat.lr_scale(batch) if lr > BASE_LR else lr / BASE_LR)
        lone_goodput = lone_sps * lone_gain * BASE_BATCH / batch
        dt = b["time_s"] - a["time_s"]
        num += dt * plan.goodput / lone_goodput
        den += dt
    return num / den if den else None


def summ(xs: list[float]) -> dict[str, Any]:
    finite = [x for x in xs if x is not None]
    return {"median": statistics.median(finite) if finite else None,
            "min": min(finite) if finite else None, "max": max(finite) if finite else None,
            "values": xs}


def fmt(s: dict[str, Any], digits: int = 2) -> str:
    if s["median"] is None:
        return "n/a"
    def f(x: float) -> str:
        return "inf" if math.isinf(x) else f"{x:.{digits}f}"

    return f"{f(s['median'])} ({f(s['min'])}-{f(s['max'])})"


def ratio(num: float, den: float) -> float:
    if math.isinf(den):
        return 0.0 if not math.isinf(num) else math.nan
    return num / den


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clusters", nargs="+", default=["hetero-4", "hetero-8", "geo-16", "lab-6"])
    ap.add_argument("--select-seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--report-seeds", nargs="+", type=int, default=[3, 4, 5])
    ap.add_argument("--epochs", type=float, default=5.0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="goodput")
    args = ap.parse_args()
    command = "python benchmarks/goodput.py " + " ".join(sys.argv[1:])

    def job(system: str, cluster: str, seed: int, batch: int = BASE_BATCH, lr: float = BASE_LR,
            select: bool = False) -> dict[str, Any]:
        return {"system": system, "cluster": cluster, "seed": seed, "batch": batch, "lr": lr,
                "epochs": args.epochs, "stop_target": max(TARGETS) if select else 0.0,
                "max_time_s": 30.0 if select else 0.0}

    pool = ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn"))
    lone_of = {c: lone_key(c) for c in args.clusters}
    first = {k: next(c for c in args.clusters if lone_of[c] == k) for k in set(lone_of.values())}
    select_jobs = [job("lone", first[k], s, b, lr, select=True) for k in sorted(first)
                   for b in LONE_BATCHES for lr in LONE_LRS for s in args.select_seeds]
    selection = list(pool.map(run_job, select_jobs))
    picks = {k: {t: pick([r for r in selection if lone_of[r["cluster"]] == k], t)
                 for t in TARGETS} for k in first}
    report_jobs = [job(s, c, seed) for c in args.clusters for s in ("auto", "ddp")
                   for seed in args.report_seeds]
    lone_settings = {(k, setting) for k in picks for setting in picks[k].values()}
    report_jobs += [job("lone", first[k], seed, b, lr) for k, (b, lr) in sorted(lone_settings)
                    for seed in args.report_seeds]
    report = list(pool.map(run_job, report_jobs))
    pool.shutdown()

    def get(system: str, cluster: str, seed: int, setting: tuple[int, float] | None = None):
        for r in report:
            if r["system"] != system or r["seed"] != seed:
                continue
            if system == "lone" and lone_of[r["cluster"]] == lone_of[cluster] \
                    and (r["batch"], r["lr"]) == setting:
                return r
            if system != "lone" and r["cluster"] == cluster:
                return r
        raise KeyError((system, cluster, seed, setting))

    cells = []
    for c in args.clusters:
        for t in TARGETS:
            setting = picks[lone_of[c]][t]
            autos = [get("auto", c, s) for s in args.report_seeds]
            lones = [get("lone", c, s, setting) for s in args.report_seeds]
            ddps = [get("ddp", c, s) for s in args.report_seeds]
            cells.append({
                "cluster": c, "workload": "mnist1d-cnn", "target": t,
                "lone_setting": {"batch": setting[0], "lr": setting[1]},
                "auto_tta_s": summ([tta(a["rows"], t) for a in autos]),
                "lone_tta_s": summ([tta(x["rows"], t) for x in lones]),
                "ddp_tta_s": summ([tta(x["rows"], t) for x in ddps]),
                "auto_vs_lone": summ([ratio(tta(x["rows"], t), tta(a["rows"], t))
                                      for a, x in zip(autos, lones, strict=True)]),
                "auto_vs_ddp": summ([ratio(tta(x["rows"], t), tta(a["rows"], t))
                                     for a, x in zip(autos, ddps, strict=True)]),
                "predicted_vs_lone": summ([predicted_vs_lone(a, setting, c, t) for a in autos]),
                "auto_misses": sum(math.isinf(tta(a["rows"], t)) for a in autos),
                "lone_misses": sum(math.isinf(tta(x["rows"], t)) for x in lones),
                "final_accuracy_auto": summ([final_accuracy(a["rows"]) for a in autos]),
                "final_accuracy_lone": summ([final_accuracy(x["rows"]) for x in lones]),
                "final_gap_points": summ([100 * (final_accuracy(a["rows"])
                                                 - final_accuracy(x["rows"]))
                                          for a, x in zip(autos, lones, strict=True)]),
                "auto_plans": [a["strategy_stats"].get("plans") for a in autos],
                "auto_ps_site": [a["strategy_stats"].get("ps_site") for a in autos],
            })
    OUT.mkdir(exist_ok=True)
    data = {"command": command, "select_seeds": args.select_seeds,
            "report_seeds": args.report_seeds, "epochs": args.epochs,
            "eval_every_s": EVAL_EVERY_S, "lone_grid": {"batch": LONE_BATCHES, "lr": LONE_LRS},
            "cells": cells,
            "selection": [{k: r[k] for k in ("cluster", "seed", "batch", "lr")}
                          | {"tta_s": {str(t): tta(r["rows"], t) for t in TARGETS}}
                          for r in selection],
            "runs": [{k: v for k, v in r.items()} for r in report]}
    (OUT / f"{args.out}.json").write_text(json.dumps(data, indent=1, default=str))
    lines = ["# auto vs the tuned fastest device alone and DDP (simulated, MNIST-1D CNN)\n",
             f"Command: `{command}`\n",
             f"Held-out seeds {args.report_seeds} (lone device tuned on {args.select_seeds}); "
             f"median (min-max); evaluation every {EVAL_EVERY_S} virtual s.\n",
             "| cluster | target | auto vs lone | predicted | auto vs ddp | auto TTA s | lone TTA s "
             "(batch, lr) | misses auto/lone | final acc auto / lone | gap pts |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cell in cells:
        ls = cell["lone_setting"]
        lines.append(
            f"| {cell['cluster']} | {cell['target']:.2f} | **{fmt(cell['auto_vs_lone'])}** | "
            f"{fmt(cell['predicted_vs_lone'])} | {fmt(cell['auto_vs_ddp'])} | "
            f"{fmt(cell['auto_tta_s'], 1)} | {fmt(cell['lone_tta_s'], 1)} ({ls['batch']}, "
            f"{ls['lr']}) | {cell['auto_misses']}/{cell['lone_misses']} | "
            f"{fmt(cell['final_accuracy_auto'], 3)} / {fmt(cell['final_accuracy_lone'], 3)} | "
            f"{fmt(cell['final_gap_points'], 1)} |")
    lines.append("\nauto's plans per held-out seed (epoch:G x H):\n")
    for cell in cells[::len(TARGETS)]:
        lines.append(f"- {cell['cluster']}: PS in {cell['auto_ps_site'][0]}; "
                     + " | ".join(str(p) for p in cell["auto_plans"]))
    (OUT / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
