"""C-ADP allocator: optimality against scipy's HiGHS LP and brute force, caps, rounding, errors.

What is compared. With fixed costs charged only to devices that take part, problem P is not an
LP. Its continuous optimum T* is checked two ways: (1) the LP over the active set found (all of
those devices pay their fixed cost) has optimum exactly T*; (2) for small n, the minimum of that
LP over every non-empty subset of devices is T*. The integer shares are checked against an
independent certificate of integer optimality (no allocation finishes strictly earlier: fewer
than S unit-slots end before the makespan), against exhaustive enumeration for tiny cases, and
against the bound T* <= makespan < T* + max_j b_j * granularity.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from hetrain.cluster import GBIT, preset
from hetrain.errors import ConfigError
from hetrain.plan.allocate import (
    RoundWork,
    allocate,
    choose_local_steps,
    plan_round,
    round_costs,
    speed_weighted_local_steps,
)


def lp_makespan(a, b, caps, total, subset) -> float:
    """HiGHS: min T s.t. a_j + b_j x_j <= T (j in subset), sum x_j = total, 0 <= x_j <= cap_j."""
    m = len(subset)
    c = np.zeros(m + 1)
    c[-1] = 1.0
    a_ub = np.zeros((m, m + 1))
    for k, j in enumerate(subset):
        a_ub[k, k], a_ub[k, -1] = b[j], -1.0
    b_ub = -np.asarray([a[j] for j in subset])
    a_eq = np.concatenate([np.ones(m), [0.0]])[None, :]
    bounds = [(0, None if math.isinf(caps[j]) else caps[j]) for j in subset] + [(None, None)]
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=[total], bounds=bounds, method="highs")
    return res.fun if res.status == 0 else math.inf


def unit_caps(cap, g):
    return np.array([c if math.isinf(c) else c // g for c in cap], dtype=float)


def slots_before(a, b, caps, t) -> int:
    """Units that can finish strictly before t: sum_j min(cap_j, #{k >= 1: a_j + b_j k < t})."""
    n = 0
    for aj, bj, cj in zip(a, b, caps, strict=True):
        if math.isfinite(bj) and t > aj + bj:
            n += min(cj, math.ceil((t - aj) / bj) - 1)
    return n


@st.composite
def instances(draw, max_n: int = 1000):
    n = draw(st.integers(1, max_n))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    g = draw(st.sampled_from([1, 1, 4, 32]))
    fixed_scale = draw(st.sampled_from([0.0, 0.01, 1.0, 100.0]))
    a = rng.uniform(0, 1, n) * fixed_scale
    b = 10 ** rng.uniform(-4, 0, n)
    units = draw(st.integers(0, 50 * n))
    caps = None
    if draw(st.booleans()):
        caps = rng.integers(0, 3 * max(1, units // n) + 2, n) * g
        units = min(units, int(caps.sum()) // g)
    return a, b, caps, units * g, g


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_random_instances_match_lp_and_are_integer_optimal(inst) -> None:
    a, b, caps, total, g = inst
    r = allocate(a, b, total, caps, granularity=g)
    cap = np.full(len(a), np.inf) if caps is None else caps
    x = np.array(r.shares)
    assert x.sum() == total and (x % g == 0).all() and (x >= 0).all() and (x <= cap).all()
    t_star = r.continuous_makespan_s
    if total == 0:
        assert r.makespan_s == 0 and not r.active
        return
    # the continuous optimum equals the HiGHS LP over the active set it found
    active = [j for j, v in enumerate(r.continuous_shares) if v > 1e-12]
    assert lp_makespan(a, b * g, unit_caps(cap, g), total // g, active) == pytest.approx(t_star, rel=1e-7)
    # the rounding bound: at most one unit of the slowest device over T*
    tol = 1e-9 * max(1.0, t_star)
    assert t_star - tol <= r.makespan_s < t_star + (b * g).max() + tol
    # integer optimality: no allocation finishes strictly before the makespan
    assert r.makespan_s == pytest.approx(max(r.times_s()))
    below = r.makespan_s - 1e-9 * max(1.0, r.makespan_s)
    assert slots_before(a, b * g, unit_caps(cap, g), below) < total // g


@settings(max_examples=40, deadline=None)
@given(instances(max_n=6))
def test_continuous_optimum_is_the_best_lp_over_all_subsets(inst) -> None:
    a, b, caps, total, g = inst
    if total == 0:
        return
    cap = np.full(len(a), np.inf) if caps is None else caps
    r = allocate(a, b, total, caps, granularity=g)
    best = min(lp_makespan(a, b * g, unit_caps(cap, g), total // g, list(s))
               for k in range(1, len(a) + 1) for s in itertools.combinations(range(len(a)), k))
    assert best == pytest.approx(r.continuous_makespan_s, rel=1e-7)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(0, 8), st.integers(0, 2**32 - 1), st.booleans())
def test_integer_shares_match_exhaustive_search(n, units, seed, capped) -> None:
    rng = np.random.default_rng(seed)
    a, b = rng.uniform(0, 2, n).round(2), rng.uniform(0.1, 1, n).round(2)
    caps = rng.integers(0, 4, n) if capped else np.full(n, units)
    units = min(units, int(caps.sum()))
    best = math.inf
    for x in itertools.product(*(range(int(c) + 1) for c in caps)):
        if sum(x) == units:
            best = min(best, max([a[j] + b[j] * x[j] for j in range(n) if x[j] > 0], default=0.0))
    r = allocate(a, b, units, caps)
    assert r.makespan_s == pytest.approx(best)


def test_hand_examples() -> None:
    # no fixed costs: shares proportional to speed, all finish together
    r = allocate([0, 0, 0], [1, 2, 4], 70)
    assert r.shares == (40, 20, 10) and r.makespan_s == 40
    # a device whose fixed cost alone exceeds the round gets nothing
    r = allocate([0, 0, 10], [1, 1, 1], 10)
    assert r.shares == (5, 5, 0) and r.active == (0, 1) and r.makespan_s == 5
    # a cap spills the rest onto the others
    r = allocate([0, 0], [1, 1], 10, caps=[3, 100])
    assert r.shares == (3, 7) and r.makespan_s == 7
    # rounding to whole batches of 8: the leftover batch goes to the fastest device
    r = allocate([0, 0], [1.0, 0.25], 48, granularity=8)
    assert r.shares == (8, 40) and r.continuous_shares == pytest.approx((9.6, 38.4))
    # a device that cannot take samples (inf per-sample cost) is left out
    assert allocate([0, 0], [math.inf, 1], 5).shares == (0, 5)


def test_degenerate_inputs() -> None:
    assert allocate([1.0], [0.5], 0).shares == (0,) and allocate([1.0], [0.5], 0).makespan_s == 0
    assert allocate([1.0], [0.5], 4).shares == (4,)
    with pytest.raises(ConfigError, match="caps hold"):
        allocate([0, 0], [1, 1], 10, caps=[3, 3])
    with pytest.raises(ConfigError, match="no device can take samples"):
        allocate([0, 0], [math.inf, math.inf], 1)
    with pytest.raises(ConfigError, match="no device can take samples"):
        allocate([0, 0], [1, 1], 1, caps=[0, 0])
    with pytest.raises(ConfigError, match=">= 0"):
        allocate([0], [1], -1)
    with pytest.raises(ConfigError, match="multiple of the granularity"):
        allocate([0], [1], 10, granularity=4)
    with pytest.raises(ConfigError, match="per-sample costs must be > 0"):
        allocate([0, 0], [0, 1], 3)
    with pytest.raises(ConfigError, match="expected one per device"):
        allocate([0, 0], [1], 3)
    with pytest.raises(ConfigError, match="NaN"):
        allocate([math.nan], [1], 3)
    with pytest.raises(ConfigError, match="at least one device"):
        allocate([], [], 0)


def test_cluster_cost_model_by_hand() -> None:
    cl = preset("hetero-8")
    work = RoundWork(samples=1000, flops_per_sample=1e6, model_bytes=50_000, sample_bytes=100,
                     steps=4)
    fixed, per_sample, caps = round_costs(cl, work)
    # dev1 is in site-b, the PS in site-a: both WAN uplinks (0.1 Gbit/s, 5 ms each way each)
    wan = 0.1 * GBIT
    assert fixed[1] == pytest.approx(2 * (10e-3 + 50_000 / wan) + 4 * 2e-3)
    assert per_sample[1] == pytest.approx(1e6 / 2e8 + 100 / wan)
    assert per_sample[7] < per_sample[0] and caps == [math.inf] * 8
    r = plan_round(cl, work)
    assert r.total == 1000 and r.shares[6] > r.shares[4] > r.shares[2] > r.shares[0]
    assert r.shares[6] > r.shares[7]  # equal speed, but dev7 pays the WAN to the PS
    mem = RoundWork(samples=100, flops_per_sample=1e6, model_bytes=0, memory_fixed_bytes=15e9,
                    memory_per_sample_bytes=1e8)
    assert round_costs(cl, mem)[2] == [10.0] * 8
    with pytest.raises(ConfigError, match="caps hold"):
        plan_round(cl, RoundWork(samples=81, flops_per_sample=1e6, model_bytes=0,
                                 memory_fixed_bytes=15e9, memory_per_sample_bytes=1e8))


def test_choose_local_steps() -> None:
    # comm 0.1 s against 0.05 s steps at 5%: H >= 0.1 / (0.05 * 0.05) = 40
    assert choose_local_steps(0.1, 0.05, 0.05, 1, 64) == 40
    assert choose_local_steps(0.1, 0.05, 0.05, 1, 32) == 32
    assert choose_local_steps(0.0, 0.05, 0.05, 3, 32) == 3
    with pytest.raises(ConfigError, match="comm_fraction"):
        choose_local_steps(0.1, 0.05, 1.5)
    with pytest.raises(ConfigError, match="min_steps"):
        choose_local_steps(0.1, 0.05, 0.1, 5, 2)


def test_speed_weighted_local_steps_weighs_links_by_speed() -> None:
    # speeds 1000 and 10000 samples/s, comm 1 s and 0.1 s: the fast device's link counts ten
    # times as much, comm_w = (1000 * 1 + 10000 * 0.1) / 11000 = 2 / 11 s (the plain mean, 0.55
    # s, would give 550); H >= (2 / 11) / (0.1 * 0.01) = 181.8
    assert speed_weighted_local_steps([1.0, 0.1], [1e-3, 1e-4], 0.01, 0.1, 1, 1000) == 182
    assert speed_weighted_local_steps([1.0, 0.1], [1e-3, 1e-4], 0.01, 0.1, 1, 64) == 64
