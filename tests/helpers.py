"""Test helpers shared by several test files (imported as `from helpers import ...`; tests/ is
on sys.path as with tests/procs.py): one place for the strategy tests' run context and their
short simulated digits runs."""

from __future__ import annotations

from typing import Any

from hetrain.cluster import Cluster, preset
from hetrain.config import config_from_dict
from hetrain.report.metrics import RunResult
from hetrain.runner import run_config
from hetrain.strategies import RunContext


def run_context(cluster: str | Cluster = "hetero-4", *, model_bytes: int = 10_000,
                sample_bytes: int = 64, train_samples: int = 1000, batch_size: int = 16,
                lr: float = 0.05, flops_per_sample: float = 1e6) -> RunContext:
    """A strategy's set-up context without a workload: a preset by name (or a Cluster) and
    small made-up sizes, so protocol tests run in microseconds."""
    return RunContext(cluster=preset(cluster) if isinstance(cluster, str) else cluster,
                      flops_per_sample=flops_per_sample, model_bytes=model_bytes,
                      sample_bytes=sample_bytes, train_samples=train_samples,
                      batch_size=batch_size, lr=lr)


def run_digits(name: str, cluster: str = "hetero-4", epochs: float = 4.0, *,
               cluster_obj: Cluster | None = None, **options: Any) -> RunResult:
    """`name` with `options` trained on sklearn digits (MLP, batch 16) for `epochs` on the
    simulator, evaluated once per epoch, nothing written. `cluster_obj` replaces the preset."""
    cfg = config_from_dict({"name": f"t-{name}", "cluster": cluster,
                            "workload": {"model": "mlp", "dataset": "digits"},
                            "strategy": {"name": name, **options},
                            "train": {"batch_size": 16, "eval_every_epochs": 1.0},
                            "stop": {"max_epochs": epochs}})
    return run_config(cfg, runs_root=None, cluster=cluster_obj)
