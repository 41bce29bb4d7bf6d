"""Uneven data parallelism: a one-stage plan whose rows take different shares of the batch.

A plan with `StagePlan.shares` gives row j of its mesh (the devices at index j of axis 0)
shares[j] samples of every global batch, so a fast device (or row) is not held to a slow
one's pace. Every row holds a full replica of the model: on a 1-D mesh a row is one device
and runs the plain model; on a 2-D mesh a row runs the plan's inner signatures (the part
after axis 0) with a PlanExecutor on its own 1-D sub-mesh.

Why the weighting: each row's loss is the mean over its own shares[j] samples, so it is
scaled by shares[j] / G (G the global batch) before backward. Summing the scaled gradients
over the rows then gives the gradient of the global mean loss, exactly what one process
computes on the whole batch; an unweighted average of the rows' gradients would not. The
sum runs over the "column" groups (the devices at one inner index in every row: they hold
the same shard of every parameter), in flat 25 MiB buckets as DDP does (with the loss in the
last one), as the cost model prices it. Afterwards every replica's gradient is the same, so
each rank's optimizer steps locally and the replicas stay identical.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import accumulate

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hetrain.cluster import Cluster
from hetrain.errors import ConfigError
from hetrain.parallel.execute import ComputeBudget, Padding, PlanExecutor
from hetrain.plan.cost import Plan, StagePlan, buckets, require_shares
from hetrain.plan.graph import LayerGraph
from hetrain.plan.sbp import Mesh


def row_plan(plan: Plan, row: int = 0) -> Plan:
    """What row `row` of an uneven 2-D plan runs on its own devices: the inner signatures
    (every row runs the same ones)."""
    st = plan.stages[0]
    inner = StagePlan(Mesh(st.mesh.shape[1:], st.rows()[row]), st.ops, st.inner_signatures())
    return Plan(plan.graph, (inner,))


def sum_in_buckets(tensors: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """All-reduce (sum) every tensor in place over `group`, bucket by bucket."""
    for idx in buckets([t.numel() * t.element_size() for t in tensors]):
        part = [tensors[i] for i in idx]
        flat = torch.cat([t.reshape(-1) for t in part])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in part:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def sum_replica_grads(params: list[nn.Parameter], group: dist.ProcessGroup | None,
                      *extra: Tensor) -> None:
    """Sum the gradients of `params` (each replica's local part; a parameter unused this
    step counts as zeros, so every member sends as many bytes), and `extra` tensors, over
    `group` in buckets (sum_in_buckets)."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = p.grad
        grads.append(g.to_local() if isinstance(g, DTensor) else g)
    sum_in_buckets([*grads, *extra], group)


class UnevenExecutor:
    """A plan with shares on the current process group (device ids are ranks; ranks the plan
    leaves out idle and receive the loss). Call `step(x, y)` on every rank with the same
    global batch; it returns the global mean loss on every rank."""

    def __init__(self, model: nn.Module, graph: LayerGraph, plan: Plan,
                 loss_fn: Callable[[Tensor, Tensor], Tensor], cluster: Cluster | None = None,
                 compute_budget: ComputeBudget | None = None):
        """`compute_budget` emulates a slower device (execute.ComputeBudget)."""
        require_shares(plan, graph.batch)
        st = plan.stages[0]
        if max(st.mesh.devices) >= dist.get_world_size():
            raise ConfigError(f"the plan names device {max(st.mesh.devices)}, the group has "
                              f"{dist.get_world_size()} processes; run it on a cluster of the "
                              "plan's devices")
        self.shares, self.batch = st.shares, sum(st.shares)
        self.offsets = (0, *accumulate(st.shares))
        self.src = st.mesh.devices[0]
        self.everyone = len(st.mesh.devices) == dist.get_world_size()
        rank = dist.get_rank()
        rows = st.rows()
        self.row = next((j for j, r in enumerate(rows) if rank in r), None)
        # every rank builds the mesh (its groups are created collectively, in one order); its
        # axis 0 groups are the columns, its axis 1 groups the rows
        names = ("dp", "row")[:len(st.mesh.shape)]
        mesh = DeviceMesh("cpu", torch.tensor(st.mesh.devices).view(st.mesh.shape),
                          mesh_dim_names=names)
        self.model, self.loss_fn = model, loss_fn
        self.pad = Padding(compute_budget)
        self.inner: PlanExecutor | None = None
        self.columns: dist.ProcessGroup | None = None
        if self.row is None:
            return
        self.columns = mesh.get_group("dp")
        if len(st.mesh.shape) == 2:
            weight = self.shares[self.row] / self.batch
            self.inner = PlanExecutor(model, graph.scaled(weight), row_plan(plan, self.row),
                                      mesh["row"], lambda out, y: loss_fn(out, y) * weight,
                                      cluster, compute_budget=compute_budget)
            self.pad = self.inner.pad

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters()) if self.row is not None else []

    def _forward_backward(self, x: Tensor, y: Tensor) -> Tensor:
        """This row's loss times shares[row] / G, its gradients those of that scaled loss."""
        assert self.row is not None
        if self.inner is not None:
            loss = self.inner.forward_backward(x, y)
            return loss.full_tensor() if isinstance(loss, DTensor) else loss
        start = time.perf_counter()
        loss = self.loss_fn(self.model(x), y) * (self.shares[self.row] / self.batch)
        loss.backward()
        self.pad(start, x.shape[0])
        return loss

    def step(self, x: Tensor, y: Tensor, optimizer: torch.optim.Optimizer | None) -> float:
        if x.shape[0] != self.batch:
            raise ConfigError(f"the plan's shares {list(self.shares)} sum to {self.batch}, the "
                              f"batch has {x.shape[0]} samples")
        total = torch.zeros(1)
        if self.row is not None:
            assert optimizer is not None, "every rank of the plan holds a replica"
            a, b = self.offsets[self.row], self.offsets[self.row + 1]
            optimizer.zero_grad(set_to_none=True)
            loss = self._forward_backward(x[a:b], y[a:b])
            with torch.no_grad():
                total.fill_(float(loss.detach()))
                sum_replica_grads(list(self.model.parameters()), self.columns, total)
            optimizer.step()
        if not self.everyone:
            dist.broadcast(total, src=self.src)
        return float(total)
