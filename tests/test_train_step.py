"""`hetrain.train(..., train_step=, eval_fn=, collate_fn=, num_workers=)`: batches of any
structure (here dicts) on the simulator and on real processes, and the DataLoader options.

The default (x, y) + loss_fn path must stay as it was; test_train_step_matches_the_default_path
checks that a train_step doing what the default does gives the very same figures.
"""

from __future__ import annotations

import functools
import os
import secrets
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from hetrain.api import train
from hetrain.engine.devices import Mover
from hetrain.errors import ConfigError
from hetrain.workloads import BatchLoader, LoaderOptions, gather, map_tensors, sample_bytes_of
from hetrain.workloads.datasets import digits


class DictDigits(Dataset):
    """sklearn's digits as {"x": (64,) float tensor, "y": int} items (no (input, target) pair)."""

    def __init__(self, train: bool = True) -> None:
        tr, te, _ = digits()
        x, y = (tr if train else te).tensors
        self.x, self.y = x.flatten(1), y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": int(self.y[i])}


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def dict_step(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def dict_correct(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
    return (model(batch["x"]).argmax(-1) == batch["y"]).sum(), len(batch["y"])


COLLATE_CALLS = [0]


def counting_collate(items: list[dict[str, Any]]) -> dict[str, Tensor]:
    """A user collate_fn: stacks the dict items and counts its calls."""
    COLLATE_CALLS[0] += 1
    return {"x": torch.stack([it["x"] for it in items]),
            "y": torch.tensor([it["y"] for it in items])}


def pair_step(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def pair_correct(model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[int, int]:
    x, y = batch
    return int((model(x).argmax(-1) == y).sum()), len(y)


TRAIN, TEST = DictDigits(True), DictDigits(False)
QUICK: dict[str, Any] = dict(cluster="hetero-4", strategy="local_sgd", batch_size=16,
                             optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9}, seed=3)


def test_dict_batches_train_with_train_step_and_eval_fn_on_the_simulator():
    r = train(Mlp(), TRAIN, test_dataset=TEST, train_step=dict_step, eval_fn=dict_correct,
              max_epochs=2.0, **QUICK)
    assert r.rows[0]["test_accuracy"] < 0.3  # untrained: about chance (0.1)
    assert r.final_accuracy > 0.85
    with torch.no_grad():  # the reported accuracy is eval_fn's on the test set, summed
        correct, counted = dict_correct(r.model, counting_collate([TEST[i]
                                                                  for i in range(len(TEST))]))
    assert r.final_accuracy == pytest.approx(int(correct) / counted, abs=1e-9)
    assert r.summary["best_accuracy"] >= r.final_accuracy


def test_without_eval_fn_a_train_step_run_reports_its_test_loss_and_no_accuracy(tmp_path):
    r = train(Mlp(), TRAIN, test_dataset=TEST, train_step=dict_step, max_epochs=1.0,
              runs_dir=tmp_path, name="loss-only", **QUICK)
    assert all(row["test_accuracy"] is None for row in r.rows)
    assert r.summary["final_accuracy"] is None and r.summary["best_accuracy"] is None
    assert r.rows[-1]["test_loss"] < 0.5 * r.rows[0]["test_loss"]
    with torch.no_grad():
        whole = float(dict_step(r.model.eval(), counting_collate(list(TEST))))
    assert r.rows[-1]["test_loss"] == pytest.approx(whole, rel=1e-5)  # weighted by samples
    assert (tmp_path / "loss-only" / "metrics.csv").read_text().count("\n") == len(r.rows) + 1
    with pytest.raises(ConfigError, match="target_accuracy needs an accuracy"):
        train(Mlp(), TRAIN, test_dataset=TEST, train_step=dict_step, target_accuracy=0.9,
              max_epochs=1.0, **QUICK)


def test_collate_fn_is_called_for_training_and_evaluation():
    COLLATE_CALLS[0] = 0
    r = train(Mlp(), TRAIN, test_dataset=TEST, train_step=dict_step, eval_fn=dict_correct,
              collate_fn=counting_collate, max_epochs=0.5, **QUICK)
    steps = r.summary["samples"] / 16  # at least one call per local step of batch <= 16
    assert COLLATE_CALLS[0] >= steps + len(r.rows)
    assert r.final_accuracy > 0.5


def test_train_step_matches_the_default_path():
    """A train_step and eval_fn computing what the default path does: the same figures, bit
    for bit (same indices, same batches, same arithmetic)."""
    from test_api import TEST as BTEST
    from test_api import TRAIN as BTRAIN
    from test_api import Tiny

    opts = {**QUICK, "strategy": "cadp", "max_epochs": 1.0}
    torch.manual_seed(0)
    model = Tiny()
    default = train(model, BTRAIN, test_dataset=BTEST, **opts)
    mine = train(model, BTRAIN, test_dataset=BTEST, train_step=pair_step, eval_fn=pair_correct,
                 **opts)
    keys = ("time_s", "samples", "test_loss", "test_accuracy", "train_loss")
    assert [[row[k] for k in keys] for row in mine.rows] == \
        [[row[k] for k in keys] for row in default.rows]


def mark_worker(folder: str, worker_id: int) -> None:
    """A worker_init_fn: leaves a file behind, so the test sees DataLoader workers ran."""
    (Path(folder) / f"worker{worker_id}").touch()


@pytest.mark.timeout(120)
def test_dataloader_workers_give_the_same_run(tmp_path):
    """num_workers only changes who loads the planned indices, not the batches."""
    opts = {**QUICK, "max_epochs": 0.5, "train_step": dict_step, "eval_fn": dict_correct}
    model = Mlp()  # snapshotted at each call: both runs start from the same weights
    plain = train(model, TRAIN, test_dataset=TEST, **opts)
    workers = train(model, TRAIN, test_dataset=TEST, num_workers=2,
                    loader_options={"prefetch_factor": 4,
                                    "worker_init_fn": functools.partial(mark_worker,
                                                                        str(tmp_path))},
                    **opts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker0", "worker1"]
    assert [r["test_loss"] for r in workers.rows] == [r["test_loss"] for r in plain.rows]
    assert workers.final_accuracy == plain.final_accuracy


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"collate_fn": counting_collate, "loader_options": {"collate_fn": dict_step}},
     "collate_fn is given twice"),
    ({"loader_options": {"shuffle": True}}, r"loader_options \['shuffle'\]: the plan decides"),
    ({"loader_options": {"batch_size": 8}}, "the plan decides"),
    ({"loader_options": {"persistent_worker": True}}, "unsupported key"),
    ({"num_workers": -1}, "num_workers must be an integer >= 0"),
    ({"loader_options": {"prefetch_factor": 2}}, "prefetch_factor needs num_workers > 0"),
    ({"eval_fn": dict_step}, r"eval_fn\(model, batch\) must return \(correct, counted\)"),
    ({"loss_fn": F.cross_entropy}, "give loss_fn or train_step, not both"),
])
def test_bad_options_are_refused_in_one_line(kwargs, message):
    kwargs = {"train_step": dict_step, **kwargs}
    with pytest.raises(ValueError, match=message) as e:
        train(Mlp(), TRAIN, test_dataset=TEST, max_epochs=0.1, **kwargs, **QUICK)
    assert "\n" not in str(e.value)


