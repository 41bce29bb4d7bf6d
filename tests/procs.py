"""Real `hetrain` processes for the fault and multi-node tests: a small 3-device config, and
`Started`, which tags every process a test starts (the tag is inherited by everything they
spawn) so that all of them, and the network namespaces the test made, are killed after it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

TRIO = """
name = "trio"
engine = "dist"
[cluster]
name = "trio"
sites = [{{ name = "s", lan = {{ bandwidth_Bps = 1e9 }}, wan = {{ bandwidth_Bps = 1e9 }} }}]
devices = [{devices}]
[workload]
model = "mlp"
dataset = "digits"
[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9
[strategy]
name = "{strategy}"
[train]
batch_size = 32
[stop]
max_epochs = {epochs}
target_accuracy = 0.9
[dist]
time_scale = 1.0
worker_timeout_s = 4
"""
DEVICES = '{ name = "a", flops = 4e7 }, { name = "b", flops = 4e7 }, { name = "c", flops = 8e7 }'
HETRAIN = [sys.executable, "-m", "hetrain"]
TAG = "HETRAIN_TEST_PROCS"
SECRET = "0123456789abcdef" * 4


def write_trio(tmp_path: Path, strategy: str = "asp", epochs: float = 4,
               devices: str = DEVICES) -> Path:
    path = tmp_path / f"{strategy}.toml"
    path.write_text(TRIO.format(strategy=strategy, epochs=epochs, devices=devices))
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie (a zombie has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(k) for k in (task / "children").read_text().split()]
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below pid."""
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


def tagged(tag: str) -> list[int]:
    """Live processes whose environment carries the tag."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if f"{TAG}={tag}".encode() in (proc / "environ").read_bytes().split(b"\0") \
                    and alive(int(proc.name)):
                out.append(int(proc.name))
        except OSError:
            continue
    return out


class Started:
    """The processes of one test: all carry `tag`; `kill_all` ends every one of them."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex
        self.procs: list[subprocess.Popen] = []
        self.namespaces: list[str] = []

    def start(self, args: list[str], netns: str = "", secret: bool = True) -> subprocess.Popen:
        """`args` in a session of its own; `secret`: with HETRAIN_SECRET set (several nodes
        need it; one machine makes its own)."""
        env = {**os.environ, TAG: self.tag}
        if secret:
            env["HETRAIN_SECRET"] = SECRET
        cmd = ["ip", "netns", "exec", netns, *args] if netns else args
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=env)
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for _ in range(3):
            for pid in tagged(self.tag):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for ns in self.namespaces:
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                      text=True).stdout.split()
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.2)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=10)
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def finish(proc: subprocess.Popen, timeout_s: float = 90) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, out, err


def wait_rows(run_dir: Path, rows: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until the run has evaluated `rows` times (it is training)."""
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= rows:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()}")
        time.sleep(0.05)
    raise AssertionError(f"no {rows} evaluations within {timeout_s} s")



def first_report(out, procs: list, timeout_s: float) -> tuple[object, list[int | None]]:
    """Start `procs`, return the first thing any puts on the queue `out` and their exit codes,
    and always end them (join, then kill)."""
    for p in procs:
        p.start()
    try:
        report = out.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join(5)
    return report, [p.exitcode for p in procs]
