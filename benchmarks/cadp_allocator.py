"""C-ADP allocator benchmark: wall time of `allocate` on large random clusters.

    .venv/bin/python benchmarks/cadp_allocator.py [--repeats 5]

Random instances (fixed costs 0-1 s, per-sample costs 1e-4-1 s log-uniform, half of them with
memory caps), S = 100 samples per device, granularity 1 and 32. Reports the median and spread of
--repeats wall times per size, the continuous optimum T*, the integer makespan and the rounding
gap (makespan - T*) / max_j b_j, which the theorem in plan/allocate.py bounds by 1 (units).
Target: 10,000 devices well under a second. Writes cadp_allocator.{json,md} to
benchmarks/results/ ($HETRAIN_BENCH_RESULTS when set).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
from common import results_dir

from hetrain.plan.allocate import allocate

OUT = results_dir()


def instance(n: int, seed: int, capped: bool, g: int):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    a = rng.uniform(0, 1, n)
    b = 10 ** rng.uniform(-4, 0, n)
    total = 100 * n * g
    caps = rng.integers(50, 400, n) * g if capped else None
    return a, b, caps, total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for n in (10, 100, 1000, 10_000, 100_000):
        for capped in (False, True):
            for g in (1, 32):
                a, b, caps, total = instance(n, n + capped, capped, g)
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    r = allocate(a, b, total, caps, granularity=g)
                    times.append(time.perf_counter() - t0)
                gap = (r.makespan_s - r.continuous_makespan_s) / float((b * g).max())
                rows.append(dict(devices=n, capped=capped, granularity=g,
                                 wall_s_median=statistics.median(times), wall_s_min=min(times),
                                 wall_s_max=max(times), continuous_makespan_s=r.continuous_makespan_s,
                                 makespan_s=r.makespan_s, rounding_gap_units=gap,
                                 active=len(r.active)))
                print(rows[-1], flush=True)
    cmd = " ".join([".venv/bin/python", *sys.argv])
    OUT.mkdir(exist_ok=True)
    (OUT / "cadp_allocator.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=2))
    lines = [f"<!-- made by: {cmd} -->", "# C-ADP allocator: wall time of `allocate`", "",
             f"Command: `{cmd}` (2-core shared machine; median of {args.repeats} runs; random "
             "instances, S = 100 units per device).", "",
             "| devices | caps | granularity | wall s (median) | min-max | active | T* s | "
             "makespan s | (makespan - T*) / max b |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['devices']:,} | {'yes' if r['capped'] else 'no'} | {r['granularity']} "
                     f"| {r['wall_s_median']:.4f} | {r['wall_s_min']:.4f}-{r['wall_s_max']:.4f} "
                     f"| {r['active']:,} | {r['continuous_makespan_s']:.4f} | {r['makespan_s']:.4f} "
                     f"| {r['rounding_gap_units']:.2e} |")
    (OUT / "cadp_allocator.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
