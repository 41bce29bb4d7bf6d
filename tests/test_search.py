"""Coordinate descent against the exhaustive optimum, memory limits, and known answers."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetrain.cluster import GBIT, Cluster, Device, Link, Site, homogeneous, preset
from hetrain.plan.cost import StageTables, plan_cost
from hetrain.plan.graph import LayerGraph, Op, gpt_graph, vgg_graph
from hetrain.plan.sbp import Mesh
from hetrain.plan.search import (
    SearchOptions,
    coordinate_descent,
    exhaustive,
    named_assignment,
    search_plan,
    search_stage,
    template_plan,
)

SIZES = (8, 16, 64, 256, 1024, 4096)


def build_instance(p: dict[str, Any]) -> StageTables:
    """A random small graph on a random cluster and mesh, from plain parameters (drawn by
    hypothesis or by numpy): linear / elementwise / layernorm / residual-add ops on [B, F]
    tensors ending in a cross-entropy; 1 or 2 sites; memory between the leanest and the
    fattest assignment."""
    b, f = p["batch"], p["width0"]
    ops: list[Op] = []
    prev, shapes = "", {}
    for k, (kind, w) in enumerate(p["ops"]):
        name = f"op{k}"
        if kind == "linear" or not ops:
            op = Op(name, "linear", (prev,), ((b, f),), (b, w), 2.0 * b * f * w, (w, f),
                    4.0 * (w * f + w), 1)
            f = w
        elif kind == "add" and [n for n, s in shapes.items() if s == f and n != prev]:
            other = next(n for n, s in shapes.items() if s == f and n != prev)
            op = Op(name, "add", (prev, other), ((b, f), (b, f)), (b, f), b * f, fdim=1)
        elif kind == "layernorm":
            op = Op(name, "layernorm", (prev,), ((b, f),), (b, f), 8.0 * b * f, (f,), 8.0 * f, 1)
        else:
            op = Op(name, "elementwise", (prev,), ((b, f),), (b, f), 4.0 * b * f, fdim=1)
        ops.append(op)
        shapes[name] = f
        prev = name
    ops.append(Op("loss", "cross_entropy", (prev,), ((b, f),), (), 4.0 * b * f, fdim=1))
    graph = LayerGraph("random", tuple(ops), b)
    n = int(np.prod(p["mesh"]))
    sites = (Site("a", Link(p["lan_gbit"] * GBIT, p["lat_s"]), Link(p["wan_gbit"] * GBIT, 10 * p["lat_s"])),
             Site("b", Link(p["lan_gbit"] * GBIT, p["lat_s"]), Link(p["wan_gbit"] * GBIT, 10 * p["lat_s"])))
    two = p["two_sites"] and n % 2 == 0
    devs = tuple(Device(f"d{i}", 1e9 * p["speeds"][i % len(p["speeds"])],
                        site="a" if not two or i < n // 2 else "b") for i in range(n))
    cluster = Cluster("rand", devs, sites)
    mesh = Mesh(tuple(p["mesh"]), tuple(range(n)))
    tab = StageTables(graph, mesh, cluster)
    lo = sum(float(m.min()) for m in tab.mem)
    hi = sum(float(m.max()) for m in tab.mem)
    limit = lo + p["mem_frac"] * (hi - lo) if p["mem_frac"] <= 1 else 10 * hi + 1
    cluster = dataclasses.replace(cluster, devices=tuple(dataclasses.replace(d, memory_bytes=max(limit, 1.0))
                                                         for d in devs))
    return StageTables(graph, mesh, cluster)


def numpy_params(rng: np.random.Generator) -> dict[str, Any]:
    mesh = [(2,), (4,), (2, 2)][rng.integers(3)]
    n_ops = int(rng.integers(2, 5 if len(mesh) == 2 else 7))
    kinds = ["linear", "linear", "elementwise", "layernorm", "add"]
    return dict(batch=int(rng.choice([4, 8, 32, 256])), width0=int(rng.choice(SIZES)),
                ops=[(kinds[rng.integers(len(kinds))], int(rng.choice(SIZES))) for _ in range(n_ops)],
                mesh=mesh, lan_gbit=float(rng.choice([0.1, 1, 10, 100])),
                wan_gbit=float(rng.choice([0.01, 0.1, 1])), lat_s=float(rng.choice([1e-6, 1e-4, 1e-2])),
                two_sites=bool(rng.integers(2)), speeds=[float(rng.choice([1, 2, 8])) for _ in range(4)],
                mem_frac=float(rng.choice([0.05, 0.3, 0.7, 2.0])))


@st.composite
def hyp_params(draw: st.DrawFn) -> dict[str, Any]:
    mesh = draw(st.sampled_from([(2,), (4,), (2, 2)]))
    max_ops = 4 if len(mesh) == 2 else 6
    op = st.tuples(st.sampled_from(["linear", "elementwise", "layernorm", "add"]), st.sampled_from(SIZES))
    return dict(batch=draw(st.sampled_from([4, 8, 32, 256])), width0=draw(st.sampled_from(SIZES)),
                ops=draw(st.lists(op, min_size=1, max_size=max_ops)), mesh=mesh,
                lan_gbit=draw(st.sampled_from([0.1, 1.0, 10.0, 100.0])),
                wan_gbit=draw(st.sampled_from([0.01, 0.1, 1.0])),
                lat_s=draw(st.sampled_from([1e-6, 1e-4, 1e-2])), two_sites=draw(st.booleans()),
                speeds=draw(st.lists(st.sampled_from([1.0, 2.0, 8.0]), min_size=4, max_size=4)),
                mem_frac=draw(st.sampled_from([0.0, 0.05, 0.3, 0.7, 2.0])))


def test_coordinate_descent_is_within_2_percent_of_exhaustive_in_95_percent() -> None:
    rng = np.random.default_rng(20240)
    good, n = 0, 150
    for _ in range(n):
        tab = build_instance(numpy_params(rng))
        _, best = exhaustive(tab)
        _, found = search_stage(tab)
        assert found >= best * (1 - 1e-9)
        good += found <= best * 1.02
    assert good / n >= 0.95, f"only {good}/{n} within 2%"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hyp_params())
def test_search_never_beats_the_optimum_and_respects_memory(p: dict[str, Any]) -> None:
    tab = build_instance(p)
    opt_a, opt = exhaustive(tab)
    a, found = search_stage(tab, SearchOptions(restarts=3))
    assert found == pytest.approx(tab.time_s(a) if tab.memory_bytes(a) <= tab.memory_limit_bytes
                                  else found)
    assert found >= opt * (1 - 1e-9)
    if tab.memory_bytes(opt_a) <= tab.memory_limit_bytes:  # a feasible plan exists...
        assert tab.memory_bytes(a) <= tab.memory_limit_bytes * (1 + 1e-12)  # ...so CD finds one
    # a descent never ends worse than where it started
    start = named_assignment(tab, ("dp", "rep"))
    _, from_dp = coordinate_descent(tab, start)
    lim = tab.memory_limit_bytes
    start_score = tab.time_s(start) if tab.memory_bytes(start) <= lim else 1e12 + tab.memory_bytes(start) - lim
    assert from_dp <= start_score * (1 + 1e-12)


def _mlp(batch: int, hidden: int) -> LayerGraph:
    h4 = 4 * hidden
    return LayerGraph("mlp", (
        Op("fc", "linear", ("",), ((batch, hidden),), (batch, h4), 2.0 * batch * hidden * h4,
           (h4, hidden), 4.0 * (h4 * hidden + h4), 1),
        Op("act", "elementwise", ("fc",), ((batch, h4),), (batch, h4), 8.0 * batch * h4, fdim=1),
        Op("proj", "linear", ("act",), ((batch, h4),), (batch, hidden), 2.0 * batch * hidden * h4,
           (hidden, h4), 4.0 * (hidden * h4 + hidden), 1),
        Op("loss", "cross_entropy", ("proj",), ((batch, hidden),), (), 4.0 * batch * hidden, fdim=1)),
        batch)


def _slow_lan(n: int, flops: float) -> Cluster:
    site = Site("dc", Link(0.1 * GBIT, 1e-4), Link(0.1 * GBIT, 1e-3))
    return Cluster("slow", tuple(Device(f"d{i}", flops, site="dc") for i in range(n)), (site,))


def test_large_layer_on_slow_network_picks_tensor_parallel() -> None:
    c = _slow_lan(4, 2e10)  # compute matters: replicating the layer is no way out
    res = search_plan(_mlp(8, 2048), c, SearchOptions(pipeline=False, subsets=False))
    assert res.plan.signature("fc").split(",")[-1] == "col"
    assert res.plan.signature("proj").split(",")[-1] == "row"
    assert res.gain > 10


def test_small_layer_with_a_big_batch_picks_data_parallel() -> None:
    c = _slow_lan(4, 2e9)
    res = search_plan(_mlp(4096, 32), c, SearchOptions(pipeline=False, subsets=False))
    assert set(res.plan.signature(n) for n in ("fc", "proj")) <= {"dp", "dp,dp"}
    assert res.gain == pytest.approx(1.0, rel=0.05)


def test_memory_forces_a_split() -> None:
    g = _mlp(8, 2048)
    c = homogeneous(4)
    dp = search_plan(g, c, SearchOptions(pipeline=False, subsets=False)).baseline_report
    tight = dataclasses.replace(c, devices=tuple(dataclasses.replace(d, memory_bytes=dp.memory_bytes * 0.4)
                                                 for d in c.devices))
    res = search_plan(g, tight, SearchOptions(pipeline=False, subsets=False))
    assert not res.baseline_report.feasible and res.report.feasible
    assert res.report.memory_bytes <= res.report.memory_limit_bytes


def test_presets_gain_over_data_parallel() -> None:
    g = gpt_graph(2, 64, 4, 128, 32, 16)
    for name in ("homo-4", "hetero-8", "geo-16"):
        res = search_plan(g, preset(name))
        assert res.report.feasible
        assert res.report.time_s <= res.baseline_report.time_s * (1 + 1e-9)
        assert res.report.time_s == pytest.approx(plan_cost(g, res.plan, preset(name)).time_s)
    assert search_plan(vgg_graph(32), preset("hetero-8")).gain > 1.5


def test_search_is_fast_for_a_12_layer_gpt_on_8_devices() -> None:
    g = gpt_graph(12, 768, 12, 50304, 1024, 8)
    t0 = time.perf_counter()
    res = search_plan(g, homogeneous(8))
    assert time.perf_counter() - t0 < 10  # benchmark target 1 s; generous on a shared CI box
    assert res.report.feasible


def test_alike_devices_with_nothing_to_gain_give_one_device_not_a_replicated_four() -> None:
    """A replicated plan on four alike devices takes as long as on one; the search keeps the
    one (the other three stay free) instead of whichever the candidate list met first."""
    # links so slow that no split of this small model pays for its communication
    site = Site("dc", Link(0.01 * GBIT, 0.5), Link(0.01 * GBIT, 0.5))
    c = Cluster("slow", tuple(Device(f"d{i}", 2e9, site="dc") for i in range(4)), (site,))
    g = _mlp(8, 32)
    res = search_plan(g, c, SearchOptions(pipeline=False))
    rep4 = plan_cost(g, template_plan(g, Mesh((4,), (0, 1, 2, 3)), "rep"), c)
    assert rep4.time_s == pytest.approx(res.report.time_s, rel=1e-12)  # the tie the rule breaks
    assert [st.mesh.devices for st in res.plan.stages] == [(0,)]
    assert any(d.startswith("mesh 4 ") for d, *_ in res.candidates)  # it was tried
