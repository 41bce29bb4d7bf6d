"""The quick benchmark set (`make bench`): short runs of a few benchmarks, into a scratch folder.

    .venv/bin/python benchmarks/quick.py [--out runs/bench]

Each entry of QUICK is a script of benchmarks/ with its own flags for a small run: the
allocator, the goodput and AutoDDL planners' search times, and one simulated time-to-accuracy
comparison (one epoch, one seed, hetero-4). Together about 70 s on a busy 2-core machine.
The figures are a quick look (did a change make a planner slower, or the simulated TTA
worse?), not the published ones: those come from each script's full run, whose command heads
its file in benchmarks/results/. This set writes its files, each script's log and
`quick.json` (wall time and exit status per script) to --out, never to benchmarks/results/
(through $HETRAIN_BENCH_RESULTS, see common.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS_ENV

HERE = Path(__file__).resolve().parent
QUICK: tuple[tuple[str, ...], ...] = (
    ("cadp_allocator.py", "--repeats", "1"),
    ("goodput_scale.py", "--repeats", "1"),
    ("autoddl_search.py", "--repeats", "1"),
    ("cadp_tta.py", "--epochs", "1", "--target", "0.5", "--seeds", "0", "--presets", "hetero-4",
     "--jobs", "1"),
)
"""The set: script, then its flags."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/bench"),
                    help="scratch folder for the results (default: runs/bench)")
    args = ap.parse_args()
    out: Path = args.out
    if out.resolve() == HERE / "results":
        print("benchmarks/quick.py: --out is benchmarks/results/, the published figures; give "
              "a scratch folder (default runs/bench)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, RESULTS_ENV: str(out.resolve())}
    summary, start = [], time.perf_counter()
    for script, *flags in QUICK:
        name = script.removesuffix(".py")
        t = time.perf_counter()
        with open(out / f"{name}.log", "w") as log:
            rc = subprocess.run([sys.executable, str(HERE / script), *flags], env=env,
                                stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        wall = time.perf_counter() - t
        summary.append({"script": script, "flags": flags, "wall_s": round(wall, 2), "rc": rc})
        print(f"{' '.join([script, *flags]):<80} {wall:6.1f} s  "
              f"{'ok' if rc == 0 else f'FAILED (exit {rc}, see {out / name}.log)'}", flush=True)
    total = time.perf_counter() - start
    (out / "quick.json").write_text(json.dumps({"total_s": round(total, 2), "runs": summary},
                                               indent=1) + "\n")
    failed = [s["script"] for s in summary if s["rc"] != 0]
    print(f"{len(QUICK)} benchmarks in {total:.0f} s; results, logs and quick.json in {out}/"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
