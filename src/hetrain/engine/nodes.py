"""Several machines without torchrun: a static rendezvous and a small supervisor per node.

Every node runs the same `hetrain launch CFG --nnodes N --node-rank R --nproc-per-node K
--master HOST0:PORT`. The layout is static: node R's processes take the ranks after those of
nodes 0..R-1, so node 0 holds rank 0 (the server, which hosts the rendezvous store bound to
HOST0; see `hetrain.engine.dist.rendezvous_store`). Each process gets RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT (and GLOO_SOCKET_IFNAME with `--ifname`), never
TORCHELASTIC_USE_AGENT_STORE, and runs `hetrain run --engine dist` for its rank.

The supervisor (`Supervisor.run`) differs from torchrun's agent where a training run needs it:
  - a process that dies does not stop the others: an asynchronous strategy drops that worker
    and goes on (the server decides, see `hetrain.engine.dist_server`);
  - SIGINT/SIGTERM reach it alone (its processes have process groups of their own) and are
    passed on: rank 0 gets the signal itself (it checkpoints), the others SIGTERM (they serve
    rank 0 a little longer, see `hetrain.engine.signals`); whoever is left STOP_GRACE_S later
    is killed;
  - its processes die with it (PR_SET_PDEATHSIG = SIGKILL): killing the supervisor orphans
    nothing;
  - no exit barrier: AFTER_RANK0_GRACE_S after rank 0 has exited, the processes left on its
    node are killed;
  - a node that cannot reach the master within dist.init_timeout_s says so in one line
    (`unreachable_message`) and exits 2.
Exit code: rank 0's where it runs; elsewhere 0 when every process exited 0, 128 + the signal
when the supervisor was stopped by one, else the first failure (128 + N for a signal N).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import TextIO

from hetrain.errors import ConfigError

STOP_GRACE_S = 15.0
"""Seconds between passing SIGINT/SIGTERM on and killing the processes still running."""
AFTER_RANK0_GRACE_S = 10.0
"""Seconds the processes on rank 0's node may run on after rank 0 has exited."""
POLL_S = 0.1
PROBE_EVERY_S = 0.5
PR_SET_PDEATHSIG = 1
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT")


def parse_endpoint(text: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) -> (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--master {text!r}: expected HOST:PORT, node 0's address and a port "
                          "for the rendezvous, e.g. --master 10.0.0.1:29400")
    return host, int(port)


def parse_nproc_per_node(text: str, nnodes: int) -> tuple[int, ...]:
    """`K` (every node runs K processes) or `K0,K1,...` (one count per node)."""
    parts = [p.strip() for p in str(text).split(",")]
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ConfigError(f"--nproc-per-node {text!r}: expected a count >= 1 per node, either "
                          "one for every node (e.g. 2) or one per node (e.g. 3,2)")
    counts = tuple(int(p) for p in parts)
    if len(counts) == 1:
        return counts * nnodes
    if len(counts) != nnodes:
        raise ConfigError(f"--nproc-per-node {text}: {len(counts)} counts for --nnodes "
                          f"{nnodes}; give one per node (or one for all)")
    return counts


