"""Is the searched plan the fastest one? Every enumerated plan measured side by side.

    .venv/bin/python benchmarks/autoddl_best_plan.py [--repeats 3] [--steps 12]

Per repeat, one spawn of 4 CPU gloo processes (one thread each), rank r standing for cluster
device r:
1. calibrate with microbenchmarks only (hetrain.parallel.calibrate, full: matmul FLOP/s,
   collective costs, per-op-kind overheads), so the search sees this machine; then the quick
   calibration `hetrain run` takes at start-up (parallel.calibrate), for its own pick;
2. two clusters of those 4 devices on one loopback "LAN":
   * `capped`: devices 0-1 hold MEM_BIG and devices 2-3 MEM_SMALL of the bytes the cost model
     counts for the whole model on one device (parameters, gradients, AdamW state and
     activations), so the model fits no device by itself and the two small devices hold at
     most a third of it;
   * `roomy`: 8 GB each (every plan fits);
3. on each, the search (`search_plan`, the function `[parallel] plan = "auto"` runs) picks a
   plan; every plan it enumerated (every mesh and pipeline candidate; the subset meshes run
   on their devices while the others idle), every template plan (data, tensor, mixed,
   replicated on a mesh of 4 and on 2 x 2), one device alone (the others idle: the user's
   simplest alternative; the same global batch, as this compares step times, not time to
   accuracy), and the torchtitan-style plan (tensor parallel
   inside a node of 2, data parallel across the 2 nodes: "dp-tp" on the 2 x 2 mesh) are
   trained for 2 warm-up and --steps timed AdamW steps of the tiny GPT, steps interleaved
   round-robin over the plans so that load from other work hits all alike; median per plan.
Reported per cluster (plans that do not fit the caps are measured too but ranked apart):
the searched plan's measured time over the fastest fitting plan's (per repeat and median;
target <= 1.10), the same for the plan `hetrain run` picks with its start-up calibration
(target <= 1.10) and without it, the torchtitan-style plan's over the searched plan's
(target >= 1.0), and
Spearman's rank correlation of predicted and measured over the fitting plans.
Writes benchmarks/results/autoddl_best_plan.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).parent))
from autoddl_predicted_vs_measured import GPT, M4, M22, _calibrate, models, options_from
from common import median_range, results_dir, spawned_repeats

from hetrain.cluster import Cluster, Device, Link, Site
from hetrain.parallel.calibrate import calibrate
from hetrain.parallel.calibrate import cost_options as calibrated_options
from hetrain.plan.cost import CostOptions, Plan, plan_cost
from hetrain.plan.sbp import Mesh
from hetrain.plan.search import SearchOptions, search_plan, template_plan
from hetrain.workloads.base import cross_entropy

OUT = results_dir()
MEM_BIG, MEM_SMALL = 0.6, 0.3
"""Device memory caps of the `capped` cluster, as fractions of the whole model's need."""
TORCHTITAN = "dp-tp"
LONE = Mesh((1,), (0,))
"""The user's simplest alternative: one device trains alone, the others idle."""
TEMPLATES = (*((t, M4) for t in ("dp", "tp", "mixed", "rep")),
             *((t, M22) for t in ("dp-tp", "tp-dp", "dp-dp", "tp-tp", "dp-mixed")))


def cluster_of(calib: dict[str, Any], caps: list[float]) -> Cluster:
    site = Site("local", Link(calib["beta_Bps"], calib["alpha_s"]),
                Link(calib["beta_Bps"], calib["alpha_s"]))
    return Cluster("local-4-gloo", tuple(Device(f"rank{i}", calib["flops"], c, "local")
                                         for i, c in enumerate(caps)), (site,))


def cost_options(calib: dict[str, Any]) -> CostOptions:
    return dataclasses.replace(options_from(calib), optimizer_states=2.0)  # AdamW


