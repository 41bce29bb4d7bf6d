"""Fixed-seed regression check: a digest of short simulated runs, to compare before and after
a change that must not move any simulated figure (a refactor).

    PYTHONPATH=src .venv/bin/python benchmarks/fixed_seed_check.py [--out DIGESTS.json]
        [--compare DIGESTS.json] [--epochs 0.5] [--keep DIR]

Runs the public path (`python -m hetrain run`, one subprocess per case, so no state carries
over between cases) on the built-in demo config (hetero-8, MNIST-1D CNN, seed 0) for
--epochs: the demo's strategies (auto, cadp, ashl, ddp, the fastest device alone) plus adsp,
asp, ssp and local_sgd, then cadp with qsgd compression and cadp with an lr schedule (StepLR).
Per run it prints the SHA-256 of metrics.jsonl and of summary.json, both re-serialised without
wall-clock fields (keys naming wall time; the simulator's time_s is virtual and is kept), so a
digest moves exactly when a simulated figure moves. --out writes the digests as JSON;
--compare reads such a file and exits 1 on any difference (the run names that differ are
printed). Takes about 40 s. Digests are for one machine (float rounding differs between
CPUs and torch builds): record them on the unchanged commit, then compare on the same machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

STRATEGIES_COMPARED = ("adsp", "asp", "ssp", "local_sgd")
"""Run beside the demo's own strategies (auto, cadp, ashl, ddp, fastest-alone)."""
CASES: dict[str, list[str]] = {
    "compress": ["strategy.name=\"cadp\"", "train.compression=\"qsgd\""],
    "schedule": ["strategy.name=\"cadp\"", "optimizer.scheduler=\"StepLR\"",
                 "optimizer.scheduler_options={step_size = 40, gamma = 0.5}"],
}
"""Single-strategy cases on the demo config: name -> its --set overrides."""
DEMO_TOML = """\
cluster = "hetero-8"
[workload]
model = "cnn"
dataset = "mnist1d"
[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9
[train]
batch_size = 32
seed = 0
eval_every_s = 0.5
[stop]
target_accuracy = 0.9
"""
"""The built-in demo config (hetrain.cli.run.demo_config) as a file, for the cases that name
one strategy (the demo without a config runs all of its strategies)."""
WALL_MARKERS = ("wall", "elapsed")
"""A key containing one of these holds wall-clock time: left out of the digest."""


def _strip_wall(value: Any) -> Any:
    """`value` without wall-clock entries (they differ between two identical runs)."""
    if isinstance(value, dict):
        return {k: _strip_wall(v) for k, v in value.items()
                if not any(m in k.lower() for m in WALL_MARKERS)}
    if isinstance(value, list):
        return [_strip_wall(v) for v in value]
    return value


def _digest_rows(rows: list[Any]) -> str:
    h = hashlib.sha256()
    for row in rows:  # repr of floats is exact: any bit that moves changes the digest
        h.update(json.dumps(_strip_wall(row), sort_keys=True).encode() + b"\n")
    return h.hexdigest()


def digest_run(run_dir: Path) -> dict[str, str]:
    """SHA-256 of a run's metrics.jsonl rows and of its summary.json (wall time left out)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"metrics": _digest_rows(rows), "summary": _digest_rows([summary])}


def _hetrain(args: list[str]) -> None:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    subprocess.run([sys.executable, "-m", "hetrain", "run", *args, "--no-plot", "--quiet"],
                   check=True, env=env)


def run_all(root: Path, epochs: float) -> dict[str, dict[str, str]]:
    """Every case's runs under `root`; their digests by run name."""
    stop = [f"--set=stop.max_epochs={epochs}"]
    _hetrain(["--runs-dir", str(root / "demo"), "--compare", ",".join(STRATEGIES_COMPARED),
              *stop])
    config = root / "demo.toml"
    config.write_text(DEMO_TOML)
    for case, sets in CASES.items():
        _hetrain([str(config), "--runs-dir", str(root / case), f"--set=name=\"{case}\"",
                  *stop, *(f"--set={s}" for s in sets)])
    out: dict[str, dict[str, str]] = {}
    for summary in sorted(root.glob("*/*/summary.json")):
        out[summary.parent.name] = digest_run(summary.parent)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write the digests here (JSON)")
    p.add_argument("--compare", type=Path, help="digests to compare with; exit 1 on a change")
    p.add_argument("--epochs", type=float, default=0.5, help="stop.max_epochs of every run")
    p.add_argument("--keep", type=Path, help="run into this directory (default: a temp one)")
    args = p.parse_args()
    if args.keep:
        digests = run_all(args.keep, args.epochs)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            digests = run_all(Path(tmp), args.epochs)
    for name, d in digests.items():
        print(f"{name:28s} metrics {d['metrics'][:16]}  summary {d['summary'][:16]}")
    if args.out:
        args.out.write_text(json.dumps({"epochs": args.epochs, "runs": digests}, indent=1) + "\n")
    if args.compare:
        ref = json.loads(args.compare.read_text())
        if ref.get("epochs") != args.epochs:
            print(f"--compare: {args.compare} was made with --epochs {ref.get('epochs')}")
            return 1
        changed = sorted(n for n in set(ref["runs"]) | set(digests)
                         if ref["runs"].get(n) != digests.get(n))
        print("identical" if not changed else "CHANGED: " + ", ".join(changed))
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