@dataclass(frozen=True)
class Layout:
    """Which ranks run where: node r runs nprocs[r] processes, after the ranks of nodes < r."""

    nprocs: tuple[int, ...]
    node_rank: int
    master_addr: str
    master_port: int

    def __post_init__(self) -> None:
        if not 0 <= self.node_rank < len(self.nprocs):
            raise ConfigError(f"--node-rank {self.node_rank}: with --nnodes {len(self.nprocs)} "
                              f"it must be 0..{len(self.nprocs) - 1}")

    @property
    def nnodes(self) -> int:
        return len(self.nprocs)

    @property
    def world_size(self) -> int:
        return sum(self.nprocs)

    @property
    def ranks(self) -> range:
        """This node's global ranks (its local ranks 0..K-1 in order)."""
        first = sum(self.nprocs[:self.node_rank])
        return range(first, first + self.nprocs[self.node_rank])

    @property
    def has_rank0(self) -> bool:
        return self.node_rank == 0

    @property
    def endpoint(self) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"{host}:{self.master_port}"

    def check_world(self, devices: int, ps_shards: int) -> None:
        """The processes of all nodes are one per device plus one per PS shard."""
        need = devices + ps_shards
        if self.world_size != need:
            raise ConfigError(
                f"--nproc-per-node {','.join(map(str, self.nprocs))} makes {self.world_size} "
                f"processes over {self.nnodes} nodes, but the cluster has {devices} devices "
                f"and dist.ps_shards = {ps_shards}, so the run needs {need} (one per device + "
                f"one per PS shard; node 0's count includes the server), e.g. "
                f"--nproc-per-node {','.join(map(str, suggest(need, self.nnodes)))}")

    def env(self, rank: int, ifname: str = "") -> dict[str, str]:
        """The variables a process of this node runs with (added to the supervisor's)."""
        local = rank - self.ranks.start
        out = {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(self.world_size),
               "LOCAL_WORLD_SIZE": str(len(self.ranks)), "GROUP_RANK": str(self.node_rank),
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}
        if "TORCH_CPP_LOG_LEVEL" not in os.environ:  # c10d's C++ warnings: one line is ours
            out["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        if ifname:
            out["GLOO_SOCKET_IFNAME"] = ifname
            if "NCCL_SOCKET_IFNAME" not in os.environ:  # NCCL's bootstrap, GPU workers
                out["NCCL_SOCKET_IFNAME"] = ifname
        return out


def suggest(world: int, nnodes: int) -> list[int]:
    """An even split of `world` processes over nodes (node 0 takes the remainder's first)."""
    base, extra = divmod(world, nnodes)
    return [base + (1 if r < extra else 0) for r in range(nnodes)] if base else [1] * nnodes


def node_label() -> str:
    """'node R' under `hetrain launch --nnodes` or torchrun (GROUP_RANK), else 'rank R'."""
    env = os.environ
    if env.get("GROUP_RANK", "").isdigit():
        return f"node {env['GROUP_RANK']}"
    return f"rank {env.get('RANK', '?')}"


def unreachable_message(node: str, endpoint: str, timeout_s: float) -> str:
    return (f"{node} could not reach the rendezvous at {endpoint} within {timeout_s:g} s "
            f"(is node 0 started, and is GLOO_SOCKET_IFNAME/--ifname right?)")


def reachable(host: str, port: int, timeout_s: float) -> bool:
    """One TCP connection attempt (the rendezvous store answers as soon as it listens)."""
    try:
        with socket.create_connection((host, port), timeout=max(0.05, timeout_s)):
            return True
    except OSError:
        return False


def wait_reachable(host: str, port: int, timeout_s: float) -> bool:
    """Until host:port accepts a connection (True) or timeout_s has passed (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if reachable(host, port, min(1.0, left)):
            return True
        if deadline - time.monotonic() <= 0:
            return False
        time.sleep(min(PROBE_EVERY_S, max(0.0, deadline - time.monotonic())))


def check_master_here(host: str, port: int) -> None:
    """Node 0: rank 0 will host the rendezvous on host:port, so it must be an address of
    this machine and the port free (checked before any process starts)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise ConfigError(f"--master {host}: cannot resolve it ({e.strerror or e})") from None
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"--master {host}:{port}: the port is in use on this machine "
                                  "(another run or service holds it); pick another port, the "
                                  "same on every node") from None
            raise ConfigError(f"--master {host}: not an address of this machine ({e.strerror}); "
                              "node 0 runs rank 0, which hosts the rendezvous there: give node "
                              "0's own address (the one the other nodes reach it at)") from None


