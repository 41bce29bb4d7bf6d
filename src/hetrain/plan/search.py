"""Plan search: coordinate descent over per-op SBP signatures, exhaustive search to check it.

The objective of one stage is separable into node and edge terms (cost.StageTables), so
re-picking one op's signature with its neighbours fixed is a vector argmin (OneFlow/AutoDDL's
coordinate descent). Single-op moves get stuck where two ops must change together (data
parallel -> Megatron's column + row pair costs more after either half alone), so each sweep
also re-picks both ends of every edge jointly (a |S_u| x |S_v| argmin). Sweeps run until no
move improves; restarts from data parallel, fully replicated, least-memory and random
assignments keep the best. Memory is a hard limit: a score is the time when the plan fits,
else 1e12 + the excess bytes, so any feasible plan beats every infeasible one.

The outer search tries candidate meshes (1-D over all devices, sites x local 2-D meshes with
the inner axis inside a site, 2-D factorisations of a single site, each site alone, the fastest
2^k devices: a lockstep mesh runs at its slowest member's pace, the 2^k with the most memory
when memory differs, the first 2^k when every device is alike) and GPipe pipelines (equal-sized
device groups by site, by speed or by memory; layers cut only where the pipeline executor can
cut, LayerGraph.stage_starts, two ways: FLOP-proportional to group capacity, and the exact
min-max split of the cost model's per-op stage times under each group's memory cap, so a slower
or smaller device's stage gets fewer layers; where a stage's devices differ, also with every
stage data parallel and per-column batch shares, shares.column_shares), and returns the
fastest plan that fits every device's memory (memory_bytes), of equal times the one on the
fewest devices, with the data-parallel baseline. When no candidate fits, search_plan raises one ConfigError line with
the leanest plan's need, its device's cap, the shortfall and the largest device's memory.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from dataclasses import dataclass, replace

import numpy as np

from hetrain.cluster import Cluster
from hetrain.errors import ConfigError
from hetrain.plan.cost import (
    CostOptions,
    CostReport,
    Plan,
    StagePlan,
    StageTables,
    _boundary_link_s,
    micro_memory,
    plan_cost,
    row_tables,
    stage_tables,
)
from hetrain.plan.graph import LayerGraph
from hetrain.plan.sbp import Mesh
from hetrain.plan.shares import balanced_shares, column_shares, columns_differ, rows_differ
from hetrain.plan.split import min_max_split

INFEASIBLE = 1e12


@dataclass(frozen=True)
class SearchOptions:
    restarts: int = 4
    """Coordinate-descent starts per mesh (data parallel, replicated, least memory, random...)."""
    max_sweeps: int = 50
    pair_moves: bool = True
    """Also re-pick both ends of each edge jointly."""
    pipeline: bool = True
    """Also try GPipe pipelines over device groups."""
    subsets: bool = True
    """Also try meshes over the fastest devices only, over those with the most memory (when
    memory differs), over the first 2^k when all are alike, and over single sites."""
    uneven: bool = True
    """Also try uneven data-parallel batch shares over mesh axis 0 where its rows differ, and
    per column of a pipeline whose stages' devices differ."""
    seed: int = 0


def scores(tab: StageTables, time_s: np.ndarray, mem: np.ndarray) -> np.ndarray:
    lim = tab.memory_limit_bytes
    return np.where(mem <= lim, time_s, INFEASIBLE + (mem - lim))


def score(tab: StageTables, assign: list[int]) -> float:
    return float(scores(tab, np.array(tab.time_s(assign)), np.array(tab.memory_bytes(assign))))


def named_assignment(tab: StageTables, prefer: tuple[str, ...]) -> list[int]:
    """Per op, the first signature whose axes all use a name in `prefer` order, e.g. ("dp",
    "rep") gives the data-parallel start (replicated where dp is illegal)."""
    out = []
    for sigs in tab.sigs:
        ranks = [sum(prefer.index(a.name) if a.name in prefer else len(prefer) for a in s.axes)
                 for s in sigs]
        out.append(int(np.argmin(ranks)))
    return out


