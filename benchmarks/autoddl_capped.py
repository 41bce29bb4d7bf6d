"""The searched plan on emulated devices of speeds 1:1:2:4 whose memory no device meets alone.

    .venv/bin/python benchmarks/autoddl_capped.py [--repeats 3] [--steps 8]

Issue 19's case: a GPT whose memory needs exceed the smallest emulated device, trained with
`[parallel] plan = "auto"`. Per repeat, one spawn of 4 CPU gloo processes (one thread each),
rank r standing for device r of speeds 1:1:2:4, emulated exactly as in autoddl_uneven.py (the
same calibration: rank 0's solo fit gives the budget, K = 3 x slowdown x the solo time; the
collectives' per-call cost and factors from the package's microbenchmarks, which is what
`hetrain run` adds to a cluster file under dist.emulate = "cluster"). Memory caps, as fractions
of what the cost model counts for the whole model on one device (parameters, gradients, AdamW
state, activations at the global batch): CAPS, so no device holds the model alone and the
fastest holds 90% of it.

The search (`search_plan`, what `plan = "auto"` runs, pipelines included: a pipeline stage now
pads every micro-batch to its devices' share, pipeline.StagePadding) picks a plan; every plan
it enumerated, the lone fastest device, even data parallelism over 4 and the torchtitan-style
plan (tensor parallel inside a node of 2, data parallel across: "dp-tp" on the 2 x 2 mesh) run
2 warm-up and --steps timed AdamW steps, steps interleaved round-robin, every plan the same
global batch and lr (a step-time comparison). Plans that do not fit the caps are measured too
and ranked apart. Reported: the searched plan's time over the fastest fitting plan's (target
<= 1.10), the torchtitan-style plan's over the searched one's, and Spearman over the fitting
plans. Writes benchmarks/results/autoddl_capped.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import autoddl_uneven as uneven
from autoddl_predicted_vs_measured import M4, M22
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
from hetrain.plan.cost import CostOptions, Plan, plan_cost
from hetrain.plan.sbp import Mesh
from hetrain.plan.search import SearchOptions, search_plan, template_plan

OUT = results_dir()
CAPS = (0.45, 0.45, 0.6, 0.9)
"""Per device: its memory as a fraction of the whole model's need on one device."""
LONE, EVEN, TORCHTITAN = uneven.LONE, uneven.EVEN, "torchtitan-style dp-tp on 2 x 2"


def capped(calib: dict[str, Any]) -> Cluster:
    roomy = uneven.cluster_of(calib)
    need = plan_cost(uneven.graph(), template_plan(uneven.graph(), M4, "rep"), roomy,
                     uneven.options_of(calib)).memory_bytes
    return Cluster("speeds-1-1-2-4-capped", tuple(
        dataclasses.replace(d, memory_bytes=c * need) for d, c in zip(roomy.devices, CAPS, strict=True)),
        roomy.sites)


def plans(cluster: Cluster, options: CostOptions) -> tuple[dict[str, Plan], str]:
    """label -> plan (distinct) and the searched plan's label."""
    g = uneven.graph()
    found = search_plan(g, cluster, SearchOptions(), options)
    out: dict[str, Plan] = {}
    for desc, plan in [*zip((d for d, _, _ in found.candidates), found.candidate_plans,
                            strict=True),
                       (LONE, template_plan(g, Mesh((1,), (3,)), "dp")),
                       (EVEN, template_plan(g, M4, "dp")),
                       (TORCHTITAN, template_plan(g, M22, "dp-tp"))]:
        if plan not in out.values():
            out[desc] = plan
    return out, next(k for k, p in out.items() if p == found.plan)


def worker(rank: int, world: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    calib = uneven.calibrate(rank, world)
    cluster, options = capped(calib), uneven.options_of(calib)
    found, searched = plans(cluster, options)
    me, fps = cluster.devices[rank], uneven.flops_per_sample()

    def budget(samples: int) -> float:
        return me.compute_time_s(samples, fps)

    batch = uneven.batch(torch.Generator().manual_seed(1), uneven.GPT["B"])
    measured, overruns = measure_plans(found, uneven.build, uneven.graph(), cluster, budget,
                                       batch, steps)
    return {"calibration": calib, "plans": {k: p.to_dict() for k, p in found.items()},
            "searched": searched,
            "measured": measured, "overruns": overruns}


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    calib = res["calibration"]
    summ = fitting_summary(res, uneven.graph(), capped(calib), uneven.options_of(calib))
    meas, s, rows = res["measured"], res["searched"], summ["rows"]
    return summ | dict(torchtitan_over_searched=meas[TORCHTITAN] / meas[s],
                       torchtitan_fits=next(r["fits"] for r in rows if r["plan"] == TORCHTITAN))


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
        f"({summ['best']!r}), torchtitan-style {summ['torchtitan_over_searched']:.2f}x the "
        f"searched, spearman {summ['spearman']:.2f}, overruns {sum(res['overruns'].values())}"))
    write(repeats, args.steps, " ".join([".venv/bin/python", *sys.argv]))


def write(repeats: list[dict[str, Any]], steps: int, cmd: str,
          rewritten_by: str | None = None) -> None:
    """The results JSON and table; `rewritten_by`: the --from-json command that re-wrote them
    from `cmd`'s runs."""
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "autoddl_capped.json").write_text(json.dumps(
        {"command": cmd, "gpt": uneven.GPT, "slowdown": uneven.SLOWDOWN, "k": uneven.K,
         "caps": CAPS, "repeats": repeats}, indent=1))
    ss = [r["summary"] for r in repeats]
    g = uneven.GPT
    tt = "" if ss[0]["torchtitan_fits"] else " (does not fit the caps)"
    again = f" (tables re-written from its JSON by `{rewritten_by}`)" if rewritten_by else ""
    md = [f"<!-- made by: {cmd} -->",
          "# The searched plan on speeds 1:1:2:4 with memory caps no device meets alone",
          "", f"Command: `{cmd}`{again}; {len(repeats)} repeat(s), one spawn of 4 gloo processes "
          f"each; {steps} timed AdamW steps per plan (median), steps interleaved; GPT "
          f"n_layer {g['n_layer']}, n_embd {g['n_embd']}, batch {g['B']} x {g['T']}; compute "
          f"padded to K = {uneven.K} x slowdown x the solo time of this 2-core machine (every "
          "plan; pipeline stages per micro-batch); loopback gloo links; memory caps "
          f"{list(CAPS)} of the whole model's need (devices 0-3). Same global batch and lr for "
          "every plan: a step-time comparison, not time to accuracy against the fastest device "
          "tuned over batch and lr (it does not fit the caps at this batch, and may at a "
          "smaller one; benchmarks/autoddl_tta.py makes that comparison, without caps).", "",
          "| plans measured (fit) | searched / fastest fitting (target <= 1.10) | "
          "torchtitan-style dp-tp / searched | Spearman (fitting plans) |", "|---|---|---|---|",
          f"| {ss[0]['n_plans']} ({ss[0]['n_fit']}) | "
          f"{median_range([s['searched_over_best'] for s in ss], '.3f')} | "
          f"{median_range([s['torchtitan_over_searched'] for s in ss], '.3f')}{tt} | "
          f"{median_range([s['spearman'] for s in ss], '.3f')} |", "",
          *per_plan_table(repeats)]
    (OUT / "autoddl_capped.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
