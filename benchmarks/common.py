"""What several benchmarks share: the median (min-max) summary of per-seed figures, the
stated policy for a seed that misses a target, and repeats of one spawn of gloo processes.

Policy for new benchmarks (goodput.py's, stated in its docstring): a seed that misses a
target within the run has an infinite time to target; it stays in the median and the miss
count is shown, so a miss is never hidden by a median over the seeds that made it. Existing
benchmarks whose published results files used another policy keep it, so that re-running or
re-summarising them reproduces the published figures:
  * ashl_bench.py: a median is given only when every seed reached the target; otherwise
    "k seed(s) not reached" and the others' range;
  * cadp_tta.py, real_hetero4.py: medians over the seeds that reached the target
    (cadp_tta.py prints the reached count beside them);
  * gpu_hetero.py: a miss counts as the time cap.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

RESULTS_ENV = "HETRAIN_BENCH_RESULTS"


def results_dir() -> Path:
    """Where a benchmark writes its results files: benchmarks/results/, the published ones, or
    the folder $HETRAIN_BENCH_RESULTS names (`make bench`'s scratch folder, so a quick run
    never overwrites a published figure)."""
    return Path(os.environ.get(RESULTS_ENV) or Path(__file__).parent / "results")


def spread(values: Iterable[float | None]) -> tuple[float, float, float] | None:
    """(median, min, max) of the values that are not None; None if there are none."""
    got = [v for v in values if v is not None]
    if not got:
        return None
    return statistics.median(got), min(got), max(got)


def spawned_repeats(worker: Callable[..., Any], args: tuple[Any, ...], repeats: int,
                    summarise: Callable[[Any], Any], describe: Callable[[Any, Any], str],
                    world: int = 4) -> list[dict[str, Any]]:
    """`repeats` times: spawn `world` gloo processes running worker(rank, world, *args), keep
    rank 0's result, its summary and the wall time; print one line per repeat
    (describe(summary, result))."""
    from hetrain.parallel.launch import run_local

    out = []
    for r in range(repeats):
        t0 = time.perf_counter()
        res = run_local(worker, world, args, timeout_s=1800)[0]
        summ = summarise(res)
        out.append(dict(result=res, summary=summ, wall_s=time.perf_counter() - t0))
        print(f"repeat {r} ({out[-1]['wall_s']:.0f} s): {describe(summ, res)}", flush=True)
    return out


def pad_overruns(ex: Any) -> int:
    """Steps (pipeline stages: micro-batches) whose real compute on this rank exceeded its
    emulated budget, for any hetrain.parallel executor (0 without emulation)."""
    pad = (getattr(ex, "pad", None) or getattr(getattr(ex, "inner", None), "pad", None)
           or getattr(getattr(ex, "module", None), "pad", None))
    return pad.overruns if pad is not None else 0


def interleaved_steps(steps: int, runs: list[tuple[Callable[[], Any], list[float]]]) -> None:
    """2 warm-up and `steps` timed calls of each run's step, round-robin over the runs so
    that load from other work hits all alike, each between barriers of the default group;
    the timed seconds are appended to the run's list."""
    import torch.distributed as dist

    for k in range(steps + 2):
        for step, times in runs:
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            if k >= 2:
                times.append(time.perf_counter() - t0)


def median_range(xs: list[float], spec: str = ".2f") -> str:
    """"median (min-max)" of per-repeat or per-seed figures, each formatted with `spec`."""
    return f"{format(statistics.median(xs), spec)} ({format(min(xs), spec)}-{format(max(xs), spec)})"


