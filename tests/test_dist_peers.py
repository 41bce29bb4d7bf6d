"""The benchmark's peers (benchmarks/real_peers.py, real_deepspeed.py, real_torchft.py) and the simulator
calibration (hetrain.engine.measure.with_overheads / measure_overheads).

DeepSpeed and torchft are optional benchmark dependencies: their tests skip when they are not
installed."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hetrain.cluster import preset
from hetrain.engine.measure import Overheads, measure_overheads, with_overheads
from hetrain.workloads import flops_per_sample, get_workload

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))


def test_with_overheads_adds_the_measured_cost_to_the_path_each_strategy_uses() -> None:
    c, ts, nbytes = preset("hetero-4"), 0.5, 55_000
    o = Overheads(ps_message_s=0.002, sync_round_s=0.012)
    ps = with_overheads(c, o, ts, "ps")
    # the PS's per-message time: ps_message_s real = ps_message_s / ts modelled; links as they were
    assert ps.ps_message_s == pytest.approx(0.002 / ts) and ps.sites == c.sites
    ar = with_overheads(c, o, ts, "allreduce")
    extra = ar.ring_allreduce_time_s(nbytes) - c.ring_allreduce_time_s(nbytes)
    assert extra == pytest.approx(0.012 / ts)  # one synchronous round: sync_round_s real
    assert [d.flops for d in ar.devices] == [d.flops for d in c.devices]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_measure_overheads_on_real_processes() -> None:
    pair = replace(preset("hetero-4"), devices=preset("hetero-4").devices[:2])
    o = measure_overheads(pair, get_workload("cnn", "mnist1d"), 16, 0.2, steps=5, probes=3)
    assert 0 < o.ps_message_s < 1.0 and 0 <= o.sync_round_s < 1.0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("system", ["deepspeed_zero1", "torch_ddp", "torchft_localsgd",
                                    "torchft_diloco"])
def test_peer_trains_over_gloo(system: str) -> None:
    if system.startswith(("deepspeed", "torchft")):
        pytest.importorskip(system.split("_")[0])
    from real_peers import PeerRun, run_peer

    c = replace(preset("hetero-4"), devices=preset("hetero-4").devices[:2])
    wl = get_workload("cnn", "mnist1d")
    r = run_peer(PeerRun(system, c, wl, flops_per_sample(wl), time_scale=0.1, max_epochs=0.3,
                         eval_every_epochs=0.1), timeout_s=240)
    assert r["rows"] and r["final_accuracy"] > 0.2  # chance is 0.1: it learned
    assert r["rows"][-1]["epoch"] == pytest.approx(0.3, abs=0.05)


@pytest.mark.timeout(120)
def test_the_lone_device_is_one_plain_process_padded_to_its_budget() -> None:
    """The user's simplest alternative: no process group, each step padded to the device's
    emulated time, so its clock is the fastest device's, not this CPU's."""
    from real_peers import LONE, PeerRun, run_peer

    from hetrain.engine.emulate import Throttle

    lone = preset("hetero-4").fastest_alone()
    wl = get_workload("cnn", "mnist1d")
    fps, ts, epochs = flops_per_sample(wl), 0.5, 0.3
    r = run_peer(PeerRun(LONE, lone, wl, fps, time_scale=ts, max_epochs=epochs,
                         eval_every_epochs=0.1), timeout_s=100)
    steps = int(epochs * len(wl.train) / 32)
    budget = Throttle(lone.devices[0], None, fps, ts).compute_budget_s(32, 1)
    assert r["final_accuracy"] > 0.2 and len(r["rows"]) == 3
    assert r["rows"][-1]["time_s"] >= 0.95 * steps * budget