def run_cost_options(quick: dict[str, Any]) -> CostOptions:
    """hetrain run's: parallel.train.calibrated_setup's options under dist.emulate = "none"."""
    return calibrated_options(quick, CostOptions(optimizer_states=2.0), compute=True)


def whole_model_bytes(calib: dict[str, Any]) -> float:
    """What the cost model counts for the model replicated on one device (the "rep" plan)."""
    graph = models()["gpt"][0]
    roomy = cluster_of(calib, [8e9] * 4)
    return plan_cost(graph, template_plan(graph, M4, "rep"), roomy, cost_options(calib)).memory_bytes


def clusters(calib: dict[str, Any]) -> dict[str, Cluster]:
    need = whole_model_bytes(calib)
    return {"capped": cluster_of(calib, [MEM_BIG * need] * 2 + [MEM_SMALL * need] * 2),
            "roomy": cluster_of(calib, [8e9] * 4)}


def _description(found: Any) -> str:
    """The search's own description of the plan it chose."""
    return next(d for (d, _, _), p in zip(found.candidates, found.candidate_plans, strict=True)
                if p == found.plan)


def enumerate_plans(cluster: Cluster, options: CostOptions, run_options: CostOptions
                    ) -> tuple[dict[str, Plan], str, dict[str, str]]:
    """label -> plan of every distinct plan to measure, the searched plan's label, and the
    labels of the plans `hetrain run` with `[parallel] plan = "auto"` picks on a cluster file
    of these devices: "calibrated" (parallel.calibrate on, the default: `run_options`, the
    start-up quick calibration's corrections, op kinds included as under dist.emulate =
    "none") and "uncalibrated" (parallel.calibrate = false: the cluster file's figures)."""
    graph = models()["gpt"][0]
    found = search_plan(graph, cluster, SearchOptions(), options)
    as_run = {"calibrated": search_plan(graph, cluster, SearchOptions(), run_options),
              "uncalibrated": search_plan(graph, cluster, SearchOptions(),
                                          CostOptions(optimizer_states=options.optimizer_states))}
    out: dict[str, Plan] = {}
    for (desc, _, _), plan in [*zip(found.candidates, found.candidate_plans, strict=True),
                               *(((f"as hetrain run ({k}): {_description(r)}", 0, 0), r.plan)
                                 for k, r in as_run.items())]:
        if plan not in out.values():
            out[desc] = plan
    for name, mesh in TEMPLATES:
        plan = template_plan(graph, mesh, name)
        if plan not in out.values():
            out[f"template {name} mesh {mesh.label}"] = plan
    lone = template_plan(graph, LONE, "rep")
    if lone not in out.values():
        out["lone device 0 (the others idle)"] = lone
    searched = next(k for k, p in out.items() if p == found.plan)
    run = {k: next(label for label, p in out.items() if p == r.plan) for k, r in as_run.items()}
    return out, searched, run


