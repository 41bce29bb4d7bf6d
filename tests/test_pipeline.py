"""Pipeline plans run with torch.distributed.pipelining train exactly like one process (GPipe
and 1F1B, uneven splits, DTensor stages); plans the executor cannot run say why."""

from __future__ import annotations

import functools

import pytest
import torch

from hetrain.errors import ConfigError
from hetrain.plan.cost import Plan, StagePlan
from hetrain.plan.graph import gpt_graph
from hetrain.plan.sbp import Mesh
from hetrain.plan.search import template_plan
from hetrain.plan.split import pipeline_plan, speed_split
from hetrain.workloads import MODELS
from hetrain.workloads.base import cross_entropy
from test_split import cluster_of

V, T, B = 32, 16, 8
GRAPH = gpt_graph(2, 32, 4, V, T, B)
N = len(GRAPH.ops)  # 28: tok_emb, 2 x 13 block ops, ln_f, head, loss
build_gpt = functools.partial(MODELS["gpt"], (T,), V, n_layer=2, n_head=4, n_embd=32)


def _one_device_stages(bounds: list[int], n_micro: int) -> Plan:
    return pipeline_plan(GRAPH, bounds, [Mesh((1,), (s,)) for s in range(len(bounds) - 1)], n_micro)


def _run_and_compare(plans, schedules: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    from hetrain.parallel.runs import PlanRun, reference_run, run_plans

    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
    run = PlanRun(build_gpt, cross_entropy, GRAPH, plans, (batch,) * 3, lr=0.5,
                  schedule=schedules)
    ref = reference_run(run)
    assert ref.losses[2] < ref.losses[1] - 1e-3 < ref.losses[0] - 2e-3  # the SGD steps count
    for plan, res in zip(plans, run_plans(run, 4, timeout_s=120), strict=True):
        assert res.losses == pytest.approx(ref.losses, rel=1e-4), [len(s.ops) for s in plan.stages]


@pytest.mark.dist
def test_gpt_pipelines_train_like_one_process() -> None:
    """2- and 4-stage uneven pipelines of one device per stage under GPipe and 1F1B, and a
    speed-proportional split, on 4 gloo processes (ranks a plan does not need sit it out)."""
    split = speed_split(GRAPH, cluster_of((1e9, 4e9, 2e9, 1e9)), (0, 1, 2, 3), n_micro=4)
    sizes = [len(s.ops) for s in split.stages]
    assert len(set(sizes)) > 1 and sizes.index(max(sizes)) == 1  # the fast device: most ops
    _run_and_compare((_one_device_stages([0, 8, N], 2),            # 8 | 20 ops
                      _one_device_stages([0, 20, N], 4),           # 20 | 8
                      _one_device_stages([0, 1, 8, 13, N], 4),     # 1 | 7 | 5 | 15
                      _one_device_stages([0, 13, 20, 25, N], 8),   # 13 | 7 | 5 | 3
                      split),
                     ("gpipe", "1f1b", "gpipe", "1f1b", "1f1b"))


def _two_by_two(cut: int, templates: tuple[str, str], n_micro: int) -> Plan:
    """2 stages of 2 devices, each stage's ops under a template ("dp", "tp", "mixed")."""
    meshes = (Mesh((2,), (0, 1)), Mesh((2,), (2, 3)))
    stages = tuple(template_plan(GRAPH.subgraph(a, b), mesh, t).stages[0]
                   for (a, b), mesh, t in zip(((0, cut), (cut, N)), meshes, templates, strict=True))
    return Plan(GRAPH.name, tuple(StagePlan(st.mesh, st.ops, st.signatures) for st in stages),
                n_micro)


@pytest.mark.dist
def test_gpt_pipelines_of_dtensor_stages_train_like_one_process() -> None:
    """Stages on 2 devices each run their own SBP plan with DTensor: data parallel, Megatron
    tensor parallel (vocab-parallel loss on the last stage), mixed."""
    plans = (_two_by_two(8, ("dp", "tp"), 2), _two_by_two(20, ("tp", "mixed"), 2))
    assert plans[0].signature("loss") == "vocab" and plans[1].signature("blocks.0.mlp.fc") == "col"
    _run_and_compare(plans, ("gpipe", "1f1b"))


def _holders(rank: int, world: int, plan: Plan) -> int:
    from hetrain.parallel.execute import make_executor

    torch.manual_seed(0)
    ex = make_executor(build_gpt(), GRAPH, plan, cross_entropy)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
    ex.step(x, y, torch.optim.SGD(ex.parameters(), lr=0.1) if ex.parameters() else None)
    return sum(p.numel() for p in ex.parameters())


@pytest.mark.dist
def test_stages_run_on_the_devices_the_plan_names() -> None:
    """Rank r is cluster device r: a stage the planner put on devices 2 and 3 (say, the
    small-memory ones) runs there, not on the first ranks; a one-stage plan on a subset of
    the devices runs on that subset while the others idle; both train like one process."""
    from hetrain.parallel.launch import run_local

    reversed_stages = Plan(GRAPH.name, tuple(
        StagePlan(mesh, st.ops, st.signatures) for mesh, st in
        zip((Mesh((2,), (2, 3)), Mesh((2,), (0, 1))), _two_by_two(8, ("dp", "tp"), 2).stages,
            strict=True)), 2)
    one_device = pipeline_plan(GRAPH, [0, 20, N], [Mesh((1,), (3,)), Mesh((1,), (1,))], 2)
    subset = template_plan(GRAPH, Mesh((2,), (1, 3)), "tp")
    held = [run_local(_holders, 4, (p,), timeout_s=120) for p in (reversed_stages, one_device,
                                                                  subset)]
    assert [h > 0 for h in held[0]] == [True] * 4 and held[0][2] == held[0][3] != held[0][0]
    assert [h > 0 for h in held[1]] == [False, True, False, True] and held[1][3] > held[1][1]
    assert [h > 0 for h in held[2]] == [False, True, False, True]
    _run_and_compare((reversed_stages, one_device, subset), ("gpipe", "1f1b", "gpipe"))


# ---- refusals ----------------------------------------------------------------------------------
def _refusal(plan, model=None) -> str:  # type: ignore[no-untyped-def]
    from hetrain.parallel.pipeline import pipeline_layout

    torch.manual_seed(0)
    with pytest.raises(ConfigError) as e:
        pipeline_layout(model if model is not None else build_gpt(), GRAPH, plan)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_pipeline_executor_refuses_what_it_cannot_run_in_one_line() -> None:
    assert "inside the piece that starts at 'blocks.0.ln1'" in _refusal(
        _one_device_stages([0, 3, N], 2))  # between attn.q and attn.k
    assert "same number of devices" in _refusal(
        pipeline_plan(GRAPH, [0, 13, N], [Mesh((2,), (0, 1)), Mesh((1,), (2,))], 2))
    assert "starts at 'head'" in _refusal(_one_device_stages([0, N - 1, N], 2))  # only the loss
    assert "not divisible" in _refusal(_one_device_stages([0, 13, N], 3))
    tied = MODELS["gpt"]((T,), V, n_layer=2, n_head=4, n_embd=32, tie_weights=True)
    assert "tied weights" in _refusal(_one_device_stages([0, 13, N], 2), tied)
    assert "cannot split a ResNet" in _refusal(_one_device_stages([0, 13, N], 2),
                                               MODELS["resnet"]((3, 8, 8), 10))
