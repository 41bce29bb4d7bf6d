"""Train one model under several plans on real processes, and single-process for reference.

Plans of one stage run with DTensor (execute.PlanExecutor, the mesh must span every rank),
pipeline plans with torch.distributed.pipelining (pipeline.PipelineExecutor, which leaves
ranks it does not need idle), so one group of processes can run both.

`PlanRun` is plain picklable data (a model factory, the layer graph, plans, batches), so the
same object drives the gloo workers (`run_plans`) and the reference (`reference_run`): both
start from `torch.manual_seed(seed)` and see the same global batches, so their losses agree
up to float reduction order. Per step we also time the iteration (after a barrier), which
the predicted-vs-measured benchmark compares with the cost model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hetrain.parallel.execute import make_executor
from hetrain.parallel.launch import run_local
from hetrain.plan.cost import Plan
from hetrain.plan.graph import LayerGraph


@dataclass(frozen=True)
class PlanRun:
    build_model: Callable[[], nn.Module]
    """Deterministic under torch.manual_seed (module-level function or partial: picklable)."""
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    graph: LayerGraph
    plans: tuple[Plan, ...]
    batches: tuple[tuple[Tensor, Tensor], ...]
    """The global (input, target) batch of every step."""
    lr: float = 0.05
    optimizer: str = "sgd"
    """"sgd" or "adamw"."""
    seed: int = 0
    schedule: str | tuple[str, ...] = "gpipe"
    """Pipeline schedule ("gpipe" or "1f1b") of every pipeline plan, or one per plan."""


@dataclass(frozen=True)
class PlanResult:
    losses: tuple[float, ...]
    step_times_s: tuple[float, ...]


def _optimizer(run: PlanRun, params: list[nn.Parameter]) -> torch.optim.Optimizer | None:
    if not params:  # a rank that a pipeline leaves idle
        return None
    if run.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=run.lr, foreach=False)
    return torch.optim.SGD(params, lr=run.lr, foreach=False)


def reference_run(run: PlanRun) -> PlanResult:
    """Single-process training on the same batches."""
    torch.manual_seed(run.seed)
    model = run.build_model()
    opt = _optimizer(run, list(model.parameters()))
    assert opt is not None
    losses, times = [], []
    for x, y in run.batches:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = run.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    return PlanResult(tuple(losses), tuple(times))


def plans_worker(rank: int, world: int, run: PlanRun) -> list[PlanResult]:
    """Every plan of `run` on this rank (call on all ranks of an initialised group)."""
    out = []
    for k, plan in enumerate(run.plans):
        torch.manual_seed(run.seed)
        model = run.build_model()
        schedule = run.schedule if isinstance(run.schedule, str) else run.schedule[k]
        ex = make_executor(model, run.graph, plan, run.loss_fn, schedule=schedule)
        opt = _optimizer(run, ex.parameters())
        losses, times = [], []
        for x, y in run.batches:
            dist.barrier()
            t0 = time.perf_counter()
            losses.append(ex.step(x, y, opt))
            dist.barrier()
            times.append(time.perf_counter() - t0)
        out.append(PlanResult(tuple(losses), tuple(times)))
    return out


def run_plans(run: PlanRun, world_size: int, timeout_s: float = 120.0) -> list[PlanResult]:
    """Rank 0's results per plan (losses are identical on all ranks)."""
    return run_local(plans_worker, world_size, (run,), timeout_s)[0]
