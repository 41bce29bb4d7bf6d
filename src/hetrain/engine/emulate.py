"""Heterogeneity on one machine: compute throttling to a budget and in-process link shaping.

Compute. Every task is padded to a fixed budget, the time the emulated device would take:

    budget_s = time_scale * (steps * step_overhead_s + samples * flops_per_sample / flops)

(`Device.compute_time_s`, the simulator's own formula). The worker computes, then sleeps until
`start + budget_s`. Padding to a budget, not sleeping in proportion to the measured compute
time, is what keeps the ratios exact under CPU contention: measured here with 4 processes on 2
cores, budgets gave 1:1:2:4 exactly while sleep-after-compute was off by up to 18% (the
measured time itself is inflated by whoever shares the core). The budget must exceed the real
compute time or the device runs slower than emulated; such tasks are counted as `overruns`.

`calibrated_cluster` builds the budgets the way the issue phrases them, slowdown x K x solo
step time: it measures one process's solo step time t(b) = a + c b at two batch sizes and gives
device i  step_overhead_s = K s_i a  and  flops = flops_per_sample / (K s_i c), where
s_i = max_j flops_j / flops_i is its slowdown (1 for the fastest) and K (about 3 for 4
processes on 2 cores) the contention allowance. A simulator run on that cluster predicts the
real run; `time_scale` is then 1.

Links. A message of n bytes over link l is held back latency_s + n / bandwidth_Bps (scaled by
`time_scale`) on the worker side (after a pull arrives, before a push leaves), so the server's
loop is never blocked on one worker's wire. A collective is padded to the cluster's
ring all-reduce time. The PS NIC queue of the simulator is not emulated. Real links (network
namespaces + veth + tc tbf, root only) are not implemented: netem is absent from this kernel,
so latency would still be added here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from hetrain.cluster import Cluster, Device, Link
from hetrain.workloads import Workload

EMULATE_MODES = ("none", "cluster", "relative")
"""none: run at the machine's speed; cluster: budgets from the Cluster's devices and links;
relative: budgets from the measured solo step time x K x slowdown (`calibrated_cluster`)."""

T = TypeVar("T")


def sleep_until(deadline_s: float) -> float:
    """Sleep to a perf_counter deadline; returns the seconds slept (0 if already past)."""
    left = deadline_s - time.perf_counter()
    if left > 0:
        time.sleep(left)
        return left
    return 0.0


@dataclass
class Throttle:
    """One worker's emulated device and links (None device: no throttling)."""

    device: Device | None
    ps_link: Link | None
    flops_per_sample: float
    time_scale: float = 1.0
    overruns: int = 0
    """Tasks whose real compute exceeded the budget (emulated device faster than this CPU)."""

    def compute_budget_s(self, samples: int, steps: int) -> float:
        if self.device is None:
            return 0.0
        return self.time_scale * self.device.compute_time_s(samples, self.flops_per_sample, steps)

    def run(self, fn: Callable[[], T], samples: int, steps: int) -> tuple[T, float]:
        """Run a task padded to its budget: (result, elapsed seconds incl. padding)."""
        start = time.perf_counter()
        out = fn()
        budget = self.compute_budget_s(samples, steps)
        if budget and time.perf_counter() - start > budget:
            self.overruns += 1
        sleep_until(start + budget)
        return out, time.perf_counter() - start

    def wire_s(self, nbytes: int) -> float:
        """Emulated one-way time of an nbytes message on the worker's path to the PS."""
        if self.ps_link is None:
            return 0.0
        return self.time_scale * self.ps_link.transfer_time_s(nbytes)

    def hold(self, nbytes: int, started_s: float | None = None) -> None:
        """Hold a message back until its emulated wire time since `started_s` (default now)."""
        t0 = time.perf_counter() if started_s is None else started_s
        sleep_until(t0 + self.wire_s(nbytes))


def solo_step_time(workload: Workload, batch_size: int, steps: int = 20) -> float:
    """Median time of one SGD step at `batch_size` in this process (1 thread)."""
    torch.manual_seed(0)
    model = workload.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    n = len(workload.train)  # type: ignore[arg-type]
    idx = torch.arange(batch_size) % n
    times = []
    for k in range(steps + 3):
        t = time.perf_counter()
        batch = workload.batch(idx)
        opt.zero_grad(set_to_none=True)
        workload.loss(model, batch).backward()
        opt.step()
        if k >= 3:
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def calibrated_cluster(cluster: Cluster, workload: Workload, flops_per_sample: float,
                       batch_size: int, contention_k: float = 3.0) -> Cluster:
    """The cluster with device speeds set to K x slowdown x this machine's solo step time.

    Fit t(b) = a + c b from batch sizes b and 2b: c = (t(2b) - t(b)) / b, a = t(b) - c b
    (floored at 0 and at 10% of t(b) per sample, so noise cannot make a term negative).
    """
    t1, t2 = solo_step_time(workload, batch_size), solo_step_time(workload, 2 * batch_size)
    c = max((t2 - t1) / batch_size, 0.1 * t1 / batch_size)
    a = max(t1 - c * batch_size, 0.0)
    fastest = max(d.flops for d in cluster.devices)
    devices = []
    for d in cluster.devices:
        s = fastest / d.flops
        devices.append(replace(d, flops=flops_per_sample / (contention_k * s * c),
                               step_overhead_s=contention_k * s * a))
    return replace(cluster, name=f"{cluster.name}-calibrated", devices=tuple(devices))
