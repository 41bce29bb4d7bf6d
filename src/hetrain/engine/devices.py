"""Which torch device each rank computes on, and moving tensors to and from it.

A device kind is named per cluster device (`[[devices]] torch_device`) or for the whole run
(`[dist] device`, and `[dist] ps_device` for rank 0): "cpu", "cuda" (the next free GPU of the
node), "cuda:N" (that GPU) or "auto" (the next free GPU of the node if there is one, else the
CPU). GPUs are handed out to the workers in rank order among the ranks that share a node
(torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE say which those are), so one node with 1 GPU
running the PS and three workers with kinds cpu, auto, auto puts the first auto worker on
cuda:0 and the second on the CPU. Rank 0 (the PS) on a GPU shares its node's first GPU with
the first GPU worker rather than taking one from the workers. The choice is made by each rank from the run's configuration alone, so
every rank computes the same layout without talking to the others.

The wire (hetrain.engine.codec over gloo) carries CPU tensors: pulls are staged through a
pinned host buffer and copied to the GPU without blocking; updates come back the same way, a
non-blocking copy into pinned host memory awaited once, before they are compressed and sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hetrain.cluster import Device
from hetrain.config import DistConfig
from hetrain.errors import ConfigError
from hetrain.workloads.base import map_tensors

HOW_TO_FIX = ("set [dist] device (or a device's torch_device in the cluster file) to 'cpu' or "
              "'auto'")


@dataclass(frozen=True)
class GpuInventory:
    """What this process can see (a parameter, so tests can fake a GPU count on a CPU)."""

    available: bool
    count: int

    @staticmethod
    def probe() -> GpuInventory:
        ok = torch.cuda.is_available()
        return GpuInventory(ok, torch.cuda.device_count() if ok else 0)


def node_kinds(rank: int, local_rank: int, local_world_size: int,
               kinds_by_rank: Sequence[str]) -> list[tuple[int, str]]:
    """(rank, kind) of the ranks on this rank's node, in rank order: torchrun (and hetrain's
    own nodes) give a node a contiguous block of ranks."""
    first = rank - local_rank
    last = min(first + local_world_size, len(kinds_by_rank))
    return [(r, kinds_by_rank[r]) for r in range(first, last)]


def resolve(rank: int, local_rank: int, local_world_size: int, kinds_by_rank: Sequence[str],
            gpus: GpuInventory, names: Sequence[str] | None = None) -> torch.device:
    """The device of `rank`. "cuda" and "auto" ranks take the node's GPUs in rank order; a
    "cuda" rank that finds none left (or no CUDA at all) is an error, an "auto" one takes the
    CPU. `names[r]` names rank r in errors."""
    def label(r: int) -> str:
        return names[r] if names is not None else f"rank {r}"

    kind = kinds_by_rank[rank]
    if kind == "cpu":
        return torch.device("cpu")
    if kind.startswith("cuda:"):
        index = int(kind[5:])
        if not gpus.available or index >= gpus.count:
            raise ConfigError(f"{label(rank)}: device {kind!r} does not exist on its node "
                              f"({_seen(gpus)}); {HOW_TO_FIX}, or name a GPU below "
                              f"{gpus.count}")
        return torch.device("cuda", index)
    if kind == "cuda" and not gpus.available:
        raise ConfigError(f"{label(rank)}: device 'cuda' but {_seen(gpus)}; {HOW_TO_FIX}, or "
                          "install a CUDA build of torch")
    slot = 0
    for r, k in node_kinds(rank, local_rank, local_world_size, kinds_by_rank):
        if r == rank:
            break
        if r == 0:  # the PS shares its node's first GPU: its work is light beside a worker's
            continue
        if k in ("cuda", "auto") and (k == "cuda" or slot < gpus.count):
            slot += 1
    if slot < gpus.count:
        return torch.device("cuda", slot)
    if kind == "auto":
        return torch.device("cpu")
    wanted = sum(1 for _, k in node_kinds(rank, local_rank, local_world_size, kinds_by_rank)
                 if k == "cuda")
    raise ConfigError(f"{label(rank)}: {wanted} ranks on its node want a GPU (device 'cuda') "
                      f"but the node has {gpus.count}; {HOW_TO_FIX} for some devices, or run "
                      "fewer processes per node")


def _seen(gpus: GpuInventory) -> str:
    if not gpus.available:
        cuda = torch.version.cuda
        return ("this torch has no CUDA (a CPU build)" if cuda is None
                else "no GPU is visible (torch.cuda.is_available() is False)")
    return f"{gpus.count} GPU{'s' if gpus.count != 1 else ''} visible"


def rank_kinds(dist_cfg: DistConfig, cluster_devices: Sequence[Device]
               ) -> tuple[list[str], list[str]]:
    """(device kind, name) of every rank: rank 0 (PS and coordinator), the workers (their
    torch_device, else dist.device), the PS shards (which only add up updates: CPU)."""
    kinds = [dist_cfg.ps_device, *(d.torch_device or dist_cfg.device for d in cluster_devices),
             *(["cpu"] * (dist_cfg.ps_shards - 1))]
    names = ["rank 0 (the PS)", *(f"worker '{d.name}'" for d in cluster_devices),
             *(f"PS shard {s}" for s in range(1, dist_cfg.ps_shards))]
    return kinds, names


def device_of(rank: int, layout: tuple[int, int], dist_cfg: DistConfig,
              cluster_devices: Sequence[Device], comm: str | None = None,
              gpus: GpuInventory | None = None) -> torch.device:
    """The device of `rank` in a run of these cluster devices (`layout`: its local rank and
    local world size), checked against dist.backend when the strategy's `comm` is given:
    NCCL all-reduces GPU tensors, so every worker of an all-reduce strategy must be on one."""
    kinds, names = rank_kinds(dist_cfg, cluster_devices)
    device = resolve(rank, *layout, kinds, gpus or GpuInventory.probe(), names)
    if 1 <= rank <= len(cluster_devices) and dist_cfg.backend == "nccl" \
            and comm == "allreduce" and device.type != "cuda":
        raise ConfigError(f"{names[rank]} computes on {device} but dist.backend = 'nccl' "
                          "needs every worker on a GPU; use gloo for a cluster that mixes "
                          "GPU and CPU workers")
    return device


def use(device: torch.device) -> None:
    """Make `device` this process's current GPU (NCCL and CUDA's default stream follow it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall clock around it measures the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Mover:
    """Host <-> device copies for one rank. On a GPU, host tensors go through a pinned
    staging buffer (reused while the size fits) and are copied without blocking the host;
    results come back through pinned host memory, ready for the wire."""

    def __init__(self, device: torch.device, pin_memory: bool = True) -> None:
        self.device = device
        self.pin_memory = pin_memory
        """Pin batches before the copy (a DataLoader's pin_memory; off saves host memory)."""
        self._pinned: Tensor | None = None

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def to_device(self, t: Tensor) -> Tensor:
        if not self.on_gpu:
            return t
        if t.dtype != torch.float32 or t.dim() != 1:
            return t.to(self.device, non_blocking=False)
        if self._pinned is None or self._pinned.numel() < t.numel():
            self._pinned = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
        else:  # the last copy out of the buffer must be done before it is overwritten
            torch.cuda.current_stream(self.device).synchronize()
        staged = self._pinned[:t.numel()]
        staged.copy_(t)
        return staged.to(self.device, non_blocking=True)

    def batch(self, batch: Any) -> Any:
        """A batch (tensors nested in tuples, lists, dicts) on the device, the same structure:
        pinned first and copied without blocking, or copied plainly when pin_memory is off."""
        if not self.on_gpu:
            return batch
        if not self.pin_memory:
            return map_tensors(lambda t: t.to(self.device), batch)
        return map_tensors(lambda t: t.pin_memory().to(self.device, non_blocking=True), batch)

    def to_host(self, t: Tensor) -> Tensor:
        """A device tensor in host memory for the wire. On a GPU the copy lands in pinned
        memory (a direct DMA, no bounce through a driver buffer; the caching host allocator
        reuses the blocks), queued without blocking and awaited once, since the bytes go out
        next. Each result gets its own block: an update and its buffers are alive together."""
        if t.device.type == "cpu":
            return t
        if not self.pin_memory:
            return t.to("cpu")
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
        return out


def host_tree(tree: Any) -> Any:
    """A state dict (nested dicts, lists, tuples) with every tensor copied to host memory:
    what checkpoints and messages carry, whatever device the state lives on."""
    if isinstance(tree, Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: host_tree(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(host_tree(v) for v in tree)
    return tree
