"""ADSP: equal commit counts across 1:8 speeds, the commit-rate search rule (convergence:
tests/test_converges.py)."""

from __future__ import annotations

import math

import pytest

from helpers import run_context, run_digits
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


def test_commit_counts_stay_balanced_across_1_to_8_speeds():
    r = run_digits("adsp", epochs=8.0, cluster_obj=one_to_eight())
    pushes = [w["pushes"] for w in r.summary["workers"]]
    samples = [w["samples"] for w in r.summary["workers"]]
    assert min(pushes) >= 15
    assert max(pushes) - min(pushes) <= 1  # every worker commits equally often...
    assert samples[2] > 6 * samples[0]  # ...the fast ones running ~8x the mini-batches
    assert max(w["idle_s"] for w in r.summary["workers"]) < 1e-9  # and nobody waits
    assert r.summary["strategy_stats"]["commit_balance"] >= 0.95


def ctx(train_samples: int = 100_000) -> RunContext:
    """An epoch of ~33 s: the 1 s check periods below are far inside the commit cap."""
    return run_context(one_to_eight(), train_samples=train_samples)


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
    for bad in (-0.5, math.inf, False):
        with pytest.raises(ConfigError, match="min_commits_per_epoch"):
            make_strategy("adsp", min_commits_per_epoch=bad)


def test_commit_rate_search_never_goes_below_the_commit_cap():
    """A 2000-sample epoch at these speeds takes 2000 / 3600 samples/s = 0.556 s: 4 commits per
    epoch need one every 0.139 s, i.e. at least 8 per 1 s period. Rewards that walk the
    uncapped search down to 1 commit per period stop it at 8."""
    histories = {}
    for m in (0, 4):
        s = make_strategy("adsp", check_period_s=1.0, commits_init=8, momentum=0.5,
                          min_commits_per_epoch=m)
        s.setup(ctx(train_samples=2000))
        for k, loss in enumerate([5.0, 4.0, 3.9, 3.7, 3.4, 3.0, 2.5, 2.4]):
            feed_period(s, float(k), loss)
        histories[m] = s.history
    assert histories[0] == [8, 8, 9, 8, 7, 5, 3, 1]
    assert histories[4] == [8, 8, 9, 8, 8, 8, 8, 8]
    assert s.round_cap_s == pytest.approx(2000 / 3600 / 4) and s.c_min == 8
    assert s.stats()["floored_periods"] == 4
    for w in range(4):
        round_s = s.costs.comm_s[w] + s.local_target(w) * s.costs.step_s[w]
        assert round_s <= s.round_cap_s


def test_a_slow_link_caps_its_workers_local_steps():
    """geo-16, the paper's speed-proportional plan (commit time not subtracted): the search's
    floor keeps G / C under the cap, and each worker's own round c_i + tau_i s_i is cut to it
    as well (one step where even that does not fit)."""
    c = RunContext(cluster=preset("geo-16"), flops_per_sample=1e6, model_bytes=50_000,
                   sample_bytes=160, train_samples=10_000, batch_size=32, lr=0.05)
    free = make_strategy("adsp", min_commits_per_epoch=0)
    free.setup(c)
    s = make_strategy("adsp")
    s.setup(c)
    cap = s.round_cap_s
    assert s.period_s / free.commits > cap  # uncapped: fewer than 4 commits per epoch
    assert s.commits == s.c_min == math.ceil(s.period_s / cap) and s.period_s / s.commits <= cap
    clipped = 0
    for w in range(16):
        comm, step = s.costs.comm_s[w], s.costs.step_s[w]
        tau = s.local_target(w)
        assert tau == max(1.0, min(s.period_s / s.commits, cap - comm) / step)
        assert comm + tau * step <= cap or tau == 1.0
        clipped += tau < s.period_s / s.commits / step
        s.next_task(w)
    assert clipped == s.stats()["capped_tasks"] >= 4


def test_every_worker_commits_four_times_per_epoch_on_geo16(mnist1d_cnn):
    """ADSP on geo-16 with the MNIST-1D CNN: uncapped, the workers on the far sites commit 3
    times in the epoch; capped, everyone commits at least 4 times."""
    def run(**options):
        cfg = config_from_dict({"name": "t-geo-adsp", "cluster": "geo-16",
                                "workload": {"model": "cnn", "dataset": "mnist1d"},
                                "strategy": {"name": "adsp", **options},
                                "train": {"batch_size": 32, "eval_every_epochs": 1.0, "seed": 7},
                                "stop": {"max_epochs": 1.0}})
        s = run_config(cfg, runs_root=None, workload=mnist1d_cnn).summary
        return s, [w["pushes"] / s["epochs"] for w in s["workers"]]

    _, free = run(min_commits_per_epoch=0)
    assert min(free) < 4
    s, capped = run()
    assert s["epochs"] >= 1.0 and min(capped) >= 4, [w["pushes"] for w in s["workers"]]
    assert s["strategy_stats"]["commits_min"] > 1
