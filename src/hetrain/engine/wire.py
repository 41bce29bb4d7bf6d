"""Messages over torch.distributed point-to-point: framing, receive-from-any, free ports.

A message is one of `hetrain.engine.messages`' dataclasses; on the wire it is the dict of
plain data and tensors `messages.to_wire` makes, encoded by `hetrain.engine.codec` into one
uint8 tensor: a JSON header and the tensors' raw bytes. Nothing received is unpickled; the
length a peer announces is bounded before anything is allocated, and what it decodes to is
vetted against the message's dataclass (`messages.from_wire`). gloo moves only
tensors of a size both ends know, so a message goes as two sends: an int64 length, then the
bytes. The header is a few hundred bytes, so `nbytes` of a message is within ~1% of the
tensor bytes it carries for anything but tiny ones.

`Inbox` serves whichever worker pushes first (asynchronous receive from any worker); a source
whose message has not come within its deadline, whose connection broke, or that sent a
malformed message is reported as lost instead of blocking (or misleading) the server.

A peer is reached through a `Link`: its rank in the default group (the ranks that started the
run), or rank 0/1 of a private 2-rank gloo group (a worker that joined the running job, see
`hetrain.engine.join`: a fixed gloo world cannot grow). Everything above the link is the same.
"""

from __future__ import annotations

import contextlib
import errno
import queue
import socket
import threading
import time
from collections import deque
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hetrain.engine import codec, messages
from hetrain.engine.messages import Bye, Message, Stop
from hetrain.engine.signals import StopSignal
from hetrain.errors import ConfigError

MAX_MESSAGE_BYTES = 1 << 34
"""Upper bound on one message (16 GiB); `set_message_limit` tightens it to the model's size."""
_limit = MAX_MESSAGE_BYTES


def set_message_limit(model_bytes: int) -> None:
    """Refuse messages far larger than the run can send: a few model copies (a task carries
    parameters, a state reply the optimizer's moments too) plus 256 MiB of indices and
    headers. Bounds what a broken or hostile peer can make this process allocate."""
    global _limit
    _limit = min(MAX_MESSAGE_BYTES, 4 * model_bytes + (256 << 20))


def encode(msg: Message) -> torch.Tensor:
    """A message as one uint8 tensor (`codec.pack`: 0.2 ms each way for a 55 kB model
    message, faster to decode than pickle)."""
    return codec.pack(messages.to_wire(msg))


def decode(data: torch.Tensor) -> Message:
    """Decode and vet a received message; CodecError or MessageError if it is malformed."""
    return messages.from_wire(codec.unpack(data))


class RawGroup(Protocol):
    """A raw, unregistered group's point-to-point methods (c10d's, as a ProcessGroup and a
    backend such as ProcessGroupGloo have them)."""

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> dist.Work: ...


class Link:
    """One peer: `peer` in `group` (None: the default group), or in a raw, unregistered
    group (`raw`: a joiner's private pair, whose send/recv are the c10d methods)."""

    def __init__(self, peer: int, group: dist.ProcessGroup | None = None,
                 raw: RawGroup | None = None) -> None:
        self.peer, self.group, self.raw = peer, group, raw

    def isend(self, t: torch.Tensor) -> Any:
        if self.raw is not None:
            return self.raw.send([t], self.peer, 0)
        return dist.isend(t, self.peer, group=self.group)

    def send(self, t: torch.Tensor) -> None:
        if self.raw is not None:
            self.raw.send([t], self.peer, 0).wait()
        else:
            dist.send(t, self.peer, group=self.group)

    def recv(self, t: torch.Tensor) -> None:
        if self.raw is not None:
            self.raw.recv([t], self.peer, 0).wait()
        else:
            dist.recv(t, self.peer, group=self.group)

    def __repr__(self) -> str:
        return f"Link({self.peer}{', private' if self.raw is not None else ''})"


Peer = int | Link


def as_link(peer: Peer, group: dist.ProcessGroup | None = None) -> Link:
    return peer if isinstance(peer, Link) else Link(peer, group)


def send_obj(obj: Message, dst: Peer, group: dist.ProcessGroup | None = None) -> int:
    """Blocking send of a message; returns the bytes that crossed the wire."""
    link = as_link(dst, group)
    data = encode(obj)
    link.send(torch.tensor([data.numel()], dtype=torch.int64))
    link.send(data)
    return data.numel() + 8


