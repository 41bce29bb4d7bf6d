"""The simulator: determinism, the virtual clock against hand computation, DDP's pace, scale."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from hetrain.cluster import Cluster, Device, Link, Site, homogeneous, preset
from hetrain.config import config_from_dict
from hetrain.runner import run_config
from hetrain.strategies import BarrierMixin, Decision, Push, RunContext, Strategy, WorkTask


def _cfg(strategy: str, **over):
    data = {"name": f"t-{strategy}", "cluster": "hetero-4",
            "workload": {"model": "mlp", "dataset": "digits"},
            "strategy": {"name": strategy, **over.pop("options", {})},
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
            "train": {"batch_size": 16, "seed": 0},
            "stop": {"max_epochs": 2.0}}
    for k, v in over.items():
        data[k].update(v)
    return config_from_dict(data)


def two_devices(ps_nic: Link | None = None) -> Cluster:
    site = Site("s", Link(1e6, 1e-3), Link(1e5, 1e-2))
    return Cluster("two", (Device("slow", 1e8, site="s", step_overhead_s=0.01),
                           Device("fast", 4e8, site="s", step_overhead_s=0.01)), (site,),
                   ps_nic=ps_nic)


@dataclass
class SyncPS(BarrierMixin, Strategy):
    """A synchronous parameter server with unequal tasks, for the hand computation."""

    name = "test_sync_ps"
    comm = "ps"
    update = "delta"

    def setup(self, ctx: RunContext) -> None:
        super().setup(ctx)
        self.barrier_init(ctx.n_workers)

    def next_task(self, worker: int) -> WorkTask:
        return WorkTask(batch_size=8 * (worker + 1), local_steps=3)

    def on_push(self, push: Push) -> Decision:
        return self.barrier_push(push)


def test_same_seed_same_run_different_seed_different_run(digits_mlp) -> None:
    a = run_config(_cfg("local_sgd"), runs_root=None, workload=digits_mlp)
    b = run_config(_cfg("local_sgd"), runs_root=None, workload=digits_mlp)
    assert a.rows == b.rows and a.summary["time_s"] == b.summary["time_s"]
    c = run_config(_cfg("local_sgd", train={"seed": 1}), runs_root=None, workload=digits_mlp)
    assert [r["test_loss"] for r in c.rows] != [r["test_loss"] for r in a.rows]


def test_virtual_clock_matches_hand_computation_ps(digits_mlp) -> None:
    cluster = two_devices()
    cfg = _cfg("ddp", stop={"max_epochs": 0.2})
    r = run_config(cfg, runs_root=None, cluster=cluster, workload=digits_mlp, strategy=SyncPS())
    fps, mbytes = r.summary["flops_per_sample"], r.summary["model_bytes"]
    link = cluster.sites[0].lan

    def worker_round(w: int) -> float:
        samples = 8 * (w + 1) * 3
        compute = 3 * 0.01 + samples * fps / cluster.devices[w].flops
        return 2 * (link.latency_s + mbytes / link.bandwidth_Bps) + compute

    round_s = max(worker_round(0), worker_round(1))
    rounds = r.summary["updates"]
    assert rounds >= 2
    assert r.summary["time_s"] == pytest.approx(rounds * round_s, rel=1e-9)
    slow, fast = r.summary["workers"]
    assert fast["idle_s"] == pytest.approx((rounds - 1) * (round_s - worker_round(1)), rel=1e-9)
    assert slow["comm_s"] == pytest.approx(rounds * 2 * (link.latency_s + mbytes / link.bandwidth_Bps))


def test_ps_message_time_is_paid_one_message_at_a_time(digits_mlp) -> None:
    """With ps_message_s = X the PS sends the round's pulls one after the other and takes the
    pushes in the order they start: the hand computation of the barrier round."""
    x = 0.004
    cluster = replace(two_devices(), ps_message_s=x)
    cfg = _cfg("ddp", stop={"max_epochs": 0.2})
    r = run_config(cfg, runs_root=None, cluster=cluster, workload=digits_mlp, strategy=SyncPS())
    fps, mbytes = r.summary["flops_per_sample"], r.summary["model_bytes"]
    link = cluster.sites[0].lan.transfer_time_s(mbytes)

    def compute(w: int) -> float:
        return 3 * 0.01 + 8 * (w + 1) * 3 * fps / cluster.devices[w].flops

    def round_s(x: float) -> float:
        busy, starts = 0.0, []
        for _w in range(2):  # the pulls: PS first, then the link
            busy += x
            starts.append(busy + link)
        for ready in sorted(s + compute(w) + link for w, s in enumerate(starts)):
            busy = max(ready, busy) + x  # the pushes: the link first, then the PS
        return busy

    assert r.summary["time_s"] == pytest.approx(r.summary["updates"] * round_s(x), rel=1e-9)
    assert round_s(x) - round_s(0.0) > 2 * x  # more than one pull and one push: it queues


def test_ps_nic_queues_concurrent_transfers(digits_mlp) -> None:
    """Both workers pull at t=0 through a PS NIC as slow as their links: the second waits."""
    nic = Link(1e6, 0.0)
    cfg = _cfg("ddp", stop={"max_epochs": 0.02})
    free = run_config(cfg, runs_root=None, cluster=two_devices(), workload=digits_mlp,
                      strategy=SyncPS())
    queued = run_config(cfg, runs_root=None, cluster=two_devices(nic), workload=digits_mlp,
                        strategy=SyncPS())
    assert queued.summary["time_s"] > free.summary["time_s"]


def test_virtual_clock_matches_hand_computation_allreduce(digits_mlp) -> None:
    cluster = two_devices()
    r = run_config(_cfg("local_sgd", options={"local_steps": 2}, stop={"max_epochs": 0.1}),
                   runs_root=None, cluster=cluster, workload=digits_mlp)
    fps, mbytes = r.summary["flops_per_sample"], r.summary["model_bytes"]
    compute_slow = 2 * 0.01 + 2 * 16 * fps / cluster.devices[0].flops
    round_s = compute_slow + cluster.ring_allreduce_time_s(mbytes)
    assert r.summary["time_s"] == pytest.approx(r.summary["updates"] * round_s, rel=1e-9)


def test_ddp_runs_at_the_slowest_pace_on_hetero4(mnist1d_cnn_small) -> None:
    """Equal batches: every step waits for the slowest device, so efficiency = n*min/sum."""
    r = run_config(_cfg("ddp", stop={"max_epochs": 0.5}, train={"batch_size": 32}),
                   runs_root=None, workload=mnist1d_cnn_small)
    bound = preset("hetero-4").ddp_efficiency_bound()
    assert bound == pytest.approx(0.5)
    assert r.summary["hardware_efficiency"] == pytest.approx(bound, rel=0.02)
    assert r.summary["hardware_efficiency"] <= bound


def test_ddp_and_local_sgd_learn(digits_mlp) -> None:
    for s in ("ddp", "local_sgd"):
        r = run_config(_cfg(s, stop={"max_epochs": 3.0}), runs_root=None, workload=digits_mlp)
        assert r.rows[0]["test_accuracy"] < 0.3
        assert r.final_accuracy > 0.85, s


def test_sixty_four_virtual_workers(digits_mlp) -> None:
    r = run_config(_cfg("local_sgd", options={"local_steps": 2}, stop={"max_epochs": 6.0},
                        train={"batch_size": 4}),
                   runs_root=None, cluster=homogeneous(64), workload=digits_mlp)
    assert len(r.summary["workers"]) == 64
    assert all(w["samples"] > 0 for w in r.summary["workers"])
    assert r.rows[-1]["test_loss"] < 0.5 * r.rows[0]["test_loss"]


def test_files_are_written(tmp_path, digits_mlp) -> None:
    r = run_config(_cfg("ddp", stop={"max_epochs": 0.5, "target_accuracy": 0.2}),
                   runs_root=tmp_path, workload=digits_mlp)
    run_dir = tmp_path / "t-ddp"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(r.rows) >= 2
    assert (run_dir / "summary.json").is_file()
    assert r.summary["tta_s"] is not None and r.summary["tta_s"] <= r.summary["time_s"]


@dataclass
class PairPS(Strategy):
    """Applies each worker's pushes two at a time (the first waits, buffered, for the second)
    and never holds a worker: a run stops with work both in flight and buffered. Counts what
    it hands out and applies per worker, for the unsent-work test."""

    name = "test_pair_ps"
    comm = "ps"
    update = "delta"

    def setup(self, ctx: RunContext) -> None:
        super().setup(ctx)
        n = ctx.n_workers
        self.held: list[list[int]] = [[] for _ in range(n)]
        self.handed, self.applied = [0] * n, [0] * n

    def next_task(self, worker: int) -> WorkTask:
        task = WorkTask(batch_size=8 * (worker + 1), local_steps=1 + worker % 3)
        self.handed[worker] += task.samples
        return task

    def on_push(self, push: Push) -> Decision:
        w, held = push.worker, self.held[push.worker]
        held.append(push.samples)
        if len(held) < 2:
            return Decision(release=(w,))
        self.applied[w] += sum(held)
        held.clear()
        weight = 0.5 / self.context.n_workers
        return Decision(apply=((w, weight), (w, weight)), release=(w,))


def test_unsent_samples_are_the_samples_drawn_minus_the_samples_applied(digits_mlp) -> None:
    from hetrain.engine.setup import prepare
    from hetrain.engine.sim import Simulator

    strategy = PairPS()
    sim = Simulator(prepare(_cfg("ddp", stop={"max_epochs": 1.0}), workload=digits_mlp,
                            strategy=strategy))
    s = sim.run().summary
    unsent = [w["unsent_samples"] for w in s["workers"]]
    assert s["unsent_samples"] == sum(unsent) == sim.owner.samples_taken - sim.applied_samples
    assert unsent == [h - a for h, a in zip(strategy.handed, strategy.applied, strict=True)]
    buffered = [sum(h) for h in strategy.held]
    assert any(buffered) and s["unsent_samples"] > sum(buffered)  # buffered and in flight
    assert sim.applied_samples == sum(strategy.applied) >= s["config"]["stop"]["max_epochs"] \
        * sim.p.ctx.train_samples


def test_any_torch_optimizer_and_gradient_clipping(digits_mlp) -> None:
    """optimizer.name may be any torch.optim class with its options; clip_grad_norm bounds
    every step's gradient, on a worker (delta) and on the server (gradient)."""
    import torch

    from hetrain.config import OptimizerConfig, config_from_dict
    from hetrain.engine.core import Replica, Server
    from hetrain.errors import ConfigError
    from hetrain.runner import run_config
    from hetrain.strategies.base import OuterOptimizer, WorkTask

    cfg = config_from_dict({"cluster": "homo-4", "workload": {"model": "mlp", "dataset": "digits"},
                            "strategy": {"name": "local_sgd", "local_steps": 2},
                            "optimizer": {"name": "RMSprop", "lr": 0.003,
                                          "options": {"alpha": 0.9}},
                            "stop": {"max_epochs": 2.0}})
    s = run_config(cfg, runs_root=None, workload=digits_mlp).summary
    assert s["final_accuracy"] > 0.5, s["final_accuracy"]
    for bad, match in (({"name": "RMSprop", "options": {"alphaa": 0.9}}, "alphaa"),
                       ({"name": "Nope"}, "RMSprop"), ({"name": "sgd", "options": {"x": 1}},
                                                       "optimizer.options")):
        with pytest.raises(ConfigError, match=match):
            OptimizerConfig(**bad)
    torch.manual_seed(0)
    clip = OptimizerConfig(lr=1.0, momentum=0.0, clip_grad_norm=1e-3)
    rep = Replica(digits_mlp, digits_mlp.build_model(), clip)
    r = rep.run(WorkTask(batch_size=32), "delta", [torch.arange(32)])
    assert r.update.norm() == pytest.approx(1e-3, rel=1e-3)  # lr 1 x a gradient of norm 1e-3
    server = Server(digits_mlp.build_model(), "gradient", clip, OuterOptimizer())
    before = server.params()
    server.apply([(1.0, torch.ones_like(before), [])])
    assert (before - server.params()).norm() == pytest.approx(1e-3, rel=1e-3)


