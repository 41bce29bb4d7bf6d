"""Analytical per-iteration cost of a layer graph under an SBP plan (AutoDDL's performance model).

One training iteration of a stage on mesh M with per-op signatures s_i costs

    T = sum_i compute_i(s_i) + sum_(u->v) [box(out_u -> in_v) + box(din_v -> grad(out_u))]
        + sum_i sync_i(s_i) + internal_i(s_i) + max_d step_overhead_d

compute_i = o_k + c_i * flops_i / (prod of the axis sizes that split op i) / (r_k min_d speed_d):
a split op runs in lockstep, so the slowest mesh member sets the pace; c_i = 3 for weighted ops
(forward + data grad + weight grad), 2 for the others. Per op kind k (CostOptions, calibrated
by microbenchmarks; defaults 0 and 1): o_k is the fixed framework cost of running one op forward
and backward whatever its size or split (DTensor dispatch, sharding propagation, autograd), and
r_k the kind's throughput relative to the device's (matmul) FLOP/s, since layer norm, GELU,
softmax or pooling are memory-bound. Every collective may also pay a fixed per-call cost
(CostOptions.collective_call_s, see sbp.MeshComm): gradients are synchronised one tensor at a
time and one mesh axis at a time, so that cost is paid per tensor and per axis. The backward
boxing of an edge is the dual of the forward one (an all-gather forward is a reduce-scatter
backward). sync_i converts the weight gradient (Partial on every axis where the weight is Broadcast but the work split)
back to the weight's placement: the data-parallel gradient all-reduce, hierarchical on 2-D
meshes. Nothing overlaps (an upper bound; real runs overlap some sync with backward).

Memory per device = sum_i param_i (1 + 1 + optimizer_states) / weight split + activation_i /
activation split (every op output is kept for backward); it must fit the smallest member's
memory_bytes, or the plan is infeasible.

Pipelines (GPipe): k stages on disjoint meshes, m micro-batches of batch/m. A stage's
micro-batch time t_s (its own formula above at batch/m, plus sending the boundary activation
and its gradient over the slowest link to the next stage) repeats m times: the first
micro-batch passes every stage, the other m - 1 follow at the slowest stage's pace, forward
and backward alike: T = sum_s t_s + (m - 1) max_s t_s + max_s sync_s, a bubble of
sum_s t_s - max_s t_s ((k - 1) t for k equal stages; less when the stages are uneven, which
(m + k - 1) max_s t_s over-priced by up to a third at m = 2). All m micro-batches'
activations stay in memory.

Uneven data parallelism (StagePlan.shares, one-stage plans): row j of mesh axis 0 computes its
own share b_j of the batch on its own devices (its formula above at b_j, on the row's
sub-mesh, with its own step overhead), then the rows' gradient shards are summed over axis 0
in flat buckets: T = max_j T_j + inner sync + sum_buckets all_reduce(axis 0) (uneven_cost).
A pipeline with shares runs one pipeline per column (device j of every stage) on its own
share, each device at its own pace, then sums each stage's gradients over its devices:
T = max_j (column j's pipeline time) + max_s sync_s (column_pipeline_cost).
"""

from __future__ import annotations

import json
import math
import sys
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from hetrain.cluster import Cluster
from hetrain.errors import ConfigError
from hetrain.plan.graph import LayerGraph, Op
from hetrain.plan.sbp import (
    B,
    CollectiveFactors,
    Mesh,
    NdSbp,
    NdSignature,
    Split,
    grad_placement,
    mesh_comm,
    signatures,
    weight_grad_placement,
)


@dataclass(frozen=True)
class CostOptions:
    """Knobs of the cost model."""

    optimizer_states: float = 2.0
    """Optimizer state bytes per parameter byte (Adam: 2, SGD with momentum: 1, SGD: 0)."""
    keep_activations: bool = True
    """Count every op output as saved for backward."""
    collective_factors: CollectiveFactors = ()
    """Per-collective corrections to the ring formulas, from a profile of the collective
    library (see sbp.CollectiveFactors); () is the ideal ring."""
    collective_call_s: float = 0.0
    """Fixed seconds per collective call, whatever its group size or bytes (sbp.MeshComm)."""
    op_overhead_s: tuple[tuple[str, float], ...] = ()
    """(op kind, seconds): fixed cost of one op's forward + backward (framework dispatch);
    kinds not listed cost 0."""
    kind_speed: tuple[tuple[str, float], ...] = ()
    """(op kind, throughput / device FLOP/s); kinds not listed run at 1 (the device's FLOP/s)."""

    def __post_init__(self) -> None:
        if self.optimizer_states < 0:
            raise ConfigError("optimizer_states must be >= 0 (Adam: 2, SGD+momentum: 1)")
        if self.collective_call_s < 0 or any(v < 0 for _, v in self.op_overhead_s):
            raise ConfigError("collective_call_s and op_overhead_s must be >= 0")
        if any(v <= 0 for _, v in self.kind_speed):
            raise ConfigError("kind_speed values must be > 0")


