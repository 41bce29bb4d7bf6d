"""The Python API on a user-defined model and Dataset class, and its errors for bad inputs."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

import hetrain
from hetrain.api import make_workload, train
from hetrain.errors import ConfigError
from hetrain.strategies import REGISTRY, BarrierMixin, Decision, Push, Strategy, WorkTask, register
from hetrain.workloads import flops_per_sample


class Blobs(Dataset):
    """Three Gaussian blobs in 2-D; items are (tensor, int), not a TensorDataset."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        centers = torch.tensor([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]])
        self.x = centers[self.y] + 0.6 * torch.randn(n, 2, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


class Tiny(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


TRAIN, TEST = Blobs(1200, seed=0), Blobs(300, seed=1)
QUICK = dict(cluster="hetero-4", strategy="local_sgd", batch_size=16, max_epochs=1.0,
             optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9})


def test_user_model_and_dataset_train_on_the_simulator(tmp_path):
    torch.manual_seed(0)  # an unseeded Tiny() started above 0.6 accuracy once in a while
    model = Tiny()
    before = [p.detach().clone() for p in model.parameters()]
    r = train(model, TRAIN, test_dataset=TEST, target_accuracy=0.9, runs_dir=tmp_path,
              name="blobs", **QUICK)
    assert isinstance(r, hetrain.TrainResult) and isinstance(r, hetrain.RunResult)
    assert r.summary["engine"] == "sim" and r.summary["strategy"] == "local_sgd"
    assert r.summary["n_workers"] == 4 and r.summary["config"]["workload"]["model"] == "user:Tiny"
    assert r.rows[0]["test_accuracy"] < 0.6 < 0.9 <= r.final_accuracy  # it learned
    assert r.tta_s is not None and 0 < r.tta_s <= r.summary["time_s"]
    # The returned model is the trained global model, and it is as accurate as reported.
    assert isinstance(r.model, Tiny)
    with torch.no_grad():
        acc = float((r.model(TEST.x).argmax(1) == TEST.y).float().mean())
    assert acc == pytest.approx(r.final_accuracy, abs=1e-6)
    # The caller's instance is left untouched (replicas are copies of a snapshot).
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    rows = [json.loads(line) for line in (tmp_path / "blobs" / "metrics.jsonl").open()]
    assert len(rows) == len(r.rows)
    assert json.loads((tmp_path / "blobs" / "summary.json").read_text())["tta_s"] == r.tta_s


def test_the_api_takes_the_runners_path(tmp_path, capsys):
    """A second run of a name moves the first aside, as `hetrain run` does (hetrain.runner)."""
    for _ in range(2):
        r = train(Tiny, TRAIN, test_dataset=TEST, runs_dir=tmp_path, name="again",
                  **{**QUICK, "max_epochs": 0.1})
    assert isinstance(r.model, Tiny)
    assert (tmp_path / "again" / "summary.json").is_file()
    assert (tmp_path / "again.1" / "summary.json").is_file()
    assert "moved it to" in capsys.readouterr().err


def test_same_seed_same_run_and_factory_equals_instance():
    torch.manual_seed(3)
    instance = Tiny()
    a = train(instance, TRAIN, test_dataset=TEST, seed=1, **QUICK)
    b = train(instance, TRAIN, test_dataset=TEST, seed=1, **QUICK)
    assert a.rows == b.rows
    # A factory is called under the run's seed; an instance made under that seed matches it.
    torch.manual_seed(1)
    seeded = Tiny()
    c = train(Tiny, TRAIN, test_dataset=TEST, seed=1, **QUICK)
    d = train(seeded, TRAIN, test_dataset=TEST, seed=1, **QUICK)
    assert [r["test_loss"] for r in c.rows] == [r["test_loss"] for r in d.rows]


def test_held_out_split_when_no_test_set():
    wl = make_workload(Tiny(), TRAIN, test_fraction=0.25, seed=0)
    assert (len(wl.train), len(wl.test)) == (900, 300)
    assert set(wl.train.indices).isdisjoint(wl.test.indices)
    assert wl.input_shape == (2,) and wl.num_classes == 3 and wl.sample_bytes == 2 * 4 + 8


def test_architecture_fingerprint_keeps_flops_apart():
    small, big = make_workload(Tiny(8), TRAIN, TEST), make_workload(Tiny(64), TRAIN, TEST)
    assert small.name == big.name
    assert flops_per_sample(big) > 4 * flops_per_sample(small)


@pytest.mark.parametrize("optimizer", [
    {"name": "sgd", "lr": 0.1, "momentum": 0.5},
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.5}),
    functools.partial(torch.optim.SGD, lr=0.1, momentum=0.5),
])
def test_optimizer_forms_agree(optimizer):
    r = train(Tiny(), TRAIN, test_dataset=TEST, **{**QUICK, "optimizer": optimizer,
                                                    "max_epochs": 0.2})
    assert r.summary["config"]["optimizer"] == {"name": "sgd", "lr": 0.1, "momentum": 0.5,
                                                "weight_decay": 0.0, "nesterov": False,
                                                "options": {}, "clip_grad_norm": 0.0,
                                                "scheduler": "", "scheduler_options": {}}


