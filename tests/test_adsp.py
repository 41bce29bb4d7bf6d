"""ADSP: equal commit counts across 1:8 speeds, the commit-rate search rule, convergence."""

from __future__ import annotations

import pytest

from hetrain.cluster import BASE_FLOPS, preset
from hetrain.config import config_from_dict
from hetrain.errors import ConfigError
from hetrain.runner import run_config
from hetrain.strategies import Push, RunContext, make_strategy


def one_to_eight():
    """Four devices of speeds 1, 1, 8, 8 on one LAN (no per-step overhead: exactly 1:8)."""
    c = preset("hetero-4")
    for i, speed in enumerate((1, 1, 8, 8)):
        c = c.with_device(i, flops=BASE_FLOPS * speed, step_overhead_s=0.0)
    return c


def run_digits(cluster=None, epochs: float = 4.0, **options):
    cfg = config_from_dict({"name": "t-adsp", "cluster": "hetero-4",
                            "workload": {"model": "mlp", "dataset": "digits"},
                            "strategy": {"name": "adsp", **options},
                            "train": {"batch_size": 16, "eval_every_epochs": 1.0},
                            "stop": {"max_epochs": epochs}})
    return run_config(cfg, runs_root=None, cluster=cluster)


def test_commit_counts_stay_balanced_across_1_to_8_speeds():
    r = run_digits(one_to_eight(), epochs=8.0)
    pushes = [w["pushes"] for w in r.summary["workers"]]
    samples = [w["samples"] for w in r.summary["workers"]]
    assert min(pushes) >= 15
    assert max(pushes) - min(pushes) <= 1  # every worker commits equally often...
    assert samples[2] > 6 * samples[0]  # ...the fast ones running ~8x the mini-batches
    assert max(w["idle_s"] for w in r.summary["workers"]) < 1e-9  # and nobody waits
    assert r.summary["strategy_stats"]["commit_balance"] >= 0.95


def ctx() -> RunContext:
    return RunContext(cluster=one_to_eight(), flops_per_sample=1e6, model_bytes=10_000,
                      sample_bytes=64, train_samples=1000, batch_size=16, lr=0.05)


def feed_period(s, start_s: float, loss: float) -> None:
    """One push per worker inside the check period starting at start_s."""
    for w in range(4):
        s.on_push(Push(worker=w, base_version=0, samples=16, steps=1, loss=loss,
                       compute_s=s.costs.step_s[w], comm_s=s.costs.comm_s[w],
                       arrival_s=start_s + 0.1 + 0.1 * w))


def test_commit_rate_search_follows_the_reward_with_momentum():
    """Rewards (loss decrease per period) 0.5, 0.6, 0.7, then 0.1: C climbs 4 -> 5 -> 7 ->
    9 (velocity 1, 1.5, 1.75: momentum 0.5), then turns round with velocity -1 -> 8."""
    s = make_strategy("adsp", check_period_s=1.0, commits_init=4, momentum=0.5)
    s.setup(ctx())
    assert s.c_max >= 9
    for k, loss in enumerate([3.0, 2.5, 1.9, 1.2, 1.1]):
        feed_period(s, float(k), loss)
    feed_period(s, 5.0, 1.0)  # its first push closes period 4
    assert s.history == [4, 4, 5, 7, 9, 8]


def test_local_steps_are_speed_proportional():
    s = make_strategy("adsp", check_period_s=1.0, commits_init=2)
    s.setup(ctx())
    slow, fast = s.local_target(0), s.local_target(2)
    assert fast / slow == pytest.approx(s.costs.step_s[0] / s.costs.step_s[2])
    aware = make_strategy("adsp", check_period_s=1.0, commits_init=2, comm_aware=True)
    aware.setup(ctx())
    assert aware.local_target(0) < slow  # the commit time comes out of the interval


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="momentum"):
        make_strategy("adsp", momentum=1.0)
    with pytest.raises(ConfigError, match="weighting"):
        make_strategy("adsp", weighting="equal")


def test_adsp_converges_on_digits():
    r = run_digits()
    assert r.rows[0]["test_accuracy"] < 0.3
    assert r.final_accuracy > 0.85
