"""Faults on real processes, through the command line a user runs: a frozen worker, Ctrl-C,
SIGTERM (then --resume), a ddp run stopped mid-way, a worker killed under `hetrain launch`
and under torchrun.

Each test starts `hetrain` as a subprocess in its own session and, whatever happens, kills
every process it started (the `started` fixture, tests/procs.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from procs import HETRAIN, Started, alive, cmdline, descendants, environ, finish, wait_rows
from procs import write_trio as write_config

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def start(args: list[str], started: Started) -> subprocess.Popen:
    """One machine: the run makes its own secret (HETRAIN_SECRET unset)."""
    return started.start(args, secret=False)


def workers_of(proc: subprocess.Popen) -> list[int]:
    """The spawned worker processes (multiprocessing's spawn children, not its tracker)."""
    return [p for p in descendants(proc.pid) if "spawn_main" in cmdline(p)]


def test_frozen_worker_is_dropped_and_the_command_exits(tmp_path, started) -> None:
    """SIGSTOP at ~0.5 epochs: asp never waits on the frozen worker, yet it is dropped during
    the run, 4 s (the worker timeout) plus the server's evaluation pauses after its last push;
    before, each evaluation reset its deadline to a fresh 4 s, so it was only dropped
    when the run stopped its workers."""
    runs = tmp_path / "runs"
    proc = start([*HETRAIN, "run", str(write_config(tmp_path, epochs=3)), "--runs-dir",
                  str(runs), "--no-plot", "--json"], started)
    wait_rows(runs / "trio", 3, proc)
    workers = workers_of(proc)
    assert len(workers) == 3
    os.kill(workers[0], signal.SIGSTOP)
    rc, out, err = finish(proc)
    assert rc == 0, err
    summary = json.loads(out)[0]
    assert len(summary["lost_workers"]) == 1, (summary, err)
    assert "lost: no message within the worker timeout" in err and "Traceback" not in err
    assert "while the run was ending" not in err, err  # dropped during the run
    assert not [p for p in workers if alive(p)], "a worker process outlived the run"


def test_ctrl_c_checkpoints_and_exits_130(tmp_path, started) -> None:
    """A terminal's Ctrl-C reaches the whole process group: workers ignore it, rank 0
    checkpoints, stops them and exits 130 with one line naming the checkpoint."""
    runs = tmp_path / "runs"
    proc = start([*HETRAIN, "run", str(write_config(tmp_path)), "--runs-dir", str(runs),
                  "--no-plot", "--quiet"], started)
    wait_rows(runs / "trio", 3, proc)
    workers = workers_of(proc)
    os.killpg(proc.pid, signal.SIGINT)
    rc, _, err = finish(proc, 60)
    assert rc == 130, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "stopped by SIGINT" in last and "checkpoint.pt" in last and "--resume" in last
    assert (runs / "trio" / "checkpoint.pt").is_file()
    assert not [p for p in workers if alive(p)]


# Slow: by default test_a_ddp_run_losing_a_worker_stops_with_the_checkpoint_it_promises has
# rank 0 fetch a ddp worker's model into the checkpoint, and the SIGTERM -> checkpoint -> 143
# path runs in test_launch_drops_a_killed_worker_goes_on_and_checkpoints_on_sigterm.
@pytest.mark.slow
def test_sigterm_on_a_ddp_run_checkpoints_the_workers_model(tmp_path, started) -> None:
    """All-reduce strategies keep the model on the workers: rank 0 fetches it from one that
    is waiting, after SIGTERM, before stopping them."""
    runs = tmp_path / "runs"
    proc = start([*HETRAIN, "run", str(write_config(tmp_path, "ddp")), "--runs-dir", str(runs),
                  "--no-plot", "--quiet"], started)
    wait_rows(runs / "trio", 3, proc)
    workers = workers_of(proc)
    proc.send_signal(signal.SIGTERM)
    rc, _, err = finish(proc, 60)
    assert rc == 143, err
    assert "checkpoint.pt" in err.strip().splitlines()[-1]
    assert (runs / "trio" / "checkpoint.pt").is_file()
    assert not [p for p in workers if alive(p)]


def test_a_ddp_run_losing_a_worker_stops_with_the_checkpoint_it_promises(tmp_path,
                                                                          started) -> None:
    """A synchronous run cannot go on without a worker: one line, exit 2, and a checkpoint of
    the model a surviving worker holds."""
    runs = tmp_path / "runs"
    proc = start([*HETRAIN, "run", str(write_config(tmp_path, "ddp")), "--runs-dir", str(runs),
                  "--no-plot", "--quiet"], started)
    wait_rows(runs / "trio", 3, proc)
    os.kill(workers_of(proc)[1], signal.SIGKILL)
    rc, _, err = finish(proc, 60)
    assert rc == 2, err
    last = err.strip().splitlines()[-1]
    assert "cannot go on without its lost worker" in last and "checkpoint.pt" in last, err
    assert (runs / "trio" / "checkpoint.pt").is_file() and "Traceback" not in err


def test_launch_drops_a_killed_worker_goes_on_and_checkpoints_on_sigterm(tmp_path,
                                                                         started) -> None:
    """`hetrain launch` on one machine: SIGKILL to one worker of an asynchronous run drops
    it and the run trains on; SIGTERM to the launcher then checkpoints, stops the other
    workers and exits 143 (no orphans)."""
    runs = tmp_path / "runs"
    proc = start([*HETRAIN, "launch", str(write_config(tmp_path, epochs=8)), "--runs-dir",
                  str(runs), "--no-plot", "--quiet"], started)
    wait_rows(runs / "trio", 3, proc)
    workers = workers_of(proc)
    assert len(workers) == 3
    os.kill(workers[1], signal.SIGKILL)
    rows = len((runs / "trio" / "metrics.jsonl").read_text().splitlines())
    wait_rows(runs / "trio", rows + 2, proc)  # it goes on without the lost worker
    proc.send_signal(signal.SIGTERM)
    rc, _, err = finish(proc, 60)
    assert rc == 143, err
    assert "lost" in err and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "stopped by SIGTERM" in last and "checkpoint.pt" in last, err
    assert (runs / "trio" / "checkpoint.pt").is_file()
    assert not [p for p in workers if alive(p)], "a worker process outlived the launcher"


@pytest.mark.slow
def test_resume_after_sigterm_reaches_the_uncut_accuracy(tmp_path, started) -> None:
    config = write_config(tmp_path)
    cut, uncut = tmp_path / "cut", tmp_path / "uncut"
    proc = start([*HETRAIN, "run", str(config), "--runs-dir", str(cut), "--no-plot", "--quiet"],
                 started)
    wait_rows(cut / "trio", 4, proc)
    proc.send_signal(signal.SIGTERM)
    assert finish(proc, 60)[0] == 143
    rows_before = len((cut / "trio" / "metrics.jsonl").read_text().splitlines())
    resumed = start([*HETRAIN, "run", str(config), "--runs-dir", str(cut), "--no-plot",
                     "--json", "--resume"], started)
    rc, out, err = finish(resumed, 120)
    assert rc == 0, err
    whole = start([*HETRAIN, "run", str(config), "--runs-dir", str(uncut), "--no-plot",
                   "--json"], started)
    rc, out_whole, err = finish(whole, 120)
    assert rc == 0, err
    a, b = json.loads(out)[0], json.loads(out_whole)[0]
    rows = [json.loads(r) for r in (cut / "trio" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) > rows_before  # it went on from the checkpoint's rows
    assert abs(rows[-1]["epoch"] - 4) < 0.1 and a["epochs"] == pytest.approx(b["epochs"], abs=0.1)
    assert b["tta_s"] is not None and a["tta_s"] is not None  # both reach the 90% target
    assert a["best_accuracy"] >= b["best_accuracy"] - 0.03


@pytest.mark.slow
def test_worker_killed_under_torchrun_restarts_and_resumes(tmp_path, started) -> None:
    """torchrun --max-restarts: the killed worker's SIGKILL makes torchrun SIGTERM every
    rank; rank 0 checkpoints, the restarted job resumes from it and finishes."""
    runs = tmp_path / "runs"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "4", "--max-restarts", "1", "--local-ranks-filter", "0"]
    proc = start([*torchrun, "-m", "hetrain", "run", str(write_config(tmp_path, epochs=6)),
                  "--runs-dir", str(runs), "--no-plot", "--json"], started)
    wait_rows(runs / "trio", 3, proc)
    ranks = {environ(p).get("RANK"): p for p in descendants(proc.pid) if "hetrain" in cmdline(p)}
    os.kill(ranks["2"], signal.SIGKILL)
    rc, out, err = finish(proc, 240)
    assert rc == 0, err[-3000:]
    assert "resuming from" in err
    summary = json.loads(out)[0]  # rank 0 of the restarted job (the first was stopped)
    assert summary["epochs"] == pytest.approx(6, abs=0.1)
    assert summary["tta_s"] is not None
