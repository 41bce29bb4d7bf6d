"""A replacement worker joins a running job: `hetrain join` takes a lost worker's slot.

A fixed gloo world cannot grow, and a broken gloo pair cannot be reused, so a joiner gets a
link of its own: a 2-rank `ProcessGroupGloo` (rank 0 = the coordinator, rank 1 = the joiner)
built on the run's rendezvous store under `join/<ticket>/pg/`, never registered in the
default world. The coordinator reaches it through a `wire.Link`, so its loop is unchanged.

The protocol, over the store (a few keys; nothing in them is trusted):
  1. rank 0 publishes `join/info` (run name, strategy, free slots) when training starts and
     whenever a slot frees or fills;
  2. the joiner reads it, refuses at once (one line) if the run is all-reduce, has PS shards,
     or has no free slot; else takes a ticket (`join/requests` += 1) and writes the slot it
     wants (`join/<t>/want`, -1: the first free);
  3. rank 0, only while some slot is free, looks at the ticket counter every POLL_S seconds
     (one store round trip), answers `join/<t>/answer` ("slot W" or "refused: why") and, in a
     thread of its own, forms the private group and challenges the joiner
     (`auth.join_challenge`); a joiner that does not prove the run's secret is refused with
     one log line, and nothing it sent is decoded;
  4. the authenticated joiner is admitted like a starting worker: "setup", its "ready", then
     `strategy.on_worker_joined(w)` and tasks. The summary lists every join.

Limits: PS strategies with dist.ps_shards = 1 only (an all-reduce collective cannot take a
member mid-way, and the PS shards talk to the workers over the default group); the joiner
takes the slot's device in the cluster, so it should run where that device is.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import stat
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hetrain.engine import auth
from hetrain.engine.wire import Link
from hetrain.errors import ConfigError

log = logging.getLogger("hetrain.dist")

REQUESTS = "join/requests"
INFO = "join/info"
POLL_S = 0.25
"""How often rank 0 looks for join requests while a slot is free (one store round trip)."""
WANT_GRACE_S = 10.0
"""A ticket whose slot request never came (its joiner died in between) is skipped after this."""
JOIN_FILE = "join.json"
ALLREDUCE_HINT = ("an all-reduce collective cannot take a member mid-way; restart the whole "
                  "job instead (torchrun --max-restarts resumes it from its checkpoint, see "
                  "README: faults)")


@dataclass
class Admitted:
    """A joiner that proved the run's secret over its private link."""

    ticket: int
    worker: int
    link: Link


def _key(ticket: int, name: str) -> str:
    return f"join/{ticket}/{name}"


