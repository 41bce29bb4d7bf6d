"""Pipeline plans run with torch.distributed.pipelining train exactly like one process (GPipe
and 1F1B, uneven splits, DTensor stages); plans the executor cannot run say why."""

from __future__ import annotations

import functools
from dataclasses import dataclass

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


def _two_by_two(cut: int, templates: tuple[str, str], n_micro: int) -> Plan:
    """2 stages of 2 devices, each stage's ops under a template ("dp", "tp", "mixed")."""
    meshes = (Mesh((2,), (0, 1)), Mesh((2,), (2, 3)))
    stages = tuple(template_plan(GRAPH.subgraph(a, b), mesh, t).stages[0]
                   for (a, b), mesh, t in zip(((0, cut), (cut, N)), meshes, templates, strict=True))
    return Plan(GRAPH.name, tuple(StagePlan(st.mesh, st.ops, st.signatures) for st in stages),
                n_micro)


def _speed_split() -> Plan:
    return speed_split(GRAPH, cluster_of((1e9, 4e9, 2e9, 1e9)), (0, 1, 2, 3), n_micro=4)


ONE_DEVICE_STAGES = ((_one_device_stages([0, 8, N], 2), "gpipe"),            # 8 | 20 ops
                     (_one_device_stages([0, 20, N], 4), "1f1b"),            # 20 | 8
                     (_one_device_stages([0, 1, 8, 13, N], 4), "gpipe"),     # 1 | 7 | 5 | 15
                     (_one_device_stages([0, 13, 20, 25, N], 8), "1f1b"),    # 13 | 7 | 5 | 3
                     (_speed_split(), "1f1b"))
"""2- and 4-stage uneven pipelines of one device per stage, and a speed-proportional split."""
DTENSOR_STAGES = ((_two_by_two(8, ("dp", "tp"), 2), "gpipe"),
                  (_two_by_two(20, ("tp", "mixed"), 2), "1f1b"))
"""2 stages of 2 devices, each with its own SBP plan."""
REVERSED_STAGES = Plan(GRAPH.name, tuple(
    StagePlan(mesh, st.ops, st.signatures) for mesh, st in
    zip((Mesh((2,), (2, 3)), Mesh((2,), (0, 1))), _two_by_two(8, ("dp", "tp"), 2).stages,
        strict=True)), 2)
PLACED = ((REVERSED_STAGES, "gpipe"),
          (pipeline_plan(GRAPH, [0, 20, N], [Mesh((1,), (3,)), Mesh((1,), (1,))], 2), "1f1b"),
          (template_plan(GRAPH, Mesh((2,), (1, 3)), "tp"), "gpipe"))
"""Plans on the devices the planner named: a stage on devices 2 and 3 (say, the small-memory
ones), a pipeline on devices 3 and 1, one stage on the subset 1 and 3."""


def _column_shares(cut: int, shares: tuple[int, int], n_micro: int,
                   devices: tuple[tuple[int, int], tuple[int, int]] = ((0, 1), (2, 3))) -> Plan:
    """2 data-parallel stages of 2 devices whose columns (device j of each stage) take
    `shares` of every batch."""
    return Plan(GRAPH.name, tuple(
        StagePlan(Mesh((2,), devs), tuple(op.name for op in GRAPH.ops[a:b]), ("dp",) * (b - a),
                  shares) for devs, (a, b) in zip(devices, ((0, cut), (cut, N)), strict=True)),
        n_micro)


COLUMN_SHARES = ((_column_shares(8, (6, 2), 2), "gpipe"),
                 (_column_shares(20, (2, 6), 2), "1f1b"),
                 (_column_shares(13, (6, 2), 2, ((3, 0), (1, 2))), "1f1b"))
"""Pipelines whose columns take uneven shares of the batch (the last on devices 3 -> 1 and
0 -> 2)."""
GROUPS = {"one_device": ONE_DEVICE_STAGES, "dtensor": DTENSOR_STAGES, "placed": PLACED,
          "shares": COLUMN_SHARES}


def _holders(plan: Plan) -> int:
    """The number of parameters this rank holds after one step under `plan`."""
    from hetrain.parallel.execute import make_executor

    torch.manual_seed(0)
    ex = make_executor(build_gpt(), GRAPH, plan, cross_entropy)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
    ex.step(x, y, torch.optim.SGD(ex.parameters(), lr=0.1) if ex.parameters() else None)
    return sum(p.numel() for p in ex.parameters())


def _hold_then_train(rank: int, world: int, run) -> tuple[list[int], list, list]:  # type: ignore[no-untyped-def]
    from hetrain.parallel.runs import plans_worker

    return ([_holders(p) for p in run.plans], plans_worker(rank, world, run), _padded(rank),
            _padded_tensor_parallel(), _padded_columns(rank))


SLOW_S = 0.2
"""Emulated seconds per sample of the whole model's forward + backward on the slow devices."""
PADDED = ((_one_device_stages([0, 8, N], 4), "gpipe", (1,)),
          (_two_by_two(8, ("dp", "tp"), 2), "1f1b", (2, 3)))
