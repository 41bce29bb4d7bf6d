"""`hetrain run` with [parallel]: a small GPT trained under a searched or saved plan on real
gloo processes (spawned by `python -m hetrain run`), checkpoint + resume, and one-line refusals."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hetrain.cli import main
from hetrain.plan.cost import Plan
from hetrain.plan.graph import gpt_graph
from hetrain.plan.sbp import Mesh
from hetrain.plan.search import template_plan
from procs import HETRAIN, alive, cmdline, descendants, finish, wait_rows, write_trio

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

CLUSTER = """
name = "capped"
sites = [{ name = "s", lan = { bandwidth_Bps = 1e9 }, wan = { bandwidth_Bps = 1e9 } }]
devices = [DEVICES]
"""
TWO = ('{ name = "small", flops = 1e9, memory_bytes = 450000 }, '
       '{ name = "big", flops = 2e9, memory_bytes = 2000000 }')
SMALL_CAP = 450_000
CONFIG = """
name = "NAME"
engine = "dist"
cluster = "cluster.toml"
[workload]
model = "gpt"
dataset = "text"
model_options = { n_layer = 2, n_embd = 32, n_head = 2 }
dataset_options = { max_chars = 40000, block_size = 32 }
[optimizer]
name = "adam"
lr = 0.01
[train]
batch_size = 8
eval_every_epochs = 0.1
[stop]
max_epochs = EPOCHS
[dist]
init_timeout_s = 60
[parallel]
PARALLEL
"""
GPT = dict(n_layer=2, n_embd=32, block=32, batch=8)


def write_config(d: Path, name: str, epochs: float = 0.3, parallel: str = 'plan = "auto"',
                 devices: str = TWO) -> Path:
    (d / "cluster.toml").write_text(CLUSTER.replace("DEVICES", devices))
    p = d / f"{name}.toml"
    p.write_text(CONFIG.replace("NAME", name).replace("EPOCHS", str(epochs))
                 .replace("PARALLEL", parallel))
    return p


def hetrain(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`python -m hetrain ...` in its own process group, killed whole on a timeout."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    p = subprocess.Popen([sys.executable, "-m", "hetrain", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@functools.cache
def vocab() -> int:
    from hetrain.workloads import get_workload

    return get_workload("gpt", "text", model_options={"n_layer": 2, "n_embd": 32, "n_head": 2},
                        dataset_options={"max_chars": 40000, "block_size": 32}).num_classes


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uncut run: plan = "auto" on a cluster whose small device cannot hold the model's
    parameters, gradients and Adam state."""
    d = tmp_path_factory.mktemp("auto")
    cfg = write_config(d, "auto")
    r = hetrain("run", str(cfg), "--runs-dir", str(d / "runs"), "--quiet", "--no-plot")
    assert r.returncode == 0, r.stderr
    return d / "runs" / "auto"


def test_auto_plan_trains_where_the_small_device_cannot_hold_the_model(auto_run: Path,
                                                                         capsys) -> None:
    graph = gpt_graph(2, 32, 2, vocab(), 32, 8)
    assert graph.param_bytes() * (2 + 2) > SMALL_CAP  # params + grads + Adam's 2 states
    summary = json.loads((auto_run / "summary.json").read_text())
    assert summary["strategy"] == "parallel" and summary["engine"] == "dist"
    calib = summary["parallel"]["calibration"]  # parallel.calibrate is on by default
    assert calib["compute"] is False  # dist.emulate = "cluster": compute is padded, not priced
    assert calib["seconds"] < 60 and calib["beta_Bps"] > 0 and "collective_rows" not in calib
    assert summary["parallel"]["uncalibrated_layout"]
    plan = Plan.from_dict(summary["parallel"]["plan"])
    assert summary["parallel"]["memory_bytes"] <= SMALL_CAP
    assert sorted(i for st in plan.stages for i in st.mesh.devices) == [0, 1]
    got = rows(auto_run)
    assert len(got) == 3 and got[-1]["updates"] == 43 and got[-1]["samples"] == 43 * 8
    assert got[-1]["test_loss"] < got[0]["test_loss"] < 4.0  # ln(92) = 4.5 at the start
    assert got[-1]["train_loss"] < got[0]["train_loss"]
    ck = torch.load(auto_run / "checkpoint.pt", weights_only=True)
    assert set(ck["model"]) >= {"tok_emb.weight", "head.weight", "blocks.1.mlp.fc.weight"}
    assert ck["model"]["head.weight"].shape == (vocab(), 32)  # full, not a shard
    from hetrain.report.metrics import RunResult
    from hetrain.report.table import plan_lines

    (line,) = plan_lines([RunResult("auto", [], summary, None)])
    assert line.startswith(f"auto: plan {summary['parallel']['layout']} (predicted ")
    assert "calibrated on the run's processes in" in line and "cluster file alone picked" in line
    assert main(["report", str(auto_run), "--out", str(auto_run.parent / "rep"), "--json"]) == 0
    reported = json.loads(capsys.readouterr().out)
    assert reported["runs"][0]["strategy"] == "parallel"
    assert reported["runs"][0]["final_accuracy"] == pytest.approx(got[-1]["test_accuracy"])
    assert reported["runs"][0]["gbytes_moved"] is None  # not measured: "-", not 0.000


