"""Local SGD / periodic model averaging (torch's PostLocalSGD, DiLoCo without an outer
momentum by default): every worker runs H local steps, then parameters are averaged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from hetrain.strategies.base import (
    BarrierMixin,
    Decision,
    OuterOptimizer,
    Push,
    RunContext,
    Strategy,
    WorkTask,
)
from hetrain.strategies.options import MAX_STEPS, Limit, fraction, integer
from hetrain.strategies.registry import register


@register
@dataclass
class LocalSGD(BarrierMixin, Strategy):
    """Equal batches, `local_steps` inner steps, then an all-reduce average of the replicas.

    With outer_lr=1 and outer_momentum=0 this is plain model averaging; DiLoCo is
    outer_lr=0.7, outer_momentum=0.9 (Nesterov) with many local steps.
    """

    name = "local_sgd"
    comm = "allreduce"
    update = "delta"
    weights = "average"

    local_steps: Annotated[int, integer(1, MAX_STEPS)] = 8
    """Inner steps between two averagings (H)."""
    outer_lr: Annotated[float, Limit(0, 2, lo_open=True)] = 1.0
    """Outer SGD learning rate on the averaged delta (1: plain averaging; DiLoCo: 0.7)."""
    outer_momentum: Annotated[float, fraction(lo_open=False)] = 0.0
    """Outer Nesterov momentum (DiLoCo: 0.9)."""

    def setup(self, ctx: RunContext) -> None:
        super().setup(ctx)
        self.barrier_init(ctx.n_workers)

    def next_task(self, worker: int) -> WorkTask:
        return WorkTask(batch_size=self.context.batch_size, local_steps=self.local_steps)

    def on_push(self, push: Push) -> Decision:
        return self.barrier_push(push, weight_by_samples=False)

    def outer(self) -> OuterOptimizer:
        return OuterOptimizer(self.outer_lr, self.outer_momentum, nesterov=self.outer_momentum > 0)
