"""The speed-proportional pipeline split: the exact min-max split (checked against brute force)
gives a slower device fewer layers."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.cluster import GBIT, Cluster, Device, Link, Site
from hetrain.errors import ConfigError
from hetrain.plan.cost import plan_cost, stage_graphs
from hetrain.plan.graph import gpt_graph
from hetrain.plan.split import min_max_split, op_compute_s, speed_split


def cluster_of(speeds: tuple[float, ...]) -> Cluster:
    site = Site("dc", Link(10 * GBIT, 1e-5), Link(10 * GBIT, 1e-5))
    return Cluster("mixed", tuple(Device(f"d{i}", f, site="dc") for i, f in enumerate(speeds)),
                   (site,))


def _brute_force(costs: list[list[float]], starts: set[int]) -> float | None:
    k, n = len(costs), len(costs[0])
    best = None
    for cut in itertools.combinations(sorted(starts & set(range(1, n))), k - 1):
        b = [0, *cut, n]
        t = max(sum(costs[s][b[s]:b[s + 1]]) for s in range(k))
        best = t if best is None else min(best, t)
    return best


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4).flatmap(lambda k: st.tuples(
    st.lists(st.lists(st.floats(0.0, 10.0), min_size=7, max_size=7), min_size=k, max_size=k),
    st.integers(k, 7), st.sets(st.integers(1, 6)))))
def test_min_max_split_is_the_brute_force_optimum(case) -> None:  # type: ignore[no-untyped-def]
    rows, n, starts = case
    costs = [r[:n] for r in rows]
    want = _brute_force(costs, starts)
    if want is None:
        with pytest.raises(ConfigError, match="cannot split"):
            min_max_split(costs, starts)
        return
    bounds, got = min_max_split(costs, starts)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == len(costs) + 1
    assert all(a < b for a, b in itertools.pairwise(bounds)) and set(bounds[1:-1]) <= starts
    assert max(sum(costs[s][bounds[s]:bounds[s + 1]]) for s in range(len(costs))) == pytest.approx(got)


def test_speed_split_gives_slower_devices_fewer_layers() -> None:
    g = gpt_graph(8, 64, 4, 64, 32, 8)
    cl = cluster_of((1e9, 3e9))
    plan = speed_split(g, cl, (0, 1))
    flops = [sum(g.ops[i].flops for i in range(a, b)) for a, b in stage_graphs(g, plan)]
    assert flops[1] > 2 * flops[0]  # the 3x faster device gets roughly 3x the work
    times = [sum(op_compute_s(g, cl, d)[a:b]) for d, (a, b) in zip((0, 1), stage_graphs(g, plan),
                                                                   strict=True)]
    assert max(times) < 1.15 * min(times)
    even = speed_split(g, cl, (0, 0))  # equal speeds: an even split is no worse
    assert plan_cost(g, plan, cl).time_s < plan_cost(g, even, cl).time_s * 0.8