class JoinDesk:
    """Rank 0's side: publishes the free slots, takes join requests, authenticates joiners.

    `poll` is called from the coordinator's loop; it costs nothing while no slot is free and
    one store round trip per POLL_S otherwise. Forming a joiner's link and its proof run in a
    thread, so a slow or hostile joiner never holds up the run."""

    def __init__(self, store: dist.Store, secret: str, *, run: str, strategy: str, comm: str,
                 ps_shards: int, n_workers: int, timeout_s: float) -> None:
        self.store, self.secret = store, secret
        self.info = {"run": run, "strategy": strategy, "comm": comm, "ps_shards": ps_shards,
                     "workers": n_workers}
        self.timeout = timedelta(seconds=timeout_s)
        self.joinable = comm == "ps" and ps_shards == 1
        self.handled = 0
        self.pending: set[int] = set()
        """Slots promised to a joiner that is not admitted (or refused) yet."""
        self._ready: queue.Queue[Admitted | int] = queue.Queue()
        self._next_poll = 0.0
        self._want_seen: dict[int, float] = {}
        self._refused: list[Any] = []
        """Private groups of refused joiners, kept open so that the refusal reaches them."""
        self.files: list[Path] = []

    # ---- files for `hetrain join` on this machine ----------------------------------------
    def write_files(self, run_dir: Path, endpoint: str, prefix: str, generated: bool) -> None:
        """runs/<name>/join.json (the store's endpoint) and, when the run generated its
        secret (nobody else has it), runs/<name>/.join-secret, mode 0600; both removed by
        `close`."""
        run_dir.mkdir(parents=True, exist_ok=True)
        if generated:
            path = run_dir / auth.JOIN_SECRET_FILE
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.secret)
            os.chmod(path, 0o600)
            self.files.append(path)
        path = run_dir / JOIN_FILE
        path.write_text(json.dumps({"run": self.info["run"], "endpoint": endpoint,
                                    "prefix": prefix, "pid": os.getpid(),
                                    "secret_file": auth.JOIN_SECRET_FILE if generated
                                    else None}) + "\n")
        self.files.append(path)

    def publish(self, free: list[int], ended: bool = False) -> None:
        """The slots a joiner may take now (none for a strategy that cannot take one)."""
        free = sorted(set(free) - self.pending) if self.joinable and not ended else []
        self.store.set(INFO, json.dumps({**self.info, "free": free, "ended": ended}))

    def close(self) -> None:
        """The run is over: no more joins; a joiner admitted too late is told to stop.
        Idempotent (the coordinator closes it before its last drain, run_rank at the end)."""
        with contextlib.suppress(Exception):  # the store may be gone with a failed run
            self.publish([], ended=True)
        while True:
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Admitted):
                from hetrain.engine.messages import Stop
                from hetrain.engine.wire import send_obj
                with contextlib.suppress(Exception):
                    send_obj(Stop(), item.link)
        for path in self.files:
            path.unlink(missing_ok=True)

    # ---- requests ---------------------------------------------------------------------------
    def poll(self, free: list[int]) -> tuple[list[Admitted], list[int]]:
        """(joiners authenticated since the last call, slots whose joiner failed)."""
        admitted: list[Admitted] = []
        failed: list[int] = []
        while True:
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Admitted):
                self.pending.discard(item.worker)
                admitted.append(item)
            else:
                self.pending.discard(item)
                failed.append(item)
        if failed:
            self.publish(free)
        now = time.monotonic()
        if not self.joinable or not set(free) - self.pending or now < self._next_poll:
            return admitted, failed
        self._next_poll = now + POLL_S
        count = self.store.add(REQUESTS, 0)
        while self.handled < count and self._take(self.handled + 1, free):
            self.handled += 1
        return admitted, failed

    def _take(self, ticket: int, free: list[int]) -> bool:
        """Answer one ticket; False: its slot request has not come yet (look again later)."""
        want_key = _key(ticket, "want")
        if not self.store.check([want_key]):
            first = self._want_seen.setdefault(ticket, time.monotonic())
            return time.monotonic() - first > WANT_GRACE_S
        try:
            want = int(self.store.get(want_key).decode())
        except ValueError:
            want = -2
        open_slots = sorted(set(free) - self.pending)
        if want == -1 and open_slots:
            slot = open_slots[0]
        elif want in open_slots:
            slot = want
        else:
            why = "no free slot" if not open_slots else \
                f"worker {want} is not a free slot (free: {open_slots})"
            self.store.set(_key(ticket, "answer"), f"refused: {why}")
            log.warning("hetrain: join request %d refused: %s", ticket, why)
            return True
        self.pending.add(slot)
        self.publish(free)
        self.store.set(_key(ticket, "answer"), f"slot {slot}")
        threading.Thread(target=self._connect, args=(ticket, slot), daemon=True,
                         name=f"hetrain-join-{ticket}").start()
        return True

    def _connect(self, ticket: int, slot: int) -> None:
        """Form the private pair and check the joiner's proof (a thread: it may be slow)."""
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore(_key(ticket, "pg/"), self.store), 0, 2,
                                       self.timeout)
            # torch's stubs omit send/recv on Backend, which ProcessGroupGloo has at run time
            link = Link(1, raw=pg)  # type: ignore[arg-type]
            ok = auth.join_challenge(link, self.secret, ticket)
        except Exception as e:  # it left, or never connected
            log.warning("hetrain: join request %d (worker %d) failed before it proved the "
                        "run's secret: %s", ticket, slot, str(e).splitlines()[0][:160])
            self._ready.put(slot)
            return
        if not ok:
            self._refused.append(pg)
            log.warning("hetrain: join request %d (worker %d) refused: it did not prove this "
                        "run's secret; nothing it sent was read", ticket, slot)
            self._ready.put(slot)
            return
        self._ready.put(Admitted(ticket, slot, link))


