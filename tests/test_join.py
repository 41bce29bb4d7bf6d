"""A replacement worker joins a running dist job (`hetrain join`, hetrain.engine.join).

The job runs in this process (rank 0; its workers are spawned) so that `fail_at` can kill a
worker; the joiners are real `hetrain join` processes started through tests/procs.py, which
kills every one of them after the test."""

from __future__ import annotations

import json

import pytest

from hetrain.cli import main
from hetrain.config import load_config
from hetrain.engine import auth
from hetrain.engine.dist import fail_at, run_distributed
from hetrain.engine.join import JOIN_FILE
from procs import HETRAIN, Started, finish, free_port, wait_rows, write_trio

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]


def join_cmd(config, runs, *extra: str) -> list[str]:
    return [*HETRAIN, "join", str(config), "--runs-dir", str(runs), *extra]


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_replacement_joins_after_a_worker_dies_and_a_wrong_secret_is_refused(
        tmp_path, started: Started) -> None:
    """Worker 0 dies at its 4th task, worker 1 at its 9th. A joiner with the wrong secret
    asks for slot 0: refused (exit 2, one line), the slot stays free. `hetrain join --worker
    1` takes slot 1 once it frees: its pushes are applied, the run finishes above chance, and
    every process exits. Both joiners start with the run (they wait for their slot)."""
    config = write_trio(tmp_path, "asp", epochs=4)
    runs = tmp_path / "runs"
    bad = started.start(join_cmd(config, runs, "--worker", "0", "--wait", "120"),
                        secret=True)  # HETRAIN_SECRET set, but not the run's
    good = started.start(join_cmd(config, runs, "--worker", "1", "--wait", "120"),
                         secret=False)
    r = run_distributed(load_config(config), run_dir=runs / "trio",
                        faults=fail_at(rank=1, task=3).fail_at(rank=2, task=8))
    s = r.summary
    rc, _, err = finish(bad, 30)
    assert rc == 2 and "secret" in one_line(err), err
    rc, _, err = finish(good, 30)
    assert rc == 0, err
    assert "joined run 'trio' as worker 1" in err and "Traceback" not in err
    assert s["lost_workers"] == [0, 1] and s["joined_workers"] == [1], s
    joined = s["joins"][0]
    assert joined["pushes_before"] == 8  # the dead process's pushes
    assert s["workers"][1]["pushes"] > joined["pushes_before"]
    assert s["applied_samples_by_worker"][1] > joined["applied_before"], s
    assert s["epochs"] >= 4 - 1e-9 and s["final_accuracy"] > 0.6, s  # chance: 0.1
    assert not (runs / "trio" / JOIN_FILE).exists()
    assert not (runs / "trio" / auth.JOIN_SECRET_FILE).exists()


def hetrain_join(capsys, *args: str) -> tuple[int, str]:
    """`hetrain join ARGS` in this process (the CLI's own entry): (exit code, stderr)."""
    rc = main(["join", *args])
    return rc, capsys.readouterr().err


def test_join_refusals_are_one_line(tmp_path, started: Started, capsys, monkeypatch) -> None:
    """All-reduce strategies, no run, an endpoint nobody serves, a run with no free slot, a
    slot that does not exist: exit 2, one line each."""
    ddp, asp = write_trio(tmp_path, "ddp"), write_trio(tmp_path, "asp", epochs=30)
    rc, err = hetrain_join(capsys, str(ddp), "--endpoint", "127.0.0.1:1")
    assert rc == 2 and "all-reduce" in one_line(err) and "torchrun" in err, err
    rc, err = hetrain_join(capsys, str(asp), "--runs-dir", str(tmp_path / "none"))
    assert rc == 2 and "join.json" in one_line(err), err
    rc, err = hetrain_join(capsys, str(asp), "--endpoint", f"127.0.0.1:{free_port()}")
    assert rc == 2 and "no secret to join with" in one_line(err), err
    with monkeypatch.context() as m:
        m.setenv(auth.ENV_SECRET, "0" * 64)
        rc, err = hetrain_join(capsys, str(asp), "--endpoint", f"127.0.0.1:{free_port()}")
    assert rc == 2 and "cannot reach" in one_line(err), err
    runs = tmp_path / "runs"
    run = started.start([*HETRAIN, "run", str(asp), "--runs-dir", str(runs), "--no-plot",
                         "--quiet"], secret=False)
    wait_rows(runs / "trio", 2, run)
    info = json.loads((runs / "trio" / JOIN_FILE).read_text())
    assert info["secret_file"] == auth.JOIN_SECRET_FILE and info["pid"] == run.pid
    assert (runs / "trio" / auth.JOIN_SECRET_FILE).stat().st_mode & 0o777 == 0o600
    rc, err = hetrain_join(capsys, str(asp), "--runs-dir", str(runs))
    assert rc == 2 and "no free slot" in one_line(err), err
    rc, err = hetrain_join(capsys, str(asp), "--runs-dir", str(runs), "--worker", "7")
    assert rc == 2 and "--worker 7" in one_line(err), err


@pytest.mark.slow
def test_a_replacement_rejoins_cadp_at_a_round_boundary(tmp_path, started: Started) -> None:
    """cadp re-plans without the dead device, then with it again when `hetrain join` takes
    its slot; the joiner's deltas are averaged in from the next round on."""
    config = write_trio(tmp_path, "cadp", epochs=8)
    runs = tmp_path / "runs"
    good = started.start(join_cmd(config, runs, "--wait", "120"), secret=False)
    r = run_distributed(load_config(config), run_dir=runs / "trio",
                        faults=fail_at(rank=2, task=2))
    s = r.summary
    rc, _, err = finish(good, 30)
    assert rc == 0 and "joined run 'trio' as worker 1" in err, err
    assert s["lost_workers"] == [1] and s["joined_workers"] == [1], s
    joined = s["joins"][0]
    assert s["applied_samples_by_worker"][1] > joined["applied_before"], s
    assert s["strategy_stats"]["replans"] >= 2
    assert s["epochs"] >= 8 - 1e-9 and s["final_accuracy"] > 0.6, s
