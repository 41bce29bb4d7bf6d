"""Strategies (ASHL vs ADSP by default; any of ashl_bench's, and the fastest device alone),
each at its own best setting (simulated).

`ashl_bench.py` runs every strategy at one learning rate. That favours whichever strategy the
rate happens to suit, so this benchmark tunes it per strategy and keeps selection and
evaluation apart: phase 1 runs every strategy at every setting of the grid on the selection
seeds and picks, per (cluster, strategy), the setting that misses the target (then the high
target) on the fewest seeds, then has the lowest median time to the target (then to the high
target, then the best final figure); phase 2 reruns each strategy at its picked setting on
held-out seeds, and the ratios are taken per held-out seed. Same simulator, workloads,
targets and stopping rule as `ashl_bench.py` (`--epochs` shortens the runs).

`--grid OPTION=V1,V2,...` (repeatable) adds strategy options to the search, for the
strategies that have that option (the others run at their default): e.g. ASHL's and ADSP's
`commit_weight` (a server-side step size), or C-ADP's `batch_size` and `local_steps`.

    .venv/bin/python benchmarks/ashl_tuned.py --workload mnist1d-cnn   # about 20 minutes
    .venv/bin/python benchmarks/ashl_tuned.py --clusters hetero-8 --strategies ashl adsp \
        --lrs 0.05 0.1 --grid commit_weight=0.7,1,1.4 \
        --out benchmarks/results/ashl_tuned_commit_weight
    .venv/bin/python benchmarks/ashl_tuned.py --strategies cadp ddp fastest-alone \
        --lrs 0.05 0.1 0.2 --grid batch_size=0,8,16 --grid local_steps=0,1 \
        --grid lr_scaling=none --epochs 6 --out benchmarks/results/cadp_tuned
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

from ashl_bench import (
    FASTEST_ALONE,
    HIGH_TARGETS,
    STRATEGIES,
    TARGETS,
    WORKLOADS,
    _fmt,
    _summ,
    add_ttas,
    run_one,
)

from hetrain.strategies.registry import strategy_options

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


Setting = dict[str, float | int | str]
"""One point of the search: {"lr": ..., strategy option: value, ...}."""
Job = tuple[str, str, str, int, dict[str, Any]]


def _label(setting: Setting) -> str:
    return ", ".join(f"{k} {v:g}" if isinstance(v, float | int) else f"{k} {v}"
                     for k, v in setting.items())


def _value(text: str) -> float | int | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _options_of(label: str) -> set[str]:
    """The strategy options a benchmark label can be searched over."""
    spec = STRATEGIES[label]
    return set() if spec.get(FASTEST_ALONE) else set(strategy_options(spec["strategy"]["name"]))


def parse_grid(items: list[str]) -> dict[str, list[float | int | str]]:
    """["batch_size=8,16", "lr_scaling=none"] -> {"batch_size": [8, 16], ...}."""
    grid: dict[str, list[float | int | str]] = {}
    for item in items:
        name, _, values = item.partition("=")
        if not name or not values:
            raise SystemExit(f"--grid {item!r}: expected OPTION=V1,V2,...")
        grid[name] = [_value(v) for v in values.split(",")]
    return grid


def settings_for(label: str, lrs: tuple[float, ...],
                 grid: dict[str, list[float | int | str]]) -> list[Setting]:
    """Every combination of the learning rates and the grid options `label` has."""
    out: list[Setting] = [{"lr": lr} for lr in lrs]
    for name, values in grid.items():
        if name in _options_of(label):
            out = [{**s, name: v} for s in out for v in values]
    return out


def _overrides(setting: Setting, epochs: float | None) -> dict[str, Any]:
    options = {k: v for k, v in setting.items() if k != "lr"}
    return ({"optimizer": {"lr": setting["lr"]}} | ({"strategy": options} if options else {})
            | ({"stop": {"max_epochs": epochs}} if epochs else {}))


def _run(pool: Any, jobs: list[tuple[Job, Setting]]) -> list[dict]:
    out = []
    for (_, setting), r in zip(jobs, pool.imap(run_one, [j for j, _ in jobs]), strict=True):
        r = _with_ttas(r)
        r["setting"] = setting
        out.append(r)
        print(f"[{len(out)}/{len(jobs)}] {r['cluster']} {r['strategy']} s{r['seed']} "
              f"{_label(setting)}: tta {r['tta_s']} high {r['tta_high_s']} "
              f"acc {r['final_accuracy']:.3f} loss {r['final_loss']:.3f}", flush=True)
    return out


def _cell(values: list[float | None]) -> str:
    return _fmt(_summ(values))


def _rank(rs: list[dict[str, Any]]) -> tuple[float, ...]:
    """A setting's rank over the selection seeds, lower is better: first how many seeds miss
    the target, then the high one (a setting that diverges on one seed in three is not
    picked for its fast median), then the median scores."""
    misses = (sum(r["tta_s"] is None for r in rs), sum(r["tta_high_s"] is None for r in rs))
    return misses + tuple(statistics.median(x) for x in zip(*map(_score, rs), strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="mnist1d-cnn", choices=list(WORKLOADS))
    ap.add_argument("--clusters", nargs="+", default=["hetero-8", "geo-16"])
    ap.add_argument("--strategies", nargs="+", default=["adsp", "ashl", "fastest-alone"],
                    choices=list(STRATEGIES))
    ap.add_argument("--lrs", type=float, nargs="+", default=None)
    ap.add_argument("--grid", action="append", default=[], metavar="OPTION=V1,V2,...")
    ap.add_argument("--epochs", type=float, default=None,
                    help="train this many epochs instead of the workload's default")
    ap.add_argument("--select-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--eval-seeds", type=int, nargs="+", default=[3, 4, 5])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    lrs = tuple(args.lrs or GRIDS[args.workload])
    grid = parse_grid(args.grid)
    unused = [k for k in grid if not any(k in _options_of(s) for s in args.strategies)]
    if unused:
        raise SystemExit(f"--grid {unused}: none of {args.strategies} has such an option")
    out = Path(args.out or f"benchmarks/results/ashl_tuned_{args.workload.split('-')[0]}")
    t0 = time.perf_counter()
    space = {(c, s): settings_for(s, lrs, grid) for c in args.clusters for s in args.strategies}

    def jobs(seeds: list[int], plan: dict[tuple[str, str], list[Setting]]) -> list:
        return [((c, args.workload, s, seed, _overrides(setting, args.epochs)), setting)
                for (c, s), settings in plan.items() for setting in settings for seed in seeds]

    with get_context("spawn").Pool(args.jobs) as pool:
        sweep = _run(pool, jobs(args.select_seeds, space))
        picked = {key: min(settings, key=lambda st, key=key: _rank(
                      [r for r in sweep if (r["cluster"], r["strategy"]) == key
                       and r["setting"] == st]))
                  for key, settings in space.items()}
        held = _run(pool, jobs(args.eval_seeds, {k: [v] for k, v in picked.items()}))
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    result = {"title": "Strategies at their tuned settings (simulated)", "command": command,
              "workload": args.workload, "clusters": args.clusters, "lrs": lrs, "grid": grid,
              "epochs": args.epochs or WORKLOADS[args.workload]["stop"]["max_epochs"],
              "select_seeds": args.select_seeds, "eval_seeds": args.eval_seeds,
              "picked": {f"{c}/{s}": st for (c, s), st in picked.items()},
              "sweep": sweep, "held_out": held, "wall_s": time.perf_counter() - t0}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(to_markdown(result))
    print(to_markdown(result))
    return 0


def _setting_of(r: dict[str, Any]) -> Setting:
    return r.get("setting") or {"lr": r["lr"]}  # results from before the grid had lr only


def to_markdown(res: dict[str, Any]) -> str:
    w = res["workload"]
    by_loss = "target_loss" in WORKLOADS[w]["stop"]
    final_key = "final_loss" if by_loss else "final_accuracy"
    final = final_key.replace("_", " ")
    picked = res.get("picked") or {k: {"lr": v} for k, v in res["picked_lr"].items()}
    searched = "".join(f"; {k} {', '.join(map(str, vs))}" for k, vs in res.get("grid", {}).items())
    epochs = res.get("epochs", WORKLOADS[w]["stop"]["max_epochs"])
    lines = [f"Command: `{res['command']}`", "", f"# {res['title']}", "",
             f"{w}, {epochs:g} epochs; learning rates "
             f"{', '.join(f'{x:g}' for x in res['lrs'])}{searched} (each "
             "strategy over the options it has); picked on seeds "
             f"{res['select_seeds']} (fewest seeds missing a target, then lowest median TTA, "
             f"TTA high, final figure), reported on held-out seeds {res['eval_seeds']}. "
             "Median [min..max].", ""]
    for c in res["clusters"]:
        t, hi = TARGETS[(w, c)], HIGH_TARGETS[(w, c)]
        lines += [f"## {c} (TTA target {t}, high target {hi})", "",
                  "Phase 1, selection seeds:", "",
                  f"| strategy | setting | TTA s | TTA high s | {final} | picked |",
                  "|---|---|---|---|---|---|"]
        strategies = sorted({r["strategy"] for r in res["sweep"] if r["cluster"] == c})
        for s in strategies:
            mine = [r for r in res["sweep"] if (r["cluster"], r["strategy"]) == (c, s)]
            settings: list[Setting] = []
            for st in map(_setting_of, mine):
                if st not in settings:
                    settings.append(st)
            for st in settings:
                rs = [r for r in mine if _setting_of(r) == st]
                mark = "yes" if st == picked[f"{c}/{s}"] else ""
                lines.append(f"| {s} | {_label(st)} | {_cell([r['tta_s'] for r in rs])} | "
                             f"{_cell([r['tta_high_s'] for r in rs])} | "
                             f"{_cell([r[final_key] for r in rs])} | {mark} |")
        lines += ["", "Phase 2, held-out seeds, each strategy at its picked setting:", "",
                  f"| strategy | setting | TTA s | TTA high s | {final} |",
                  "|---|---|---|---|---|"]
        held = {(r["strategy"], r["seed"]): r for r in res["held_out"] if r["cluster"] == c}
        for s in strategies:
            rs = [r for (st, _), r in held.items() if st == s]
            lines.append(f"| {s} | {_label(picked[f'{c}/{s}'])} | "
                         f"{_cell([r['tta_s'] for r in rs])} | "
                         f"{_cell([r['tta_high_s'] for r in rs])} | "
                         f"{_cell([r[final_key] for r in rs])} |")
        lines += ["", "Per held-out seed:", ""]
        others = [s for s in strategies if s != "fastest-alone"]
        pairs = [(a, b) for i, a in enumerate(others) for b in others[i + 1:]]
        if "fastest-alone" in strategies:
            pairs += [("fastest-alone", s) for s in others]
        for a, b in pairs:
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