def coordinate_descent(tab: StageTables, start: list[int], max_sweeps: int = 50,
                       pair_moves: bool = True) -> tuple[list[int], float]:
    a = list(start)
    n = len(a)
    adj: list[list[tuple[int, bool]]] = [[] for _ in range(n)]
    for e, (u, v, _) in enumerate(tab.edges):
        adj[u].append((e, True))
        adj[v].append((e, False))
    mem_total = tab.memory_bytes(a)
    pairs = [(min(u, v), max(u, v)) for u, v, _ in tab.edges]
    parallel = {e for e, pr in enumerate(pairs) if pairs.count(pr) > 1 or pr[0] == pr[1]}

    def op_vec(i: int, skip: int = -1) -> np.ndarray:
        t = tab.node_time[i].copy()
        for e, is_src in adj[i]:
            if e == skip:
                continue
            u, v, _ = tab.edges[e]
            t += tab.edge[e][:, a[v]] if is_src else tab.edge[e][a[u], :]
        return t

    nbrs = [{tab.edges[e][1] if src else tab.edges[e][0] for e, src in adj[i]} for i in range(n)]
    dirty_ops, dirty_edges = set(range(n)), set(range(len(tab.edges))) - parallel

    def changed(ops: tuple[int, ...], old_mem: float) -> None:
        """Re-examine what a move can have changed: the ops next to it (their vectors read
        its signature), the edges at those ops, and everything when memory was freed."""
        if mem_total < old_mem:
            dirty_ops.update(range(n))
            dirty_edges.update(set(range(len(tab.edges))) - parallel)
            return
        for j in ops:
            for k in (j, *nbrs[j]):
                dirty_ops.add(k)
                dirty_edges.update(e for e, _ in adj[k] if e not in parallel)

    for _ in range(max_sweeps):
        improved = False
        for i in range(n):
            if i not in dirty_ops:
                continue
            dirty_ops.discard(i)
            mem = mem_total - tab.mem[i][a[i]] + tab.mem[i]
            sc = scores(tab, op_vec(i), mem)
            k = int(np.argmin(sc))
            if sc[k] < sc[a[i]] - 1e-12 * max(1.0, abs(sc[a[i]])):
                old, (mem_total, a[i], improved) = mem_total, (float(mem[k]), k, True)
                changed((i,), old)
        if pair_moves:
            for e, (u, v, _) in enumerate(tab.edges):
                if e not in dirty_edges:
                    continue
                dirty_edges.discard(e)
                tm = op_vec(u, e)[:, None] + op_vec(v, e)[None, :] + tab.edge[e]
                mm = (mem_total - tab.mem[u][a[u]] - tab.mem[v][a[v]]
                      + tab.mem[u][:, None] + tab.mem[v][None, :])
                sc = scores(tab, tm, mm)
                ku, kv = np.unravel_index(int(np.argmin(sc)), sc.shape)
                if sc[ku, kv] < sc[a[u], a[v]] - 1e-12 * max(1.0, abs(sc[a[u], a[v]])):
                    old, mem_total, a[u], a[v] = mem_total, float(mm[ku, kv]), int(ku), int(kv)
                    improved = True
                    changed((u, v), old)
        if not improved:
            break
    return a, score(tab, a)