def test_a_dataloader_as_the_dataset_brings_its_collate_fn():
    """A user's DataLoader: its data set and collate_fn are used; its batch size and shuffling
    are the plan's (the run is the one the same options without a DataLoader give)."""
    COLLATE_CALLS[0] = 0
    model = Mlp()
    opts = {**QUICK, "max_epochs": 0.3, "train_step": dict_step, "eval_fn": dict_correct}
    loader = DataLoader(TRAIN, batch_size=128, shuffle=True, collate_fn=counting_collate)
    r = train(model, loader, test_dataset=TEST, **opts)
    assert COLLATE_CALLS[0] > len(r.rows)
    same = train(model, TRAIN, test_dataset=TEST, collate_fn=counting_collate, **opts)
    assert [row["test_loss"] for row in r.rows] == [row["test_loss"] for row in same.rows]
    with pytest.raises(ConfigError, match="collate_fn is given twice with different values: "
                                          "the DataLoader given as dataset says"):
        train(model, loader, test_dataset=TEST, loader_options={"collate_fn": dict_step}, **opts)


def test_dict_items_without_train_step_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="must be an \\(input, target\\) pair"):
        train(Mlp(), TRAIN, test_dataset=TEST, max_epochs=0.1, **QUICK)
    with pytest.raises(ConfigError, match="collate_fn must return an \\(inputs, targets\\)"):
        train(Mlp(), TRAIN, test_dataset=TEST, collate_fn=counting_collate, max_epochs=0.1,
              **QUICK)