@dataclass(frozen=True)
class StagePlan:
    """Ops (by name, contiguous in the graph) on one mesh, each with its signature name.

    `shares` (uneven data parallelism): samples of each batch that the devices at each index
    of mesh axis 0 process, in axis order, summing to the batch; every op is "dp" on axis 0.
    In a pipeline every stage carries the same shares, one per column (device j of every
    stage). Empty: an even split (DTensor's Shard(0))."""

    mesh: Mesh
    ops: tuple[str, ...]
    signatures: tuple[str, ...]
    shares: tuple[int, ...] = ()

    def rows(self) -> list[tuple[int, ...]]:
        """The devices at each index of mesh axis 0 (Mesh.rows)."""
        return self.mesh.rows()

    def inner_signatures(self) -> tuple[str, ...]:
        """The signatures without their axis-0 part ("dp,col" -> "col"; 1-D "dp" -> "dp" on a
        one-device mesh): what each row of an uneven plan runs on its own devices."""
        return tuple(s.split(",", 1)[1] if "," in s else s for s in self.signatures)


@dataclass(frozen=True)
class Plan:
    """A complete plan: one stage (pure SBP) or a pipeline of stages."""

    graph: str
    stages: tuple[StagePlan, ...]
    n_micro: int = 1

    def signature(self, op: str) -> str:
        for st in self.stages:
            if op in st.ops:
                return st.signatures[st.ops.index(op)]
        raise KeyError(op)

    def to_dict(self) -> dict[str, Any]:
        return {"graph": self.graph, "n_micro": self.n_micro, "stages": [
            {"mesh_shape": list(s.mesh.shape), "devices": list(s.mesh.devices),
             "ops": list(s.ops), "signatures": list(s.signatures),
             **({"shares": list(s.shares)} if s.shares else {})} for s in self.stages]}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Plan:
        """A plan from its dict (a saved file's keys beyond these are ignored here); every
        field's type is checked, so a damaged file fails in one line, never deeper."""
        def strs(v: Any) -> tuple[str, ...]:
            if not isinstance(v, list | tuple) or not all(isinstance(x, str) for x in v):
                raise TypeError("a list of strings")
            return tuple(v)

        def ints(v: Any) -> tuple[int, ...]:
            if not isinstance(v, list | tuple) or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise TypeError("a list of integers")
            return tuple(v)

        try:
            if not isinstance(d, dict) or not isinstance(d["stages"], list) or not d["stages"]:
                raise TypeError("stages must be a non-empty list of tables")
            n_micro = d.get("n_micro", 1)
            if not isinstance(n_micro, int) or isinstance(n_micro, bool) or n_micro < 1:
                raise TypeError("n_micro must be an integer >= 1")
            stages = []
            for s in d["stages"]:
                if not isinstance(s, dict):
                    raise TypeError("every stage must be a table")
                st = StagePlan(Mesh(ints(s["mesh_shape"]), ints(s["devices"])), strs(s["ops"]),
                               strs(s["signatures"]), ints(s.get("shares", [])))
                if len(st.ops) != len(st.signatures):
                    raise TypeError("a stage needs one signature per op")
                stages.append(st)
            plan = Plan(str(d["graph"]), tuple(stages), n_micro)
            check_shares(plan)
            return plan
        except KeyError as e:
            raise ConfigError(f"plan: missing key {e}; expected graph, stages [{{mesh_shape, "
                              "devices, ops, signatures}], n_micro") from None
        except TypeError as e:
            raise ConfigError(f"plan: malformed ({e}); expected graph, stages [{{mesh_shape, "
                              "devices, ops, signatures}], n_micro") from None

    def save(self, path: str | Path, meta: dict[str, Any] | None = None) -> None:
        """Write the plan as JSON (or TOML for a .toml path), with PLAN_FORMAT and `meta`
        (what it was searched for: model, batch, cluster), so that `hetrain run` can check
        that a plan file fits its config before it runs it."""
        p = Path(path)
        d = {"format": PLAN_FORMAT, **(meta or {}), **self.to_dict()}
        p.write_text(tomli_w.dumps(d) if p.suffix == ".toml" else json.dumps(d, indent=1))

    @staticmethod
    def load(path: str | Path) -> Plan:
        return read_plan_file(path)[0]


