"""The typed codec of messages and checkpoints: exact round trips, and nothing from a crafted
buffer is executed, allocated beyond its bytes, or accepted when malformed."""

from __future__ import annotations

import collections
import json
import math
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.cluster import load_cluster
from hetrain.compress import make_compressor
from hetrain.config import config_from_dict
from hetrain.engine import codec, messages, wire
from hetrain.engine.setup import prepare
from hetrain.engine.sim import Simulator
from hetrain.strategies import REGISTRY, Strategy, WorkTask


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, np.random.Generator):
        return a.bit_generator.state == b.bit_generator.state  # type: ignore[union-attr]
    if isinstance(a, dict):
        return (type(b) is dict and list(a) == list(b)
                and all(_same(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple, collections.deque)):
        return type(a) is type(b) and len(a) == len(b) and all(  # type: ignore[arg-type]
            _same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[call-overload]
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if type(a).__module__.startswith("hetrain") and hasattr(a, "__dict__"):
        return type(a) is type(b) and _same(vars(a), vars(b))
    return type(a) is type(b) and a == b


def test_round_trip_of_every_supported_kind() -> None:
    obj = {"kind": "x", 3: (1.5, float("nan"), float("-inf"), None, True), "s": {1, 2},
           "q": collections.deque([1, 2], 5), "view": torch.arange(6.0).reshape(2, 3)[:, 1],
           "b": torch.tensor(True), "bf": torch.ones(3, dtype=torch.bfloat16),
           "empty": torch.zeros(0, 4), "n": np.arange(5, dtype=np.int64),
           "ns": np.float32(2.5), "dt": torch.float16, "size": torch.Size([2, 3]),
           "rng": np.random.default_rng(3), "cluster": load_cluster("hetero-4"),
           "task": WorkTask(batch_size=16, local_steps=3), "fs": frozenset({"a"})}
    back = wire.codec.unpack(codec.pack(obj))
    assert _same(obj, back)
    assert back["view"].tolist() == [1.0, 4.0]  # only the view's elements travelled
    tree, tensors = codec.to_tree(obj)
    assert _same(obj, codec.from_tree(json.loads(json.dumps(tree)), tensors))


scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.tuples(inner, inner)
                      | st.dictionaries(st.text(max_size=4) | st.integers(), inner, max_size=4),
                      max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(values)
def test_plain_data_round_trips_exactly(value: object) -> None:
    assert _same(value, codec.unpack(codec.pack(value)))


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_registered_strategy_round_trips_after_training(name: str) -> None:
    """What a checkpoint holds: each strategy's whole state (plans, EMAs, clocks, RNG) and
    the data owner, after a short simulated run."""
    cfg = config_from_dict({"cluster": "hetero-4", "strategy": {"name": name},
                            "workload": {"model": "mlp", "dataset": "digits"},
                            "stop": {"max_epochs": 0.3}})
    sim = Simulator(prepare(cfg))
    sim.run()
    for obj in (sim.strategy, sim.owner):
        assert _same(obj, codec.unpack(codec.pack(obj)))


def _moved_examples() -> list[object]:
    from hetrain.plan.local_steps import FractionalSteps, LocalPlan, OnlineCosts
    from hetrain.profile import Profile, worker_profiles
    from hetrain.strategies.clock_gate import ClockGate

    profile = Profile(worker_profiles(["a", "b"], 8, [0.1, 0.2], [0.01, 0.02], [0.01, 0.02]),
                      1000, 1000, "measured")
    return [LocalPlan((1, 2), 1.0, (1.0, 1.0)), FractionalSteps(2), OnlineCosts(profile),
            ClockGate(2, 1)]


def test_a_moved_class_loads_under_its_old_name() -> None:
    """A checkpoint written before a class moved names it the old way and still loads."""
    examples = {codec._key(type(obj)): obj for obj in _moved_examples()}
    assert set(examples) == set(codec.RENAMED.values())
    for old, new in codec.RENAMED.items():
        tree, tensors = codec.to_tree(examples[new])
        assert tree["o"][0] == new  # written under the new name
        tree["o"][0] = old
        assert _same(examples[new], codec.from_tree(tree, tensors))


def _trained_strategy(name: str) -> Strategy:
    """Strategy `name` after 0.3 simulated epochs of hetero-4 (its state filled in)."""
    cfg = config_from_dict({"cluster": "hetero-4", "strategy": {"name": name},
                            "workload": {"model": "mlp", "dataset": "digits"},
                            "stop": {"max_epochs": 0.3}})
    sim = Simulator(prepare(cfg))
    sim.run()
    return sim.strategy


def test_checkpoints_from_before_the_ema_module_still_load() -> None:
    """The moving averages and per-worker costs became `hetrain.plan.ema` objects; a checkpoint
    written before holds them as plain floats and arrays, and `_upgrade_attrs` reads it back
    as the same state."""
    from hetrain.plan.local_steps import OnlineCosts
    from hetrain.plan.noise import GradientNoiseScale, GradProbe
    from hetrain.profile import Profile, worker_profiles

    noise = GradientNoiseScale(0.2)
    for i in range(3):
        noise.observe(GradProbe(4.0 + i, 16, 1.5, 32))
    old = {"ema_weight": 0.2, "_grad_sq": noise._grad_sq.mean, "_trace": noise._trace.mean,
           "_decay": noise._grad_sq.decay, "probes": 3}
    assert _same(noise, codec.from_tree({"o": [codec._key(GradientNoiseScale), old]}, []))
    del old["probes"]
    with pytest.raises(codec.CodecError, match="older version"):
        codec.from_tree({"o": [codec._key(GradientNoiseScale), old]}, [])

    profile = Profile(worker_profiles(["a", "b"], 8, [0.1, 0.2], [0.01, 0.02], [0.01, 0.02]),
                      1000, 1000, "measured")
    costs = OnlineCosts(profile)
    costs.observe(1, 0.9, 3, 0.1)
    tree, tensors = codec.to_tree(costs)
    attrs = tree["o"][1]
    attrs["step_s"] = attrs.pop("compute_s")
    back = codec.from_tree(tree, tensors)
    assert _same(dict(sorted(vars(costs).items())), dict(sorted(vars(back).items())))

    cadp = _trained_strategy("cadp")
    tree, tensors = codec.to_tree(cadp)
    attrs = tree["o"][1]
    del attrs["costs"]  # plain floats: no tensors of its own
    for name, values in (("_compute_s", cadp.costs.compute_s), ("_comm_s", cadp.costs.comm_s)):
        attrs[name] = {"n": ["float64", [len(values)]]}  # last in the tree, so last tensors
        tensors.append(torch.from_numpy(np.array(values).view(np.uint8)))
    back = codec.from_tree(tree, tensors)
    assert _same(dict(sorted(vars(cadp).items())), dict(sorted(vars(back).items())))


def test_auto_checkpoints_from_before_the_divergence_guard_still_load() -> None:
    """They lack the guard's state: it starts afresh (no cap, no discarded round, the next
    round's loss as the reference); they hold the PS's per-member cost as a float and a count,
    read back as the same `EMA`; everything else is read back as it was."""
    auto = _trained_strategy("auto")
    assert auto._first_loss is not None and auto._member_cost.count > 0
    tree, tensors = codec.to_tree(auto)
    attrs = tree["o"][1]
    guard = ("_first_loss", "_round_cap", "discarded_rounds")
    for name in guard:
        del attrs[name]
    del attrs["_member_cost"]  # plain numbers: no tensors of its own
    attrs["_measured_member_s"] = auto._member_cost.mean
    attrs["_member_rounds"] = auto._member_cost.count
    back = codec.from_tree(tree, tensors)
    assert (back._first_loss, back._round_cap, back.discarded_rounds) == (None, math.inf, 0)
    mine = {k: v for k, v in sorted(vars(auto).items()) if k not in guard}
    assert _same(mine, {k: v for k, v in sorted(vars(back).items()) if k not in guard})


def _crafted(tree: object, tail: bytes = b"") -> torch.Tensor:
    header = json.dumps(tree).encode()
    head = struct.pack("<4sI", codec.MAGIC, len(header)) + header
    return torch.frombuffer(bytearray(head + bytes(-len(head) % 16) + tail), dtype=torch.uint8)


def _nested(depth: int) -> object:
    tree: object = 1
    for _ in range(depth):
        tree = [tree]
    return tree


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path("SHOULD_NOT_EXIST").touch, ())  # type: ignore[return-value]


@pytest.mark.parametrize("data, why", [
    (torch.frombuffer(bytearray(pickle.dumps(_Boom())), dtype=torch.uint8), "bad magic"),
    (_crafted({"o": ["os.system", {}]}), "not allowed"),
    (_crafted({"o": ["builtins.eval", {}]}), "not allowed"),
    (_crafted({"o": ["hetrain.strategies.base.WorkTask", {"__class__": 1}]}), "attribute"),
    (_crafted({"o": ["hetrain.strategies.base.WorkTask", {}]}), "lacks field"),
    (_crafted({"t": ["float32", [1 << 40]]}), "shorter"),
    (_crafted({"t": ["float32", [-1]]}), "bad shape"),
    (_crafted({"t": ["object", [1]]}), "not allowed"),
    (_crafted({"t": ["float32", [1]]}, bytes(32)), "length differs"),
    (_crafted({"n": ["object", [1]]}), "not allowed"),
    (_crafted({"rng": ["Evil", {}]}), "not allowed"),
    (_crafted({"zz": 1}), "unknown tag"),
    (_crafted({"f": "1e999"}), "bad float"),
    (_crafted(_nested(200)), "deeper"),
    (torch.zeros(3, dtype=torch.uint8), "shorter than its prefix"),
])
def test_malformed_or_hostile_buffers_are_refused(data: torch.Tensor, why: str,
                                                  tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(codec.CodecError, match=why):
        codec.unpack(data)
    assert not (tmp_path / "SHOULD_NOT_EXIST").exists()


def test_unknown_types_are_not_encoded() -> None:
    with pytest.raises(codec.CodecError, match="not a type hetrain sends"):
        codec.pack({"f": lambda: 1})
    with pytest.raises(codec.CodecError, match="dtype"):
        codec.pack(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.parametrize("msg, why", [
    ({"kind": "push", "samples": 3, "evil": 1}, "unknown key"),
    ({"kind": "exec"}, "unknown message kind"),
    ({"kind": "task", "batches": []}, "lacks"),
    ({"kind": "push", "samples": "3"}, "samples is a str"),
    ({"kind": "push", "samples": True}, "samples is a bool"),
    ([1, 2], "a message is a dict"),
])
def test_message_schema_refuses_what_the_protocol_does_not_allow(msg: object, why: str) -> None:
    with pytest.raises(messages.MessageError, match=why):
        wire.decode(codec.pack(msg))


def test_real_messages_pass_the_schema() -> None:
    comp = make_compressor("none")
    payload = comp.compress(torch.randn(10))
    push = messages.Push(samples=32, steps=1, loss=0.5, compute_s=0.1, comm_s=0.0,
                         probe=(1.0, 2.0, 3.0), payload=payload, buffers=[], shard_bytes=(0, 0),
                         times={"busy_s": 0.1}, overruns=0)
    back = wire.decode(wire.encode(push))
    assert isinstance(back, messages.Push) and back.payload is not None
    assert torch.equal(comp.extract(back.payload), comp.extract(payload))


def test_announced_length_is_bounded_before_allocating(monkeypatch) -> None:
    monkeypatch.setattr(wire, "_limit", wire._limit)  # restored after the test
    wire.set_message_limit(1000)
    assert wire._limit == 4000 + (256 << 20)
    with pytest.raises(wire.MalformedMessage, match="announced a message of"):
        wire.recv_body(10 ** 15, 1)  # would be torch.empty(10**15) without the bound
    with pytest.raises(wire.MalformedMessage):
        wire.recv_body(-5, 1)
