"""Execute a pipeline Plan with torch.distributed.pipelining (GPipe or 1F1B) on gloo processes.

A plan's stages are contiguous op ranges (cost.stage_graphs). The model is cut the manual
way torchtitan does it: a model's forward is written as a chain of `Piece`s (a GPT's
embedding, the attention half and the MLP half of each block, the final norm, the head; each
module of a Sequential or of a ConvNet's features and classifier), a stage runs the pieces
that start inside its op range, and every module outside the stage is dropped from the
model (in place: every rank builds its own), so parameter names stay those of the whole
model. A boundary must fall where a piece starts (a free reshape op before it may sit on
either side): the graph marks those ops (Op.stage_start, LayerGraph.stage_starts), and the
planner cuts only there too.

Ranks: the plan's device ids are ranks (rank r runs cluster device r, as `hetrain run` and
torchrun place them), so a stage runs on the devices the planner sized it for (a slower or
smaller device holds fewer layers); ranks no stage names idle. A one-device stage runs plainly. A
stage on several devices runs its own SBP plan with DTensor (execute.PlanExecutor on the
stage's sub-graph and a DeviceMesh of its ranks: data, tensor or mixed parallel, whatever the
plan says); its boundary activations are plain full tensors, so device j of stage s sends to
device j of stage s+1 (one P2P group per j, d copies of each activation where the cost model
prices one) and no DTensor crosses a boundary; the last stage keeps its output a DTensor for
the loss op's signature (vocab-parallel cross-entropy). The schedule averages gradients over
micro-batches (scale_grads), matching the mean loss of one whole batch when every micro-batch
has the same size.

Batch shares (StagePlan.shares, the same on every stage, every op "dp"): column j, device j
of every stage, is a pipeline of its own over shares[j] samples of each batch (its n_micro
micro-batches of shares[j] / n_micro), each device running its stage's modules plainly on
them, so a column of faster devices takes more of the batch; each column's loss is weighted
by shares[j] / batch and every stage sums its devices' gradients (uneven.sum_replica_grads),
which gives the whole batch's mean-loss gradient on every replica, as the uneven one-stage
executor does.

Speed emulation (`compute_budget`, as the one-stage executors take it: this rank's device's
forward + backward time for n samples of the whole model): a rank pads its stage's work per
micro-batch to its device's share: the stage's fraction of the model's training FLOPs, of
which the device computes what the stage's signatures give it (cost.device_work_fraction: half
on a 2-device data-parallel stage, all of it on a replicated one), so a pipeline on one machine
paces like the cluster file's devices and the cost model's prices (StagePadding).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import DTensor, Replicate

from hetrain.engine.emulate import sleep_until
from hetrain.errors import ConfigError
from hetrain.parallel.execute import ComputeBudget, PlanExecutor
from hetrain.parallel.uneven import sum_replica_grads
from hetrain.plan.cost import Plan, require_shares, stage_graphs, training_flops_per_sample
from hetrain.plan.graph import LayerGraph

if TYPE_CHECKING:
    from hetrain.workloads.gpt import GPT
    from hetrain.workloads.models import ConvNet

SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


@dataclass(frozen=True)
class Piece:
    """A run of the model's forward that no stage boundary cuts."""

    start: str
    """The graph op where the piece begins (it runs up to the next piece's start)."""
    modules: tuple[str, ...]
    """Module paths it calls: its stage keeps them."""
    run: Callable[[Any, Tensor], Tensor]
    """(the stage's copy of the model, of the class model_pieces split, input) -> output."""


# ---- pieces of the models the planner has graphs for -----------------------------------------
def _gpt_embed(m: GPT, idx: Tensor) -> Tensor:
    t = idx.shape[1]
    if t > m.block_size:
        raise ValueError(f"gpt: sequence length {t} exceeds block_size {m.block_size}")
    return m.drop(m.tok_emb(idx) + m.pos_emb(torch.arange(t, device=idx.device)))


def _gpt_attn(i: int, m: GPT, x: Tensor) -> Tensor:
    b = m.block(i)
    return x + b.attn(b.ln1(x))


def _gpt_mlp(i: int, m: GPT, x: Tensor) -> Tensor:
    b = m.block(i)
    return x + b.mlp(b.ln2(x))