def check_shares(plan: Plan, batch: int | None = None) -> None:
    """Uneven shares are legal. One stage: one share >= 1 per index of mesh axis 0, every op
    data parallel on axis 0, n_micro 1. A pipeline (column_pipeline_cost): the same shares in
    every stage, one per device of its 1-D mesh, each a multiple of n_micro, every op "dp".
    Given the batch, shares summing to it. Raises TypeError (Plan.from_dict turns it into
    one ConfigError line)."""
    if len(plan.stages) > 1 and any(st.shares for st in plan.stages):
        _check_column_shares(plan)
    for st in plan.stages:
        if not st.shares:
            continue
        if len(plan.stages) == 1 and plan.n_micro > 1:
            raise TypeError("a one-stage plan with shares takes n_micro = 1")
        if len(st.shares) != st.mesh.shape[0] or min(st.shares) < 1:
            raise TypeError(f"shares {list(st.shares)} need one count >= 1 per index of mesh "
                            f"axis 0 ({st.mesh.shape[0]})")
        if any(s.split(",")[0] != "dp" for s in st.signatures):
            raise TypeError("uneven shares need every op data parallel ('dp') on mesh axis 0")
        if batch is not None and sum(st.shares) != batch:
            raise TypeError(f"shares {list(st.shares)} sum to {sum(st.shares)}, not the batch "
                            f"{batch}")


def _check_column_shares(plan: Plan) -> None:
    """A pipeline's shares: one per column (device j of every stage), the same in every
    stage, on 1-D meshes of as many devices, every op plain "dp", multiples of n_micro."""
    shares, m = plan.stages[0].shares, plan.n_micro
    if any(st.shares != shares for st in plan.stages):
        raise TypeError("a pipeline's batch shares (one per column: device j of every stage) "
                        "must be the same in every stage")
    if any(st.mesh.shape != (len(shares),) for st in plan.stages):
        raise TypeError(f"a pipeline with shares {list(shares)} needs every stage on a 1-D "
                        f"mesh of {len(shares)} devices")
    if any(s != "dp" for st in plan.stages for s in st.signatures):
        raise TypeError("a pipeline with shares needs every op data parallel ('dp')")
    if min(shares) < m or any(x % m for x in shares):
        raise TypeError(f"shares {list(shares)} must be positive multiples of n_micro ({m}): "
                        "every column splits its share into n_micro equal micro-batches")


def require_shares(plan: Plan, batch: int) -> None:
    """check_shares for a plan about to be priced or run: one ConfigError line."""
    try:
        check_shares(plan, batch)
    except TypeError as e:
        raise ConfigError(f"plan: {e}") from None


PLAN_FORMAT = 1
"""Version of a saved plan file (`Plan.save`); files without one (older) still load."""


def read_plan_file(path: str | Path) -> tuple[Plan, dict[str, Any]]:
    """(the plan, the file's other keys) from a JSON or TOML plan file: plain parsing, no
    pickle or eval; errors are one ConfigError line naming the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"plan file '{p}' not found (write one with `hetrain plan --out`)")
    try:
        text = p.read_text()
        d = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"plan file '{p}' cannot be read ({str(e).splitlines()[0][:120]}); "
                          "write it again with `hetrain plan --out`") from None
    if not isinstance(d, dict):
        raise ConfigError(f"plan file '{p}' holds {type(d).__name__}, not a plan table")
    fmt = d.get("format", PLAN_FORMAT)
    if fmt != PLAN_FORMAT:
        raise ConfigError(f"plan file '{p}' has format {fmt!r}; this hetrain reads format "
                          f"{PLAN_FORMAT}: write it again with `hetrain plan --out`")
    try:
        plan = Plan.from_dict(d)
    except ConfigError as e:
        raise ConfigError(f"plan file '{p}': {e}") from None
    meta = {k: v for k, v in d.items() if k not in ("format", "graph", "n_micro", "stages")}
    return plan, meta


@dataclass(frozen=True)
class OpCost:
    name: str
    signature: str
    compute_s: float
    comm_s: float
    """Boxing into this op (forward and backward) plus its internal collectives."""
    sync_s: float
    memory_bytes: float


@dataclass(frozen=True)
class CostReport:
    time_s: float
    compute_s: float
    comm_s: float
    sync_s: float
    bubble_s: float
    memory_bytes: float
    """Largest per-device memory over the plan's stages."""
    memory_limit_bytes: float
    ops: tuple[OpCost, ...]
    stage_s: tuple[float, ...] = ()
    """A pipeline's per-stage micro-batch times (pipeline_time_s); empty for one stage."""

    @property
    def feasible(self) -> bool:
        return self.memory_bytes <= self.memory_limit_bytes


