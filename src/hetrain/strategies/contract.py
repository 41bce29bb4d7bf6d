"""The strategy contract (hetrain.strategies.base, "The contract"), checked one Decision at a time.

`check_decision` is a pure function of what an engine already knows when a strategy has
answered: which workers are busy, which are live, how many pushes it holds per worker. An engine
calls it after `on_push`, `on_worker_lost` and `on_worker_joined` (with its bookkeeping for the
event already done: the pusher no longer busy, the lost worker no longer live) and before it
carries the Decision out, so a broken strategy fails at the decision that broke a rule, with the
rule's name, instead of as a hang or a "none is buffered" error later.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Collection, Mapping, Sized
from typing import Literal, SupportsIndex

from hetrain.errors import HetrainError
from hetrain.strategies.base import Decision, Strategy

Event = Literal["push", "lost", "joined"]
"""What the strategy answered: `on_push`, `on_worker_lost` or `on_worker_joined`."""

SUM_TOLERANCE = 1e-9
"""How far from 1 the weights of an averaging Decision may sum (float rounding)."""


class ContractError(HetrainError, RuntimeError):
    """A strategy answered with a Decision that breaks a rule of the contract. A user's own
    strategy class is code the user can fix, so it is a HetrainError (one line, exit 2)."""


def check_decision(strategy: Strategy, decision: Decision | None, *, n_workers: int,
                   busy: Collection[int], live: Collection[int] | None = None,
                   buffered: Mapping[int, int | Sized] | None = None,
                   after: Event = "push") -> None:
    """Raise ContractError if `decision` (what `strategy` answered to `after`; None: nothing)
    breaks a rule of the contract.

    The engine's state is the one right after the event, before the Decision is carried out:
    `busy`, the live workers computing a task (released, push owed); `live`, the workers
    that are not lost (None: all `n_workers`); the others live are waiting. `buffered`, per
    worker, the pushes the engine holds that no Decision applied yet, as a count or a
    collection of them (the engines' deques; None: rule 2 unchecked).
    """
    live_set = set(range(n_workers)) if live is None else set(live)
    busy_set = set(busy)
    if not busy_set <= live_set:
        raise ValueError(f"busy workers {sorted(busy_set - live_set)} are not live")
    d = decision if decision is not None else Decision()

    def broken(rule: str, detail: str) -> ContractError:
        return ContractError(f"strategy '{strategy.name}' broke the contract after a {after} "
                             f"({rule}): {detail}; decision {d}")

    def worker_id(w: object, where: str) -> int:
        if isinstance(w, bool) or not isinstance(w, SupportsIndex):
            raise broken("worker ids", f"{where} names {w!r}, not a worker number")
        i = operator.index(w)
        if not 0 <= i < n_workers:
            raise broken("worker ids", f"{where} names worker {i} of {n_workers}")
        return i

    # 1. release only waiting workers, each at most once
    released = [worker_id(w, "release") for w in d.release]
    twice = sorted(w for w, k in Counter(released).items() if k > 1)
    if twice:
        raise broken("1: release at most once", f"workers {twice} released twice")
    for w in released:
        if w in busy_set:
            raise broken("1: never release a busy worker",
                         f"worker {w} is still computing its last task (its push is owed)")
        if w not in live_set:
            raise broken("1: never release a lost worker", f"worker {w} is lost")

    # 2. apply only pushes the engine holds
    applied = Counter(worker_id(w, "apply") for w, _ in d.apply)
    if buffered is not None:
        for w, k in sorted(applied.items()):
            held = buffered.get(w, 0)
            count = held if isinstance(held, int) else len(held)
            if k > count:
                what = "was lost (the engine dropped its pushes)" if w not in live_set else \
                    f"has {count} push(es) held"
                raise broken("2: apply only held pushes", f"applies worker {w}'s push {k} "
                             f"time(s), but it {what}")

    # 3. weights finite, >= 0, and summing as the strategy documents
    weights = []
    for w, x in d.apply:
        try:
            weight = float(x)
        except (TypeError, ValueError):
            raise broken("3: weights", f"worker {w}'s weight {x!r} is not a number") from None
        if not math.isfinite(weight) or weight < 0:
            raise broken("3: weights are finite and >= 0", f"worker {w}'s weight is {x!r}")
        weights.append(weight)
    if strategy.weights == "average" and weights and any(weights):
        total = math.fsum(weights)
        if abs(total - 1.0) > SUM_TOLERANCE:
            raise broken("3: an average's weights sum to 1", f"they sum to {total!r}")
    if not (isinstance(d.lr_scale, (int, float)) and math.isfinite(d.lr_scale)
            and d.lr_scale > 0):
        raise broken("3: the lr scale is a finite number > 0", f"it is {d.lr_scale!r}")

    # 4. no deadlock: someone live still computes (a waiting worker is freed only by a push)
    # a strategy without its own on_worker_lost (a barrier) cannot go on once a worker is
    # lost, at the loss or at a later push: the engine stops that run with a checkpoint (a
    # join is not waived: a joining worker must be released or the run must go on without it)
    waived = type(strategy).on_worker_lost is Strategy.on_worker_lost and (
        after == "lost" or (after == "push" and len(live_set) < n_workers))
    if live_set and not busy_set and not released and not waived:
        raise broken("4: no deadlock", f"every live worker {sorted(live_set)} is waiting and "
                     "the decision releases none of them")
