"""The analytical cost model: compute, boxing, gradient sync, memory, pipelines, plan files."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.cluster import homogeneous, preset
from hetrain.errors import ConfigError
from hetrain.plan.cost import CostOptions, Plan, StagePlan, StageTables, plan_cost
from hetrain.plan.graph import LayerGraph, Op, gpt_graph, graph_from_module, vgg_graph
from hetrain.plan.sbp import Mesh
from hetrain.plan.search import data_parallel_plan, template_plan


def mlp_graph(batch: int = 32, hidden: int = 256) -> LayerGraph:
    ops = (Op("fc", "linear", ("",), ((batch, hidden),), (batch, 4 * hidden),
              2.0 * batch * hidden * 4 * hidden, (4 * hidden, hidden), 4.0 * hidden * 4 * hidden, 1),
           Op("act", "elementwise", ("fc",), ((batch, 4 * hidden),), (batch, 4 * hidden), 0.0, fdim=1),
           Op("proj", "linear", ("act",), ((batch, 4 * hidden),), (batch, hidden),
              2.0 * batch * hidden * 4 * hidden, (hidden, 4 * hidden), 4.0 * hidden * 4 * hidden, 1),
           Op("loss", "cross_entropy", ("proj",), ((batch, hidden),), (), 0.0, fdim=1))
    return LayerGraph("mlp", ops, batch)


def test_data_parallel_cost_is_compute_share_plus_gradient_all_reduce() -> None:
    c, g = homogeneous(4), mlp_graph()
    rep = plan_cost(g, data_parallel_plan(g, c), c)
    flops = sum(3 * op.flops if op.weight_shape else 2 * op.flops for op in g.ops)
    assert rep.compute_s == pytest.approx(flops / 4 / c.devices[0].flops)
    weights = [op for op in g.ops if op.weight_shape]
    expect = sum(c.ring_allreduce_time_s(4.0 * op.weight_shape[0] * op.weight_shape[1])
                 for op in weights)
    assert rep.sync_s == pytest.approx(expect)
    assert rep.comm_s == 0.0  # batch-split all the way: no activation boxing
    assert rep.time_s == pytest.approx(rep.compute_s + rep.sync_s + c.devices[0].step_overhead_s)


def test_megatron_pair_pays_one_all_reduce_each_way() -> None:
    c, g = homogeneous(4), mlp_graph()
    plan = Plan("mlp", (StagePlan(Mesh((4,), (0, 1, 2, 3)), ("fc", "act", "proj", "loss"),
                                  ("col", "feat", "row", "rep")),))
    rep = plan_cost(g, plan, c)
    T = 32 * 256 * 4.0
    assert rep.sync_s == 0.0  # every weight is split: nothing to synchronise
    # forward: P -> B after proj; backward: the col layer's partial input gradient is graph input
    assert rep.comm_s == pytest.approx(c.ring_allreduce_time_s(T))


def test_lockstep_mesh_runs_at_the_slowest_member() -> None:
    c = preset("hetero-4")  # speeds 1:1:2:4
    g = mlp_graph()
    fast = Mesh((1,), (3,))
    t_all = StageTables(g, Mesh((4,), (0, 1, 2, 3)), c).compute[0]
    t_fast = StageTables(g, fast, c).compute[0]
    assert t_all[0] == pytest.approx(t_fast[0] * 4 / 4)  # 1/4 of the work at 1/4 of the speed


def test_memory_is_a_hard_limit() -> None:
    c, g = homogeneous(4), mlp_graph(hidden=512)
    rep = plan_cost(g, data_parallel_plan(g, c), c)
    params = sum(op.param_bytes for op in g.ops)
    acts = sum(op.out_bytes for op in g.ops if op.out_shape) / 4
    assert rep.memory_bytes == pytest.approx(params * (2 + 2) + acts)  # Adam: 2 states
    assert rep.feasible
    small = dataclasses.replace(c, devices=tuple(dataclasses.replace(d, memory_bytes=rep.memory_bytes / 2)
                                                 for d in c.devices))
    assert not plan_cost(g, data_parallel_plan(g, small), small).feasible
    sgd = plan_cost(g, data_parallel_plan(g, c), c, CostOptions(optimizer_states=0))
    assert sgd.memory_bytes == pytest.approx(params * 2 + acts)


def test_pipeline_bubble() -> None:
    c, g = homogeneous(4), gpt_graph(2, 64, 4, 128, 32, 16)
    cut = g.cut_points()
    assert g.index("blocks.0.add_2") in cut and g.index("blocks.0.mlp.fc") not in cut
    k = g.index("blocks.0.add_2") + 1
    names = tuple(op.name for op in g.ops)
    plan = Plan(g.name, (StagePlan(Mesh((2,), (0, 1)), names[:k], ("dp",) * k),
                         StagePlan(Mesh((2,), (2, 3)), names[k:], ("dp",) * (len(names) - k))), 4)
    rep = plan_cost(g, plan, c)
    first, second = rep.stage_s
    assert first < second  # one block's attention half | the rest
    assert rep.bubble_s == pytest.approx(first)  # not (k - 1) x the slowest
    assert rep.time_s == pytest.approx(first + 4 * second + rep.sync_s
                                       + c.devices[0].step_overhead_s)
    with pytest.raises(ConfigError, match="divisible"):
        plan_cost(g, dataclasses.replace(plan, n_micro=3), c)


def test_plan_files_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    c, g = homogeneous(4), gpt_graph(1, 64, 4, 128, 32, 8)
    plan = template_plan(g, Mesh((2, 2), (0, 1, 2, 3)), "dp-tp")
    for suffix in (".json", ".toml"):
        plan.save(tmp_path / f"p{suffix}")
        assert Plan.load(tmp_path / f"p{suffix}") == plan
    assert plan_cost(g, Plan.load(tmp_path / "p.json"), c).time_s == plan_cost(g, plan, c).time_s
    with pytest.raises(ConfigError, match="not found"):
        Plan.load(tmp_path / "missing.json")
    bad = dataclasses.replace(plan, stages=(dataclasses.replace(
        plan.stages[0], signatures=("warp",) * len(plan.stages[0].ops)),))
    with pytest.raises(ConfigError, match="not legal"):
        plan_cost(g, bad, c)


def test_graphs_from_descriptions_and_modules() -> None:
    import torch

    from hetrain.workloads import MODELS

    g = gpt_graph(2, 64, 4, 100, 32, 8)
    assert g.param_bytes() == pytest.approx(4 * sum(
        p.numel() for p in MODELS["gpt"]((32,), 100, n_layer=2, n_head=4, n_embd=64).parameters()))
    model = MODELS["vgg"]((3, 16, 16), 10, width=8, fc=32)
    traced = graph_from_module(model, torch.zeros(4, 3, 16, 16))
    described = vgg_graph(4, (3, 16, 16), width=8, fc=32)
    assert [op.kind for op in traced.ops] == [op.kind for op in described.ops]
    assert traced.param_bytes() == pytest.approx(described.param_bytes())
    assert traced.total_flops() == pytest.approx(described.total_flops(), rel=0.05)


def test_op_overhead_and_kind_speed_price_compute_per_kind() -> None:
    c, g = homogeneous(4), mlp_graph()
    opts = CostOptions(op_overhead_s=(("linear", 1e-3), ("elementwise", 2e-4)),
                       kind_speed=(("linear", 0.5),))
    rep = plan_cost(g, data_parallel_plan(g, c), c, opts)
    f = c.devices[0].flops
    # fc and proj: overhead + 3 x flops / 4 devices / (0.5 f); act (0 FLOPs): overhead only;
    # the loss (kind not listed): no overhead, full speed, 0 FLOPs
    mm = 2.0 * 32 * 256 * 1024
    assert rep.compute_s == pytest.approx(2 * (1e-3 + 3 * mm / 4 / (0.5 * f)) + 2e-4)
    base = plan_cost(g, data_parallel_plan(g, c), c)
    assert base.compute_s == pytest.approx(2 * 3 * mm / 4 / f)  # defaults: the plain FLOP model
    with pytest.raises(ConfigError):
        CostOptions(kind_speed=(("linear", 0.0),))


def test_collective_call_cost_is_paid_per_gradient_tensor() -> None:
    c, g = homogeneous(4), mlp_graph()
    base = plan_cost(g, data_parallel_plan(g, c), c)
    rep = plan_cost(g, data_parallel_plan(g, c), c, CostOptions(collective_call_s=0.01))
    assert rep.sync_s == pytest.approx(base.sync_s + 2 * 0.01)  # two weights, no biases
    assert rep.time_s == pytest.approx(base.time_s + 2 * 0.01)


@pytest.mark.parametrize("template, mesh", [("dp", Mesh((4,), (0, 1, 2, 3))),
                                            ("tp", Mesh((4,), (0, 1, 2, 3))),
                                            ("rep", Mesh((4,), (0, 1, 2, 3))),
                                            ("dp-tp", Mesh((2, 2), (0, 1, 2, 3))),
                                            ("mixed", Mesh((4,), (0, 1, 2, 3)))])
def test_device_work_fraction_is_the_cost_models_compute_share(template: str,
                                                                mesh: Mesh) -> None:
    """What speed emulation pads a device to: its compute in the cost model's tables (no
    per-op overhead, every kind at full speed) over the whole model's on one device."""
    from hetrain.parallel.execute import resolve_signatures
    from hetrain.plan.cost import device_work_fraction

    g = gpt_graph(2, 64, 4, 96, 16, 8)
    plan = template_plan(g, mesh, template)
    tab = StageTables(g, mesh, homogeneous(4))
    assign = tab.index_of(plan.stages[0].signatures)
    alone = StageTables(g, Mesh((1,), (0,)), homogeneous(1))
    one = alone.index_of(template_plan(g, Mesh((1,), (0,)), "rep").stages[0].signatures)
    want = (sum(float(tab.compute[i][s]) for i, s in enumerate(assign))
            / sum(float(alone.compute[i][s]) for i, s in enumerate(one)))
    got = device_work_fraction(g, mesh.shape, resolve_signatures(g, plan))
    assert got == pytest.approx(want, rel=1e-12)
    assert {"dp": got == pytest.approx(0.25), "rep": got == 1.0, "dp-tp": 0.25 <= got < 0.5,
            "tp": 0.25 < got < 1.0, "mixed": 0.25 <= got < 1.0}[template], got


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.001, 10.0), min_size=1, max_size=6), st.integers(1, 16),
       st.floats(1.0, 3.0))