"""Pipelines whose last stage runs on slow emulated devices (the others unthrottled)."""


def _padded(rank: int) -> list[tuple[float, float, float, float, float]]:
    """Per PADDED plan: (loss padded, loss unpadded, rank 0's second step time padded and
    unpadded, the last stage's emulated time for its micro-batches in one step)."""
    import time

    import torch.distributed as dist

    from hetrain.parallel.execute import make_executor

    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
    out = []
    for plan, schedule, slow in PADDED:
        losses, took, emulated = [], [], torch.zeros(1)
        for budget in (None, (lambda n: SLOW_S * n) if rank in slow else None):
            torch.manual_seed(0)
            ex = make_executor(build_gpt(), GRAPH, plan, cross_entropy, schedule=schedule,
                               compute_budget=budget)
            opt = torch.optim.SGD(ex.parameters(), lr=0.1) if ex.parameters() else None
            losses.append(ex.step(x, y, opt))  # the first step also pays set-up costs
            dist.barrier()
            t0 = time.perf_counter()
            ex.step(x, y, opt)
            took.append(time.perf_counter() - t0)
            pad = ex.module.pad if ex.module is not None else None
            if pad is not None:
                emulated[0] = plan.n_micro * (B // plan.n_micro) * pad.per_sample_s
        dist.all_reduce(emulated, op=dist.ReduceOp.MAX)
        out.append((losses[1], losses[0], took[1], took[0], float(emulated)))
    return out


def _padded_tensor_parallel() -> tuple[float, float]:
    """A one-stage tensor-parallel plan on 4 slow emulated devices: rank 0's second step
    time, and the emulated time of its part of the batch's work."""
    import time

    import torch.distributed as dist

    from hetrain.parallel.execute import make_executor, resolve_signatures
    from hetrain.plan.cost import device_work_fraction

    plan = template_plan(GRAPH, Mesh((4,), (0, 1, 2, 3)), "tp")
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
    torch.manual_seed(0)
    ex = make_executor(build_gpt(), GRAPH, plan, cross_entropy,
                       compute_budget=lambda n: SLOW_S * n)
    opt = torch.optim.SGD(ex.parameters(), lr=0.1)
    ex.step(x, y, opt)
    dist.barrier()
    t0 = time.perf_counter()
    ex.step(x, y, opt)
    work = device_work_fraction(GRAPH, (4,), resolve_signatures(GRAPH, plan))
    return time.perf_counter() - t0, SLOW_S * B * work


def _padded_columns(rank: int) -> tuple[float, float]:
    """Rank 0's second step time under column shares (6, 2) and (2, 6) when column 1 (ranks
    1 and 3) runs on slow emulated devices and column 0 is unthrottled."""
    import time

    import torch.distributed as dist

    from hetrain.parallel.execute import make_executor

    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
    took = []
    for shares in ((6, 2), (2, 6)):
        torch.manual_seed(0)
        ex = make_executor(build_gpt(), GRAPH, _column_shares(13, shares, 2), cross_entropy,
                           compute_budget=(lambda n: SLOW_S * n) if rank in (1, 3) else None)
        opt = torch.optim.SGD(ex.parameters(), lr=0.1)
        ex.step(x, y, opt)
        dist.barrier()
        t0 = time.perf_counter()
        ex.step(x, y, opt)
        took.append(time.perf_counter() - t0)
    return took[0], took[1]


@dataclass(frozen=True)
class Trained:
    ref: tuple[float, ...]
    """One process's losses over the three steps."""
    losses: dict[str, list[tuple[float, ...]]]
    """Rank 0's losses per plan of each group."""
    held: dict[str, list[list[int]]]
    """Parameters each rank holds, per plan of each group: held[group][plan][rank]."""
    padded: list[tuple[float, float, float, float, float]]
    """Rank 0's _padded results."""
    tensor_parallel_padded: tuple[float, float]
    """Rank 0's _padded_tensor_parallel result."""
    columns_padded: tuple[float, float]
    """Rank 0's _padded_columns result."""


@pytest.fixture(scope="module")
def trained() -> Trained:
    """Every plan of this module trained on one group of 4 gloo processes (ranks a plan does
    not need sit it out): starting 4 processes costs more than training all 10 plans."""
    from hetrain.parallel.launch import run_local
    from hetrain.parallel.runs import PlanRun, reference_run

    plans = [p for group in GROUPS.values() for p in group]
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
    run = PlanRun(build_gpt, cross_entropy, GRAPH, tuple(p for p, _ in plans), (batch,) * 3,
                  lr=0.5, schedule=tuple(s for _, s in plans))
    per_rank = run_local(_hold_then_train, 4, (run,), timeout_s=240)
    losses, held, k = {}, {}, 0
    for name, group in GROUPS.items():
        losses[name] = [per_rank[0][1][k + i].losses for i in range(len(group))]
        held[name] = [[per_rank[r][0][k + i] for r in range(4)] for i in range(len(group))]
        k += len(group)
    return Trained(reference_run(run).losses, losses, held, per_rank[0][2], per_rank[0][3],
                   per_rank[0][4])


def _trains_like_one_process(trained: Trained, group: str) -> None:
    ref = trained.ref
    assert ref[2] < ref[1] - 1e-3 < ref[0] - 2e-3  # the SGD steps count
    for (plan, _), losses in zip(GROUPS[group], trained.losses[group], strict=True):
        assert losses == pytest.approx(ref, rel=1e-4), [len(s.ops) for s in plan.stages]


@pytest.mark.dist
def test_gpt_pipelines_train_like_one_process(trained: Trained) -> None:
    """2- and 4-stage uneven pipelines of one device per stage under GPipe and 1F1B, and a
    speed-proportional split, on 4 gloo processes."""
    sizes = [len(s.ops) for s in _speed_split().stages]
    assert len(set(sizes)) > 1 and sizes.index(max(sizes)) == 1  # the fast device: most ops
    _trains_like_one_process(trained, "one_device")


@pytest.mark.dist
def test_gpt_pipelines_of_dtensor_stages_train_like_one_process(trained: Trained) -> None:
    """Stages on 2 devices each run their own SBP plan with DTensor: data parallel, Megatron
    tensor parallel (vocab-parallel loss on the last stage), mixed."""
    plans = [p for p, _ in DTENSOR_STAGES]
    assert plans[0].signature("loss") == "vocab" and plans[1].signature("blocks.0.mlp.fc") == "col"
    _trains_like_one_process(trained, "dtensor")


@pytest.mark.dist
def test_stages_run_on_the_devices_the_plan_names(trained: Trained) -> None:
    """Rank r is cluster device r: a stage the planner put on devices 2 and 3 (say, the
    small-memory ones) runs there, not on the first ranks; a one-stage plan on a subset of
    the devices runs on that subset while the others idle; both train like one process."""
    held = trained.held["placed"]
    assert [h > 0 for h in held[0]] == [True] * 4 and held[0][2] == held[0][3] != held[0][0]
    assert [h > 0 for h in held[1]] == [False, True, False, True] and held[1][3] > held[1][1]
    assert [h > 0 for h in held[2]] == [False, True, False, True]
    _trains_like_one_process(trained, "placed")


@pytest.mark.dist
def test_gpt_pipelines_with_column_shares_train_like_one_process(trained: Trained) -> None:
    """Column j (device j of every stage) runs its own pipeline on its share of the batch,
    its loss weighted by the share, and each stage sums its devices' gradients: the same
    losses as one process, under GPipe and 1F1B, on any devices the plan names; each device
    holds its stage's parameters whole."""
    held = trained.held["shares"]
    assert held[0][0] == held[0][1] > 0 and held[0][2] == held[0][3] > 0
    assert held[2][3] == held[2][0] != held[2][1] == held[2][2]
    _trains_like_one_process(trained, "shares")


@pytest.mark.dist
def test_a_slow_column_given_the_smaller_share_paces_the_step_less(trained: Trained) -> None:
    """Column 1's devices are emulated slow (0.2 s per sample of the whole model): giving
    them 2 of the 8 samples instead of 6 shortens the step by about the 4 samples' emulated
    time (0.8 s), which even shares could not."""
    small, large = trained.columns_padded
    assert large - small > 0.5 * 4 * SLOW_S, (small, large)


# ---- refusals ----------------------------------------------------------------------------------
@pytest.mark.dist
def test_a_slow_stage_emulated_by_its_compute_budget_paces_the_pipeline(trained: Trained) -> None:
    """dist.emulate's padding on a pipeline: the last stage's devices pad each micro-batch's
    forward and backward to their share of the model's emulated time, so a step lasts at
    least that stage's emulated time for all its micro-batches (GPipe over one device, 1F1B
    over a 2-device DTensor stage); the losses do not change. Without the backward's part
    (the hook on the stage output) a step would last about a third of it."""
    for loss, plain, took, unpadded, emulated in trained.padded:
        assert loss == plain
        assert emulated > 0.4
        assert took >= 0.9 * emulated and took - unpadded >= 0.6 * emulated, (took, emulated)


@pytest.mark.dist
def test_a_tensor_parallel_step_is_padded_to_its_devices_part_of_the_work(
        trained: Trained) -> None:
    """Under tensor parallelism on 4 devices each device computes about a quarter of the
    batch's FLOPs (the unsplit ops whole), and the emulation pads it to that, as the cost
    model prices it; it used to pad every device to the whole batch's time (4x too slow)."""
    took, emulated = trained.tensor_parallel_padded
    whole = SLOW_S * B
    assert 0.25 * whole < emulated < 0.3 * whole
    assert emulated <= took < 0.6 * whole, (took, emulated)


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
