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