class Outbox:
    """Non-blocking sends: a send to a worker that is not receiving yet must not stall the
    server's loop (it has other workers to serve). The previous send to the same destination
    is completed first, so messages to one worker stay in order. `links` maps a destination
    to its private link (a joined worker); the others are default-group ranks."""

    def __init__(self, links: dict[int, Link] | None = None) -> None:
        self._pending: dict[int, list[Any]] = {}
        self.links = links if links is not None else {}

    def send(self, obj: Message, dst: int) -> int:
        self.wait(dst)
        link = self.links.get(dst) or Link(dst)
        data = encode(obj)
        length = torch.tensor([data.numel()], dtype=torch.int64)
        self._pending[dst] = [link.isend(length), link.isend(data), length, data]
        return data.numel() + 8

    def wait(self, dst: int) -> None:
        pending = self._pending.pop(dst, None)
        if pending is not None:
            pending[0].wait()
            pending[1].wait()

    def forget(self, dst: int) -> None:
        """Drop what is pending to a destination that is gone."""
        self._pending.pop(dst, None)

    def wait_all(self) -> None:
        for dst in list(self._pending):
            with contextlib.suppress(RuntimeError):  # its process died after the send
                self.wait(dst)


class MalformedMessage(ValueError):
    """A peer sent something that is not a valid message (its length, encoding or schema)."""


def recv_body(length: int, src: Peer, group: dist.ProcessGroup | None = None) -> Message:
    link = as_link(src, group)
    if not 0 < length <= _limit:
        raise MalformedMessage(f"rank {link.peer} announced a message of {length} bytes (the "
                               f"limit is {_limit})")
    data = torch.empty(length, dtype=torch.uint8)
    link.recv(data)
    try:
        return decode(data)
    except (codec.CodecError, messages.MessageError) as e:
        raise MalformedMessage(f"rank {link.peer} sent a malformed message: {e}") from None


def recv_obj(src: Peer, group: dist.ProcessGroup | None = None) -> tuple[Message, int]:
    """Blocking receive of one message from `src`: (object, bytes)."""
    obj, nbytes, _, _ = recv_obj_timed(src, group)
    return obj, nbytes


def recv_obj_timed(src: Peer, group: dist.ProcessGroup | None = None
                   ) -> tuple[Message, int, float, float]:
    """`recv_obj`, also timing the wait for the message to start (its 8-byte length) apart
    from the transfer of its body: on a slow link the second is communication, not idling."""
    link = as_link(src, group)
    t0 = time.perf_counter()
    length = torch.empty(1, dtype=torch.int64)
    link.recv(length)
    t1 = time.perf_counter()
    n = int(length.item())
    obj = recv_body(n, link)
    return obj, n + 8, t1 - t0, time.perf_counter() - t1


def pump(src: int, q: Any, link: Link | None = None, tag: Any = None) -> None:
    """Receive src's messages into q as ("msg", src, obj, nbytes), until its last ("bye" or
    "stop") or a broken connection (then ("lost", src, reason, 0)); with a `tag`, each event
    carries it as a fifth item. `link`: how src is reached (default: its rank). Run in a
    thread per source; a thread still blocked in recv when its process exits aborts the
    process."""
    link = link or Link(src)
    extra = () if tag is None else (tag,)
    while True:
        try:
            obj, n = recv_obj(link)
        except MalformedMessage as e:  # stop listening to it: it is broken or hostile
            q.put(("lost", src, str(e), 0, *extra))
            return
        except Exception as e:  # the peer died, hung past the store timeout, or shut down
            q.put(("lost", src, f"connection lost ({str(e).splitlines()[0][:160]})", 0,
                   *extra))
            return
        q.put(("msg", src, obj, n, *extra))
        if isinstance(obj, (Bye, Stop)):
            return


