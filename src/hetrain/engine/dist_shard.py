"""Ranks n+1 .. n+S-1 of a dist run with `dist.ps_shards = S`: parameter-server shards.

The model's parameter tensors are split into S contiguous blocks balanced by size
(`partition`). Rank 0 keeps block 0 together with everything else (strategy, data owner, float
buffers, evaluation, checkpoints); shard s (rank n + s) holds block s and its slice of the
server optimizer. The strategy runs once, on rank 0, on the pushes' metadata; a shard only
carries out rank 0's commands, strictly in the order they were sent, so every block goes
through the same server updates as in a one-server run (the optimizers are element-wise, so a
block steps as it would inside the whole model).

Messages a shard receives (`hetrain.engine.messages`):
  from a worker   Pull(version=v): answered with a Block once the shard has applied v
                  updates (what rank 0 had applied when it released the worker);
                  Push(payload=the worker's compressed update of this block);
  from rank 0     Setup (the block, update mode, outer optimizer, optimizer state, version),
                  Apply (the Decision's (worker, weight) items: each worker's oldest buffered
                  pushes, waited for if they have not arrived yet), Drop (a lost worker),
                  State (send the block and optimizer state), Stop.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter, deque
from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import Any

from torch import Tensor, nn

from hetrain.compress import Compressor
from hetrain.config import RunConfig
from hetrain.engine.core import Server, copy_flat_into, follow_plateau
from hetrain.engine.devices import host_tree
from hetrain.engine.messages import (
    Apply,
    Block,
    Bye,
    Drop,
    Message,
    Pull,
    Push,
    Setup,
    State,
    Stop,
    expect,
    present,
)
from hetrain.engine.signals import WorkerLostError
from hetrain.engine.wire import Inbox, Outbox, pump, send_obj
from hetrain.strategies.base import OuterOptimizer, Update

log = logging.getLogger("hetrain.dist")
JOIN_S = 10.0


def partition(numels: Sequence[int], shards: int) -> list[tuple[int, int]]:
    """Split tensors 0..k-1 into `shards` contiguous, non-empty [start, end) ranges, each
    boundary at the tensor end nearest its even share of the total numel. Whole tensors only:
    a block then needs no bookkeeping beyond its tensors' order."""
    if not 1 <= shards <= len(numels):
        raise ValueError(f"cannot split {len(numels)} tensors into {shards} shards")
    cum = [0, *accumulate(numels)]
    bounds = [0]
    for s in range(1, shards):
        target = cum[-1] * s / shards
        lo, hi = bounds[-1] + 1, len(numels) - (shards - s)  # a tensor for every later block
        bounds.append(min(range(lo, hi + 1), key=lambda e: abs(cum[e] - target)))
    bounds.append(len(numels))
    return list(pairwise(bounds))


class ShardFanout:
    """Rank 0's end of the shards: its model's parameters split into blocks (block 0 its own,
    block s on rank n + s), and the commands it sends them, in order."""

    def __init__(self, model: nn.Module, shards: int, n_workers: int) -> None:
        params = list(model.parameters())
        self.blocks = [params[a:b] for a, b in partition([p.numel() for p in params], shards)]
        """The parameter tensors of each shard; block 0 is rank 0's own."""
        self.ranks = [n_workers + s for s in range(1, len(self.blocks))]
        self.optimizers: tuple[dict[str, Any], ...] = ()
        """A resumed run's optimizer states of shards 1..S-1 (sent with their setup)."""
        self.outbox: Outbox | None = None
        self.inbox: Inbox | None = None
        self.timeout_s = 0.0

    def connect(self, outbox: Outbox, inbox: Inbox, timeout_s: float) -> None:
        """The links to the shards (made once the inbox knows their ranks)."""
        self.outbox, self.inbox, self.timeout_s = outbox, inbox, timeout_s

    @property
    def sizes(self) -> list[int]:
        return [sum(p.numel() for p in b) for b in self.blocks]

    def setup(self, update: Update, outer: OuterOptimizer, version: int) -> None:
        assert self.outbox is not None
        for s, rank in enumerate(self.ranks, 1):
            self.outbox.send(Setup(update=update, outer=outer, version=version,
                                   params=[host_tree(p) for p in self.blocks[s]],
                                   optimizer=self.optimizers[s - 1] if self.optimizers
                                   else None), rank)

    def send(self, cmd: Apply | Drop | State | Stop) -> None:
        """A command to every shard."""
        assert self.outbox is not None
        for rank in self.ranks:
            self.outbox.send(cmd, rank)

    def gather(self) -> list[dict[str, Any]]:
        """Copy every shard's block into rank 0's model (as of the latest update: a shard
        runs commands in order); returns the shards' optimizer states."""
        assert self.inbox is not None
        self.send(State())
        optimizers = []
        for s, rank in enumerate(self.ranks, 1):
            kind, _, obj, _ = self.inbox.request(rank, self.timeout_s)
            if kind == "lost":
                raise WorkerLostError(f"parameter-server shard {s} (rank {rank}) was lost: {obj}")
            msg = expect(obj, State)
            copy_flat_into(self.blocks[s], present(msg.params, msg, "params"))
            optimizers.append(present(msg.optimizer, msg, "optimizer"))
        return optimizers

    def stop(self, timeout_s: float) -> None:
        """Stop the shards (after the workers, which said bye to them too) and wait for their
        bye."""
        assert self.inbox is not None
        self.send(Stop())
        for rank in self.ranks:
            self.inbox.expect(rank, timeout_s)
        while self.inbox.waiting:
            self.inbox.next()