def _exit_code(returncode: int) -> int:
    """A shell's view of a process's end: 128 + N for signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _die_with_parent(parent: int, libc: ctypes.CDLL) -> None:
    """preexec_fn of a node's process: its own process group (a terminal's Ctrl-C goes to
    the supervisor only, which passes it on once) and SIGKILL when the supervisor dies."""
    os.setpgid(0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the supervisor died before prctl: do not outlive it
        os.kill(os.getpid(), signal.SIGKILL)


class Supervisor:
    """Runs this node's processes (`commands`: global rank -> argv) until they have exited."""

    def __init__(self, layout: Layout, commands: Mapping[int, list[str]], *,
                 init_timeout_s: float, ifname: str = "", err: TextIO | None = None,
                 base_env: Mapping[str, str] | None = None) -> None:
        self.layout = layout
        self.commands = dict(commands)
        self.init_timeout_s = init_timeout_s
        self.ifname = ifname
        self.err = err or sys.stderr
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.exits: dict[int, int] = {}  # rank -> exit code, in the order they exited
        self.signals: list[int] = []  # received, not yet passed on
        self.signalled: int | None = None
        self.kill_at: float | None = None

    def say(self, text: str) -> None:
        print(f"hetrain: node {self.layout.node_rank}: {text}", file=self.err, flush=True)

    def _env(self, rank: int) -> dict[str, str]:
        env = {k: v for k, v in self.base_env.items()
               if not k.startswith("TORCHELASTIC_") and k not in RANK_ENV}
        env.update(self.layout.env(rank, self.ifname))
        return env

    def _start(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        me = os.getpid()
        for rank in self.layout.ranks:
            self.procs[rank] = subprocess.Popen(
                self.commands[rank], env=self._env(rank), close_fds=True,
                preexec_fn=lambda: _die_with_parent(me, libc))

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append(signum)

    def _live(self) -> dict[int, subprocess.Popen[bytes]]:
        return {r: p for r, p in self.procs.items() if r not in self.exits}

    def _send(self, rank: int, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.procs[rank].send_signal(signum)

    def _pass_on(self, signum: int) -> None:
        """Rank 0 gets the signal (it checkpoints and stops the workers); the others SIGTERM
        (they ignore SIGINT: rank 0 ends the run, and serve rank 0 a while on SIGTERM)."""
        if self.signalled is None:
            self.signalled = signum
            self.kill_at = time.monotonic() + STOP_GRACE_S
            self.say(f"{signal.Signals(signum).name}: passed on to ranks "
                     f"{', '.join(map(str, self._live()))}; whoever is left in "
                     f"{STOP_GRACE_S:g} s is killed")
        for rank in self._live():
            self._send(rank, signum if rank == 0 else signal.SIGTERM)

    def _reap(self) -> None:
        for rank, proc in self._live().items():
            rc = proc.poll()
            if rc is None:
                continue
            self.exits[rank] = _exit_code(rc)
            # exit 2 is a user error the rank printed itself (or its node's first rank did)
            if rc not in (0, 2) and self.signalled is None and rank != 0:
                self.say(f"rank {rank} exited with code {_exit_code(rc)} (the other ranks go "
                         "on)")
            if rank == 0 and self._live():
                due = time.monotonic() + AFTER_RANK0_GRACE_S
                self.kill_at = due if self.kill_at is None else min(self.kill_at, due)

    def _kill_left(self, why: str) -> None:
        live = self._live()
        if live:
            self.say(f"ranks {', '.join(map(str, live))} still running {why}; killed")
        for rank in live:
            self._send(rank, signal.SIGKILL)
        for proc in live.values():
            proc.wait()
        self._reap()

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        probe = not self.layout.has_rank0  # rank 0 hosts the store: nothing to reach
        deadline = time.monotonic() + self.init_timeout_s
        next_probe = 0.0
        try:
            self._start()
            while self._live():
                while self.signals:
                    self._pass_on(self.signals.pop(0))
                self._reap()
                now = time.monotonic()
                if probe and now >= next_probe and self.signalled is None:
                    if reachable(self.layout.master_addr, self.layout.master_port, 0.5):
                        probe = False
                    elif time.monotonic() >= deadline:
                        for rank in self._live():
                            self._send(rank, signal.SIGKILL)
                        for proc in self.procs.values():
                            proc.wait()
                        print("hetrain: " + unreachable_message(
                            f"node {self.layout.node_rank}", self.layout.endpoint,
                            self.init_timeout_s), file=self.err, flush=True)
                        return 2
                    next_probe = time.monotonic() + PROBE_EVERY_S
                if self.kill_at is not None and time.monotonic() >= self.kill_at:
                    self._kill_left(f"{STOP_GRACE_S:g} s after the signal"
                                    if self.signalled is not None and 0 not in self.exits
                                    else f"{AFTER_RANK0_GRACE_S:g} s after rank 0 exited")
                    break
                time.sleep(POLL_S)
        finally:
            for proc in self.procs.values():  # an exception here: never leave them behind
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for s, handler in previous.items():
                signal.signal(s, handler)
        return self.exit_code()

    def exit_code(self) -> int:
        if 0 in self.exits:
            return self.exits[0]
        if self.signalled is not None:
            return 128 + self.signalled
        return next((rc for rc in self.exits.values() if rc != 0), 0)
