"""ASP: the fully asynchronous parameter server (Downpour / Hogwild-style async SGD).

Gradient mode: a worker computes the mean gradient of `local_steps` mini-batches (1: classic
async SGD) on the model it pulled, pushes it, and the server steps its optimizer on that one
gradient the moment it arrives; the worker is released at once with the new model. Nobody
waits, so every device runs at its own speed, and a gradient is stale by the number of server
updates made since its worker pulled: staleness = version at arrival - base version (about
n - 1 on average for n workers of equal speed; fast workers' gradients are fresher).
`staleness_weighting` scales each gradient by 1 / (1 + staleness) (Zhang et al., IJCAI 2016,
"staleness-aware async SGD"), which damps the old gradients of slow workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from hetrain.strategies.base import Decision, Push, RunContext, Strategy, WorkTask
from hetrain.strategies.options import MAX_STEPS, integer, non_negative
from hetrain.strategies.registry import register


@register
@dataclass
class ASP(Strategy):
    """Apply every push on arrival (weight push_weight, optionally / (1 + staleness)); release."""

    name = "asp"
    comm = "ps"
    update = "gradient"

    local_steps: Annotated[int, integer(1, MAX_STEPS)] = 1
    """Mini-batches whose mean gradient makes one push (1: classic asynchronous SGD)."""
    staleness_weighting: bool = False
    """Scale each gradient by 1 / (1 + staleness), staleness in server updates."""
    push_weight: Annotated[float, non_negative().with_note("0: 1 / n_workers")] = 0.0
    """Weight of one gradient in the server step, i.e. a learning-rate multiplier
    (0: 1 / n_workers, so n asynchronous pushes move the model about as far as one
    synchronous step at the configured learning rate)."""

    def setup(self, ctx: RunContext) -> None:
        super().setup(ctx)
        self._version = 0
        self._pushes = 0
        self._staleness_sum = 0
        self._staleness_max = 0
        self._base_weight = self.push_weight or 1.0 / ctx.n_workers

    def next_task(self, worker: int) -> WorkTask:
        return WorkTask(batch_size=self.context.batch_size, local_steps=self.local_steps)

    def _apply_now(self, push: Push) -> tuple[int, float]:
        """Record the push's staleness, count one server update, return (worker, weight)."""
        staleness = self._version - push.base_version
        self._pushes += 1
        self._staleness_sum += staleness
        self._staleness_max = max(self._staleness_max, staleness)
        self._version += 1
        scale = 1.0 / (1 + staleness) if self.staleness_weighting else 1.0
        return push.worker, self._base_weight * scale

    def on_push(self, push: Push) -> Decision:
        return Decision(apply=(self._apply_now(push),), release=(push.worker,))

    def stats(self) -> dict[str, float | int | str]:
        return {"pushes": self._pushes, "max_staleness": self._staleness_max,
                "mean_staleness": self._staleness_sum / max(1, self._pushes)}
