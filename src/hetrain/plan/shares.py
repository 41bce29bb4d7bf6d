"""Uneven data parallelism: batch shares that follow each row's speed and memory.

An even data-parallel split runs in lockstep at its slowest member's pace: on devices of
speeds 1:1:2:4 the fast ones wait three quarters of every step. An uneven plan
(StagePlan.shares) gives row j of the mesh (the devices at index j of axis 0) its own number
of samples, every row runs the same inner plan on its devices, and the gradients are summed
over axis 0 weighted by share (cost.uneven_cost prices it; parallel.uneven runs it).

The cost model is affine in a row's samples b (compute, activation boxing, memory all scale
with b; op overheads, syncs and parameters do not), so each row's time is t_j(b) = A_j + C_j b
and memory M_j(b) = P_j + Q_j b, read off its tables at two batch sizes. The shares that
minimise the slowest row, max_j t_j(b_j) with sum b_j = G, b_j >= one unit and M_j(b_j) within
row j's cap, are C-ADP's min-makespan allocation (allocate.allocate: exact water-filling,
integer rounding in units of the inner data-parallel width) of the samples beyond each row's
first unit, whose time becomes a fixed cost. Leaving a row out altogether is a mesh over fewer
devices, which the search prices separately.

A pipeline's shares (column_shares) are per column, device j of every stage: column j is a
pipeline of its own over its share (cost.column_pipeline_cost), so a column of faster devices
takes more of the batch. Its time is the pipeline formula over its stages' micro-batch times,
each affine in the column's micro-batch u: T_j(u) = sum_s t_sj(u) + (m - 1) max_s t_sj(u),
convex and increasing. Minimising max_j T_j(u_j) with sum u_j = batch / m takes the batch / m
smallest "slots" T_j(1), T_j(2), ... (each T_j increasing), which handing out micro-batch
samples one at a time to the column whose next slot is smallest does (a heap; the argument
of allocate's rounding theorem).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math

from hetrain.cluster import Cluster
from hetrain.errors import ConfigError
from hetrain.plan.allocate import allocate
from hetrain.plan.cost import (
    ColumnStage,
    CostOptions,
    Plan,
    StagePlan,
    column_stages,
    device_kind,
    row_tables,
)
from hetrain.plan.graph import LayerGraph
from hetrain.plan.sbp import Mesh


def rows_differ(cluster: Cluster, mesh: Mesh) -> bool:
    """Whether the rows of the mesh differ in pace or room (else even shares are optimal)."""
    devs = cluster.devices
    keys = {(min(devs[d].flops for d in r), min(devs[d].memory_bytes for d in r),
             max(devs[d].step_overhead_s for d in r)) for r in mesh.rows()}
    return mesh.shape[0] > 1 and len(keys) > 1


def granularity(st: StagePlan) -> int:
    """Shares come in units of the inner axis when the inner plan splits the batch on it."""
    inner = len(st.mesh.devices) // st.mesh.shape[0]
    return inner if inner > 1 and "dp" in st.inner_signatures() else 1


def balanced_shares(graph: LayerGraph, st: StagePlan, cluster: Cluster,
                    options: CostOptions | None = None) -> tuple[int, ...] | None:
    """The shares minimising the slowest row's predicted time within every row's memory, each
    row at least one unit; None when the batch cannot give every row a unit or no such split
    fits memory."""
    g, total = granularity(st), graph.batch
    if total % g or total < g * st.mesh.shape[0]:
        return None
    lo = max(g, (total // 2) // g * g)
    fixed, per, caps = [], [], []
    inner = st.inner_signatures()
    for row in st.rows():
        try:
            hi_tab = row_tables(graph, row, total, cluster, options)
            lo_tab = row_tables(graph, row, lo, cluster, options)
            a_hi, a_lo = hi_tab.index_of(inner), lo_tab.index_of(inner)
        except ConfigError:
            return None
        t_hi, t_lo = hi_tab.time_s(a_hi), lo_tab.time_s(a_lo)
        m_hi, m_lo = hi_tab.memory_bytes(a_hi), lo_tab.memory_bytes(a_lo)
        slope = (t_hi - t_lo) / (total - lo) if total > lo else t_hi / total
        mslope = (m_hi - m_lo) / (total - lo) if total > lo else m_hi / total
        per.append(max(slope, 1e-15))
        fixed.append(t_hi - slope * total)
        room = hi_tab.memory_limit_bytes - (m_hi - mslope * total)
        caps.append(math.inf if mslope <= 0 else max(0.0, room / mslope))
    # every row takes at least one unit: allocate the rest with that unit's time as a fixed
    # cost (a row given no more still pays it, which the min-max then includes)
    rest = total - g * len(fixed)
    fixed = [a + b * g for a, b in zip(fixed, per, strict=True)]
    if min(caps) < g:
        return None
    try:
        extra = allocate(fixed, per, rest, [c - g for c in caps], g).shares if rest else \
            (0,) * len(fixed)
    except ConfigError:
        return None
    return tuple(g + x for x in extra)


def with_shares(plan: Plan, shares: tuple[int, ...]) -> Plan:
    return dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], shares=shares),))


def columns_differ(cluster: Cluster, plan: Plan) -> bool:
    """Whether the devices of some stage of a pipeline differ in pace or room (else its columns
    are alike and even shares are optimal)."""
    return any(len({device_kind(cluster, d) for d in st.mesh.devices}) > 1 for st in plan.stages)


def column_shares(graph: LayerGraph, plan: Plan, cluster: Cluster,
                  options: CostOptions | None = None) -> tuple[int, ...] | None:
    """The shares of a pipeline's columns (multiples of n_micro, at least one sample per
    micro-batch each) minimising the slowest column's predicted time within every device's
    memory; None when the batch cannot give every column a micro-batch sample or no such
    split fits memory. `plan`: the pipeline's stages (1-D meshes of equal size) and n_micro."""
    m = plan.n_micro
    columns = list(zip(*(st.mesh.devices for st in plan.stages), strict=True))
    if graph.batch % m or graph.batch // m < len(columns):
        return None
    units = graph.batch // m

    def affine(lo: float, hi: float) -> tuple[float, float]:
        """(value at 0, slope) of the line through (1, lo) and (units, hi)."""
        slope = (hi - lo) / (units - 1) if units > 1 else 0.0
        return lo - slope, slope

    times, caps = [], []
    priced: dict[tuple[object, ...], tuple[list[ColumnStage], list[ColumnStage]]] = {}
    for column in columns:
        # columns of alike devices over alike links price alike
        key = (*(device_kind(cluster, d) for d in column),
               *(cluster.link_between(a, b) for a, b in itertools.pairwise(column)))
        try:
            if key not in priced:
                priced[key] = (column_stages(graph, plan, column, 1, cluster, options),
                               column_stages(graph, plan, column, units, cluster, options))
        except ConfigError:
            return None
        lo, hi = priced[key]
        lines = [affine(a.time_s, b.time_s) for a, b in zip(lo, hi, strict=True)]
        overhead = max(x.overhead_s for x in lo)
        times.append(lambda u, lines=lines, overhead=overhead: overhead + sum(
            a + b * u for a, b in lines) + (m - 1) * max(a + b * u for a, b in lines))
        cap = math.inf
        for a, b in zip(lo, hi, strict=True):
            fixed, per = affine(a.memory_bytes, b.memory_bytes)
            room = a.memory_limit_bytes - fixed
            cap = min(cap, math.inf if per <= 0 else math.floor(room / per + 1e-9))
        caps.append(cap)
    if min(caps) < 1:
        return None
    share = [1] * len(columns)
    heap = [(t(2), j) for j, t in enumerate(times) if caps[j] >= 2]
    heapq.heapify(heap)
    for _ in range(units - len(columns)):
        if not heap:
            return None
        _, j = heapq.heappop(heap)
        share[j] += 1
        if share[j] < caps[j]:
            heapq.heappush(heap, (times[j](share[j] + 1), j))
    return tuple(u * m for u in share)
