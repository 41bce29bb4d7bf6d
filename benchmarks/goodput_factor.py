"""How auto's `noise_scale_factor`, `noise_scale` (its prior), `min_batch` and
`lr_follows_noise` were chosen, and what `local_step_penalty` and the base lr would change:
auto at each value of one option on the SELECTION seeds.

    .venv/bin/python benchmarks/goodput_factor.py [--workload mnist1d-cnn]
        [--option noise_scale_factor|noise_scale|lr_follows_noise|min_batch|
                  local_step_penalty|lr|hysteresis|noise_ema_weight|push]
        [--values 1 2 3 5]
        [--clusters hetero-4 hetero-8 geo-16 lab-6] [--seeds 0 1 2] [--jobs 2]
        [--selection benchmarks/results/goodput.json (goodput_gpt.json for text-gpt)]
        [--with OPTION=VALUE ...] [--out NAME]

auto (simulated, the workload's epochs, evaluated every 0.5 virtual s, its defaults but the
option) against the tuned fastest device alone, per target: the lone device's setting is the
one goodput.py's tuning picked on these seeds, and its time to the target on each seed is the
selection run's, read from the results file of goodput.py (`--selection`). Only selection
seeds are used here, so goodput.py's held-out seeds (3-5) stay out of the choice. Writes
benchmarks/results/goodput_<word>{,_gpt}.{json,md}, <word> naming the option (OPTIONS:
factor, prior, lr_follow with values 1 / 0, min_batch, penalty, base_lr: the optimizer's base lr,
not an auto option, for how far auto's own lr is from its best; push with values gradient /
delta): per cluster, target and
value, the median (and per-seed values) of lone TTA / auto TTA, and auto's final metric
(accuracy, or test loss for text-gpt). `--with` holds other auto options fixed in every run
(e.g. the prior, `noise_scale=8`, while min_batch moves), `--out` names the results files
instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from common import results_dir
from goodput import WORKLOADS, final_metric, lone_key, make_job, pick, run_job, tta

OPTIONS = {"noise_scale_factor": "factor", "noise_scale": "prior", "lr_follows_noise": "lr_follow",
           "min_batch": "min_batch", "local_step_penalty": "penalty", "lr": "base_lr",
           "hysteresis": "hysteresis", "noise_ema_weight": "noise_ema", "push": "push"}
"""The options this sweeps, and the word naming them in file names and tables; `lr` is not
auto's but the optimizer's base lr (the lr auto scales from): how far auto's own lr is from
its best."""
BOOLEAN = {"lr_follows_noise"}
"""Options given as 1 / 0 on the command line."""
INTEGER = {"min_batch", "min_device_batch"}
WORDS = {"push"}
"""Options whose values are words (push: gradient, delta)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="mnist1d-cnn")
    ap.add_argument("--option", choices=sorted(OPTIONS), default="noise_scale_factor")
    ap.add_argument("--values", "--factors", nargs="+", default=["1", "2", "3", "5"])
    ap.add_argument("--clusters", nargs="+", default=["hetero-4", "hetero-8", "geo-16", "lab-6"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--selection", type=Path, default=None,
                    help="goodput.py's results file of the workload (default: its own)")
    ap.add_argument("--with", dest="fixed", nargs="+", default=[], metavar="OPTION=VALUE",
                    help="auto options held at these values in every run (e.g. noise_scale=8)")
    ap.add_argument("--out", default="", help="results name (default: goodput_<word>[_gpt])")
    args = ap.parse_args()
    spec = WORKLOADS[args.workload]
    selection = args.selection or Path(__file__).parent / "results" / f"{spec['out']}.json"
    saved = json.loads(selection.read_text())
    if saved.get("workload", "mnist1d-cnn") != args.workload or not set(args.seeds) <= set(
            saved["select_seeds"]):
        sys.exit(f"goodput_factor: {selection} must be goodput.py's {args.workload} results "
                 f"with selection seeds {args.seeds}")
    as_goodput = argparse.Namespace(workload=args.workload, epochs=0.0)  # its default epochs
    opt = args.option
    args.values = [typed(opt, v) for v in args.values]

    fixed = dict(fixed_option(text) for text in args.fixed)

    def job(cluster: str, seed: int, value: Any) -> dict[str, Any]:
        if opt == "lr":
            return make_job(as_goodput, "auto", cluster, seed, lr=value) | {"options": fixed}
        return make_job(as_goodput, "auto", cluster, seed) | {"options": fixed | {opt: value}}

    def value_of(run: dict[str, Any]) -> Any:
        return run["lr"] if opt == "lr" else run["options"][opt]

    jobs = [job(c, s, f) for f in args.values for c in args.clusters for s in args.seeds]
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        runs = list(pool.map(run_job, jobs))
    cells: list[dict[str, Any]] = []
    for c in args.clusters:
        mine = [r for r in saved["selection"] if lone_key(r["cluster"]) == lone_key(c)]
        for t in spec["targets"]:
            batch, lr = pick(mine, t)
            lone = {r["seed"]: float(r["tta_s"][str(t)]) for r in mine
                    if (r["batch"], r["lr"]) == (batch, lr)}
            for f in args.values:
                autos = {r["seed"]: r for r in runs if r["cluster"] == c
                         and value_of(r) == f}
                ratios = [lone[s] / tta(autos[s]["rows"], t, spec["metric"])
                          for s in args.seeds]
                cells.append({"cluster": c, "target": t, opt: f,
                              "lone_setting": [batch, lr], "auto_vs_lone": ratios,
                              "median": statistics.median(ratios),
                              "final_auto": [final_metric(autos[s]["rows"], spec["metric"])
                                             for s in args.seeds]})
    command = "python benchmarks/goodput_factor.py " + " ".join(sys.argv[1:])
    out = results_dir()
    out.mkdir(exist_ok=True)
    name = args.out or spec["out"].replace("goodput", f"goodput_{OPTIONS[opt]}")
    (out / f"{name}.json").write_text(json.dumps(
        {"command": command, "workload": args.workload, "option": opt, "fixed": fixed,
         "seeds": args.seeds,
         "cells": cells,
         "runs": [{k: r[k] for k in ("cluster", "seed", "lr", "options", "rows",
                                     "strategy_stats")}
                  for r in runs]}, indent=1, default=str))
    lines = [f"# auto's {opt} on the selection seeds (simulated, {args.workload})"
             "\n",
             f"Command: `{command}`\n",
             *([f"Held in every run: {fixed}\n"] if fixed else []),
             f"auto vs the tuned lone device (lone TTA / auto TTA), seeds {args.seeds}, median "
             "(per seed); the lone TTAs are the selection runs of goodput.py's results file; "
             "final: auto's final metric, median.\n",
             "| cluster | target | " + " | ".join(f"{OPTIONS[opt]} {label(f)}"
                                                   for f in args.values)
             + " | final " + " / ".join(label(f) for f in args.values) + " |",
             "|---|---|" + "---|" * (len(args.values) + 1)]
    for i in range(0, len(cells), len(args.values)):
        row = cells[i:i + len(args.values)]
        lines.append(f"| {row[0]['cluster']} | {row[0]['target']:g} | " + " | ".join(
            f"{x['median']:.2f} ({', '.join(f'{v:.2f}' for v in x['auto_vs_lone'])})"
            for x in row) + " | " + " / ".join(
            f"{statistics.median(x['final_auto']):.3f}" for x in row) + " |")
    text = "\n".join(lines) + "\n"
    (out / f"{name}.md").write_text(text)
    print(text)


def fixed_option(text: str) -> tuple[str, Any]:
    """`name=value` of `--with`, typed like the option."""
    name, sep, value = text.partition("=")
    if not sep:
        sys.exit(f"goodput_factor: --with takes OPTION=VALUE, got '{text}'")
    if name in BOOLEAN:
        return name, value.lower() in ("1", "true")
    return name, typed(name, value)


def typed(name: str, value: str) -> Any:
    """A command-line value as the option takes it."""
    if name in WORDS:
        return value
    if name in BOOLEAN:
        return bool(float(value))
    return int(float(value)) if name in INTEGER else float(value)


def label(value: Any) -> str:
    return value if isinstance(value, str) else f"{value:g}"


if __name__ == "__main__":
    main()