def test_hetrain_plan_prints_each_pipeline_stage_s_time() -> None:
    """`hetrain plan`'s layout of a pipeline says how long each stage takes per micro-batch
    (so a user sees how balanced the stages are) and the bubble, the first stage's time here."""
    from hetrain.cluster import Cluster, Device, Link, Site
    from hetrain.parallel.cli_plan import _layout
    from hetrain.plan.cost import plan_cost
    from hetrain.plan.split import speed_split

    site = Site("s", Link(1e9, 1e-4), Link(1e9, 1e-4))
    cluster = Cluster("c", (Device("slow", 1e9, site="s"), Device("fast", 4e9, site="s")),
                      (site,))
    graph = gpt_graph(2, 32, 2, 64, 32, 8)
    plan = speed_split(graph, cluster, (0, 1), n_micro=4)
    rep = plan_cost(graph, plan, cluster)
    first, second = rep.stage_s
    assert _layout(plan, rep) == (
        f"mesh 1 on devices [0] | mesh 1 on devices [1], 4 micro-batches of "
        f"{first * 1e3:.3g} | {second * 1e3:.3g} ms per stage (bubble {rep.bubble_s:.3g} s)")
    assert rep.bubble_s == pytest.approx(min(first, second))


def test_plan_file_from_hetrain_plan_out_runs(auto_run: Path, tmp_path: Path) -> None:
    write_config(tmp_path, "unused")
    plan_file = tmp_path / "plan.json"
    opts = [f"--model-option={k}={v}" for k, v in
            dict(n_layer=2, n_embd=32, n_head=2, vocab=vocab(), block_size=32).items()]
    assert main(["plan", "--cluster", str(tmp_path / "cluster.toml"), "--model", "gpt",
                 "--batch", "8", *opts, "--out", str(plan_file), "--json",
                 "--calibration", str(auto_run / "summary.json")]) == 0
    saved = json.loads(plan_file.read_text())
    assert saved["format"] == 1 and saved["devices"] == 2 and saved["batch"] == 8
    cfg = write_config(tmp_path, "file", parallel='plan = "plan.json"\nschedule = "1f1b"')
    r = hetrain("run", str(cfg), "--runs-dir", str(tmp_path / "runs"), "--quiet", "--no-plot")
    assert r.returncode == 0, r.stderr
    got, ref = rows(tmp_path / "runs" / "file"), rows(auto_run)
    assert json.loads((tmp_path / "runs" / "file" / "summary.json").read_text())[
        "parallel"]["plan"]["stages"] == saved["stages"]
    # the file holds the plan auto found with the run's calibration: 1F1B trains like GPipe
    # up to float order
    assert [x["test_loss"] for x in got] == pytest.approx([x["test_loss"] for x in ref],
                                                          rel=1e-4)