def test_pipeline_time_is_gpipes_schedule_simulated(stage_s: list[float], n_micro: int,
                                                    backward: float) -> None:
    """pipeline_time_s against GPipe simulated op by op: micro-batch i's forward on stage s
    starts when it left stage s-1 and stage s finished micro-batch i-1; the backwards run in
    reverse stage order once the last forward is done (a backward `backward` x its forward)."""
    from hetrain.plan.cost import pipeline_time_s

    k = len(stage_s)
    f = [t / (1 + backward) for t in stage_s]
    b = [t - x for t, x in zip(stage_s, f, strict=True)]
    done = [[0.0] * (n_micro + 1) for _ in range(k + 1)]  # done[s+1][i+1]: forward end
    for s in range(k):
        for i in range(n_micro):
            done[s + 1][i + 1] = max(done[s][i + 1], done[s + 1][i]) + f[s]
    back = [[0.0] * (n_micro + 1) for _ in range(k + 1)]  # stage k-1-s, backward of i
    start = done[k][n_micro]
    for s in range(k):
        stage = k - 1 - s
        for i in range(n_micro):
            ready = start if s == 0 else back[s][i + 1]
            back[s + 1][i + 1] = max(ready, back[s + 1][i], start) + b[stage]
    assert back[k][n_micro] == pytest.approx(pipeline_time_s(stage_s, n_micro))
