"""SSP: stale-synchronous parallel (Ho et al., NIPS 2013) on the parameter server.

Every push ticks its worker's clock c_w (pushes completed). Pushes are applied on arrival, as
in ASP, but a worker may only start its next iteration while it is at most `staleness` (s)
iterations ahead of the slowest: it is released iff c_w - min_v c_v <= s, otherwise it is held
until the slowest catches up. Hence the iteration each worker is running is never more than
s ahead of the slowest worker's (the slowest is never held), completed clocks differ by at
most s + 1 (a finished, held worker), and s = 0 is bulk-synchronous pacing. The gate is a
small class of its own, because ASHL's SHL stage uses the same bound on commits.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetrain.errors import ConfigError
from hetrain.strategies.asp import ASP
from hetrain.strategies.base import Decision, Push, RunContext
from hetrain.strategies.options import is_int_at_least
from hetrain.strategies.registry import register


class ClockGate:
    """Bounded staleness on per-worker clocks (pushes completed); bound None: never hold."""

    def __init__(self, n: int, bound: int | None) -> None:
        self.clocks = [0] * n
        self.bound = bound
        self.held: set[int] = set()
        self.alive = set(range(n))
        self.max_gap = 0
        """Largest max - min of completed clocks ever seen (<= bound + 1)."""
        self.holds = 0
        """Pushes after which the worker had to wait."""

    def min_clock(self) -> int:
        return min(self.clocks[w] for w in self.alive)

    def _ready(self) -> tuple[int, ...]:
        m = self.min_clock()
        ready = tuple(sorted(v for v in self.held
                             if self.bound is None or self.clocks[v] - m <= self.bound))
        self.held.difference_update(ready)
        return ready

    def tick(self, worker: int) -> tuple[int, ...]:
        """Count worker's push; return the workers that may start their next iteration now."""
        self.clocks[worker] += 1
        self.max_gap = max(self.max_gap,
                           max(self.clocks[w] for w in self.alive) - self.min_clock())
        self.held.add(worker)
        ready = self._ready()
        if worker not in ready:
            self.holds += 1
        return ready

    def set_bound(self, bound: int | None) -> tuple[int, ...]:
        """Change the bound; return held workers it frees."""
        self.bound = bound
        return self._ready()

    def join(self, worker: int) -> None:
        """A replacement takes a lost worker's slot at the slowest live clock: the minimum
        does not move, so nobody is held for it, and it is not held itself."""
        self.clocks[worker] = self.min_clock() if self.alive else 0
        self.alive.add(worker)
        self.held.discard(worker)

    def drop(self, worker: int) -> tuple[int, ...]:
        """A lost worker no longer paces the others."""
        self.alive.discard(worker)
        self.held.discard(worker)
        return self._ready() if self.alive else ()


@register
@dataclass
class SSP(ASP):
    """ASP with the staleness bound: a worker runs at most `staleness` iterations ahead."""

    name = "ssp"

    staleness: int = 3
    """s: how many iterations a worker may run ahead of the slowest (0: lock-step)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_int_at_least(self.staleness, 0):
            raise ConfigError(f"strategy ssp: staleness must be an integer >= 0, "
                              f"got {self.staleness!r}")

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
