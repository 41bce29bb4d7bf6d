"""The search's pipeline candidates: executable by the pipeline executor, uneven by device
speed (and never slower than any contiguous split for one-device stages), within every
device's memory cap, or one clear error when nothing fits."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetrain.cluster import GBIT, Cluster, Device, Link, Site, preset
from hetrain.errors import ConfigError
from hetrain.plan.cost import (
    CostOptions,
    Plan,
    memory_with_micro,
    plan_cost,
    stage_graphs,
    stage_tables,
)
from hetrain.plan.graph import LayerGraph, gpt_graph, vgg_graph
from hetrain.plan.sbp import Mesh
from hetrain.plan.search import (
    SearchOptions,
    _balanced_bounds,
    _pipeline_groups,
    _search_pipeline,
    data_parallel_plan,
    search_plan,
)
from hetrain.plan.split import pipeline_plan
from hetrain.workloads import MODELS


def _cluster(speeds: tuple[float, ...], site_of: tuple[int, ...] | None = None,
             memory: tuple[float, ...] | None = None, gbit: tuple[float, float] = (10.0, 1.0),
             name: str = "test") -> Cluster:
    """Devices of the given FLOP/s on 1 or more sites (LAN, WAN Gbit/s), optional memory caps."""
    site_of = site_of or (0,) * len(speeds)
    sites = tuple(Site(f"s{j}", Link(gbit[0] * GBIT, 1e-4), Link(gbit[1] * GBIT, 1e-3))
                  for j in range(max(site_of) + 1))
    return Cluster(name, tuple(Device(f"d{i}", f, memory_bytes=memory[i] if memory else 16e9,
                                      site=f"s{site_of[i]}") for i, f in enumerate(speeds)), sites)


def _stage_flops(graph: LayerGraph, plan: Plan) -> list[float]:
    return [sum(op.flops for op in graph.ops[a:b]) for a, b in stage_graphs(graph, plan)]


# ---- every pipeline the search builds runs on the executor ---------------------------------------
def test_every_searched_pipeline_passes_the_executors_layout() -> None:
    """Presets, a cluster with unequal sites (3 + 1) and uneven memory, and one whose second
    site is 100x slower (a cut-point split would leave the last stage only the loss) give
    pipeline candidates of equal-sized groups cut where the executor can cut."""
    from hetrain.parallel.pipeline import pipeline_layout

    torch.manual_seed(0)
    models = [(gpt_graph(2, 64, 4, 128, 32, 16),
               MODELS["gpt"]((32,), 128, n_layer=2, n_head=4, n_embd=64)),
              (vgg_graph(32), MODELS["vgg"]((3, 32, 32), 10))]
    clusters = [preset(n) for n in ("homo-4", "hetero-4", "hetero-8", "geo-16")]
    clusters += [_cluster((1e9, 2e9, 4e9, 1e9), (0, 0, 0, 1), memory=(1e9, 4e9, 4e9, 8e9)),
                 _cluster((1e11, 1e11, 1e9, 1e9), (0, 0, 1, 1))]
    seen = 0
    for cl in clusters:
        for groups in _pipeline_groups(cl):
            assert len({len(g) for g in groups}) == 1, (cl.name, groups)
            for graph, model in models:
                for plan, desc in _search_pipeline(graph, cl, groups, SearchOptions(restarts=2), None):
                    pipeline_layout(model, graph, plan)  # raises ConfigError if it cannot run
                    assert plan.stages[-1].ops != ("loss",), desc
                    seen += 1
    assert seen > 80
    graph, model = models[0]
    res = search_plan(graph, clusters[-1])
    if len(res.plan.stages) > 1:
        pipeline_layout(model, graph, res.plan)


# ---- uneven stages by device speed ----------------------------------------------------------------
def test_searched_pipeline_gives_slower_devices_fewer_layers() -> None:
    """Two slow and two 4x faster devices on a 1 Gbit/s LAN: the search picks a 4-stage
    pipeline whose slow stages hold less work than the fast ones, predicted faster than the
    equal-work split of the same stages and micro-batches, and priced as plan_cost says."""
    g = gpt_graph(4, 128, 4, 256, 64, 16)
    cl = _cluster((1e10, 1e10, 4e10, 4e10), gbit=(1.0, 1.0))
    res = search_plan(g, cl)
    assert len(res.plan.stages) == 4, res.candidates
    by_dev = {st.mesh.devices[0]: f for st, f in zip(res.plan.stages, _stage_flops(g, res.plan),
                                                     strict=True)}
    assert max(by_dev[0], by_dev[1]) < min(by_dev[2], by_dev[3])
    even = pipeline_plan(g, _balanced_bounds(g, [1.0] * 4),
                         [st.mesh for st in res.plan.stages], res.plan.n_micro)
    assert res.report.time_s < 0.9 * plan_cost(g, even, cl).time_s
    assert res.report.time_s == pytest.approx(plan_cost(g, res.plan, cl).time_s)
    assert res.report.time_s <= min(t for _, t, _ in res.candidates) * (1 + 1e-12)


def test_speed_split_beats_flops_split_when_op_overheads_count() -> None:
    """With a fixed per-op cost (framework dispatch), FLOP-proportional cuts misjudge small
    ops; the split by the cost model's per-op times is priced faster, and the search keeps it."""
    g = gpt_graph(4, 64, 4, 128, 32, 16)
    cl = preset("hetero-4")
    opts = CostOptions(op_overhead_s=(("layernorm", 2e-3), ("add", 2e-3), ("elementwise", 2e-3)))
    found = _search_pipeline(g, cl, [[0], [1], [2], [3]], SearchOptions(restarts=1), opts)
    for m in {p.n_micro for p, _ in found}:
        t = {d.split(" split")[0].split()[-1]: plan_cost(g, p, cl, opts).time_s
             for p, d in found if p.n_micro == m}
        assert t["speed"] < t.get("flops", float("inf"))