def exhaustive(tab: StageTables, max_states: int = 2_000_000) -> tuple[list[int], float]:
    """The exact optimum by enumerating every assignment (numpy broadcasting)."""
    sizes = [len(s) for s in tab.sigs]
    if math.prod(sizes) > max_states:
        raise ValueError(f"{math.prod(sizes)} assignments exceed max_states={max_states}")
    n = len(sizes)

    def along(vec: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        shape = [1] * n
        for ax, sz in zip(axes, vec.shape, strict=True):
            shape[ax] = sz
        return vec.reshape(shape)

    t = np.full(sizes, tab.overhead_s)
    m = np.zeros(sizes)
    for i in range(n):
        t = t + along(tab.node_time[i], (i,))
        m = m + along(tab.mem[i], (i,))
    for e, (u, v, _) in enumerate(tab.edges):
        mat = tab.edge[e] if u < v else tab.edge[e].T
        t = t + along(mat, (min(u, v), max(u, v)))
    sc = scores(tab, t, m)
    idx = np.unravel_index(int(np.argmin(sc)), sc.shape)
    return [int(k) for k in idx], float(sc[idx])


def search_stage(tab: StageTables, options: SearchOptions | None = None) -> tuple[list[int], float]:
    """Best of coordinate descent from several starts."""
    o = options or SearchOptions()
    rng = np.random.default_rng(o.seed)
    starts = [named_assignment(tab, ("dp", "rep")), named_assignment(tab, ("rep",)),
              [int(np.argmin(m)) for m in tab.mem]]
    while len(starts) < o.restarts:
        starts.append([int(rng.integers(len(s))) for s in tab.sigs])
    best: tuple[list[int], float] | None = None
    for st in starts[:max(1, o.restarts)]:
        res = coordinate_descent(tab, st, o.max_sweeps, o.pair_moves)
        if best is None or res[1] < best[1]:
            best = res
    assert best is not None
    return best


# ---- candidate meshes and pipelines -----------------------------------------------------------
def _by_site(cluster: Cluster) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {s.name: [] for s in cluster.sites}
    for i, d in enumerate(cluster.devices):
        out[d.site].append(i)
    return {k: v for k, v in out.items() if v}


def candidate_meshes(cluster: Cluster, subsets: bool = True) -> list[Mesh]:
    sites = _by_site(cluster)
    order = tuple(i for v in sites.values() for i in v)
    n, meshes = cluster.n, [Mesh((cluster.n,), order)]
    counts = {len(v) for v in sites.values()}
    per = counts.pop() if len(counts) == 1 else 0
    if len(sites) == 1:
        meshes += [Mesh((a, n // a), order) for a in range(2, n // 2 + 1) if n % a == 0]
    elif per > 1:  # rows inside a site: the inner axis stays on the LAN
        meshes += [Mesh((n // b, b), order) for b in range(2, per + 1) if per % b == 0]
    if subsets:
        if len(sites) > 1:
            meshes += [Mesh((len(v),), tuple(v)) for v in sites.values()]
        devs = cluster.devices
        rankings = []
        if len({d.flops for d in devs}) > 1:
            rankings.append(sorted(range(n), key=lambda i: (-devs[i].flops, i)))
        if len({d.memory_bytes for d in devs}) > 1:  # the devices with the most room
            rankings.append(sorted(range(n),
                                   key=lambda i: (-devs[i].memory_bytes, -devs[i].flops, i)))
        if not rankings:  # every device alike: the first 2^k (a replicated plan on one
            rankings.append(list(order))  # device runs as fast and leaves the rest free)
        for best in rankings:
            k = 1
            while k < n:
                sel = sorted(best[:k], key=lambda i: (order.index(i)))
                meshes.append(Mesh((k,), tuple(sel)))
                k *= 2
    seen, out = set(), []
    for m in meshes:
        if (m.shape, m.devices) not in seen:
            seen.add((m.shape, m.devices))
            out.append(m)
    return out


def _balanced_bounds(graph: LayerGraph, capacity: list[float]) -> list[int] | None:
    """Stage bounds minimising max_s flops_s / capacity_s over the allowed stage starts (the
    FLOP-proportional split; exact, by min_max_split)."""
    k, n = len(capacity), len(graph.ops)
    starts = graph.stage_starts()
    if len(starts) < k - 1:
        return None
    costs = [[op.flops / c for op in graph.ops] for c in capacity]
    return min_max_split(costs, starts)[0] if k > 1 else [0, n]


def _speed_bounds(micro: LayerGraph, cluster: Cluster, meshes: list[Mesh], m: int,
                  cost_options: CostOptions | None) -> list[int] | None:
    """Stage bounds minimising the pipeline's time over m micro-batches (the stages' sum plus
    m - 1 times the slowest, cost.pipeline_time_s) as the cost model prices each stage's
    micro-batch for data-parallel stages (per-op compute on that stage's devices at their slowest
    member's speed, the boundary activation and gradient over the link to the next stage),
    each stage within its devices' memory cap (with m micro-batches' activations): a stage on
    devices with less room gets fewer or lighter layers. If no split fits data parallel, the
    caps are checked against each op's leanest signature (what the stage's own SBP search may
    reach); if none fits even so, the split with the least excess over a cap is returned."""
    k, n = len(meshes), len(micro.ops)
    starts = micro.stage_starts()
    if len(starts) < k - 1:
        return None
    costs, send, dp_mem, lean_mem, caps = [], [], [], [], []
    for s, mesh in enumerate(meshes):
        try:
            tab = stage_tables(micro, mesh, cluster, cost_options)
        except ConfigError:
            return None
        a = named_assignment(tab, ("dp", "rep"))
        costs.append([float(tab.compute[i][a[i]] + tab.internal[i][a[i]]) for i in range(n)])
        mem = micro_memory(tab, m)
        dp_mem.append([float(mem[i][a[i]]) for i in range(n)])
        lean_mem.append([float(x.min()) for x in mem])
        caps.append(tab.memory_limit_bytes)
        row = [0.0] * (n + 1)
        if s + 1 < k:
            for j in starts:
                row[j] = 2 * _boundary_link_s(cluster, mesh, meshes[s + 1],
                                              micro.ops[j - 1].out_bytes)
        send.append(row)
    for memory in (dp_mem, lean_mem):
        try:
            return min_max_split(costs, starts, send=send, memory=memory, caps=caps,
                                 n_micro=m)[0]
        except ConfigError:
            continue
    # nothing fits: the split with the least excess over a cap (what the error will report)
    return min_max_split(lean_mem, starts, send=[[-c] * (n + 1) for c in caps])[0]


def _pipeline_groups(cluster: Cluster) -> list[list[list[int]]]:
    """Device groups for pipeline stages, in stage order: the sites (and pairs of sites) when
    they are equal in size, and 2 or 4 equal groups by speed and, when the devices' memory
    differs, by memory. Every group has as many devices (the pipeline executor feeds device
    j of a stage from device j of the one before)."""
    sites = list(_by_site(cluster).values())
    out = []
    if len(sites) > 1 and len({len(v) for v in sites}) == 1:
        out.append(sites)
        if len(sites) % 2 == 0 and len(sites) > 2:
            out.append([sites[j] + sites[j + 1] for j in range(0, len(sites), 2)])
    devs = cluster.devices
    orders = [sorted(range(cluster.n), key=lambda i: (devs[i].flops, i))]
    if len({d.memory_bytes for d in devs}) > 1:
        orders.append(sorted(range(cluster.n),
                             key=lambda i: (devs[i].memory_bytes, devs[i].flops, i)))
    for order in orders:
        for k in (2, 4):
            if cluster.n % k == 0 and cluster.n >= k:
                c = cluster.n // k
                groups = [sorted(order[j * c:(j + 1) * c]) for j in range(k)]
                if groups not in out:
                    out.append(groups)
    return out


def _column_groups(cluster: Cluster) -> list[list[list[int]]]:
    """When speeds differ: 2 or 4 stage groups that each take one device of every k
    speed-ranked ones, so that column j of the pipeline is k alike devices and, with
    per-column batch shares, a column of fast devices takes more of the batch (without
    shares such a pipeline runs at its slow devices' pace: only its shares are tried)."""
    devs = cluster.devices
    if len({d.flops for d in devs}) == 1:
        return []
    order = sorted(range(cluster.n), key=lambda i: (devs[i].flops, i))
    return [[sorted(order[j * k + s] for j in range(cluster.n // k)) for s in range(k)]
            for k in (2, 4) if cluster.n % k == 0 and cluster.n // k > 1]


def data_parallel_plan(graph: LayerGraph, cluster: Cluster, mesh: Mesh | None = None,
                       options: CostOptions | None = None) -> Plan:
    """Pure data parallelism over `mesh` (default: all devices): dp where legal, else rep."""
    mesh = mesh or candidate_meshes(cluster, subsets=False)[0]
    tab = stage_tables(graph, mesh, cluster, options)
    return to_plan(graph, [(tab, named_assignment(tab, ("dp", "rep")))])


def uneven_plan(graph: LayerGraph, cluster: Cluster, mesh: Mesh, o: SearchOptions,
                cost_options: CostOptions | None) -> Plan | None:
    """Data parallel over mesh axis 0 with speed- and memory-balanced shares (plan.shares);
    on a 2-D mesh each row runs the inner plan searched for the slowest row at an even share.
    None when no balanced split exists."""
    ops = tuple(op.name for op in graph.ops)
    if len(mesh.shape) == 1:
        stage = StagePlan(mesh, ops, ("dp",) * len(ops))
    else:
        slowest = min(mesh.rows(), key=lambda r: min(cluster.devices[d].flops for d in r))
        try:
            tab = row_tables(graph, slowest, graph.batch // mesh.shape[0], cluster, cost_options)
        except ConfigError:
            return None
        a, _ = search_stage(tab, o)
        stage = StagePlan(mesh, ops, tuple(f"dp,{tab.sigs[i][s].name}" for i, s in enumerate(a)))
    shares = balanced_shares(graph, stage, cluster, cost_options)
    return None if shares is None else Plan(graph.name, (replace(stage, shares=shares),))


def to_plan(graph: LayerGraph, stages: list[tuple[StageTables, list[int]]], n_micro: int = 1) -> Plan:
    return Plan(graph.name, tuple(StagePlan(t.mesh, tuple(op.name for op in t.graph.ops),
                                            tuple(t.sigs[i][s].name for i, s in enumerate(a)))
                                  for t, a in stages), n_micro)


@dataclass(frozen=True)
class SearchResult:
    plan: Plan
    report: CostReport
    baseline: Plan
    baseline_report: CostReport
    candidates: tuple[tuple[str, float, bool], ...]
    """(description, predicted time_s, fits in memory) of every candidate tried."""
    search_time_s: float
    candidate_plans: tuple[Plan, ...] = ()
    """The plan of each candidate, in the same order (benchmarks measure them all)."""

    @property
    def gain(self) -> float:
        """Predicted speed-up over the data-parallel baseline."""
        return self.baseline_report.time_s / self.report.time_s


def search_plan(graph: LayerGraph, cluster: Cluster, options: SearchOptions | None = None,
                cost_options: CostOptions | None = None) -> SearchResult:
    o = options or SearchOptions()
    t0 = time.perf_counter()
    found: list[tuple[Plan, str]] = []
    for mesh in candidate_meshes(cluster, o.subsets):
        try:
            tab = stage_tables(graph, mesh, cluster, cost_options)
        except ConfigError:
            continue
        a, _ = search_stage(tab, o)
        found.append((to_plan(graph, [(tab, a)]), f"mesh {mesh.label} {list(mesh.devices)}"))
        if o.uneven and rows_differ(cluster, mesh):
            uneven = uneven_plan(graph, cluster, mesh, o, cost_options)
            if uneven is not None:
                found.append((uneven, f"mesh {mesh.label} {list(mesh.devices)} uneven shares "
                              f"{list(uneven.stages[0].shares)}"))
    if o.pipeline:
        grouped = _pipeline_groups(cluster)
        for groups in grouped:
            found += _search_pipeline(graph, cluster, groups, o, cost_options)
        if o.uneven:
            for groups in _column_groups(cluster):
                if groups not in grouped:
                    found += _search_pipeline(graph, cluster, groups, o, cost_options,
                                              shares_only=True)
    if not found:
        raise ConfigError(f"no plan for '{graph.name}' on '{cluster.name}': no mesh admits it")
    reports = [(plan_cost(graph, p, cluster, cost_options), p, d) for p, d in found]
    rank = sorted(reports, key=lambda r: (not r[0].feasible, r[0].time_s if r[0].feasible
                                          else r[0].memory_bytes - r[0].memory_limit_bytes))
    if not rank[0][0].feasible:
        raise ConfigError(_shortfall(graph, cluster, rank[0][0], rank[0][2], len(reports),
                                     cost_options))
    tied = [r for r in rank if r[0].feasible and r[0].time_s <= rank[0][0].time_s * (1 + _TIE)]
    rank[0] = min(tied, key=lambda r: _devices_used(r[1]))  # stable: the first of the fewest
    base = data_parallel_plan(graph, cluster, options=cost_options)
    return SearchResult(rank[0][1], rank[0][0], base, plan_cost(graph, base, cluster, cost_options),
                        tuple((d, r.time_s, r.feasible) for r, _, d in reports),
                        time.perf_counter() - t0, tuple(p for _, p, _ in reports))


_TIE = 1e-12
"""Relative difference in predicted time below which two plans tie (float rounding): of tied
plans the search keeps the one on the fewest devices, e.g. one device rather than the same
replicated plan on four, which takes as long and occupies the other three."""


def _devices_used(plan: Plan) -> int:
    return sum(len(st.mesh.devices) for st in plan.stages)


def _gib(nbytes: float) -> str:
    """Bytes in GiB, or MiB below 1 GiB."""
    return f"{nbytes / 2**30:.3g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.3g} MiB"


def _shortfall(graph: LayerGraph, cluster: Cluster, lean: CostReport, desc: str, tried: int,
               cost_options: CostOptions | None) -> str:
    """The one-line error when no candidate fits: what the leanest plan needs, on which cap,
    the shortfall, the largest device and the model's parameter state."""
    opt = (cost_options or CostOptions()).optimizer_states
    state = graph.param_bytes() * (2 + opt)
    big = max(cluster.devices, key=lambda d: d.memory_bytes)
    return (f"'{graph.name}' (batch {graph.batch}) fits no device memory on '{cluster.name}': "
            f"the leanest of {tried} plans ({desc}) needs {_gib(lean.memory_bytes)} on a device "
            f"of {_gib(lean.memory_limit_bytes)}, short by "
            f"{_gib(lean.memory_bytes - lean.memory_limit_bytes)} (parameters + gradients + "
            f"optimizer state + activations as the cost model counts them; the model's "
            f"parameters + gradients + optimizer state alone take {_gib(state)}); the largest "
            f"device, '{big.name}', has {_gib(big.memory_bytes)}. Use devices with more "
            "memory, more devices, or a smaller batch or model")


def _search_pipeline(graph: LayerGraph, cluster: Cluster, groups: list[list[int]],
                     o: SearchOptions, cost_options: CostOptions | None,
                     shares_only: bool = False) -> list[tuple[Plan, str]]:
    """GPipe candidates with one stage per group (in order) and k, 2k or 4k micro-batches,
    cut at the graph's stage starts two ways: FLOP-proportional to the groups' capacity (size
    x slowest speed) and by the cost model's per-op times (_speed_bounds: a slower or fuller
    stage gets fewer layers). Each stage then gets its own SBP search on its devices, memory
    counted with all micro-batches' activations, and where a stage's devices differ (with
    o.uneven) the same cuts with data-parallel stages and per-column shares are tried too
    (only those with `shares_only`); plan_cost prices every candidate."""
    k = len(groups)
    meshes = [Mesh((len(g),), tuple(g)) for g in groups]
    flops_bounds = _balanced_bounds(graph, [len(g) * min(cluster.devices[i].flops for i in g)
                                            for g in groups])
    out = []
    for m in (k, 2 * k, 4 * k):
        if graph.batch % m:
            continue
        micro = graph.scaled(1.0 / m)
        tried: dict[tuple[int, ...], str] = {}
        for how, bounds in (("speed", _speed_bounds(micro, cluster, meshes, m, cost_options)),
                            ("flops", flops_bounds)):
            if bounds is not None:
                tried.setdefault(tuple(bounds), how)
        for cuts, how in tried.items():
            sizes = [b - a for a, b in itertools.pairwise(cuts)]
            desc = f"pipeline {k} stages x {m} micro {[len(g) for g in groups]} {how} split " \
                   f"{sizes} ops"
            ranges = list(itertools.pairwise(cuts))
            if not shares_only:
                stages = []
                try:
                    for (a, b), mesh in zip(ranges, meshes, strict=True):
                        tab = copy.copy(stage_tables(micro.subgraph(a, b), mesh, cluster,
                                                     cost_options))
                        tab.mem = micro_memory(tab, m)  # the stage search sees GPipe's memory
                        stages.append((tab, search_stage(tab, o)[0]))
                except ConfigError:
                    continue
                out.append((to_plan(graph, stages, m), desc))
            dp = Plan(graph.name, tuple(
                StagePlan(_fastest_first(cluster, mesh), tuple(op.name for op in graph.ops[a:b]),
                          ("dp",) * (b - a)) for (a, b), mesh in zip(ranges, meshes, strict=True)),
                m)
            if o.uneven and len(groups[0]) > 1 and columns_differ(cluster, dp):
                shares = column_shares(graph, dp, cluster, cost_options)
                if shares is not None:
                    out.append((replace(dp, stages=tuple(replace(st, shares=shares)
                                                         for st in dp.stages)),
                                f"{desc}, column shares {list(shares)}"))
    return out


def _fastest_first(cluster: Cluster, mesh: Mesh) -> Mesh:
    """A 1-D mesh's devices fastest first (then roomiest): column j of a pipeline with
    shares pairs the j-th fastest device of every stage."""
    devs = cluster.devices
    return Mesh(mesh.shape, tuple(sorted(mesh.devices, key=lambda i: (
        -devs[i].flops, -devs[i].memory_bytes, i))))


# ---- hand-written plans (baselines, tests, benchmarks) ---------------------------------------
_TP_RULES = (("*.attn.[qkv]", "col"), ("*.attn.core", "heads"), ("*.attn.proj", "row"),
             ("*.mlp.fc", "col"), ("*.mlp.gelu", "feat"), ("*.mlp.proj", "row"),
             ("head", "col"), ("loss", "vocab"), ("classifier.0", "col"),
             ("classifier.1", "feat"), ("classifier.2", "row"))
TEMPLATES: dict[str, tuple[tuple[str, str], ...]] = {
    "dp": (("*", "dp"),),
    "rep": (("*", "rep"),),
    "tp": (*_TP_RULES, ("*", "rep")),
    "mixed": (*(r for r in _TP_RULES if "attn" not in r[0]), ("loss", "rep"), ("*", "dp")),
}
"""Rule lists (fnmatch pattern, 1-D signature): dp = data parallel; rep = every device
computes everything (no communication at all); tp = Megatron tensor
parallelism (column/row pairs, head-parallel attention, vocab-parallel head) with everything
else replicated; mixed = data parallel with tensor-parallel MLP/classifier."""


def rule_plan(graph: LayerGraph, mesh: Mesh, rules_per_axis: tuple[tuple[tuple[str, str], ...], ...],
              name: str = "") -> Plan:
    """A plan from per-axis rule lists (first matching pattern wins; an axis whose choice is
    illegal for an op falls back to "dp", then "rep", keeping the outer axes' choices first)."""
    import fnmatch

    from hetrain.plan.sbp import signatures

    if len(rules_per_axis) != len(mesh.shape):
        raise ConfigError(f"{len(rules_per_axis)} rule lists for a {len(mesh.shape)}-D mesh")
    names = []
    for op in graph.ops:
        legal = {s.name for s in signatures(op, mesh.shape)}
        per_axis = [next((s for pat, s in rules if fnmatch.fnmatchcase(op.name, pat)), "dp")
                    for rules in rules_per_axis]
        options = [list(dict.fromkeys((c, "dp", "rep"))) for c in per_axis]
        names.append(next((",".join(c) for c in itertools.product(*options) if ",".join(c) in legal),
                          sorted(legal)[0]))
    return Plan(name or graph.name, (StagePlan(mesh, tuple(op.name for op in graph.ops), tuple(names)),))


def template_plan(graph: LayerGraph, mesh: Mesh, template: str) -> Plan:
    """"dp", "tp", "mixed" on a 1-D mesh; "dp-tp" (outer dp, inner tp) or "dp-mixed" on 2-D."""
    parts = template.split("-")
    if any(p not in TEMPLATES for p in parts) or len(parts) != len(mesh.shape):
        raise ConfigError(f"template '{template}' does not fit a {len(mesh.shape)}-D mesh; use "
                          f"one of {sorted(TEMPLATES)} per axis joined by '-', e.g. 'dp-tp'")
    return rule_plan(graph, mesh, tuple(TEMPLATES[p] for p in parts), graph.name)