def test_metrics_csv_holds_the_scalar_columns_of_every_row(tmp_path, digits_mlp) -> None:
    import csv
    import json

    cfg = config_from_dict({"name": "csv", "cluster": "homo-4",
                            "workload": {"model": "mlp", "dataset": "digits"},
                            "strategy": {"name": "ddp"}, "stop": {"max_epochs": 0.5}})
    run_config(cfg, runs_root=tmp_path, workload=digits_mlp)
    rows = [json.loads(line) for line in (tmp_path / "csv" / "metrics.jsonl").open()]
    with (tmp_path / "csv" / "metrics.csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) >= 2 and "busy_s" not in table[0]
    assert [float(r["test_accuracy"]) for r in table] == [r["test_accuracy"] for r in rows]


def test_a_decisions_lr_scale_is_the_servers_step(mnist1d_cnn_small) -> None:
    """Gradient pushes with Decision.lr_scale 0.5: the run of optimizer.lr halved."""
    from hetrain.engine.setup import prepare
    from hetrain.engine.sim import Simulator
    from test_dist_shards import SyncPS, trio_cfg

    cfg = replace(trio_cfg("test_sync_ps"), engine="sim")
    halved_cfg = replace(cfg, optimizer=replace(cfg.optimizer, lr=cfg.optimizer.lr * 0.5))
    runs = [Simulator(prepare(c, strategy=st, workload=mnist1d_cnn_small)).run()
            for c, st in ((cfg, SyncPS(lr_scale=0.5)), (halved_cfg, SyncPS()), (cfg, SyncPS()))]
    scaled, halved, plain = ([r["test_loss"] for r in run.rows] for run in runs)
    assert scaled == pytest.approx(halved, abs=1e-6)
    assert scaled != pytest.approx(plain, abs=1e-3)
