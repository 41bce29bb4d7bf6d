"""`hetrain plan`: the AutoDDL plan per layer vs pure data parallel (--cluster, --model), or the
auto strategy's time-to-accuracy plan for a run config, explained in words (--goodput)."""

from __future__ import annotations

import argparse
import dataclasses

from hetrain.cli.output import Output
from hetrain.config import StrategyConfig, load_config
from hetrain.parallel.cli_plan import add_plan_arguments, plan_from_args
from hetrain.validate import check_number, non_negative


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="search a data/tensor/pipeline parallel plan (AutoDDL), or "
                       "explain the auto strategy's plan for a config (--goodput)",
                       description="Search SBP placements per layer with the analytical cost "
                       "model and coordinate descent; print the plan, its predicted step time "
                       "and memory, and the data-parallel baseline's. With --goodput [CONFIG]: "
                       "the devices, PS site, global batch, local steps and lr the auto "
                       "strategy starts with on that config (default: the demo), and why.")
    add_plan_arguments(p)
    p.add_argument("--goodput", nargs="?", const="demo", default=None, metavar="CONFIG",
                   help="explain the auto strategy's plan for a run config (default: the demo)")
    p.add_argument("--noise-scale", type=float, default=0.0,
                   help="--goodput: plan at this gradient noise scale (default: the prior, "
                   "train.batch_size with SGD, the smallest batch with Adam-type optimizers; "
                   "a run measures it as it trains)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.goodput is None:
        return plan_from_args(args, console=Output(quiet=False, as_json=False).console)
    return explain_goodput(args.goodput, args.noise_scale, as_json=args.json)


def explain_goodput(config: str, noise_scale: float = 0.0, as_json: bool = False) -> int:
    from hetrain.cli.run import demo_config
    from hetrain.engine.setup import prepare
    from hetrain.strategies.auto import Auto

    check_number("--noise-scale", noise_scale, non_negative(1e12), "0: the prior")
    cfg = demo_config() if config == "demo" else load_config(config)
    options = dict(cfg.strategy.options) if cfg.strategy.name == "auto" else {}
    if noise_scale:
        options["noise_scale"] = noise_scale
    cfg = dataclasses.replace(cfg, strategy=StrategyConfig("auto", options))
    prep = prepare(cfg)
    assert isinstance(prep.strategy, Auto)  # the config names it
    plan, lines = prep.strategy.explain_plan(prep.cluster, prep.ctx.flops_per_sample)
    lone = plan.alternatives["fastest device alone"]
    out = Output(quiet=False, as_json=as_json)
    out.json({"ps_site": plan.ps_site, "global_batch": plan.global_batch,
              "local_steps": plan.local_steps, "lr_scale": plan.lr_scale,
              "devices": [prep.cluster.devices[j].name for j in plan.active],
              "batches": list(plan.batches()), "goodput": plan.goodput,
              "goodput_fastest_alone": lone, "explanation": lines})
    out.print(f"auto plan for {cfg.name} on {prep.cluster.name}:")
    for line in lines:
        out.print(f"  {line}")
    return 0