def _bias_of(op: Op, w: NdSbp) -> tuple[tuple[int, ...], NdSbp] | None:
    """The bias (or second LN tensor) as a separate 1-D tensor: split where the weight's output
    dim is split, else broadcast."""
    rest = op.param_bytes / op.dtype_bytes - math.prod(op.weight_shape)
    if rest <= 0:
        return None
    return (int(rest),), tuple(Split(0) if s == Split(0) and op.kind != "embedding" else B
                               for s in w)


@lru_cache(maxsize=8192)
def _anon(op: Op) -> Op:
    """The op without its identity: equal for every block of a transformer (a cache key)."""
    return replace(op, name="", inputs=tuple("" for _ in op.inputs))


_NodeTables = tuple[list[NdSignature], np.ndarray, np.ndarray, np.ndarray, np.ndarray]
_EdgeTables = dict[tuple[Op, Op, int], np.ndarray]
_SHARED: OrderedDict[tuple[Mesh, Cluster, CostOptions],
                     tuple[dict[Op, _NodeTables], _EdgeTables]] = OrderedDict()


def _shared_tables(mesh: Mesh, cluster: Cluster, options: CostOptions
                   ) -> tuple[dict[Op, _NodeTables], dict[tuple[Op, Op, int], np.ndarray]]:
    """The node and edge tables already computed on this mesh, cluster and options, keyed by
    anonymous op (a pipeline stage's sub-graph reuses the whole graph's; 64 contexts kept)."""
    key = (mesh, cluster, options)
    got = _SHARED.get(key)
    if got is None:
        got = _SHARED[key] = ({}, {})
        while len(_SHARED) > 64:
            _SHARED.popitem(last=False)
    else:
        _SHARED.move_to_end(key)
    return got


def clear_caches() -> None:
    """Forget every cached table (for cold-cache timings)."""
    stage_tables.cache_clear()
    _device_stage.cache_clear()
    _anon.cache_clear()
    _SHARED.clear()


