"""How far above the tuned fastest device alone can a synchronous plan get? An estimate for the
goodput benchmark's cells, from its own lone-device runs and the cluster model; no training.

    .venv/bin/python benchmarks/goodput_ceiling.py [--results goodput.json goodput_gpt.json]

A synchronous plan at global batch G (H = 1: every step averages the gradients of G samples,
wherever they ran) takes the same steps as one device training alone at batch G, so it needs
as many of them to reach a target as the lone device needs at that batch. Each step costs the
cluster's round instead of the lone device's step. The best such plan's speed-up over the
tuned lone device is then about

    ceiling = max over G of  TTA_lone* / (TTA_lone(G) x round(G) / step_lone(G))

with TTA_lone* the tuned lone device's time to the target (its pick), TTA_lone(G) its time at
batch G at the best lr tried there (medians over the selection seeds, read from goodput.py's
results file), step_lone(G) its step time (step overhead + compute), and round(G) the shortest
round at batch G on the cluster: the planner's exact allocator over every PS site and device
subset (hetrain.plan.goodput.best_for), pricing the links and the PS's per-member cost
("links"), or compute and step overheads only ("free links"). On the simulator a round takes
exactly what the model prices.

It is an estimate, not a bound: G and lr only on the lone grid (batches a factor 2 apart, lrs
a factor 2 apart), and it leaves out H > 1 local steps and a batch that changes during the
run. An auto round at H = 1 is one step at batch G: with Adam its members push gradients (until
stop 43 they averaged their own Adam steps, which is not such a step), with SGD their
momentum steps average to one while the shares stay put. auto with min_batch 2 measured
1.59x / 1.53x on GPT hetero-8's selection seeds against this estimate's 1.29x / 1.33x (G 3 on
two devices, at an lr between the grid's; benchmarks/results/goodput_min_batch_prior8_gpt.md). What it shows is where the
gain is: which G, on which devices.
Writes benchmarks/results/goodput_ceiling.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from common import results_dir
from goodput import WORKLOADS, cluster_spec, lone_key, pick, ttas_by_setting, workload_costs

ISSUE_TARGETS = {"hetero-4": 1.5, "hetero-8": 1.4, "geo-16": 1.5}
"""Issue 13's speed-up targets over the tuned lone device (other clusters: >= 1.0)."""


def lone_tta_by_batch(selection: list[dict[str, Any]], target: float) -> dict[int, float]:
    """Median TTA over the seeds of every (batch, lr) tried, the best lr's per batch."""
    best: dict[int, float] = {}
    for (batch, _), ttas in ttas_by_setting(selection, target).items():
        best[batch] = min(best.get(batch, math.inf), statistics.median(ttas))
    return best


def site_costs(cluster: Any, flops_per_sample: float, model_bytes: int,
               free_links: bool) -> list[Any]:
    """The round costs with the PS in each site (free links: compute and step overheads only)."""
    from hetrain.plan.goodput import Costs, cluster_costs

    out = []
    for site in cluster.sites:
        costs = cluster_costs(cluster, site.name, flops_per_sample, model_bytes)
        if free_links:
            costs = Costs(costs.ps_site, (0.0,) * costs.n, costs.overhead_s,
                          costs.per_sample_s, 0.0)
        out.append(costs)
    return out


def shortest_round_s(costs: list[Any], global_batch: int) -> float:
    """The shortest H = 1 round at `global_batch` over every PS site and device subset."""
    from hetrain.plan.goodput import StatModel, best_for

    stat = StatModel(noise_scale=1.0, base_batch=global_batch)  # H = 1: efficiency is equal
    plans = [best_for(c, stat, global_batch, 1) for c in costs]
    return min((p.round_s for p in plans if p is not None), default=math.inf)


def ceiling(lone_tta: dict[int, float], lone_step_s: dict[int, float],
            round_s: dict[int, float], tuned_tta: float) -> tuple[float, int]:
    """(speed-up, G) of the best fixed-batch synchronous plan over the tuned lone device."""
    times = {g: lone_tta[g] * round_s[g] / lone_step_s[g] for g in lone_tta}
    g = min(times, key=lambda b: (times[b], b))
    return tuned_tta / times[g], g


