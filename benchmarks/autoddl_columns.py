"""A pipeline whose columns take shares by speed, on devices of speeds 4:1:4:1 that each hold
half the model, measured on real processes beside every plan the search enumerated.

    .venv/bin/python benchmarks/autoddl_columns.py [--repeats 3] [--steps 8]

Issue 19's "data-parallel batch shares follow device speeds" inside a pipeline. A GPT whose
memory is mostly parameters and optimizer state (2 layers, n_embd 256, 8 tokens, batch 32),
4 CPU gloo processes (one thread each) standing for devices 0-3 of speeds 4:1:4:1, each with
memory for CAP of what the cost model counts for the whole model on one device: no one-stage
plan fits, and 2 layers leave a pipeline few places to cut, so giving the slow devices a
lighter stage balances them only coarsely. The searched plan is expected to be a 2-stage
pipeline whose column of fast devices (device 0 -> device 2) takes most of each batch and
whose slow column (1 -> 3) the rest (StagePlan.shares on a pipeline,
parallel.pipeline's column pipelines).

Speeds are emulated as in autoddl_capped.py (rank 0's solo fit of this GPT gives the budget,
K = 3 x slowdown x the solo time; pipeline stages pad every micro-batch to their device's
share; collectives as the package's microbenchmarks measure them). Every plan the search
enumerated, the searched plan's twin without shares (the same stages, each data parallel
with DTensor over its 2 devices, an even split) and the lone fastest device run 2 warm-up
and --steps timed AdamW steps, interleaved, every plan the same global batch and lr (a
step-time comparison). Plans that do not fit the caps are measured too and ranked apart.
Reported: the searched plan's time over the fastest fitting plan's, its twin's over the
searched plan's (predicted and measured: what the shares buy), and Spearman over the fitting
plans. Writes benchmarks/results/autoddl_columns.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import autoddl_uneven as uneven
from common import (
    fitting_summary,
    measure_plans,
    median_range,
    per_plan_table,
    results_dir,
    rewrite_from_json,
    spawned_repeats,
)

from hetrain.cluster import Cluster
from hetrain.plan.cost import CostOptions, Plan, plan_cost, training_flops_per_sample
from hetrain.plan.sbp import Mesh
from hetrain.plan.search import SearchOptions, search_plan, template_plan
from hetrain.workloads.base import cross_entropy

OUT = results_dir()
GPT = dict(n_layer=2, n_head=4, n_embd=256, vocab=128, T=8, B=32)
SLOWDOWN = (1.0, 4.0, 1.0, 4.0)
"""Per rank: the fastest device's speed over this one's (speeds 4:1:4:1)."""
CAP = 0.5
"""Every device's memory, as a fraction of the whole model's need on one device."""
LONE, TWIN = "lone fastest device 0 (the others idle)", "the searched pipeline without shares"


graph = functools.partial(uneven.graph, GPT)
build = functools.partial(uneven.build, GPT)
batch = functools.partial(uneven.batch, gpt=GPT)


def solo_fit() -> tuple[float, float]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2)
    return uneven.fit_solo(build(), lambda b: batch(gen, b), cross_entropy, GPT["B"] // 4)


def cluster_of(calib: dict[str, Any]) -> Cluster:
    roomy = uneven.cluster_of(calib, training_flops_per_sample(graph()), slowdown=SLOWDOWN)
    need = plan_cost(graph(), template_plan(graph(), Mesh((1,), (0,)), "rep"), roomy,
                     uneven.options_of(calib)).memory_bytes
    return dataclasses.replace(roomy, name=roomy.name + "-capped", devices=tuple(
        dataclasses.replace(d, memory_bytes=CAP * need) for d in roomy.devices))


def plans(cluster: Cluster, options: CostOptions) -> tuple[dict[str, Plan], str]:
    """label -> plan (distinct) and the searched plan's label."""
    g = graph()
    found = search_plan(g, cluster, SearchOptions(), options)
    twin = dataclasses.replace(found.plan, stages=tuple(
        dataclasses.replace(st, shares=()) for st in found.plan.stages))
    out: dict[str, Plan] = {}
    for desc, plan in [*zip((d for d, _, _ in found.candidates), found.candidate_plans,
                            strict=True),
                       (TWIN, twin), (LONE, template_plan(g, Mesh((1,), (0,)), "dp"))]:
        if plan not in out.values():
            out[desc] = plan
    return out, next(k for k, p in out.items() if p == found.plan)