def test_any_torch_optimizer_class_is_accepted():
    r = train(Tiny(), TRAIN, test_dataset=TEST, **{**QUICK, "max_epochs": 0.2, "optimizer":
                                                    (torch.optim.RMSprop, {"lr": 0.01,
                                                                           "alpha": 0.9})})
    opt = r.summary["config"]["optimizer"]
    assert (opt["name"], opt["lr"], opt["options"]) == ("RMSprop", 0.01, {"alpha": 0.9})


@pytest.mark.parametrize("scheduler", [
    {"name": "StepLR", "step_size": 1, "gamma": 0.5},
    "ExponentialLR",  # gamma from config={"optimizer": {"scheduler_options": ...}}
])
def test_scheduler_by_name_or_table(scheduler):
    config = {} if isinstance(scheduler, dict) else {
        "optimizer": {"scheduler_options": {"gamma": 0.5}}}
    r = train(Tiny(), TRAIN, test_dataset=TEST, **{**QUICK, "max_epochs": 0.3,
                                                    "scheduler": scheduler, "config": config})
    opt = r.summary["config"]["optimizer"]
    name = scheduler["name"] if isinstance(scheduler, dict) else scheduler
    assert opt["scheduler"] == name
    options = opt["scheduler_options"]
    for row in r.rows:  # the lr column: torch's schedule at the row's global step
        o = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=opt["lr"])
        s = getattr(torch.optim.lr_scheduler, name)(o, **options)
        for _ in range(row["updates"]):
            o.step()
            s.step()
        assert row["lr"] == pytest.approx(s.get_last_lr()[0], rel=1e-12)
    assert len({row["lr"] for row in r.rows}) > 1


def test_strategy_cluster_and_config_forms(tmp_path):
    from hetrain.strategies import make_strategy

    cluster = hetrain.preset("hetero-4").with_device(0, flops=1e8)
    path = tmp_path / "c.toml"
    cluster.save(path)
    kw = {**QUICK, "max_epochs": 0.2}
    for c in (cluster, path, str(path)):
        kw["cluster"] = c
        r = train(Tiny(), TRAIN, test_dataset=TEST, **kw)
        assert r.summary["cluster"] == "hetero-4" and r.summary["n_workers"] == 4
    kw["strategy"] = make_strategy("local_sgd", local_steps=2)
    r = train(Tiny(), TRAIN, test_dataset=TEST, config={"train": {"eval_every_epochs": 0.1}},
              **kw)
    assert r.summary["config"]["strategy"] == {"name": "local_sgd", "local_steps": 2,
                                               "outer_lr": 1.0, "outer_momentum": 0.0}
    assert r.summary["config"]["train"]["eval_every_epochs"] == 0.1
    kw["strategy"] = {"name": "local_sgd", "local_steps": 3}
    assert train(Tiny(), TRAIN, test_dataset=TEST, **kw).summary["config"]["strategy"][
        "local_steps"] == 3