def cells(results: dict[str, Any]) -> list[dict[str, Any]]:
    from hetrain.cluster import load_cluster

    workload = results.get("workload", "mnist1d-cnn")
    spec = WORKLOADS[workload]
    fps, model_bytes = workload_costs(workload)
    measured = {(c["cluster"], c["target"]): c for c in results["cells"]}
    out = []
    for name in results["clusters"]:
        cluster = load_cluster(cluster_spec(name))
        fastest = max(cluster.devices, key=lambda d: d.flops)
        mine = [r for r in results["selection"] if lone_key(r["cluster"]) == lone_key(name)]
        costs = {key: site_costs(cluster, fps, model_bytes, free)
                 for key, free in (("links", False), ("free_links", True))}
        for target in spec["targets"]:
            setting = pick(mine, target)
            tuned = statistics.median(ttas_by_setting(mine, target)[setting])
            by_batch = {g: t for g, t in lone_tta_by_batch(mine, target).items()
                        if math.isfinite(t)}
            step = {g: fastest.compute_time_s(g, fps) for g in by_batch}
            row: dict[str, Any] = {"cluster": name, "workload": workload, "target": target,
                                   "lone_setting": list(setting), "lone_tta_s": tuned,
                                   "lone_tta_by_batch": by_batch}
            for key, sites in costs.items():
                rounds = {g: shortest_round_s(sites, g) for g in by_batch}
                row[f"ceiling_{key}"], row[f"ceiling_{key}_batch"] = ceiling(
                    by_batch, step, rounds, tuned)
            cell = measured.get((name, target), {})
            row["auto_vs_lone"] = cell.get("auto_vs_lone")
            row["issue_target"] = ISSUE_TARGETS.get(name, 1.0)
            out.append(row)
    return out


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = ["# What a fixed-batch synchronous plan could gain over the tuned lone device: an "
             "estimate (simulated)",
             "", f"Command: `{command}`", "",
             "From goodput.py's results files: the lone device's selection runs (median over "
             "the selection seeds, best lr per batch) and the cluster model. An estimate, not a "
             "bound: batches and lrs only on the lone grid, no local steps, no batch changes "
             "(the script's docstring). auto: the held-out "
             "median of goodput.py's results; the target is issue 13's. auto above a cell's "
             "estimate changed its batch during the run, ran a batch or an lr off the lone "
             "grid, or its held-out seeds ran faster than the selection seeds the estimate "
             "is from.", "",
             "| workload | cluster | target | lone pick (batch, lr) | ceiling, links (G) | "
             "ceiling, free links (G) | auto measured | issue target | target above the "
             "estimate |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        auto = "n/a" if r["auto_vs_lone"] is None else f"{r['auto_vs_lone']:.2f}"
        above = "**yes**" if r["issue_target"] > r["ceiling_links"] else "no"
        lines.append(
            f"| {r['workload']} | {r['cluster']} | {r['target']} | "
            f"({r['lone_setting'][0]}, {r['lone_setting'][1]:g}) | "
            f"{r['ceiling_links']:.2f} ({r['ceiling_links_batch']}) | "
            f"{r['ceiling_free_links']:.2f} ({r['ceiling_free_links_batch']}) | {auto} | "
            f"{r['issue_target']:.1f} | {above} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = Path(__file__).parent / "results"
    ap.add_argument("--results", nargs="+", type=Path,
                    default=[here / "goodput.json", here / "goodput_gpt.json"])
    args = ap.parse_args()
    rows = [r for p in args.results for r in cells(json.loads(p.read_text()))]
    command = "python benchmarks/goodput_ceiling.py" + (
        "" if args.results == ap.get_default("results")
        else " --results " + " ".join(str(p) for p in args.results))
    where = results_dir()
    where.mkdir(exist_ok=True)
    (where / "goodput_ceiling.json").write_text(json.dumps(
        {"command": command, "cells": rows}, indent=1))
    text = markdown(rows, command)
    (where / "goodput_ceiling.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