class StageTables:
    """Per-op and per-edge cost tables of one graph on one mesh, for fast search.

    node_time[i][s], node_mem[i][s] and edge[e][s_u, s_v] (numpy); identical ops (every block
    of a transformer, the same op in a stage's sub-graph) share their tables, which are
    never modified in place."""

    def __init__(self, graph: LayerGraph, mesh: Mesh, cluster: Cluster,
                 options: CostOptions | None = None):
        self.graph, self.mesh, self.cluster = graph, mesh, cluster
        self.options = options or CostOptions()
        self.comm = mesh_comm(cluster, mesh, self.options.collective_factors,
                              self.options.collective_call_s)
        members = [cluster.devices[d] for d in mesh.devices]
        self.min_speed = min(d.flops for d in members)
        self.memory_limit_bytes = min(d.memory_bytes for d in members)
        self.overhead_s = max(d.step_overhead_s for d in members)
        cache, ecache = _shared_tables(mesh, cluster, self.options)
        self.sigs, self.compute, self.internal, self.sync, self.mem = [], [], [], [], []
        for op in graph.ops:
            key = _anon(op)
            if key not in cache:
                cache[key] = self._node(op)
            sg, c, i, s, m = cache[key]
            self.sigs.append(sg)
            self.compute.append(c)
            self.internal.append(i)
            self.sync.append(s)
            self.mem.append(m)
            if not sg:
                raise ConfigError(f"op '{op.name}' has no legal signature on mesh {mesh.label}")
        self.node_time = [c + i + s for c, i, s in zip(self.compute, self.internal, self.sync, strict=True)]
        self.edges = graph.edges()
        self.edge = []
        for u, v, slot in self.edges:
            key2 = (_anon(graph.ops[u]), _anon(graph.ops[v]), slot)
            if key2 not in ecache:
                ecache[key2] = self._edge(u, v, slot)
            self.edge.append(ecache[key2])

    def _node(self, op: Op) -> _NodeTables:
        ms, sigs = self.mesh.shape, signatures(op, self.mesh.shape)
        factor = 3.0 if op.weight_shape else 2.0
        overhead = dict(self.options.op_overhead_s).get(op.kind, 0.0)
        speed = self.min_speed * dict(self.options.kind_speed).get(op.kind, 1.0)
        comp, inter, sync, mem = (np.zeros(len(sigs)) for _ in range(4))
        for k, sg in enumerate(sigs):
            split = math.prod(p for p, a in zip(ms, sg.axes, strict=True) if a.split)
            comp[k] = overhead + factor * op.flops / split / speed
            w = sg.weight
            if w is not None:
                grad = tuple(weight_grad_placement(a.split, wk)
                             for a, wk in zip(sg.axes, w, strict=True))
                sync[k] = self.comm.boxing_s(grad, w, op.weight_shape, op.dtype_bytes)
                bias = _bias_of(op, w)
                if bias is not None:
                    bg = tuple(weight_grad_placement(a.split, bw) for a, bw in zip(sg.axes, bias[1], strict=True))
                    sync[k] += self.comm.boxing_s(bg, bias[1], bias[0], op.dtype_bytes)
                wsplit = math.prod(p for p, s in zip(ms, w, strict=True) if isinstance(s, Split))
                mem[k] += op.param_bytes * (2 + self.options.optimizer_states) / wsplit
            if op.kind == "cross_entropy":
                rows = math.prod(op.in_shapes[0]) / op.in_shapes[0][op.fdim]
                for ax, a in enumerate(sg.axes):
                    if a.name == "vocab":
                        local = rows / math.prod(p for j, p in enumerate(ms)
                                                 if j != ax and isinstance(sg.axes[j].ins[0], Split))
                        inter[k] += self.comm.collective_s("all_reduce", ax, 3 * local * 4)
            if self.options.keep_activations and op.out_shape:
                osplit = math.prod(p for p, s in zip(ms, sg.out, strict=True) if isinstance(s, Split))
                mem[k] += op.out_bytes / osplit
        return sigs, comp, inter, sync, mem

    def _edge(self, u: int, v: int, slot: int) -> np.ndarray:
        pu, _cv = self.graph.ops[u], self.graph.ops[v]
        shape, dt = pu.out_shape, pu.dtype_bytes
        m = np.zeros((len(self.sigs[u]), len(self.sigs[v])))
        for a, su in enumerate(self.sigs[u]):
            need = tuple(grad_placement(x) for x in su.out)
            for b, sv in enumerate(self.sigs[v]):
                m[a, b] = (self.comm.boxing_s(su.out, sv.ins(slot), shape, dt)
                           + self.comm.boxing_s(sv.din(slot), need, shape, dt))
        return m

    # ---- evaluation -------------------------------------------------------------------------
    def time_s(self, assign: list[int] | np.ndarray) -> float:
        t = sum(float(self.node_time[i][s]) for i, s in enumerate(assign))
        t += sum(float(self.edge[e][assign[u], assign[v]]) for e, (u, v, _) in enumerate(self.edges))
        return t + self.overhead_s

    def memory_bytes(self, assign: list[int] | np.ndarray) -> float:
        return sum(float(self.mem[i][s]) for i, s in enumerate(assign))

    def index_of(self, names: tuple[str, ...]) -> list[int]:
        """Signature indices from signature names (as a Plan stores them)."""
        out = []
        for op, sigs, name in zip(self.graph.ops, self.sigs, names, strict=True):
            found = [k for k, s in enumerate(sigs) if s.name == name]
            if not found:
                raise ConfigError(f"op '{op.name}': signature '{name}' is not legal on mesh "
                                  f"{self.mesh.label}; legal: {[s.name for s in sigs]}")
            out.append(found[0])
        return out

    def op_costs(self, assign: list[int] | np.ndarray) -> list[OpCost]:
        comm = [float(self.internal[i][s]) for i, s in enumerate(assign)]
        for e, (u, v, _) in enumerate(self.edges):
            comm[v] += float(self.edge[e][assign[u], assign[v]])
        return [OpCost(op.name, self.sigs[i][s].name, float(self.compute[i][s]), comm[i],
                       float(self.sync[i][s]), float(self.mem[i][s]))
                for i, (op, s) in enumerate(zip(self.graph.ops, assign, strict=True))]


def _boundary_link_s(cluster: Cluster, a: Mesh, b: Mesh, nbytes: float) -> float:
    links = [cluster.link_between(i, j) for i in a.devices for j in b.devices]
    return max(lk.latency_s for lk in links) + nbytes / min(lk.bandwidth_Bps for lk in links)


def stage_graphs(graph: LayerGraph, plan: Plan) -> list[tuple[int, int]]:
    """(start, stop) op index ranges of the plan's stages (checked contiguous and complete)."""
    out, start = [], 0
    for st in plan.stages:
        stop = start + len(st.ops)
        if tuple(op.name for op in graph.ops[start:stop]) != st.ops:
            raise ConfigError(f"plan stage ops do not match graph '{graph.name}' at op {start}")
        out.append((start, stop))
        start = stop
    if start != len(graph.ops):
        raise ConfigError(f"plan covers {start} of {len(graph.ops)} ops of graph '{graph.name}'")
    return out


@lru_cache(maxsize=128)
def stage_tables(graph: LayerGraph, mesh: Mesh, cluster: Cluster,
                 options: CostOptions | None = None) -> StageTables:
    """Cached StageTables (search and plan_cost price the same stages again and again)."""
    return StageTables(graph, mesh, cluster, options)


