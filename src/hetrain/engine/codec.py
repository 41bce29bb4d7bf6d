"""Typed serialisation for messages and checkpoints: nothing read back is ever unpickled.

An object becomes a JSON tree plus a list of tensors (`to_tree`), and back (`from_tree`):

    None, bool, int, str           as JSON values          list       as a JSON array
    float                          a JSON number, or {"f": "nan" | "inf" | "-inf"}
    tuple / set / frozenset        {"u": [...]} / {"s": [...]} / {"fs": [...]}
    deque                          {"q": [...], "m": maxlen}
    dict (any encodable keys)      {"d": [[key, value], ...]}
    torch.Tensor                   {"t": [dtype, shape]}: the next tensor of the list
    numpy array / scalar           {"n": [dtype, shape]} (also from the list) / {"ns": [dtype, v]}
    torch.dtype / torch.Size       {"dt": "float32"} / {"sz": [...]}
    numpy Generator                {"rng": [bit generator, state]}
    a class of the allowlist       {"o": ["module.Class", {attribute: value}]}

Only the allowlist's classes (hetrain's own value types and the registered strategies) can be
built, without calling their constructors, from attributes that are themselves plain data: a
crafted message or file cannot name a callable, so decoding runs no code of the sender's
choosing. A class whose attributes changed may define a static `_upgrade_attrs(attrs) -> attrs`
that turns an older version's decoded attributes into its own (the class's code, not the
file's), so checkpoints written before the change still load; `RENAMED` does the same for a
class that moved. Every dtype is checked against an allowlist, every shape against the bytes that
carry it, nesting depth and sizes are bounded; anything else is a `CodecError`.

`pack`/`unpack` put the tree and the tensor bytes in one uint8 tensor for the wire:
magic, header length, JSON header, then each tensor's bytes at a 16-byte boundary.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import math
import struct
from typing import Any

import numpy as np
import torch

MAGIC = b"HTW1"
_PREFIX = struct.Struct("<4sI")  # magic, header bytes
MAX_HEADER_BYTES = 64 << 20
MAX_DEPTH = 64
ALIGN = 16

TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in (
        "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
        "uint8", "bool")}
NUMPY_DTYPES = frozenset({"float64", "float32", "float16", "int64", "int32", "int16", "int8",
                          "uint64", "uint32", "uint16", "uint8", "bool"})
BIT_GENERATORS = frozenset({"PCG64", "PCG64DXSM", "Philox", "SFC64", "MT19937"})

# hetrain's value types that messages and checkpoints carry; registered strategies are added
# from the registry (a user's own strategy class is trusted code once imported).
ALLOWED_CLASSES = (
    "hetrain.cluster.Cluster", "hetrain.cluster.Device", "hetrain.cluster.Link",
    "hetrain.cluster.Site",
    "hetrain.compress.base.Compressed", "hetrain.context.RunContext",
    "hetrain.engine.core.DataOwner", "hetrain.engine.core.TaskResult",
    "hetrain.plan.allocate.Allocation", "hetrain.plan.allocate.RoundWork",
    "hetrain.plan.ema.EMA", "hetrain.plan.ema.WorkerCosts",
    "hetrain.plan.goodput.Costs", "hetrain.plan.goodput.GoodputPlan",
    "hetrain.plan.goodput.StatModel",
    "hetrain.plan.noise.GradProbe", "hetrain.plan.noise.GradientNoiseScale",
    "hetrain.plan.local_steps.FractionalSteps", "hetrain.plan.local_steps.LocalPlan",
    "hetrain.plan.local_steps.OnlineCosts",
    "hetrain.profile.profile.Profile", "hetrain.profile.profile.WorkerProfile",
    "hetrain.report.metrics.WorkerTimes",
    "hetrain.strategies.ashl.PlateauSwitch", "hetrain.strategies.clock_gate.ClockGate",
    "hetrain.strategies.base.RunContext",  # its name in older checkpoints
    "hetrain.strategies.base.WorkTask",
    "hetrain.strategies.base.Push", "hetrain.strategies.base.Decision",
    "hetrain.strategies.base.OuterOptimizer",
)
RENAMED = {
    **{f"hetrain.profile.plan_iterations.{name}": f"hetrain.plan.local_steps.{name}"
       for name in ("FractionalSteps", "LocalPlan", "OnlineCosts")},
    "hetrain.strategies.ssp.ClockGate": "hetrain.strategies.clock_gate.ClockGate",
}
"""Old name -> allowlisted name of a class that moved: checkpoints written before the move
name it the old way and must still load."""


class CodecError(ValueError):
    """A value that cannot be encoded, or bytes/trees that are not a valid encoding."""


def _key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_classes: dict[str, type] = {}


def allowed_classes() -> dict[str, type]:
    """The allowlist resolved to classes (lazily: the modules import this one's users)."""
    from hetrain.strategies.registry import REGISTRY
    if ALLOWED_CLASSES[0] not in _classes:
        for name in ALLOWED_CLASSES:
            module, _, qual = name.rpartition(".")
            _classes[name] = getattr(importlib.import_module(module), qual)
        _classes.update({old: _classes[new] for old, new in RENAMED.items()})
    for cls in REGISTRY.values():
        _classes.setdefault(_key(cls), cls)
    return _classes


def allow(cls: type) -> None:
    """Trust one more class: the strategy object a run was given (a user's own class that
    is not registered) must be saved in, and read back from, that run's checkpoints."""
    _classes[_key(cls)] = cls


# ---- encoding -----------------------------------------------------------------------------
def to_tree(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """(JSON-serialisable tree, tensors in order of appearance). Tensors are detached CPU
    tensors (a view travels as its own elements only)."""
    tensors: list[torch.Tensor] = []
    return _enc(obj, tensors, 0), tensors


def _enc(o: Any, ts: list[torch.Tensor], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise CodecError(f"nesting deeper than {MAX_DEPTH}")
    d = depth + 1
    if o is None or isinstance(o, (bool, str)):
        return o
    if isinstance(o, int) and not isinstance(o, np.integer):
        return int(o)
    if isinstance(o, float) and not isinstance(o, np.floating):
        return o if math.isfinite(o) else {"f": repr(o)}
    if isinstance(o, torch.Tensor):
        name = str(o.dtype).removeprefix("torch.")
        if name not in TORCH_DTYPES:
            raise CodecError(f"tensor dtype {o.dtype} is not supported on the wire")
        ts.append(o.detach().cpu())
        return {"t": [name, list(o.shape)]}
    if isinstance(o, np.ndarray):
        if o.dtype.name not in NUMPY_DTYPES:
            raise CodecError(f"numpy dtype {o.dtype} is not supported")
        ts.append(torch.from_numpy(np.ascontiguousarray(o).reshape(-1).view(np.uint8)))
        return {"n": [o.dtype.name, list(o.shape)]}
    if isinstance(o, np.generic):
        if o.dtype.name not in NUMPY_DTYPES:
            raise CodecError(f"numpy dtype {o.dtype} is not supported")
        return {"ns": [o.dtype.name, _enc(o.item(), ts, d)]}
    if isinstance(o, torch.dtype):
        return {"dt": str(o).removeprefix("torch.")}
    if isinstance(o, torch.Size):
        return {"sz": list(o)}
    if isinstance(o, list):
        return list(o) if _plain(o) else [_enc(v, ts, d) for v in o]
    if isinstance(o, tuple) and not hasattr(o, "_fields"):
        return {"u": list(o) if _plain(o) else [_enc(v, ts, d) for v in o]}
    if isinstance(o, (set, frozenset)):
        items = [_enc(v, ts, d) for v in sorted(o, key=repr)]
        return {"fs" if isinstance(o, frozenset) else "s": items}
    if isinstance(o, collections.deque):
        return {"q": [_enc(v, ts, d) for v in o], "m": o.maxlen}
    if isinstance(o, dict):
        return {"d": [[_enc(k, ts, d), _enc(v, ts, d)] for k, v in o.items()]}
    if isinstance(o, np.random.Generator):
        bg = o.bit_generator
        return {"rng": [type(bg).__name__, _enc(bg.state, ts, d)]}
    key = _key(type(o))
    if key not in allowed_classes():
        raise CodecError(f"{key} is not a type hetrain sends or saves (add it to "
                         "hetrain.engine.codec.ALLOWED_CLASSES if it is plain data)")
    return {"o": [key, {k: _enc(v, ts, d) for k, v in vars(o).items()}]}


_SCALARS = frozenset({int, str, bool, type(None)})


def _plain(items: list[Any] | tuple[Any, ...]) -> bool:
    """Only JSON scalars (the common case: histories of numbers): encoded as they are."""
    for v in items:
        t = type(v)
        if t not in _SCALARS and not (t is float and math.isfinite(v)):
            return False
    return True


# ---- decoding -----------------------------------------------------------------------------
class _TensorList:
    """Tensors of a checkpoint (already typed), consumed in order."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._it = iter(tensors)

    def take(self, dtype: str, shape: list[int], numpy: bool) -> torch.Tensor:
        t = next(self._it, None)
        if not isinstance(t, torch.Tensor):
            raise CodecError("the tree refers to more tensors than there are")
        want = torch.uint8 if numpy else TORCH_DTYPES[dtype]
        size = [_nbytes(dtype, shape, numpy)] if numpy else shape
        if t.dtype != want or list(t.shape) != size:
            raise CodecError(f"tensor {t.dtype}{list(t.shape)} does not match {dtype}{shape}")
        return t

    def finish(self) -> None:
        if next(self._it, None) is not None:
            raise CodecError("more tensors than the tree refers to")


class _Bytes:
    """Tensors of a wire message: consecutive 16-byte-aligned slices of its buffer."""

    def __init__(self, data: torch.Tensor, offset: int) -> None:
        self._data, self._off = data, offset

    def take(self, dtype: str, shape: list[int], numpy: bool) -> torch.Tensor:
        n = _nbytes(dtype, shape, numpy)
        if self._off + n > self._data.numel():
            raise CodecError("message shorter than the tensors its header declares")
        raw = self._data[self._off:self._off + n].clone()
        self._off += n + _pad(n)
        return raw if numpy else raw.view(TORCH_DTYPES[dtype]).reshape(shape)

    def finish(self) -> None:
        if self._off != self._data.numel():
            raise CodecError("message length differs from what its header declares")


def from_tree(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuild what `to_tree` encoded; `tensors` are consumed in order and must all be used."""
    src = _TensorList(tensors)
    obj = _dec(tree, src, 0)
    src.finish()
    return obj


def _shape(v: Any) -> list[int]:
    if not isinstance(v, list) or not all(type(s) is int and s >= 0 for s in v):
        raise CodecError(f"bad shape {v!r}")
    return v


def _pair(v: Any) -> tuple[Any, Any]:
    if not (isinstance(v, list) and len(v) == 2):
        raise CodecError("expected a [name, value] pair")
    return v[0], v[1]


def _dec(n: Any, src: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise CodecError(f"nesting deeper than {MAX_DEPTH}")
    d = depth + 1
    if n is None or isinstance(n, (bool, int, float, str)):
        return n
    if isinstance(n, list):
        return list(n) if _plain(n) else [_dec(v, src, d) for v in n]
    if not isinstance(n, dict) or not n:
        raise CodecError(f"unexpected node {type(n).__name__}")
    tag = next(iter(n))
    v = n[tag]
    if tag in ("t", "n"):
        name, shape = _pair(v)
        if name not in (TORCH_DTYPES if tag == "t" else NUMPY_DTYPES):
            raise CodecError(f"dtype {name!r} is not allowed")
        t = src.take(name, _shape(shape), numpy=tag == "n")
        if tag == "t":
            return t
        return t.numpy().view(np.dtype(name)).reshape(shape)
    if tag == "ns":
        name, value = _pair(v)
        if name not in NUMPY_DTYPES or not isinstance(value, (bool, int, float, dict)):
            raise CodecError(f"bad numpy scalar {v!r}")
        return np.dtype(name).type(_dec(value, src, d))
    if tag == "f":
        if v not in ("nan", "inf", "-inf"):
            raise CodecError(f"bad float {v!r}")
        return float(v)
    if tag == "dt":
        if v not in TORCH_DTYPES:
            raise CodecError(f"dtype {v!r} is not allowed")
        return TORCH_DTYPES[v]
    if tag == "sz":
        return torch.Size(_shape(v))
    if tag == "u":
        return tuple(v) if _plain(_list(v)) else tuple(_dec(x, src, d) for x in v)
    if tag == "s":
        return {_dec(x, src, d) for x in _list(v)}
    if tag == "fs":
        return frozenset(_dec(x, src, d) for x in _list(v))
    if tag == "q":
        maxlen = n.get("m")
        if maxlen is not None and (type(maxlen) is not int or maxlen < 0):
            raise CodecError(f"bad deque maxlen {maxlen!r}")
        return collections.deque((_dec(x, src, d) for x in _list(v)), maxlen)
    if tag == "d":
        out = {}
        for pair in _list(v):
            k, x = _pair(pair)
            out[_dec(k, src, d)] = _dec(x, src, d)
        return out
    if tag == "rng":
        name, state = _pair(v)
        if name not in BIT_GENERATORS:
            raise CodecError(f"bit generator {name!r} is not allowed")
        bg = getattr(np.random, name)()
        try:
            bg.state = _dec(state, src, d)
        except (TypeError, ValueError, KeyError) as e:
            raise CodecError(f"bad {name} state: {e}") from None
        return np.random.Generator(bg)
    if tag == "o":
        return _dec_object(v, src, d)
    raise CodecError(f"unknown tag {tag!r}")


def _list(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise CodecError(f"expected a list, got {type(v).__name__}")
    return v


def _dec_object(v: Any, src: Any, depth: int) -> Any:
    if not (isinstance(v, list) and len(v) == 2 and isinstance(v[1], dict)):
        raise CodecError("bad object node")
    name, attrs = v
    cls = allowed_classes().get(name) if isinstance(name, str) else None
    if cls is None:
        raise CodecError(f"type {name!r} is not allowed")
    if not all(isinstance(k, str) and k.isidentifier() and not k.startswith("__")
               for k in attrs):
        raise CodecError(f"bad attribute names for {name}")
    if dataclasses.is_dataclass(cls):
        missing = {f.name for f in dataclasses.fields(cls) if f.init} - set(attrs)
        if missing:
            raise CodecError(f"{name} lacks field(s) {sorted(missing)}")
    values = {k: _dec(x, src, depth) for k, x in attrs.items()}
    upgrade = getattr(cls, "_upgrade_attrs", None)
    if upgrade is not None:
        try:
            values = upgrade(values)
        except (KeyError, TypeError, ValueError) as e:
            raise CodecError(f"{name}: attributes of an older version that do not upgrade "
                             f"({type(e).__name__}: {e})") from None
    obj: object = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


def _nbytes(dtype: str, shape: list[int], numpy: bool = False) -> int:
    size = np.dtype(dtype).itemsize if numpy else TORCH_DTYPES[dtype].itemsize
    return math.prod(shape) * size


# ---- one buffer for the wire ---------------------------------------------------------------
def _pad(n: int) -> int:
    return -n % ALIGN


def pack(obj: Any) -> torch.Tensor:
    """The whole message as one uint8 tensor (one copy of each tensor's bytes)."""
    tree, tensors = to_tree(obj)
    header = json.dumps(tree, separators=(",", ":"), allow_nan=False).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise CodecError(f"message header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    head = _PREFIX.pack(MAGIC, len(header)) + header
    parts = [torch.frombuffer(bytearray(head + bytes(_pad(len(head)))), dtype=torch.uint8)]
    for t in tensors:
        raw = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else \
            torch.empty(0, dtype=torch.uint8)
        parts.append(raw)
        if _pad(raw.numel()):
            parts.append(torch.zeros(_pad(raw.numel()), dtype=torch.uint8))
    return torch.cat(parts)


def unpack(data: torch.Tensor) -> Any:
    """Parse what `pack` wrote; tensors are copies (the receive buffer can be reused)."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise CodecError("a message is a flat uint8 tensor")
    total = data.numel()
    if total < _PREFIX.size:
        raise CodecError(f"message of {total} bytes is shorter than its prefix")
    magic, hlen = _PREFIX.unpack(bytes(data[:_PREFIX.size].tolist()))
    if magic != MAGIC:
        raise CodecError("not a hetrain message (bad magic)")
    if hlen > min(MAX_HEADER_BYTES, total - _PREFIX.size):
        raise CodecError(f"header length {hlen} does not fit the {total}-byte message")
    try:
        tree = json.loads(data[_PREFIX.size:_PREFIX.size + hlen].numpy().tobytes())
    except (ValueError, RecursionError) as e:
        raise CodecError(f"unreadable header: {str(e)[:120]}") from None
    off = _PREFIX.size + hlen
    src = _Bytes(data, off + _pad(off))
    obj = _dec(tree, src, 0)
    src.finish()
    return obj
