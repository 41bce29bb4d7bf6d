"""train.tensorboard: every evaluation row as TensorBoard scalars beside metrics.jsonl, on both
engines; a clear one-line error up front when the tensorboard package is missing."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import hetrain
from hetrain import validate
from hetrain.cli import main
from hetrain.config import RunConfig, config_from_dict
from hetrain.engine.dist import WorkerLostError, fail_at, run_distributed
from hetrain.engine.setup import prepare
from hetrain.engine.sim import Simulator
from hetrain.errors import ConfigError
from hetrain.runner import run_config

MISSING = "train.tensorboard = true needs the tensorboard package: pip install tensorboard"


def tiny_cfg(name: str = "tb", tensorboard: bool = True, **train: Any) -> RunConfig:
    return config_from_dict({"name": name, "cluster": "homo-4",
                             "workload": {"model": "mlp", "dataset": "digits"},
                             "strategy": {"name": "ddp"},
                             "optimizer": {"scheduler": "StepLR",
                                           "scheduler_options": {"step_size": 5}},
                             "train": {"tensorboard": tensorboard, "eval_every_epochs": 0.1,
                                       **train},
                             "stop": {"max_epochs": 0.5}})


def dist_cfg(**dist: Any) -> RunConfig:
    """ddp on two CPU workers, 0.1 epoch of a small MNIST-1D (as tests/test_dist.py)."""
    devices = [{"name": "slow", "flops": 2e8}, {"name": "fast", "flops": 4e8}]
    cluster = {"name": "pair", "devices": devices,
               "sites": [{"name": "s", "lan": {"bandwidth_Bps": 1e9},
                          "wan": {"bandwidth_Bps": 1e9}}]}
    return config_from_dict({
        "name": "tb-dist", "engine": "dist", "cluster": cluster,
        "workload": {"model": "cnn", "dataset": "mnist1d",
                     "dataset_options": {"num_samples": 4000}},
        "strategy": {"name": "ddp"}, "optimizer": {"lr": 0.05},
        "train": {"batch_size": 32, "eval_every_epochs": 0.02, "tensorboard": True},
        "stop": {"max_epochs": 0.1},
        "dist": {"time_scale": 0.05, "worker_timeout_s": 20.0, "init_timeout_s": 60.0, **dist}})


def jsonl_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float, float]]:
    """(step, value, wall time) of every event of `tag`, as TensorBoard shows them."""
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)]


def writer_threads() -> list[threading.Thread]:
    """The background threads of open event files (SummaryWriter's EventFileWriter)."""
    return [t for t in threading.enumerate() if type(t).__name__ == "_AsyncWriterThread"]


def assert_same_as_jsonl(run_dir: Path) -> None:
    rows = jsonl_rows(run_dir)
    log_dir = run_dir / "tensorboard"
    for tag in ("test_accuracy", "test_loss", "epoch"):
        events = scalars(log_dir, tag)
        assert [s for s, _, _ in events] == [r["updates"] for r in rows], tag
        assert [v for _, v, _ in events] == pytest.approx([r[tag] for r in rows], rel=1e-6)
    # TensorBoard's RELATIVE axis is the run's time (virtual seconds on the simulator)
    wall = [w for _, _, w in scalars(log_dir, "test_accuracy")]
    assert [w - wall[0] for w in wall] == pytest.approx(
        [r["time_s"] - rows[0]["time_s"] for r in rows], abs=1e-3)


def test_sim_run_writes_the_rows_of_metrics_jsonl(tmp_path, digits_mlp) -> None:
    pytest.importorskip("tensorboard")
    r = run_config(tiny_cfg(), runs_root=tmp_path, workload=digits_mlp)
    run_dir = tmp_path / "tb"
    assert len(r.rows) >= 4 and any(p.name.startswith("events.out.tfevents")
                                    for p in (run_dir / "tensorboard").iterdir())
    assert_same_as_jsonl(run_dir)
    lr = scalars(run_dir / "tensorboard", "lr")  # the optional columns too, where present
    assert [v for _, v, _ in lr] == pytest.approx([row["lr"] for row in r.rows], rel=1e-6)
    assert not writer_threads()  # closed at the end of the run


def test_run_that_fails_midway_still_closes_its_events(tmp_path, digits_mlp) -> None:
    pytest.importorskip("tensorboard")
    cfg = tiny_cfg("boom")
    seen: list[dict[str, Any]] = []

    def fail_at_third_row(fraction: float, row: dict[str, Any] | None) -> None:
        seen.append(row or {})
        if len(seen) == 3:
            raise RuntimeError("boom")

    sim = Simulator(prepare(cfg, workload=digits_mlp), tmp_path / "boom", fail_at_third_row)
    with pytest.raises(RuntimeError, match="boom"):
        sim.run()
    assert not writer_threads()
    assert [v for _, v, _ in scalars(tmp_path / "boom" / "tensorboard", "test_accuracy")] == \
        pytest.approx([row["test_accuracy"] for row in seen], rel=1e-6)


def test_default_run_writes_no_tensorboard_dir(tmp_path, digits_mlp) -> None:
    run_config(tiny_cfg("plain", tensorboard=False), runs_root=tmp_path, workload=digits_mlp)
    assert (tmp_path / "plain" / "metrics.jsonl").is_file()
    assert not (tmp_path / "plain" / "tensorboard").exists()


def test_missing_package_is_one_line_and_exit_2_before_training(
        tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(validate, "tensorboard_available", lambda: False)
    monkeypatch.setattr("hetrain.cli.run.run_config", lambda *a, **k: pytest.fail("trained"))
    (tmp_path / "tb.toml").write_text('cluster = "homo-4"\n[workload]\nmodel = "mlp"\n'
                                      'dataset = "digits"\n[train]\ntensorboard = true\n')
    runs = tmp_path / "runs"
    assert main(["run", str(tmp_path / "tb.toml"), "--runs-dir", str(runs), "--quiet"]) == 2
    assert capsys.readouterr().err == f"hetrain: error: {MISSING}\n"
    assert not runs.exists()
    # --set turns it on the same way
    (tmp_path / "off.toml").write_text('cluster = "homo-4"\n')
    assert main(["run", str(tmp_path / "off.toml"), "--set", "train.tensorboard=true",
                 "--runs-dir", str(runs), "--quiet"]) == 2
    assert capsys.readouterr().err == f"hetrain: error: {MISSING}\n"


def test_api_refuses_before_training(tmp_path, monkeypatch, digits_mlp) -> None:
    monkeypatch.setattr(validate, "tensorboard_available", lambda: False)
    with pytest.raises(ValueError, match=f"^{re.escape(MISSING)}$"):
        hetrain.train(digits_mlp.build_model(), digits_mlp.train, runs_dir=tmp_path,
                      tensorboard=True)
    monkeypatch.setattr(validate, "tensorboard_available", lambda: True)
    with pytest.raises(ConfigError, match="pass runs_dir"):
        hetrain.train(digits_mlp.build_model(), digits_mlp.train, tensorboard=True)
    assert not any(tmp_path.iterdir())


def test_api_run_writes_events(tmp_path, digits_mlp) -> None:
    pytest.importorskip("tensorboard")
    r = hetrain.train(digits_mlp.build_model(), digits_mlp.train, test_dataset=digits_mlp.test,
                      cluster="homo-4", strategy="ddp", max_epochs=0.3, name="api",
                      runs_dir=tmp_path, tensorboard=True)
    assert r.summary["config"]["train"]["tensorboard"] is True
    assert_same_as_jsonl(tmp_path / "api")


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_dist_run_writes_events_on_rank_0(tmp_path, mnist1d_cnn_small) -> None:
    pytest.importorskip("tensorboard")
    cfg = dist_cfg()
    run_config(cfg, runs_root=tmp_path, workload=mnist1d_cnn_small)
    assert_same_as_jsonl(tmp_path / cfg.name)
    assert not writer_threads()


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resumed_dist_run_shows_each_step_once(tmp_path, mnist1d_cnn_small) -> None:
    """A run cut after its last checkpoint wrote rows that the resumed run writes again:
    TensorBoard shows the resumed run's values, once per step."""
    pytest.importorskip("tensorboard")
    cfg = dist_cfg(checkpoint_every=2)
    with pytest.raises(WorkerLostError):
        run_distributed(cfg, run_dir=tmp_path / "cut", faults=fail_at(rank=2, task=3),
                        workload=mnist1d_cnn_small)
    assert not writer_threads()
    run_distributed(cfg.replace(train=replace(cfg.train, resume=True)), run_dir=tmp_path / "cut",
                    workload=mnist1d_cnn_small)
    assert len(list((tmp_path / "cut" / "tensorboard").iterdir())) == 2
    rows = jsonl_rows(tmp_path / "cut")
    events = scalars(tmp_path / "cut" / "tensorboard", "test_accuracy")
    assert [s for s, _, _ in events] == [r["updates"] for r in rows]
    assert [v for _, v, _ in events] == pytest.approx([r["test_accuracy"] for r in rows],
                                                      rel=1e-6)
