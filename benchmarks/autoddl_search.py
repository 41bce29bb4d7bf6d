"""AutoDDL planner benchmark: search time on GPT-style graphs, predicted gain on the presets.

    .venv/bin/python benchmarks/autoddl_search.py [--repeats 3]

Search time is wall time of `search_plan` with cold caches (boxing and stage tables cleared),
median and spread of --repeats runs, for a 12- and a 48-layer GPT-2-small-shaped graph
(n_embd 768, 12 heads, vocab 50304, T 1024, batch 64) on 8 and 64 devices: homogeneous
single-site clusters and, to exercise 2-D meshes and WAN links, 2 x 4 and 8 x 8 two-level
clusters (sites of 4 / 8 devices, 10 Gbit/s LAN, 1 Gbit/s WAN). Targets: < 1 s (12 layers,
8 devices) and < 30 s (48 layers, 64 devices). Gains are the cost model's predicted
iteration time of pure data parallelism over all devices divided by the chosen plan's
(simulated: no training runs here). Writes autoddl_search.{json,md} to
benchmarks/results/ ($HETRAIN_BENCH_RESULTS when set).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from common import results_dir

from hetrain.cluster import GBIT, Cluster, Device, Link, Site, homogeneous, preset
from hetrain.plan.cost import clear_caches
from hetrain.plan.graph import gpt_graph, vgg_graph
from hetrain.plan.sbp import mesh_comm
from hetrain.plan.search import SearchResult, search_plan

OUT = results_dir()


def two_level(sites: int, per_site: int) -> Cluster:
    ss = tuple(Site(f"s{k}", Link(10 * GBIT, 20e-6), Link(1 * GBIT, 1e-3)) for k in range(sites))
    devs = tuple(Device(f"d{i}", 2e12, memory_bytes=80e9, site=f"s{i // per_site}")
                 for i in range(sites * per_site))
    return Cluster(f"{sites}x{per_site}-sites", devs, ss)


def timed(graph, cluster) -> tuple[float, SearchResult]:  # type: ignore[no-untyped-def]
    clear_caches()
    mesh_comm.cache_clear()
    t0 = time.perf_counter()
    res = search_plan(graph, cluster)
    return time.perf_counter() - t0, res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for layers in (12, 48):
        g = gpt_graph(layers, 768, 12, 50304, 1024, 64)
        for cl in (homogeneous(8), two_level(2, 4), homogeneous(64), two_level(8, 8)):
            cl = Cluster(cl.name, tuple(Device(d.name, 2e12, 80e9, d.site, 1e-3) for d in cl.devices),
                         cl.sites)
            runs = [timed(g, cl) for _ in range(args.repeats)]
            times = [t for t, _ in runs]
            res = runs[0][1]
            st0 = res.plan.stages[0]
            rows.append(dict(graph=g.name, ops=len(g.ops), cluster=cl.name, devices=cl.n,
                             search_s_median=statistics.median(times), search_s_min=min(times),
                             search_s_max=max(times), candidates=len(res.candidates),
                             plan=f"{len(res.plan.stages)} stage(s), mesh {st0.mesh.label}",
                             signatures=sorted(set(st0.signatures)),
                             gain_over_dp=res.gain, dp_fits=res.baseline_report.feasible))
            print(rows[-1], flush=True)
    gains = []
    for model, g in (("gpt 2x64 (cli default)", gpt_graph(2, 64, 2, 96, 64, 32)),
                     ("gpt 12x768 T=256", gpt_graph(12, 768, 12, 50304, 256, 8)),
                     ("vgg-16 32x32 (cli default)", vgg_graph(32))):
        for name in ("hetero-8", "geo-16"):
            _, res = timed(g, preset(name))
            st = res.plan.stages
            gains.append(dict(model=model, cluster=name, gain_over_dp=res.gain,
                              chosen_time_s=res.report.time_s, dp_time_s=res.baseline_report.time_s,
                              plan=" ; ".join(f"mesh {s.mesh.label} {list(s.mesh.devices)}"
                                              + (f" shares {list(s.shares)}" if s.shares else "")
                                              for s in st)
                              + (f" x{res.plan.n_micro} micro" if len(st) > 1 else ""),
                              signatures=sorted({x for s in st for x in s.signatures})))
            print(gains[-1], flush=True)
    cmd = "  ".join([".venv/bin/python", *sys.argv])
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "autoddl_search.json").write_text(json.dumps({"command": cmd, "search": rows,
                                                          "gains": gains}, indent=1))
    md = [f"<!-- made by: {cmd} -->", "# AutoDDL planner: search time and predicted gain", "",
          f"Command: `{cmd}` (2-core shared machine; median of {args.repeats} cold-cache runs).", "",
          "| graph | ops | cluster | devices | search s (median) | min-max | candidates | chosen "
          "| gain vs DP | DP fits |", "|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['graph']} | {r['ops']} | {r['cluster']} | {r['devices']} | {r['search_s_median']:.2f} "
           f"| {r['search_s_min']:.2f}-{r['search_s_max']:.2f} | {r['candidates']} | {r['plan']} "
           f"{','.join(r['signatures'])} | {r['gain_over_dp']:.2f}x | {r['dp_fits']} |" for r in rows]
    md += ["", "Predicted gain of the chosen plan over pure data parallelism on the presets "
           "(cost model, simulated):", "", "| model | cluster | DP s/iter | chosen s/iter | gain | chosen plan |",
           "|---|---|---|---|---|---|"]
    md += [f"| {r['model']} | {r['cluster']} | {r['dp_time_s']:.4g} | {r['chosen_time_s']:.4g} | "
           f"{r['gain_over_dp']:.2f}x | {r['plan']} ({','.join(r['signatures'])}) |" for r in gains]
    (OUT / "autoddl_search.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