def _child(path: str, m: nn.Module, x: Tensor) -> Tensor:
    return m.get_submodule(path)(x)


def _conv_in(path: str, m: ConvNet, x: Tensor) -> Tensor:
    return m.get_submodule(path)(x.reshape(x.shape[0], *m.in_shape))


def _flat_in(path: str, m: nn.Module, x: Tensor) -> Tensor:
    return m.get_submodule(path)(x.flatten(1))


def _chain(prefix: str, seq: nn.Module, first: Callable[..., Tensor]) -> list[Piece]:
    """One piece per child of a Sequential (or the module itself); `first` runs the first."""
    names = [f"{prefix}.{n}" for n, _ in seq.named_children()] if isinstance(seq, nn.Sequential) \
        else [prefix]
    return [Piece(p, (p,), functools.partial(first if k == 0 else _child, p))
            for k, p in enumerate(names)]


def model_pieces(model: nn.Module) -> list[Piece]:
    """The forward of a hetrain GPT, ConvNet (vgg, cnn) or Sequential (mlp) as pieces, named
    like the ops of plan.graph's gpt_graph / vgg_graph / graph_from_module."""
    from hetrain.workloads.gpt import GPT
    from hetrain.workloads.models import ConvNet

    if isinstance(model, GPT):
        out = [Piece("tok_emb", ("tok_emb", "pos_emb", "drop"), _gpt_embed)]
        for i in range(len(model.blocks)):
            p = f"blocks.{i}"
            out += [Piece(f"{p}.ln1", (f"{p}.ln1", f"{p}.attn"), functools.partial(_gpt_attn, i)),
                    Piece(f"{p}.ln2", (f"{p}.ln2", f"{p}.mlp"), functools.partial(_gpt_mlp, i))]
        return [*out, Piece("ln_f", ("ln_f",), functools.partial(_child, "ln_f")),
                Piece("head", ("head",), functools.partial(_child, "head"))]
    if isinstance(model, ConvNet):
        return [*_chain("features", model.features, _conv_in),
                *_chain("classifier", model.classifier, _flat_in)]
    if isinstance(model, nn.Sequential):
        return [Piece(n, (n,), functools.partial(_child, n)) for n, _ in model.named_children()]
    raise ConfigError(f"pipeline: cannot split a {type(model).__name__} into stages; the "
                      "executor knows GPT, ConvNet (vgg, cnn) and nn.Sequential (mlp)")


# ---- the layout of a plan on a model ---------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    stages: tuple[tuple[Piece, ...], ...]
    """The pieces of every stage."""
    replicas: int
    """Devices per stage."""


def pipeline_layout(model: nn.Module, graph: LayerGraph, plan: Plan) -> Layout:
    """Map the plan's stages onto the model's pieces; every plan this executor cannot run
    raises one ConfigError line saying why (no processes needed)."""
    d = _replicas(plan)
    if plan.n_micro < 1 or graph.batch % plan.n_micro:
        raise ConfigError(f"batch {graph.batch} is not divisible by n_micro ({plan.n_micro})")
    if plan.stages[0].shares:
        require_shares(plan, graph.batch)
    stages = _stage_pieces(model_pieces(model), graph, plan)
    _check_untied(model, stages)
    return Layout(stages, d)


def _replicas(plan: Plan) -> int:
    """Devices per stage, when every stage has as many (device j of a stage feeds device j
    of the next)."""
    if len(plan.stages) < 2:
        raise ConfigError("the pipeline executor runs plans of 2 or more stages")
    sizes = [len(st.mesh.devices) for st in plan.stages]
    if len(set(sizes)) > 1:
        raise ConfigError(f"pipeline stages span {sizes} devices; the executor needs the same "
                          "number of devices in every stage")
    return sizes[0]