def worker(rank: int, world: int, steps: int) -> dict[str, Any]:
    from hetrain.parallel.execute import make_executor

    calib = _calibrate(rank, world)
    quick = calibrate(quick=True)  # what hetrain run does at start-up
    run_options = run_cost_options(quick)
    graph, build, make = models()["gpt"]
    batch = make(torch.Generator().manual_seed(1))
    options = cost_options(calib)
    runs, plans, searched, as_run = [], {}, {}, {}
    for cname, cluster in clusters(calib).items():
        found, searched[cname], as_run[cname] = enumerate_plans(cluster, options, run_options)
        plans[cname] = {k: p.to_dict() for k, p in found.items()}
        for label, plan in found.items():
            torch.manual_seed(0)
            ex = make_executor(build(), graph, plan, cross_entropy, cluster=cluster)
            params = ex.parameters()
            opt = torch.optim.AdamW(params, lr=1e-3, foreach=False) if params else None
            runs.append((cname, label, ex, opt, []))
    x, y = batch
    for k in range(steps + 2):
        for *_, ex, opt, times in runs:
            dist.barrier()
            t0 = time.perf_counter()
            ex.step(x, y, opt)
            dist.barrier()
            if k >= 2:
                times.append(time.perf_counter() - t0)
    measured: dict[str, dict[str, float]] = {}
    for cname, label, *_, times in runs:
        measured.setdefault(cname, {})[label] = statistics.median(times)
    return {"calibration": calib, "quick_calibration": quick, "plans": plans,
            "searched": searched, "as_run": as_run, "measured": measured}


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    """One repeat: per cluster, predicted and measured per plan and the ratios."""
    graph = models()["gpt"][0]
    calib = res["calibration"]
    options = cost_options(calib)
    out = {}
    for cname, cluster in clusters(calib).items():
        rows = []
        for label, d in res["plans"][cname].items():
            rep = plan_cost(graph, Plan.from_dict(d), cluster, options)
            rows.append(dict(plan=label, predicted_s=rep.time_s, fits=rep.feasible,
                             measured_s=res["measured"][cname][label],
                             memory_mb=rep.memory_bytes / 1e6))
        fit = [r for r in rows if r["fits"]]
        best = min(fit, key=lambda r: r["measured_s"])
        s = res["searched"][cname]
        meas = res["measured"][cname]
        tt = next(k for k in meas if k == f"template {TORCHTITAN} mesh 2x2" or
                  Plan.from_dict(res["plans"][cname][k]) == template_plan(graph, M22, TORCHTITAN))
        out[cname] = dict(
            rows=rows, searched=s, best=best["plan"],
            searched_over_best=meas[s] / best["measured_s"],
            as_run=res["as_run"][cname],
            as_run_over_best={k: meas[v] / best["measured_s"]
                              for k, v in res["as_run"][cname].items()},
            torchtitan=tt, torchtitan_fits=next(r["fits"] for r in rows if r["plan"] == tt),
            torchtitan_over_searched=meas[tt] / meas[s],
            lone_over_searched=meas["lone device 0 (the others idle)"] / meas[s]
            if "lone device 0 (the others idle)" in meas else None,
            lone_fits=next((r["fits"] for r in rows
                            if r["plan"] == "lone device 0 (the others idle)"), None),
            spearman=float(spearmanr([r["predicted_s"] for r in fit],
                                     [r["measured_s"] for r in fit])[0]),
            n_plans=len(rows), n_fit=len(fit))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    repeats = spawned_repeats(worker, (args.steps,), args.repeats, summarise, lambda summ, _: "; ".join(
        f"{c}: searched {s['searched']!r} {s['searched_over_best']:.3f}x the best "
        f"(hetrain run's {s['as_run_over_best']['calibrated']:.3f}x, uncalibrated "
        f"{s['as_run_over_best']['uncalibrated']:.3f}x) "
        f"({s['best']!r}), torchtitan-style {s['torchtitan_over_searched']:.3f}x the "
        f"searched, spearman {s['spearman']:.2f}" for c, s in summ.items()))
    write(repeats, args)


def _lone(ss: list[dict[str, Any]]) -> str:
    xs = [s["lone_over_searched"] for s in ss if s["lone_over_searched"] is not None]
    if not xs:
        return "n/a"
    return median_range(xs, ".3f") + ("" if ss[0]["lone_fits"] else " (does not fit the caps)")


