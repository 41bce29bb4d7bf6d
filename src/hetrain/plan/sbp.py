"""SBP placements, operator signatures and boxing costs on 1-D and 2-D device meshes (AutoDDL).

A tensor on a mesh axis is Split(dim) (each of the axis' p devices holds a 1/p slice along
`dim`), Broadcast (every device holds all of it) or Partial (every device holds a full-shape
summand; the value is the sum). On an n-D mesh a tensor has one placement per axis (an NdSbp).
These are DTensor's Shard(dim), Replicate() and Partial().

Boxing (converting placements) is charged with ring collectives over the Cluster's alpha-beta
links. Convention: T is the tensor bytes held by one axis group; per device a ring
all-gather or reduce-scatter moves T(p-1)/p, an all-reduce 2T(p-1)/p, an all-to-all T(p-1)/p^2
(in total over the group: T(p-1), T(p-1), 2T(p-1), T(p-1)/p: OneFlow's table). In time:

    all-gather, reduce-scatter   (p-1) (alpha + T / (p beta))
    all-reduce                  2(p-1) (alpha + T / (p beta))
    all-to-all                   sum over p-1 pairwise rounds of (alpha_r + T / (p^2 beta_r))

plus an optional fixed cost per call (MeshComm.call_s, default 0).
B->S, B->P, S->P are local (free). alpha is the slowest hop's latency, beta the narrowest
hop's bandwidth, where concurrent rings of one mesh axis that leave a site share its WAN
uplink (so the outer axis of a sites x local mesh pays WAN bandwidth / (rings crossing)).
On an n-D mesh boxing changes one axis at a time; a shortest path over intermediate
placements finds e.g. the hierarchical all-reduce (reduce-scatter inside the site, all-reduce
across sites on 1/p of the bytes, all-gather inside); `boxing_path` gives that route so the
executor can follow it.

Signatures are restricted to what the DTensor executor runs (torch 2.13): convolutions split
the batch only (no channel parallelism, no batch split over both axes of a 2-D mesh), and the
vocab-parallel loss is 1-D only.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

from hetrain.cluster import Cluster
from hetrain.errors import ConfigError
from hetrain.plan.graph import Op


@dataclass(frozen=True)
class Split:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Broadcast:
    def __str__(self) -> str:
        return "B"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


Sbp = Split | Broadcast | Partial
NdSbp = tuple[Sbp, ...]
CollectiveFactors = tuple[tuple[str, float, float], ...]
"""(collective, latency factor, time-per-byte factor) measured against the ring formula, for a
collective library that departs from it (e.g. gloo's all-gather is as slow as its all-reduce)."""
B, P = Broadcast(), Partial()


def grad_placement(fwd: Sbp) -> Sbp:
    """Placement a producer needs the gradient of its output in: a Split output needs a split
    gradient; a Broadcast or Partial output needs the full (Broadcast) gradient."""
    return fwd if isinstance(fwd, Split) else B


def weight_grad_placement(split: bool, weight: Sbp) -> Sbp:
    """A weight gradient's placement on one axis: Partial when the axis splits the work but
    the weight is Broadcast (each device holds a partial sum: data parallelism), else as the
    weight (a split weight's gradient is split; redundant work gives a replicated gradient)."""
    return P if split and weight == B else weight


@dataclass(frozen=True)
class Signature:
    """A legal 1-D SBP signature of an operator on one mesh axis."""

    name: str
    ins: tuple[Sbp, ...]
    out: Sbp
    weight: Sbp | None
    """Placement of the main weight (None: parameter-free op)."""
    din: tuple[Sbp, ...]
    """Placements of the input gradients the op's backward produces."""
    split: bool
    """True when the axis' devices divide the work; False when each repeats it all."""


def _catalog(op: Op) -> list[Signature]:
    s0, sf = Split(0), Split(op.fdim)
    rep = Signature("rep", (B,) * len(op.inputs), B, B if op.weight_shape else None,
                    (B,) * len(op.inputs), False)
    if op.kind == "conv":  # DTensor's convolution shards the batch only (torch 2.13)
        return [Signature("dp", (s0,), s0, B, (s0,), True), rep]
    if op.kind == "linear":
        return [Signature("dp", (s0,), s0, B, (s0,), True),
                Signature("col", (B,), sf, Split(0), (P,), True),
                Signature("row", (sf,), P, Split(1), (sf,), True), rep]
    if op.kind == "embedding":
        return [Signature("dp", (s0,), s0, B, (s0,), True),
                Signature("col", (B,), sf, Split(1), (B,), True),
                Signature("vocab", (B,), P, Split(0), (B,), True), rep]
    if op.kind == "layernorm":
        return [Signature("dp", (s0,), s0, B, (s0,), True), rep]
    if op.kind == "cross_entropy":
        return [Signature("dp", (s0,), P, None, (s0,), True),
                Signature("vocab", (sf,), P, None, (sf,), True), rep]
    n = len(op.inputs)
    feat = "heads" if op.kind == "attention" else "feat"
    sigs = [Signature("dp", (s0,) * n, s0, None, (s0,) * n, True),
            Signature(feat, (sf,) * n, sf, None, (sf,) * n, True), rep]
    if op.kind in ("reshape", "add"):
        sigs.append(Signature("partial", (P,) * n, P, None, (B,) * n, True))
    return sigs


def _divides(shape: tuple[int, ...], nd: NdSbp, mesh_shape: tuple[int, ...]) -> bool:
    for d, size in enumerate(shape):
        k = math.prod(p for p, s in zip(mesh_shape, nd, strict=True) if s == Split(d))
        if size % k:
            return False
    return all(not isinstance(s, Split) or s.dim < len(shape) for s in nd)


@dataclass(frozen=True)
class NdSignature:
    """One 1-D signature per mesh axis; its name joins theirs ("dp,col")."""

    axes: tuple[Signature, ...]

    @property
    def name(self) -> str:
        return ",".join(s.name for s in self.axes)

    def ins(self, slot: int) -> NdSbp:
        return tuple(s.ins[slot] for s in self.axes)

    def din(self, slot: int) -> NdSbp:
        return tuple(s.din[slot] for s in self.axes)

    @property
    def out(self) -> NdSbp:
        return tuple(s.out for s in self.axes)

    @property
    def weight(self) -> NdSbp | None:
        return None if self.axes[0].weight is None else tuple(s.weight for s in self.axes)  # type: ignore[misc]


def signatures(op: Op, mesh_shape: tuple[int, ...]) -> list[NdSignature]:
    """The legal signatures of `op` on a mesh: products of 1-D ones whose splits divide."""
    out = []
    for combo in itertools.product(_catalog(op), repeat=len(mesh_shape)):
        nd = NdSignature(combo)
        ok = all(_divides(shp, nd.ins(k), mesh_shape) for k, shp in enumerate(op.in_shapes))
        ok = ok and _divides(op.out_shape, nd.out, mesh_shape) if op.out_shape else ok
        if ok and nd.weight is not None:
            ok = _divides(op.weight_shape, nd.weight, mesh_shape)
        if ok and op.kind == "conv" and len(mesh_shape) > 1:
            ok = any(a.name != "dp" for a in combo)  # its conv handler rejects [Shard(0), Shard(0)]
        if ok and op.kind == "cross_entropy" and len(mesh_shape) > 1:
            ok = all(a.name != "vocab" for a in combo)  # torch's loss_parallel mean is 1-D only
        if ok and op.heads:
            k = math.prod(p for p, s in zip(mesh_shape, combo, strict=True) if s.name == "heads")
            ok = op.heads % k == 0
        if ok:
            out.append(nd)
    return out


@dataclass(frozen=True)
class Mesh:
    """A logical device mesh: `devices` (Cluster indices) laid out row-major in `shape`.
    Axis 0 is the outer axis (across sites), the last axis the inner one (inside a site)."""

    shape: tuple[int, ...]
    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.shape) not in (1, 2) or math.prod(self.shape) != len(self.devices):
            raise ConfigError(f"mesh shape {self.shape} does not hold {len(self.devices)} devices")
        if len(set(self.devices)) != len(self.devices):
            raise ConfigError(f"mesh devices {self.devices} repeat a device")

    @property
    def label(self) -> str:
        return "x".join(map(str, self.shape))

    def groups(self, axis: int) -> list[tuple[int, ...]]:
        """The device groups that run one collective each along `axis` (concurrently)."""
        if len(self.shape) == 1:
            return [self.devices]
        a, b = self.shape
        rows = [self.devices[i * b:(i + 1) * b] for i in range(a)]
        return rows if axis == 1 else [tuple(r[j] for r in rows) for j in range(b)]

    def rows(self) -> list[tuple[int, ...]]:
        """The devices at each index of axis 0: one device each on a 1-D mesh, a row of the
        inner axis (groups(1)) on a 2-D one."""
        return self.groups(1) if len(self.shape) == 2 else [(d,) for d in self.devices]