@dataclass
class EveryOtherAveraging(BarrierMixin, Strategy):
    """A user strategy: averaging rounds that alternate between 1 and `long_steps` steps."""

    name = "test_every_other"
    comm = "allreduce"
    update = "delta"
    long_steps: int = 4

    def setup(self, ctx):
        super().setup(ctx)
        self.barrier_init(ctx.n_workers)
        self.rounds = 0

    def next_task(self, worker: int) -> WorkTask:
        steps = self.long_steps if self.rounds % 2 else 1
        return WorkTask(batch_size=self.context.batch_size, local_steps=steps)

    def on_push(self, push: Push) -> Decision:
        d = self.barrier_push(push)
        self.rounds += bool(d.apply)
        return d

    def stats(self):
        return {"rounds": self.rounds}


@pytest.fixture
def user_strategy():
    """Register the user strategy for one test only (other tests see the built-ins)."""
    register(EveryOtherAveraging)
    yield EveryOtherAveraging.name
    REGISTRY.pop(EveryOtherAveraging.name, None)


def test_registered_custom_strategy_runs_on_the_simulator(user_strategy):
    from hetrain.config import config_from_dict
    from hetrain.runner import run_config

    r = train(Tiny(), TRAIN, test_dataset=TEST,
              **{**QUICK, "strategy": {"name": user_strategy, "long_steps": 3}})
    assert r.summary["strategy"] == user_strategy and r.summary["strategy_stats"]["rounds"] > 2
    assert r.final_accuracy > 0.8
    # The same name works from a run config (what a TOML file gives).
    cfg = config_from_dict({"name": "u", "cluster": "homo-4",
                            "workload": {"model": "mlp", "dataset": "digits"},
                            "strategy": {"name": user_strategy}, "stop": {"max_epochs": 0.2}})
    assert run_config(cfg, runs_root=None).summary["strategy"] == user_strategy


def test_unregistered_strategy_name_is_an_error_but_an_instance_runs():
    with pytest.raises(ConfigError, match="unknown strategy 'test_every_other'"):
        train(Tiny(), TRAIN, test_dataset=TEST, **{**QUICK, "strategy": "test_every_other"})
    r = train(Tiny(), TRAIN, test_dataset=TEST,
              **{**QUICK, "strategy": EveryOtherAveraging(long_steps=2), "max_epochs": 0.3})
    assert r.summary["strategy"] == "test_every_other"


class Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(2), 0


class Singles(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dataset=Stream()), "map-style"),
    (dict(dataset=[]), "empty"),
    (dict(dataset=Singles()), r"\(input, target\) pair"),
    (dict(model="Tiny"), "nn.Module or a zero-argument callable"),
    (dict(model=lambda: 3), "returned int"),
    (dict(model=nn.Linear(5, 3)), r"input shape \(2, 2\)"),
    (dict(model=nn.ReLU()), "no trainable parameters"),
    (dict(loss_fn=lambda out, y: out), "scalar"),
    (dict(strategy="no_such"), "unknown strategy 'no_such'"),
    (dict(strategy={"name": "local_sgd", "h": 2}), r"unknown option\(s\) \['h'\]"),
    (dict(optimizer=(torch.optim.RMSprop, {"alphaa": 0.9})), r"unknown option\(s\) \[.alphaa.\]"),
    (dict(optimizer=(torch.optim.Adam, {"betas": (0.9, 0.99)})), r"\['betas'\]"),
    (dict(optimizer={"name": "lion"}), "optimizer.name"),
    (dict(scheduler="LRScheduler"), "abstract base class"),
    (dict(scheduler={"name": "LambdaLR", "lr_lambda": 0.5}), "Python API"),
    (dict(scheduler={"name": "StepLR"}), r"do not fit StepLR.*step_size"),
    (dict(scheduler={"step_size": 3}), "scheduler must be a torch.optim.lr_scheduler name"),
    (dict(cluster="hetero-3"), "not found; give a TOML file or a preset name"),
    (dict(cluster=4), "cluster must be"),
    (dict(engine="gpu"), "engine = 'gpu'"),
    (dict(batch_size=5000), "larger than the training set"),
    (dict(batch_size=2.5), "batch_size must be an integer"),
    (dict(stop={"epochs": 2}), r"unknown key\(s\) \['epochs'\]"),
    (dict(target_accuracy=1.5), "target_accuracy must be in"),
    (dict(config={"workload": {}}), "cannot be given here"),
    (dict(config={"train": {"treads": 2}}), r"unknown key\(s\) \['treads'\]"),
    (dict(task="regression"), "task = 'regression'"),
])
def test_bad_inputs_raise_config_errors(kwargs, message):
    args = {"model": Tiny(), "dataset": TRAIN, "test_dataset": TEST, **QUICK, **kwargs}
    with pytest.raises(ConfigError, match=message):
        train(**args)


