"""C-ADP against DDP, local SGD and the fastest device alone (simulated): time-to-accuracy.

    .venv/bin/python benchmarks/cadp_tta.py [--epochs 12] [--target 0.85] [--seeds 0 1 2]
                                            [--presets hetero-4 hetero-8 geo-16] [--jobs 2]

MNIST-1D (20,000 samples, 16,000 to train) with the CNN on the simulator (virtual clock, real
gradients), every strategy with its defaults and the project's default optimizer (SGD lr 0.05,
momentum 0.9, train.batch_size 32): ddp, local_sgd (H = 8), cadp (auto batch, H and shares:
the same defaults on every preset) and the preset's fastest device by itself. Each (preset,
seed) trains all four for the same number of epochs in ONE invocation. Reported per preset,
median and min-max over the seeds: TTA (virtual seconds to the target test accuracy), the
per-seed speed-up ddp TTA / strategy TTA, the final test accuracy (last evaluation) and its
gap to ddp in points, the mean of the last epoch's evaluations (less noisy), and hardware
efficiency (achieved / sum of the devices' samples/s).
Writes <--out, default cadp_tta>.{json,md,png} to benchmarks/results/ ($HETRAIN_BENCH_RESULTS
when set).
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

from common import results_dir, spread

OUT = results_dir()
STRATEGIES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("ddp", {}), ("local_sgd", {}), ("cadp", {}), ("fastest-alone", {}))
"""fastest-alone: the cluster's fastest device training by itself (plain SGD, the same batch
and learning rate): the baseline a heterogeneous cluster has to beat to be worth using."""


def one_run(job: tuple[str, str, dict[str, Any], int, float, float]) -> dict[str, Any]:
    import torch

    from hetrain.baselines import FASTEST_ALONE, fastest_alone
    from hetrain.config import config_from_dict
    from hetrain.runner import run_config

    torch.set_num_threads(1)
    preset, strategy, options, seed, epochs, target = job
    alone = strategy == FASTEST_ALONE
    cfg = config_from_dict({
        "name": f"{preset}-{strategy}-s{seed}", "cluster": preset,
        "workload": {"model": "cnn", "dataset": "mnist1d"},
        "strategy": {"name": "ddp" if alone else strategy, **options}, "train": {"seed": seed},
        "stop": {"max_epochs": epochs, "target_accuracy": target}})
    if alone:
        cfg = fastest_alone(cfg)
    r = run_config(cfg, runs_root=None)
    s = r.summary
    last_epoch = [row["test_accuracy"] for row in r.rows if row["epoch"] > epochs - 1 + 1e-9]
    return {"preset": preset, "strategy": strategy, "seed": seed, "tta_s": s["tta_s"],
            "time_s": s["time_s"], "final_accuracy": s["final_accuracy"],
            "last_epoch_accuracy": statistics.mean(last_epoch) if last_epoch else None,
            "hardware_efficiency": s["hardware_efficiency"], "epochs": s["epochs"],
            "strategy_stats": s["strategy_stats"],
            "curve": [(row["time_s"], row["test_accuracy"]) for row in r.rows]}


def med(xs: list[float]) -> str:
    """Median (min-max) over the seeds that reached the target (this file's published
    policy, see benchmarks/common.py)."""
    s = spread(xs)
    if s is None:
        return "n/a"
    return f"{s[0]:.3g} ({s[1]:.3g}-{s[2]:.3g})"


def summarise(runs: list[dict[str, Any]], presets: list[str], seeds: list[int]) -> list[dict]:
    rows = []
    by = {(r["preset"], r["strategy"], r["seed"]): r for r in runs}
    for p in presets:
        for name, _ in STRATEGIES:
            mine = [by[(p, name, s)] for s in seeds]
            ddp = [by[(p, "ddp", s)] for s in seeds]
            speedup = [d["tta_s"] / m["tta_s"] for m, d in zip(mine, ddp, strict=True)
                       if m["tta_s"] and d["tta_s"]]
            gap = [100 * (m["final_accuracy"] - d["final_accuracy"])
                   for m, d in zip(mine, ddp, strict=True)]
            gap_last = [100 * (m["last_epoch_accuracy"] - d["last_epoch_accuracy"])
                        for m, d in zip(mine, ddp, strict=True)]
            rows.append({"preset": p, "strategy": name, "tta_s": [m["tta_s"] for m in mine],
                         "speedup_vs_ddp": speedup, "reached": sum(bool(m["tta_s"]) for m in mine),
                         "final_accuracy": [m["final_accuracy"] for m in mine],
                         "final_gap_points": gap,
                         "last_epoch_accuracy": [m["last_epoch_accuracy"] for m in mine],
                         "last_epoch_gap_points": gap_last,
                         "hardware_efficiency": [m["hardware_efficiency"] for m in mine]})
    return rows


def plot(runs: list[dict[str, Any]], presets: list[str], seed: int, target: float,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(presets), figsize=(4.6 * len(presets), 3.8), squeeze=False)
    for ax, p in zip(axes[0], presets, strict=True):
        for r in runs:
            if r["preset"] == p and r["seed"] == seed:
                t, acc = zip(*r["curve"], strict=True)
                ax.plot(t, acc, marker=".", markersize=3,
                        label=f"{r['strategy']} (HW eff {r['hardware_efficiency']:.2f})")
        ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.set(xscale="log", xlabel="virtual time (s, simulated)", ylabel="test accuracy",
               title=f"{p}, MNIST-1D CNN, seed {seed}", ylim=(0, 1))
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=float, default=12.0)
    ap.add_argument("--target", type=float, default=0.85)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--presets", nargs="+", default=["hetero-4", "hetero-8", "geo-16"])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="cadp_tta", help="file stem under benchmarks/results/")
    args = ap.parse_args()
    jobs = [(p, name, opts, s, args.epochs, args.target)
            for p in args.presets for s in args.seeds for name, opts in STRATEGIES]
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        runs = []
        for r in pool.map(one_run, jobs):
            runs.append(r)
            print(r["preset"], r["strategy"], r["seed"], r["tta_s"], r["final_accuracy"],
                  round(r["hardware_efficiency"], 3), flush=True)
    rows = summarise(runs, args.presets, args.seeds)
    cmd = " ".join([".venv/bin/python", *sys.argv])
    OUT.mkdir(exist_ok=True)
    (OUT / f"{args.out}.json").write_text(json.dumps(
        {"command": cmd, "epochs": args.epochs, "target_accuracy": args.target,
         "seeds": args.seeds, "summary": rows, "runs": runs}, indent=1))
    plot(runs, args.presets, args.seeds[0], args.target, OUT / f"{args.out}.png")
    lines = [f"<!-- made by: {cmd} -->",
             "# C-ADP vs DDP vs local SGD vs the fastest device alone: time-to-accuracy "
             "(simulated)", "",
             f"Command: `{cmd}`. Simulator (virtual clock, real gradients); MNIST-1D CNN, "
             f"{args.epochs:g} epochs, target test accuracy {args.target}, seeds {args.seeds}; "
             "median (min-max) over seeds. Speed-up = ddp TTA / strategy TTA per seed; gaps in "
             "accuracy points vs ddp (final = last evaluation; last epoch = mean of the last "
             "epoch's evaluations). fastest-alone: the preset's fastest device training by "
             "itself (one device, same batch and learning rate).", "",
             "| preset | strategy | TTA s | speed-up vs ddp | final acc | gap (pts) | "
             "last-epoch acc | gap (pts) | HW efficiency |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        reached = "" if r["reached"] == len(args.seeds) else f" [{r['reached']} reached]"
        lines.append(f"| {r['preset']} | {r['strategy']} | {med(r['tta_s'])}{reached} | "
                     f"{med(r['speedup_vs_ddp'])} | {med(r['final_accuracy'])} | "
                     f"{med(r['final_gap_points'])} | {med(r['last_epoch_accuracy'])} | "
                     f"{med(r['last_epoch_gap_points'])} | {med(r['hardware_efficiency'])} |")
    stats = {r["preset"]: r["strategy_stats"] for r in runs
             if r["strategy"] == "cadp" and r["seed"] == args.seeds[0]}
    lines += ["", f"cadp's plan per preset (seed {args.seeds[0]}):", ""]
    for p, s in stats.items():
        lines.append(f"- {p}: H = {s['local_steps']}, mean batch {s['mean_batch']}, global batch "
                     f"{s['global_batch']}, lr x{s['lr_scale']:.2f}, round {s['planned_round_s']:.3f}"
                     f" s, planned efficiency {s['planned_efficiency']:.3f}, shares "
                     f"{s['shares']}")
    lines += ["", f"![time to accuracy]({args.out}.png)"]
    (OUT / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