def worker(rank: int, world: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    calib = uneven.calibrate(rank, world, solo_fit)
    cluster, options = cluster_of(calib), uneven.options_of(calib)
    found, searched = plans(cluster, options)
    me, fps = cluster.devices[rank], training_flops_per_sample(graph())

    def budget(samples: int) -> float:
        return me.compute_time_s(samples, fps)

    measured, overruns = measure_plans(found, build, graph(), cluster, budget,
                                       batch(torch.Generator().manual_seed(1), GPT["B"]), steps)
    return {"calibration": calib, "plans": {k: p.to_dict() for k, p in found.items()},
            "searched": searched,
            "measured": measured, "overruns": overruns}


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    calib = res["calibration"]
    summ = fitting_summary(res, graph(), cluster_of(calib), uneven.options_of(calib))
    meas, s = res["measured"], res["searched"]
    pred = {r["plan"]: r["predicted_s"] for r in summ["rows"]}
    return summ | dict(twin_over_searched=meas[TWIN] / meas[s],
                       predicted_twin_over_searched=pred[TWIN] / pred[s])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--from-json", help="re-write the tables from a results JSON of this "
                    "benchmark (its repeats and command; no process started)")
    args = ap.parse_args()
    if args.from_json:
        rewrite_from_json(args.from_json, ap, write)
        return
    repeats = spawned_repeats(worker, (args.steps,), args.repeats, summarise, lambda summ, res: (
        f"searched {summ['searched']!r}: {summ['searched_over_best']:.3f}x the fastest fitting "
        f"({summ['best']!r}); without shares {summ['twin_over_searched']:.2f}x (predicted "
        f"{summ['predicted_twin_over_searched']:.2f}x); spearman {summ['spearman']:.2f}, "
        f"overruns {sum(res['overruns'].values())}"))
    write(repeats, args.steps, " ".join([".venv/bin/python", *sys.argv]))


def write(repeats: list[dict[str, Any]], steps: int, cmd: str,
          rewritten_by: str | None = None) -> None:
    """The results JSON and table; `rewritten_by`: the --from-json command that re-wrote them
    from `cmd`'s runs."""
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "autoddl_columns.json").write_text(json.dumps(
        {"command": cmd, "gpt": GPT, "slowdown": SLOWDOWN, "k": uneven.K, "cap": CAP,
         "repeats": repeats}, indent=1))
    ss = [r["summary"] for r in repeats]
    g = GPT
    md = [f"<!-- made by: {cmd} -->",
          "# A pipeline whose columns take shares by speed (speeds 4:1:4:1, half the model "
          "per device)", "",
          f"Command: `{cmd}`" + (f" (tables re-written from its JSON by `{rewritten_by}`)"
                                  if rewritten_by else "")
          + f"; {len(repeats)} repeat(s), one spawn of 4 gloo processes each; "
          f"{steps} timed AdamW steps per plan (median), steps interleaved; GPT n_layer "
          f"{g['n_layer']}, n_embd {g['n_embd']}, batch {g['B']} x {g['T']}; compute padded to "
          f"K = {uneven.K} x slowdown x the solo time of this 2-core machine (pipeline stages "
          f"per micro-batch); loopback gloo links; every device's memory {CAP} of the whole "
          "model's need. Same global batch and lr for every plan: a step-time comparison, "
          "not time to accuracy against the fastest device tuned over batch and lr on held-out "
          "seeds (it does not fit the memory at this batch, and may at a smaller one; "
          "benchmarks/autoddl_tta.py makes that comparison, without memory caps). "
          "The twin is the searched pipeline's stages run without shares (each stage data "
          "parallel over its 2 devices with DTensor, an even split).", "",
          "| plans measured (fit) | searched / fastest fitting | twin without shares / "
          "searched (measured) | (predicted) | Spearman (fitting plans) |",
          "|---|---|---|---|---|",
          f"| {ss[0]['n_plans']} ({ss[0]['n_fit']}) | "
          f"{median_range([s['searched_over_best'] for s in ss], '.3f')} | "
          f"{median_range([s['twin_over_searched'] for s in ss], '.2f')} | "
          f"{median_range([s['predicted_twin_over_searched'] for s in ss], '.2f')} | "
          f"{median_range([s['spearman'] for s in ss], '.3f')} |", "",
          *per_plan_table(repeats)]
    (OUT / "autoddl_columns.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