def write(repeats: list[dict[str, Any]], args: argparse.Namespace) -> None:
    cmd = " ".join([".venv/bin/python", *sys.argv])
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "autoddl_best_plan.json").write_text(json.dumps(
        {"command": cmd, "gpt": GPT, "mem_big": MEM_BIG, "mem_small": MEM_SMALL,
         "repeats": repeats}, indent=1))
    md = [f"<!-- made by: {cmd} -->",
          "# The searched plan against every enumerated plan, measured side by side",
          "", f"Command: `{cmd}`; {len(repeats)} repeat(s) (one spawn of 4 gloo processes "
          f"each, calibrated by microbenchmarks first), {args.steps} timed AdamW steps per plan "
          "(median), steps interleaved over the plans; tiny GPT "
          f"(n_layer {GPT['n_layer']}, n_embd {GPT['n_embd']}, batch {GPT['B']} x {GPT['T']}); "
          "2-core machine (4 processes share it).", "",
          f"Clusters: `capped` = devices 0-1 with {MEM_BIG:.0%} and devices 2-3 with "
          f"{MEM_SMALL:.0%} of the memory the whole model needs on one device (no device "
          "holds it alone); `roomy` = 8 GB each.", "",
          "`hetrain run`'s plan: what `[parallel] plan = \"auto\"` picks on a cluster file of "
          "these devices (the devices' FLOP/s and the link from the full calibration, as "
          "`hetrain profile` would write them): calibrated = with its start-up calibration "
          "(`parallel.calibrate`, the default: hetrain.parallel.calibrate's quick "
          "microbenchmarks, taken again on these processes; op kinds' corrections included, "
          "as under `dist.emulate = \"none\"`), uncalibrated = `parallel.calibrate = false` "
          "(the cluster file's figures alone).", "",
          "| cluster | plans measured (fit) | searched / fastest fitting (target <= 1.10) | "
          "hetrain run's plan / fastest fitting (target <= 1.10) | "
          "hetrain run uncalibrated / fastest fitting | "
          "torchtitan-style dp-tp / searched (target >= 1.0) | one device alone / searched | "
          "Spearman (fitting plans) |",
          "|---|---|---|---|---|---|---|---|"]
    for c in repeats[0]["summary"]:
        ss = [r["summary"][c] for r in repeats]
        tt = "" if ss[0]["torchtitan_fits"] else " (does not fit the caps)"
        md.append(f"| {c} | {ss[0]['n_plans']} ({ss[0]['n_fit']}) | "
                  f"{median_range([s['searched_over_best'] for s in ss], '.3f')} | "
                  f"{median_range([s['as_run_over_best']['calibrated'] for s in ss], '.3f')} | "
                  f"{median_range([s['as_run_over_best']['uncalibrated'] for s in ss], '.3f')} | "
                  f"{median_range([s['torchtitan_over_searched'] for s in ss], '.3f')}{tt} | "
                  f"{_lone(ss)} | "
                  f"{median_range([s['spearman'] for s in ss], '.3f')} |")
    for c in repeats[0]["summary"]:
        md += ["", f"## {c}: per plan (repeat 0's prediction; measured median over repeats)", "",
               "searched per repeat: " + ", ".join(f"`{r['summary'][c]['searched']}`"
                                                   for r in repeats),
               "", "hetrain run's plan per repeat: " + ", ".join(
                   f"`{r['summary'][c]['as_run']['calibrated']}`" for r in repeats),
               "", "hetrain run's plan uncalibrated per repeat: " + ", ".join(
                   f"`{r['summary'][c]['as_run']['uncalibrated']}`" for r in repeats),
               "", "| plan | fits | memory MB | predicted s | measured s | spread |",
               "|---|---|---|---|---|---|"]
        rows = repeats[0]["summary"][c]["rows"]
        for row in sorted(rows, key=lambda r: (not r["fits"], r["predicted_s"])):
            ms = [next((x["measured_s"] for x in r["summary"][c]["rows"]
                        if x["plan"] == row["plan"]), None) for r in repeats]
            ms = [m for m in ms if m is not None]
            md.append(f"| {row['plan']} | {'yes' if row['fits'] else 'no'} | "
                      f"{row['memory_mb']:.1f} | {row['predicted_s']:.4f} | "
                      f"{statistics.median(ms):.4f} | {min(ms):.4f}-{max(ms):.4f} |")
    (OUT / "autoddl_best_plan.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
