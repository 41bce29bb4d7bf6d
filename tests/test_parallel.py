"""Plans executed with DTensor on 4 gloo processes train exactly like one process; the CLI."""

from __future__ import annotations

import functools
import io
import json
import math

import pytest
import torch
from rich.console import Console

from hetrain.cluster import GBIT, Cluster, Device, Link, Site
from hetrain.errors import ConfigError
from hetrain.parallel.cli_plan import add_plan_arguments, plan_command, plan_from_args
from hetrain.plan.cost import Plan, StagePlan
from hetrain.plan.graph import gpt_graph, vgg_graph
from hetrain.plan.sbp import Mesh
from hetrain.plan.search import SearchOptions, search_plan, template_plan
from hetrain.workloads import MODELS
from hetrain.workloads.base import cross_entropy

M4, M22 = Mesh((4,), (0, 1, 2, 3)), Mesh((2, 2), (0, 1, 2, 3))


def _batches(make, steps: int = 3):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(1)
    return tuple(make(gen) for _ in range(steps))


def _assert_same_losses(results, ref) -> None:  # type: ignore[no-untyped-def]
    for r in results:
        assert r.losses == pytest.approx(ref.losses, rel=1e-4, abs=1e-6)
    assert ref.losses[-1] != pytest.approx(ref.losses[0], rel=1e-6)  # it did train


def _slow_lan_4() -> Cluster:
    site = Site("dc", Link(0.01 * GBIT, 1e-3), Link(0.01 * GBIT, 1e-3))
    return Cluster("slow-4", tuple(Device(f"d{i}", 2e10, site="dc") for i in range(4)), (site,))


def _gpt_run():  # type: ignore[no-untyped-def]
    from hetrain.parallel.runs import PlanRun

    V, T, B = 32, 16, 8
    g = gpt_graph(2, 32, 4, V, T, B)
    searched = search_plan(g, _slow_lan_4(), SearchOptions(pipeline=False, subsets=False)).plan
    plans = (template_plan(g, M4, "dp"), template_plan(g, M4, "tp"), template_plan(g, M22, "dp-tp"),
             searched)
    return PlanRun(functools.partial(MODELS["gpt"], (T,), V, n_layer=2, n_head=4, n_embd=32),
                   cross_entropy, g, plans,
                   _batches(lambda gen: (torch.randint(0, V, (B, T), generator=gen),
                                         torch.randint(0, V, (B, T), generator=gen))), lr=0.5)


def _vgg_run():  # type: ignore[no-untyped-def]
    from hetrain.parallel.runs import PlanRun

    B = 8
    g = vgg_graph(B, (3, 16, 16), width=8, fc=32)
    plans = (template_plan(g, M4, "dp"), template_plan(g, M4, "tp"), template_plan(g, M22, "dp-mixed"))
    return PlanRun(functools.partial(MODELS["vgg"], (3, 16, 16), 10, width=8, fc=32), cross_entropy,
                   g, plans, _batches(lambda gen: (torch.randn(B, 3, 16, 16, generator=gen),
                                                   torch.randint(0, 10, (B,), generator=gen))),
                   lr=0.2, optimizer="adamw")


def _every_run(rank: int, world: int, runs) -> list:  # type: ignore[no-untyped-def]
    from hetrain.parallel.runs import plans_worker

    return [plans_worker(rank, world, run) for run in runs]


@pytest.fixture(scope="module")
def trained() -> dict[str, tuple]:
    """The GPT and the VGG runs, both on one group of 4 gloo processes (starting the
    processes costs more than the training): name -> (run, rank 0's results per plan)."""
    from hetrain.parallel.launch import run_local

    runs = {"gpt": _gpt_run(), "vgg": _vgg_run()}
    results = run_local(_every_run, 4, (tuple(runs.values()),), timeout_s=120)[0]
    return {name: (run, res) for (name, run), res in zip(runs.items(), results, strict=True)}


@pytest.mark.dist
def test_gpt_trains_like_one_process_under_dp_tp_and_dp_x_tp(trained) -> None:  # type: ignore[no-untyped-def]
    from hetrain.parallel.runs import reference_run

    run, results = trained["gpt"]
    assert len({p.stages[0].signatures for p in run.plans}) == 4
    _assert_same_losses(results, reference_run(run))


