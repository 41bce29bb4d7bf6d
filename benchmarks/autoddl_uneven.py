"""Uneven data-parallel shares on devices of speeds 1:1:2:4, measured on real processes.

    .venv/bin/python benchmarks/autoddl_uneven.py [--repeats 3] [--steps 10]

Per repeat, one spawn of 4 CPU gloo processes (one thread each), rank r standing for cluster
device r of speeds 1:1:2:4 (ranks 0-1 slowest, rank 3 fastest). Device speed is emulated the
way the strategies' real engine does it (hetrain.engine.emulate): a rank's forward + backward
is padded to a budget, K x slowdown x this machine's solo time, t(b) = a + c b fitted from rank
0 alone at two batch sizes (the others wait), K = 3 (dist.contention_k's default) for 4
processes on 2 cores (real compute above the budget is counted as an overrun and reported). The
padding sits once per step before the gradient sync: exact for data-parallel plans (no
communication inside forward and backward), approximate for plans with tensor-parallel ops,
whose collectives inside the step do not wait for a slow member's emulated compute. Every plan,
the lone fastest device included, runs at that K; links are the real loopback gloo, their costs
calibrated by the same collective microbenchmarks as autoddl_predicted_vs_measured.py.

The planner sees the cluster those budgets define (emulate.calibrated_cluster's formula:
step_overhead_s = K s a, flops = per-sample FLOPs / (K s c)) and the calibrated collectives.
Measured side by side, steps interleaved round-robin, median of --steps timed AdamW steps after
2 warm-up steps, every plan on the same global batch and lr (the same updates; the lone device
is not tuned over batch and lr here, so this is a step-time comparison, not time to accuracy):
every one-stage candidate of the search
(even and uneven shares; pipelines are left out: their executor has no emulation hook), the
lone fastest device, and even data parallelism over all 4. Reported: the searched plan against
even data parallel over 4 and against the lone fastest device, predicted and measured, and
Spearman over the candidates. Writes benchmarks/results/autoddl_uneven.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).parent))
from autoddl_predicted_vs_measured import M4
from common import median_range, results_dir, spawned_repeats

from hetrain.cluster import Cluster, Device, Link, Site
from hetrain.parallel.calibrate import collective_times, fit_collectives
from hetrain.parallel.execute import make_executor
from hetrain.plan.cost import CostOptions, Plan, plan_cost, training_flops_per_sample
from hetrain.plan.graph import gpt_graph
from hetrain.plan.sbp import Mesh
from hetrain.plan.search import SearchOptions, search_plan, template_plan
from hetrain.workloads import MODELS
from hetrain.workloads.base import cross_entropy

OUT = results_dir()
GPT = dict(n_layer=2, n_head=4, n_embd=128, vocab=128, T=64, B=32)
SLOWDOWN = (4.0, 4.0, 2.0, 1.0)
"""Per rank: the fastest device's speed over this one's (speeds 1:1:2:4)."""
K = 3.0
LONE = "lone fastest device 3 (the others idle)"
EVEN = "even data parallel over 4"


def graph(gpt: dict[str, int] | None = None) -> Any:
    """The layer graph of `gpt` (sizes as GPT's keys; default this benchmark's GPT)."""
    g = gpt or GPT
    return gpt_graph(g["n_layer"], g["n_embd"], g["n_head"], g["vocab"], g["T"], g["B"])


def build(gpt: dict[str, int] | None = None) -> torch.nn.Module:
    g = gpt or GPT
    return MODELS["gpt"]((g["T"],), g["vocab"], n_layer=g["n_layer"], n_head=g["n_head"],
                         n_embd=g["n_embd"])


def flops_per_sample() -> float:
    return training_flops_per_sample(graph())


def batch(gen: torch.Generator, b: int,
          gpt: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = gpt or GPT
    return (torch.randint(0, g["vocab"], (b, g["T"]), generator=gen),
            torch.randint(0, g["vocab"], (b, g["T"]), generator=gen))


def fit_solo(model: torch.nn.Module, batch_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
             loss_fn: Callable[..., torch.Tensor], b1: int) -> tuple[float, float]:
    """(a, c) of forward + backward time t(b) = a + c b of `model` in this process alone
    (medians of 6 timings at b1 and at 4 b1; batch_of(b) gives a batch of b samples)."""
    def timed(b: int) -> float:
        x, y = batch_of(b)
        ts = []
        for k in range(8):
            t0 = time.perf_counter()
            loss_fn(model(x), y).backward()
            if k >= 2:
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    t1, t4 = timed(b1), timed(4 * b1)
    c = max((t4 - t1) / (3 * b1), 0.1 * t1 / b1)
    return max(t1 - c * b1, 0.0), c


def solo_fit() -> tuple[float, float]:
    """fit_solo of this benchmark's GPT on random batches of B/4 and B."""
    torch.manual_seed(0)
    model = build()
    gen = torch.Generator().manual_seed(2)
    return fit_solo(model, lambda b: batch(gen, b), cross_entropy, GPT["B"] // 4)


def cluster_of(calib: dict[str, Any], fps: float | None = None, k: float = K,
               slowdown: tuple[float, ...] = SLOWDOWN) -> Cluster:
    """The devices the budgets emulate: k x slowdown x the solo fit, for a model of `fps`
    training FLOPs per sample (default: this benchmark's GPT)."""
    site = Site("local", Link(calib["beta_Bps"], calib["alpha_s"]),
                Link(calib["beta_Bps"], calib["alpha_s"]))
    fps = flops_per_sample() if fps is None else fps
    name = "speeds-" + "-".join(f"{max(slowdown) / s:g}" for s in slowdown)
    return Cluster(name, tuple(
        Device(f"rank{i}", fps / (k * s * calib["c"]), 8e9, "local",
               step_overhead_s=k * s * calib["a"]) for i, s in enumerate(slowdown)), (site,))


def options_of(calib: dict[str, Any]) -> CostOptions:
    """AdamW; the collectives as measured; no per-op corrections (the budget is the compute)."""
    return CostOptions(optimizer_states=2.0,
                       collective_factors=tuple(tuple(f) for f in calib["factors"]),  # type: ignore[misc]
                       collective_call_s=calib["call_s"])


def calibrate(rank: int, world: int,
              solo: Callable[[], tuple[float, float]] = solo_fit) -> dict[str, Any]:
    """Rank 0's solo fit (`solo`) and collective fit, broadcast as one float tensor (every
    rank plans with identical numbers; nothing received is unpickled)."""
    ac = (0.0, 0.0)
    dist.barrier()
    if rank == 0:
        ac = solo()
    call_s, alpha, beta, factors = fit_collectives(collective_times(world))
    kinds = [k for k, _, _ in factors]
    flat = torch.tensor([*ac, call_s, alpha, beta, *(x for _, fa, fb in factors for x in (fa, fb))],
                        dtype=torch.float64)
    dist.broadcast(flat, src=0)
    v = flat.tolist()
    return dict(a=v[0], c=v[1], call_s=v[2], alpha_s=v[3], beta_Bps=v[4],
                factors=[(k, v[5 + 2 * i], v[6 + 2 * i]) for i, k in enumerate(kinds)])


def plans(cluster: Cluster, options: CostOptions) -> tuple[dict[str, Plan], dict[str, str]]:
    """label -> plan (distinct), and the labels of the searched plan, the search's choice
    without uneven shares, the lone fastest device and even data parallel over 4."""
    g = graph()
    found = search_plan(g, cluster, SearchOptions(pipeline=False), options)
    even_only = search_plan(g, cluster, SearchOptions(pipeline=False, uneven=False), options)
    out: dict[str, Plan] = {}
    for desc, plan in [*zip((d for d, _, _ in found.candidates), found.candidate_plans,
                            strict=True),
                       (LONE, template_plan(g, Mesh((1,), (3,)), "dp")),
                       (EVEN, template_plan(g, M4, "dp"))]:
        if plan not in out.values():
            out[desc] = plan
    lone, even = template_plan(g, Mesh((1,), (3,)), "dp"), template_plan(g, M4, "dp")
    roles = {"searched": found.plan, "searched_even_only": even_only.plan, "lone": lone,
             "even": even}
    return out, {r: next(k for k, p in out.items() if p == plan) for r, plan in roles.items()}


def worker(rank: int, world: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    calib = calibrate(rank, world)
    cluster, options = cluster_of(calib), options_of(calib)
    found, roles = plans(cluster, options)
    me = cluster.devices[rank]
    fps = flops_per_sample()

    def budget(samples: int) -> float:
        return me.compute_time_s(samples, fps)

    x, y = batch(torch.Generator().manual_seed(1), GPT["B"])
    runs = []
    for label, plan in found.items():
        torch.manual_seed(0)
        ex = make_executor(build(), graph(), plan, cross_entropy, cluster=cluster,
                           compute_budget=budget)
        params = ex.parameters()
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False) if params else None
        runs.append((label, ex, opt, [], []))
    for k in range(steps + 2):
        for _, ex, opt, times, losses in runs:
            dist.barrier()
            t0 = time.perf_counter()
            losses.append(ex.step(x, y, opt))
            dist.barrier()
            if k >= 2:
                times.append(time.perf_counter() - t0)
    over = []
    for _, ex, *_ in runs:
        pad = getattr(ex, "pad", None) or getattr(getattr(ex, "inner", None), "pad", None)
        over.append(float(pad.overruns) if pad is not None else 0.0)
    total = torch.tensor(over)
    dist.all_reduce(total)  # every rank's, summed, per plan
    return {"calibration": calib, "plans": {k: p.to_dict() for k, p in found.items()},
            "roles": roles,
            "measured": {label: statistics.median(t) for label, _, _, t, _ in runs},
            "losses": {label: ls for label, *_, ls in runs},
            "overruns": {label: int(n) for (label, *_), n in zip(runs, total.tolist(), strict=True)}}


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    g, calib = graph(), res["calibration"]
    cluster, options = cluster_of(calib), options_of(calib)
    rows = []
    for label, d in res["plans"].items():
        plan = Plan.from_dict(d)
        rows.append(dict(plan=label, predicted_s=plan_cost(g, plan, cluster, options).time_s,
                         measured_s=res["measured"][label],
                         shares=list(plan.stages[0].shares)))
    meas = res["measured"]
    pred = {r["plan"]: r["predicted_s"] for r in rows}
    roles = res["roles"]
    s, lone, even = roles["searched"], roles["lone"], roles["even"]
    return dict(rows=rows, searched=s, searched_even_only=roles["searched_even_only"],
                even_over_searched=meas[even] / meas[s], lone_over_searched=meas[lone] / meas[s],
                even_only_over_searched=meas[roles["searched_even_only"]] / meas[s],
                predicted_even_over_searched=pred[even] / pred[s],
                predicted_lone_over_searched=pred[lone] / pred[s],
                spearman=float(spearmanr([r["predicted_s"] for r in rows],
                                         [r["measured_s"] for r in rows])[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    repeats = spawned_repeats(worker, (args.steps,), args.repeats, summarise, lambda summ, res: (
        f"searched {summ['searched']!r}: even dp / searched {summ['even_over_searched']:.2f}x "
        f"(predicted {summ['predicted_even_over_searched']:.2f}x), lone fastest / searched "
        f"{summ['lone_over_searched']:.2f}x (predicted "
        f"{summ['predicted_lone_over_searched']:.2f}x), spearman {summ['spearman']:.2f}, "
        f"overruns {sum(res['overruns'].values())}"))
    write(repeats, args)


def write(repeats: list[dict[str, Any]], args: argparse.Namespace) -> None:
    cmd = " ".join([".venv/bin/python", *sys.argv])
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "autoddl_uneven.json").write_text(json.dumps(
        {"command": cmd, "gpt": GPT, "slowdown": SLOWDOWN, "k": K, "repeats": repeats},
        indent=1))
    ss = [r["summary"] for r in repeats]
    md = [f"<!-- made by: {cmd} -->",
          "# Uneven data-parallel shares on speeds 1:1:2:4 (real processes, emulated speeds)",
          "", f"Command: `{cmd}`; {len(repeats)} repeat(s), one spawn of 4 gloo processes "
          f"each; {args.steps} timed AdamW steps per plan (median), steps interleaved; GPT "
          f"n_layer {GPT['n_layer']}, n_embd {GPT['n_embd']}, batch {GPT['B']} x {GPT['T']}; "
          f"compute padded to K = {K} x slowdown x the solo time of this 2-core machine "
          "(every plan, the lone device too); loopback gloo links. Same global batch and lr, so "
          "the same updates, for every plan: a step-time comparison, not time to accuracy "
          "against a lone device tuned over batch and lr on held-out seeds.", "",
          "| | measured, median (min-max) | predicted, median |", "|---|---|---|",
          f"| even data parallel over 4 / searched | "
          f"{median_range([s['even_over_searched'] for s in ss])} | "
          f"{statistics.median(s['predicted_even_over_searched'] for s in ss):.2f} |",
          f"| lone fastest device / searched | {median_range([s['lone_over_searched'] for s in ss])} | "
          f"{statistics.median(s['predicted_lone_over_searched'] for s in ss):.2f} |",
          f"| search without uneven shares / searched | "
          f"{median_range([s['even_only_over_searched'] for s in ss])} | |",
          f"| Spearman, predicted vs measured over the plans | "
          f"{median_range([s['spearman'] for s in ss])} | |", "",
          "Searched per repeat: " + ", ".join(f"`{s['searched']}`" for s in ss), "",
          "Search without uneven shares per repeat: " + ", ".join(
              f"`{s['searched_even_only']}`" for s in ss), "",
          "Overruns: steps x ranks whose real compute exceeded the emulated budget (that rank "
          "then ran slower than its emulated device), summed over repeats, per plan below.", "",
          "## Per plan (repeat 0's prediction; measured median over repeats)", "",
          "| plan | predicted s | measured s | spread | overruns |", "|---|---|---|---|---|"]
    for row in sorted(ss[0]["rows"], key=lambda r: r["predicted_s"]):
        ms = [next(x["measured_s"] for x in s["rows"] if x["plan"] == row["plan"]) for s in ss
              if any(x["plan"] == row["plan"] for x in s["rows"])]
        over = sum(r["result"]["overruns"].get(row["plan"], 0) for r in repeats)
        md.append(f"| {row['plan']} | {row['predicted_s']:.4f} | {statistics.median(ms):.4f} "
                  f"| {min(ms):.4f}-{max(ms):.4f} | {over} |")
    (OUT / "autoddl_uneven.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
