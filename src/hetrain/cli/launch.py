"""`hetrain launch CONFIG.toml`: train a config on the real engine (torch.distributed).

One machine: hetrain spawns the server (rank 0) and one worker process per device on
127.0.0.1 (`--nproc` = devices + dist.ps_shards, i.e. devices + 1 by default; a free port
unless `--port`). Several machines: give
`--nnodes/--node-rank/--rdzv-endpoint` and it runs torchrun with c10d rendezvous on this node
(the same command on every node, with its own --node-rank and --nproc-per-node).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import subprocess
import sys

from hetrain.cli.output import Output
from hetrain.cli.run import apply_overrides
from hetrain.cluster import load_cluster
from hetrain.config import RunConfig, load_config
from hetrain.engine import auth
from hetrain.errors import ConfigError
from hetrain.report.table import comparison_table
from hetrain.runner import run_config
from hetrain.validate import MAX_DEVICES, check_number, integer, preflight


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="train a config on real processes (torch.distributed)",
                       description="Run a config with engine = 'dist': rank 0 is the parameter "
                       "server / coordinator, ranks 1..n the workers (one per cluster device).")
    p.add_argument("config", help="run config TOML")
    p.add_argument("--nproc", type=int, default=0,
                   help="processes on this machine: devices + dist.ps_shards (default: "
                   "from the cluster)")
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    p.add_argument("--resume", action="store_true",
                   help="continue from runs/<name>/checkpoint.pt")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set dist.time_scale=0.25")
    p.add_argument("--runs-dir", default="runs", help="where runs/<name>/ is written")
    p.add_argument("--quiet", action="store_true", help="no progress or tables")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    multi = p.add_argument_group("several machines (torchrun, c10d rendezvous)")
    multi.add_argument("--nnodes", type=int, default=1, help="number of machines")
    multi.add_argument("--node-rank", type=int, default=0, help="this machine's index")
    multi.add_argument("--nproc-per-node", type=int, default=0,
                       help="processes on this machine (node 0 includes the server)")
    multi.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT",
                       help="rendezvous endpoint on node 0")
    multi.add_argument("--rdzv-id", default="hetrain", help="job id shared by all nodes")
    multi.add_argument("--dry-run", action="store_true", help="print the torchrun command only")
    p.set_defaults(func=main)


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """The torchrun line this node runs (rank 0 lives on node 0, local rank 0)."""
    if not args.rdzv_endpoint:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
    if args.nproc_per_node < 1:
        raise ConfigError("--nnodes > 1 needs --nproc-per-node N (this node's processes)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.nnodes),
           "--nproc-per-node", str(args.nproc_per_node), "--node-rank", str(args.node_rank),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint,
           "--rdzv-id", args.rdzv_id, "--local-ranks-filter", "0",
           "-m", "hetrain", "run", "--engine", "dist", "--no-plot",
           "--runs-dir", args.runs_dir, args.config]
    for item in args.set:
        cmd += ["--set", item]
    if args.resume:
        cmd += ["--set", "dist.resume=true"]
    return cmd


def prepare_config(args: argparse.Namespace) -> RunConfig:
    cfg = apply_overrides(load_config(args.config), args.set)
    dist_cfg = cfg.dist
    if args.port is not None:
        dist_cfg = dataclasses.replace(dist_cfg, port=args.port)
    if args.resume:
        dist_cfg = dataclasses.replace(dist_cfg, resume=True)
    cfg = dataclasses.replace(cfg, engine="dist", dist=dist_cfg)
    if args.nproc:
        n, shards = load_cluster(cfg.cluster).n, cfg.dist.ps_shards
        if args.nproc != n + shards:
            raise ConfigError(f"--nproc {args.nproc}: the cluster '{cfg.cluster}' has {n} "
                              f"devices and dist.ps_shards = {shards}, so the run needs "
                              f"{n + shards} processes (one per device + one per PS shard); "
                              f"use --nproc {n + shards} or a cluster of "
                              f"{args.nproc - shards} devices")
    return cfg


def main(args: argparse.Namespace) -> int:
    check_number("--nnodes", args.nnodes, integer(1, MAX_DEVICES))
    check_number("--node-rank", args.node_rank, integer(0, args.nnodes - 1),
                 "node 0 hosts the server; the others are 1 .. --nnodes - 1")
    check_number("--nproc", args.nproc, integer(0, MAX_DEVICES + 1024), "0: from the cluster")
    check_number("--nproc-per-node", args.nproc_per_node, integer(0, MAX_DEVICES + 1024))
    if args.nnodes > 1:
        cmd = torchrun_command(args)
        if args.dry_run:
            print(shlex.join(cmd))
            return 0
        if not auth.configured_secret():  # every node must prove the same one
            raise ConfigError(f"--nnodes > 1 needs the run's secret on every node: "
                              f"{auth.HOW_TO_SET} (or {auth.ENV_SECRET_FILE}=PATH)")
        return subprocess.call(cmd)
    cfg = prepare_config(args)
    preflight(cfg, args.runs_dir)
    out = Output(args.quiet, args.json)
    with out.progress(f"{cfg.name} [{cfg.strategy.name}, dist]") as progress:
        result = run_config(cfg, runs_root=args.runs_dir, progress=progress)
    out.print(comparison_table([result]))
    out.json([result.summary])
    return 0
