"""The dist engine's messages: one frozen dataclass per kind, for rank 0, workers and shards.

A kind serves every role that sends it (a shard's `Setup` carries parameters, a worker's the
cluster), so a field some role needs but another does not is optional: it defaults to None and
the receiver that needs it asks for it with `present`. The dataclasses' annotations are the
schema: on the wire a message is a dict with a "kind" (`to_wire`; the codec encodes that, and
nothing is unpickled), and `from_wire` vets what a peer sent against the annotations before
anyone reads it: an unknown kind, a missing or unknown key, or a value of the wrong type (a
bool where an int is expected included; a Literal field's value outside its values) is a
`MessageError`, and the receiver stops that peer with a log line saying which. An absent optional field is left out of the dict, never sent as
null, so on the wire every value has its field's type.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple, TypeAlias, TypeVar, Union

import torch

from hetrain.cluster import Cluster
from hetrain.compress.base import Compressed
from hetrain.strategies.base import Comm, OuterOptimizer, Update, WorkTask


class MessageError(ValueError):
    """A message that is not what the protocol allows."""


# Every message is a value (frozen), built by name (kw_only: `Report`'s optional fields come
# first in its subclasses), and compared by identity (a field-wise == would compare tensors).


# ---- rank 0 -> workers / shards ------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, eq=False)
class Setup:
    """A worker's (its slot, the cluster, update mode, emulation; all-reduce: the initial
    global model, `state`) or a shard's (its block `params`, optimizer state, version)."""

    kind: ClassVar[str] = "setup"
    worker: int | None = None
    cluster: Cluster | None = None
    flops_per_sample: int | float | None = None
    update: Update | None = None
    comm: Comm | None = None
    outer: OuterOptimizer | None = None
    emulation: dict[str, Any] | None = None
    state: dict[str, Any] | None = None
    shards: dict[str, Any] | None = None
    version: int | None = None
    params: list[Any] | None = None
    optimizer: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True, eq=False)
class Task:
    """A WorkTask and its batches' sample indices; PS: block 0 of the parameters and the
    version to pull the others at; all-reduce: the last round's weight riding along."""

    kind: ClassVar[str] = "task"
    task: WorkTask
    batches: list[Any]
    apply_weight: int | float | None = None
    lr_factor: int | float | None = None
    params: torch.Tensor | None = None
    buffers: list[Any] | None = None
    version: int | None = None


@dataclass(frozen=True, kw_only=True, eq=False)
class Apply:
    """All-reduce workers: all-reduce the last update with `weight`; shards: apply the
    Decision's (worker, weight) `items`. `lr_factor`: rank 0's ReduceLROnPlateau factor;
    `lr_scale`: the Decision's (gradient pushes: the step's lr multiplier)."""

    kind: ClassVar[str] = "apply"
    weight: int | float | None = None
    items: list[Any] | None = None
    lr_factor: int | float | None = None
    lr_scale: int | float | None = None


@dataclass(frozen=True, kw_only=True, eq=False)
class Drop:
    """Shards: a worker was lost; forget its pushes and pulls."""

    kind: ClassVar[str] = "drop"
    worker: int


@dataclass(frozen=True, kw_only=True, eq=False)
class Stop:
    """The run is over: answer with `Bye`."""

    kind: ClassVar[str] = "stop"


# ---- workers -> rank 0 / shards, shards -> rank 0 / workers --------------------------------
@dataclass(frozen=True, kw_only=True, eq=False)
class Report:
    """What a worker sends rank 0 carries its cumulative busy/comm/idle seconds and bytes
    (`times`) and its emulation overruns."""

    times: dict[str, Any] | None = None
    overruns: int | None = None


@dataclass(frozen=True, kw_only=True, eq=False)
class Ready(Report):
    """A worker built its replica on `device`, or cannot run as configured (`error`)."""

    kind: ClassVar[str] = "ready"
    device: str | None = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True, eq=False)
class Push(Report):
    """A worker's finished task to rank 0 (its metadata; PS: block 0 of its compressed update
    and its float buffers), or one block of the update to the shard that holds it."""

    kind: ClassVar[str] = "push"
    samples: int | None = None
    steps: int | None = None
    loss: int | float | None = None
    compute_s: int | float | None = None
    comm_s: int | float | None = None
    probe: tuple[Any, ...] | None = None
    payload: Compressed | None = None
    buffers: list[Any] | None = None
    shard_bytes: tuple[Any, ...] | None = None


@dataclass(frozen=True, kw_only=True, eq=False)
class Pull:
    """A worker to a shard: the block once `version` updates are applied."""

    kind: ClassVar[str] = "pull"
    version: int


@dataclass(frozen=True, kw_only=True, eq=False)
class Block:
    """A shard's answer to a `Pull`."""

    kind: ClassVar[str] = "block"
    params: torch.Tensor


@dataclass(frozen=True, kw_only=True, eq=False)
class State(Report):
    """Rank 0's request for the model (empty), or the answer: an all-reduce worker's `model`
    and `optimizer` state dicts, a shard's block `params` and `optimizer`."""

    kind: ClassVar[str] = "state"
    model: dict[str, Any] | None = None
    optimizer: dict[str, Any] | None = None
    params: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True, eq=False)