def plan_cost(graph: LayerGraph, plan: Plan, cluster: Cluster,
              options: CostOptions | None = None) -> CostReport:
    """Predicted iteration time and per-device memory of `plan` (see the module docstring)."""
    if plan.stages[0].shares:
        if len(plan.stages) > 1:
            return column_pipeline_cost(graph, plan, cluster, options)
        return uneven_cost(graph, plan, cluster, options)
    m, k = plan.n_micro, len(plan.stages)
    if m < 1 or graph.batch % m:
        raise ConfigError(f"batch {graph.batch} is not divisible by n_micro={m}")
    micro = graph.scaled(1.0 / m) if m > 1 else graph
    stage_t, syncs, mems, limits, overheads = [], [], [], [], []
    ops: list[OpCost] = []
    for s, ((a, b), st) in enumerate(zip(stage_graphs(graph, plan), plan.stages, strict=True)):
        tab = stage_tables(micro.subgraph(a, b) if k > 1 else micro, st.mesh, cluster, options)
        assign = tab.index_of(st.signatures)
        oc = tab.op_costs(assign)
        sync = sum(o.sync_s for o in oc)
        t = tab.time_s(assign) - sync - tab.overhead_s
        if s + 1 < k:
            t += 2 * _boundary_link_s(cluster, st.mesh, plan.stages[s + 1].mesh,
                                      micro.ops[b - 1].out_bytes)
        mems.append(memory_with_micro(tab, assign, m))
        stage_t.append(t)
        syncs.append(sync)
        limits.append(tab.memory_limit_bytes)
        overheads.append(tab.overhead_s)
        ops += oc
    time_s = pipeline_time_s(stage_t, m) + max(syncs) + max(overheads)
    worst = max(range(k), key=lambda j: mems[j] - limits[j])
    return CostReport(time_s, sum(o.compute_s for o in ops) * m, sum(o.comm_s for o in ops) * m,
                      max(syncs), sum(stage_t) - max(stage_t), mems[worst], limits[worst],
                      tuple(ops), tuple(stage_t) if k > 1 else ())


def pipeline_time_s(stage_s: list[float], n_micro: int) -> float:
    """GPipe's (and 1F1B's) forward and backward over n_micro micro-batches whose time on
    stage s is stage_s[s]: the first micro-batch passes every stage, the others follow at the
    slowest stage's pace (a flow shop of identical jobs; exact when a stage's backward takes a
    fixed multiple of its forward)."""
    return sum(stage_s) + (n_micro - 1) * max(stage_s)


def row_tables(graph: LayerGraph, row: tuple[int, ...], share: float, cluster: Cluster,
               options: CostOptions | None = None) -> StageTables:
    """Tables of one row of an uneven plan: the graph at `share` samples on the row's devices
    (1-D plans: one device)."""
    return stage_tables(graph.scaled(share / graph.batch), Mesh((len(row),), row), cluster, options)


BUCKET_BYTES = 25 * 2**20
"""Gradients are summed over the columns in flat buckets of at most this many bytes (DDP's
default bucket size): one all_reduce per bucket, not per tensor, since a collective call's
fixed cost (~1 ms over gloo here) dwarfs a small tensor's transfer."""


