"""Run a config on the engine it names and write its files: the one path every entry point takes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from torch import nn

from hetrain.cluster import Cluster
from hetrain.config import RunConfig
from hetrain.context import ProgressFn
from hetrain.engine.checkpoint import checkpoint_path, load_checkpoint
from hetrain.engine.setup import prepare
from hetrain.engine.sim import Simulator
from hetrain.errors import ConfigError
from hetrain.report.metrics import RunResult
from hetrain.strategies import Strategy
from hetrain.workloads import Workload, workload_from_config


def run_config(cfg: RunConfig, *, runs_root: str | Path | None = "runs",
               progress: ProgressFn | None = None, cluster: Cluster | None = None,
               workload: Workload | None = None, strategy: Strategy | None = None,
               quiet: bool = False) -> RunResult:
    """Train per `cfg` and write runs/<name>/metrics.jsonl and summary.json (unless runs_root
    is None; an earlier run of the name is moved aside, `keep_previous_run`, and said so
    unless `quiet`). The simulator runs in this process; the dist engine needs torchrun or
    `hetrain launch` (see hetrain.engine.dist)."""
    return _run(cfg, runs_root, progress, cluster, workload, strategy, quiet, False)[0]


def run_config_with_model(cfg: RunConfig, *, runs_root: str | Path | None = "runs",
                          progress: ProgressFn | None = None, cluster: Cluster | None = None,
                          workload: Workload | None = None, strategy: Strategy | None = None,
                          quiet: bool = False) -> tuple[RunResult, nn.Module | None]:
    """`run_config`, and the final global model (hetrain.train's): the simulator's, or on the
    dist engine the model of the checkpoint rank 0 wrote into runs_root/<name> when the run
    stopped (None: no checkpoint there, a torchrun worker rank, or a [parallel] run, whose
    checkpoint holds the plan's shards)."""
    return _run(cfg, runs_root, progress, cluster, workload, strategy, quiet, True)


def _run(cfg: RunConfig, runs_root: str | Path | None, progress: ProgressFn | None,
         cluster: Cluster | None, workload: Workload | None, strategy: Strategy | None,
         quiet: bool, want_model: bool) -> tuple[RunResult, nn.Module | None]:
    if cfg.engine == "sim" and cfg.parallel is not None:
        raise ConfigError("[parallel] runs a plan on real processes, not on the simulator: set "
                          "engine = \"dist\" (or --engine dist), or remove the [parallel] table")
    run_dir = None if runs_root is None else Path(runs_root) / cfg.name
    if run_dir is not None:
        keep_previous_run(run_dir, cfg, quiet)
    if cfg.engine == "sim":
        prep = prepare(cfg, cluster=cluster, workload=workload, strategy=strategy)
        sim = Simulator(prep, run_dir, progress)
        result = sim.run()
        return result, sim.server.model if want_model else None
    try:
        from hetrain.engine import dist
    except ImportError as e:  # pragma: no cover - the dist engine ships with the package
        raise ConfigError(f"engine = 'dist' is not available: {e}") from None
    result = dist.run_distributed(cfg, run_dir=run_dir, progress=progress, cluster=cluster,
                                  workload=workload, strategy=strategy)
    model = None
    if want_model and run_dir is not None and cfg.parallel is None \
            and result.summary.get("role") != "worker" \
            and checkpoint_path(run_dir).is_file():
        model = (workload or workload_from_config(cfg.workload)).build_model()
        name = strategy.name if strategy is not None else cfg.strategy.name
        model.load_state_dict(load_checkpoint(run_dir, name).model)
    return result, model


def keep_previous_run(run_dir: Path, cfg: RunConfig, quiet: bool = False) -> Path | None:
    """A new run of a name that already has one moves the old one aside to <name>.<k> (the
    first free k) and says so: nothing is overwritten, and no old checkpoint.pt sits beside
    the new results. Not when the run continues the old one (--resume, a torchrun restart)
    and not on ranks other than 0 (they write nothing)."""
    env = os.environ
    if cfg.train.resume or int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 \
            or env.get("RANK", "0") != "0":
        return None
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return None
    k = 1
    while (aside := run_dir.with_name(f"{run_dir.name}.{k}")).exists():
        k += 1
    run_dir.rename(aside)
    if not quiet:
            print(f"hetrain: {run_dir} held an earlier run; moved it to {aside}",
              file=sys.stderr, flush=True)
    return aside