def test_a_resumed_auto_run_keeps_its_checkpoint_s_plan(tmp_path: Path) -> None:
    """plan = "auto" resumes under the plan its checkpoint was written with (a search at
    another time, calibrated or not, may pick another); a plan file must match it."""
    import dataclasses

    from hetrain.cluster import load_cluster
    from hetrain.config import load_config
    from hetrain.errors import ConfigError
    from hetrain.parallel.train import first_setup, make_setup, save_checkpoint
    from hetrain.workloads import workload_from_config

    cfg = load_config(write_config(tmp_path, "resumed"))
    cfg = cfg.replace(train=dataclasses.replace(cfg.train, resume=True))
    cluster, workload = load_cluster(cfg.cluster), workload_from_config(cfg.workload)
    searched = Plan.from_dict(make_setup(cfg, cluster, workload).plan)
    assert len(searched.stages) == 2
    other = dataclasses.replace(searched, n_micro=2 if searched.n_micro != 2 else 4)
    run_dir = tmp_path / "runs" / "resumed"
    save_checkpoint(run_dir, {}, {}, [], {"config": cfg.to_dict(), "plan": other.to_dict()})
    assert Plan.from_dict(first_setup(cfg, cluster, workload, run_dir).plan) == other
    plan_file = tmp_path / "plan.json"
    searched.save(str(plan_file), {})
    with_file = cfg.replace(parallel=dataclasses.replace(cfg.parallel, plan=str(plan_file)))
    with pytest.raises(ConfigError, match="another plan"):
        first_setup(with_file, cluster, workload, run_dir)


# Slow: by default test_ctrl_c_checkpoints_the_last_step_and_resume_matches_the_uncut_run
# resumes a [parallel] run from its checkpoint to the uncut run's rows and weights.
@pytest.mark.slow
def test_resume_continues_as_the_uncut_run(auto_run: Path, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "auto", epochs=0.2)
    runs = str(tmp_path / "runs")
    r = hetrain("run", str(cfg), "--runs-dir", runs, "--quiet", "--no-plot")
    assert r.returncode == 0, r.stderr
    assert rows(tmp_path / "runs" / "auto")[-1]["updates"] == 29
    r = hetrain("run", str(cfg), "--runs-dir", runs, "--quiet", "--no-plot", "--resume",
                "--set", "stop.max_epochs=0.3")
    assert r.returncode == 0, r.stderr
    got, ref = rows(tmp_path / "runs" / "auto"), rows(auto_run)
    assert [x["updates"] for x in got] == [x["updates"] for x in ref]
    for a, b in zip(got, ref, strict=True):  # the same batches, weights and Adam state
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-6)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
    resumed = torch.load(tmp_path / "runs" / "auto" / "checkpoint.pt", weights_only=True)
    uncut = torch.load(auto_run / "checkpoint.pt", weights_only=True)
    for k, v in uncut["model"].items():
        torch.testing.assert_close(resumed["model"][k], v, rtol=1e-5, atol=1e-6)


