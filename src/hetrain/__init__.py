"""hetrain: train PyTorch models across heterogeneous devices faster than DDP.

profile -> plan -> train -> report. See README.md for the architecture and docs/ for the
concepts, the strategies and the config reference.

    import hetrain
    result = hetrain.train(model=Net(), dataset=train_set, cluster="hetero-4")

The public names below are imported lazily (on first use), so `import hetrain` and
`hetrain --version` stay fast and do not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "train": "hetrain.api",
    "make_workload": "hetrain.api",
    "TrainResult": "hetrain.api",
    "plan_batches": "hetrain.api",
    "BatchPlan": "hetrain.api",
    "Cluster": "hetrain.cluster",
    "Device": "hetrain.cluster",
    "Link": "hetrain.cluster",
    "Site": "hetrain.cluster",
    "preset": "hetrain.cluster",
    "load_cluster": "hetrain.cluster",
    "ConfigError": "hetrain.errors",
    "RunResult": "hetrain.report.metrics",
    "load_run": "hetrain.report.metrics",
    "HeteroDDP": "hetrain.ddp",
    "HeteroBatchSampler": "hetrain.ddp",
}
_SUBMODULES = ("strategies", "workloads", "cluster", "config", "api", "ddp")

__all__ = ["__version__", *_LAZY, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"hetrain.{name}")
    else:
        raise AttributeError(f"module 'hetrain' has no attribute '{name}'")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
