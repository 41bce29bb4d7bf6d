"""ASHL: the plateau switch fires exactly once on a scripted loss curve (the strategy driven
directly with Push records: it is a pure state machine), the stages' gaps and plans, the
measured-profile path (convergence on digits: tests/test_converges.py)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from helpers import run_context
from hetrain.config import config_from_dict
from hetrain.errors import ConfigError
from hetrain.plan.local_steps import plan_for_comm_fraction, plan_for_fastest
from hetrain.profile import Profile
from hetrain.runner import run_config
from hetrain.strategies import Push, RunContext, make_strategy
from hetrain.strategies.ashl import PlateauSwitch


def ctx(cluster: str = "hetero-8") -> RunContext:
    return run_context(cluster, model_bytes=50_000, sample_bytes=160, train_samples=10_000,
                       batch_size=32)


def scripted_losses(n: int = 400, seed: int = 0) -> list[float]:
    """Fast decay, a plateau from ~push 150, then a second (late) drop and plateau."""
    rng = np.random.default_rng(seed)
    k = np.arange(n)
    curve = 0.4 + 2.0 * np.exp(-k / 40) - 0.2 * (k > 300)
    return list(curve * (1 + 0.01 * rng.standard_normal(n)))


def expected_switch(losses: list[float], window: int, threshold: float, patience: int) -> int:
    """The rule written out independently: index of the loss that completes the
    `patience`-th consecutive window whose mean improved by less than `threshold`."""
    means = [sum(losses[j:j + window]) / window for j in range(0, len(losses) - window + 1,
                                                                 window)]
    run = 0
    for j in range(1, len(means)):
        run = run + 1 if (means[j - 1] - means[j]) / means[j - 1] < threshold else 0
        if run >= patience:
            return (j + 1) * window - 1
    raise AssertionError("the scripted curve must plateau")


def test_plateau_switch_fires_exactly_once():
    losses = scripted_losses()
    rule = PlateauSwitch(window=16, threshold=0.02, patience=2)
    fired = [i for i, x in enumerate(losses) if rule.feed(x)]
    assert fired == [expected_switch(losses, 16, 0.02, 2)]
    assert 100 < fired[0] < 300  # on the plateau, not in the decay nor at the late drop


def test_ashl_switches_stage_exactly_once_when_driven_by_pushes():
    s = make_strategy("ashl", switch_window=16, switch_threshold=0.02, switch_patience=2)
    s.setup(ctx())
    n = s.context.n_workers
    ahl_round_s = s.plan.round_time_s
    losses = scripted_losses()
    stages, releases = [], []
    for i, loss in enumerate(losses):
        w = i % n
        d = s.on_push(Push(worker=w, base_version=0, samples=32, steps=1, loss=loss,
                           compute_s=s.costs.step_s[w], comm_s=s.costs.comm_s[w],
                           arrival_s=0.01 * i))
        stages.append(s.stage)
        releases.append(d.release)
        assert d.apply[0][0] == w
    switches = [i for i in range(1, len(stages)) if stages[i] != stages[i - 1]]
    assert switches == [expected_switch(losses, 16, 0.02, 2)]
    assert stages[0] == 1 and stages[-1] == 2
    assert s.gate.bound == s.shl_gap and s.switch_time_s == pytest.approx(0.01 * switches[0])
    assert s.plan.round_time_s < ahl_round_s  # SHL commits more often
    assert all(r == (i % n,) for i, r in enumerate(releases))  # round robin: nobody held
    stats = s.stats()
    assert stats["ahl_pushes"] == switches[0] + 1 and stats["stage"] == 2


def test_ahl_tolerates_a_large_gap_and_shl_a_small_one():
    s = make_strategy("ashl", ahl_gap=3, shl_gap=0, switch_window=1000)
    s.setup(ctx())

    def push(w: int) -> tuple[int, ...]:
        return s.on_push(Push(worker=w, base_version=0, samples=32, steps=1, loss=1.0,
                              compute_s=0.1, comm_s=0.01, arrival_s=0.0)).release

    assert [push(7) for _ in range(4)] == [(7,), (7,), (7,), ()]  # 4 ahead > 3: held
    assert s.gate.set_bound(0) == ()  # the SHL bound (as the switch sets it)
    assert [push(w) for w in range(6)] == [()] * 6  # lock-step: wait for the slowest...
    assert push(6) == (0, 1, 2, 3, 4, 5, 6)  # ...which is worker 6; 7 is still 3 ahead


def test_weights_make_a_round_the_sample_weighted_average():
    s = make_strategy("ashl")
    s.setup(ctx())
    total = 0.0
    for w in range(8):
        steps = s.next_task(w).local_steps
        d = s.on_push(Push(worker=w, base_version=0, samples=32 * steps, steps=steps,
                           loss=1.0, compute_s=steps * s.costs.step_s[w],
                           comm_s=s.costs.comm_s[w], arrival_s=0.0))
        total += d.apply[0][1]
    assert total == pytest.approx(1.0, rel=0.15)  # rounding of the planned steps only
    uniform = make_strategy("ashl", weighting="uniform")
    uniform.setup(ctx())
    d = uniform.on_push(Push(0, 0, 32, 1, 1.0, 0.1, 0.01, 0.0))
    assert d.apply == ((0, 1 / 8),)


def test_stage_zero_reads_a_measured_profile(tmp_path):
    p = Profile.from_context(ctx())
    slow = [w.step_time_s * (3.0 if i == 7 else 1.0) for i, w in enumerate(p.workers)]
    measured = Profile(tuple(type(w)(w.name, w.batch_size, t, w.push_time_s, w.pull_time_s)
                             for w, t in zip(p.workers, slow, strict=True)),
                       p.model_bytes, p.push_bytes, "measured")
    path = tmp_path / "profile.json"
    measured.save(path)
    s = make_strategy("ashl", profile_path=str(path))
    s.setup(ctx())
    base = make_strategy("ashl")
    base.setup(ctx())
    assert s.stats()["profile_source"] == "measured"
    assert s.plan.targets[7] == pytest.approx(base.plan.targets[7] / 3, rel=0.05)
    with pytest.raises(ConfigError, match="workers"):
        make_strategy("ashl", profile_path=str(path)).setup(ctx("hetero-4"))


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="ahl_comm_fraction"):
        make_strategy("ashl", ahl_comm_fraction=0.0)
    with pytest.raises(ConfigError, match="switch_patience"):
        make_strategy("ashl", switch_patience=0)
    for bad in (-1.0, math.nan, True, "4"):
        with pytest.raises(ConfigError, match="min_commits_per_epoch"):
            make_strategy("ashl", min_commits_per_epoch=bad)


def epoch_at_full_speed_s(c: RunContext) -> float:
    """train_samples / the devices' summed samples/s, priced here from the Cluster's numbers."""
    return c.train_samples / sum(
        c.batch_size / (d.step_overhead_s + c.batch_size * c.flops_per_sample / d.flops)
        for d in c.cluster.devices)


def test_commit_cap_bounds_the_round_time_on_geo16():
    """geo-16's WAN links plan a 1.38 s AHL round; an epoch at full speed is ~1.04 s, so
    uncapped every worker commits < 1 time per epoch. The cap (epoch / 4) cuts T to 0.26 s and
    each worker fills it as the planner does, H_i = max(1, (T - c_i) / s_i)."""
    c = ctx("geo-16")
    free = make_strategy("ashl", min_commits_per_epoch=0)
    free.setup(c)
    capped = make_strategy("ashl")
    capped.setup(c)
    cap = epoch_at_full_speed_s(c) / 4
    assert cap == pytest.approx(0.2607, abs=1e-3)
    assert free.plan.round_time_s > 4 * cap and not free.plan.capped
    assert capped.plan.capped and capped.plan.round_time_s == pytest.approx(cap, rel=1e-12)
    workers = Profile.from_context(c).workers
    for w, target, steps in zip(workers, capped.plan.targets, capped.plan.local_steps,
                                strict=True):
        assert target == pytest.approx(max(1.0, (cap - w.comm_time_s) / w.step_time_s))
        assert w.comm_time_s + target * w.step_time_s <= cap * (1 + 1e-9)
        assert 1 <= steps <= 10
    assert max(free.plan.local_steps) == 60 and max(capped.plan.local_steps) == 10
    stats = capped.stats()
    assert stats["round_capped"] == 1 and stats["round_cap_s"] == pytest.approx(cap)
    assert free.stats()["round_capped"] == 0 and free.stats()["round_cap_s"] == 0.0
    # the SHL plan and the fastest-steps plans are capped alike
    fast = make_strategy("ashl", ahl_fastest_steps=200)
    fast.setup(c)
    assert fast.plan.capped and fast.plan.round_time_s == pytest.approx(cap, rel=1e-12)


def test_a_link_slower_than_the_cap_runs_one_step_and_a_loose_cap_changes_nothing():
    short = dataclasses.replace(ctx("geo-16"), train_samples=2000)  # cap ~0.052 s
    s = make_strategy("ashl")
    s.setup(short)
    cap = epoch_at_full_speed_s(short) / 4
    workers = Profile.from_context(short).workers
    slow_links = [i for i, w in enumerate(workers) if w.comm_time_s >= cap]
    assert slow_links == list(range(8, 16))  # europe's and asia's 40 / 60 ms links
    for i, w in enumerate(workers):
        if i in slow_links:
            assert s.plan.targets[i] == 1.0 and s.plan.local_steps[i] == 1
        elif w.comm_time_s + w.step_time_s <= cap:  # one step fits: fill the cap
            assert w.comm_time_s + s.plan.targets[i] * w.step_time_s == pytest.approx(cap)
        else:  # a slow device on a fast link: one step too
            assert s.plan.targets[i] == 1.0
    assert s.plan.local_steps == (1,) * 16
    # a cap above the planned round: the very same plan, float for float
    long = dataclasses.replace(ctx("geo-16"), train_samples=100_000)
    loose, free = make_strategy("ashl"), make_strategy("ashl", min_commits_per_epoch=0)
    loose.setup(long)
    free.setup(long)
    assert loose.plan == free.plan and not loose.plan.capped
    p = Profile.from_context(long)
    for plan in (plan_for_comm_fraction, plan_for_fastest):
        arg = 0.1 if plan is plan_for_comm_fraction else 40
        assert plan(p, arg, max_round_time_s=1e9) == plan(p, arg)
        tight = plan(p, arg, max_round_time_s=0.5)
        assert tight.capped and tight.round_time_s == 0.5 > plan(p, arg).round_time_s / 3


def geo16_run(name: str, workload, **options):
    cfg = config_from_dict({"name": f"t-geo-{name}", "cluster": "geo-16",
                            "workload": {"model": "cnn", "dataset": "mnist1d"},
                            "strategy": {"name": name, **options},
                            "train": {"batch_size": 32, "eval_every_epochs": 1.0, "seed": 7},
                            "stop": {"max_epochs": 1.0}})
    return run_config(cfg, runs_root=None, workload=workload).summary


def commits_per_epoch(summary) -> list[float]:
    return [w["pushes"] / summary["epochs"] for w in summary["workers"]]


def test_every_worker_commits_four_times_per_epoch_on_geo16(mnist1d_cnn):
    """The issue's case: ashl on geo-16 with the MNIST-1D CNN. Uncapped, the AHL plan runs
    8-63 local steps per commit and the workers commit 1-2 times in the epoch; capped, every
    worker commits at least 4 times."""
    free = geo16_run("ashl", mnist1d_cnn, min_commits_per_epoch=0)
    assert min(commits_per_epoch(free)) < 2
    s = geo16_run("ashl", mnist1d_cnn)
    assert s["epochs"] >= 1.0
    assert min(commits_per_epoch(s)) >= 4, [w["pushes"] for w in s["workers"]]
    assert s["strategy_stats"]["capped_plans"] > 0
    assert s["unsent_samples"] == sum(w["unsent_samples"] for w in s["workers"]) > 0