def _error(capsys, *args: str) -> str:
    assert main(list(args)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_bad_inputs_exit_2_with_one_line(tmp_path: Path, capsys) -> None:
    cfg = str(write_config(tmp_path, "bad"))
    runs = ["--runs-dir", str(tmp_path / "runs"), "--quiet"]
    assert "not on the simulator" in _error(capsys, "run", cfg, "--engine", "sim", *runs)
    assert "not supported" in _error(capsys, "run", cfg, *runs, "--set", 'workload.model="resnet"',
                                     "--set", 'workload.dataset="digits"',
                                     "--set", "workload.model_options={}",
                                     "--set", "workload.dataset_options={}")
    (tmp_path / "broken.json").write_text('{"stages": [')
    assert "cannot be read" in _error(capsys, "run", cfg, *runs, "--set",
                                      f'parallel.plan="{tmp_path / "broken.json"}"')
    graph = gpt_graph(2, 32, 2, vocab(), 32, 8)
    dp = template_plan(graph, Mesh((2,), (0, 1)), "dp")  # every device holds the whole model
    dp.save(tmp_path / "dp.json", {"devices": 2})
    assert "short by" in _error(capsys, "run", cfg, *runs, "--set",
                                f'parallel.plan="{tmp_path / "dp.json"}"')
    dp.save(tmp_path / "three.json", {"devices": 3})
    assert "3 devices" in _error(capsys, "run", cfg, *runs, "--set",
                                 f'parallel.plan="{tmp_path / "three.json"}"')
    big = gpt_graph(3, 32, 2, vocab(), 32, 8)
    template_plan(big, Mesh((2,), (0, 1)), "dp").save(tmp_path / "other.json", {"devices": 2})
    assert "hetrain plan --model gpt --batch 8" in _error(
        capsys, "run", cfg, *runs, "--set", f'parallel.plan="{tmp_path / "other.json"}"')
    assert "fits no device memory" in _error(capsys, "run", cfg, *runs,
                                             "--set", "train.batch_size=64")
    assert "parallel.schedule" in _error(capsys, "run", cfg, *runs,
                                         "--set", 'parallel.schedule="zb"')
    assert not (tmp_path / "runs" / "bad").exists() or not any(
        (tmp_path / "runs" / "bad").glob("metrics.jsonl"))


@pytest.mark.slow
def test_four_ranks_under_torchrun(tmp_path: Path) -> None:
    """Four devices, two of them too small for the model: a pipeline of two 2-device DTensor
    stages, run by torchrun (each rank its own `hetrain run`)."""
    four = ", ".join(f'{{ name = "d{i}", flops = {1e9 * (1 + i // 2)}, memory_bytes = '
                     f'{450000 if i < 2 else 2000000} }}' for i in range(4))
    cfg = write_config(tmp_path, "four", epochs=0.2, devices=four)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "4", "-m", "hetrain", "run", str(cfg),
                          "--runs-dir", str(tmp_path / "runs"), "--quiet", "--no-plot"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        _, err = p.communicate(timeout=280)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 0, err[-2000:]
    summary = json.loads((tmp_path / "runs" / "four" / "summary.json").read_text())
    plan = Plan.from_dict(summary["parallel"]["plan"])
    assert [len(st.mesh.devices) for st in plan.stages] == [2, 2]
    got = rows(tmp_path / "runs" / "four")
    assert got[-1]["updates"] == 29 and got[-1]["test_loss"] < got[0]["test_loss"]


def test_pack_round_trips_without_pickle() -> None:
    """What [parallel] ranks exchange (weights, optimizer state, groups) goes through the
    codec the strategies' messages use."""
    from hetrain.engine.codec import pack, unpack

    tree = {"w": torch.randn(3, 4), "s": {"step": torch.tensor(5.0), "m": torch.zeros(0)},
            "i": torch.arange(4), "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}], "busy": 1.5}
    back = unpack(pack(tree))
    torch.testing.assert_close(back["w"], tree["w"])
    assert back["s"]["step"].item() == 5.0 and back["s"]["m"].shape == (0,)
    assert back["i"].tolist() == [0, 1, 2, 3] and back["groups"] == [{"lr": 0.1,
                                                                      "betas": (0.9, 0.99)}]
    assert back["busy"] == 1.5


@pytest.mark.slow
def test_one_stage_plan_on_a_subset_leaves_the_other_ranks_idle(tmp_path: Path) -> None:
    """Three devices where only the largest holds the model: the plan is a one-device mesh,
    run by rank 0 while ranks 1 and 2 idle; it trains like the pipeline plan of two devices."""
    three = ('{ name = "a", flops = 1e9, memory_bytes = 450000 }, '
             '{ name = "b", flops = 2e9, memory_bytes = 1000000 }, '
             '{ name = "c", flops = 3e9, memory_bytes = 2000000 }')
    cfg = write_config(tmp_path, "three", epochs=0.2, devices=three)
    r = hetrain("run", str(cfg), "--runs-dir", str(tmp_path / "runs"), "--quiet", "--no-plot")
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "runs" / "three" / "summary.json").read_text())
    plan = Plan.from_dict(summary["parallel"]["plan"])
    assert len(plan.stages) == 1 and plan.stages[0].mesh.devices == (2,)
    got = rows(tmp_path / "runs" / "three")
    assert got[-1]["updates"] == 29 and got[-1]["test_loss"] < got[0]["test_loss"]


# ---- faults: signals, a lost rank, refusals ---------------------------------------------------
def _start(started, *args: str):
    """`python -m hetrain ...` in a session of its own; the `started` fixture kills it and
    everything it spawned, whatever happens."""
    return started.start([*HETRAIN, *args], secret=False)


def _ranks(proc) -> list[int]:
    """The spawned rank processes (multiprocessing's spawn children, not its tracker)."""
    return [p for p in descendants(proc.pid) if "spawn_main" in cmdline(p)]


def _step_of(ckpt: Path) -> int:
    return json.loads(torch.load(ckpt, weights_only=True)["meta"])["step"]


