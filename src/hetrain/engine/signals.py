"""Ctrl-C and SIGTERM in a dist run: rank 0 checkpoints and stops its workers; workers wait.

Rank 0 holds the run's state, so it alone decides how a run ends. Its handler only records
the signal, and raises `RunInterrupted` where the coordinator waits for messages (a safe
point: no update is half-applied there), so the checkpoint it then writes is consistent. A
second signal while it is stopping raises at once: the user insists.

Workers ignore SIGINT (a terminal's Ctrl-C reaches the whole process group; rank 0 stops them
cleanly) and answer SIGTERM with an alarm: they keep serving rank 0 for `WORKER_GRACE_S` (an
all-reduce run's checkpoint needs a worker's model) and then die of SIGALRM. torchrun sends
SIGTERM to every rank and SIGKILL 30 s later, so rank 0 has time to checkpoint.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from hetrain.errors import HetrainError

WORKER_GRACE_S = 10
"""Seconds a worker serves on after SIGTERM (rank 0 fetching the model, then `stop`)."""


class RunInterrupted(HetrainError):
    """The run was stopped by SIGINT or SIGTERM (after checkpointing, if it could)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class WorkerLostError(HetrainError):
    """A synchronous run cannot go on without a worker that died or hung."""


class StopSignal:
    """Records SIGINT/SIGTERM for rank 0; `safe_point()` marks where they may raise."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._at_safe_point = False
        self._stopping = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.signum is None
        self.signum = signum
        if self._at_safe_point or (self._stopping and not first):
            raise self.error()

    def error(self) -> RunInterrupted:
        assert self.signum is not None
        name = signal.Signals(self.signum).name
        if self._stopping:
            return RunInterrupted(f"{name} again while stopping: stopped at once", self.signum)
        return RunInterrupted(f"stopped by {name}", self.signum)

    @contextmanager
    def safe_point(self) -> Iterator[None]:
        """Around a blocking wait: a signal (now or already recorded) raises here."""
        self._at_safe_point = True
        try:
            if self.signum is not None and not self._stopping:
                raise self.error()
            yield
        finally:
            self._at_safe_point = False

    def stopping(self) -> None:
        """From now on only a second signal raises (the first is being handled)."""
        self._stopping = True

    @contextmanager
    def installed(self) -> Iterator[StopSignal]:
        """Handle SIGINT and SIGTERM while the run lasts (main thread only: elsewhere, as in
        a test's helper thread, signals stay with whoever handles them)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _worker_sigterm(signum: int, frame: FrameType | None) -> None:
    signal.alarm(WORKER_GRACE_S)  # SIGALRM's default action ends the process


def worker_signals() -> None:
    """A worker's (or PS shard's) signal handling: see the module docstring."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _worker_sigterm)