def _chain_or_gpt(draw: st.DrawFn) -> LayerGraph:
    if draw(st.booleans()):
        return gpt_graph(draw(st.integers(1, 2)), 32, 4, draw(st.sampled_from([64, 512])), 16,
                         draw(st.sampled_from([12, 24])))
    return vgg_graph(draw(st.sampled_from([12, 24])), width=draw(st.sampled_from([4, 16])),
                     convs=(1, 1), fc=draw(st.sampled_from([16, 256])))


@st.composite
def _pipeline_case(draw: st.DrawFn) -> tuple[LayerGraph, Cluster, int, CostOptions, int]:
    g = _chain_or_gpt(draw)
    k = draw(st.integers(2, 3))
    speeds = tuple(draw(st.sampled_from([1e8, 3e8, 1e9, 8e9])) for _ in range(k))
    sites = tuple(draw(st.integers(0, 1)) for _ in range(k))
    cl = _cluster(speeds, (0, *sites[1:]) if 1 in sites[1:] else None,
                  gbit=(draw(st.sampled_from([0.1, 10.0])), draw(st.sampled_from([0.01, 1.0]))))
    opts = CostOptions(op_overhead_s=(("linear", draw(st.sampled_from([0.0, 1e-3]))),
                                      ("layernorm", draw(st.sampled_from([0.0, 5e-3])))))
    # memory: unlimited, or a cap between the leanest one-device stage and the whole model
    whole = plan_cost(g, data_parallel_plan(g, cl, Mesh((1,), (0,)), opts), cl, opts).memory_bytes
    frac = draw(st.sampled_from([0.0, 0.35, 0.6]))
    if frac:
        cl = dataclasses.replace(cl, devices=tuple(
            dataclasses.replace(d, memory_bytes=whole * frac * draw(st.sampled_from([1.0, 2.0])))
            for d in cl.devices))
    return g, cl, k, opts, draw(st.sampled_from([1, 2]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_pipeline_case())
def test_searched_cuts_are_the_best_contiguous_split(case) -> None:  # type: ignore[no-untyped-def]
    """For one-device stages the searched cuts are priced no slower than any contiguous
    split at the graph's stage starts (brute force through plan_cost), and fit memory
    whenever some split does."""
    g, cl, k, opts, mult = case
    m = k * mult
    assert g.batch % m == 0
    meshes = [Mesh((1,), (d,)) for d in range(k)]
    found = [p for p, _ in _search_pipeline(g, cl, [[d] for d in range(k)], SearchOptions(restarts=1),
                                            opts) if p.n_micro == m]
    assert found
    reports = [plan_cost(g, p, cl, opts) for p in found]
    best = min(reports, key=lambda r: (not r.feasible, r.time_s))
    brute = [plan_cost(g, pipeline_plan(g, [0, *c, len(g.ops)], meshes, m), cl, opts)
             for c in itertools.combinations(g.stage_starts(), k - 1)]
    feasible = [r.time_s for r in brute if r.feasible]
    assert best.feasible == bool(feasible)
    if feasible:
        assert best.time_s <= min(feasible) * (1 + 1e-9)


# ---- memory caps ----------------------------------------------------------------------------------
def _per_device_need(graph: LayerGraph, plan: Plan, cl: Cluster) -> dict[int, float]:
    """Bytes per device as the cost model counts them (GPipe: all micro-batches' activations)."""
    micro = graph.scaled(1.0 / plan.n_micro) if plan.n_micro > 1 else graph
    out = {}
    for (a, b), stage in zip(stage_graphs(graph, plan), plan.stages, strict=True):
        tab = stage_tables(micro.subgraph(a, b) if len(plan.stages) > 1 else micro, stage.mesh, cl)
        need = memory_with_micro(tab, tab.index_of(stage.signatures), plan.n_micro)
        out.update({d: need for d in stage.mesh.devices})
    return out


GPT = gpt_graph(4, 256, 4, 4096, 64, 8)


def _caps(fractions: tuple[float, ...]) -> Cluster:
    base = _cluster((1e12,) * len(fractions), gbit=(10.0, 10.0), name="caps")
    dp = plan_cost(GPT, data_parallel_plan(GPT, base), base).memory_bytes
    return dataclasses.replace(base, devices=tuple(
        dataclasses.replace(d, memory_bytes=dp * f) for d, f in zip(base.devices, fractions, strict=True)))


def test_a_model_too_big_for_the_small_devices_gets_a_plan_that_fits() -> None:
    """Data parallel needs more than the two small devices have: the search returns a plan
    that fits every device, the small devices holding less than the big ones."""
    cl = _caps((0.3, 0.3, 2.0, 2.0))
    res = search_plan(GPT, cl)
    assert not res.baseline_report.feasible
    need = _per_device_need(GPT, res.plan, cl)
    assert all(need[d] <= cl.devices[d].memory_bytes for d in need) and res.report.feasible
    assert max(need.get(0, 0.0), need.get(1, 0.0)) < min(need.get(2, 0.0), need.get(3, 0.0))


def test_devices_too_small_for_any_layer_are_left_out() -> None:
    """Two devices can hold no layer at all: the plan uses only the two with room."""
    cl = _caps((0.01, 0.01, 2.0, 2.0))
    res = search_plan(GPT, cl)
    assert res.report.feasible
    assert {d for st in res.plan.stages for d in st.mesh.devices} <= {2, 3}
    need = _per_device_need(GPT, res.plan, cl)
    assert all(need[d] <= cl.devices[d].memory_bytes for d in need)


def test_a_model_that_fits_nowhere_gets_one_line_naming_the_shortfall() -> None:
    cl = _caps((0.1, 0.1, 0.15, 0.15))
    with pytest.raises(ConfigError) as e:
        search_plan(GPT, cl)
    msg = str(e.value)
    assert "\n" not in msg and "fits no device memory" in msg
    assert "short by" in msg and "needs" in msg
    big = max(d.memory_bytes for d in cl.devices)
    assert f"has {big / 2**20:.3g} MiB" in msg and "'d2'" in msg
