"""SSP: stale-synchronous parallel (Ho et al., NIPS 2013) on the parameter server.

Every push ticks its worker's clock c_w (pushes completed). Pushes are applied on arrival, as
in ASP, but a worker may only start its next iteration while it is at most `staleness` (s)
iterations ahead of the slowest: it is released iff c_w - min_v c_v <= s, otherwise it is held
until the slowest catches up. Hence the iteration each worker is running is never more than
s ahead of the slowest worker's (the slowest is never held), completed clocks differ by at
most s + 1 (a finished, held worker), and s = 0 is bulk-synchronous pacing. The gate is a
class of its own (clock_gate.py), because ASHL's SHL stage uses the same bound on commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from hetrain.strategies.asp import ASP
from hetrain.strategies.base import Decision, Push, RunContext
from hetrain.strategies.clock_gate import ClockGate
from hetrain.strategies.options import MAX_STEPS, integer
from hetrain.strategies.registry import register


@register
@dataclass
class SSP(ASP):
    """ASP with the staleness bound: a worker runs at most `staleness` iterations ahead."""

    name = "ssp"

    staleness: Annotated[int, integer(0, MAX_STEPS)] = 3
    """s: how many iterations a worker may run ahead of the slowest (0: lock-step)."""

    def setup(self, ctx: RunContext) -> None:
        super().setup(ctx)
        self.gate = ClockGate(ctx.n_workers, self.staleness)

    def on_push(self, push: Push) -> Decision:
        apply = self._apply_now(push)
        return Decision(apply=(apply,), release=self.gate.tick(push.worker))

    def on_worker_lost(self, worker: int) -> Decision | None:
        return Decision(release=self.gate.drop(worker))

    def on_worker_joined(self, worker: int) -> Decision | None:
        self.gate.join(worker)
        return Decision(release=(worker,))

    def stats(self) -> dict[str, float | int | str]:
        return {**super().stats(), "max_clock_gap": self.gate.max_gap,
                "held_pushes": self.gate.holds}