@pytest.mark.slow
def test_ctrl_c_checkpoints_the_last_step_and_resume_matches_the_uncut_run(
        auto_run: Path, tmp_path: Path, started) -> None:
    """A terminal's Ctrl-C reaches every process: rank 0 checkpoints the step every rank
    finished and exits 130 in one line; --resume then gives the uncut run's rows and weights
    (the checkpoint falls between two evaluations: the train loss so far is restored too)."""
    cfg = write_config(tmp_path, "auto", epochs=3)
    runs = tmp_path / "runs"
    proc = _start(started, "run", str(cfg), "--runs-dir", str(runs), "--quiet", "--no-plot")
    wait_rows(runs / "auto", 1, proc)  # the evaluation after step 15
    ranks = _ranks(proc)
    assert len(ranks) == 1
    os.killpg(proc.pid, signal.SIGINT)
    rc, _, err = finish(proc, 60)
    assert rc == 130, err
    last = err.strip().splitlines()[-1]
    assert "stopped by SIGINT" in last and "checkpoint.pt" in last and "--resume" in last, err
    assert "Traceback" not in err
    step = _step_of(runs / "auto" / "checkpoint.pt")
    assert 15 <= step < 43 and f"({step})" in last  # before the uncut run's end
    assert not [p for p in ranks if alive(p)]
    r = hetrain("run", str(cfg), "--runs-dir", str(runs), "--quiet", "--no-plot", "--resume",
                "--set", "stop.max_epochs=0.3")
    assert r.returncode == 0, r.stderr
    got, ref = rows(runs / "auto"), rows(auto_run)
    assert [x["updates"] for x in got] == [x["updates"] for x in ref]
    for a, b in zip(got, ref, strict=True):
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-6)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
    resumed = torch.load(runs / "auto" / "checkpoint.pt", weights_only=True)
    uncut = torch.load(auto_run / "checkpoint.pt", weights_only=True)
    for k, v in uncut["model"].items():
        torch.testing.assert_close(resumed["model"][k], v, rtol=1e-5, atol=1e-6)


def test_a_killed_rank_stops_the_run_in_one_line_and_every_process_exits(tmp_path: Path,
                                                                           started) -> None:
    cfg = write_config(tmp_path, "lost", epochs=3)
    runs = tmp_path / "runs"
    proc = _start(started, "run", str(cfg), "--runs-dir", str(runs), "--quiet", "--no-plot",
                  "--set", "dist.worker_timeout_s=5", "--set", "train.checkpoint_every=10")
    wait_rows(runs / "lost", 1, proc)
    ranks = _ranks(proc)
    assert len(ranks) == 1
    t = time.monotonic()
    os.kill(ranks[0], signal.SIGKILL)
    rc, _, err = finish(proc, 60)
    took = time.monotonic() - t
    assert rc == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("hetrain: error: run 'lost' stopped: rank 1 (device 'big') was lost")
    step = _step_of(runs / "lost" / "checkpoint.pt")
    assert step % 10 == 0 and f"checkpoint.pt (step {step};" in last and "--resume" in last
    assert "Traceback" not in err
    assert took < 20, took  # not the 60 s init_timeout_s
    assert not [p for p in descendants(proc.pid) if alive(p)]