@pytest.mark.multiproc
def test_public_names_are_lazy():
    assert hetrain.train is train and hetrain.Cluster is hetrain.cluster.Cluster
    assert hetrain.strategies.register is register
    code = "import sys, hetrain; print('torch' in sys.modules, hetrain.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", hetrain.__version__]


def test_plan_batches_gives_faster_devices_bigger_batches():
    from hetrain.api import plan_batches

    # Compute-bound (1 GFLOP/sample, no model bytes): batches follow the speeds 1:1:2:4.
    p = plan_batches("hetero-4", 256, flops_per_sample=1e9, model_bytes=0)
    assert p.batch_sizes == (32, 32, 64, 128) and p.local_steps == 1
    assert sum(p.weights) == pytest.approx(1.0) and p.weights[3] == 0.5
    assert p.efficiency > 0.99 and p.speedup_vs_equal == pytest.approx(2.0, rel=0.01)
    # From a user model + data set: the FLOPs are counted, bytes taken from the parameters.
    q = plan_batches(hetrain.preset("hetero-4"), 64, model=Tiny(), dataset=TRAIN)
    assert sum(q.batch_sizes) == 64 and q.round_time_s <= q.equal_round_time_s
    # Slow links: local_steps=0 picks H > 1 so communication stays a small part of a round.
    r = plan_batches("hetero-8", 256, flops_per_sample=1e6, model_bytes=400_000, local_steps=0)
    assert r.local_steps > 1 and sum(r.batch_sizes) == 256
    assert r.round_time_s < r.equal_round_time_s / 2


def test_plan_batches_respects_memory_and_validates():
    from hetrain.api import plan_batches

    # 1 GB of activations per sample on 16 GB devices: nobody may take more than 15.
    p = plan_batches("hetero-4", 40, flops_per_sample=1e9, model_bytes=1000,
                     activation_bytes_per_sample=1e9)
    assert max(p.batch_sizes) <= 15 and sum(p.batch_sizes) == 40
    with pytest.raises(ConfigError, match="caps hold"):
        plan_batches("hetero-4", 100, flops_per_sample=1e9, activation_bytes_per_sample=1e9)
    with pytest.raises(ConfigError, match="needs dataset="):
        plan_batches("hetero-4", 64, model=Tiny())
    with pytest.raises(ConfigError, match="flops_per_sample"):
        plan_batches("hetero-4", 64)
    with pytest.raises(ConfigError, match="total_batch"):
        plan_batches("hetero-4", 0, flops_per_sample=1e6)


def test_torchrun_scratch_is_shared_per_job_and_private(tmp_path, monkeypatch):
    """Without runs_dir, torchrun's ranks on one machine share one folder per job (rank 0's
    generated secret is read there), and a folder other users could write is refused."""
    from hetrain.api import _torchrun_scratch

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    for k, v in (("TORCHELASTIC_RUN_ID", "job/1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", "29500")):
        monkeypatch.setenv(k, v)
    a = _torchrun_scratch()
    assert a == _torchrun_scratch() and a.parent == tmp_path and "/" not in a.name[8:]
    assert a.stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv("MASTER_PORT", "29501")
    assert _torchrun_scratch() != a  # another job, another folder
    a.chmod(0o777)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ConfigError, match="not a folder private to this user"):
        _torchrun_scratch()