class Bye(Report):
    """The sender's last message (after a `Stop`, or a worker's to each shard)."""

    kind: ClassVar[str] = "bye"


# ---- profiling (hetrain.engine.measure) ----------------------------------------------------
@dataclass(frozen=True, kw_only=True, eq=False)
class Steps:
    """Time `steps` SGD steps at each batch size."""

    kind: ClassVar[str] = "steps"
    batch_sizes: list[Any]
    steps: int


@dataclass(frozen=True, kw_only=True, eq=False)
class StepTimes:
    """The answer to `Steps`: per batch size, the seconds of each step."""

    kind: ClassVar[str] = "step_times"
    times: list[Any]
    overruns: int | None = None


@dataclass(frozen=True, kw_only=True, eq=False)
class Ping:
    """A probe to echo back (latency)."""

    kind: ClassVar[str] = "ping"
    data: torch.Tensor


@dataclass(frozen=True, kw_only=True, eq=False)
class Model:
    """A model-sized probe each way (bandwidth): `data` goes, `answer` comes back."""

    kind: ClassVar[str] = "model"
    data: torch.Tensor
    answer: torch.Tensor


@dataclass(frozen=True, kw_only=True, eq=False)
class Echo:
    """The answer to a `Ping` or `Model`."""

    kind: ClassVar[str] = "echo"
    data: torch.Tensor


Message: TypeAlias = (Setup | Task | Apply | Drop | Stop | Ready | Push | Pull | Block | State
                     | Bye | Steps | StepTimes | Ping | Model | Echo)
KINDS: dict[str, type[Message]] = {cls.kind: cls for cls in typing.get_args(Message)}


# ---- the wire ------------------------------------------------------------------------------
class _Field(NamedTuple):
    """What a field's annotation allows on the wire."""

    types: tuple[type, ...]
    """The classes `isinstance` checks: a union's members but None, a generic's container
    (`list[Any]` -> list: the elements are the receiver's to read), a Literal's values'."""
    values: tuple[Any, ...] | None
    """A Literal's values (None: any value of `types`)."""
    required: bool


def _field(hint: Any, required: bool) -> _Field:
    """A field's annotation as what `from_wire` checks; TypeError for one it could not check
    (Any, a bare TypeVar): the annotations are the protocol, so each must say something."""
    members = [a for a in typing.get_args(hint) if a is not type(None)] \
        if typing.get_origin(hint) in (Union, types.UnionType) else [hint]
    if len(members) == 1 and typing.get_origin(members[0]) is Literal:
        values = typing.get_args(members[0])
        return _Field(tuple(dict.fromkeys(type(v) for v in values)), values, required)
    classes = tuple(typing.get_origin(m) or m for m in members)
    bad = [c for c in classes if c is Any or not isinstance(c, type)]  # a class since 3.11
    if bad:
        raise TypeError(f"a message field's annotation must be checkable, got {hint!r}")
    return _Field(classes, None, required)


_FIELDS = {kind: {f.name: _field(typing.get_type_hints(cls)[f.name],
                                 f.default is dataclasses.MISSING)
                  for f in dataclasses.fields(cls)}
           for kind, cls in KINDS.items()}
"""kind -> field name -> `_Field`, read off the dataclasses above once."""


def to_wire(msg: Message) -> dict[str, Any]:
    """`msg` as the dict the codec encodes: its kind and its fields that are not None (the
    values as they are: `dataclasses.asdict` would copy them and take nested ones apart)."""
    out: dict[str, Any] = {"kind": msg.kind}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if value is not None:
            out[f.name] = value
    return out


def from_wire(obj: Any) -> Message:
    """The message a peer's decoded dict is, if it is well formed; else a MessageError naming
    what is wrong."""
    if not isinstance(obj, dict):
        raise MessageError(f"a message is a dict, got {type(obj).__name__}")
    kind = obj.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise MessageError(f"unknown message kind {kind!r}")
    schema = _FIELDS[kind]
    missing = [name for name, field in schema.items() if field.required and name not in obj]
    if missing:
        raise MessageError(f"'{kind}' message lacks {sorted(missing)}")
    for key, value in obj.items():
        if key == "kind":
            continue
        if key not in schema:
            raise MessageError(f"'{kind}' message has an unknown key {key!r}")
        allowed, values, _ = schema[key]
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise MessageError(f"'{kind}' message: {key} is a {type(value).__name__}")
        if values is not None and value not in values:
            raise MessageError(f"'{kind}' message: {key} is {value!r}, not one of {values}")
    return KINDS[kind](**{k: v for k, v in obj.items() if k != "kind"})


# ---- receivers -----------------------------------------------------------------------------
M = TypeVar("M", bound=Message)
T = TypeVar("T")


def expect(msg: Message, cls: type[M]) -> M:
    """`msg` if it is of the kind this receiver can take here, else a MessageError."""
    if not isinstance(msg, cls):
        raise MessageError(f"expected a '{cls.kind}' message, got '{msg.kind}'")
    return msg


def present(value: T | None, msg: Message, name: str) -> T:
    """An optional field this receiver needs (`present(setup.cluster, setup, "cluster")` on
    a worker); a MessageError if the sender left it out."""
    if value is None:
        raise MessageError(f"'{msg.kind}' message lacks ['{name}']")
    return value
