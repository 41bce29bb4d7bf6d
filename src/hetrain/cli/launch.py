"""`hetrain launch CONFIG.toml`: train a config on the real engine (torch.distributed).

One machine: hetrain spawns the server (rank 0) and one worker process per device on
127.0.0.1 (`--nproc` = devices + dist.ps_shards, i.e. devices + 1 by default; a free port
unless `--port`). Several machines: the same command on every node with `--nnodes N
--node-rank R --nproc-per-node K[,K1,...] --master HOST0:PORT`; each node's supervisor
(hetrain.engine.nodes) starts its processes with a static rendezvous (no torchrun).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from hetrain.cli.output import Output
from hetrain.cli.run import apply_overrides, write_plots
from hetrain.cluster import Device, load_cluster
from hetrain.config import RunConfig, load_config
from hetrain.engine import auth, nodes
from hetrain.errors import ConfigError
from hetrain.report.table import results_renderables
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
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    multi = p.add_argument_group(
        "several machines", "the same command on every node, each with its own --node-rank; "
        "every node needs the run's secret (HETRAIN_SECRET or HETRAIN_SECRET_FILE)")
    multi.add_argument("--nnodes", type=int, default=1, help="number of machines")
    multi.add_argument("--node-rank", type=int, default=0,
                       help="this machine's index, 0..nnodes-1 (node 0 runs rank 0, the server)")
    multi.add_argument("--nproc-per-node", default="", metavar="K[,K1,...]",
                       help="processes per node: one count for every node, or one per node "
                       "(e.g. 3,2), the same on every node; they add up to devices + "
                       "dist.ps_shards, node 0's include the server")
    multi.add_argument("--master", "--rdzv-endpoint", dest="master", default="",
                       metavar="HOST:PORT", help="node 0's address and a free port there: "
                       "rank 0 hosts the rendezvous on it (--rdzv-endpoint: the same)")
    multi.add_argument("--ifname", default="", metavar="IFACE",
                       help="network interface for gloo's connections between the nodes "
                       "(sets GLOO_SOCKET_IFNAME); needed when the machines have several "
                       "interfaces, e.g. --ifname eth1")
    multi.add_argument("--dry-run", action="store_true",
                       help="print this node's processes (environment and command) only")
    p.set_defaults(func=main)


MULTI_ONLY = (("node_rank", 0, "--node-rank"), ("nproc_per_node", "", "--nproc-per-node"),
              ("master", "", "--master"), ("ifname", "", "--ifname"),
              ("dry_run", False, "--dry-run"))


def node_layout(args: argparse.Namespace) -> nodes.Layout:
    """The static rendezvous of a --nnodes > 1 launch (the same on every node)."""
    if args.nproc:
        raise ConfigError("--nproc counts the processes of a one-machine run; with --nnodes "
                          "give --nproc-per-node K (every node) or K0,K1,... (one per node)")
    if args.port is not None:
        raise ConfigError("--port is the one-machine rendezvous port; with --nnodes the port "
                          "is part of --master HOST:PORT")
    if not args.master:
        raise ConfigError("--nnodes > 1 needs --master HOST:PORT (node 0's address and a free "
                          "port there), the same on every node")
    if not args.nproc_per_node:
        raise ConfigError("--nnodes > 1 needs --nproc-per-node K (every node) or K0,K1,... "
                          "(one per node), the same on every node")
    host, port = nodes.parse_endpoint(args.master)
    return nodes.Layout(nodes.parse_nproc_per_node(args.nproc_per_node, args.nnodes),
                        args.node_rank, host, port)


def rank_command(args: argparse.Namespace, rank: int) -> list[str]:
    """`hetrain run` for one rank: rank 0 shows progress and the results (as --quiet/--json
    ask); the other ranks print only their errors."""
    cmd = [sys.executable, "-m", "hetrain", "run", args.config, "--engine", "dist",
           "--runs-dir", args.runs_dir]
    if rank != 0 or args.no_plot:  # rank 0 draws the run's plots, as on one machine
        cmd.append("--no-plot")
    for item in args.set:
        cmd += ["--set", item]
    if args.resume:
        cmd.append("--resume")
    if rank != 0:
        cmd.append("--quiet")
    else:
        cmd += (["--quiet"] if args.quiet else []) + (["--json"] if args.json else [])
    return cmd


def node_roles(ranks: range, devices: Sequence[Device]) -> str:
    """What this node's ranks are, in the cluster file's terms: rank r >= 1 is the cluster's
    device r - 1 (so the device order of the cluster file decides which machine runs which
    device), ranks past the devices are PS shards."""
    roles = []
    for rank in ranks:
        if rank == 0:
            roles.append("rank 0 = the PS")
        elif rank <= len(devices):
            roles.append(f"rank {rank} = device '{devices[rank - 1].name}'")
        else:
            roles.append(f"rank {rank} = PS shard {rank - len(devices)}")
    return ", ".join(roles)


def launch_nodes(args: argparse.Namespace) -> int:
    """This node's share of a several-machine run (hetrain.engine.nodes)."""
    layout = node_layout(args)
    cfg = apply_overrides(load_config(args.config), args.set)
    cluster = load_cluster(cfg.cluster)
    if cfg.parallel is not None:  # [parallel]: one process per device, no server
        if layout.world_size != cluster.n:
            raise ConfigError(f"--nproc-per-node {args.nproc_per_node} makes "
                              f"{layout.world_size} processes, but [parallel] runs one per "
                              f"device of the cluster's {cluster.n}")
    else:
        layout.check_world(cluster.n, cfg.dist.ps_shards)
    commands = {rank: rank_command(args, rank) for rank in layout.ranks}
    if args.dry_run:
        for rank, cmd in commands.items():
            env = layout.env(rank, args.ifname)
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return 0
    if not auth.configured_secret():  # every node must prove the same one
        raise ConfigError(f"--nnodes > 1 needs the run's secret on every node: "
                          f"{auth.HOW_TO_SET} (or {auth.ENV_SECRET_FILE}=PATH)")
    if layout.has_rank0:
        nodes.check_master_here(layout.master_addr, layout.master_port)
    if not args.quiet:
        roles = (f"ranks {layout.ranks.start}..{layout.ranks.stop - 1} of the [parallel] plan"
                 if cfg.parallel is not None else node_roles(layout.ranks, cluster.devices))
        print(f"hetrain: node {layout.node_rank}: {roles}", file=sys.stderr, flush=True)
    rc = nodes.Supervisor(layout, commands, init_timeout_s=cfg.dist.init_timeout_s,
                          ifname=args.ifname, base_env=os.environ).run()
    if args.json and not layout.has_rank0:
        print("[]")  # the run's summary is node 0's (rank 0's) to print
    return rc