# ---- the joiner's side ------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """Where the run's store is, and the secret to prove."""

    host: str
    port: int
    prefix: str
    secret: str


def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--endpoint {text!r}: expected HOST:PORT, e.g. 127.0.0.1:29400")
    return host, int(port)


def _read_private(path: Path) -> str:
    try:
        st = path.stat()
        text = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror})") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or st.st_uid != os.getuid():
        raise ConfigError(f"{path} is not a private file of this user (mode 0600); refusing "
                          "to use it as the run's secret")
    return text


def find_target(run_dir: Path, endpoint: str = "", prefix: str = "",
                wait_s: float = 0.0) -> Target:
    """The run's endpoint (--endpoint, else runs/<name>/join.json, waited for up to wait_s)
    and its secret (HETRAIN_SECRET / HETRAIN_SECRET_FILE, else the run's .join-secret)."""
    info: dict[str, Any] = {}
    path = run_dir / JOIN_FILE
    deadline = time.monotonic() + wait_s
    while not endpoint and not path.is_file() and time.monotonic() < deadline:
        time.sleep(0.25)
    if path.is_file():
        loaded: Any = {}
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
        except OSError:
            pass
        except ValueError:  # not JSON, or not UTF-8: not a file a run wrote
            loaded = None
        if not (isinstance(loaded, dict) and isinstance(loaded.get("endpoint"), str)) \
                and not endpoint:
            raise ConfigError(f"{path} is damaged (not the JSON object a run writes); give "
                              "--endpoint HOST:PORT of the run's rendezvous")
        info = loaded if isinstance(loaded, dict) else {}
    if not endpoint and not info:
        raise ConfigError(f"no running dist run '{run_dir.name}' to join: {path} does not "
                          "exist (it is there while a run started on this machine lasts); "
                          "give --endpoint HOST:PORT of the run's rendezvous")
    host, port = parse_endpoint(endpoint or str(info.get("endpoint", "")))
    secret = auth.configured_secret()
    if not secret:
        secret_file = info.get("secret_file")
        if not secret_file or not (run_dir / str(secret_file)).is_file():
            raise ConfigError(f"no secret to join with: set {auth.ENV_SECRET} (or "
                              f"{auth.ENV_SECRET_FILE}) to the run's secret")
        secret = _read_private(run_dir / str(secret_file))
    return Target(host, port, prefix or str(info.get("prefix", "")), secret)


def _info(store: dist.Store) -> dict[str, Any] | None:
    if not store.check([INFO]):
        return None
    info = json.loads(store.get(INFO).decode())
    return info if isinstance(info, dict) else None


