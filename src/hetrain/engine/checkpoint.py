"""Checkpoint/resume of a run: runs/<name>/checkpoint.pt, one format for both engines.

The dist engine saves the server (rank 0) state. What a resumed run needs to continue where it
stopped: the global model and the server's optimizer (its momentum), the model version, the
strategy object itself (its plan, stage, buffers, clocks: strategies are plain picklable state
machines), the data owner (its RNG and position in the epoch permutation, so no sample is
repeated or skipped beyond the tasks that were in flight), the metrics so far and the wall time
already spent. Workers' inner optimizer state is not saved: a resumed worker starts its replica
from the global model with fresh momentum, which is what a replacement machine would do.

Checkpoints are taken right after a server update, before anyone is released, so a barrier
strategy has no half-collected round in it; on resume every live worker is released afresh.
Writes go to a temporary file renamed into place, so a crash mid-write keeps the old one.

The simulator saves the same fields plus `sim`, the rest of its state between two events
(every replica's model and optimizer, the tasks in flight and the pushes buffered at the
server, the event queue, the error-feedback residuals, the clocks of the links, the torch
RNG; `hetrain.engine.sim`), so its resumed run repeats the uncut run exactly. A checkpoint
is refused by the other engine (`engine` names the writer).

The file is a torch.save of tensors and plain data only: the state goes through
`hetrain.engine.codec` (a JSON tree naming allowlisted hetrain types + a list of tensors), and
it is read with `torch.load(weights_only=True)`, so a crafted checkpoint cannot run code. A
checkpoint of another model, data set, cluster, optimizer or strategy is refused, naming what differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hetrain.engine import codec
from hetrain.errors import ConfigError

CHECKPOINT_FILE = "checkpoint.pt"
FORMAT = 2
"""2: codec tree + tensors (weights_only); 1 (pickled objects) is no longer read."""
PARALLEL_KIND = "hetrain-parallel"
"""`kind` of a [parallel] run's checkpoint (hetrain.parallel.train), which this reader refuses."""
MUST_MATCH = ("workload", "cluster", "optimizer.name")
"""Config keys a resumed run must share with its checkpoint (other keys may change)."""


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
    job: str = ""
    """The torchrun job that wrote it (TORCHELASTIC_RUN_ID): a restart of that job resumes
    from it by itself (`hetrain.engine.dist.restarted_job_resumes`)."""
    engine: str = "dist"
    """The engine that wrote it (and alone can resume it)."""
    sim: dict[str, Any] = field(default_factory=dict)
    """engine "sim": the simulator's state besides the fields above (`Simulator.state`)."""


def checkpoint_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_FILE


def save_checkpoint(run_dir: str | Path, state: ServerState) -> Path:
    path = checkpoint_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.tmp")
    tree, tensors = codec.to_tree({f.name: getattr(state, f.name)
                                   for f in dataclasses.fields(ServerState)})
    text = json.dumps(tree, allow_nan=False)
    torch.save({"format": FORMAT, "tree": text, "tensors": tensors,
                "digest": _digest(text, tensors)}, tmp)
    os.replace(tmp, path)
    return path


def _digest(tree: str, tensors: list[torch.Tensor]) -> str:
    """sha256 of the tree and every tensor's bytes: torch's zip reader does not check its
    CRCs, so a damaged tensor would otherwise resume silently with wrong weights."""
    h = hashlib.sha256(tree.encode())
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _weights_only_detail(message: str) -> str:
    """The line of torch's weights-only refusal that says what it met (its advice to load
    with weights_only=False, which would run the file's code, is left out)."""
    lines = [line.strip() for line in message.splitlines()[1:] if line.strip()]
    skip = ("Please file", "Check the documentation", "WeightsUnpickler error")
    return next((line for line in lines if not line.startswith(skip)), "not plain data")[:120]


def _unreadable(path: Path, why: str) -> ConfigError:
    return ConfigError(f"checkpoint '{path}' cannot be read ({why}): it is corrupt, crafted, or "
                       "not a checkpoint of this hetrain version; move it away and start afresh")


def _lookup(config: dict[str, Any] | None, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def load_checkpoint(run_dir: str | Path | None, strategy_name: str,
                    config: dict[str, Any] | None = None, engine: str = "dist") -> ServerState:
    """Read a checkpoint back; errors name the file and what to do. With `config` (the
    resumed run's `RunConfig.to_dict()`), refuse a checkpoint of another workload, cluster,
    optimizer or strategy; always one of another engine than `engine`."""
    if run_dir is None:
        raise ConfigError("train.resume = true needs a run directory (runs_root is None)")
    path = checkpoint_path(run_dir)
    if not path.is_file():
        raise ConfigError(f"train.resume = true but there is no checkpoint at '{path}'; run "
                          "without --resume first (checkpoints are written when a run stops "
                          "and every train.checkpoint_every updates, unless train.checkpoint "
                          "= false)")
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": the error says it
            warnings.simplefilter("ignore")
            data = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises many kinds for a bad zip, pickle or tensor record
        if isinstance(e, pickle.UnpicklingError) and "Weights only" in str(e):
            raise _unreadable(path, f"refused unread by the weights-only reader, so nothing in "
                              f"it ran: {_weights_only_detail(str(e))}") from None
        first = (str(e).strip().splitlines() or [""])[0][:120]
        raise _unreadable(path, first or type(e).__name__) from None
    if isinstance(data, dict) and data.get("kind") == PARALLEL_KIND:
        raise ConfigError(f"checkpoint '{path}' is of a [parallel] run (an AutoDDL plan), but "
                          f"this config has no [parallel] table (it runs strategy "
                          f"'{strategy_name}'); resume with the [parallel] table of the run "
                          "that wrote it, or start afresh")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else None
        raise ConfigError(f"checkpoint '{path}' has format {got}, expected {FORMAT}; "
                          "start the run afresh")
    digest = data.get("digest")  # absent in files written before it was added
    try:
        if digest is not None and digest != _digest(data["tree"], list(data["tensors"])):
            raise ValueError("its contents do not match their checksum: the file is damaged")
        fields = codec.from_tree(json.loads(data["tree"]), list(data["tensors"]))
        state = ServerState(**fields)
    except (codec.CodecError, AttributeError, KeyError, TypeError, ValueError) as e:
        raise _unreadable(path, str(e)[:160]) from None
    if state.engine != engine:
        raise ConfigError(f"checkpoint '{path}' was written by the {state.engine} engine; "
                          f"resume it with engine = \"{state.engine}\", or start afresh")
    got = getattr(state.strategy, "name", "?")
    if got != strategy_name:
        raise ConfigError(f"checkpoint '{path}' is of strategy '{got}', but the config says "
                          f"'{strategy_name}'; resume with the same config")
    for key in MUST_MATCH if config is not None else ():
        then, now = _lookup(state.config, key), _lookup(config, key)
        if then != now:
            raise ConfigError(f"checkpoint '{path}' was written with {key} = {then!r}, the "
                              f"config says {now!r}; resume with the same {key} or start afresh")
    return state


def check_ps_shards(state: ServerState, shards: int) -> None:
    """A checkpoint holds one optimizer state per PS shard: resume with as many shards."""
    had = len(state.shard_optimizers) + 1
    if had != shards:
        raise ConfigError(f"the checkpoint was written with dist.ps_shards = {had}, the config "
                          f"says {shards}; resume with dist.ps_shards = {had}")
