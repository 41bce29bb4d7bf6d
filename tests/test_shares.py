"""Uneven data-parallel shares: priced like the even split when even, balanced against a
brute-force enumeration, within each row's memory, and chosen by the search when they pay."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.cluster import GBIT, Cluster, Device, Link, Site
from hetrain.errors import ConfigError
from hetrain.plan.cost import CostOptions, Plan, StagePlan, buckets, plan_cost
from hetrain.plan.graph import LayerGraph, gpt_graph, vgg_graph
from hetrain.plan.sbp import Mesh
from hetrain.plan.search import SearchOptions, search_plan, template_plan, uneven_plan
from hetrain.plan.shares import balanced_shares, column_shares, rows_differ, with_shares

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
    with pytest.raises(ConfigError, match="n_micro = 1"):
        Plan.from_dict(dataclasses.replace(with_shares(dp, (2, 2, 2, 2)), n_micro=2).to_dict())
    for shares, words in ((((6, 2), (2, 6)), "the same in every stage"),
                          (((5, 3), (5, 3)), "multiples of n_micro")):
        bad = dataclasses.replace(_columns((0, 1), (2, 3)), stages=tuple(
            dataclasses.replace(st, shares=sh)
            for st, sh in zip(_columns((0, 1), (2, 3)).stages, shares, strict=True)))
        with pytest.raises(ConfigError, match=words):
            Plan.from_dict(bad.to_dict())
    tp_stage = dataclasses.replace(with_columns(_columns((0, 1), (2, 3)), (4, 4)), stages=(
        with_columns(_columns((0, 1), (2, 3)), (4, 4)).stages[0],
        dataclasses.replace(template_plan(GPT.subgraph(13, len(GPT.ops)), Mesh((2,), (2, 3)),
                                          "tp").stages[0], shares=(4, 4))))
    with pytest.raises(ConfigError, match="data parallel"):
        Plan.from_dict(tp_stage.to_dict())


# ---- a pipeline's per-column shares ----------------------------------------------------------
def _columns(*stage_devices: tuple[int, ...], cut: int = 13, n_micro: int = 2,
             graph: LayerGraph = GPT) -> Plan:
    """A 2-stage data-parallel pipeline of `graph` cut at op `cut` (a piece boundary)."""
    bounds = ((0, cut), (cut, len(graph.ops)))
    return Plan(graph.name, tuple(
        StagePlan(Mesh((len(devs),), devs), tuple(op.name for op in graph.ops[a:b]),
                  ("dp",) * (b - a)) for devs, (a, b) in zip(stage_devices, bounds, strict=True)),
        n_micro)


def with_columns(plan: Plan, shares: tuple[int, ...]) -> Plan:
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, shares=shares)
                                                  for st in plan.stages))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from([5e9, 1e10, 4e10]), min_size=4, max_size=6),
       st.lists(st.sampled_from([2e6, 6e6, 16e9]), min_size=6, max_size=6),
       st.lists(st.sampled_from([0.0, 1e-3]), min_size=6, max_size=6),
       st.sampled_from([1, 2, 4]))
def test_column_shares_are_the_fastest_that_fit(flops: list[float], memory: list[float],
                                                overhead: list[float], n_micro: int) -> None:
    """Against every split of the batch into positive multiples of n_micro over the columns
    of a 2-stage pipeline of 2 or 3 devices per stage, priced by the cost model."""
    d = len(flops) // 2
    c = _cluster(flops[:2 * d], memory[:2 * d], overhead_s=overhead[:2 * d])
    plan = _columns(tuple(range(d)), tuple(range(d, 2 * d)), n_micro=n_micro)
    units = [tuple(u * n_micro for u in s) for s in _compositions(GPT.batch // n_micro, d)]
    priced = {s: plan_cost(GPT, with_columns(plan, s), c) for s in units}
    fitting = {s: r.time_s for s, r in priced.items() if r.feasible}
    got = column_shares(GPT, plan, c)
    if got is None:
        assert not fitting
        return
    assert priced[got].feasible
    assert priced[got].time_s <= min(fitting.values()) * (1 + 1e-9)


def test_a_column_pipeline_is_priced_as_its_slowest_column() -> None:
    """Column j runs its share on its own devices: the step is the slowest column's
    pipeline plus the stages' gradient sums; alike columns with even shares cost what one
    column does with its share, and a column of slower devices given the same share costs
    more."""
    alike = _cluster([1e10] * 4)
    plan = _columns((0, 1), (2, 3))
    even = plan_cost(GPT, with_columns(plan, (4, 4)), alike)
    half = gpt_graph(2, 32, 4, 32, 16, 4)
    alone = plan_cost(half, with_columns(_columns((0,), (2,), graph=half), (4,)), alike)
    assert even.time_s - even.sync_s == pytest.approx(alone.time_s, rel=1e-9)
    assert even.sync_s > 0 == alone.sync_s
    slow = _cluster([1e10, 2.5e9, 1e10, 2.5e9])
    assert plan_cost(GPT, with_columns(plan, (4, 4)), slow).time_s > 2 * even.time_s - even.sync_s
    assert plan_cost(GPT, with_columns(plan, (6, 2)), slow).time_s < \
        plan_cost(GPT, with_columns(plan, (4, 4)), slow).time_s


def test_search_pairs_alike_devices_into_columns_and_shares_the_batch_by_speed() -> None:
    """Speeds 4:1:4:1 and memory for half the model each: no one-stage plan fits, a 2-layer
    GPT gives the stage split few places to cut, and the searched plan is a 2-stage pipeline
    whose fast column (devices 0 and 2) takes most of the batch; predicted faster than every
    plan without shares (by 1.11x: the pipeline of the slow devices' stage and the fast ones'
    with 8 and 20 ops)."""
    g = gpt_graph(2, 256, 4, 128, 8, 32)
    need = plan_cost(g, template_plan(g, Mesh((1,), (0,)), "dp"), _cluster([1e10])).memory_bytes
    c = _cluster([4e10, 1e10, 4e10, 1e10], [0.5 * need] * 4)
    r = search_plan(g, c)
    assert [st.mesh.devices for st in r.plan.stages] == [(0, 1), (2, 3)]
    shares = r.plan.stages[0].shares
    assert shares[0] > 3 * shares[1] and sum(shares) == g.batch
    others = [t for (desc, t, fits) in r.candidates if fits and "shares" not in desc]
    assert r.report.time_s * 1.08 < min(others)
    assert any("column shares" in desc for desc, _, _ in r.candidates)
    alike = search_plan(g, _cluster([1e10] * 4, [0.5 * need] * 4))
    assert not any("column shares" in desc for desc, _, _ in alike.candidates)


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