def _stage_pieces(pieces: list[Piece], graph: LayerGraph,
                  plan: Plan) -> tuple[tuple[Piece, ...], ...]:
    """The pieces of each stage. The graph says where a stage may start (LayerGraph.
    stage_starts: its ops marked `stage_start`, or free reshapes just before one), the same
    boundaries the planner cuts at; the model's pieces must start exactly at the marked ops."""
    index = {op.name: i for i, op in enumerate(graph.ops)}
    missing = [p.start for p in pieces if p.start not in index]
    if missing:
        raise ConfigError(f"the model does not match graph '{graph.name}': the graph has no "
                          f"op '{missing[0]}' (a module of the model)")
    at = {index[p.start]: p for p in pieces}
    if sorted(at) != [index[p.start] for p in pieces] or 0 not in at:
        raise ConfigError(f"the model does not match graph '{graph.name}': its modules are not "
                          "in graph order from the first op")
    marked = {op.name for op in graph.ops if op.stage_start}
    odd = sorted(marked ^ {p.start for p in pieces}, key=lambda n: index.get(n, -1))
    if odd:
        raise ConfigError(f"the model does not match graph '{graph.name}': op '{odd[0]}' is "
                          f"{'not ' if odd[0] in marked else ''}a piece of the model but the graph "
                          f"{'marks' if odd[0] in marked else 'does not mark'} it as a stage start")
    allowed = graph.stage_starts()
    starts = [0]
    for s, (a, _) in enumerate(stage_graphs(graph, plan)[1:], 1):
        if a not in allowed:
            names = [graph.ops[i].name for i in allowed]
            where = (f"inside the piece that starts at '{at[max(i for i in at if i < a)].start}'"
                     if a not in at else "where more than one tensor crosses")
            raise ConfigError(f"stage {s} starts at op '{graph.ops[a].name}', {where}; stages "
                              f"may start at: {', '.join(names[:8])}"
                              f"{', ...' if len(names) > 8 else ''}")
        starts.append(min(i for i in at if i >= a))  # past free reshapes to the piece
    starts.append(len(graph.ops))
    stages = tuple(tuple(at[i] for i in sorted(at) if a <= i < b)
                   for a, b in itertools.pairwise(starts))
    for s, ps in enumerate(stages):
        if not ps:
            raise ConfigError(f"stage {s} holds no module of the model (only ops "
                              f"{list(plan.stages[s].ops)})")
    return stages


def _check_untied(model: nn.Module, stages: tuple[tuple[Piece, ...], ...]) -> None:
    """A parameter two stages use (tied embedding and head) would need its own sync."""
    stage_of: dict[int, int] = {}
    for s, ps in enumerate(stages):
        for path in (m for p in ps for m in p.modules):
            for name, prm in model.get_submodule(path).named_parameters():
                if stage_of.setdefault(id(prm), s) != s:
                    raise ConfigError(f"parameter '{path}.{name}' is used by stages "
                                      f"{stage_of[id(prm)]} and {s} (tied weights); the "
                                      "executor cannot split it")


def _keep_only(module: nn.Module, keep: set[str], prefix: str = "") -> None:
    """Drop (set to None) every submodule that is neither in `keep` nor above one of them."""
    for name, child in list(module.named_children()):
        path = prefix + name
        if path in keep:
            continue
        if any(k.startswith(path + ".") for k in keep):
            _keep_only(child, keep, path + ".")
        else:
            setattr(module, name, None)


class StagePadding:
    """Pads this rank's part of a stage, per micro-batch, to its emulated device's time:
    `fraction` x the budget's per-sample time x the micro-batch's samples (the device's step
    overhead, budget(0), once per step, on the step's first forward). A third pads the
    forward; the other two thirds are slept when the stage's backward starts (a hook on its
    output), less twice the real forward (a backward costs about two forwards, as the cost
    model counts it), so the schedule's stages wait for each other as the devices would.
    Counts overruns: micro-batches whose real forward took longer than its third."""

    def __init__(self, budget: ComputeBudget, fraction: float):
        self.overhead_s = budget(0)
        self.per_sample_s = (budget(1) - self.overhead_s) * fraction
        self.first, self.overruns = True, 0

    def start_step(self) -> None:
        self.first = True

    def __call__(self, start: float, samples: float, out: Tensor) -> None:
        total = samples * self.per_sample_s + (self.overhead_s if self.first else 0.0)
        self.first = False
        forward = time.perf_counter() - start
        if sleep_until(start + total / 3) == 0.0:
            self.overruns += 1
        backward = 2 * total / 3 - 2 * forward
        if backward > 0 and out.requires_grad:
            out.register_hook(functools.partial(_sleep_then, backward))