@lru_cache(maxsize=1024)
def _valid_states(divisible: tuple[tuple[bool, ...], ...], ms: tuple[int, ...]) -> frozenset[NdSbp]:
    """The placements (one per axis) of a tensor whose dim d is divisible by mesh axis sizes
    as `divisible[d]` says (per axis, then by the whole mesh): the Dijkstra states."""
    ks = (*ms, math.prod(ms))
    # a representative shape with the same divisibility: the lcm of the sizes that divide
    shape = tuple(math.lcm(*(k for k, ok in zip(ks, div, strict=True) if ok), 1) for div in divisible)
    options: list[Sbp] = [B, P, *(Split(d) for d in range(len(shape)))]
    return frozenset(nd for nd in itertools.product(options, repeat=len(ms)) if _divides(shape, nd, ms))


@lru_cache(maxsize=256)
def mesh_comm(cluster: Cluster, mesh: Mesh, factors: CollectiveFactors = (),
              call_s: float = 0.0) -> MeshComm:
    """The (cached) MeshComm of a mesh: boxing results are reused across searches."""
    return MeshComm(cluster, mesh, factors, call_s)


class MeshComm:
    """Collective and boxing times on one mesh of one cluster (cached).

    `call_s` is a fixed cost per collective call on top of the ring formula, whatever the
    group size: the framework's and library's per-call work (DTensor redistribute, process
    wake-ups), which the per-hop alpha does not scale like. It makes boxing paths with fewer
    steps cheaper (an all-reduce per mesh axis beats reduce-scatter, all-reduce, all-gather
    for small tensors)."""

    def __init__(self, cluster: Cluster, mesh: Mesh, factors: CollectiveFactors = (),
                 call_s: float = 0.0):
        if call_s < 0:
            raise ConfigError(f"collective call_s must be >= 0, got {call_s}")
        self.cluster, self.mesh, self.call_s = cluster, mesh, call_s
        self.factors = {k: (fa, fb) for k, fa, fb in factors}
        for i in mesh.devices:
            if not 0 <= i < cluster.n:
                raise ConfigError(f"mesh device {i} is not in cluster '{cluster.name}' (n={cluster.n})")
        self.ring = [self._flows_alpha_beta(self._ring_flows(ax)) for ax in range(len(mesh.shape))]
        self.rounds = [[self._flows_alpha_beta(fl) for fl in self._a2a_flows(ax)]
                       for ax in range(len(mesh.shape))]
        self._box = lru_cache(maxsize=None)(self._boxing_s)
        self._from = lru_cache(maxsize=None)(self._distances)

    def _ring_flows(self, axis: int) -> list[tuple[int, int]]:
        flows = []
        for g in self.mesh.groups(axis):
            ring = sorted(g, key=lambda k: (self.cluster.devices[k].site, k))
            flows += [(ring[k], ring[(k + 1) % len(ring)]) for k in range(len(ring))] if len(ring) > 1 else []
        return flows

    def _a2a_flows(self, axis: int) -> list[list[tuple[int, int]]]:
        groups = self.mesh.groups(axis)
        p = len(groups[0])
        return [[(g[k], g[(k + r) % p]) for g in groups for k in range(p)] for r in range(1, p)]

    def _flows_alpha_beta(self, flows: list[tuple[int, int]]) -> tuple[float, float]:
        """(max latency, min bandwidth) of concurrent flows; WAN uplinks are shared."""
        if not flows:
            return 0.0, math.inf
        devs = self.cluster.devices
        out: dict[str, int] = {}
        inn: dict[str, int] = {}
        for i, j in flows:
            if devs[i].site != devs[j].site:
                out[devs[i].site] = out.get(devs[i].site, 0) + 1
                inn[devs[j].site] = inn.get(devs[j].site, 0) + 1
        lat, bw = 0.0, math.inf
        for i, j in flows:
            si, sj = devs[i].site, devs[j].site
            if si == sj:
                b = self.cluster.site(si).lan.bandwidth_Bps
            else:
                b = min(self.cluster.site(si).wan.bandwidth_Bps / out[si],
                        self.cluster.site(sj).wan.bandwidth_Bps / inn[sj])
            for own in (devs[i].link, devs[j].link):
                b = min(b, own.bandwidth_Bps) if own is not None else b
            lat, bw = max(lat, self.cluster.link_between(i, j).latency_s), min(bw, b)
        return lat, bw

    # ---- collectives (T = bytes held by one group) -----------------------------------------
    def collective_s(self, kind: str, axis: int, nbytes: float) -> float:
        p = self.mesh.shape[axis]
        if p == 1 or nbytes <= 0:
            return 0.0
        fa, fb = self.factors.get(kind, (1.0, 1.0))
        alpha, beta = self.ring[axis]
        alpha, beta = fa * alpha, beta / fb
        if kind in ("all_gather", "reduce_scatter"):
            ring = (p - 1) * (alpha + nbytes / (p * beta))
        elif kind == "all_reduce":
            ring = 2 * (p - 1) * (alpha + nbytes / (p * beta))
        elif kind == "all_to_all":
            ring = sum(fa * a + fb * nbytes / (p * p * b) for a, b in self.rounds[axis])
        else:
            raise ValueError(f"unknown collective '{kind}'")
        return self.call_s + ring

    @staticmethod
    def transition(src: Sbp, dst: Sbp) -> str | None:
        """The collective converting src to dst on one axis (None: local, free)."""
        if src == dst or isinstance(src, Broadcast) or isinstance(dst, Partial):
            return None
        if isinstance(src, Split):
            return "all_gather" if isinstance(dst, Broadcast) else "all_to_all"
        return "all_reduce" if isinstance(dst, Broadcast) else "reduce_scatter"

    def boxing_s(self, src: NdSbp, dst: NdSbp, shape: tuple[int, ...], dtype_bytes: int = 4) -> float:
        """Cheapest time to convert a tensor of logical `shape` from src to dst placements."""
        if src == dst:
            return 0.0
        return self._box(src, dst, shape, dtype_bytes)

    def _boxing_s(self, src: NdSbp, dst: NdSbp, shape: tuple[int, ...], dtype_bytes: int) -> float:
        if len(self.mesh.shape) == 1:
            kind = self.transition(src[0], dst[0])
            total = float(math.prod(shape)) * dtype_bytes
            return 0.0 if kind is None else self.collective_s(kind, 0, total)
        dist, _ = self._from(src, shape, dtype_bytes)
        if dst not in dist:
            raise ValueError(f"no boxing path from {src} to {dst} for shape {shape}")
        return dist[dst]

    def boxing_path(self, src: NdSbp, dst: NdSbp, shape: tuple[int, ...],
                    dtype_bytes: int = 4) -> list[NdSbp]:
        """The placements the cheapest boxing passes through, src first, dst last (one axis
        changes per step): what an executor should redistribute along."""
        if src == dst or len(self.mesh.shape) == 1:
            return [src] if src == dst else [src, dst]
        _, prev = self._from(src, shape, dtype_bytes)
        path = [dst]
        while path[-1] != src:
            path.append(prev[path[-1]])
        return path[::-1]

    def _distances(self, src: NdSbp, shape: tuple[int, ...],
                   dtype_bytes: int) -> tuple[dict[NdSbp, float], dict[NdSbp, NdSbp]]:
        """Dijkstra from src over the placements of a tensor, one axis changing per step."""
        total = float(math.prod(shape)) * dtype_bytes
        ms = self.mesh.shape
        options: list[Sbp] = [B, P, *(Split(d) for d in range(len(shape)))]
        valid = _valid_states(tuple(tuple(size % k == 0 for k in (*ms, math.prod(ms)))
                                    for size in shape), ms)
        dist, heap, tie, done = {src: 0.0}, [(0.0, 0, src)], itertools.count(1), set()
        prev: dict[NdSbp, NdSbp] = {}
        while heap:
            t, _, cur = heapq.heappop(heap)
            if cur in done:
                continue
            done.add(cur)
            for k in range(len(ms)):
                local = total / math.prod(ms[j] for j in range(len(ms))
                                          if j != k and isinstance(cur[j], Split))
                for place in options:
                    nxt = (*cur[:k], place, *cur[k + 1:])
                    if place == cur[k] or nxt not in valid or nxt in done:
                        continue
                    kind = self.transition(cur[k], place)
                    nt = t + (0.0 if kind is None else self.collective_s(kind, k, local))
                    if nt < dist.get(nxt, math.inf):
                        dist[nxt], prev[nxt] = nt, cur
                        heapq.heappush(heap, (nt, next(tie), nxt))
        return dist, prev
