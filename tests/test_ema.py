"""hetrain.plan.ema: the moving average every planner smooths measurements with, and the
per-worker cost tracker of cadp and ashl/adsp (OnlineCosts)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetrain.errors import ConfigError
from hetrain.plan.ema import EMA, WorkerCosts
from hetrain.plan.local_steps import OnlineCosts
from hetrain.plan.noise import GradientNoiseScale, GradProbe
from hetrain.profile import Profile, worker_profiles


def test_ema_moves_by_the_newest_measurements_weight() -> None:
    ema = EMA(0.25, value=4.0)
    assert ema.value == 4.0 and ema.count == 0
    assert ema.update(8.0) == 5.0            # 0.75 * 4 + 0.25 * 8
    assert ema.update(0.0) == 3.75           # 0.75 * 5
    assert ema.update(2.0, weight=1.0) == 2.0  # weight 1 keeps only the newest
    assert ema.count == 3


def test_ema_keeps_the_exact_order_of_operations() -> None:
    """(1 - w) * v + w * x, float for float: the averages it replaced computed it so, and
    the fixed-seed figures depend on it (v + w * (x - v) differs in the last bits)."""
    w, v = 0.3, 0.1
    ema = EMA(w, value=v)
    for x in (0.7, 1e-3, 123.456, 0.2):
        v = (1 - w) * v + w * x
        assert ema.update(x) == v
    assert any((1 - w) * a + w * b != a + w * (b - a)
               for a, b in ((0.1, 0.7), (0.7, 1e-3), (1e-3, 123.456)))


def test_bias_correction_removes_the_zero_start() -> None:
    w = 0.1
    plain, corrected = EMA(w), EMA(w, bias_corrected=True)
    for _ in range(3):
        plain.update(5.0)
        corrected.update(5.0)
    assert plain.value == pytest.approx(5.0 * (1 - 0.9 ** 3))   # biased towards the 0 start
    assert corrected.value == pytest.approx(5.0)
    two = EMA(w, bias_corrected=True)
    two.update(1.0)
    two.update(3.0)
    # (w (1 - w) * 1 + w * 3) / (1 - (1 - w)^2), by hand
    assert two.value == pytest.approx((0.09 * 1.0 + 0.1 * 3.0) / (1 - 0.81))
    assert two.decay == pytest.approx(0.81)


def test_bias_corrected_ema_has_no_value_before_a_measurement() -> None:
    with pytest.raises(ValueError, match="first update"):
        _ = EMA(0.5, bias_corrected=True).value
    with pytest.raises(ValueError, match="starts from 0"):
        EMA(0.5, value=1.0, bias_corrected=True)


@pytest.mark.parametrize("weight", [0.0, -0.1, 1.5, math.nan])
def test_bad_weights_are_config_errors(weight: float) -> None:
    with pytest.raises(ConfigError, match=r"my weight must be in \(0, 1\]"):
        EMA(weight, what="my weight")
    with pytest.raises(ConfigError, match="EMA update weight"):
        EMA(0.5).update(1.0, weight=weight)
    with pytest.raises(ConfigError, match="cost EMA weight"):
        WorkerCosts([1.0], [1.0], weight)


def test_worker_costs_track_each_worker_apart() -> None:
    costs = WorkerCosts(np.array([1.0, 2.0]), [0.5, 0.25], weight=0.5)
    assert costs.compute_s == [1.0, 2.0] and type(costs.compute_s[0]) is float
    costs.update(1, compute_s=12.0, comm_s=0.75, units=4)   # 12 s over 4 units: 3 s each
    assert costs.compute_s == [1.0, 0.5 * 2.0 + 0.5 * 12.0 / 4]
    assert costs.comm_s == [0.5, 0.5]
    costs.update(0, comm_s=1.5)                              # no compute measured
    assert costs.compute_s[0] == 1.0 and costs.comm_s[0] == 1.0
    with pytest.raises(ConfigError, match="one of each per worker"):
        WorkerCosts([1.0, 2.0], [1.0], 0.5)


def test_online_costs_are_worker_costs_of_steps_and_commits() -> None:
    profile = Profile(worker_profiles(["a", "b"], 8, [0.1, 0.2], [0.01, 0.02], [0.01, 0.02]),
                      1000, 1000, "measured")
    costs = OnlineCosts(profile, weight=0.5)
    assert isinstance(costs, WorkerCosts) and costs.step_s is costs.compute_s
    before = list(costs.compute_s), list(costs.comm_s)
    costs.observe(0, compute_s=0.0, steps=3, comm_s=-1.0)    # measured nothing
    costs.observe(1, compute_s=0.5, steps=0, comm_s=-1.0)
    assert (costs.compute_s, costs.comm_s) == before
    costs.observe(1, compute_s=0.9, steps=3, comm_s=0.1)
    assert costs.step_s[1] == 0.5 * 0.2 + 0.5 * 0.9 / 3
    assert costs.comm_s[1] == 0.5 * profile.workers[1].comm_time_s + 0.5 * 0.1
    with pytest.raises(ConfigError, match="online costs: EMA weight"):
        OnlineCosts(profile, weight=0.0)


def test_noise_scale_averages_match_the_hand_written_correction() -> None:
    """GradientNoiseScale on `EMA`s gives, bit for bit, the raw averages over one shared
    prod(1 - w) it kept before."""
    probes = [GradProbe(4.0 + i, 16, 1.5 + 0.1 * i, 32) for i in range(5)]
    est = GradientNoiseScale(0.2)
    g = t = 0.0
    decay = 1.0
    for i, p in enumerate(probes):
        w = 0.2 if i % 2 else 0.5
        est.observe(p, weight=w)
        gp, tp = p.estimates()
        g, t, decay = (1 - w) * g + w * gp, (1 - w) * t + w * tp, decay * (1 - w)
        assert est.grad_sqnorm == g / (1 - decay) and est.trace_cov == t / (1 - decay)
    assert est.probes == 5
    with pytest.raises(ConfigError, match="noise-scale probe weight"):
        est.observe(probes[0], weight=2.0)
    with pytest.raises(ConfigError, match="noise-scale ema_weight"):
        GradientNoiseScale(0.0)
