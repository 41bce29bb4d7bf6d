"""A bounded-staleness gate on per-worker clocks: SSP's pacing and ASHL's SHL stage.

Each worker's clock counts its pushes (or commits). After a tick the worker is held while it
is more than `bound` clocks ahead of the slowest live worker, and released as soon as the
slowest catches up: the slowest is never held, so the gate cannot deadlock. Lost workers stop
pacing the others (`drop`); a replacement starts at the slowest live clock (`join`).
"""

from __future__ import annotations


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
