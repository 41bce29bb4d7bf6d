"""Run a function on N local gloo processes (the DTensor tests and the AutoDDL benchmarks).

Each worker sets one intra-op thread (N processes share a few cores), joins a gloo group on
127.0.0.1 at a free port (bound to port 0 and read back, never a fixed port), builds the
process group, runs `fn(rank, world_size, *args)` (which builds its DeviceMeshes with
`init_device_mesh` after the group exists) and always
destroys the group. The parent joins with a timeout and kills stragglers, so a hung
collective fails the caller instead of hanging it (hetrain.engine.spawn). Under torchrun, call `fn` directly with
`init_device_mesh` instead.
"""

from __future__ import annotations

import os
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hetrain.engine.spawn import Spawner
from hetrain.engine.wire import free_port


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        try:
            results.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_local(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (), timeout_s: float = 120.0) -> list[Any]:
    """fn's return value per rank (fn and args must be picklable: module-level functions)."""
    spawner = Spawner()
    results = spawner.queue()
    port = free_port()
    for r in range(world_size):
        spawner.start(_worker, (r, world_size, port, fn, args, results), daemon=True)
    out: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout_s)
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    except queue.Empty:
        errors.append(f"timed out after {timeout_s:.0f} s waiting for {world_size - len(out)} rank(s)")
    finally:
        spawner.reap(10 if not errors else 1)
    if errors:
        raise RuntimeError("distributed run failed: " + "\n".join(errors))
    return [out[r] for r in range(world_size)]