@pytest.mark.dist
def test_vgg_trains_like_one_process_under_dp_tp_and_mixed(trained) -> None:  # type: ignore[no-untyped-def]
    from hetrain.parallel.runs import reference_run

    run, results = trained["vgg"]
    _assert_same_losses(results, reference_run(run))


def test_templates_are_the_plans_they_claim() -> None:
    g = gpt_graph(1, 32, 4, 32, 16, 8)
    tp = template_plan(g, M4, "tp")
    assert [tp.signature(f"blocks.0.{n}") for n in ("attn.q", "attn.core", "attn.proj", "mlp.fc",
                                                   "mlp.proj")] == ["col", "heads", "row", "col", "row"]
    assert template_plan(g, M22, "dp-tp").signature("blocks.0.mlp.fc") == "dp,col"
    v = template_plan(vgg_graph(8, (3, 16, 16), width=8, fc=32), M22, "dp-mixed")
    assert v.signature("features.0") == "dp,rep"  # DTensor's conv cannot split the batch twice
    assert v.signature("classifier.0") == "dp,col"
    with pytest.raises(ConfigError, match="template"):
        template_plan(g, M4, "dp-tp")


def test_executor_refuses_what_it_cannot_run() -> None:
    from hetrain.parallel.execute import resolve_signatures

    g = gpt_graph(1, 32, 4, 32, 16, 8)
    names = tuple(op.name for op in g.ops)
    two = Plan(g.name, (StagePlan(Mesh((2,), (0, 1)), names[:1], ("dp",)),
                        StagePlan(Mesh((2,), (2, 3)), names[1:], ("dp",) * (len(names) - 1))), 2)
    with pytest.raises(ConfigError, match="pipeline"):
        resolve_signatures(g, two)
    bad = Plan(g.name, (StagePlan(M4, names, ("col",) * len(names)),))
    with pytest.raises(ConfigError, match="not legal"):
        resolve_signatures(g, bad)


@pytest.mark.multiproc
def test_launcher_reports_a_failing_worker() -> None:
    from hetrain.parallel.launch import run_local

    with pytest.raises(RuntimeError, match="rank"):
        run_local(math.sqrt, 2, timeout_s=60)  # sqrt(rank, world) raises TypeError in the worker


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=160), buf


def test_plan_command_prints_the_plan_and_the_baseline(tmp_path) -> None:  # type: ignore[no-untyped-def]
    con, buf = _console()
    out = tmp_path / "plan.toml"
    assert plan_command("hetero-8", "gpt", batch=16, console=con, out=str(out)) == 0
    text = buf.getvalue()
    for needle in ("blocks.0.attn.q", "data parallel", "chosen", "predicted gain", "memory"):
        assert needle in text
    g = gpt_graph(2, 64, 2, 96, 64, 16)
    assert Plan.load(out).stages[-1].ops[-1] == g.ops[-1].name
    con, buf = _console()
    plan_command("geo-16", "vgg", model_options=["width=8"], as_json=True, console=con)
    data = json.loads(buf.getvalue())
    assert data["gain_over_data_parallel"] >= 1 and data["predicted"]["feasible"]
    assert {"plan", "data_parallel", "ops", "candidates"} <= set(data)


def test_plan_arguments_and_errors() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    args = parser.parse_args(["--cluster", "homo-4", "--model", "mlp", "--batch", "8", "--json",
                              "--no-pipeline", "--model-option", "input_shape=1,40"])
    assert plan_from_args(args) == 0
    with pytest.raises(ConfigError, match="unknown model"):
        plan_command("homo-4", "transformerXL")
    with pytest.raises(ConfigError, match="unknown model option"):
        plan_command("homo-4", "gpt", model_options=["depth=3"])
    with pytest.raises(ConfigError, match="key=value"):
        plan_command("homo-4", "gpt", model_options=["n_layer"])
    with pytest.raises(ConfigError, match="preset"):
        plan_command("nowhere-9", "gpt")
