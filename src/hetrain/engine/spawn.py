"""The one way hetrain starts processes on this machine, and makes sure they end.

Used by the dist engine's local runs (`dist.spawn_local`), [parallel] runs
(`parallel.train`), the profiler (`engine.measure`) and `parallel.launch.run_local`. Each
child is a fresh interpreter (the spawn start method, torch's flavour so tensors can pass
through its pipes and queues): nothing of this process (threads, a CUDA context, a process
group) is inherited. `reap`, run in the caller's `finally`, is the cleanup: when it returns
every child has exited or has been stopped, so no child outlives its caller's failure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Literal

import torch.multiprocessing as mp

STOP_GRACE_S = 5.0
"""How long `reap` waits for a child to go after it was sent its stop signal."""

log = logging.getLogger("hetrain.dist.spawn")  # shown by the dist engine's handler


class Spawner:
    """Children of one caller, in start order (`procs[i]` is the i-th started)."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess] = []

    def start(self, target: Callable[..., Any], args: tuple[Any, ...], *, daemon: bool,
              name: str | None = None) -> BaseProcess:
        """Start `target(*args)` in a child. daemon=False lets the child start processes of
        its own (DataLoader workers); `reap` then has to end it."""
        p = self.ctx.Process(target=target, args=args, daemon=daemon, name=name)
        p.start()
        self.procs.append(p)
        return p

    def pipe(self) -> tuple[Connection, Connection]:
        return self.ctx.Pipe()

    def queue(self) -> Any:
        """A queue the children can put to and this process can read with a timeout."""
        return self.ctx.Queue()

    def simple_queue(self) -> Any:
        return self.ctx.SimpleQueue()

    def exit_codes(self) -> list[int | None]:
        """Each child's exit code (None: still running); -N: ended by signal N."""
        return [p.exitcode for p in self.procs]

    def reap(self, timeout_s: float, *, now: Iterable[int] = (),
             stop: Literal["kill", "terminate"] = "kill", warn: bool = False) -> None:
        """End every child: those at the indices `now` (ones the caller has given up on, e.g.
        hung or frozen by SIGSTOP) get `stop` at once; each other one gets timeout_s to exit,
        then `stop` (SIGKILL, or SIGTERM for "terminate"), and STOP_GRACE_S to go. SIGKILL is
        the default because SIGTERM would wait on a stopped process, and so would
        multiprocessing's exit handler. warn: say on the log which child did not exit."""
        for i in now:
            getattr(self.procs[i], stop)()
        for p in self.procs:
            p.join(timeout_s)
            if p.is_alive():
                if warn:
                    log.warning("hetrain: worker process %s did not exit; killing it", p.name)
                getattr(p, stop)()
                p.join(STOP_GRACE_S)
