"""Checkpoint/resume of the server (rank 0) state of a dist run: runs/<name>/checkpoint.pt.

What a resumed run needs to continue where it stopped: the global model and the server's
optimizer (its momentum), the model version, the strategy object itself (its plan, stage,
buffers, clocks: strategies are plain picklable state machines), the data owner (its RNG and
position in the epoch permutation, so no sample is repeated or skipped beyond the tasks that
were in flight), the metrics so far and the wall time already spent. Workers' inner optimizer
state is not saved: a resumed worker starts its replica from the global model with fresh
momentum, which is what a replacement machine would do.

Checkpoints are taken right after a server update, before anyone is released, so a barrier
strategy has no half-collected round in it; on resume every live worker is released afresh.
Writes go to a temporary file renamed into place, so a crash mid-write keeps the old one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetrain.errors import ConfigError

CHECKPOINT_FILE = "checkpoint.pt"
FORMAT = 1


@dataclass
class ServerState:
    """Everything rank 0 restores; tensors are CPU copies."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    version: int
    strategy: Any
    owner: Any
    applied_samples: int
    next_eval: int
    elapsed_s: float
    rows: list[dict[str, Any]]
    workers: list[Any]
    tta: tuple[float | None, int | None]
    lost: list[int]
    config: dict[str, Any]
    shard_optimizers: tuple[dict[str, Any], ...] = ()
    """dist.ps_shards > 1: the optimizer states of shards 1..S-1 (`optimizer` is block 0's)."""


def checkpoint_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_FILE


def save_checkpoint(run_dir: str | Path, state: ServerState) -> Path:
    path = checkpoint_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.tmp")
    torch.save({"format": FORMAT, "state": state}, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(run_dir: str | Path | None, strategy_name: str) -> ServerState:
    """Read a checkpoint back; errors name the file and what to do."""
    if run_dir is None:
        raise ConfigError("dist.resume = true needs a run directory (runs_root is None)")
    path = checkpoint_path(run_dir)
    if not path.is_file():
        raise ConfigError(f"dist.resume = true but there is no checkpoint at '{path}'; run "
                          "without --resume first (checkpoints are written every "
                          "dist.checkpoint_every updates and when a run stops)")
    data = torch.load(path, weights_only=False)
    if data.get("format") != FORMAT:
        raise ConfigError(f"checkpoint '{path}' has format {data.get('format')}, expected "
                          f"{FORMAT}; start the run afresh")
    state: ServerState = data["state"]
    got = getattr(state.strategy, "name", "?")
    if got != strategy_name:
        raise ConfigError(f"checkpoint '{path}' is of strategy '{got}', but the config says "
                          f"'{strategy_name}'; resume with the same config")
    return state


def check_ps_shards(state: ServerState, shards: int) -> None:
    """A checkpoint holds one optimizer state per PS shard: resume with as many shards."""
    had = len(state.shard_optimizers) + 1
    if had != shards:
        raise ConfigError(f"the checkpoint was written with dist.ps_shards = {had}, the config "
                          f"says {shards}; resume with dist.ps_shards = {had}")
