"""The speed-proportional pipeline split: the exact min-max split (checked against brute force)
gives a slower device fewer layers."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.cluster import GBIT, Cluster, Device, Link, Site
from hetrain.errors import ConfigError
from hetrain.plan.cost import plan_cost, stage_graphs
from hetrain.plan.graph import gpt_graph
from hetrain.plan.sbp import Mesh
from hetrain.plan.split import min_max_split, op_compute_s, pipeline_plan, speed_split


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


def _brute_force_full(costs, send, memory, caps, starts):  # type: ignore[no-untyped-def]
    k, n = len(costs), len(costs[0])
    best = None
    for cut in itertools.combinations(sorted(starts & set(range(1, n))), k - 1):
        b = [0, *cut, n]
        if any(sum(memory[s][b[s]:b[s + 1]]) > caps[s] for s in range(k)):
            continue
        t = max(sum(costs[s][b[s]:b[s + 1]]) + send[s][b[s + 1]] for s in range(k))
        best = t if best is None else min(best, t)
    return best


def _split_cases(k: int, *extra: st.SearchStrategy) -> st.SearchStrategy:  # type: ignore[type-arg]
    """k stages of 7 ops: per-op times, per-boundary transfers, whole-byte memories, caps,
    the op count, the allowed starts, then `extra`."""
    return st.tuples(
        st.lists(st.lists(st.floats(0.0, 10.0), min_size=7, max_size=7), min_size=k, max_size=k),
        st.lists(st.lists(st.floats(0.0, 5.0), min_size=8, max_size=8), min_size=k, max_size=k),
        st.lists(st.lists(st.integers(0, 4 << 30), min_size=7, max_size=7), min_size=k,
                 max_size=k),
        st.lists(st.integers(0, 20 << 30), min_size=k, max_size=k),
        st.integers(k, 7), st.sets(st.integers(1, 6)), *extra)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4).flatmap(_split_cases))
def test_min_max_split_with_transfers_and_memory_caps_is_the_brute_force_optimum(case) -> None:  # type: ignore[no-untyped-def]
    """Memory in whole bytes (as the cost model counts them): the caps are hard limits, and
    prefix sums of whole numbers are exact."""
    rows, sends, mems, caps, n, starts = case
    costs, memory = [r[:n] for r in rows], [r[:n] for r in mems]
    send = [[*r[:n], 0.0] for r in sends]
    want = _brute_force_full(costs, send, memory, caps, starts)
    if want is None:
        with pytest.raises(ConfigError, match="cannot split"):
            min_max_split(costs, starts, send=send, memory=memory, caps=caps)
        return
    bounds, got = min_max_split(costs, starts, send=send, memory=memory, caps=caps)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert set(bounds[1:-1]) <= starts
    assert all(sum(memory[s][bounds[s]:bounds[s + 1]]) <= caps[s] for s in range(len(costs)))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4).flatmap(lambda k: _split_cases(k, st.integers(2, 16))))
def test_split_for_n_micro_batches_is_the_brute_force_optimum(case) -> None:  # type: ignore[no-untyped-def]
    """With n_micro, the split minimises the pipeline's time, the stages' sum plus n_micro - 1
    times the slowest (cost.pipeline_time_s), over every split within the caps."""
    from hetrain.plan.cost import pipeline_time_s

    rows, sends, mems, caps, n, starts, m = case
    costs, memory = [r[:n] for r in rows], [r[:n] for r in mems]
    send = [[*r[:n], 0.0] for r in sends]
    k = len(costs)

    def stages(b: list[int]) -> list[float]:
        return [sum(costs[s][b[s]:b[s + 1]]) + send[s][b[s + 1]] for s in range(k)]

    splits = [[0, *cut, n] for cut in itertools.combinations(sorted(starts & set(range(1, n))),
                                                             k - 1)]
    fit = [b for b in splits if all(sum(memory[s][b[s]:b[s + 1]]) <= caps[s] for s in range(k))]
    if not fit:
        with pytest.raises(ConfigError, match="cannot split"):
            min_max_split(costs, starts, send=send, memory=memory, caps=caps, n_micro=m)
        return
    want = min(pipeline_time_s(stages(b), m) for b in fit)
    bounds, slowest = min_max_split(costs, starts, send=send, memory=memory, caps=caps,
                                    n_micro=m)
    assert bounds in fit
    assert pipeline_time_s(stages(bounds), m) == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert slowest == pytest.approx(max(stages(bounds)))


def test_cost_model_prices_an_uneven_split_per_stage_device() -> None:
    """One-device stages on devices of different speeds: each stage's micro-batch time is its
    ops' compute on its own device plus the boundary activation and gradient over the link;
    the pipeline takes the stages' sum plus m - 1 times the slowest (the bubble is the sum
    less the slowest)."""
    g = gpt_graph(2, 64, 4, 128, 32, 16)
    cl = dataclasses.replace(cluster_of((1e9, 4e9, 2e9)), devices=tuple(
        dataclasses.replace(d, step_overhead_s=0.003) for d in cluster_of((1e9, 4e9, 2e9)).devices))
    bounds, m, k = [0, 5, 20, len(g.ops)], 4, 3
    plan = pipeline_plan(g, bounds, [Mesh((1,), (d,)) for d in range(k)], m)
    micro = g.scaled(1 / m)
    link = cl.sites[0].lan
    stage = [sum(op_compute_s(micro, cl, s)[a:b])
             + (2 * (link.latency_s + micro.ops[b - 1].out_bytes / link.bandwidth_Bps) if s < k - 1 else 0.0)
             for s, (a, b) in enumerate(itertools.pairwise(bounds))]
    rep = plan_cost(g, plan, cl)
    assert rep.time_s == pytest.approx(sum(stage) + (m - 1) * max(stage) + 0.003, rel=1e-9)
    assert rep.bubble_s == pytest.approx(sum(stage) - max(stage), rel=1e-9)
    assert rep.stage_s == pytest.approx(stage, rel=1e-9)
    assert rep.sync_s == 0.0
    faster = pipeline_plan(g, bounds, [Mesh((1,), (d,)) for d in (1, 0, 2)], m)  # fast device first
    assert plan_cost(g, faster, cl).time_s != pytest.approx(rep.time_s)


def test_stage_starts_are_the_pipeline_executors_boundaries() -> None:
    """The graph's stage starts are exactly where the executor's pieces begin (GPT, and a
    traced Sequential whose functional flatten is a free reshape); a hand-built graph with
    no marks may be cut at every cut point but before its loss."""
    import torch

    from hetrain.parallel.pipeline import model_pieces, pipeline_layout
    from hetrain.plan.graph import graph_from_module
    from hetrain.workloads import MODELS

    g = gpt_graph(2, 32, 4, 32, 16, 8)
    gpt = MODELS["gpt"]((16,), 32, n_layer=2, n_head=4, n_embd=32)
    assert [g.ops[i].name for i in g.stage_starts()] == [p.start for p in model_pieces(gpt)][1:]
    torch.manual_seed(0)
    mlp = MODELS["mlp"]((1, 40), 10, hidden=(16, 16))
    traced = graph_from_module(mlp, torch.zeros(8, 1, 40), name="mlp")
    assert traced.stage_starts()
    for i in traced.stage_starts():
        pipeline_layout(mlp, traced, pipeline_plan(traced, [0, i, len(traced.ops)],
                                                   [Mesh((1,), (0,)), Mesh((1,), (1,))], 2))
    bare = dataclasses.replace(g, ops=tuple(dataclasses.replace(op, stage_start=False) for op in g.ops),
                               _index={})
    assert len(g.ops) - 1 not in bare.stage_starts()
    assert set(g.stage_starts()) == set(bare.stage_starts()) == {c + 1 for c in g.cut_points()} - {len(g.ops) - 1}
