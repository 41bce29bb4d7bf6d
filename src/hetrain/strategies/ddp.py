"""Synchronous data parallelism as PyTorch DDP does it: equal batch per worker, gradients
averaged every step. On heterogeneous devices every step waits for the slowest one."""

from __future__ import annotations

from dataclasses import dataclass

from hetrain.strategies.base import BarrierMixin, Decision, Push, RunContext, Strategy, WorkTask
from hetrain.strategies.registry import register


@register
@dataclass
class DDP(BarrierMixin, Strategy):
    """All-reduce of gradients after every step; each rank takes the configured batch size.

    Gradients are averaged with equal weights (1/n), exactly what DDP's all-reduce does.
    """

    name = "ddp"
    comm = "allreduce"
    update = "gradient"
    weights = "average"

    def setup(self, ctx: RunContext) -> None:
        super().setup(ctx)
        self.barrier_init(ctx.n_workers)

    def next_task(self, worker: int) -> WorkTask:
        return WorkTask(batch_size=self.context.batch_size, local_steps=1)

    def on_push(self, push: Push) -> Decision:
        return self.barrier_push(push, weight_by_samples=False)
