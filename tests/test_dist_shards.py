"""The sharded parameter server (`dist.ps_shards`): partition, validation and real runs.

Real runs are 3 workers + 2 PS ranks (rank 0 and one shard) over gloo on 127.0.0.1, a
fraction of an epoch of MNIST-1D (a few seconds each), free ports, bounded by the timeout.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from hetrain.cli import main
from hetrain.config import RunConfig, config_from_dict
from hetrain.engine.checkpoint import checkpoint_path
from hetrain.engine.dist import WorkerLostError, fail_at, run_distributed
from hetrain.engine.dist_shard import partition
from hetrain.errors import ConfigError
from hetrain.strategies import Decision, Push, Strategy, WorkTask
from test_dist import CLUSTER, AsyncSGD, make_cfg

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

TRIO = {**CLUSTER, "devices": [{"name": "slow", "flops": 2e8}, {"name": "fast", "flops": 4e8},
                               {"name": "mid", "flops": 3e8}]}


@dataclass
class SyncPS(Strategy):
    """Synchronous SGD through the PS: apply every worker's push at once, in worker order, and
    release them in that order. Arrival order then changes nothing, so runs are reproducible."""

    name = "test_sync_ps"
    comm = "ps"
    update = "gradient"
    lr_scale: float = 1.0
    """The Decisions' lr scale (the server's step at optimizer.lr x it)."""
    arrived: set[int] = field(default_factory=set)

    def next_task(self, worker: int) -> WorkTask:
        return WorkTask(batch_size=self.context.batch_size)

    def on_push(self, push: Push) -> Decision:
        self.arrived.add(push.worker)
        if len(self.arrived) < self.context.cluster.n:
            return Decision()
        ws, self.arrived = sorted(self.arrived), set()
        return Decision(apply=tuple((w, 1 / len(ws)) for w in ws), release=tuple(ws),
                        lr_scale=self.lr_scale)


def trio_cfg(strategy: str, epochs: float = 0.2, **dist: Any) -> RunConfig:
    return make_cfg(strategy, epochs=epochs, **dist).replace(cluster=TRIO)


def test_partition_splits_tensors_into_contiguous_blocks_balanced_by_size() -> None:
    cnn = [160, 32, 5120, 32, 5120, 32, 3200, 10]  # the MNIST-1D CNN
    assert partition(cnn, 1) == [(0, 8)]
    assert partition(cnn, 2) == [(0, 4), (4, 8)]  # 5344 | 8362: the nearest tensor boundary
    assert partition(cnn, 3) == [(0, 3), (3, 5), (5, 8)]
    assert partition([5, 5, 5], 3) == [(0, 1), (1, 2), (2, 3)]
    assert partition([1000, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]  # never an empty block
    assert partition([1, 1, 1, 1000], 2) == [(0, 3), (3, 4)]
    for bad in (0, 9):
        with pytest.raises(ValueError):
            partition(cnn, bad)


@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_ps_shards_must_be_a_positive_integer(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"dist\.ps_shards"):
        config_from_dict({"dist": {"ps_shards": value}})


@pytest.mark.parametrize(("strategy", "shards", "message"), [
    ("ddp", 2, r"dist.ps_shards = 2: strategy 'ddp' all-reduces.*dist.ps_shards = 1"),
    ("asp", 9, r"dist.ps_shards = 9 but the model has only 8 parameter tensors")])
def test_ps_shards_that_cannot_work_are_clear_errors(strategy: str, shards: int, message: str,
                                                     mnist1d_cnn_small) -> None:
    with pytest.raises(ConfigError, match=message):
        run_distributed(make_cfg(strategy, ps_shards=shards), run_dir=None,
                        workload=mnist1d_cnn_small)


def test_launch_nproc_counts_the_shards(tmp_path, capsys) -> None:
    p = tmp_path / "c.toml"
    p.write_text('cluster = { name = "pair", sites = [{ name = "s", lan = { bandwidth_Bps = 1e9 }'
                 ', wan = { bandwidth_Bps = 1e9 } }], devices = [{ name = "a", flops = 1e8 }, '
                 '{ name = "b", flops = 1e8 }] }\n[strategy]\nname = "asp"\n')
    assert main(["launch", str(p), "--nproc", "3", "--set", "dist.ps_shards=2"]) == 2
    err = capsys.readouterr().err
    assert "dist.ps_shards = 2" in err and "--nproc 4" in err


def _losses(rows: list[dict[str, Any]]) -> list[float]:
    return [r["test_loss"] for r in rows if r.get("test_loss") is not None]


@pytest.fixture(scope="module")
def sync_ps_runs(mnist1d_cnn_small) -> dict[int, Any]:
    """The deterministic SyncPS run on one server and on two shards (uncut), shared by the
    tests that compare against them."""
    return {s: run_distributed(trio_cfg("test_sync_ps", ps_shards=s), run_dir=None,
                               strategy=SyncPS(), workload=mnist1d_cnn_small) for s in (1, 2)}


def test_two_shards_give_the_model_of_one_server(sync_ps_runs) -> None:
    """Same seed, deterministic strategy: every evaluation (of the model assembled from the
    shards' blocks) equals the one-server run's, and the bytes per worker are the same."""
    runs = [sync_ps_runs[1], sync_ps_runs[2]]
    one, two = (r.summary for r in runs)
    assert two["ps_shards"] == 2 and one["updates"] == two["updates"] >= 5
    assert _losses(runs[1].rows) == pytest.approx(_losses(runs[0].rows), abs=1e-5)
    assert two["final_accuracy"] == pytest.approx(one["final_accuracy"], abs=1e-6)
    assert _losses(runs[1].rows)[-1] < _losses(runs[1].rows)[0]
    for w1, w2 in zip(one["workers"], two["workers"], strict=True):
        assert w2["pushes"] == w1["pushes"]
        assert w2["bytes_sent"] == pytest.approx(w1["bytes_sent"], rel=0.03)


def test_every_shard_steps_at_the_decisions_lr_scale(sync_ps_runs, mnist1d_cnn_small) -> None:
    """Gradient pushes with Decision.lr_scale 0.5 on two shards: the model of one server whose
    optimizer.lr is halved (a shard that ignored the scale would step its block at the full
    lr), and not the model of the unscaled run."""
    scaled = run_distributed(trio_cfg("test_sync_ps", ps_shards=2), run_dir=None,
                             strategy=SyncPS(lr_scale=0.5), workload=mnist1d_cnn_small)
    cfg = trio_cfg("test_sync_ps")
    halved = run_distributed(replace(cfg, optimizer=replace(cfg.optimizer,
                                                            lr=cfg.optimizer.lr * 0.5)),
                             run_dir=None, strategy=SyncPS(), workload=mnist1d_cnn_small)
    assert _losses(scaled.rows) == pytest.approx(_losses(halved.rows), abs=1e-5)
    assert _losses(scaled.rows) != pytest.approx(_losses(sync_ps_runs[1].rows), abs=1e-3)


# cadp on two shards runs by default in test_topk_pushes_on_two_shards_train_and_are_sparse,
# dense pushes on two shards in the asp case: the other strategies are slow.
@pytest.mark.parametrize("name", ["asp", pytest.param("cadp", marks=pytest.mark.slow),
                                  pytest.param("ashl", marks=pytest.mark.slow)])
def test_ps_strategies_train_on_two_shards(name: str, mnist1d_cnn_small) -> None:
    r = run_distributed(trio_cfg(name, epochs=0.3, ps_shards=2), run_dir=None,
                        workload=mnist1d_cnn_small)
    s = r.summary
    assert s["ps_shards"] == 2 and s["epochs"] >= 0.3 - 1e-9 and s["lost_workers"] == []
    losses = _losses(r.rows)
    assert losses[-1] < losses[0] - 0.01, losses
    for w in s["workers"]:  # each push is one model's worth of bytes, summed over the shards
        assert w["bytes_sent"] / w["pushes"] == pytest.approx(s["model_bytes"], rel=0.1)


@pytest.mark.slow
def test_killed_worker_with_two_shards_does_not_lose_async_run(mnist1d_cnn_small) -> None:
    r = run_distributed(trio_cfg("test_async", ps_shards=2), run_dir=None, strategy=AsyncSGD(),
                        faults=fail_at(rank=1, task=3), workload=mnist1d_cnn_small)
    assert r.summary["lost_workers"] == [0]
    assert r.summary["workers"][0]["pushes"] == 3
    assert r.summary["epochs"] >= 0.2 - 1e-9
    losses = _losses(r.rows)
    assert losses[-1] < losses[0], losses


@pytest.mark.slow
def test_two_shard_checkpoint_resumes_to_the_model_of_an_uncut_run(tmp_path, sync_ps_runs,
                                                                   mnist1d_cnn_small) -> None:
    wl, full = mnist1d_cnn_small, sync_ps_runs[2]
    cfg = trio_cfg("test_sync_ps", ps_shards=2, checkpoint_every=1)
    with pytest.raises(WorkerLostError, match="checkpoint"):
        run_distributed(cfg, run_dir=tmp_path / "cut", strategy=SyncPS(),
                        faults=fail_at(rank=3, task=3), workload=wl)
    assert checkpoint_path(tmp_path / "cut").is_file()
    with pytest.raises(ConfigError, match=r"dist\.ps_shards = 2"):
        run_distributed(trio_cfg("test_sync_ps", resume=True), run_dir=tmp_path / "cut",
                        strategy=SyncPS(), workload=wl)
    resumed = run_distributed(cfg.replace(train=replace(cfg.train, resume=True)),
                              run_dir=tmp_path / "cut", strategy=SyncPS(), workload=wl)
    assert resumed.summary["updates"] == full.summary["updates"]
    assert resumed.summary["final_accuracy"] == pytest.approx(full.summary["final_accuracy"],
                                                              abs=1e-6)
    assert _losses(resumed.rows)[-1] == pytest.approx(_losses(full.rows)[-1], abs=1e-5)


@pytest.mark.slow
def test_hung_worker_with_two_shards_is_dropped_after_the_timeout(mnist1d_cnn_small) -> None:
    cfg = trio_cfg("test_async", ps_shards=2, worker_timeout_s=4.0)
    r = run_distributed(cfg, run_dir=None, strategy=AsyncSGD(), workload=mnist1d_cnn_small,
                        faults=fail_at(rank=2, task=2, kind="hang"))
    assert r.summary["lost_workers"] == [1]
    assert r.summary["epochs"] >= 0.2 - 1e-9


@pytest.mark.slow
def test_topk_pushes_on_two_shards_train_and_are_sparse(mnist1d_cnn_small) -> None:
    """Each block is compressed with its own error feedback (and, with train.local_residual,
    the worker keeps its unsent progress per block): top-10% pushes still train, at about 1/6
    of the bytes."""
    cfg = trio_cfg("cadp", epochs=0.3, ps_shards=2)
    cfg = cfg.replace(train=replace(cfg.train, compression="topk", local_residual=True,
                                    compression_options={"ratio": 0.1}))
    r = run_distributed(cfg, run_dir=None, workload=mnist1d_cnn_small)
    s = r.summary
    assert s["ps_shards"] == 2 and s["lost_workers"] == []
    for w in s["workers"]:  # 10% of the values + 16-bit gaps: 15% of a dense push, plus
        # the two messages' pickle framing and metadata (about 1 kB each)
        assert 0.15 * s["model_bytes"] < w["bytes_sent"] / w["pushes"] < 0.25 * s["model_bytes"]
    losses = _losses(r.rows)
    assert losses[-1] < losses[0] - 0.01, losses
