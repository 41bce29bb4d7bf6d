"""The CLI end to end, as a user runs it: a tiny config, report, and clear user errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TINY = """
name = "tiny"
cluster = "hetero-4"
[workload]
model = "mlp"
dataset = "digits"
[strategy]
name = "local_sgd"
local_steps = 2
[train]
batch_size = 16
[stop]
max_epochs = 1.0
target_accuracy = 0.3
"""


def hetrain(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetrain", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.multiproc
def test_run_tiny_config_then_report(tmp_path: Path) -> None:
    (tmp_path / "tiny.toml").write_text(TINY)
    r = hetrain("run", "tiny.toml", "--compare", "ddp", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summaries = json.loads(r.stdout)
    assert [s["strategy"] for s in summaries] == ["local_sgd", "ddp"]
    for name in ("tiny", "tiny-ddp"):
        assert (tmp_path / "runs" / name / "metrics.jsonl").stat().st_size > 0
        assert (tmp_path / "runs" / name / "summary.json").is_file()
    assert (tmp_path / "runs" / "tiny-report" / "time_to_accuracy.png").stat().st_size > 1000
    rep = hetrain("report", "runs/tiny", "runs/tiny-ddp", "--out", "rep", cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    assert "local_sgd" in rep.stdout and "speedup" in rep.stdout
    assert (tmp_path / "rep" / "utilisation.png").stat().st_size > 1000


@pytest.mark.multiproc
def test_compare_with_the_fastest_device_alone(tmp_path: Path) -> None:
    (tmp_path / "tiny.toml").write_text(TINY)
    r = hetrain("run", "tiny.toml", "--compare", "fastest-alone", "--json", "--no-plot",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cluster_run, alone = json.loads(r.stdout)
    assert (cluster_run["strategy"], alone["strategy"]) == ("local_sgd", "ddp")
    assert alone["cluster"] == "hetero-4-fastest" and len(alone["workers"]) == 1
    assert alone["bytes_total"] == 0 and cluster_run["bytes_total"] > 0
    assert alone["epochs"] >= 1.0 and cluster_run["epochs"] >= 1.0  # the same stopping rule


@pytest.mark.multiproc
def test_progress_is_shown_unless_quiet(tmp_path: Path) -> None:
    (tmp_path / "tiny.toml").write_text(TINY)
    loud = hetrain("run", "tiny.toml", "--no-plot", "--set", "stop.max_epochs=0.3", cwd=tmp_path)
    assert loud.returncode == 0 and "tiny [local_sgd]" in loud.stderr
    assert "time to 30% test accuracy" in loud.stdout
    quiet = hetrain("run", "tiny.toml", "--no-plot", "--quiet", "--set", "stop.max_epochs=0.3",
                    cwd=tmp_path)
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == ""


@pytest.mark.multiproc
def test_user_errors_exit_2_without_traceback(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text(TINY.replace('model = "mlp"', 'model = "transformerXL"'))
    cases = [("run", "missing.toml"), ("run", "bad.toml"), ("report", "nowhere"),
             ("run", "bad.toml", "--set", "nokey")]
    errors = {}
    for args in cases:
        r = hetrain(*args, cwd=tmp_path)
        assert r.returncode == 2, (args, r.stderr)
        last = r.stderr.strip().splitlines()[-1]
        assert "Traceback" not in r.stderr and last.startswith("hetrain: error:"), r.stderr
        errors[args] = r.stderr
    assert "choose one of" in errors["run", "bad.toml"]


FAR = """
name = "far"
[cluster]
name = "two-sites"
ps_site = "home"
[[cluster.sites]]
name = "home"
lan = { bandwidth_Bps = 1.25e9, latency_s = 5e-5 }
wan = { bandwidth_Bps = 1.25e6, latency_s = 0.05 }
[[cluster.sites]]
name = "far"
lan = { bandwidth_Bps = 1.25e9, latency_s = 5e-5 }
wan = { bandwidth_Bps = 1.25e6, latency_s = 0.05 }
[[cluster.devices]]
name = "slow"
flops = 2e8
site = "home"
[[cluster.devices]]
name = "fast"
flops = 8e8
site = "far"
count = 3
[workload]
model = "mlp"
dataset = "digits"
[train]
batch_size = 16
"""


@pytest.mark.multiproc
def test_plan_goodput_explains_the_auto_plan(tmp_path: Path) -> None:
    (tmp_path / "far.toml").write_text(FAR)
    r = hetrain("plan", "--goodput", "far.toml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "parameter server in site far; 3 of 4 devices train" in r.stdout
    assert "site home left out: its 200 ms round trip" in r.stdout
    r = hetrain("plan", "--goodput", "far.toml", "--json", cwd=tmp_path)
    plan = json.loads(r.stdout)
    assert plan["ps_site"] == "far" and plan["devices"] == ["fast-0", "fast-1", "fast-2"]
    r = hetrain("plan", cwd=tmp_path)
    assert r.returncode == 2 and "--goodput" in r.stderr and "Traceback" not in r.stderr


def test_a_new_run_of_a_name_moves_the_old_one_aside(tmp_path: Path, monkeypatch) -> None:
    """Nothing is overwritten: runs/<name> -> runs/<name>.1, .2, ...; not on --resume, not
    on a torchrun restart, not on ranks other than 0."""
    from hetrain.config import config_from_dict
    from hetrain.runner import keep_previous_run

    cfg = config_from_dict({"name": "r"})
    run_dir = tmp_path / "r"
    assert keep_previous_run(run_dir, cfg) is None  # nothing there yet
    for k in (1, 2):
        run_dir.mkdir()
        (run_dir / "summary.json").write_text(str(k))
        assert keep_previous_run(run_dir, cfg) == tmp_path / f"r.{k}"
        assert (tmp_path / f"r.{k}" / "summary.json").read_text() == str(k)
    run_dir.mkdir()
    (run_dir / "checkpoint.pt").write_text("x")
    resume = config_from_dict({"name": "r", "dist": {"resume": True}})
    assert keep_previous_run(run_dir, resume) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert keep_previous_run(run_dir, cfg) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("RANK", "2")
    assert keep_previous_run(run_dir, cfg) is None and (run_dir / "checkpoint.pt").is_file()
