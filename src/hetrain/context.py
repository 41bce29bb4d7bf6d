"""Types that both sides of the engine/strategy and strategy/profile seams use: the run's
context a strategy is set up with, and the progress callback every engine calls. They live
here, importing neither side, so that no module imports an engine or a strategy for a type."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hetrain.cluster import Cluster

ProgressFn = Callable[[float, dict[str, Any] | None], None]
"""Called with the fraction done (0..1) and the newest evaluation row, if any."""


@dataclass(frozen=True)
class RunContext:
    """What a strategy may know about the run when it is set up."""

    cluster: Cluster
    """The planner's view of the devices and links (preset, file or profile)."""
    flops_per_sample: float
    """Forward+backward FLOPs of one training sample of the workload."""
    model_bytes: int
    """Bytes of the model's parameters (fp32), i.e. one full push or pull."""
    sample_bytes: int
    """Bytes of one training sample, for strategies that ship data."""
    train_samples: int
    """Size of the training set (an epoch)."""
    batch_size: int
    """The configured per-worker reference batch size (DDP's per-rank batch)."""
    lr: float
    """The configured base learning rate at `batch_size`."""
    optimizer: str = "sgd"
    """The workers' optimizer (sgd | adam | adamw): how a learning rate follows the batch."""

    @property
    def n_workers(self) -> int:
        return self.cluster.n
