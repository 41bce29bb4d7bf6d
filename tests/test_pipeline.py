"""Pipeline plans run with torch.distributed.pipelining train exactly like one process (GPipe
and 1F1B, uneven splits, data parallel inside stages); plans the executor cannot run say why."""

from __future__ import annotations

import functools

import pytest
import torch

from hetrain.errors import ConfigError
from hetrain.plan.graph import gpt_graph
from hetrain.plan.sbp import Mesh
from hetrain.plan.split import pipeline_plan, speed_split
from hetrain.workloads import MODELS
from hetrain.workloads.base import cross_entropy
from test_split import cluster_of

V, T, B = 32, 16, 8
GRAPH = gpt_graph(2, 32, 4, V, T, B)
N = len(GRAPH.ops)  # 28: tok_emb, 2 x 13 block ops, ln_f, head, loss
build_gpt = functools.partial(MODELS["gpt"], (T,), V, n_layer=2, n_head=4, n_embd=32)


def _one_device_stages(bounds: list[int], n_micro: int):  # type: ignore[no-untyped-def]
    return pipeline_plan(GRAPH, bounds, [Mesh((1,), (s,)) for s in range(len(bounds) - 1)], n_micro)


@pytest.mark.dist
def test_gpt_pipelines_train_like_one_process() -> None:
    """2- and 4-stage uneven pipelines under GPipe and 1F1B, a speed-proportional split and
    2 stages x 2 data-parallel devices, on 4 gloo processes (idle ranks sit plans out)."""
    from hetrain.parallel.runs import PlanRun, reference_run, run_plans

    split = speed_split(GRAPH, cluster_of((1e9, 4e9, 2e9, 1e9)), (0, 1, 2, 3), n_micro=4)
    sizes = [len(s.ops) for s in split.stages]
    assert len(set(sizes)) > 1 and sizes.index(max(sizes)) == 1  # the fast device: most ops
    plans = (
        _one_device_stages([0, 8, N], 2),            # 8 | 20 ops
        _one_device_stages([0, 20, N], 4),           # 20 | 8
        _one_device_stages([0, 1, 8, 13, N], 4),     # 1 | 7 | 5 | 15
        _one_device_stages([0, 13, 20, 25, N], 8),   # 13 | 7 | 5 | 3
        split,
        pipeline_plan(GRAPH, [0, 13, N], [Mesh((2,), (0, 1)), Mesh((2,), (2, 3))], 2),
    )
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
    run = PlanRun(build_gpt, cross_entropy, GRAPH, plans, (batch,) * 3, lr=0.5,
                  schedule=("gpipe", "1f1b", "gpipe", "1f1b", "1f1b", "gpipe"))
    ref = reference_run(run)
    assert ref.losses[2] < ref.losses[1] - 1e-3 < ref.losses[0] - 2e-3  # the SGD steps count
    for plan, res in zip(plans, run_plans(run, 4, timeout_s=120), strict=True):
        assert res.losses == pytest.approx(ref.losses, rel=1e-4), [len(s.ops) for s in plan.stages]


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
    from hetrain.plan.cost import Plan, StagePlan

    assert "inside the piece that starts at 'blocks.0.ln1'" in _refusal(
        _one_device_stages([0, 3, N], 2))  # between attn.q and attn.k
    assert "only data parallel" in _refusal(Plan(GRAPH.name, (
        StagePlan(Mesh((2,), (0, 1)), tuple(o.name for o in GRAPH.ops[:13]),
                  ("col",) * 13),
        StagePlan(Mesh((2,), (2, 3)), tuple(o.name for o in GRAPH.ops[13:]),
                  ("dp",) * (N - 13))), 2))
    assert "same number of devices" in _refusal(
        pipeline_plan(GRAPH, [0, 13, N], [Mesh((2,), (0, 1)), Mesh((1,), (2,))], 2))
    assert "starts at 'head'" in _refusal(_one_device_stages([0, N - 1, N], 2))  # only the loss
    assert "not divisible" in _refusal(_one_device_stages([0, 13, N], 3))
    tied = MODELS["gpt"]((T,), V, n_layer=2, n_head=4, n_embd=32, tie_weights=True)
    assert "tied weights" in _refusal(_one_device_stages([0, 13, N], 2), tied)
    assert "cannot split a ResNet" in _refusal(_one_device_stages([0, 13, N], 2),
                                               MODELS["resnet"]((3, 8, 8), 10))