def request_slot(target: Target, run: str, worker: int | None, wait_s: float,
                 timeout_s: float) -> tuple[int, Link, Any]:
    """Take a free slot of the run at `target` and prove the secret: (worker, link to rank 0,
    the private group, to keep it alive). One-line ConfigError for every refusal."""
    from hetrain.engine import nodes
    from hetrain.engine.dist import _gloo_on_loopback

    where = f"{target.host}:{target.port}"
    if not nodes.wait_reachable(target.host, target.port, min(timeout_s, 2.0 + wait_s)):
        raise ConfigError(f"cannot reach the run's rendezvous at {where} (is the run still "
                          "going, and is that its endpoint?)")
    _gloo_on_loopback(target.host)
    timeout = timedelta(seconds=timeout_s)
    try:
        store: dist.Store = dist.TCPStore(target.host, target.port, None, False, timeout)
    except (RuntimeError, dist.DistError) as e:
        raise ConfigError(f"cannot join the run's rendezvous at {where}: "
                          f"{str(e).splitlines()[0][:160]}") from None
    if target.prefix:
        store = dist.PrefixStore(target.prefix, store)
    deadline = time.monotonic() + wait_s
    while True:
        _wait_for_slot(store, where, run, worker, deadline)
        answer, ticket = _ask(store, run, worker, timeout, timeout_s)
        if answer.startswith("slot "):
            break
        if time.monotonic() >= deadline:  # taken by another joiner since, or refused
            raise ConfigError(f"run '{run}' {answer}")
        time.sleep(0.25)
    slot = int(answer.split()[1])
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore(_key(ticket, "pg/"), store), 1, 2, timeout)
        # torch's stubs omit send/recv on Backend, which ProcessGroupGloo has at run time
        link = Link(0, raw=pg)  # type: ignore[arg-type]
        auth.join_respond(link, target.secret, ticket)
    except (RuntimeError, dist.DistError) as e:
        raise ConfigError(f"run '{run}' closed the join link: "
                          f"{str(e).splitlines()[0][:160]}") from None
    return slot, link, pg


def _wait_for_slot(store: dist.Store, where: str, run: str, worker: int | None,
                   deadline: float) -> None:
    """Until join/info shows a slot this joiner may take; a refusal once `deadline` passes."""
    while True:
        info = _info(store)
        if info is None and time.monotonic() < deadline:
            time.sleep(0.25)
            continue
        if info is None:
            raise ConfigError(f"no hetrain run at {where} takes joins yet (it has not started "
                              "training, or it is not a dist run of this hetrain)")
        if info.get("run") != run:
            raise ConfigError(f"the run at {where} is '{info.get('run')}', not '{run}'")
        if info.get("comm") != "ps":
            raise ConfigError(f"run '{run}' uses strategy '{info.get('strategy')}' "
                              f"(all-reduce): {ALLREDUCE_HINT}")
        if info.get("ps_shards", 1) != 1:
            raise ConfigError(f"run '{run}' has dist.ps_shards = {info.get('ps_shards')}: a "
                              "joiner cannot reach its PS shards; restart the job to replace "
                              "a worker")
        if info.get("ended"):
            raise ConfigError(f"run '{run}' has ended")
        n, free = int(info.get("workers", 0)), list(info.get("free", []))
        if worker is not None and not 0 <= worker < n:
            raise ConfigError(f"--worker {worker}: run '{run}' has workers 0..{n - 1}")
        if (free if worker is None else worker in free):
            return
        if time.monotonic() >= deadline:
            what = ("no free slot: all its workers are running or being replaced"
                    if not free else f"worker {worker} is not a free slot (free: {free})")
            raise ConfigError(f"run '{run}': {what}; a slot frees when a worker is lost "
                              "(--wait SECONDS waits for one)")
        time.sleep(0.25)


def _ask(store: dist.Store, run: str, worker: int | None, timeout: timedelta,
         timeout_s: float) -> tuple[str, int]:
    """Take a ticket and ask for the slot: (rank 0's answer, "slot W" or "refused: why";
    the ticket)."""
    ticket = store.add(REQUESTS, 1)
    store.set(_key(ticket, "want"), str(-1 if worker is None else worker))
    answer_key = _key(ticket, "answer")
    try:
        store.wait([answer_key], timeout)
    except (RuntimeError, dist.DistError):
        raise ConfigError(f"run '{run}' did not answer the join request within "
                          f"{timeout_s:g} s (it may have ended)") from None
    return store.get(answer_key).decode(), ticket
