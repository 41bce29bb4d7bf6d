"""Simulator checkpoints (train.checkpoint / checkpoint_every / resume): written by default
with a runs dir and not with the flag off; a run cut by SIGINT or a crash and resumed repeats
the uncut run EXACTLY (same metrics.jsonl bytes, same final accuracy); a checkpoint of
another run, engine or a crafted one is refused in one line before any file is touched."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hetrain.api import train
from hetrain.cli import main
from hetrain.config import RunConfig, config_from_dict
from hetrain.engine.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from hetrain.engine.signals import RunInterrupted
from hetrain.errors import ConfigError
from hetrain.runner import run_config
from test_api import Blobs  # three 2-D Gaussian blobs, items (tensor, int)


def cfg_of(strategy: str = "asp", epochs: float = 1.0, optimizer: str = "sgd",
           **train_keys: Any) -> RunConfig:
    """A small MNIST-1D CNN run on hetero-4 (~1-2 s on the simulator)."""
    options = {"local_steps": 4} if strategy == "local_sgd" else {}
    return config_from_dict({
        "optimizer": {"name": optimizer, "lr": 0.05 if optimizer == "sgd" else 0.003},
        "name": "c", "cluster": "hetero-4",
        "workload": {"model": "cnn", "dataset": "mnist1d",
                     "dataset_options": {"num_samples": 2000}},
        "strategy": {"name": strategy, **options},
        "train": {"eval_every_epochs": 0.2, **train_keys}, "stop": {"max_epochs": epochs}})


def summary_without_config(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.pop("config")  # the resumed run's says resume = true
    return summary


def test_checkpoint_is_written_by_default_and_not_with_the_flag_off(tmp_path) -> None:
    on = run_config(cfg_of(epochs=0.4), runs_root=tmp_path / "on", quiet=True)
    state = load_checkpoint(tmp_path / "on" / "c", "asp", engine="sim")
    assert state.engine == "sim" and state.rows == on.rows  # the end of the run
    assert state.version == on.summary["updates"]
    run_dir = tmp_path / "off" / "c"
    run_dir.mkdir(parents=True)
    checkpoint_path(run_dir).write_bytes(b"an earlier run's")
    off = run_config(cfg_of(epochs=0.4, checkpoint=False), runs_root=tmp_path / "off",
                     quiet=True)
    assert not checkpoint_path(run_dir).exists()  # none written, the stale one removed
    assert off.rows == on.rows  # checkpoints change nothing in a run's numbers
    assert (run_dir / "metrics.jsonl").read_bytes() == \
        (tmp_path / "on" / "c" / "metrics.jsonl").read_bytes()


def _cut(how: str, at_row: int):
    rows = [0]

    def progress(fraction: float, row: dict[str, Any] | None) -> None:
        if row is None:
            return
        rows[0] += 1
        if rows[0] == at_row:
            if how == "sigint":  # handled between two events: checkpoint, RunInterrupted
                os.kill(os.getpid(), signal.SIGINT)
            else:  # a crash mid-event: the last periodic checkpoint is what is left
                raise RuntimeError("crash")
    return progress


@pytest.mark.parametrize("strategy, how, train_keys", [
    ("asp", "sigint", {"compression": "topk", "compression_options": {"ratio": 0.05},
                       "compress_pulls": True, "checkpoint_every": 3}),
    ("local_sgd", "crash", {"compression": "topk", "compression_options": {"ratio": 0.05},
                            "local_residual": True, "checkpoint_every": 1}),
    ("auto", "sigint", {}),
    ("auto", "crash", {"optimizer": "adamw", "checkpoint_every": 2}),   # gradient pushes
])
def test_a_resumed_run_repeats_the_uncut_run_exactly(tmp_path, strategy, how,
                                                     train_keys) -> None:
    """EXACT equality (not approximate): the checkpoint holds the whole simulator state."""
    cfg = cfg_of(strategy, **train_keys)
    full = run_config(cfg, runs_root=tmp_path / "full", quiet=True)
    expected = RunInterrupted if how == "sigint" else RuntimeError
    with pytest.raises(expected) as cut:
        run_config(cfg, runs_root=tmp_path / "cut", progress=_cut(how, 3), quiet=True)
    if how == "sigint":
        assert "stopped by SIGINT" in str(cut.value) and "--resume" in str(cut.value)
    cut_state = load_checkpoint(tmp_path / "cut" / "c", strategy, engine="sim")
    assert 0 < cut_state.version < full.summary["updates"]  # cut mid-way
    resumed = run_config(cfg.replace(train=replace(cfg.train, resume=True)),
                         runs_root=tmp_path / "cut", quiet=True)
    assert resumed.final_accuracy == full.final_accuracy
    assert (tmp_path / "cut" / "c" / "metrics.jsonl").read_bytes() == \
        (tmp_path / "full" / "c" / "metrics.jsonl").read_bytes()
    assert summary_without_config(tmp_path / "cut" / "c") == \
        summary_without_config(tmp_path / "full" / "c")


def tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 3))


def test_api_resume_trains_a_finished_run_further_to_the_uncut_accuracy(tmp_path) -> None:
    """hetrain.train(resume=True, max_epochs=more) goes on from the end checkpoint: the same
    model as one uncut run of that length (the cut adds one evaluation row, which changes no
    number of the model); the returned model is the resumed one."""
    quick = dict(test_dataset=Blobs(300, seed=1), cluster="hetero-4", strategy="ssp",
                 batch_size=16, optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
                 name="blobs")
    full = train(tiny, Blobs(1200), max_epochs=1.0, runs_dir=tmp_path / "full", **quick)
    short = train(tiny, Blobs(1200), max_epochs=0.5, runs_dir=tmp_path / "cut", **quick)
    assert short.summary["epochs"] < 0.6
    again = train(tiny, Blobs(1200), max_epochs=0.5, runs_dir=tmp_path / "cut", resume=True,
                  **quick)  # nothing left to do: the same rows, and the checkpoint stays whole
    assert again.rows == short.rows
    more = train(tiny, Blobs(1200), max_epochs=1.0, runs_dir=tmp_path / "cut", resume=True,
                 **quick)
    assert more.final_accuracy == full.final_accuracy > 0.8
    assert more.summary["updates"] == full.summary["updates"]
    assert more.rows[:len(short.rows)] == short.rows  # the first attempt's rows are kept
    for a, b in zip(more.model.state_dict().values(), full.model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="pass the runs_dir"):
        train(tiny, Blobs(1200), resume=True, **quick)
    off = train(tiny, Blobs(1200), max_epochs=0.2, runs_dir=tmp_path / "off",
                checkpoint=False, **quick)
    assert off.model is not None and not checkpoint_path(tmp_path / "off" / "blobs").exists()


def test_cli_resume_on_the_simulator(tmp_path, capsys) -> None:
    config = tmp_path / "c.toml"
    config.write_text('cluster = "hetero-4"\n[workload]\nmodel = "cnn"\ndataset = "mnist1d"\n'
                      'dataset_options = { num_samples = 2000 }\n[strategy]\nname = "asp"\n'
                      '[stop]\nmax_epochs = 0.3\n')
    runs = str(tmp_path / "runs")
    assert main(["run", str(config), "--runs-dir", runs, "--no-plot", "--quiet"]) == 0
    assert checkpoint_path(tmp_path / "runs" / "c").is_file()
    assert main(["run", str(config), "--runs-dir", runs, "--no-plot", "--quiet", "--resume",
                 "--set", "stop.max_epochs=0.5"]) == 0
    assert not (tmp_path / "runs" / "c.1").exists()  # continued, not moved aside
    rows = [json.loads(line) for line in
            (tmp_path / "runs" / "c" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["epoch"] >= 0.5 and rows[0]["samples"] == 0


def test_another_run_engine_or_a_crafted_checkpoint_is_refused_in_one_line(tmp_path) -> None:
    run_config(cfg_of(epochs=0.2), runs_root=tmp_path, quiet=True)
    run_dir = tmp_path / "c"
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    good = checkpoint_path(run_dir).read_bytes()

    def resume(cfg: RunConfig) -> None:
        run_config(cfg.replace(train=replace(cfg.train, resume=True)), runs_root=tmp_path,
                   quiet=True)

    cases = [
        (cfg_of("ssp", epochs=0.2), r"strategy 'asp', but the config says 'ssp'"),
        (cfg_of(epochs=0.2).replace(cluster="hetero-8"), r"cluster = 'hetero-4'"),
        (cfg_of(epochs=0.2).replace(engine="dist"), r"written by the sim engine"),
    ]
    for cfg, says in cases:
        with pytest.raises(ConfigError, match=says) as e:
            resume(cfg)
        assert "\n" not in str(e.value)
    state = load_checkpoint(run_dir, "asp", engine="sim")
    save_checkpoint(run_dir, replace(state, engine="dist"))
    with pytest.raises(ConfigError, match=r"written by the dist engine; resume it with engine"):
        resume(cfg_of(epochs=0.2))
    del state.sim["events"]  # a state that is not the simulator's whole state
    save_checkpoint(run_dir, state)
    with pytest.raises(ConfigError, match=r"does not fit this run \('events'\)"):
        resume(cfg_of(epochs=0.2))
    torch.save({"format": 2, "tree": '{"o": ["os.system", {}]}', "tensors": []},
               checkpoint_path(run_dir))
    with pytest.raises(ConfigError, match="not allowed"):
        resume(cfg_of(epochs=0.2))
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics  # refused before any write
    checkpoint_path(run_dir).write_bytes(good)
    resume(cfg_of(epochs=0.2))  # the good one still resumes


def test_former_dist_keys_are_read_as_train_keys() -> None:
    cfg = config_from_dict({"dist": {"checkpoint_every": 5, "resume": True}})
    assert (cfg.train.checkpoint_every, cfg.train.resume) == (5, True)
    assert config_from_dict({}).train.checkpoint is True
