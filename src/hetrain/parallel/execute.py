"""Execute a single-stage SBP plan with DTensor: every parameter and activation a DTensor.

Placements map one to one: Split(d) -> Shard(d), Broadcast -> Replicate(), Partial ->
Partial(). For each op of the plan that is a module of the model (linear, conv, embedding,
layer norm, activation/pool modules) its parameters are distributed with the signature's
weight placement (a bias follows a weight split on the output dim, else it is replicated)
and a forward pre-hook redistributes its input to the signature's input placement: that
`redistribute` is the boxing the cost model charges (its autograd backward the backward
boxing). Functional code between modules (residual adds, GELU, attention) runs on DTensors
with DTensor's own sharding propagation, so it is correct for any plan; its communication
follows DTensor, which can differ from the model's choice for those ops. Data parallelism is
Shard(0) inputs with Replicate weights: their gradients come back Partial and `step`
redistributes them to the weights' placements (the gradient all-reduce) before the update.
Every redistribution the executor makes follows the cost model's cheapest boxing path
(sbp.MeshComm.boxing_path on the given Cluster), one mesh axis per step, so a (P, P) ->
(B, B) gradient on a 2-D mesh runs as reduce-scatter, all-reduce of a quarter, all-gather.

Modules the graph does not name (position embedding, dropout) keep replicated parameters;
their plain-tensor inputs are made replicated DTensors. Pipeline plans run in
parallel.pipeline, plans with uneven batch shares in parallel.uneven; `make_executor` picks
the executor a plan needs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import loss_parallel

from hetrain.cluster import Cluster, homogeneous
from hetrain.engine.emulate import sleep_until
from hetrain.errors import ConfigError
from hetrain.parallel.sdpa import register_cpu_sdpa_sharding
from hetrain.plan.cost import Plan, device_work_fraction
from hetrain.plan.graph import LayerGraph, Op
from hetrain.plan.sbp import (
    B,
    Broadcast,
    MeshComm,
    NdSbp,
    NdSignature,
    P,
    Sbp,
    Split,
    mesh_comm,
    signatures,
)


def to_placements(nd: NdSbp) -> list[Placement]:
    return [Shard(s.dim) if isinstance(s, Split) else Replicate() if isinstance(s, Broadcast)
            else Partial() for s in nd]


def from_placements(placements: Sequence[Placement]) -> NdSbp | None:
    """The SBP of plain DTensor placements (None for others, e.g. a masked partial)."""
    out: list[Sbp] = []
    for p in placements:
        if type(p) is Shard:
            out.append(Split(p.dim))
        elif type(p) is Replicate:
            out.append(B)
        elif type(p) is Partial and p.reduce_op == "sum":
            out.append(P)
        else:
            return None
    return tuple(out)


def box(x: DTensor, placements: Sequence[Placement], comm: MeshComm | None) -> DTensor:
    """Redistribute along the cost model's cheapest boxing path (e.g. the hierarchical
    all-reduce on a 2-D mesh), one mesh axis per step; directly when no path applies."""
    if list(x.placements) == list(placements):
        return x
    src, dst = from_placements(x.placements), from_placements(placements)
    if comm is None or src is None or dst is None or x.ndim == 0:
        return x.redistribute(x.device_mesh, placements)
    for state in comm.boxing_path(src, dst, tuple(x.shape), x.element_size())[1:]:
        x = x.redistribute(x.device_mesh, to_placements(state))
    return x


def _as_dtensor(x: Tensor, mesh: DeviceMesh, placements: Sequence[Placement],
                comm: MeshComm | None = None) -> Tensor:
    if isinstance(x, DTensor):
        return box(x, placements, comm)
    # every rank holds the same global tensor (same seed, same batch): slice locally, no comm
    plain = [Replicate() if isinstance(p, Partial) else p for p in placements]
    return distribute_tensor(x, mesh, plain, src_data_rank=None)


def resolve_signatures(graph: LayerGraph, plan: Plan) -> dict[str, NdSignature]:
    if len(plan.stages) != 1:
        raise ConfigError("the DTensor executor runs single-stage plans; this plan has "
                          f"{len(plan.stages)} pipeline stages (run it with make_executor)")
    st = plan.stages[0]
    out = {}
    for op, name in zip(graph.ops, st.signatures, strict=True):
        legal = {s.name: s for s in signatures(op, st.mesh.shape)}
        if name not in legal:
            raise ConfigError(f"op '{op.name}': signature '{name}' is not legal on mesh "
                              f"{st.mesh.label}; legal: {sorted(legal)}")
        out[op.name] = legal[name]
    return out


def _param_placements(op: Op, sig: NdSignature, pname: str) -> list[Placement]:
    w = sig.weight
    if w is None or op.kind == "layernorm":
        return [Replicate()] * len(sig.axes)
    if pname == "weight":
        return to_placements(w)
    return [Shard(0) if s == Split(0) and op.kind in ("linear", "conv") else Replicate() for s in w]


ComputeBudget = Callable[[float], float]
"""Speed emulation (`hetrain run`'s dist.emulate, benchmarks): seconds the emulated device
takes for the forward and backward of this many samples of the whole model; the executor
sleeps until then before the gradient synchronisation, so a slower device delays its
gradients as it would (hetrain.engine.emulate's budget padding). An executor asks for the
work its device does under the plan (cost.device_work_fraction of the batch: its share of
a data-parallel batch, the whole batch's unsplit ops under tensor parallelism), the work the
cost model prices."""


class Padding:
    """Pads a rank's forward + backward to its compute budget; counts overruns (the real
    compute took longer than the emulated device would)."""

    def __init__(self, budget: ComputeBudget | None):
        self.budget, self.overruns = budget, 0

    def __call__(self, start: float, samples: float) -> None:
        if self.budget is None:
            return
        if sleep_until(start + self.budget(samples)) == 0.0:
            self.overruns += 1


class PlanExecutor:
    """A model made plan-parallel in place: call `step(x, y)` on every rank with the same
    global batch; it returns the global mean loss (same value on every rank)."""

    def __init__(self, model: nn.Module, graph: LayerGraph, plan: Plan, mesh: DeviceMesh,
                 loss_fn: Callable[[Tensor, Tensor], Tensor], cluster: Cluster | None = None,
                 comm: MeshComm | None = None, compute_budget: ComputeBudget | None = None):
        """`comm` (default: the cluster's plain rings) routes redistributions; pass the cost
        model's own (StageTables.comm) so the executor runs the boxing paths it priced.
        `compute_budget` emulates a slower device (see ComputeBudget)."""
        register_cpu_sdpa_sharding()
        self.sigs = resolve_signatures(graph, plan)
        pm = plan.stages[0].mesh
        self.comm = comm or mesh_comm(cluster or homogeneous(max(pm.devices) + 1), pm)
        if tuple(mesh.shape) != plan.stages[0].mesh.shape:
            raise ConfigError(f"device mesh {tuple(mesh.shape)} does not match the plan's "
                              f"{plan.stages[0].mesh.shape}")
        self.model, self.mesh, self.loss_fn = model, mesh, loss_fn
        self.pad = Padding(compute_budget)
        self.work = device_work_fraction(graph, tuple(mesh.shape), self.sigs)
        ops = {op.name: op for op in graph.ops}
        self.loss_sig = self.sigs[graph.ops[-1].name] if graph.ops[-1].kind == "cross_entropy" else None
        self._hooks = []
        for name, mod in model.named_modules():
            op = ops.get(name)
            if op is not None:
                sig = self.sigs[name]
                for pname, p in list(mod.named_parameters(recurse=False)):
                    d = distribute_tensor(p.detach(), mesh, _param_placements(op, sig, pname))
                    mod.register_parameter(pname, nn.Parameter(d, requires_grad=p.requires_grad))
                self._hooks.append(mod.register_forward_pre_hook(self._pre_hook(to_placements(sig.ins(0)))))
            elif not list(mod.children()) and list(mod.parameters(recurse=False)):
                for pname, p in list(mod.named_parameters(recurse=False)):
                    d = distribute_tensor(p.detach(), mesh, [Replicate()] * mesh.ndim)
                    mod.register_parameter(pname, nn.Parameter(d, requires_grad=p.requires_grad))
                self._hooks.append(mod.register_forward_pre_hook(self._pre_hook(None)))

    def _pre_hook(self, placements: list[Placement] | None) -> Callable[..., Any]:
        mesh = self.mesh

        def hook(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            target = placements if placements is not None else (
                None if isinstance(x, DTensor) else [Replicate()] * mesh.ndim)
            if target is None or not isinstance(x, Tensor):
                return args
            return (_as_dtensor(x, mesh, target, self.comm), *args[1:])

        return hook

    def loss(self, out: Tensor, y: Tensor) -> Tensor:
        """loss_fn on the output boxed to the loss op's signature (vocab-parallel: run it and
        its backward inside `loss_context`)."""
        if self.loss_sig is None:
            return self.loss_fn(out, _as_dtensor(y, self.mesh, [Replicate()] * self.mesh.ndim))
        ins = self.loss_sig.ins(0)
        out = _as_dtensor(out, self.mesh, to_placements(ins), self.comm)
        y_pl = [Shard(0) if s == Split(0) else Replicate() for s in ins]
        return self.loss_fn(out, _as_dtensor(y, self.mesh, y_pl))

    def loss_context(self) -> contextlib.AbstractContextManager[Any]:
        vocab = self.loss_sig is not None and any(a.name == "vocab" for a in self.loss_sig.axes)
        return loss_parallel() if vocab else contextlib.nullcontext()

    def sync_grads(self) -> None:
        """Gradient synchronisation after backward: Partial -> each parameter's placement."""
        for p in self.model.parameters():
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                p.grad = box(g, list(p.placements), self.comm)

    def forward_backward(self, x: Tensor, y: Tensor) -> Tensor:
        start = time.perf_counter()
        with self.loss_context():
            loss = self.loss(self.model(x), y)
            loss.backward()
        self.pad(start, x.shape[0] * self.work)  # this device's part of the batch's work
        self.sync_grads()
        return loss

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def step(self, x: Tensor, y: Tensor, optimizer: torch.optim.Optimizer | None) -> float:
        assert optimizer is not None, "every rank of a single-stage plan holds parameters"
        optimizer.zero_grad(set_to_none=True)
        loss = self.forward_backward(x, y)
        optimizer.step()
        full = loss.full_tensor() if isinstance(loss, DTensor) else loss
        return float(full.detach())


class Executor(Protocol):
    """What the runners need of an executor (PlanExecutor, pipeline.PipelineExecutor)."""

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (none on a rank a pipeline leaves idle)."""
        ...

    def step(self, x: Tensor, y: Tensor, optimizer: torch.optim.Optimizer | None) -> float:
        """One training step on the global batch; the global mean loss on every rank."""
        ...


class SubsetExecutor:
    """A one-stage plan on some of the group's ranks (the planner left slow or small devices
    out): the plan's device ids are ranks; the others idle and receive the loss."""

    def __init__(self, model: nn.Module, graph: LayerGraph, plan: Plan,
                 loss_fn: Callable[[Tensor, Tensor], Tensor], cluster: Cluster | None,
                 comm: MeshComm | None, compute_budget: ComputeBudget | None = None):
        st = plan.stages[0]
        if max(st.mesh.devices) >= dist.get_world_size():
            raise ConfigError(f"the plan names device {max(st.mesh.devices)}, the group has "
                              f"{dist.get_world_size()} processes; run it on a cluster of the "
                              "plan's devices")
        # every rank builds the mesh (its groups are created collectively)
        mesh = DeviceMesh("cpu", torch.tensor(st.mesh.devices).view(st.mesh.shape))
        self.src = st.mesh.devices[0]
        self.inner = PlanExecutor(model, graph, plan, mesh, loss_fn, cluster, comm,
                                  compute_budget) \
            if dist.get_rank() in st.mesh.devices else None

    def parameters(self) -> list[nn.Parameter]:
        return self.inner.parameters() if self.inner is not None else []

    def step(self, x: Tensor, y: Tensor, optimizer: torch.optim.Optimizer | None) -> float:
        loss = torch.zeros(1)
        if self.inner is not None:
            loss.fill_(self.inner.step(x, y, optimizer))
        dist.broadcast(loss, src=self.src)
        return float(loss)


def make_executor(model: nn.Module, graph: LayerGraph, plan: Plan,
                  loss_fn: Callable[[Tensor, Tensor], Tensor], *, cluster: Cluster | None = None,
                  comm: MeshComm | None = None, schedule: str = "gpipe",
                  timeout_s: float | None = None,
                  compute_budget: ComputeBudget | None = None) -> Executor:
    """The executor for `plan` on the current process group: PipelineExecutor (with the
    `schedule`, "gpipe" or "1f1b") for pipeline plans, an uneven.UnevenExecutor for a plan
    with batch shares, a PlanExecutor on a device mesh of the plan's shape when the plan
    spans every rank, else a SubsetExecutor. The plan's device ids are ranks. Call on every
    rank. `timeout_s`: a pipeline's P2P receive timeout. `compute_budget`: this rank's
    emulated device speed."""
    if len(plan.stages) > 1:
        from hetrain.parallel.pipeline import PipelineExecutor

        return PipelineExecutor(model, graph, plan, loss_fn, schedule, timeout_s, compute_budget)
    if plan.stages[0].shares:
        from hetrain.parallel.uneven import UnevenExecutor

        return UnevenExecutor(model, graph, plan, loss_fn, cluster, compute_budget)
    devices = plan.stages[0].mesh.devices
    if tuple(devices) != tuple(range(dist.get_world_size())):
        return SubsetExecutor(model, graph, plan, loss_fn, cluster, comm, compute_budget)
    mesh = init_device_mesh("cpu", plan.stages[0].mesh.shape)
    return PlanExecutor(model, graph, plan, mesh, loss_fn, cluster, comm, compute_budget)