def buckets(nbytes: list[int], cap: int = BUCKET_BYTES) -> list[list[int]]:
    """Consecutive tensor indices grouped into buckets of at most `cap` bytes (a larger
    tensor alone in its own); parallel.uneven sums gradients so."""
    out: list[list[int]] = []
    size = cap
    for i, n in enumerate(nbytes):
        if not out or size + n > cap:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def _shard_bytes(op: Op, inner: NdSignature, inner_shape: tuple[int, ...]) -> list[int]:
    """Bytes of one row member's gradient shards of the op (weight, then bias)."""
    w = inner.weight
    if w is None:
        return []
    wsplit = math.prod(p for p, x in zip(inner_shape, w, strict=True) if isinstance(x, Split))
    out = [int(math.prod(op.weight_shape) * op.dtype_bytes // wsplit)]
    bias = _bias_of(op, w)
    if bias is not None:
        bsplit = math.prod(p for p, x in zip(inner_shape, bias[1], strict=True)
                           if isinstance(x, Split))
        out.append(int(bias[0][0] * op.dtype_bytes // bsplit))
    return out


def uneven_cost(graph: LayerGraph, plan: Plan, cluster: Cluster,
                options: CostOptions | None = None) -> CostReport:
    """Uneven data parallelism (StagePlan.shares), as parallel.uneven runs it: row j computes
    its share alone (its own tables at shares[j] samples, its inner signatures on its devices),
    then the gradient shards (and the loss) are summed over mesh axis 0 in flat buckets, one
    all-reduce per bucket (the ops' rows show their inner sync only). T = max_j (row j's
    compute, inner communication and step overhead) + inner sync + outer all-reduce. Each
    row's memory must fit its smallest member."""
    require_shares(plan, graph.batch)
    st = plan.stages[0]
    if tuple(op.name for op in graph.ops) != st.ops:
        raise ConfigError(f"plan stage ops do not match graph '{graph.name}'")
    inner = st.inner_signatures()
    o = options or CostOptions()
    comm = mesh_comm(cluster, st.mesh, o.collective_factors, o.collective_call_s)
    rows = []
    for row, share in zip(st.rows(), st.shares, strict=True):
        tab = row_tables(graph, row, share, cluster, options)
        a = tab.index_of(inner)
        oc = tab.op_costs(a)
        sync = sum(x.sync_s for x in oc)
        rows.append((tab.time_s(a) - sync, sync, tab, a, oc))  # with the row's step overhead
    slow = max(range(len(rows)), key=lambda j: rows[j][0])
    t_slow, _, tab, a, oc = rows[slow]
    inner_shape = tab.mesh.shape
    shards = [n for i, op in enumerate(graph.ops)
              for n in _shard_bytes(op, tab.sigs[i][a[i]], inner_shape)] + [4]  # + the loss
    outer = sum(comm.collective_s("all_reduce", 0, sum(shards[k] for k in b))
                for b in buckets(shards))
    sync = max(r[1] for r in rows) + outer
    ops = tuple(replace(x, signature=name) for x, name in zip(oc, st.signatures, strict=True))
    excess = [(r[2].memory_bytes(r[3]), r[2].memory_limit_bytes) for r in rows]
    mem, limit = max(excess, key=lambda e: e[0] - e[1])
    return CostReport(t_slow + sync, sum(x.compute_s for x in oc),
                      sum(x.comm_s for x in oc), sync, 0.0, mem, limit, ops)


@dataclass(frozen=True)
class ColumnStage:
    """One device's part of a column pipeline: its stage at the column's micro-batch."""

    time_s: float
    """Forward + backward of one micro-batch, with sending the boundary activation (and
    receiving its gradient) to the next stage's device in the column."""
    memory_bytes: float
    """With every micro-batch's activations alive."""
    memory_limit_bytes: float
    overhead_s: float
    ops: tuple[OpCost, ...]
    grad_bytes: tuple[int, ...]
    """The stage's gradient tensors (what its devices sum)."""


def column_stages(graph: LayerGraph, plan: Plan, column: tuple[int, ...], micro_samples: float,
                  cluster: Cluster, options: CostOptions | None = None) -> list[ColumnStage]:
    """Column `column` (device j of every stage) of a pipeline plan running micro-batches of
    `micro_samples` samples, each device computing its stage's ops whole ("dp" on a mesh of
    one device), priced stage by stage."""
    micro = graph.scaled(micro_samples / graph.batch)
    out = []
    for s, ((a, b), dev) in enumerate(zip(stage_graphs(graph, plan), column, strict=True)):
        # a one-device mesh has no links: alike devices share one pricing
        alone = _device_stage(micro.subgraph(a, b), _first_alike(cluster, dev), cluster, options,
                              plan.n_micro)
        if s + 1 < len(column):
            alone = replace(alone, time_s=alone.time_s + 2 * _boundary_link_s(
                cluster, Mesh((1,), (dev,)), Mesh((1,), (column[s + 1],)),
                micro.ops[b - 1].out_bytes))
        out.append(alone)
    return out


@lru_cache(maxsize=4096)
def _device_stage(sub: LayerGraph, device: int, cluster: Cluster, options: CostOptions | None,
                  n_micro: int) -> ColumnStage:
    """A stage's ops whole on one device (no boundary transfer), n_micro micro-batches'
    activations alive."""
    tab = StageTables(sub, Mesh((1,), (device,)), cluster, options)
    assign = tab.index_of(("dp",) * len(sub.ops))
    grads = tuple(n for i, op in enumerate(sub.ops)
                  for n in _shard_bytes(op, tab.sigs[i][assign[i]], (1,)))
    return ColumnStage(tab.time_s(assign) - tab.overhead_s, memory_with_micro(tab, assign, n_micro),
                       tab.memory_limit_bytes, tab.overhead_s, tuple(tab.op_costs(assign)), grads)


def device_kind(cluster: Cluster, device: int) -> tuple[float, float, float]:
    """What a device computes at, as the cost model sees it: speed, memory, step overhead."""
    d = cluster.devices[device]
    return d.flops, d.memory_bytes, d.step_overhead_s


def _first_alike(cluster: Cluster, device: int) -> int:
    """The first device of the cluster of this one's kind (device_kind)."""
    kind = device_kind(cluster, device)
    return next(i for i in range(cluster.n) if device_kind(cluster, i) == kind)


def column_pipeline_cost(graph: LayerGraph, plan: Plan, cluster: Cluster,
                         options: CostOptions | None = None) -> CostReport:
    """A pipeline with batch shares, as parallel.pipeline runs it: column j (device j of every
    stage) is a pipeline of its own over n_micro micro-batches of shares[j] / n_micro samples,
    each device running its stage's ops whole on them (column_stages: its own speed and step
    overhead) and sending the column's slice of the boundary activation to the next stage's
    device j; then each stage's gradients (and the last stage's loss) are summed over its
    devices in flat buckets, the stages at once. T = max_j (pipeline_time_s(column j's stage
    times) + its devices' largest step overhead) + max_s sync_s. Memory: each device at its
    column's micro-batch with every micro-batch's activations alive, within its own cap."""
    require_shares(plan, graph.batch)
    m, k = plan.n_micro, len(plan.stages)
    o = options or CostOptions()
    priced = [column_stages(graph, plan, column, share / m, cluster, options)
              for share, column in zip(plan.stages[0].shares,
                                       zip(*(st.mesh.devices for st in plan.stages), strict=True),
                                       strict=True)]

    def column_s(c: list[ColumnStage]) -> float:
        return pipeline_time_s([x.time_s for x in c], m) + max(x.overhead_s for x in c)

    slowest = max(priced, key=column_s)
    syncs = []
    for s, st in enumerate(plan.stages):
        comm = mesh_comm(cluster, st.mesh, o.collective_factors, o.collective_call_s)
        shards = [*slowest[s].grad_bytes, *([4] if s == k - 1 else [])]  # + the last stage's loss
        syncs.append(sum(comm.collective_s("all_reduce", 0, sum(shards[i] for i in idx))
                         for idx in buckets(shards)) if len(st.mesh.devices) > 1 else 0.0)
    times = [x.time_s for x in slowest]
    ops = tuple(op for x in slowest for op in x.ops)
    mem, limit = max(((x.memory_bytes, x.memory_limit_bytes) for c in priced for x in c),
                     key=lambda e: e[0] - e[1])
    return CostReport(column_s(slowest) + max(syncs),
                      sum(x.compute_s for x in ops) * m, sum(x.comm_s for x in ops) * m,
                      max(syncs), sum(times) - max(times), mem, limit, ops, tuple(times))


def training_flops_per_sample(graph: LayerGraph) -> float:
    """FLOPs of one sample's forward and backward as the cost model counts them (3x the
    forward for ops with weights: data and weight gradients; 2x for the others)."""
    return sum((3.0 if op.weight_shape else 2.0) * op.flops for op in graph.ops) / graph.batch


def device_work_fraction(graph: LayerGraph, mesh_shape: tuple[int, ...],
                         signatures: Mapping[str, NdSignature]) -> float:
    """The share of `graph`'s training FLOPs that one device of a mesh of `mesh_shape`
    computes under `signatures` (op name -> signature): the cost model's compute term, each
    op's FLOPs over the mesh axes its signature splits. 1/d for data parallelism on d
    devices; more under tensor parallelism, whose unsplit ops every device runs whole; 1
    for a replicated plan. What speed emulation pads a device's step to (parallel.execute,
    parallel.pipeline), so the emulated devices do the work the model priced."""
    total = mine = 0.0
    for op in graph.ops:
        work = (3.0 if op.weight_shape else 2.0) * op.flops
        axes = signatures[op.name].axes
        total += work
        mine += work / math.prod(p for p, a in zip(mesh_shape, axes, strict=True) if a.split)
    return mine / total if total > 0 else 1.0


def micro_memory(tab: StageTables, m: int) -> list[np.ndarray]:
    """tab.mem (per op, per signature) with m micro-batches' activations alive (GPipe): tab
    prices one micro-batch, whose activations are 1/m of the batch's."""
    out = []
    for i, op in enumerate(tab.graph.ops):
        mem = tab.mem[i].copy()
        if m > 1 and tab.options.keep_activations and op.out_shape:
            for s, sg in enumerate(tab.sigs[i]):
                osplit = math.prod(p for p, x in zip(tab.mesh.shape, sg.out, strict=True)
                                   if isinstance(x, Split))
                mem[s] += op.out_bytes / osplit * (m - 1)
        out.append(mem)
    return out


def memory_with_micro(tab: StageTables, assign: list[int], m: int) -> float:
    """Per-device memory with m micro-batches' activations alive (GPipe)."""
    mem = micro_memory(tab, m)
    return sum(float(mem[i][s]) for i, s in enumerate(assign))


def plan_summary(report: CostReport) -> dict[str, Any]:
    """A JSON-friendly summary (no per-op rows)."""
    d = asdict(report)
    d.pop("ops")
    d["feasible"] = report.feasible
    return d
