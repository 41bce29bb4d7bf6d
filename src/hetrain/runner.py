"""Run a config on the engine it names and write its files: the one path every entry point takes."""

from __future__ import annotations

from pathlib import Path

from hetrain.cluster import Cluster
from hetrain.config import RunConfig
from hetrain.engine.setup import prepare
from hetrain.engine.sim import ProgressFn, simulate
from hetrain.errors import ConfigError
from hetrain.report.metrics import RunResult
from hetrain.strategies import Strategy
from hetrain.workloads import Workload


def run_config(cfg: RunConfig, *, runs_root: str | Path | None = "runs",
               progress: ProgressFn | None = None, cluster: Cluster | None = None,
               workload: Workload | None = None, strategy: Strategy | None = None) -> RunResult:
    """Train per `cfg` and write runs/<name>/metrics.jsonl and summary.json (unless runs_root
    is None). The simulator runs in this process; the dist engine needs torchrun or
    `hetrain launch` (see hetrain.engine.dist)."""
    run_dir = None if runs_root is None else Path(runs_root) / cfg.name
    if cfg.engine == "sim":
        prep = prepare(cfg, cluster=cluster, workload=workload, strategy=strategy)
        return simulate(prep, run_dir, progress)
    try:
        from hetrain.engine import dist
    except ImportError as e:  # pragma: no cover - the dist engine ships with the package
        raise ConfigError(f"engine = 'dist' is not available: {e}") from None
    return dist.run_distributed(cfg, run_dir=run_dir, progress=progress, cluster=cluster,
                                workload=workload, strategy=strategy)
