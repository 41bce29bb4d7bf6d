"""`hetrain run [CONFIG.toml]`: train one config (or the built-in demo) and report."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


from hetrain.baselines import FASTEST_ALONE, fastest_alone
from hetrain.cli.output import Output
from hetrain.config import RunConfig, StrategyConfig, config_from_dict, load_config
from hetrain.errors import ConfigError
from hetrain.report.metrics import RunResult
from hetrain.report.table import results_renderables
from hetrain.runner import run_config
from hetrain.strategies import REGISTRY
from hetrain.validate import check_runs_dir, preflight

DEMO_STRATEGIES = ("auto", "cadp", "ashl", "ddp")
"""Strategies the demo compares side by side (those registered in this build)."""


def demo_config() -> RunConfig:
    """The built-in default: hetero-8 preset, MNIST-1D CNN, target 90% test accuracy, every
    run evaluated every 0.5 (virtual) s so that time to accuracy compares runs whose steps
    differ in size (a lone device against a cluster) at the same granularity."""
    return config_from_dict({
        "name": "demo", "cluster": "hetero-8",
        "workload": {"model": "cnn", "dataset": "mnist1d"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"batch_size": 32, "seed": 0, "eval_every_s": 0.5},
        "stop": {"max_epochs": 5.0, "target_accuracy": 0.9},
    })


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train a config (no config: the built-in demo)",
                       description="Train one TOML config; with no config, run the built-in demo "
                       "(hetero-8 preset, MNIST-1D CNN, strategies side by side).")
    p.add_argument("config", nargs="?", help="run config TOML (see README: config reference)")
    p.add_argument("--compare", default="", metavar="S1,S2",
                   help="also run these strategies (default options) on the same config; "
                   f"'{FASTEST_ALONE}': the cluster's fastest device by itself")
    p.add_argument("--engine", choices=("sim", "dist"), help="override the config's engine")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set stop.max_epochs=2 (TOML value)")
    p.add_argument("--runs-dir", default="runs", help="where runs/<name>/ is written")
    p.add_argument("--resume", action="store_true",
                   help="continue from runs/<name>/checkpoint.pt (both engines; written when "
                   "a run ends, every train.checkpoint_every updates, on Ctrl-C/SIGTERM and "
                   "when a dist run loses the workers it needs)")
    p.add_argument("--port", type=int, default=None,
                   help="engine dist: rendezvous port on dist.master_addr (default: "
                   "dist.port, 0 = a free one)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress or tables")
    p.add_argument("--json", action="store_true", help="print the summaries as JSON on stdout")
    p.set_defaults(func=main)


def apply_overrides(cfg: RunConfig, items: list[str]) -> RunConfig:
    """Apply `section.key=value` overrides (value parsed as TOML)."""
    data = cfg.to_dict()
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. stop.max_epochs=2")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare string
        node: dict[str, Any] = data
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: '{part}' is not a section")
        node[last] = value
    return config_from_dict(data, registered_strategy=True)


def _compare_names(compare: str) -> list[str]:
    return [s.strip() for s in compare.split(",") if s.strip()]


def _variants(cfg: RunConfig, compare: str) -> list[RunConfig]:
    names = _compare_names(compare)
    if names and cfg.parallel is not None:
        raise ConfigError("--compare runs the config under other strategies, but a [parallel] "
                          "table replaces the strategy (each copy would run the same plan); "
                          "drop --compare, or remove the [parallel] table to compare "
                          "strategies")
    out = [cfg]
    for name in names:
        if name == FASTEST_ALONE:
            out.append(fastest_alone(cfg))
            continue
        if name not in REGISTRY:
            raise ConfigError(f"--compare: unknown strategy '{name}'; choose from "
                              f"{', '.join(sorted(REGISTRY))}, {FASTEST_ALONE}")
        out.append(dataclasses.replace(cfg, name=f"{cfg.name}-{name}",
                                       strategy=StrategyConfig(name, {})))
    return out


def main(args: argparse.Namespace) -> int:
    out = Output(args.quiet, args.json)
    if args.config:
        base = apply_overrides(load_config(args.config), args.set)
        configs = _variants(base, args.compare)
    else:
        base = apply_overrides(demo_config(), args.set)
        configs = [dataclasses.replace(base, name=f"{base.name}-{s}", strategy=StrategyConfig(s))
                   for s in DEMO_STRATEGIES if s in REGISTRY]
        configs += _variants(base, args.compare)[1:]
        if FASTEST_ALONE not in _compare_names(args.compare):
            configs.append(fastest_alone(base))
    if args.engine:
        configs = [dataclasses.replace(c, engine=args.engine) for c in configs]
    if args.resume:
        configs = [dataclasses.replace(c, train=dataclasses.replace(c.train, resume=True))
                   for c in configs]
    if args.port is not None:
        configs = [dataclasses.replace(c, dist=dataclasses.replace(c.dist, port=args.port))
                   for c in configs]
    for cfg in configs:  # every run's inputs, before the first one starts
        preflight(cfg, args.runs_dir)
    if not args.no_plot and len(configs) > 1:
        check_runs_dir(args.runs_dir, [base.name + "-report"])
    results: list[RunResult] = []
    for cfg in configs:
        label = "parallel" if cfg.parallel is not None else cfg.strategy.name
        with out.progress(f"{cfg.name} [{label}]") as progress:
            results.append(run_config(cfg, runs_root=args.runs_dir, progress=progress,
                                      quiet=args.quiet))
    if any("role" in r.summary for r in results):
        return 0  # a worker or PS-shard rank of a dist run: rank 0 reports the results
    for shown in results_renderables(results):
        out.print(shown)
    if not args.no_plot:
        write_plots(results, Path(args.runs_dir) / (base.name + "-report" if len(configs) > 1
                                                     else base.name), out)
    out.json([r.summary for r in results])
    return 0


def write_plots(results: list[RunResult], report_dir: Path, out: Output) -> None:
    """The time-to-accuracy, utilisation and noise-scale PNGs of finished runs (matplotlib
    is imported here: half a second that a --no-plot run, and every rank, need not pay)."""
    from hetrain.report.plots import plot_noise_scale, plot_time_to_accuracy, plot_utilisation

    report_dir.mkdir(parents=True, exist_ok=True)
    tta = plot_time_to_accuracy(results, report_dir / "time_to_accuracy.png")
    util = plot_utilisation(results, report_dir / "utilisation.png")
    noise = plot_noise_scale(results, report_dir / "noise_scale.png")
    out.print("plots: " + "  ".join(str(p) for p in (tta, util, noise) if p))