def measure_plans(plans: dict[str, Any], build: Callable[[], Any], graph: Any, cluster: Any,
                  budget: Callable[[int], float], batch: tuple[Any, Any],
                  steps: int) -> tuple[dict[str, float], dict[str, int]]:
    """Every plan (label -> hetrain Plan) built on this process group with the same seed and
    emulated compute `budget`, AdamW (lr 1e-3), `steps` timed steps on `batch` interleaved
    (interleaved_steps); (label -> median step seconds, label -> overruns of every rank).
    Collective: call on every rank."""
    import functools

    import torch
    import torch.distributed as dist

    from hetrain.parallel.execute import make_executor
    from hetrain.workloads.base import cross_entropy

    runs = []
    for label, plan in plans.items():
        torch.manual_seed(0)
        ex = make_executor(build(), graph, plan, cross_entropy, cluster=cluster,
                           compute_budget=budget)
        params = ex.parameters()
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False) if params else None
        runs.append((label, ex, opt, []))
    x, y = batch
    interleaved_steps(steps, [(functools.partial(ex.step, x, y, opt), times)
                              for _, ex, opt, times in runs])
    total = torch.tensor([float(pad_overruns(ex)) for _, ex, _, _ in runs])
    dist.all_reduce(total)  # every rank's, summed, per plan
    return ({label: statistics.median(t) for label, _, _, t in runs},
            {label: int(n) for (label, *_), n in zip(runs, total.tolist(), strict=True)})


def per_plan_table(repeats: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: the searched and the fastest fitting plan per repeat, then a table of
    every plan of repeat 0 (its prediction; fitting plans first, by predicted time) with the
    median and spread of its measured step time over the repeats and its overruns summed
    over them. Each repeat's summary holds `searched`, `best` and `rows` of plan,
    predicted_s, fits, measured_s, memory_mb."""
    ss = [r["summary"] for r in repeats]
    md = ["Searched per repeat: " + ", ".join(f"`{s['searched']}`" for s in ss), "",
          "Fastest fitting per repeat: " + ", ".join(f"`{s['best']}`" for s in ss), "",
          "Overruns: micro-batches (pipelines) or steps (one-stage plans) x ranks whose real "
          "compute exceeded the emulated budget, summed over repeats.", "",
          "## Per plan (repeat 0's prediction; measured median over repeats)", "",
          "| plan | fits | memory MB | predicted s | measured s | spread | overruns |",
          "|---|---|---|---|---|---|---|"]
    for row in sorted(ss[0]["rows"], key=lambda r: (not r["fits"], r["predicted_s"])):
        ms = [next(x["measured_s"] for x in s["rows"] if x["plan"] == row["plan"]) for s in ss
              if any(x["plan"] == row["plan"] for x in s["rows"])]
        over = sum(r["result"]["overruns"].get(row["plan"], 0) for r in repeats)
        md.append(f"| {row['plan']} | {'yes' if row['fits'] else 'no'} | {row['memory_mb']:.1f} "
                  f"| {row['predicted_s']:.4f} | {statistics.median(ms):.4f} "
                  f"| {min(ms):.4f}-{max(ms):.4f} | {over} |")
    return md


def fitting_summary(res: dict[str, Any], graph: Any, cluster: Any,
                    options: Any) -> dict[str, Any]:
    """A measure_plans repeat (`res`: plans, measured, searched) against the cost model:
    per plan its prediction, fit and measured time (`rows`), the fastest fitting plan
    (`best`), the searched plan's time over it, and Spearman over the fitting plans."""
    from scipy.stats import spearmanr

    from hetrain.plan.cost import Plan, plan_cost

    rows = []
    for label, d in res["plans"].items():
        rep = plan_cost(graph, Plan.from_dict(d), cluster, options)
        rows.append(dict(plan=label, predicted_s=rep.time_s, fits=rep.feasible,
                         measured_s=res["measured"][label], memory_mb=rep.memory_bytes / 1e6))
    fit = [r for r in rows if r["fits"]]
    best = min(fit, key=lambda r: r["measured_s"])
    s = res["searched"]
    return dict(rows=rows, searched=s, best=best["plan"],
                searched_over_best=res["measured"][s] / best["measured_s"],
                spearman=float(spearmanr([r["predicted_s"] for r in fit],
                                         [r["measured_s"] for r in fit])[0]),
                n_plans=len(rows), n_fit=len(fit))


def rewrite_from_json(path: str, ap: Any, write: Callable[..., None]) -> None:
    """Re-write a benchmark's tables from its results JSON (its repeats and command; no
    process started): write(repeats, steps, command, rewritten_by), `ap` the benchmark's
    parser (to read --steps back from the command)."""
    import json
    import shlex
    import sys

    data = json.loads(Path(path).read_text())
    made = ap.parse_args(shlex.split(data["command"])[2:])
    write(data["repeats"], made.steps, data["command"],
          " ".join([".venv/bin/python", *sys.argv]))