def test_a_detached_loss_is_refused():
    def detached(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return dict_step(model, batch).detach()

    with pytest.raises(ConfigError, match="does not depend on the model's parameters"):
        train(Mlp(), TRAIN, test_dataset=TEST, train_step=detached, max_epochs=0.1, **QUICK)


@pytest.mark.parametrize("which", ["train_step", "eval_fn", "collate_fn"])
def test_unpicklable_callables_are_refused_before_dist_spawns(which):
    good = {"train_step": dict_step, "eval_fn": dict_correct, "collate_fn": counting_collate}
    fns = {**good, which: lambda *a: good[which](*a)}  # the point: a lambda
    with pytest.raises(ConfigError, match=f"{which}=.*<lambda> cannot be pickled") as e:
        train(Mlp(), TRAIN, test_dataset=TEST, engine="dist", max_epochs=0.1, **fns, **QUICK)
    assert "\n" not in str(e.value)


def mark_process(folder: str, worker_id: int) -> None:
    """A worker_init_fn: a file named <the loading process>-<this DataLoader worker>."""
    (Path(folder) / f"{os.getppid()}-{os.getpid()}").touch()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow  # ~32 s on 2 cores (3 processes importing torch, 6 DataLoader workers)
@pytest.mark.dist
@pytest.mark.timeout(120)
def test_dataloader_workers_on_spawned_dist_runs(tmp_path):
    """The spawned workers are not daemonic, so each starts its own DataLoader workers
    (num_workers=2); every process of the run has exited when train returns."""
    pair = {"name": "pair", "sites": [{"name": "s", "lan": {"bandwidth_Bps": 1e9},
                                       "wan": {"bandwidth_Bps": 1e9}}],
            "devices": [{"name": "slow", "flops": 1e9}, {"name": "fast", "flops": 2e9}]}
    r = train(Mlp(), TRAIN, test_dataset=TEST, train_step=dict_step, eval_fn=dict_correct,
              num_workers=2, loader_options={"worker_init_fn": functools.partial(
                  mark_process, str(tmp_path))},
              cluster=pair, strategy="local_sgd", engine="dist", batch_size=16, max_epochs=1.0,
              optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
              config={"dist": {"emulate": "none"}})
    assert r.summary["engine"] == "dist" and r.final_accuracy > 0.8
    pairs = [tuple(int(x) for x in p.name.split("-")) for p in tmp_path.iterdir()]
    loaders = {parent for parent, _ in pairs}
    assert os.getpid() in loaders and len(loaders) == 3  # rank 0's evaluation + 2 workers
    assert len(pairs) == 2 * 3
    assert not [pid for parent, child in pairs for pid in (parent, child)
                if pid != os.getpid() and _alive(pid)]


Pair = namedtuple("Pair", "x y")


def test_nested_batches_are_gathered_counted_and_moved_whole():
    items = [{"img": torch.ones(3), "meta": (torch.tensor(i), [torch.zeros(2)])}
             for i in range(5)]
    batch = gather(items, [4, 1])  # a plain list is a map-style data set
    assert batch["img"].shape == (2, 3) and batch["meta"][0].tolist() == [4, 1]
    assert batch["meta"][1][0].shape == (2, 2)
    assert sample_bytes_of(items[0]) == 3 * 4 + 8 + 2 * 4
    moved = map_tensors(lambda t: t + 1, Pair(torch.zeros(1), {"a": [torch.zeros(2)]}))
    assert isinstance(moved, Pair) and moved.y["a"][0].tolist() == [1.0, 1.0]
    assert Mover(torch.device("cpu")).batch(batch) is batch
    loader = BatchLoader(items, LoaderOptions(collate_fn=counting_collate_list))
    assert [b for b in loader.batches([[0, 1], [2]])] == [[0, 1], [2]]


def counting_collate_list(items: list[dict[str, Any]]) -> list[int]:
    return [int(it["meta"][0]) for it in items]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(240)
def test_dict_batches_train_on_spawned_processes():
    pair = {"name": "pair", "sites": [{"name": "s", "lan": {"bandwidth_Bps": 1e9},
                                       "wan": {"bandwidth_Bps": 1e9}}],
            "devices": [{"name": "slow", "flops": 1e9}, {"name": "fast", "flops": 2e9}]}
    r = train(Mlp(), TRAIN, test_dataset=TEST, train_step=dict_step, eval_fn=dict_correct,
              collate_fn=counting_collate, cluster=pair, strategy="local_sgd", engine="dist",
              batch_size=16, max_epochs=2.0, optimizer={"name": "sgd", "lr": 0.1,
                                                          "momentum": 0.9},
              config={"dist": {"emulate": "none"}})
    assert r.summary["engine"] == "dist" and r.final_accuracy > 0.85
    assert isinstance(r.model, Mlp)
    with torch.no_grad():  # the model read back from the checkpoint is the evaluated one
        correct, counted = dict_correct(r.model, counting_collate(list(TEST)))
    assert r.final_accuracy == pytest.approx(int(correct) / counted, abs=1e-9)


TORCHRUN_SCRIPT = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
    import hetrain
    from test_train_step import TEST, TRAIN, Mlp, counting_collate, dict_correct, dict_step

    if __name__ == "__main__":
        r = hetrain.train(Mlp(), TRAIN, test_dataset=TEST, train_step=dict_step,
                          eval_fn=dict_correct, collate_fn=counting_collate, num_workers=1,
                          cluster="homo-4", strategy="local_sgd", engine="dist", batch_size=16,
                          max_epochs=1.0, optimizer={{"name": "sgd", "lr": 0.1,
                                                      "momentum": 0.9}},
                          config={{"dist": {{"emulate": "none"}}}}, seed=3)
        if r.summary.get("role") != "worker":
            print("RESULT", r.summary["engine"], r.final_accuracy)
""")


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_dataloader_workers_under_torchrun(tmp_path):
    """Under torchrun the ranks are ordinary processes, so num_workers > 0 is allowed there."""
    script = tmp_path / "train_dicts.py"
    script.write_text(TORCHRUN_SCRIPT)
    torchrun = Path(sys.executable).with_name("torchrun")
    # torchrun's ranks share no run directory here, so the run's secret comes from the env
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HETRAIN_SECRET": secrets.token_hex(32)}
    p = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "5", str(script)],
                       capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("RESULT")]
    engine, acc = line.split()[1:]
    assert engine == "dist" and float(acc) > 0.8
