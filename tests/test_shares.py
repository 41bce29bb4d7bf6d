"""Uneven data-parallel shares: priced like the even split when even, balanced against a
brute-force enumeration, within each row's memory, and chosen by the search when they pay."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.cluster import GBIT, Cluster, Device, Link, Site
from hetrain.errors import ConfigError
from hetrain.plan.cost import CostOptions, Plan, StagePlan, buckets, plan_cost
from hetrain.plan.graph import gpt_graph, vgg_graph
from hetrain.plan.sbp import Mesh
from hetrain.plan.search import SearchOptions, search_plan, template_plan, uneven_plan
from hetrain.plan.shares import balanced_shares, rows_differ, with_shares

GPT = gpt_graph(2, 32, 4, 32, 16, 8)


def _cluster(flops: list[float], memory: list[float] | None = None, gbit: float = 10.0,
             latency_s: float = 1e-4, overhead_s: list[float] | None = None) -> Cluster:
    site = Site("dc", Link(gbit * GBIT, latency_s), Link(gbit * GBIT, latency_s))
    mem = memory or [16e9] * len(flops)
    over = overhead_s or [0.0] * len(flops)
    return Cluster("c", tuple(Device(f"d{i}", f, memory_bytes=m, site="dc", step_overhead_s=o)
                              for i, (f, m, o) in enumerate(zip(flops, mem, over, strict=True))),
                   (site,))


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    return [tuple(b - a for a, b in itertools.pairwise((0, *cut, total)))
            for cut in itertools.combinations(range(1, total), parts - 1)]


def test_even_shares_cost_what_the_even_split_costs_but_sync_in_buckets() -> None:
    """Compute as the even split's; the gradient sum is one bucketed all-reduce (DDP-style),
    not one per tensor (DTensor's), so it pays the per-call cost once."""
    c = _cluster([1e10, 1e10, 2e10, 4e10])
    dp = template_plan(GPT, Mesh((4,), (0, 1, 2, 3)), "dp")
    options = CostOptions(collective_call_s=1e-3)
    even, shared = (plan_cost(GPT, p, c, options) for p in (dp, with_shares(dp, (2, 2, 2, 2))))
    assert shared.time_s - shared.sync_s == pytest.approx(even.time_s - even.sync_s, rel=1e-12)
    tensors = sum(1 + (op.param_bytes > op.dtype_bytes * math.prod(op.weight_shape))
                  for op in GPT.ops if op.weight_shape)
    assert even.sync_s >= tensors * 1e-3 > 2e-3 >= shared.sync_s - 1e-3


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from([5e9, 1e10, 2e10, 4e10]), min_size=2, max_size=3),
       st.lists(st.sampled_from([3e6, 8e6, 16e9]), min_size=3, max_size=3),
       st.lists(st.sampled_from([0.0, 2e-4, 1e-3]), min_size=3, max_size=3))
def test_balanced_shares_are_the_fastest_that_fit(flops: list[float], memory: list[float],
                                                  overhead: list[float]) -> None:
    """Against every split of the batch into positive shares, priced by the cost model."""
    n = len(flops)
    c = _cluster(flops, memory[:n], overhead_s=overhead[:n])
    mesh = Mesh((len(flops),), tuple(range(len(flops))))
    dp = Plan(GPT.name, (StagePlan(mesh, tuple(op.name for op in GPT.ops), ("dp",) * len(GPT.ops)),))
    priced = {s: plan_cost(GPT, with_shares(dp, s), c) for s in _compositions(GPT.batch, len(flops))}
    fitting = {s: r.time_s for s, r in priced.items() if r.feasible}
    got = balanced_shares(GPT, dp.stages[0], c)
    if got is None:
        assert not fitting
        return
    assert priced[got].feasible
    assert priced[got].time_s <= min(fitting.values()) * (1 + 1e-9)


