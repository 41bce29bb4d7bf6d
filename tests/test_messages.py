"""The dist engine's message dataclasses: every kind survives the wire exactly, and what a
peer sends that the annotations do not allow is refused with a line saying why."""

from __future__ import annotations

import dataclasses
import queue
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetrain.cluster import load_cluster
from hetrain.compress import make_compressor
from hetrain.engine import codec, messages, wire
from hetrain.engine.messages import MessageError, from_wire, to_wire
from hetrain.strategies.base import OuterOptimizer, WorkTask
from procs import first_report

_times = {"busy_s": 1.5, "comm_s": 0.25, "idle_s": 0.0, "bytes_sent": 10, "bytes_received": 20}


def _full() -> list[messages.Message]:
    """One message of every kind with every field set (a round trip covers them all)."""
    payload = make_compressor("none").compress(torch.randn(6))
    params = torch.arange(5, dtype=torch.float32)
    return [
        messages.Setup(worker=1, cluster=load_cluster("hetero-4"), flops_per_sample=2.5e6,
                       update="delta", comm="ps", outer=OuterOptimizer(lr=0.5),
                       emulation={"mode": "relative", "time_scale": 2.0},
                       state={"model": {"w": params}, "version": 3},
                       shards={"ranks": [5], "sizes": [3, 2]}, version=3,
                       params=[params[:3], params[3:]], optimizer={"state": {}}),
        messages.Task(task=WorkTask(batch_size=8, local_steps=2),
                      batches=[torch.arange(8), torch.arange(8, 16)], apply_weight=0.5,
                      lr_factor=0.1, params=params, buffers=[torch.ones(2)], version=4),
        messages.Apply(weight=0.25, items=[(0, 0.5), (2, 0.5)], lr_factor=1, lr_scale=0.5),
        messages.Drop(worker=2),
        messages.Stop(),
        messages.Ready(device="cpu", error="no such device", times=_times, overruns=1),
        messages.Push(samples=32, steps=2, loss=0.75, compute_s=0.5, comm_s=0.125,
                      probe=(1.0, 2.0, 3.0), payload=payload, buffers=[torch.zeros(3)],
                      shard_bytes=(100, 200), times=_times, overruns=0),
        messages.Pull(version=7),
        messages.Block(params=params),
        messages.State(model={"w": params}, optimizer={"state": {}, "param_groups": []},
                       params=params, times=_times, overruns=2),
        messages.Bye(times=_times, overruns=0),
        messages.Steps(batch_sizes=[8, 16, 32], steps=4),
        messages.StepTimes(times=[[0.01, 0.02], [0.03, 0.04]], overruns=1),
        messages.Ping(data=torch.zeros(1)),
        messages.Model(data=params, answer=params + 1),
        messages.Echo(data=params),
    ]


def _minimal() -> list[messages.Message]:
    """One message of every kind with its required fields only."""
    out = []
    for msg in _full():
        required = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)
                    if f.default is dataclasses.MISSING}
        out.append(type(msg)(**required))
    return out


def _ids(msgs: list[messages.Message]) -> list[str]:
    return [m.kind for m in msgs]


def _bytes(msg: messages.Message) -> bytes:
    return codec.pack(to_wire(msg)).numpy().tobytes()


def test_every_kind_has_a_dataclass_and_the_examples_cover_them() -> None:
    assert sorted(messages.KINDS) == sorted(_ids(_full()))
    assert len(set(messages.KINDS)) == 16
    for msg in _full():
        unset = [f.name for f in dataclasses.fields(msg) if getattr(msg, f.name) is None]
        assert not unset, (msg.kind, unset)


@pytest.mark.parametrize("msg", _full() + _minimal(), ids=_ids(_full()) + _ids(_minimal()))
def test_round_trip_through_the_wire_is_exact(msg: messages.Message) -> None:
    back = wire.decode(wire.encode(msg))
    assert type(back) is type(msg)
    assert _bytes(back) == _bytes(msg)  # the same fields, types and tensor bytes
    assert from_wire(to_wire(msg)).kind == msg.kind


def test_to_wire_is_a_dict_with_the_kind_and_the_fields_that_are_set() -> None:
    payload = make_compressor("none").compress(torch.ones(2))
    wire_push = to_wire(messages.Push(samples=3, payload=payload))
    assert wire_push == {"kind": "push", "samples": 3, "payload": payload}
    assert wire_push["payload"] is payload  # the values as they are, not copied apart
    assert to_wire(messages.Stop()) == {"kind": "stop"}
    assert to_wire(messages.Setup(worker=0, state=None)) == {"kind": "setup", "worker": 0}


def test_messages_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        messages.Pull(version=1).version = 2  # type: ignore[misc]


