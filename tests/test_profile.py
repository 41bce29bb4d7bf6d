"""ASHL stage 0: the Profile type (priced from the Cluster, saved and loaded) and the plans."""

from __future__ import annotations

import pytest

from hetrain.cluster import preset
from hetrain.config import config_from_dict
from hetrain.engine.setup import prepare
from hetrain.errors import ConfigError
from hetrain.profile import (
    FractionalSteps,
    OnlineCosts,
    Profile,
    WorkerProfile,
    plan_for_comm_fraction,
    plan_for_fastest,
    plan_local_steps,
    worker_profiles,
)
from hetrain.strategies import RunContext


def _ctx(cluster: str = "hetero-8") -> RunContext:
    return RunContext(cluster=preset(cluster), flops_per_sample=1e6, model_bytes=50_000,
                      sample_bytes=160, train_samples=10_000, batch_size=32, lr=0.05)


def test_from_cluster_prices_what_the_cluster_model_says():
    ctx = _ctx()
    p = Profile.from_context(ctx, push_ratio=0.5)
    assert p.n == 8 and p.source == "sim" and p.push_bytes == 25_000
    for i, w in enumerate(p.workers):
        d, link = ctx.cluster.devices[i], ctx.cluster.ps_link(i)
        assert w.step_time_s == pytest.approx(d.compute_time_s(32, 1e6, 1))
        assert w.pull_time_s == pytest.approx(link.transfer_time_s(50_000))
        assert w.push_time_s == pytest.approx(link.transfer_time_s(25_000))
    assert p.speeds()[0] == 1.0 and p.speeds()[-1] == pytest.approx(7.34, rel=0.01)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_save_and_load_round_trip(tmp_path, suffix):
    p = Profile.from_context(_ctx("geo-16"))
    path = tmp_path / f"profile{suffix}"
    p.save(path)
    assert Profile.load(path) == p


def test_bad_profiles_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        Profile.load(tmp_path / "none.json")
    with pytest.raises(ConfigError, match="exactly the keys"):
        Profile.from_dict({"workers": [{"name": "a", "batch_size": 1}]})
    with pytest.raises(ConfigError, match="step_time_s"):
        WorkerProfile("a", 32, 0.0, 0.1, 0.1)
    with pytest.raises(ConfigError, match="same length"):
        worker_profiles(["a", "b"], 32, [0.1], [0.1, 0.1], [0.1, 0.1])


def test_plan_equalises_round_times():
    p = Profile.from_context(_ctx())
    plan = plan_local_steps(p, min_steps=4)
    slowest = max(range(p.n), key=lambda i: p.workers[i].round_time_s(4))
    assert plan.local_steps[slowest] == 4
    for w, h, r in zip(p.workers, plan.local_steps, plan.round_times_s, strict=True):
        assert r == pytest.approx(w.round_time_s(h))
        assert abs(r - plan.round_time_s) <= w.step_time_s / 2 + 1e-12  # rounding only
    assert plan.imbalance < 1.1
    assert max(plan.local_steps) >= 7 * min(plan.local_steps)  # 1:8 speeds -> ~1:8 steps


def test_plan_for_fastest_and_for_comm_fraction():
    p = Profile.from_context(_ctx("geo-16"))
    fast = plan_for_fastest(p, 40)
    assert max(fast.local_steps) == 40
    for f in (0.05, 0.3):
        plan = plan_for_comm_fraction(p, f)
        assert all(w.comm_time_s / plan.round_time_s <= f + 1e-12 for w in p.workers)
    slow_links = plan_for_comm_fraction(p, 0.05)
    assert slow_links.round_time_s > plan_for_comm_fraction(p, 0.3).round_time_s
    # on one fast LAN the budget never binds: rounds are the slowest worker's one step
    lan = Profile.from_context(_ctx("hetero-4"))
    assert min(plan_for_comm_fraction(lan, 0.1).local_steps) == 1


def test_fractional_steps_keep_the_long_run_rate():
    r = FractionalSteps(2)
    a = [r.take(0, 1.5) for _ in range(100)]
    b = [r.take(1, 0.4) for _ in range(10)]
    assert sum(a) == 150 and set(a) == {1, 2}
    assert b == [1] * 10  # at least one step


def test_online_costs_follow_measurements():
    p = Profile.from_context(_ctx())
    costs = OnlineCosts(p, weight=0.5)
    w0 = p.workers[0]
    costs.observe(0, compute_s=4 * 2 * w0.step_time_s, steps=4, comm_s=3 * w0.comm_time_s)
    assert costs.step_s[0] == pytest.approx(1.5 * w0.step_time_s)
    assert costs.comm_s[0] == pytest.approx(2 * w0.comm_time_s)
    q = costs.profile()
    assert q.workers[0].comm_time_s == pytest.approx(2 * w0.comm_time_s)
    assert q.workers[1] == p.workers[1]


def test_the_simulator_charges_what_the_profile_predicts():
    """Stage 0 on the simulator is exact: measured step times equal the priced ones."""
    cfg = config_from_dict({"name": "p", "cluster": "hetero-4",
                            "workload": {"model": "mlp", "dataset": "digits"},
                            "strategy": {"name": "ashl"}, "stop": {"max_epochs": 0.5}})
    prep = prepare(cfg)
    from hetrain.engine.sim import simulate

    simulate(prep)
    strategy = prep.strategy
    for priced, measured in zip(strategy.profile.step_times_s(), strategy.costs.step_s,
                                strict=True):
        assert measured == pytest.approx(priced, rel=1e-9)
