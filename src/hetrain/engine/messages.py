"""The dist engine's messages: every kind, the keys it may carry and their types, in one place.

A message is a dict with a "kind"; the same kind serves rank 0, the workers and the PS shards
(a shard's "setup" carries parameters, a worker's carries the cluster). `check` vets what a peer
sent before anyone reads it: an unknown kind, a missing or unknown key, or a value of the wrong
type is a `MessageError`, and the receiver stops that peer with a log line saying which.
"""

from __future__ import annotations

from typing import Any

import torch

from hetrain.cluster import Cluster
from hetrain.compress.base import Compressed
from hetrain.strategies.base import OuterOptimizer, WorkTask

Number = (int, float)
Types = type | tuple[type, ...]


class MessageError(ValueError):
    """A message that is not what the protocol allows."""


# kind -> (required keys, optional keys), each key -> allowed types. "times" and "overruns"
# ride on everything a worker sends to rank 0.
_FROM_WORKER: dict[str, Types] = {"times": dict, "overruns": int}
SCHEMA: dict[str, tuple[dict[str, Types], dict[str, Types]]] = {
    # rank 0 -> workers / shards
    "setup": ({}, {"worker": int, "cluster": Cluster, "flops_per_sample": Number,
                   "update": str, "comm": str, "outer": OuterOptimizer, "emulation": dict,
                   "state": (dict, type(None)), "shards": dict, "version": int,
                   "params": list, "optimizer": (dict, type(None))}),
    "task": ({"task": WorkTask, "batches": list},
             {"apply_weight": Number, "lr_factor": Number, "params": torch.Tensor,
              "buffers": list, "version": int}),
    "apply": ({}, {"weight": Number, "items": list, "lr_factor": Number}),
    "drop": ({"worker": int}, {}),
    "stop": ({}, {}),
    # workers -> rank 0 / shards, shards -> rank 0 / workers
    "ready": ({}, {"device": str, "error": str, **_FROM_WORKER}),
    "push": ({}, {"samples": int, "steps": int, "loss": Number, "compute_s": Number,
                  "comm_s": Number, "probe": tuple, "payload": Compressed, "buffers": list,
                  "shard_bytes": tuple, **_FROM_WORKER}),
    "pull": ({"version": int}, {}),
    "block": ({"params": torch.Tensor}, {}),
    "state": ({}, {"model": dict, "optimizer": dict, "params": torch.Tensor, **_FROM_WORKER}),
    "bye": ({}, _FROM_WORKER),
    # profiling (hetrain.engine.measure)
    "steps": ({"batch_sizes": list, "steps": int}, {}),
    "step_times": ({"times": list}, {"overruns": int}),
    "ping": ({"data": torch.Tensor}, {}),
    "model": ({"data": torch.Tensor, "answer": torch.Tensor}, {}),
    "echo": ({"data": torch.Tensor}, {}),
}


def check(msg: Any) -> dict[str, Any]:
    """`msg` if it is a well-formed message, else a MessageError naming what is wrong."""
    if not isinstance(msg, dict):
        raise MessageError(f"a message is a dict, got {type(msg).__name__}")
    kind = msg.get("kind")
    if kind not in SCHEMA:
        raise MessageError(f"unknown message kind {kind!r}")
    required, optional = SCHEMA[kind]
    missing = set(required) - set(msg)
    if missing:
        raise MessageError(f"'{kind}' message lacks {sorted(missing)}")
    for key, value in msg.items():
        if key == "kind":
            continue
        types = required.get(key) or optional.get(key)
        if types is None:
            raise MessageError(f"'{kind}' message has an unknown key {key!r}")
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in
                                            (types if isinstance(types, tuple) else (types,))):
            raise MessageError(f"'{kind}' message: {key} is a {type(value).__name__}")
    return msg
