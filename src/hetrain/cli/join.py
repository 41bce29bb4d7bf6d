"""`hetrain join CONFIG.toml`: a replacement worker takes a lost worker's slot in a running
dist job (PS strategies), without restarting anyone (hetrain.engine.join).

The run's endpoint comes from --endpoint HOST:PORT (its rendezvous: dist.master_addr and the
port, or --master of `hetrain launch`), else from runs/<name>/join.json, which a dist run
writes while it lasts. The secret comes from HETRAIN_SECRET / HETRAIN_SECRET_FILE, else from
runs/<name>/.join-secret (mode 0600), which a run started on this machine with a generated
secret writes while it lasts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from hetrain.cli.run import apply_overrides
from hetrain.compress import make_compressor
from hetrain.config import load_config
from hetrain.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("join", help="replace a lost worker of a running dist job",
                       description="Start a worker that takes a lost worker's slot (its "
                       "device) in a running dist job with a PS strategy; the job goes on "
                       "without a restart. All-reduce strategies (ddp, local_sgd) cannot take "
                       "a member mid-way: restart those jobs (torchrun --max-restarts).")
    p.add_argument("config", help="the run's config TOML (the same one the run uses)")
    p.add_argument("--endpoint", default="", metavar="HOST:PORT",
                   help="the run's rendezvous (default: from runs/<name>/join.json)")
    p.add_argument("--worker", type=int, default=None, metavar="W",
                   help="the slot to take (default: the first lost one)")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait this long for a slot to free (default: refuse at once)")
    p.add_argument("--store-prefix", default="", help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, as the run did")
    p.add_argument("--runs-dir", default="runs", help="where runs/<name>/ is")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from hetrain.engine.dist_worker import Worker
    from hetrain.engine.join import ALLREDUCE_HINT, find_target, request_slot
    from hetrain.strategies.registry import get_class
    from hetrain.workloads import workload_from_config

    cfg = apply_overrides(load_config(args.config), args.set)
    if get_class(cfg.strategy.name).comm != "ps":
        raise ConfigError(f"strategy '{cfg.strategy.name}' is all-reduce: {ALLREDUCE_HINT}")
    if cfg.dist.ps_shards != 1:
        raise ConfigError(f"dist.ps_shards = {cfg.dist.ps_shards}: a joiner cannot reach the "
                          "PS shards; restart the job to replace a worker")
    if args.wait < 0:
        raise ConfigError("--wait must be >= 0 seconds")
    torch.set_num_threads(cfg.train.threads)
    started = time.monotonic()
    target = find_target(Path(args.runs_dir) / cfg.name, args.endpoint, args.store_prefix,
                         args.wait)
    workload = workload_from_config(cfg.workload)
    wait_s = max(0.0, args.wait - (time.monotonic() - started))
    worker, link, _group = request_slot(target, cfg.name, args.worker, wait_s,
                                        cfg.dist.init_timeout_s)
    print(f"hetrain: joined run '{cfg.name}' as worker {worker}", file=sys.stderr, flush=True)
    compressor = make_compressor(cfg.train.compression, **cfg.train.compression_options)
    w = Worker(worker + 1, cfg, workload, compressor, None, link=link)
    try:
        w.run()
    except RuntimeError as e:
        if "gloo" not in str(e):
            raise
        raise ConfigError(f"worker {worker}: lost the run's server ("
                          f"{str(e).splitlines()[0][:120]})") from None
    print(f"hetrain: worker {worker} ran {w.tasks} task(s); the run stopped it",
          file=sys.stderr)
    return 0
