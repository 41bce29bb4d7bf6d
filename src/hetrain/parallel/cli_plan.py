"""`hetrain plan --cluster C --model M`: search an SBP plan and print it with its prediction.

Wiring (cli.py): `add_plan_arguments(subparsers.add_parser("plan", help=...))`, then on that
sub-command `return plan_from_args(args)`. ConfigErrors propagate for the CLI to print.
The planner needs no torch.distributed; only graphs traced from other models import torch.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from hetrain.cluster import load_cluster
from hetrain.errors import ConfigError
from hetrain.plan.cost import CostOptions, CostReport, plan_summary
from hetrain.plan.graph import LayerGraph, gpt_graph, graph_from_module, vgg_graph
from hetrain.plan.search import SearchOptions, SearchResult, search_plan
from hetrain.validate import check_limits, check_number, check_output_file, integer, non_negative

TRACE_MAX_INPUT = 10**6
"""mlp and cnn are built and traced in memory: the largest input (values per sample)..."""
TRACE_MAX_BATCH = 10**8
"""...and batch x input values they are traced on."""
GPT_DEFAULTS = dict(n_layer=2, n_embd=64, n_head=2, vocab=96, block_size=64)
VGG_DEFAULTS = dict(image="3,32,32", width=16, convs="1,1,2", fc=128, num_classes=10)


def _parse_options(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for it in items:
        key, sep, value = it.partition("=")
        if not sep or not key:
            raise ConfigError(f"--model-option '{it}' must look like key=value, e.g. n_layer=12")
        out[key.strip()] = value.strip()
    return out


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace("x", ",").split(",") if x)


def model_graph(model: str, batch: int, options: dict[str, str]) -> LayerGraph:
    """The layer graph of a built-in model: gpt and vgg from their descriptions, mlp and cnn
    traced from hetrain.workloads (with options input_shape=..., num_classes=...)."""
    def pick(defaults: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(options) - set(defaults))
        if unknown:
            raise ConfigError(f"unknown model option(s) {unknown} for '{model}'; "
                              f"allowed: {sorted(defaults)}")
        return {**defaults, **options}

    def check(o: dict[str, Any]) -> dict[str, Any]:
        check_limits("plan", model, o, "--model-option")
        return o

    try:
        if model == "gpt":
            o = check({k: int(v) for k, v in pick(GPT_DEFAULTS).items()})
            if o["n_embd"] % o["n_head"]:
                raise ConfigError(f"--model-option: gpt n_embd ({o['n_embd']}) must be "
                                  f"divisible by n_head ({o['n_head']})")
            return gpt_graph(o["n_layer"], o["n_embd"], o["n_head"], o["vocab"], o["block_size"], batch)
        if model == "vgg":
            o = pick(VGG_DEFAULTS)
            image = _ints(str(o["image"]))
            if len(image) != 3:
                raise ConfigError(f"vgg: image must be C,H,W, got '{o['image']}'")
            o = check({"image": image, "width": int(o["width"]), "convs": _ints(str(o["convs"])),
                       "fc": int(o["fc"]), "num_classes": int(o["num_classes"])})
            return vgg_graph(batch, (image[0], image[1], image[2]), o["width"], o["convs"],
                             o["fc"], o["num_classes"])
        if model in ("mlp", "cnn"):
            import math

            import torch

            from hetrain.workloads import MODELS

            o = pick({"input_shape": "1,40", "num_classes": 10})
            shape = _ints(str(o["input_shape"]))
            check({"input_shape": shape, "num_classes": int(o["num_classes"])})
            if math.prod(shape) > TRACE_MAX_INPUT or batch * math.prod(shape) > TRACE_MAX_BATCH:
                raise ConfigError(f"--model {model} is traced on a real batch: batch {batch} x "
                                  f"input_shape {shape} is too large (at most "
                                  f"{TRACE_MAX_INPUT:,} values a sample and {TRACE_MAX_BATCH:,} "
                                  f"a batch); use a smaller --batch or input_shape")
            net = MODELS[model](shape, int(o["num_classes"]))
            return graph_from_module(net, torch.zeros(batch, *shape), name=model)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"bad model option for '{model}': {e}") from None
    raise ConfigError(f"hetrain plan: unknown model '{model}'; choose one of: gpt, vgg, mlp, cnn")


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", help="preset name or cluster TOML file")
    parser.add_argument("--model", help="gpt, vgg, mlp or cnn")
    parser.add_argument("--batch", type=int, default=32, help="global batch size (default 32)")
    parser.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                        help="model size, e.g. n_layer=12 n_embd=768 (gpt), width=32 (vgg)")
    parser.add_argument("--no-pipeline", action="store_true", help="do not consider pipelines")
    parser.add_argument("--no-subsets", action="store_true",
                        help="always use every device (no fastest-subset or single-site meshes)")
    parser.add_argument("--no-uneven", action="store_true",
                        help="do not consider uneven data-parallel batch shares")
    parser.add_argument("--restarts", type=int, default=4, help="coordinate-descent starts per mesh")
    parser.add_argument("--optimizer-states", type=float, default=2.0,
                        help="optimizer state bytes per parameter byte (Adam 2, SGD 0)")
    parser.add_argument("--calibration", default=None, metavar="SUMMARY_JSON",
                        help="search with a [parallel] run's start-up calibration (its "
                             "summary.json): the plan that run picked")
    parser.add_argument("--out", default=None, help="save the plan (.json or .toml) to replay it")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def plan_from_args(args: argparse.Namespace, console: Console | None = None) -> int:
    if not args.cluster or not args.model:
        raise ConfigError("hetrain plan needs --cluster and --model (a parallel plan), or "
                          "--goodput [CONFIG] (the auto strategy's time-to-accuracy plan)")
    return plan_command(args.cluster, args.model, batch=args.batch, model_options=args.model_option,
                        pipeline=not args.no_pipeline, subsets=not args.no_subsets,
                        uneven=not args.no_uneven, restarts=args.restarts, optimizer_states=args.optimizer_states,
                        calibration=args.calibration, out=args.out, as_json=args.json,
                        console=console)


def plan_command(cluster: str, model: str, *, batch: int = 32, model_options: Sequence[str] = (),
                 pipeline: bool = True, subsets: bool = True, uneven: bool = True,
                 restarts: int = 4,
                 optimizer_states: float = 2.0, calibration: str | None = None,
                 out: str | None = None, as_json: bool = False,
                 console: Console | None = None) -> int:
    """Search, print (tables or JSON), optionally save the plan; returns the exit code.
    `calibration`: a file read by calibrate.read_calibration (the cost model's corrections
    from a run's start-up microbenchmarks)."""
    check_number("--batch", batch, integer(1, 10**9))
    check_number("--restarts", restarts, integer(1, 100))
    check_number("--optimizer-states", optimizer_states, non_negative(100),
                 "optimizer state bytes per parameter byte: Adam 2, SGD+momentum 1, SGD 0")
    if out:
        check_output_file(out, "--out")
    options = CostOptions(optimizer_states=optimizer_states)
    if calibration:
        from hetrain.parallel.calibrate import cost_options, read_calibration

        calib = read_calibration(calibration)
        options = cost_options(calib, options, compute=bool(calib.get("compute", True)))
    cl = load_cluster(cluster)
    graph = model_graph(model, batch, _parse_options(model_options))
    res = search_plan(graph, cl, SearchOptions(restarts=restarts, pipeline=pipeline,
                                               subsets=subsets, uneven=uneven), options)
    if out:
        res.plan.save(out, plan_meta(graph, cl, model, _parse_options(model_options),
                                     optimizer_states))
    con = console or Console()
    if as_json:
        con.print_json(json.dumps(result_dict(res, cl.name)))
    else:
        _print_tables(con, res, graph, cl.name)
        if out:
            con.print(f"plan saved to {out}")
    return 0


def graph_digest(graph: LayerGraph) -> str:
    """A digest of what a plan depends on in its graph (op names, kinds, shapes, parameter
    sizes, batch): a plan file records it so that a run refuses a plan of another model."""
    import hashlib

    ops = [[o.name, o.kind, list(o.out_shape), list(o.weight_shape), o.param_bytes]
           for o in graph.ops]
    text = json.dumps({"batch": graph.batch, "ops": ops}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_meta(graph: LayerGraph, cluster: Any, model: str, options: dict[str, Any],
              optimizer_states: float) -> dict[str, Any]:
    """What a saved plan was searched for (Plan.save's `meta`)."""
    return {"model": model, "model_options": {k: str(v) for k, v in options.items()},
            "batch": graph.batch, "graph_digest": graph_digest(graph),
            "cluster": cluster.name, "devices": cluster.n,
            "optimizer_states": optimizer_states}


def result_dict(res: SearchResult, cluster: str) -> dict[str, Any]:
    return {"cluster": cluster, "graph": res.plan.graph, "plan": res.plan.to_dict(),
            "predicted": plan_summary(res.report), "data_parallel": plan_summary(res.baseline_report),
            "gain_over_data_parallel": res.gain, "search_time_s": res.search_time_s,
            "ops": [vars(o) for o in res.report.ops],
            "candidates": [{"candidate": d, "time_s": t, "fits": f} for d, t, f in res.candidates]}


_KIND = {"linear": "linear", "conv": "conv", "embedding": "embed", "layernorm": "norm",
         "attention": "attn", "elementwise": "elemwise", "reshape": "reshape", "add": "add",
         "cross_entropy": "loss"}


def _mb(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def _print_tables(con: Console, res: SearchResult, graph: LayerGraph, cluster: str) -> None:
    kinds = {op.name: op.kind for op in graph.ops}
    stage_of = {name: k for k, st in enumerate(res.plan.stages) for name in st.ops}
    t = Table(title=f"plan for {graph.name} (batch {graph.batch}) on {cluster}")
    t.add_column("op", no_wrap=True)
    for col in ("kind", "stage", "signature", "compute ms", "comm ms", "sync ms", "MiB"):
        t.add_column(col, justify="right" if "ms" in col or "MiB" in col else "left")
    for o in res.report.ops:
        t.add_row(o.name, _KIND[kinds[o.name]], str(stage_of[o.name]), o.signature,
                  f"{o.compute_s * 1e3:.3f}",
                  f"{o.comm_s * 1e3:.3f}", f"{o.sync_s * 1e3:.3f}", _mb(o.memory_bytes))
    con.print(t)
    s = Table(title="predicted per iteration")
    for col in ("plan", "layout", "time s", "memory MiB / device", "limit MiB", "fits"):
        s.add_column(col)
    for label, plan, rep in (("chosen", res.plan, res.report),
                             ("data parallel", res.baseline, res.baseline_report)):
        s.add_row(label, _layout(plan, rep), f"{rep.time_s:.4g}", _mb(rep.memory_bytes),
                  _mb(rep.memory_limit_bytes), "yes" if rep.feasible else "NO")
    con.print(s)
    con.print(f"predicted gain over data parallel: {res.gain:.2f}x; "
              f"searched {len(res.candidates)} candidates in {res.search_time_s:.2f} s")


def _layout(plan: Any, rep: CostReport) -> str:
    shares = plan.stages[0].shares
    stages = " | ".join(f"mesh {st.mesh.label} on devices {list(st.mesh.devices)}"
                        for st in plan.stages)
    if len(plan.stages) == 1:
        return stages + (f", batch shares {list(shares)} (uneven data parallel: per index of "
                         "mesh axis 0, by speed and memory)" if shares else "")
    per_stage = " | ".join(f"{t * 1e3:.3g}" for t in rep.stage_s)
    if shares:
        stages += (f", column shares {list(shares)} (column j, device j of every stage, runs "
                   "its own pipeline on its share: by speed and memory)")
    return (stages + f", {plan.n_micro} micro-batches of {per_stage} ms per stage"
            + (" in the slowest column" if shares else "") + f" (bubble {rep.bubble_s:.3g} s)")
