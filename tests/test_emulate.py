"""Heterogeneity emulation: budgets, link shaping, calibration."""

from __future__ import annotations

import threading
import time

import pytest

from hetrain.cluster import Link, preset
from hetrain.engine.emulate import Throttle, calibrated_cluster, solo_step_time

FPS = 1e6  # FLOPs per sample


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_budget_pads_a_task_to_the_device_time() -> None:
    dev = preset("hetero-4").devices[0]  # 2e8 FLOP/s, 2 ms per step
    th = Throttle(dev, None, FPS, time_scale=0.5)
    want = 0.5 * (2e-3 + 32 * FPS / 2e8)
    assert th.compute_budget_s(32, 1) == pytest.approx(want)
    _, elapsed = th.run(lambda: _spin(0.002), 32, 1)
    assert want <= elapsed < want + 0.03
    assert th.overruns == 0


def test_overrun_is_counted_when_the_cpu_is_slower_than_the_device() -> None:
    dev = preset("hetero-4").devices[3]
    th = Throttle(dev, None, FPS, time_scale=1e-3)
    _, elapsed = th.run(lambda: _spin(0.01), 32, 1)
    assert elapsed >= 0.01 and th.overruns == 1


def test_budgets_keep_speed_ratios_under_contention() -> None:
    """Four throttled threads of speeds 1:1:2:4 sharing this process: the tasks they finish
    in a fixed wall time stand 1:1:2:4 (the GIL and the shared cores are the contention)."""
    cluster = preset("hetero-4")
    counts = [0] * 4
    stop = time.perf_counter() + 1.2

    def work(i: int) -> None:
        th = Throttle(cluster.devices[i], None, FPS, time_scale=0.25)
        while time.perf_counter() < stop:
            th.run(lambda: _spin(0.001), 32, 1)
            counts[i] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    base = (counts[0] + counts[1]) / 2
    assert counts[2] / base == pytest.approx(2, rel=0.2)
    assert counts[3] / base == pytest.approx(4, rel=0.2)


def test_link_shaping_holds_latency_plus_bytes_over_bandwidth() -> None:
    th = Throttle(None, Link(1e6, 5e-3), FPS, time_scale=2.0)
    assert th.wire_s(10_000) == pytest.approx(2.0 * (5e-3 + 0.01))
    t = time.perf_counter()
    th.hold(10_000)
    assert time.perf_counter() - t >= th.wire_s(10_000)
    assert Throttle(None, None, FPS).wire_s(10**9) == 0.0


def test_calibrated_cluster_keeps_ratios_and_scales_by_k(mnist1d_cnn_small) -> None:
    from hetrain.workloads import flops_per_sample

    wl = mnist1d_cnn_small
    fps = flops_per_sample(wl)
    base = preset("hetero-4")
    k3 = calibrated_cluster(base, wl, fps, 32, contention_k=3.0)
    speeds = [d.flops for d in k3.devices]
    assert [s / speeds[3] for s in speeds] == pytest.approx([0.25, 0.25, 0.5, 1.0])
    fastest_step_s = k3.devices[3].compute_time_s(32, fps, 1)
    solo = solo_step_time(wl, 32)
    assert 1.5 * solo < fastest_step_s < 6 * solo  # ~K x solo, with timing noise
    assert k3.sites == base.sites
