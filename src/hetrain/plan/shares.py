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
"""

from __future__ import annotations

import dataclasses
import math

from hetrain.cluster import Cluster
from hetrain.errors import ConfigError
from hetrain.plan.allocate import allocate
from hetrain.plan.cost import CostOptions, Plan, StagePlan, row_tables
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
