"""The dist server's Inbox deadlines (no processes: a source that never sends)."""

from __future__ import annotations

import time

from hetrain.engine.wire import Inbox


def test_a_silent_source_is_lost_at_its_deadline_plus_the_pauses() -> None:
    """Evaluations postpone a deadline by their length, not to a fresh timeout: a server
    that evaluates more often than the worker timeout still finds a hung worker. No wall-time
    bound on a busy machine: it is not lost before its deadline, and at once after it."""
    inbox = Inbox([])
    inbox.expect(7, 0.4)
    inbox.postpone(7, 0.01)
    assert inbox.next_within(0.01) is None  # due in ~0.41 s: not lost yet
    for _ in range(5):  # more "evaluations" of 10 ms, one every 0.1 s: due at 0.46 s
        time.sleep(0.1)
        inbox.postpone(7, 0.01)
    time.sleep(0.05)  # >= 0.55 s have passed; a fresh 0.4 s per pause would be due at ~0.9 s
    ev = inbox.next_within(0.01)
    assert ev is not None and ev[:2] == ("lost", 7), ev


def test_postpone_leaves_other_sources_and_unknown_ones_alone() -> None:
    inbox = Inbox([])
    inbox.expect(1, 0.05)
    inbox.postpone(2, 10.0)  # owes nothing: stays owing nothing
    assert inbox.waiting == [1]
    assert inbox.next_within(None)[:2] == ("lost", 1)
    assert inbox.waiting == []
