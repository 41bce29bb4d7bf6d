"""SBP placements, signatures and boxing costs against the ring formulas they are derived from."""

from __future__ import annotations

import itertools
import math

import pytest

from hetrain.cluster import GBIT, Cluster, Device, Link, Site, homogeneous, preset
from hetrain.errors import ConfigError
from hetrain.plan.graph import Op, gpt_graph
from hetrain.plan.sbp import B, Mesh, MeshComm, P, Split, grad_placement, signatures

S0, S1 = Split(0), Split(1)


def two_sites(per_site: int = 4, lan_gbit: float = 100, wan_gbit: float = 1) -> Cluster:
    sites = (Site("a", Link(lan_gbit * GBIT, 1e-5), Link(wan_gbit * GBIT, 1e-3)),
             Site("b", Link(lan_gbit * GBIT, 1e-5), Link(wan_gbit * GBIT, 1e-3)))
    devs = tuple(Device(f"d{i}", 1e12, site="ab"[i // per_site]) for i in range(2 * per_site))
    return Cluster("two-sites", devs, sites)


def test_placements_print_like_oneflow() -> None:
    assert [str(x) for x in (S0, B, P)] == ["S(0)", "B", "P"]
    assert grad_placement(S1) == S1 and grad_placement(B) == B and grad_placement(P) == B


def test_one_d_boxing_follows_the_ring_formulas() -> None:
    c = homogeneous(4)
    comm = MeshComm(c, Mesh((4,), (0, 1, 2, 3)))
    shape, T = (64, 256), 64 * 256 * 4.0
    ar = comm.boxing_s((P,), (B,), shape)
    assert ar == pytest.approx(c.ring_allreduce_time_s(T))  # the Cluster's own ring model
    lan = c.sites[0].lan
    assert comm.boxing_s((S0,), (B,), shape) == pytest.approx(3 * (lan.latency_s + T / (4 * lan.bandwidth_Bps)))
    assert comm.boxing_s((P,), (S1,), shape) == pytest.approx(ar / 2)  # reduce-scatter
    a2a = comm.boxing_s((S0,), (S1,), shape)
    assert a2a == pytest.approx(3 * (lan.latency_s + T / (16 * lan.bandwidth_Bps)))
    for free in [((B,), (S0,)), ((B,), (P,)), ((S0,), (P,)), ((S1,), (S1,))]:
        assert comm.boxing_s(*free, shape) == 0.0


def test_outer_axis_pays_the_wan_shared_by_concurrent_rings() -> None:
    c = two_sites()
    mesh = Mesh((2, 4), tuple(range(8)))
    comm = MeshComm(c, mesh)
    shape = (1024, 1024)
    T = 1024 * 1024 * 4.0
    inner = comm.boxing_s((B, P), (B, B), shape)
    outer = comm.boxing_s((P, B), (B, B), shape)
    lan, wan = c.sites[0].lan, c.sites[0].wan
    assert inner == pytest.approx(2 * 3 * (lan.latency_s + T / (4 * lan.bandwidth_Bps)))
    # four outer rings (one per inner index) leave each site through the same uplink
    lat = c.link_between(0, 4).latency_s
    direct = comm.collective_s("all_reduce", 0, T)
    assert direct == pytest.approx(2 * 1 * (lat + T / (2 * wan.bandwidth_Bps / 4)))
    # cheaper still: split on the inner axis for free, all-reduce T/4 across, all-gather inside
    via_split = comm.collective_s("all_reduce", 0, T / 4) + comm.collective_s("all_gather", 1, T)
    assert outer == pytest.approx(min(direct, via_split)) and outer < direct
    assert outer > 20 * inner


def test_two_d_boxing_finds_the_hierarchical_all_reduce() -> None:
    c = two_sites()
    comm = MeshComm(c, Mesh((2, 4), tuple(range(8))))
    shape = (1024, 1024)
    both = comm.boxing_s((P, P), (B, B), shape)
    T = 1024 * 1024 * 4.0
    naive = comm.collective_s("all_reduce", 1, T) + comm.collective_s("all_reduce", 0, T)
    hier = (comm.collective_s("reduce_scatter", 1, T) + comm.collective_s("all_reduce", 0, T / 4)
            + comm.collective_s("all_gather", 1, T))
    assert both == pytest.approx(min(naive, hier))
    assert both < 0.5 * naive  # the WAN carries 1/4 of the bytes


def test_flat_mesh_over_two_sites_is_slower_than_lan_only() -> None:
    c = two_sites()
    flat = MeshComm(c, Mesh((8,), tuple(range(8)))).boxing_s((P,), (B,), (256, 256))
    lan_only = MeshComm(c, Mesh((4,), (0, 1, 2, 3))).boxing_s((P,), (B,), (256, 256))
    assert flat > 10 * lan_only


def test_linear_signatures_are_oneflow_matmul_ones() -> None:
    op = gpt_graph(1, 64, 4, 128, 16, 8).ops[2]  # blocks.0.attn.q
    sigs = {s.name: s for s in signatures(op, (4,))}
    assert set(sigs) == {"dp", "col", "row", "rep"}
    assert (sigs["dp"].ins(0), sigs["dp"].weight, sigs["dp"].out) == ((S0,), (B,), (S0,))
    assert (sigs["col"].ins(0), sigs["col"].weight, sigs["col"].out) == ((B,), (S0,), (Split(2),))
    assert (sigs["row"].ins(0), sigs["row"].weight, sigs["row"].out) == ((Split(2),), (S1,), (P,))
    assert sigs["col"].din(0) == (P,)  # column parallel: the input gradient is a partial sum
    assert len(signatures(op, (2, 2))) == 16


def test_splits_must_divide() -> None:
    g = gpt_graph(1, 48, 3, 100, 16, 6)
    att = next(op for op in g.ops if op.kind == "attention")
    assert "heads" not in {s.name for s in signatures(att, (2,))}  # 3 heads
    assert "heads" in {s.name for s in signatures(att, (3,))}
    lin = Op("l", "linear", ("",), ((6, 10),), (6, 7), 1.0, (7, 10), 280.0, 1)
    assert {s.name for s in signatures(lin, (2,))} == {"dp", "row", "rep"}  # 7 outputs


def test_mesh_checks_and_groups() -> None:
    with pytest.raises(ConfigError, match="does not hold"):
        Mesh((2, 3), tuple(range(5)))
    m = Mesh((2, 3), tuple(range(6)))
    assert m.groups(1) == [(0, 1, 2), (3, 4, 5)] and m.groups(0) == [(0, 3), (1, 4), (2, 5)]
    with pytest.raises(ConfigError, match="not in cluster"):
        MeshComm(preset("homo-4"), Mesh((8,), tuple(range(8))))


def test_single_device_axis_is_free() -> None:
    comm = MeshComm(homogeneous(2), Mesh((1,), (0,)))
    assert comm.boxing_s((P,), (B,), (8, 8)) == 0.0
    assert math.isinf(comm.ring[0][1])


def test_collective_factors_correct_the_ring_formula() -> None:
    c = homogeneous(4)
    mesh = Mesh((4,), (0, 1, 2, 3))
    ideal = MeshComm(c, mesh)
    gloo = MeshComm(c, mesh, (("all_gather", 1.0, 2.0), ("reduce_scatter", 3.0, 1.0)))
    T = 1e6
    assert gloo.collective_s("all_reduce", 0, T) == ideal.collective_s("all_reduce", 0, T)
    lan = c.sites[0].lan
    assert gloo.collective_s("all_gather", 0, T) == pytest.approx(3 * (lan.latency_s + 2 * T / (4 * lan.bandwidth_Bps)))
    assert gloo.collective_s("reduce_scatter", 0, T) == pytest.approx(3 * (3 * lan.latency_s + T / (4 * lan.bandwidth_Bps)))


def test_boxing_path_is_the_priced_route() -> None:
    comm = MeshComm(homogeneous(4), Mesh((2, 2), (0, 1, 2, 3)))
    path = comm.boxing_path((P, P), (B, B), (128, 64))
    assert path[0] == (P, P) and path[-1] == (B, B)
    assert all(sum(a != b for a, b in zip(x, y, strict=True)) == 1 for x, y in itertools.pairwise(path))
    steps = sum(comm.boxing_s(x, y, (128, 64)) for x, y in itertools.pairwise(path))
    assert steps == pytest.approx(comm.boxing_s((P, P), (B, B), (128, 64)))
    assert len(path) == 4  # reduce-scatter, all-reduce of a quarter, all-gather


def test_call_cost_is_paid_once_per_collective_and_shortens_paths() -> None:
    c = homogeneous(4)
    lan = c.sites[0].lan
    one_d = MeshComm(c, Mesh((4,), (0, 1, 2, 3)), call_s=0.01)
    T = 1e6
    ring = 6 * (lan.latency_s + T / (4 * lan.bandwidth_Bps))
    assert one_d.collective_s("all_reduce", 0, T) == pytest.approx(0.01 + ring)
    assert one_d.boxing_s((B,), (Split(0),), (8, 8)) == 0.0  # local: no call
    # 2 x 2: with a large per-call cost, (P, P) -> (B, B) is one all-reduce per axis (2 calls)
    # instead of reduce-scatter, all-reduce, all-gather (3 calls)
    two_d = MeshComm(c, Mesh((2, 2), (0, 1, 2, 3)), call_s=1.0)
    shape, nbytes = (128, 64), 128 * 64 * 4
    ar2 = 2 * (lan.latency_s + nbytes / (2 * lan.bandwidth_Bps))
    assert two_d.boxing_path((P, P), (B, B), shape) in ([(P, P), (B, P), (B, B)], [(P, P), (P, B), (B, B)])
    assert two_d.boxing_s((P, P), (B, B), shape) == pytest.approx(2 * (1.0 + ar2))
    with pytest.raises(ConfigError):
        MeshComm(c, Mesh((4,), (0, 1, 2, 3)), call_s=-1.0)
