"""Learning-rate schedulers stepped by the global step (optimizer.scheduler), on both engines."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from hetrain.config import OptimizerConfig, RunConfig, config_from_dict
from hetrain.engine.core import Server, next_task, schedule_metrics, set_flat_grads
from hetrain.engine.schedule import LrSchedule, scheduler_names
from hetrain.errors import ConfigError
from hetrain.runner import run_config
from hetrain.strategies import OuterOptimizer, WorkTask
from hetrain.strategies.base import Decision, Push, Strategy

SCHEDULERS: list[tuple[str, dict[str, Any]]] = [
    ("StepLR", {"step_size": 3, "gamma": 0.5}),
    ("CosineAnnealingLR", {"T_max": 10, "eta_min": 0.01}),
    ("OneCycleLR", {"max_lr": 2.0, "total_steps": 20}),
    ("LinearLR", {"start_factor": 0.1, "total_iters": 5}),
    ("ExponentialLR", {"gamma": 0.9}),
    ("MultiStepLR", {"milestones": [2, 5, 9], "gamma": 0.3}),
    ("CyclicLR", {"base_lr": 0.1, "max_lr": 1.0, "step_size_up": 4}),
]


def torch_factors(name: str, options: dict[str, Any], n: int, lr: float = 1.0) -> list[float]:
    """get_last_lr() / lr after 0..n-1 steps of torch's own scheduler on a real optimizer."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=lr, momentum=0.9)
    sched = getattr(torch.optim.lr_scheduler, name)(opt, **options)
    out = []
    for _ in range(n):
        out.append(sched.get_last_lr()[0] / lr)
        opt.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sched.step()
    return out


# ---- LrSchedule against torch ---------------------------------------------------------------
@pytest.mark.parametrize(("name", "options"), SCHEDULERS, ids=[s[0] for s in SCHEDULERS])
def test_factors_equal_torch_in_order_and_out_of_order(name: str, options: dict) -> None:
    n = 20
    expected = torch_factors(name, options, n)
    assert len(set(expected)) > 1  # the schedule changes the lr in this window
    assert [LrSchedule(name, options).factor(k) for k in range(n)] == expected
    order = [7, 3, 15, 0, 19, 2, 2, 11, 18, 1, 19, 17]
    for cache in (4096, 3, 1):  # small caches: earlier steps are recomputed from scratch
        sched = LrSchedule(name, options, cache=cache)
        assert [sched.factor(k) for k in order] == [expected[k] for k in order]


COMPOSITES: list[tuple[str, dict[str, Any]]] = [
    ("SequentialLR", {"schedulers": [{"name": "LinearLR", "start_factor": 0.1, "total_iters": 5},
                                     {"name": "CosineAnnealingLR", "T_max": 10}],
                      "milestones": [5]}),
    ("SequentialLR", {"schedulers": [{"name": "ConstantLR", "factor": 0.5, "total_iters": 3},
                                     {"name": "StepLR", "step_size": 3, "gamma": 0.5},
                                     {"name": "ExponentialLR", "gamma": 0.8}],
                      "milestones": [4, 11]}),
    ("ChainedScheduler", {"schedulers": [{"name": "LinearLR", "start_factor": 0.2,
                                          "total_iters": 6},
                                         {"name": "ExponentialLR", "gamma": 0.9}]}),
    ("ChainedScheduler", {"schedulers": [{"name": "ConstantLR", "factor": 0.3,
                                          "total_iters": 4},
                                         {"name": "MultiStepLR", "milestones": [3, 9],
                                          "gamma": 0.5}]}),
]