class Shard:
    """One shard's loop: buffer pushed blocks and pulls, run rank 0's commands in order."""

    def __init__(self, n_workers: int, cfg: RunConfig, compressor: Compressor) -> None:
        self.cfg, self.compressor = cfg, compressor
        self.server: Server | None = None
        self.commands: deque[Message] = deque()
        self.blocks: dict[int, deque[Tensor]] = {w: deque() for w in range(n_workers)}
        self.pulls: list[tuple[int, int]] = []
        self.dropped: set[int] = set()
        self.outbox = Outbox()
        self.q: queue.Queue[tuple[str, int, Any, int]] = queue.Queue()
        self.receivers = [threading.Thread(target=pump, args=(src, self.q), daemon=True,
                                           name=f"hetrain-shard-recv-{src}")
                          for src in range(n_workers + 1)]  # rank 0 and the workers
        for t in self.receivers:
            t.start()

    @property
    def version(self) -> int:
        return -1 if self.server is None else self.server.version

    def run(self) -> None:
        while True:
            kind, src, msg, _ = self.q.get()
            if kind == "lost":
                if src == 0:
                    log.warning("hetrain: shard lost rank 0 (%s); stopping", msg)
                    return
                continue  # rank 0 decides what a lost worker means (its "drop" command)
            if src == 0:
                self.commands.append(msg)
            elif src - 1 not in self.dropped and not isinstance(msg, Bye):
                if isinstance(msg, Push):
                    payload = present(msg.payload, msg, "payload")
                    self.blocks[src - 1].append(self.compressor.extract(payload))
                else:
                    self.pulls.append((src - 1, expect(msg, Pull).version))
            if not self._progress():
                return

    def _progress(self) -> bool:
        """Run the commands whose pushes are here, then answer the pulls whose version is
        reached; False once stopped."""
        while self.commands and self._ready(self.commands[0]):
            if not self._execute(self.commands.popleft()):
                return False
        waiting = []
        for w, v in self.pulls:
            if w in self.dropped:
                continue
            if self.server is not None and self.version >= v:
                self.outbox.send(Block(params=self.server.params()), w + 1)
            else:
                waiting.append((w, v))
        self.pulls = waiting
        return True

    def _ready(self, cmd: Message) -> bool:
        if not isinstance(cmd, Apply):
            return True
        need = Counter(w for w, _ in present(cmd.items, cmd, "items"))
        return all(len(self.blocks[w]) >= k for w, k in need.items())

    def _execute(self, cmd: Message) -> bool:
        if isinstance(cmd, Setup):
            params = nn.ParameterList([nn.Parameter(t) for t in present(cmd.params, cmd,
                                                                          "params")])
            self.server = Server(params, present(cmd.update, cmd, "update"),
                                 self.cfg.optimizer, present(cmd.outer, cmd, "outer"))
            if cmd.optimizer is not None:
                self.server.optimizer.load_state_dict(cmd.optimizer)
            self.server.version = present(cmd.version, cmd, "version")
        elif isinstance(cmd, Apply):
            assert self.server is not None
            follow_plateau(self.server, cmd.lr_factor)
            self.server.apply([(weight, self.blocks[w].popleft(), [])
                               for w, weight in present(cmd.items, cmd, "items")],
                              present(cmd.lr_scale, cmd, "lr_scale"))
        elif isinstance(cmd, Drop):
            w = cmd.worker
            self.dropped.add(w)
            self.blocks[w].clear()
            self.outbox.forget(w + 1)
        elif isinstance(cmd, State):
            assert self.server is not None
            send_obj(State(params=self.server.params(),
                           optimizer=self.server.optimizer.state_dict()), 0)
        elif isinstance(cmd, Stop):  # sent after every live worker said bye (to us too)
            for src, t in enumerate(self.receivers):  # each ends at its sender's last message
                if src - 1 not in self.dropped:
                    t.join(JOIN_S)
            send_obj(Bye(), 0)
            self.outbox.wait_all()
            return False
        return True