class Inbox:
    """Receive-from-any over point-to-point: one receiver thread per source, one queue.

    gloo's `irecv(...).is_completed()` does not report completion until `wait()` is called,
    so polling it cannot tell which worker pushed first; a thread per source blocked in
    `recv` (gloo pairs are independent, so these run concurrently with the main thread's
    sends) feeds one queue instead. The main thread keeps a deadline per source it expects a
    message from; a source past its deadline, or whose connection broke, is reported lost.
    With a `StopSignal`, SIGINT/SIGTERM raise RunInterrupted out of the wait (rank 0's safe
    point: no update is half-applied there).
    """

    def __init__(self, sources: list[int], stop: StopSignal | None = None) -> None:
        self._stop = stop
        self._q: queue.Queue[tuple[str, int, Any, int, object]] = queue.Queue()
        self._deadline: dict[int, float] = {}
        self._gone: set[int] = set()
        self._stash: deque[tuple[str, int, Any, int]] = deque()
        self._tag: dict[int, object] = {}
        """Per source, the tag of its current receiver: events of a receiver it replaced
        (the hung process a joiner took over from) are dropped, never read as the new one's."""
        for src in sources:
            self.add(src)

    def add(self, src: int, link: Link | None = None) -> None:
        """Receive from src (again: a joined worker in a lost one's slot) through `link`."""
        tag = self._tag[src] = object()
        self._gone.discard(src)
        threading.Thread(target=pump, args=(src, self._q, link, tag), daemon=True,
                         name=f"hetrain-recv-{src}").start()

    def drop(self, src: int) -> None:
        """Stop listening to src (a joiner that failed): what it still sends is ignored."""
        self._gone.add(src)
        self._deadline.pop(src, None)

    def expect(self, src: int, timeout_s: float) -> None:
        """src owes us a message within timeout_s."""
        self._deadline[src] = time.monotonic() + timeout_s

    def postpone(self, src: int, seconds: float) -> None:
        """Move src's deadline `seconds` later (the server paused for an evaluation). By the
        pause, not to a fresh timeout: a hung worker's deadline must still come, however
        often the server evaluates."""
        if src in self._deadline:
            self._deadline[src] += seconds

    def cap(self, timeout_s: float) -> None:
        """Wait at most timeout_s more for anyone (a run that is being stopped)."""
        due = time.monotonic() + timeout_s
        self._deadline = {src: min(d, due) for src, d in self._deadline.items()}

    @property
    def waiting(self) -> list[int]:
        """Sources that owe a message, or whose message `request` held back."""
        return sorted(set(self._deadline) | {ev[1] for ev in self._stash})

    def _get(self, wait_s: float | None = None) -> tuple[str, int, Any, int] | None:
        started = time.monotonic()
        while True:
            if self._stash:  # vetted when first received (its source may be gone since)
                return self._stash.popleft()
            now = time.monotonic()
            src, due = min(self._deadline.items(), key=lambda kv: kv[1])
            wait = max(0.0, due - now)
            tick = wait_s is not None and started + wait_s < due
            if tick:
                assert wait_s is not None
                wait = max(0.0, started + wait_s - now)
            try:
                if self._stop is None:
                    kind, s, obj, n, tag = self._q.get(timeout=wait)
                else:
                    with self._stop.safe_point():
                        kind, s, obj, n, tag = self._q.get(timeout=wait)
            except queue.Empty:
                if tick:
                    return None
                del self._deadline[src]
                self._gone.add(src)
                return "lost", src, "no message within the worker timeout (hung or dead)", 0
            if s in self._gone or tag is not self._tag.get(s):
                continue  # a late message or error of a source already given up (or replaced)
            if kind == "lost":
                self._gone.add(s)
            self._deadline.pop(s, None)
            return kind, s, obj, n

    def next(self) -> tuple[str, int, Any, int]:
        """Block until an expected source delivers or fails: ("msg", src, obj, nbytes) or
        ("lost", src, reason, 0)."""
        ev = self.next_within(None)
        assert ev is not None
        return ev

    def next_within(self, wait_s: float | None) -> tuple[str, int, Any, int] | None:
        """`next`, or None when nothing came within `wait_s` seconds (the caller has
        something else to look at now and then: join requests)."""
        if not self._deadline and not self._stash:
            raise RuntimeError("Inbox.next() with nothing expected")
        return self._get(wait_s)

    def request(self, src: int, timeout_s: float) -> tuple[str, int, Any, int]:
        """Wait for src's next message only; others arriving meanwhile are kept for next()."""
        self.expect(src, timeout_s)
        held = []
        while True:
            ev = self._get()
            assert ev is not None
            if ev[1] == src:
                break
            held.append(ev)
        self._stash.extendleft(reversed(held))  # ahead of any it did not reach, in order
        return ev


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (bind to 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(host: str, port: int) -> None:
    """Raise a ConfigError naming the port if the rendezvous store cannot listen on it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                raise ConfigError(
                    f"port {port} on {host} is already in use (another run or service holds it); "
                    "pick another with --port PORT, or use --port 0 for a free one") from None
            raise
