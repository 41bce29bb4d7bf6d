"""hetrain.engine.spawn: every child has ended when `reap` returns, by the signal asked."""

from __future__ import annotations

import logging
import signal
import sys
import time

import pytest

from hetrain.engine.spawn import Spawner

pytestmark = pytest.mark.multiproc


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_child_that_exits_keeps_its_exit_code() -> None:
    sp = Spawner()
    sp.start(sys.exit, (3,), daemon=True)
    sp.reap(60)
    assert sp.exit_codes() == [3]


def test_stragglers_are_killed_and_named() -> None:
    sp = Spawner()
    for k in range(2):
        sp.start(time.sleep, (60,), daemon=False, name=f"sleeper-{k}")
    lines = _Lines()
    logging.getLogger("hetrain.dist.spawn").addHandler(lines)
    try:
        sp.reap(0.5, now=[0], warn=True)  # sleeper-0 given up on: killed without a word
    finally:
        logging.getLogger("hetrain.dist.spawn").removeHandler(lines)
    assert sp.exit_codes() == [-signal.SIGKILL] * 2
    assert lines.lines == ["hetrain: worker process sleeper-1 did not exit; killing it"]


def test_terminate_sends_sigterm() -> None:
    sp = Spawner()
    sp.start(time.sleep, (60,), daemon=True)
    sp.reap(0.5, stop="terminate")
    assert sp.exit_codes() == [-signal.SIGTERM]