def torch_composite_factors(name: str, options: dict[str, Any], n: int) -> list[float]:
    """torch's own composite, built the documented way on a real optimizer."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=1.0, momentum=0.9)
    sched = torch.optim.lr_scheduler
    subs = [getattr(sched, s["name"])(opt, **{k: v for k, v in s.items() if k != "name"})
            for s in options["schedulers"]]
    whole = (sched.SequentialLR(opt, subs, milestones=options["milestones"])
             if name == "SequentialLR" else sched.ChainedScheduler(subs, optimizer=opt))
    out = []
    for _ in range(n):
        out.append(whole.get_last_lr()[0])
        opt.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            whole.step()
    return out


@pytest.mark.parametrize(("name", "options"), COMPOSITES,
                         ids=[f"{c[0]}-{k}" for k, c in enumerate(COMPOSITES)])
def test_composite_factors_equal_torch(name: str, options: dict) -> None:
    n = 20
    expected = torch_composite_factors(name, options, n)
    assert len(set(expected)) > 3
    assert [LrSchedule(name, options).factor(k) for k in range(n)] == expected
    order = [7, 3, 15, 0, 19, 2, 2, 11, 18, 1, 19, 17]
    for cache in (4096, 3, 1):
        sched = LrSchedule(name, options, cache=cache)
        assert [sched.factor(k) for k in order] == [expected[k] for k in order]
    cfg = opt(scheduler=name, scheduler_options=options)  # and the config accepts it
    assert cfg.scheduler == name


def test_onecycle_holds_its_last_factor_past_total_steps() -> None:
    sched = LrSchedule("OneCycleLR", {"max_lr": 1.0, "total_steps": 5})
    last = torch_factors("OneCycleLR", {"max_lr": 1.0, "total_steps": 5}, 5)[-1]
    assert sched.factor(4) == last and sched.factor(50) == last


def test_negative_step_is_refused() -> None:
    with pytest.raises(ValueError):
        LrSchedule("StepLR", {"step_size": 1}).factor(-1)


# ---- config validation ------------------------------------------------------------------------
def opt(**kw: Any) -> OptimizerConfig:
    return config_from_dict({"optimizer": kw}).optimizer


def test_a_valid_scheduler_loads() -> None:
    cfg = opt(scheduler="StepLR", scheduler_options={"step_size": 10, "gamma": 0.5})
    assert cfg.scheduler == "StepLR" and cfg.scheduler_options == {"step_size": 10, "gamma": 0.5}
    assert "StepLR" in scheduler_names() and "LRScheduler" not in scheduler_names()


@pytest.mark.parametrize(("table", "match"), [
    ({"scheduler": "NoSuchLR"}, r"not a torch\.optim\.lr_scheduler.*choose one of:.*StepLR"),
    ({"scheduler": "ReduceLROnPlateau", "scheduler_options": {"mode": "median"}},
     r"do not fit ReduceLROnPlateau.*median"),
    ({"scheduler": "ChainedScheduler", "scheduler_options": {
        "schedulers": [{"name": "ReduceLROnPlateau"}]}},
     r"schedulers\[0\]\.name = 'ReduceLROnPlateau' cannot be used inside ChainedScheduler"),
    ({"scheduler": "LambdaLR"}, r"'LambdaLR' needs optimizer\.scheduler_options\.lr_lambda, "
                                 r"a Python callable.*TOML.*use the Python API: hetrain\.train"),
    ({"scheduler": "MultiplicativeLR", "scheduler_options": {"lr_lambda": "0.9"}},
     r"'MultiplicativeLR' needs .*lr_lambda, a Python callable \(got '0\.9'\).*Python API"),
    ({"scheduler": "SequentialLR", "scheduler_options": {
        "schedulers": [{"name": "StepLR", "step_size": 2}, {"name": "LambdaLR"}],
        "milestones": [3]}},
     r"schedulers\[1\]\.name = 'LambdaLR' needs .*schedulers\[1\]\.lr_lambda.*Python API"),
    ({"scheduler": "SequentialLR"}, r"SequentialLR needs scheduler_options\.schedulers.*"
                                     r"milestones = \[5\]"),
    ({"scheduler": "ChainedScheduler", "scheduler_options": {"schedulers": []}},
     r"ChainedScheduler needs scheduler_options\.schedulers"),
    ({"scheduler": "SequentialLR", "scheduler_options": {
        "schedulers": [{"name": "StepLR", "step_size": 2}, {"name": "NoSuchLR"}],
        "milestones": [3]}},
     r"schedulers\[1\]\.name = 'NoSuchLR' is not a torch"),
    ({"scheduler": "SequentialLR", "scheduler_options": {
        "schedulers": [{"name": "StepLR", "step_size": 2}, {"name": "StepLR"}],
        "milestones": [3]}},
     r"schedulers\[1\] \{\} do not fit StepLR.*step_size"),
    ({"scheduler": "ChainedScheduler", "scheduler_options": {
        "schedulers": [{"name": "StepLR", "step_size": 2, "gamma": -1.0}]}},
     r"schedulers\[0\] \(StepLR.*factor -1\.0 at step 2"),
    ({"scheduler": "ChainedScheduler", "scheduler_options": {
        "schedulers": [{"name": "StepLR", "step_size": 2, "last_epoch": 4}]}},
     r"schedulers\[0\]\.last_epoch cannot be set"),
    ({"scheduler": "ChainedScheduler", "scheduler_options": {
        "schedulers": [{"name": "StepLR", "step_size": 2, "gamma": float("nan")}]}},
     r"schedulers\[0\] must hold finite numbers"),
    ({"scheduler": "SequentialLR", "scheduler_options": {
        "schedulers": [{"name": "ChainedScheduler", "schedulers": []}], "milestones": []}},
     r"schedulers\[0\]\.name = 'ChainedScheduler' cannot be used inside SequentialLR"),
    ({"scheduler": "ChainedScheduler", "scheduler_options": {"schedulers": ["StepLR"]}},
     r"schedulers\[0\] must be a table with a scheduler name"),
    ({"scheduler": "SequentialLR", "scheduler_options": {
        "schedulers": [{"name": "StepLR", "step_size": 2}], "milestones": [1, 2]}},
     r"do not fit SequentialLR.*milestone"),
    ({"scheduler": "LRScheduler"}, r"cannot be used: it is the abstract base"),
    ({"scheduler": "StepLR"}, r"do not fit StepLR.*step_size"),
    ({"scheduler": "StepLR", "scheduler_options": {"step_size": 2, "gama": 0.5}},
     r"do not fit StepLR.*gama"),
    ({"scheduler": "OneCycleLR", "scheduler_options": {"max_lr": 1.0}},
     r"do not fit OneCycleLR.*total_steps"),
    ({"scheduler": "StepLR", "scheduler_options": {"step_size": 2, "gamma": float("nan")}},
     r"finite numbers.*nan"),
    ({"scheduler": "MultiStepLR", "scheduler_options": {"milestones": [1, float("inf")]}},
     r"finite numbers.*inf"),
    ({"scheduler": "StepLR", "scheduler_options": {"step_size": 2, "gamma": -1.0}},
     r"factor -1\.0 at step 2.*finite and >= 0"),
    ({"scheduler": "StepLR", "scheduler_options": {"step_size": 2, "last_epoch": 5}},
     r"last_epoch cannot be set.*global step"),
    ({"scheduler_options": {"step_size": 2}}, r"optimizer\.scheduler is empty"),
    ({"scheduler": 3}, r"optimizer\.scheduler must be"),
    ({"scheduler": "StepLR", "scheduler_options": 5}, r"must be a table"),
])
def test_bad_scheduler_is_a_one_line_config_error(table: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        opt(**table)
    assert "\n" not in str(e.value)


@pytest.mark.multiproc
def test_cli_refuses_a_bad_scheduler_with_exit_2(tmp_path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[optimizer]\nscheduler = "LambdaLR"\n')
    p = subprocess.run([sys.executable, "-m", "hetrain", "run", str(path), "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "LambdaLR" in lines[0] and "Python API" in lines[0], p.stderr


# ---- the shared arithmetic ----------------------------------------------------------------
STEP = {"scheduler": "StepLR", "scheduler_options": {"step_size": 2, "gamma": 0.5}}


def test_gradient_server_steps_with_the_scheduled_lr() -> None:
    """Plain SGD on a constant gradient: each update moves the weights by lr(step) x g."""
    cfg = OptimizerConfig(lr=0.1, momentum=0.0, **STEP)
    model = nn.Linear(3, 1, bias=False)
    server = Server(model, "gradient", cfg, OuterOptimizer())
    grad = torch.ones(3)
    expected = [0.1 * f for f in torch_factors("StepLR", STEP["scheduler_options"], 7)]
    for k in range(7):
        before = server.params()
        assert schedule_metrics(server) == {"lr": pytest.approx(expected[k], rel=1e-12)}
        server.apply([(1.0, grad, [])])
        assert server.optimizer.param_groups[0]["lr"] == pytest.approx(expected[k], rel=1e-12)
        assert torch.allclose(before - server.params(), expected[k] * grad, rtol=1e-6)
    assert server.version == 7


def test_gradient_server_scales_its_lr_by_the_decisions_and_skips_a_discarded_update() -> None:
    """AdamW on the server: an update with lr_scale 0.5 is torch's AdamW step at half the lr;
    one whose weights are all 0 leaves the parameters and the optimizer's state alone (a step
    on a zero gradient would still move them), though it counts as an update."""
    torch.manual_seed(0)
    cfg = OptimizerConfig(name="adamw", lr=0.1, weight_decay=0.01)
    model = nn.Linear(3, 2)
    reference = nn.Linear(3, 2)
    reference.load_state_dict(model.state_dict())
    server = Server(model, "gradient", cfg, OuterOptimizer())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.01)
    for _ in range(3):
        grad = torch.randn(8)
        server.apply([(0.25, grad, []), (0.75, grad, [])], lr_scale=0.5)
        set_flat_grads(list(reference.parameters()), grad)
        ref_opt.step()
        assert torch.allclose(server.params(),
                              torch.nn.utils.parameters_to_vector(reference.parameters()),
                              atol=1e-7)
    before, state = server.params(), str(server.optimizer.state_dict())
    server.apply([(0.0, torch.randn(8), []), (0.0, torch.randn(8), [])], lr_scale=0.5)
    assert torch.equal(server.params(), before) and str(server.optimizer.state_dict()) == state
    assert server.version == 4


def test_delta_server_outer_step_is_not_scheduled() -> None:
    cfg = OptimizerConfig(lr=0.1, **STEP)
    server = Server(nn.Linear(3, 1, bias=False), "delta", cfg, OuterOptimizer(lr=0.7))
    for _ in range(5):
        server.apply([(1.0, torch.ones(3), [])])
        assert server.optimizer.param_groups[0]["lr"] == 0.7


class Fixed(Strategy):
    name = "test_fixed_scale"

    def next_task(self, worker: int) -> WorkTask:
        return WorkTask(batch_size=4, lr_scale=3.0)

    def on_push(self, push: Push) -> Decision:  # pragma: no cover - not pushed to
        return Decision()


def test_next_task_scales_the_strategys_lr_by_the_factor_at_the_version() -> None:
    server = Server(nn.Linear(2, 1), "delta", OptimizerConfig(**STEP), OuterOptimizer())
    factors = torch_factors("StepLR", STEP["scheduler_options"], 6)
    for v in range(6):
        server.version = v
        assert next_task(Fixed(), 0, server).lr_scale == pytest.approx(3.0 * factors[v])
    plain = Server(nn.Linear(2, 1), "delta", OptimizerConfig(), OuterOptimizer())
    assert next_task(Fixed(), 0, plain) == WorkTask(batch_size=4, lr_scale=3.0)
    assert schedule_metrics(plain) == {}


# ---- whole runs -------------------------------------------------------------------------------
PAIR = {"name": "pair", "sites": [{"name": "s", "lan": {"bandwidth_Bps": 1e9},
                                   "wan": {"bandwidth_Bps": 1e9}}],
        "devices": [{"name": "slow", "flops": 2e8}, {"name": "fast", "flops": 4e8}]}


def make_cfg(strategy: str, engine: str = "sim", epochs: float = 0.1,
             scheduler: dict[str, Any] | None = None) -> RunConfig:
    return config_from_dict({
        "name": f"sched-{strategy}", "engine": engine, "cluster": PAIR,
        "workload": {"model": "cnn", "dataset": "mnist1d",
                     "dataset_options": {"num_samples": 4000}},
        "strategy": {"name": strategy}, "optimizer": {"lr": 0.05, **(scheduler or STEP)},
        "train": {"batch_size": 32, "eval_every_epochs": 0.02},
        "stop": {"max_epochs": epochs},
        "dist": {"time_scale": 0.05, "worker_timeout_s": 20.0, "init_timeout_s": 60.0}})


def expected_lr(cfg: RunConfig, updates: int) -> float:
    o = cfg.optimizer
    return o.lr * torch_factors(o.scheduler, o.scheduler_options, updates + 1)[updates]


def check_lr_column(cfg: RunConfig, rows: list[dict[str, Any]]) -> None:
    assert len({row["updates"] for row in rows}) >= 3, rows
    for row in rows:
        assert row["lr"] == pytest.approx(expected_lr(cfg, row["updates"]), rel=1e-12), row


@pytest.mark.parametrize("strategy", ["ddp", "cadp"])
def test_sim_lr_column_follows_torch(strategy: str, tmp_path, mnist1d_cnn_small) -> None:
    cfg = make_cfg(strategy)
    r = run_config(cfg, runs_root=tmp_path, workload=mnist1d_cnn_small)
    check_lr_column(cfg, r.rows)
    written = [json.loads(line) for line in
               (tmp_path / cfg.name / "metrics.jsonl").read_text().splitlines()]
    assert [row["lr"] for row in written] == [row["lr"] for row in r.rows]
    assert len({row["lr"] for row in r.rows}) > 1


def test_without_a_scheduler_there_is_no_lr_column(mnist1d_cnn_small) -> None:
    cfg = make_cfg("ddp", epochs=0.02)
    cfg = cfg.replace(optimizer=OptimizerConfig(lr=0.05))
    r = run_config(cfg, runs_root=None, workload=mnist1d_cnn_small)
    assert all("lr" not in row for row in r.rows)


@pytest.mark.parametrize("strategy", ["ddp", "cadp"])
def test_sim_a_zero_lr_freezes_the_model_after_the_first_update(strategy: str,
                                                                mnist1d_cnn_small) -> None:
    """gamma 0 after one step: the first update moves the model, none after it (gradient
    mode through the server's lr, delta mode through the workers' lr)."""
    cfg = make_cfg(strategy, scheduler={"scheduler": "StepLR",
                                        "scheduler_options": {"step_size": 1, "gamma": 0.0}})
    rows = run_config(cfg, runs_root=None, workload=mnist1d_cnn_small).rows
    frozen = {row["test_loss"] for row in rows if row["updates"] >= 1}
    assert rows[-1]["updates"] >= 3 and len(frozen) == 1, rows
    assert rows[0]["test_loss"] not in frozen


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_dist_lr_column_matches_torch_and_the_simulator(tmp_path, mnist1d_cnn_small) -> None:
    """ddp over gloo (the workers' own servers step with the scheduled lr) against the same
    run on the simulator: same updates at every evaluation, same lr, about the same model."""
    from hetrain.engine.dist import run_distributed

    cfg = make_cfg("ddp", engine="dist", epochs=0.06)
    d = run_distributed(cfg, run_dir=tmp_path / "d", workload=mnist1d_cnn_small)
    s = run_config(cfg.replace(engine="sim"), runs_root=None, workload=mnist1d_cnn_small)
    check_lr_column(cfg, d.rows)
    assert [(r["updates"], r["lr"]) for r in d.rows] == [(r["updates"], r["lr"])
                                                         for r in s.rows]
    assert d.summary["final_accuracy"] == pytest.approx(s.summary["final_accuracy"], abs=2e-3)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("strategy", "shards"), [("cadp", 1), ("asp", 2)])
def test_dist_ps_strategies_follow_the_schedule(strategy: str, shards: int, tmp_path,
                                                mnist1d_cnn_small) -> None:
    """PS strategies over gloo (delta: the workers' lr; gradient, sharded: every shard's
    server lr): the lr column is torch's at each row's updates, and a zero lr after the first
    update freezes the model on the dist engine too."""
    from dataclasses import replace

    from hetrain.engine.dist import run_distributed

    cfg = make_cfg(strategy, engine="dist", epochs=0.06)
    cfg = cfg.replace(dist=replace(cfg.dist, ps_shards=shards))
    check_lr_column(cfg, run_distributed(cfg, run_dir=tmp_path / "a",
                                         workload=mnist1d_cnn_small).rows)
    frozen = cfg.replace(optimizer=OptimizerConfig(
        lr=0.05, scheduler="StepLR", scheduler_options={"step_size": 1, "gamma": 0.0}))
    rows = run_distributed(frozen, run_dir=tmp_path / "b", workload=mnist1d_cnn_small).rows
    assert len({row["test_loss"] for row in rows if row["updates"] >= 1}) == 1, rows


def test_sim_sequential_lr_column_follows_torch(mnist1d_cnn_small) -> None:
    name, options = COMPOSITES[0]
    cfg = make_cfg("ddp", scheduler={"scheduler": name, "scheduler_options": options})
    rows = run_config(cfg, runs_root=None, workload=mnist1d_cnn_small).rows
    factors = torch_composite_factors(name, options, max(r["updates"] for r in rows) + 1)
    assert len({row["lr"] for row in rows}) > 2, rows
    for row in rows:
        assert row["lr"] == pytest.approx(0.05 * factors[row["updates"]], rel=1e-12), row


# ---- LambdaLR / MultiplicativeLR: a callable from the Python API --------------------------
def warmup(step: int) -> float:
    """A module-level lr_lambda (picklable): linear warmup over 4 steps, then 0.9^step."""
    return (step + 1) / 4 if step < 3 else 0.9 ** step


def shrink(step: int) -> float:
    return 0.8 if step % 2 else 1.0


@pytest.mark.parametrize(("name", "fn"), [("LambdaLR", warmup), ("MultiplicativeLR", shrink)])
def test_callable_factors_equal_torch(name: str, fn) -> None:
    expected = torch_factors(name, {"lr_lambda": fn}, 20)
    sched = LrSchedule(name, {"lr_lambda": fn}, cache=3)
    order = [7, 3, 15, 0, 19, 2, 11, 1]
    assert [sched.factor(k) for k in order] == [expected[k] for k in order]
    if name == "LambdaLR":
        assert expected == [warmup(k) for k in range(20)]


def test_sim_lambda_lr_column_is_the_lambda(tmp_path, mnist1d_cnn_small) -> None:
    """A callable in the config (as hetrain.train puts it there): the lr column is
    optimizer.lr x fn(updates); the record names the callable."""
    cfg = make_cfg("ddp", scheduler={"scheduler": "LambdaLR",
                                     "scheduler_options": {"lr_lambda": warmup}})
    r = run_config(cfg, runs_root=tmp_path, workload=mnist1d_cnn_small)
    assert len({row["lr"] for row in r.rows}) > 2, r.rows
    for row in r.rows:
        assert row["lr"] == pytest.approx(0.05 * warmup(row["updates"]), rel=1e-12), row
    summary = json.loads((tmp_path / cfg.name / "summary.json").read_text())
    assert summary["config"]["optimizer"]["scheduler_options"] == {
        "lr_lambda": f"<callable {__name__}.warmup>"}


def test_api_lambda_and_multiplicative_on_the_simulator() -> None:
    import hetrain
    from test_api import QUICK, TEST, TRAIN, Tiny

    for name, fn in (("LambdaLR", warmup), ("MultiplicativeLR", shrink)):
        r = hetrain.train(Tiny(), TRAIN, test_dataset=TEST,
                          **{**QUICK, "max_epochs": 0.3, "strategy": "ddp",
                             "scheduler": {"name": name, "lr_lambda": fn}})
        last = max(row["updates"] for row in r.rows)
        factors = torch_factors(name, {"lr_lambda": fn}, last + 1)
        assert len({row["lr"] for row in r.rows}) > 1, r.rows
        for row in r.rows:
            assert row["lr"] == pytest.approx(0.1 * factors[row["updates"]], rel=1e-12), row


def test_api_unpicklable_lr_lambda_is_refused_before_dist_spawns() -> None:
    import hetrain
    from test_api import QUICK, TEST, TRAIN, Tiny

    with pytest.raises(ConfigError, match=r"scheduler\.lr_lambda=.*<lambda> cannot be pickled"
                       ) as e:
        hetrain.train(Tiny(), TRAIN, test_dataset=TEST, engine="dist",
                      **{**QUICK, "max_epochs": 0.1,
                         "scheduler": {"name": "LambdaLR", "lr_lambda": lambda s: 0.9 ** s}})
    assert "\n" not in str(e.value)


# ---- ReduceLROnPlateau: stepped by the evaluations -----------------------------------------
@pytest.mark.parametrize("options", [
    {"patience": 1, "factor": 0.5},
    {"mode": "max", "patience": 0, "factor": 0.3, "cooldown": 2, "threshold": 0.05},
    {"patience": 2, "factor": 0.1, "min_lr": 0.004, "threshold_mode": "abs",
     "threshold": 0.01},
])
def test_plateau_factors_equal_torch_for_a_metric_sequence(options: dict) -> None:
    from hetrain.engine.schedule import PlateauSchedule, make_schedule

    losses = [1.0, 0.8, 0.79, 0.795, 0.9, 0.7, 0.7, 0.71, 0.72, 0.69, 0.69, 0.7, 0.7, 0.7]
    opt_ = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=1.0, momentum=0.9)
    ref = torch.optim.lr_scheduler.ReduceLROnPlateau(opt_, **options)
    sched = make_schedule("ReduceLROnPlateau", options)
    assert isinstance(sched, PlateauSchedule)
    seen = []  # (step, factor from then on)
    for k, loss in enumerate(losses):
        metric = loss if options.get("mode", "min") == "min" else 1 - loss
        step = 5 * (k + 1)
        sched.observe(step, loss, 1 - loss)
        ref.step(metric)
        seen.append((step, opt_.param_groups[0]["lr"]))
        assert sched.factor(step) == opt_.param_groups[0]["lr"]
    assert len({f for _, f in seen}) > 1  # it did reduce
    assert sched.factor(0) == sched.factor(4) == 1.0
    for step, f in seen:  # earlier steps keep the factor in force then
        assert sched.factor(step) == f and sched.factor(step + 4) == f


@pytest.mark.parametrize(("strategy", "options", "metric"), [
    ("ddp", {"patience": 1, "factor": 0.5, "threshold": 0.5}, "test_loss"),
    ("cadp", {"mode": "max", "patience": 0, "factor": 0.5, "threshold": 0.5}, "test_accuracy")])
def test_sim_plateau_drops_the_lr_after_a_plateau(strategy, options, metric,
                                                  mnist1d_cnn_small) -> None:
    """A threshold of 50%: no evaluation improves enough, so every patience + 1 evaluations
    the lr halves; each row's lr is torch's ReduceLROnPlateau stepped on the rows before it
    (the test loss, or the accuracy in mode max)."""
    cfg = make_cfg(strategy, epochs=0.1,
                   scheduler={"scheduler": "ReduceLROnPlateau", "scheduler_options": options})
    rows = run_config(cfg, runs_root=None, workload=mnist1d_cnn_small).rows
    opt_ = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.05)
    ref = torch.optim.lr_scheduler.ReduceLROnPlateau(opt_, **options)
    for row in rows:
        assert row["lr"] == pytest.approx(opt_.param_groups[0]["lr"], rel=1e-12), rows
        ref.step(row[metric])
    assert rows[0]["lr"] == pytest.approx(0.05) and rows[-1]["lr"] <= 0.05 / 4, rows


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("strategy", "shards"), [
    ("ddp", 1), pytest.param("asp", 2, marks=pytest.mark.slow)])
def test_dist_plateau_reaches_servers_that_never_evaluate(strategy: str, shards: int, tmp_path,
                                                           mnist1d_cnn_small) -> None:
    """ReduceLROnPlateau steps on rank 0's evaluations; all-reduce workers and PS shards run
    their own servers and get its factor with each update. Factor 0 after the second
    evaluation (every evaluation is a plateau at threshold 0.9) freezes the model there, on
    every server alike: a server still at the base lr would move it."""
    from dataclasses import replace

    from hetrain.engine.dist import run_distributed

    cfg = make_cfg(strategy, engine="dist", epochs=0.06, scheduler={
        "scheduler": "ReduceLROnPlateau",
        "scheduler_options": {"patience": 0, "factor": 0.0, "threshold": 0.9}})
    cfg = cfg.replace(dist=replace(cfg.dist, ps_shards=shards))
    rows = run_distributed(cfg, run_dir=tmp_path / "p", workload=mnist1d_cnn_small).rows
    assert len(rows) >= 4 and rows[1]["lr"] == 0.05 and rows[2]["lr"] == 0.0, rows
    assert rows[-1]["updates"] > rows[1]["updates"] + 1, rows
    assert len({row["test_loss"] for row in rows[1:]}) == 1, rows
    assert rows[0]["test_loss"] != rows[1]["test_loss"]