def _weighted(loss_fn: Callable[[Tensor, Tensor], Tensor], weight: float, out: Tensor,
              y: Tensor) -> Tensor:
    return loss_fn(out, y) * weight


def _sleep_then(seconds: float, grad: Tensor) -> Tensor:
    time.sleep(seconds)
    return grad


class StageModule(nn.Module):
    """One stage: the model with only its modules left, run piece by piece. With a `mesh`
    (a DTensor stage) its input becomes a replicated DTensor and, unless `keep_dtensor` (the
    last stage, whose loss is computed by the stage's plan), its output a plain full tensor.
    With `pad`, each forward (and its backward) is padded to the emulated device's time."""

    def __init__(self, model: nn.Module, pieces: tuple[Piece, ...],
                 mesh: DeviceMesh | None = None, keep_dtensor: bool = False,
                 pad: StagePadding | None = None):
        super().__init__()
        _keep_only(model, {m for p in pieces for m in p.modules})
        self.model, self.pieces, self.mesh, self.keep_dtensor = model, pieces, mesh, keep_dtensor
        self.pad = pad

    def forward(self, x: Tensor) -> Tensor:
        start = time.perf_counter()
        samples = x.shape[0]
        if self.mesh is not None:
            x = DTensor.from_local(x, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        for p in self.pieces:
            x = p.run(self.model, x)
        out = x.full_tensor() if isinstance(x, DTensor) and not self.keep_dtensor else x
        if self.pad is not None:
            self.pad(start, samples, out)
        return out


def stage_ranks(plan: Plan, world: int) -> list[list[int]]:
    """The ranks of every stage, device j of a stage first: the plan's device ids."""
    ranks = [list(st.mesh.devices) for st in plan.stages]
    flat = [r for rs in ranks for r in rs]
    if len(set(flat)) < len(flat):
        raise ConfigError(f"pipeline stages share devices {sorted(flat)}; each device runs one "
                          "stage")
    if max(flat) >= world:
        raise ConfigError(f"the plan names device {max(flat)}, the group has {world} processes "
                          f"(devices 0..{world - 1}); run it on a cluster of the plan's devices")
    return ranks


# ---- execution --------------------------------------------------------------------------------
def _p2p_group(ranks: list[int], timeout: timedelta | None) -> dist.ProcessGroup:
    """A P2P group whose receives give up after `timeout`. Its creation waits for the members
    with that timeout too, so the ranks first meet in a barrier of the default group (which
    waits as long as its own timeout)."""
    if timeout is not None:
        dist.barrier()
    return dist.new_group(ranks, timeout=timeout)


class PipelineExecutor:
    """A pipeline plan on this process group: build it on every rank (the same seed, the
    model pruned in place to this rank's stage) and call `step(x, y, optimizer)` with the same
    global batch everywhere; it returns the global mean loss on every rank."""

    def __init__(self, model: nn.Module, graph: LayerGraph, plan: Plan,
                 loss_fn: Callable[[Tensor, Tensor], Tensor], schedule: str = "gpipe",
                 timeout_s: float | None = None, compute_budget: ComputeBudget | None = None):
        """`timeout_s`: how long a P2P receive waits for its peer (gloo's P2P waits use the
        timeout their group was created with, gloo's 30 min by default). `compute_budget`:
        this rank's emulated device (the whole model's forward + backward of n samples; the
        stage pads to its share, StagePadding)."""
        if schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule '{schedule}'; one of {sorted(SCHEDULES)}")
        layout = pipeline_layout(model, graph, plan)
        k, d, m = len(layout.stages), layout.replicas, plan.n_micro
        if schedule == "1f1b" and m < k:
            raise ConfigError(f"1F1B needs at least as many micro-batches as stages ({m} < {k})")
        world, rank = dist.get_world_size(), dist.get_rank()
        ranks = stage_ranks(plan, world)
        self.n_micro, self.last_rank = m, ranks[-1][0]
        self.shares = plan.stages[0].shares  # checked by pipeline_layout
        # every rank creates every group and mesh, in the same order (new_group's contract)
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        p2p = [_p2p_group(sorted(r[j] for r in ranks), timeout) for j in range(d)]
        meshes = [DeviceMesh("cpu", torch.tensor(r).view(st.mesh.shape))
                  if d > 1 and not self.shares else None
                  for r, st in zip(ranks, plan.stages, strict=True)]
        # with shares a stage's devices are replicas that sum their gradients (and the last
        # stage its columns' losses) over the stage's group
        sums = [dist.new_group(r, timeout=timeout) if self.shares and d > 1 else None
                for r in ranks]
        self.module: StageModule | None = None
        self.spmd: PlanExecutor | None = None
        where = {r: (s, j) for s, rs in enumerate(ranks) for j, r in enumerate(rs)}
        if rank not in where:
            return
        s, j = where[rank]
        self.first, self.last = s == 0, s == k - 1
        self.sum_group = sums[s]
        mesh = meshes[s]
        a, b = stage_graphs(graph, plan)[s]
        self.module = StageModule(model, layout.stages[s], mesh, keep_dtensor=self.last)
        sub = graph.subgraph(a, b)
        if mesh is not None:
            self.spmd = PlanExecutor(self.module.model, sub, Plan(plan.graph, (plan.stages[s],)),
                                     mesh, loss_fn)
        if compute_budget is not None:  # this rank's share of the model's work in its stage
            share = training_flops_per_sample(sub) / training_flops_per_sample(graph)
            # one device, or a column's device (its samples whole): all of its stage's work
            work = self.spmd.work if self.spmd is not None else 1.0
            self.module.pad = StagePadding(compute_budget, share * work)
        self.rows = slice(0, graph.batch)
        if self.shares:  # column j's samples of every batch, its loss weighted by its share
            self.rows = slice(sum(self.shares[:j]), sum(self.shares[:j + 1]))
            weight = self.shares[j] / graph.batch
            loss_fn = functools.partial(_weighted, loss_fn, weight)
        stage = PipelineStage(self.module, s, k, torch.device("cpu"), group=p2p[j])
        # stage t's peer in group j is device j of stage t (the group orders ranks, not stages)
        stage.stage_index_to_group_rank = {t: dist.get_group_rank(p2p[j], r[j])
                                           for t, r in enumerate(ranks)}
        self.schedule = SCHEDULES[schedule](
            stage, n_microbatches=m, scale_grads=True,
            loss_fn=self.spmd.loss if self.spmd is not None else loss_fn)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters()) if self.module is not None else []

    def step(self, x: Tensor, y: Tensor, optimizer: torch.optim.Optimizer | None) -> float:
        if x.shape[0] % self.n_micro:
            raise ConfigError(f"batch {x.shape[0]} is not divisible by n_micro ({self.n_micro})")
        if self.shares and x.shape[0] != sum(self.shares):
            raise ConfigError(f"the plan's shares {list(self.shares)} sum to {sum(self.shares)}, "
                              f"the batch has {x.shape[0]} samples")
        loss = torch.zeros(1)
        if self.module is not None:
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            if self.module.pad is not None:
                self.module.pad.start_step()
            losses: list[Tensor] = []
            x, y = x[self.rows], y[self.rows]
            with self.spmd.loss_context() if self.spmd is not None else contextlib.nullcontext():
                if self.first:
                    self.schedule.step(x, return_outputs=False)
                elif self.last:
                    self.schedule.step(target=y, losses=losses, return_outputs=False)
                else:
                    self.schedule.step(return_outputs=False)
            if self.last:  # equal micro-batches: their mean is the batch's (column's) mean loss
                full = [v.full_tensor() if isinstance(v, DTensor) else v for v in losses]
                loss = torch.stack([v.detach() for v in full]).mean().reshape(1)
            if self.spmd is not None:
                self.spmd.sync_grads()
            if self.sum_group is not None:
                self._sum_over_stage(loss)
            if optimizer is not None:
                optimizer.step()
        dist.broadcast(loss, src=self.last_rank)
        return float(loss)

    def _sum_over_stage(self, loss: Tensor) -> None:
        """Shares: each column's gradients are those of its share-weighted loss; their sum over
        the stage's devices is the gradient of the whole batch's mean loss (and the last
        stage's weighted losses sum to it)."""
        assert self.module is not None
        sum_replica_grads(list(self.module.parameters()), self.sum_group,
                          *([loss] if self.last else []))