@pytest.mark.parametrize("obj, why", [
    ([1, 2], "a message is a dict, got list"),
    ("stop", "a message is a dict, got str"),
    ({"kind": "exec"}, "unknown message kind 'exec'"),
    ({"samples": 3}, "unknown message kind None"),
    ({"kind": ["push"]}, "unknown message kind"),
    ({"kind": "task", "batches": []}, r"'task' message lacks \['task'\]"),
    ({"kind": "model", "data": torch.zeros(1)}, r"'model' message lacks \['answer'\]"),
    ({"kind": "push", "samples": 3, "evil": 1}, "'push' message has an unknown key 'evil'"),
    ({"kind": "stop", "times": {}}, "'stop' message has an unknown key 'times'"),
    ({"kind": "push", "samples": "3"}, "'push' message: samples is a str"),
    ({"kind": "push", "samples": 3.0}, "'push' message: samples is a float"),
    ({"kind": "push", "samples": True}, "'push' message: samples is a bool"),
    ({"kind": "push", "loss": False}, "'push' message: loss is a bool"),
    ({"kind": "drop", "worker": True}, "'drop' message: worker is a bool"),
    ({"kind": "pull", "version": None}, "'pull' message: version is a NoneType"),
    ({"kind": "push", "samples": None}, "'push' message: samples is a NoneType"),
    ({"kind": "block", "params": [1.0]}, "'block' message: params is a list"),
    ({"kind": "push", "probe": [1.0, 2.0, 3.0]}, "'push' message: probe is a list"),
    ({"kind": "setup", "update": "sideways"}, "'setup' message: update is 'sideways'"),
    ({"kind": "setup", "comm": 1}, "'setup' message: comm is a int"),
])
def test_malformed_messages_are_refused(obj: Any, why: str) -> None:
    with pytest.raises(MessageError, match=why):
        from_wire(obj)
    if isinstance(obj, dict) and not isinstance(obj.get("kind"), list):
        with pytest.raises(MessageError, match=why):  # the same through the codec
            wire.decode(codec.pack(obj))


@pytest.mark.parametrize("msg", _full(), ids=_ids(_full()))
def test_every_field_refuses_a_value_of_another_type(msg: messages.Message) -> None:
    """The check follows each field's annotation (no separate table to fall out of step)."""
    good = to_wire(msg)
    for name in good:
        if name == "kind":
            continue
        with pytest.raises(MessageError, match=f"'{msg.kind}' message: {name} is a object"):
            from_wire({**good, name: object()})


@pytest.mark.parametrize("msg", _full(), ids=_ids(_full()))
def test_every_required_field_is_required(msg: messages.Message) -> None:
    good = to_wire(msg)
    for f in dataclasses.fields(msg):
        if f.default is dataclasses.MISSING:
            bad = {k: v for k, v in good.items() if k != f.name}
            with pytest.raises(MessageError, match=rf"'{msg.kind}' message lacks \['{f.name}'\]"):
                from_wire(bad)


def test_an_int_is_a_number_where_a_float_is_allowed() -> None:
    msg = from_wire({"kind": "push", "loss": 1, "compute_s": 0, "comm_s": 2.5})
    assert isinstance(msg, messages.Push) and (msg.loss, msg.compute_s) == (1, 0)


def test_receivers_ask_for_the_kind_and_the_optional_fields_they_need() -> None:
    push = messages.Push(samples=3)
    assert messages.expect(push, messages.Push) is push
    with pytest.raises(MessageError, match="expected a 'pull' message, got 'push'"):
        messages.expect(push, messages.Pull)
    assert messages.present(push.samples, push, "samples") == 3
    with pytest.raises(MessageError, match=r"'push' message lacks \['payload'\]"):
        messages.present(push.payload, push, "payload")


def test_an_annotation_the_check_cannot_follow_is_refused() -> None:
    with pytest.raises(TypeError, match="must be checkable"):
        messages._field(Any, True)
    with pytest.raises(TypeError, match="must be checkable"):
        messages._field(int | Any, False)


# ---- over a real gloo link -----------------------------------------------------------------
def _pair_rank(rank: int, port: int, out: Any) -> None:
    """Rank 1 sends a valid ping, then a push whose samples is a bool (well encoded, so only
    the message check can refuse it); rank 0 receives as the engine does (`wire.pump`)."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        if rank == 1:
            wire.send_obj(messages.Ping(data=torch.arange(3.0)), 0)
            data = codec.pack({"kind": "push", "samples": True})
            dist.send(torch.tensor([data.numel()], dtype=torch.int64), 0)
            dist.send(data, 0)
        else:
            q: queue.Queue[Any] = queue.Queue()
            wire.pump(1, q)  # returns once it stops listening to rank 1
            events = []
            while not q.empty():
                kind, src, obj, _ = q.get()
                events.append((kind, src, obj.kind if kind == "msg" else obj))
            out.put(events)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_peer_that_sends_an_ill_typed_message_is_reported_lost_with_why() -> None:
    port = wire.free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_pair_rank, args=(r, port, out)) for r in (0, 1)]
    events, exitcodes = first_report(out, procs, 90)
    assert events == [("msg", 1, "ping"),
                      ("lost", 1, "rank 1 sent a malformed message: 'push' message: samples "
                                  "is a bool")], events
    assert exitcodes == [0, 0]
