"""ASHL vs ADSP (and the fastest device alone), each at its own best learning rate (simulated).

`ashl_bench.py` runs every strategy at one learning rate. That favours whichever strategy the
rate happens to suit, so this benchmark tunes it per strategy and keeps selection and
evaluation apart: phase 1 runs every strategy at every rate of the grid on the selection
seeds and picks, per (cluster, strategy), the rate with the lowest median time to the target
(then to the high target, then the best final figure); phase 2 reruns each strategy at its
picked rate on held-out seeds, and the ratios are taken per held-out seed. Same simulator,
workloads, targets and stopping rule as `ashl_bench.py`.

    .venv/bin/python benchmarks/ashl_tuned.py --workload mnist1d-cnn   # about 20 minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from ashl_bench import HIGH_TARGETS, TARGETS, WORKLOADS, _fmt, _summ, add_ttas, run_one

GRIDS = {"mnist1d-cnn": (0.05, 0.07, 0.1, 0.14), "text-gpt": (1.5e-3, 3e-3, 6e-3)}
"""Learning rates tried (SGD with momentum 0.9 for the CNN, AdamW for the GPT); the middle
of each grid is the rate `ashl_bench.py` uses for everyone."""


def _score(r: dict[str, Any]) -> tuple[float, float, float]:
    """Lower is better: TTA, then TTA to the high target, then minus the final figure."""
    inf = float("inf")
    by_loss = "target_loss" in WORKLOADS[r["workload"]]["stop"]
    final = -r["final_loss"] if by_loss else r["final_accuracy"]
    return (r["tta_s"] if r["tta_s"] is not None else inf,
            r["tta_high_s"] if r["tta_high_s"] is not None else inf, -final)


def _with_ttas(r: dict[str, Any]) -> dict[str, Any]:
    add_ttas(r).pop("curve")  # the curves stay in ashl_bench's results; here only the TTAs
    return r


def _run(pool: Any, jobs: list[tuple[str, str, str, int, dict[str, Any]]]) -> list[dict]:
    out = []
    for r in pool.imap_unordered(run_one, jobs):
        out.append(_with_ttas(r))
        print(f"[{len(out)}/{len(jobs)}] {r['cluster']} {r['strategy']} s{r['seed']} "
              f"lr {r['lr']:g}: tta {r['tta_s']} high {r['tta_high_s']} "
              f"acc {r['final_accuracy']:.3f} loss {r['final_loss']:.3f}", flush=True)
    return out


def _cell(values: list[float | None]) -> str:
    return _fmt(_summ(values))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="mnist1d-cnn", choices=list(WORKLOADS))
    ap.add_argument("--clusters", nargs="+", default=["hetero-8", "geo-16"])
    ap.add_argument("--strategies", nargs="+", default=["adsp", "ashl", "fastest-alone"])
    ap.add_argument("--lrs", type=float, nargs="+", default=None)
    ap.add_argument("--select-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--eval-seeds", type=int, nargs="+", default=[3, 4, 5])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    lrs = tuple(args.lrs or GRIDS[args.workload])
    out = Path(args.out or f"benchmarks/results/ashl_tuned_{args.workload.split('-')[0]}")
    t0 = time.perf_counter()

    def jobs(seeds: list[int], lr_of: dict[tuple[str, str], tuple[float, ...]]) -> list:
        return [(c, args.workload, s, seed, {"optimizer": {"lr": lr}})
                for c in args.clusters for s in args.strategies for lr in lr_of[(c, s)]
                for seed in seeds]

    with get_context("spawn").Pool(args.jobs) as pool:
        grid = {(c, s): lrs for c in args.clusters for s in args.strategies}
        sweep = _run(pool, jobs(args.select_seeds, grid))
        picked: dict[tuple[str, str], float] = {}
        for c in args.clusters:
            for s in args.strategies:
                def med(lr: float, c: str = c, s: str = s) -> tuple[float, ...]:
                    rs = [r for r in sweep if (r["cluster"], r["strategy"], r["lr"])
                          == (c, s, lr)]
                    return tuple(statistics.median(x) for x in zip(*map(_score, rs),
                                                                    strict=True))
                picked[(c, s)] = min(lrs, key=med)
        held = _run(pool, jobs(args.eval_seeds, {k: (v,) for k, v in picked.items()}))
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    result = {"title": "ASHL vs ADSP at tuned learning rates (simulated)", "command": command,
              "workload": args.workload, "clusters": args.clusters, "lrs": lrs,
              "select_seeds": args.select_seeds, "eval_seeds": args.eval_seeds,
              "picked_lr": {f"{c}/{s}": lr for (c, s), lr in picked.items()},
              "sweep": sweep, "held_out": held, "wall_s": time.perf_counter() - t0}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(to_markdown(result))
    print(to_markdown(result))
    return 0


def to_markdown(res: dict[str, Any]) -> str:
    w = res["workload"]
    by_loss = "target_loss" in WORKLOADS[w]["stop"]
    final_key = "final_loss" if by_loss else "final_accuracy"
    lines = [f"Command: `{res['command']}`", "", f"# {res['title']}", "",
             f"{w}; learning rates {', '.join(f'{x:g}' for x in res['lrs'])}; picked on seeds "
             f"{res['select_seeds']} (lowest median TTA), reported on held-out seeds "
             f"{res['eval_seeds']}. Median [min..max].", ""]
    for c in res["clusters"]:
        t, hi = TARGETS[(w, c)], HIGH_TARGETS[(w, c)]
        lines += [f"## {c} (TTA target {t}, high target {hi})", "",
                  "Phase 1, selection seeds (median TTA s per learning rate):", "",
                  "| strategy | " + " | ".join(f"lr {x:g}" for x in res["lrs"]) + " | picked |",
                  "|---|" + "---|" * (len(res["lrs"]) + 1)]
        strategies = sorted({r["strategy"] for r in res["sweep"] if r["cluster"] == c})
        for s in strategies:
            cells = []
            for lr in res["lrs"]:
                rs = [r for r in res["sweep"] if (r["cluster"], r["strategy"], r["lr"])
                      == (c, s, lr)]
                cells.append(_cell([r["tta_s"] for r in rs]))
            lines.append(f"| {s} | " + " | ".join(cells) + f" | {res['picked_lr'][f'{c}/{s}']:g} |")
        lines += ["", "Phase 2, held-out seeds, each strategy at its picked learning rate:", "",
                  f"| strategy | lr | TTA s | TTA high s | {final_key.replace('_', ' ')} |",
                  "|---|---|---|---|---|"]
        held = {(r["strategy"], r["seed"]): r for r in res["held_out"] if r["cluster"] == c}
        for s in strategies:
            rs = [r for (st, _), r in held.items() if st == s]
            lines.append(f"| {s} | {res['picked_lr'][f'{c}/{s}']:g} | "
                         f"{_cell([r['tta_s'] for r in rs])} | "
                         f"{_cell([r['tta_high_s'] for r in rs])} | "
                         f"{_cell([r[final_key] for r in rs])} |")
        lines += ["", "Per held-out seed:", ""]
        for a, b in (("adsp", "ashl"), ("fastest-alone", "ashl"), ("fastest-alone", "adsp")):
            for key, what in (("tta_s", "TTA"), ("tta_high_s", "TTA high")):
                ratios = []
                for seed in res["eval_seeds"]:
                    ra, rb = held.get((a, seed)), held.get((b, seed))
                    if ra is None or rb is None:
                        continue
                    ratios.append(ra[key] / rb[key] if ra[key] and rb[key] else None)
                if ratios:
                    lines.append(f"- {what} {a} / {b}: {_cell(ratios)}")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