def prepare_config(args: argparse.Namespace) -> RunConfig:
    cfg = apply_overrides(load_config(args.config), args.set)
    dist_cfg = cfg.dist
    if args.port is not None:
        dist_cfg = dataclasses.replace(dist_cfg, port=args.port)
    cfg = dataclasses.replace(cfg, engine="dist", dist=dist_cfg)
    if args.resume:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=True))
    if args.nproc and cfg.parallel is not None:
        cluster = load_cluster(cfg.cluster)
        if args.nproc != cluster.n:
            raise ConfigError(f"--nproc {args.nproc}: [parallel] runs one process per device "
                              f"of the cluster '{cluster.name}', i.e. --nproc {cluster.n}")
    elif args.nproc:
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
    if args.nnodes > 1:
        return launch_nodes(args)
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes {args.nnodes}: must be >= 1")
    given = [flag for dest, default, flag in MULTI_ONLY if getattr(args, dest) != default]
    if given:
        raise ConfigError(f"{', '.join(given)}: only for several machines (--nnodes > 1); on "
                          "one machine hetrain spawns every process itself (--nproc, --port)")
    cfg = prepare_config(args)
    preflight(cfg, args.runs_dir)
    out = Output(args.quiet, args.json)
    label = "parallel" if cfg.parallel is not None else cfg.strategy.name
    with out.progress(f"{cfg.name} [{label}, dist]") as progress:
        result = run_config(cfg, runs_root=args.runs_dir, progress=progress,
                            quiet=args.quiet)
    for shown in results_renderables([result]):
        out.print(shown)
    if not args.no_plot:
        write_plots([result], Path(args.runs_dir) / cfg.name, out)
    out.json([result.summary])
    return 0