def test_a_small_device_gets_a_smaller_share_than_its_speed_would_give() -> None:
    fast_roomy = _cluster([1e10, 1e10])
    stage = template_plan(GPT, Mesh((2,), (0, 1)), "dp").stages[0]
    assert balanced_shares(GPT, stage, fast_roomy) == (4, 4)
    mem = plan_cost(GPT, with_shares(Plan(GPT.name, (stage,)), (4, 4)), fast_roomy).memory_bytes
    tight = _cluster([1e10, 1e10], [mem * 0.99, 16e9])
    shares = balanced_shares(GPT, stage, tight)
    assert shares is not None and shares[0] < 4
    assert plan_cost(GPT, with_shares(Plan(GPT.name, (stage,)), shares), tight).feasible


def test_search_balances_shares_on_uneven_devices_when_compute_bound() -> None:
    g = gpt_graph(4, 128, 4, 256, 64, 32)
    r = search_plan(g, _cluster([1e10, 1e10, 2e10, 4e10]), SearchOptions(pipeline=False))
    assert r.plan.stages[0].shares == (4, 4, 8, 16)
    even = search_plan(g, _cluster([1e10, 1e10, 2e10, 4e10]),
                       SearchOptions(pipeline=False, uneven=False))
    assert r.report.time_s < 0.8 * even.report.time_s


def test_no_uneven_candidate_on_alike_devices_or_over_slow_links() -> None:
    alike = _cluster([1e10] * 4)
    assert not rows_differ(alike, Mesh((4,), (0, 1, 2, 3)))
    assert all("uneven" not in d for d, _, _ in search_plan(GPT, alike).candidates)
    slow = search_plan(GPT, _cluster([1e10, 1e10, 2e10, 4e10], gbit=0.01, latency_s=0.05))
    assert slow.plan.stages[0].mesh.devices == (3,)  # the links cost more than they add


def test_two_d_uneven_plan_runs_the_inner_plan_in_every_row() -> None:
    g = gpt_graph(4, 128, 4, 256, 64, 32)
    c = _cluster([1e10, 1e10, 4e10, 4e10])
    plan = uneven_plan(g, c, Mesh((2, 2), (0, 1, 2, 3)), SearchOptions(), None)
    assert plan is not None
    st_ = plan.stages[0]
    assert st_.shares[1] > st_.shares[0] and sum(st_.shares) == g.batch
    assert all(s.startswith("dp,") for s in st_.signatures)
    assert plan_cost(g, plan, c).feasible


def test_bad_shares_are_one_line_errors() -> None:
    dp = template_plan(GPT, Mesh((4,), (0, 1, 2, 3)), "dp")
    c = _cluster([1e10] * 4)
    with pytest.raises(ConfigError, match="sum to 7"):
        plan_cost(GPT, with_shares(dp, (4, 1, 1, 1)), c)
    tp = template_plan(GPT, Mesh((4,), (0, 1, 2, 3)), "tp")
    with pytest.raises(ConfigError, match="'dp'"):
        plan_cost(GPT, with_shares(tp, (2, 2, 2, 2)), c)
    with pytest.raises(ConfigError, match="one count >= 1"):
        Plan.from_dict(with_shares(dp, (8, 0, 0, 0)).to_dict())
    bad = Plan(GPT.name, (StagePlan(dp.stages[0].mesh, dp.stages[0].ops, dp.stages[0].signatures,
                                    (2, 2, 2, 2)),) * 2, 2)
    with pytest.raises(ConfigError, match="one-stage"):
        Plan.from_dict(bad.to_dict())


def test_vgg_shares_follow_speed() -> None:
    g = vgg_graph(32, (3, 32, 32))
    c = _cluster([1e10, 2e10, 4e10, 4e10])
    stage = template_plan(g, Mesh((4,), (0, 1, 2, 3)), "dp").stages[0]
    shares = balanced_shares(g, stage, c)
    assert shares is not None and shares[0] < shares[1] < shares[2] == shares[3]


def test_buckets_group_consecutive_tensors_up_to_the_cap() -> None:
    assert buckets([4, 4, 4], cap=8) == [[0, 1], [2]]
    assert buckets([4, 20, 4, 4], cap=8) == [[0], [1], [2, 3]]  # a large tensor alone
    assert buckets([], cap=8) == []
