"""hetrain.parallel.calibrate: the collective fit recovers known costs, the corrections reach the
cost model (and change the search's pick), calibration files are checked, and the
microbenchmarks run on real gloo processes with identical figures on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.cluster import Cluster, Device, Link, Site
from hetrain.errors import ConfigError
from hetrain.parallel.calibrate import (
    _FORMULA,
    cost_options,
    fit_collectives,
    median_calibration,
    read_calibration,
)
from hetrain.plan.cost import CostOptions
from hetrain.plan.graph import gpt_graph
from hetrain.plan.search import SearchOptions, search_plan

SIZES = [2**k for k in (9, 14, 18, 22)]


def synthetic_rows(call_s: float, alpha: float, beta: float, factors: dict[str, tuple[float, float]],
                   m: int) -> list[tuple[str, int, int, float]]:
    """Timings exactly as the model the fit assumes: rings over the 1-D mesh of 2m ranks and
    the two axes of (2, m), plus the both-axes all-reduce (a ring of 2, then one of m)."""
    def ring(kind: str, p: int, n: int, fa: float = 1.0, fb: float = 1.0) -> float:
        steps, frac = _FORMULA[kind](p)
        return steps * alpha * fa + frac * n / beta * fb

    rows = []
    for p in (2 * m, 2, m):
        for n in SIZES:
            rows.append(("all_reduce", p, n, call_s + ring("all_reduce", p, n)))
            for kind, (fa, fb) in factors.items():
                rows.append((kind, p, n, call_s + ring(kind, p, n, fa, fb)))
    rows += [("all_reduce_both_axes", m, n,
              2 * call_s + ring("all_reduce", 2, n) + ring("all_reduce", m, n)) for n in SIZES]
    return rows


@settings(max_examples=30, deadline=None)
@given(call_s=st.floats(1e-5, 3e-3), alpha=st.floats(1e-6, 1e-3), beta=st.floats(1e8, 1e11),
       fa=st.floats(0.5, 3.0), fb=st.floats(0.5, 5.0), m=st.sampled_from([2, 3, 4]))
def test_the_fit_recovers_the_costs_that_made_the_timings(call_s: float, alpha: float,
                                                          beta: float, fa: float, fb: float,
                                                          m: int) -> None:
    factors = {"all_gather": (fa, fb), "reduce_scatter": (fb, fa), "all_to_all": (1.0, fb)}
    got_call, got_alpha, got_beta, got_factors = fit_collectives(
        synthetic_rows(call_s, alpha, beta, factors, m))
    assert got_call == pytest.approx(call_s, rel=1e-3, abs=1e-9)
    assert got_alpha == pytest.approx(alpha, rel=1e-3)
    assert got_beta == pytest.approx(beta, rel=1e-3)
    for kind, a, b in got_factors:
        assert (a, b) == pytest.approx(factors[kind], rel=1e-2)


CALIB = {"flops": 1e11, "alpha_s": 1e-4, "beta_Bps": 1e9, "call_s": 2e-3,
         "factors": [["all_gather", 1.5, 2.0], ["reduce_scatter", 1.2, 1.8],
                     ["all_to_all", 1.1, 4.0]],
         "op_overhead_s": {"linear": 5e-4, "attention": 9e-4},
         "kind_speed": {"linear": 1.2, "attention": 0.15}, "seconds": 3.0}


def test_cost_options_carry_the_corrections_and_compute_ones_only_when_asked() -> None:
    base = CostOptions(optimizer_states=1.0)
    comm = cost_options(CALIB, base, compute=False)
    assert comm.optimizer_states == 1.0 and comm.collective_call_s == 2e-3
    assert comm.collective_factors == (("all_gather", 1.5, 2.0), ("reduce_scatter", 1.2, 1.8),
                                       ("all_to_all", 1.1, 4.0))
    assert comm.op_overhead_s == () and comm.kind_speed == ()
    full = cost_options(CALIB, base)
    assert full.op_overhead_s == (("attention", 9e-4), ("linear", 5e-4))
    assert full.kind_speed == (("attention", 0.15), ("linear", 1.2))


def test_a_per_call_cost_turns_the_search_away_from_chatty_plans() -> None:
    """Four equal devices on a fast LAN, a tiny GPT: on the cluster file's figures alone the
    search spreads the model over all four; with a 5 ms cost per collective call (what
    the file cannot list) the chosen plan makes fewer collective calls and is predicted
    slower than the file alone promised."""
    site = Site("s", Link(1e10, 1e-6), Link(1e10, 1e-6))
    cluster = Cluster("four", tuple(Device(f"d{i}", 1e9, 8e9, "s") for i in range(4)), (site,))
    graph = gpt_graph(2, 64, 2, 96, 32, 16)
    plain = search_plan(graph, cluster, SearchOptions(), CostOptions())
    calib = dict(CALIB, call_s=5e-3, factors=[])
    slow = search_plan(graph, cluster, SearchOptions(), cost_options(calib, compute=False))
    assert plain.plan != slow.plan
    assert sum(len(s.mesh.devices) for s in slow.plan.stages) < 4 or len(slow.plan.stages) > 1
    assert slow.report.time_s > plain.report.time_s


def test_median_calibration_takes_each_figure_s_median() -> None:
    cals = [dict(CALIB, call_s=c, collective_rows=[]) for c in (1e-3, 5e-3, 2e-3)]
    cals[1] = dict(cals[1], op_overhead_s={"linear": 1.0, "attention": 9e-4})
    med = median_calibration(cals)
    assert med["call_s"] == 2e-3 and med["op_overhead_s"]["linear"] == 5e-4
    assert med["factors"][0] == ("all_gather", 1.5, 2.0) and len(med["collective_rows"]) == 3


def test_read_calibration_takes_a_summary_or_the_figures_and_refuses_the_rest(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"parallel": {"calibration": CALIB}}))
    assert read_calibration(str(summary))["call_s"] == 2e-3
    figures = tmp_path / "calib.json"
    figures.write_text(json.dumps(CALIB))
    assert read_calibration(str(figures)) == CALIB
    cases = {"uncalibrated.json": (json.dumps({"parallel": {"calibration": None}}), "not calibrated"),
             "garbled.json": ("{", "cannot be read as JSON"),
             "negative.json": (json.dumps(dict(CALIB, call_s=-1.0)), "is not a calibration"),
             "nan.json": (json.dumps(dict(CALIB, op_overhead_s={"linear": float("nan")})),
                          "is not a calibration"),
             "kind.json": (json.dumps(dict(CALIB, factors=[["gossip", 1, 1]])), "is not a calibration"),
             "zero_speed.json": (json.dumps(dict(CALIB, kind_speed={"linear": 0})),
                                 "is not a calibration")}
    for name, (text, why) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=why):
            read_calibration(str(tmp_path / name))
    with pytest.raises(ConfigError, match="cannot be read"):
        read_calibration(str(tmp_path / "missing.json"))


def _calibrate_rank(rank: int, world: int) -> dict:
    import torch

    from hetrain.parallel.calibrate import calibrate

    torch.set_num_threads(1)
    return calibrate(quick=True)


@pytest.mark.dist
@pytest.mark.slow  # 8-20 s; the default run calibrates through hetrain run's tests
@pytest.mark.timeout(180)
def test_quick_calibration_on_four_gloo_processes() -> None:
    """Every rank ends with rank 0's figures; they are plausible: a positive per-byte cost, a
    non-negative per-call cost, every op kind's overhead and speed, rows for every collective
    on the 1-D mesh and both axes of the 2 x 2 mesh."""
    from hetrain.parallel.launch import run_local

    got = run_local(_calibrate_rank, 4, (), timeout_s=150)
    assert all(g == got[0] for g in got[1:])
    c = got[0]
    assert c["flops"] > 1e8 and c["beta_Bps"] > 0 and c["alpha_s"] > 0 and c["call_s"] >= 0
    assert set(c["op_overhead_s"]) == set(c["kind_speed"]) >= {"linear", "attention", "conv"}
    assert all(v >= 0 for v in c["op_overhead_s"].values())
    assert all(v > 0 for v in c["kind_speed"].values())
    kinds = {(k, p) for k, p, _, _ in c["collective_rows"]}
    assert kinds >= {("all_reduce", 4), ("all_reduce", 2), ("all_to_all", 4),
                     ("all_reduce_both_axes", 2)}
    assert len(c["collective_rows"]) == 3 * 4 * 4 + 4
    assert json.loads(json.dumps(c))["call_s"] == c["call_s"]  # plain data for summary.json
