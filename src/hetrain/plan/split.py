"""Pipeline stage boundaries by device speed: a slower device gets fewer layers.

A GPipe iteration takes the sum of its stages' times per micro-batch plus n_micro - 1 times
the slowest one's (cost.pipeline_time_s): after the first micro-batch the slowest stage paces
every other. With per-op times that depend on the device (the cost model's compute term: o_k
+ c x flops / speed), the split of the ops over k devices (in pipeline order) minimising that
time is found exactly by dynamic programming over contiguous op ranges (over the (slowest,
sum) pairs no other beats in both); with one micro-batch, or where only the balance matters
(a FLOP-proportional split), the min-max partition, exactly and in O(k n^2). Only compute is
balanced by speed_split: the boundary transfer is the same whichever device sends it, and
the search prices it afterwards (cost.plan_cost).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence

import numpy as np

from hetrain.cluster import Cluster
from hetrain.errors import ConfigError
from hetrain.plan.cost import CostOptions, Plan, StagePlan, stage_tables
from hetrain.plan.graph import LayerGraph, Op
from hetrain.plan.sbp import Mesh, signatures


def min_max_split(costs: Sequence[Sequence[float]], starts: Collection[int] | None = None, *,
                  send: Sequence[Sequence[float]] | None = None,
                  memory: Sequence[Sequence[float]] | None = None,
                  caps: Sequence[float] | None = None,
                  n_micro: int = 1) -> tuple[list[int], float]:
    """Stage bounds [0, b_1, ..., n] minimising the slowest stage, stage s holding ops
    [b_s, b_s+1) and taking sum(costs[s][b_s:b_s+1]) + send[s][b_s+1]; with n_micro > 1,
    minimising the pipeline's time over that many micro-batches instead, the stages' sum
    plus n_micro - 1 times the slowest (cost.pipeline_time_s; a dynamic programme over the
    (slowest, sum) pairs no other pair beats in both). With one micro-batch nothing overlaps
    and the sum alone would crowd the fastest device; the min-max split keeps the stages
    balanced.

    costs[s][i] is the time of op i on stage s's devices (k rows of n ops); send[s][j] (k rows
    of n + 1, optional) is stage s's extra time when it ends before op j (passing the boundary
    tensor on; j = n, the last stage, normally 0); each stage gets at least one op; `starts`
    restricts where a stage after the first may begin (default: any op). With memory[s][i]
    (bytes of op i on stage s's devices) and caps[s], a stage whose ops exceed its cap is
    not allowed. Returns (bounds, the slowest stage's time); raises ConfigError when no split
    exists."""
    k, n = len(costs), len(costs[0]) if costs else 0
    if k == 0 or any(len(row) != n for row in costs):
        raise ConfigError("min_max_split: costs must be k >= 1 rows of equal length")
    if send is not None and (len(send) != k or any(len(row) != n + 1 for row in send)):
        raise ConfigError("min_max_split: send must be k rows of n + 1 values")
    if (memory is None) != (caps is None) or (memory is not None and caps is not None and (
            len(memory) != k or len(caps) != k or any(len(row) != n for row in memory))):
        raise ConfigError("min_max_split: memory (k rows of n) and caps (k) go together")
    ok = [i in starts if starts is not None else True for i in range(n + 1)]
    ok[0] = ok[n] = True
    pre = np.zeros((k, n + 1))
    pre[:, 1:] = np.cumsum(np.asarray(costs, dtype=float), axis=1)
    tail = np.asarray(send, dtype=float) if send is not None else np.zeros((k, n + 1))
    mpre = np.zeros((k, n + 1))
    if memory is not None:
        mpre[:, 1:] = np.cumsum(np.asarray(memory, dtype=float), axis=1)
    cap = np.asarray(caps, dtype=float) if caps is not None else np.full(k, np.inf)
    inf = float("inf")
    pos = [i for i in range(1, n + 1) if ok[i]]  # only allowed boundaries (and n)
    if n_micro > 1:
        return _pipeline_split(pre, tail, mpre, cap, pos, n_micro, caps is not None)
    # best[s][j]: the slowest of stages 0..s when they hold ops[:j]; arg[s][j] its last start
    best = np.full((k, n + 1), inf)
    arg = np.zeros((k, n + 1), dtype=int)
    fits0 = mpre[0, 1:] <= cap[0]
    best[0, 1:] = np.where(fits0, pre[0, 1:] + tail[0, 1:], inf)
    for s in range(1, k):
        for j in pos:
            if j < s + 1:
                continue
            for i in pos:
                if i >= j:
                    break
                if best[s - 1, i] < inf and mpre[s, j] - mpre[s, i] <= cap[s]:
                    t = max(best[s - 1, i], pre[s, j] - pre[s, i] + tail[s, j])
                    if t < best[s, j]:
                        best[s, j], arg[s, j] = t, i
    if best[k - 1, n] == inf:
        what = " within the memory caps" if caps is not None else ""
        raise ConfigError(f"cannot split {n} ops into {k} stages at the allowed boundaries{what}")
    bounds = [n]
    for s in range(k - 1, 0, -1):
        bounds.append(int(arg[s, bounds[-1]]))
    return [0, *reversed(bounds)], float(best[k - 1, n])


def _pipeline_split(pre: np.ndarray, tail: np.ndarray, mpre: np.ndarray, cap: np.ndarray,
                    pos: list[int], n_micro: int, capped: bool) -> tuple[list[int], float]:
    """min_max_split's n_micro > 1 case: front[s][j] holds, for stages 0..s holding ops[:j],
    every (slowest, sum) pair not beaten in both by another, with its last start and the
    pair it extends; the answer minimises sum + (n_micro - 1) x slowest over front[k-1][n]."""
    k, n = pre.shape[0], pre.shape[1] - 1
    Pair = tuple[float, float, int, int]  # slowest, sum, last stage's start, index in its front
    front: list[dict[int, list[Pair]]] = [{} for _ in range(k)]
    for j in pos:
        if mpre[0, j] <= cap[0]:
            t = float(pre[0, j] + tail[0, j])
            front[0][j] = [(t, t, 0, -1)]
    for s in range(1, k):
        for j in pos:
            found: list[Pair] = []
            for i in pos:
                if i >= j:
                    break
                prev = front[s - 1].get(i)
                if not prev or mpre[s, j] - mpre[s, i] > cap[s]:
                    continue
                t = float(pre[s, j] - pre[s, i] + tail[s, j])
                found += [(max(mx, t), sm + t, i, x) for x, (mx, sm, _, _) in enumerate(prev)]
            found.sort(key=lambda p: (p[0], p[1]))
            kept: list[Pair] = []
            for p in found:
                if not kept or p[1] < kept[-1][1]:
                    kept.append(p)
            if kept:
                front[s][j] = kept
    last = front[k - 1].get(n)
    if not last:
        what = " within the memory caps" if capped else ""
        raise ConfigError(f"cannot split {n} ops into {k} stages at the allowed boundaries{what}")
    x = min(range(len(last)), key=lambda q: last[q][1] + (n_micro - 1) * last[q][0])
    slowest = last[x][0]
    bounds, j = [n], n
    for s in range(k - 1, 0, -1):
        _, _, i, x = front[s][j][x]
        bounds.append(i)
        j = i
    return [0, *reversed(bounds)], slowest


def op_compute_s(graph: LayerGraph, cluster: Cluster, device: int,
                 options: CostOptions | None = None) -> list[float]:
    """Per-op forward + backward compute seconds of `graph` on one device (the cost model's
    compute term; on one device every signature computes the same)."""
    tab = stage_tables(graph, Mesh((1,), (device,)), cluster, options)
    return [float(c.min()) for c in tab.compute]


def speed_split(graph: LayerGraph, cluster: Cluster, devices: Sequence[int], n_micro: int = 1,
                options: CostOptions | None = None,
                starts: Collection[int] | None = None) -> Plan:
    """A pipeline Plan with one stage per device of `devices` (in that order), cut to minimise
    its compute over n_micro micro-batches (cost.pipeline_time_s). `starts` defaults to the
    graph's stage starts (LayerGraph.stage_starts: the boundaries the pipeline executor can
    run)."""
    if n_micro < 1 or graph.batch % n_micro:
        raise ConfigError(f"batch {graph.batch} is not divisible by n_micro={n_micro}")
    micro = graph.scaled(1.0 / n_micro) if n_micro > 1 else graph
    costs = [op_compute_s(micro, cluster, d, options) for d in devices]
    if starts is None:
        starts = set(graph.stage_starts())
    bounds, _ = min_max_split(costs, starts, n_micro=n_micro)
    return pipeline_plan(graph, bounds, [Mesh((1,), (d,)) for d in devices], n_micro)


def data_parallel_signature(op: Op, mesh_shape: tuple[int, ...]) -> str:
    """The op's signature with the most data-parallel axes among dp/rep-only ones."""
    names = [s.name for s in signatures(op, mesh_shape)
             if {a.name for a in s.axes} <= {"dp", "rep"}]
    return max(names, key=lambda n: n.split(",").count("dp"))


def pipeline_plan(graph: LayerGraph, bounds: Sequence[int], meshes: Sequence[Mesh],
                  n_micro: int) -> Plan:
    """Stage s = ops[bounds[s]:bounds[s+1]] on meshes[s], data parallel inside the stage."""
    if len(bounds) != len(meshes) + 1 or bounds[0] != 0 or bounds[-1] != len(graph.ops) or any(
            a >= b for a, b in itertools.pairwise(bounds)):
        raise ConfigError(f"pipeline bounds {list(bounds)} must rise from 0 to {len(graph.ops)} "
                          f"with one stage per mesh ({len(meshes)})")
    return Plan(graph.name, tuple(
        StagePlan(m, tuple(op.name for op in graph.ops[a:b]),
                  tuple(data_parallel_signature(op, m.shape) for op in graph.ops[a:b]))
        for m, a, b in zip(meshes, bounds, bounds[1:], strict=False)), n_micro)