@pytest.mark.slow
def test_a_rank_killed_during_the_start_up_calibration_is_named_in_one_line(
        tmp_path: Path, started) -> None:
    """Four ranks calibrate for several seconds before training (examples/07_autoddl): a
    rank killed then ends the run as a loss in training does, in one line naming it."""
    example = Path(__file__).parents[1] / "examples" / "07_autoddl" / "run.toml"
    runs = tmp_path / "runs"
    proc = _start(started, "run", str(example), "--runs-dir", str(runs), "--quiet", "--no-plot",
                  "--set", "dist.worker_timeout_s=5", "--set", "train.checkpoint=false")
    deadline = time.monotonic() + 60
    while len(_ranks(proc)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(5)  # spawned, imported, joined the group: calibrating (about 10 s here)
    ranks = _ranks(proc)
    os.kill(ranks[1], signal.SIGKILL)  # spawned in rank order: rank 2
    rc, _, err = finish(proc, 90)
    assert rc == 2, err
    last = err.strip().splitlines()[-1]
    assert "rank 2 (device 'mid') was lost during the start-up calibration" in last, err
    assert "Traceback" not in err
    assert not [p for p in descendants(proc.pid) if alive(p)]


@pytest.mark.slow
def test_a_frozen_rank_is_named_within_the_worker_timeout(tmp_path: Path, started) -> None:
    """SIGSTOP: the process lives but answers nothing; collectives time out after
    dist.worker_timeout_s, rank 0 names it and the spawner kills it."""
    cfg = write_config(tmp_path, "frozen", epochs=3)
    runs = tmp_path / "runs"
    proc = _start(started, "run", str(cfg), "--runs-dir", str(runs), "--quiet", "--no-plot",
                  "--set", "dist.worker_timeout_s=4")
    wait_rows(runs / "frozen", 1, proc)
    ranks = _ranks(proc)
    t = time.monotonic()
    os.kill(ranks[0], signal.SIGSTOP)
    rc, _, err = finish(proc, 60)
    took = time.monotonic() - t
    assert rc == 2, err
    last = err.strip().splitlines()[-1]
    assert "rank 1 (device 'big') was lost" in last and "no checkpoint was written yet" in last
    assert 4 <= took < 20, took
    assert not [p for p in ranks if alive(p)]


@pytest.mark.slow
def test_sigterm_to_every_rank_checkpoints_and_exits_143(tmp_path: Path, started) -> None:
    """A launcher forwarding SIGTERM to every process: the other ranks serve on (their grace
    period) until rank 0 has checkpointed the step they agreed on."""
    cfg = write_config(tmp_path, "term", epochs=3)
    runs = tmp_path / "runs"
    proc = _start(started, "run", str(cfg), "--runs-dir", str(runs), "--quiet", "--no-plot")
    wait_rows(runs / "term", 1, proc)
    ranks = _ranks(proc)
    os.killpg(proc.pid, signal.SIGTERM)
    rc, _, err = finish(proc, 60)
    assert rc == 143, err
    last = err.strip().splitlines()[-1]
    step = _step_of(runs / "term" / "checkpoint.pt")
    assert "stopped by SIGTERM" in last and f"({step})" in last and "Traceback" not in err
    assert not [p for p in ranks if alive(p)]


def test_compare_and_a_checkpoint_of_the_other_kind_are_refused(auto_run: Path, tmp_path: Path,
                                                                capsys) -> None:
    cfg = str(write_config(tmp_path, "trio"))
    runs = ["--runs-dir", str(tmp_path / "runs"), "--quiet", "--no-plot"]
    assert "--compare" in _error(capsys, "run", cfg, *runs, "--compare", "asp,ddp")
    trio = str(write_trio(tmp_path, epochs=0.05))
    assert main(["run", trio, "--engine", "sim", *runs]) == 0  # a strategy run's checkpoint
    capsys.readouterr()
    err = _error(capsys, "run", cfg, *runs, "--resume")
    assert "strategy run (strategy 'asp')" in err and "without [parallel]" in err
    other = tmp_path / "other" / "trio"
    other.mkdir(parents=True)
    shutil.copy(auto_run / "checkpoint.pt", other / "checkpoint.pt")
    for engine in ("sim", "dist"):
        err = _error(capsys, "run", trio, "--engine", engine, "--runs-dir", str(other.parent),
                     "--quiet", "--no-plot", "--resume")
        assert "[parallel] run" in err and "no [parallel] table" in err, err


@pytest.mark.slow
def test_four_ranks_one_killed_only_it_is_named(tmp_path: Path, started) -> None:
    """Four spawned ranks (a pipeline of two 2-device DTensor stages), rank 2 killed: the
    survivors report the failure themselves, so only rank 2 is named; all four processes end."""
    four = ", ".join(f'{{ name = "d{i}", flops = {1e9 * (1 + i // 2)}, memory_bytes = '
                     f'{450000 if i < 2 else 2000000} }}' for i in range(4))
    cfg = write_config(tmp_path, "four", epochs=3, devices=four)
    runs = tmp_path / "runs"
    proc = _start(started, "run", str(cfg), "--runs-dir", str(runs), "--quiet", "--no-plot",
                  "--set", "dist.worker_timeout_s=5")
    wait_rows(runs / "four", 1, proc, timeout_s=200)
    ranks = _ranks(proc)
    assert len(ranks) == 3
    t = time.monotonic()
    os.kill(ranks[1], signal.SIGKILL)  # spawned in rank order: rank 2
    rc, _, err = finish(proc, 90)
    took = time.monotonic() - t
    assert rc == 2, err
    last = err.strip().splitlines()[-1]
    assert "stopped: rank 2 (device 'd2') was lost" in last, err
    assert "Traceback" not in err and took < 30, took
    assert not [p for p in ranks if alive(p)]


ROOMY_FOUR = ", ".join(f'{{ name = "d{i}", flops = {1e9 * (1 + i // 2)}, memory_bytes = 4000000 }}'
                      for i in range(4))
CAPPED_FOUR = ", ".join(f'{{ name = "d{i}", flops = {1e9 * (1 + i // 2)}, memory_bytes = '
                       f'{450000 if i < 2 else 2000000} }}' for i in range(4))


def _rank_that_may_die(rv: Any, cfg: Any, setup: Any, dead: int, results: Any) -> None:
    """A [parallel] rank: joins the group, then either dies at once (rank `dead`, as a rank
    OOM-killed while it builds its model would) or trains; puts (rank, outcome, seconds)."""
    from hetrain.cluster import load_cluster
    from hetrain.engine import dist as engine
    from hetrain.parallel.train import train_rank
    from hetrain.workloads import workload_from_config

    workload = workload_from_config(cfg.workload)
    store, _, _ = engine.init_process_group(rv, cfg, None)
    if rv.rank == dead:
        os._exit(1)
    t = time.monotonic()
    try:
        train_rank(cfg, setup, workload, load_cluster(cfg.cluster), None, store=store)
        results.put((rv.rank, "trained", time.monotonic() - t))
    except Exception as e:
        results.put((rv.rank, f"{type(e).__name__}: {e}", time.monotonic() - t))


@pytest.mark.parametrize("devices", [ROOMY_FOUR, CAPPED_FOUR], ids=["mesh", "pipeline"])
def test_a_rank_lost_before_the_plan_is_set_up_is_named_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, devices: str) -> None:
    """Rank 2 dies between joining the group and building the plan (a 4-device mesh, or a
    pipeline of two 2-device stages where two devices are too small for the model): rank 0
    names it, and the phase, in one line within dist.worker_timeout_s (before: the pipeline's
    group creation raised gloo's own error; the mesh's loss was named at step 1)."""
    from hetrain.cluster import load_cluster
    from hetrain.config import load_config
    from hetrain.engine import auth
    from hetrain.engine.dist import Rendezvous
    from hetrain.engine.spawn import Spawner
    from hetrain.engine.wire import free_port
    from hetrain.parallel.train import first_setup
    from hetrain.workloads import workload_from_config

    monkeypatch.chdir(tmp_path)
    path = write_config(tmp_path, "lost-setup", parallel='plan = "auto"\ncalibrate = false',
                        devices=devices)
    path.write_text(path.read_text().replace("[dist]\n", "[dist]\nworker_timeout_s = 5\n"))
    cfg = load_config(path)
    setup = first_setup(cfg, load_cluster(cfg.cluster), workload_from_config(cfg.workload), None)
    stages = [len(st["devices"]) for st in setup.plan["stages"]]
    assert stages == ([4] if devices == ROOMY_FOUR else [2, 2]), stages
    spawner = Spawner()
    results = spawner.queue()
    port, secret = free_port(), auth.new_secret()
    for rank in range(4):
        spawner.start(_rank_that_may_die,
                      (Rendezvous(rank, 4, "127.0.0.1", port, secret=secret), cfg, setup, 2,
                       results), daemon=True)
    try:
        got = {}
        for _ in range(3):
            rank, outcome, seconds = results.get(timeout=90)
            got[rank] = (outcome, seconds)
    finally:
        spawner.reap(1)
    outcome, seconds = got[0]
    assert outcome.startswith("WorkerLostError: run 'lost-setup' stopped: rank 2 (device 'd2') "
                              "was lost during the set-up of the plan's process groups"), got
    assert seconds < 30, got
    assert all(o.startswith("ConnectionLostError") for o, _ in (got[1], got[3])), got
