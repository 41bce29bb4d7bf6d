"""How long the goodput planner takes on a large generated cluster, and whether its choice for
the presets depends on the order the devices are listed in.

    .venv/bin/python benchmarks/goodput_scale.py [--devices 1000] [--sites 20] [--repeats 3]

The cluster: `--devices` devices of speeds 1, 2, 4 or 8 x 2e8 FLOP/s spread at random over
`--sites` sites whose WAN uplinks are 0.1, 1 or 10 Gbit/s with 1-50 ms latency (seed 0), the
PS NIC at 25 Gbit/s; the MNIST-1D CNN's FLOPs and bytes; G up to an epoch / 16 (1,000), H in
{1, 2, 4, 8, 16, 32}, every site tried for the PS; noise scales 32 and 1,000. Planning time is
the median of `--repeats` runs in this process (no gradients: the model of time and statistical
efficiency only). Order: each preset's plan with its devices listed in reverse and in a random
order must give the same PS site, G, H, goodput and shares per kind of device.
Writes goodput_scale.{json,md} to benchmarks/results/ ($HETRAIN_BENCH_RESULTS when set).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
from common import results_dir

from hetrain.cluster import Cluster, Device, Link, Site, preset
from hetrain.plan.goodput import GoodputPlan, plan_cluster

OUT = results_dir()
FPS, MODEL_BYTES, TRAIN = 966_400, 54_824, 16_000


def generated(n: int, n_sites: int, seed: int = 0) -> Cluster:
    rng = np.random.default_rng(seed)
    sites = tuple(Site(f"site{k}", Link(1.25e9, 5e-5),
                       Link(float(rng.choice([1.25e7, 1.25e8, 1.25e9])),
                            float(rng.choice([1e-3, 5e-3, 2e-2, 5e-2]))))
                  for k in range(n_sites))
    devices = tuple(Device(f"d{j}", 2e8 * float(rng.choice([1, 2, 4, 8])),
                           site=f"site{int(rng.integers(n_sites))}", step_overhead_s=2e-3)
                    for j in range(n))
    return Cluster(f"generated-{n}x{n_sites}", devices, sites, ps_nic=Link(3.125e9, 1e-5))


def plan(cluster: Cluster, noise: float) -> GoodputPlan:
    return plan_cluster(cluster, flops_per_sample=FPS, model_bytes=MODEL_BYTES, base_batch=32,
                        noise_scale=noise, max_batch=TRAIN // 16, max_lr_scale=2.0)


def by_kind(p: GoodputPlan, c: Cluster) -> list[tuple[float, str, int]]:
    return sorted((d.flops, d.site, x) for d, x in zip(c.devices, p.shares, strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--sites", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    big = generated(args.devices, args.sites)
    timing = []
    for noise in (32.0, 1000.0):
        times, p = [], None
        for _ in range(args.repeats):
            t = time.perf_counter()
            p = plan(big, noise)
            times.append(time.perf_counter() - t)
        assert p is not None
        timing.append({"noise_scale": noise, "median_s": statistics.median(times),
                       "times_s": times, "ps_site": p.ps_site, "global_batch": p.global_batch,
                       "local_steps": p.local_steps, "active_devices": len(p.active)})
    order = []
    rng = np.random.default_rng(1)
    for name in ("hetero-4", "hetero-8", "geo-16"):
        c = preset(name)
        for label, perm in (("reversed", list(reversed(range(c.n)))),
                            ("shuffled", [int(j) for j in rng.permutation(c.n)])):
            other = Cluster(c.name, tuple(c.devices[j] for j in perm), c.sites, c.ps_site,
                            c.ps_nic, c.ps_message_s)
            for noise in (32.0, 1000.0):
                a, b = plan(c, noise), plan(other, noise)
                same = ((a.ps_site, a.global_batch, a.local_steps)
                        == (b.ps_site, b.global_batch, b.local_steps)
                        and abs(a.goodput - b.goodput) <= 1e-9 * a.goodput
                        and by_kind(a, c) == by_kind(b, other))
                order.append({"preset": name, "order": label, "noise_scale": noise,
                              "same_plan": same, "plan": f"{a.ps_site} G{a.global_batch} "
                              f"H{a.local_steps} on {len(a.active)} devices"})
    cmd = "python benchmarks/goodput_scale.py " + " ".join(sys.argv[1:])
    OUT.mkdir(exist_ok=True)
    (OUT / "goodput_scale.json").write_text(json.dumps(
        {"command": cmd, "cluster": big.name, "timing": timing, "order": order}, indent=1))
    lines = [f"`{cmd}`", "", f"# Goodput planner: {args.devices} devices in {args.sites} sites, "
             "and device order", "", "| noise scale | planning time s (median) | plan |",
             "|---|---|---|"]
    lines += [f"| {t['noise_scale']:g} | {t['median_s']:.2f} ({min(t['times_s']):.2f}-"
              f"{max(t['times_s']):.2f}) | PS in {t['ps_site']}, G {t['global_batch']}, "
              f"H {t['local_steps']}, {t['active_devices']} devices |" for t in timing]
    lines += ["", "| preset | listed | noise scale | same plan | plan |", "|---|---|---|---|---|"]
    lines += [f"| {o['preset']} | {o['order']} | {o['noise_scale']:g} | {o['same_plan']} | "
              f"{o['plan']} |" for o in order]
    text = "\n".join(lines) + "\n"
    (OUT / "goodput_scale.md").write_text(text)
    print(text)
    return 0 if all(o["same_plan"] for o in order) else 1


if __name__ == "__main__":
    sys.exit(main())
