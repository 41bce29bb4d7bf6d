"""Does the both-axes all-reduce belong in the collective fit? A paired check on one run's
own timings, no new measurement:

    .venv/bin/python benchmarks/autoddl_fit_ablation.py [benchmarks/results/autoddl_predicted_vs_measured.json]

Every repeat of autoddl_predicted_vs_measured.py keeps its raw collective timings (before and
after its plan runs). They are refit two ways, with the all-reduce over both axes of the
2 x 2 mesh in the fit (what that benchmark does) and without it (single calls over groups of 2
and 4 only, as before), and each repeat's template plans are predicted with each fit; the
table gives Spearman against the measured order over all repeats (each plan's median time).
`searched` is left out: which plan the search picks depends on the fit. Writes
benchmarks/results/autoddl_fit_ablation.md.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import autoddl_predicted_vs_measured as bench
import numpy as np
from scipy.optimize import nnls
from scipy.stats import spearmanr

from hetrain.parallel.calibrate import _FORMULA, fit_collectives
from hetrain.plan.cost import plan_cost
from hetrain.plan.search import template_plan

Fit = tuple[float, float, float, list[tuple[str, float, float]]]


def fit_single_calls_only(rows: list[tuple[str, int, int, float]]) -> Fit:
    """The fit before the both-axes rows joined it."""
    f = _FORMULA
    sel = [r for r in rows if r[0] == "all_reduce"]
    a = np.array([[1.0, f["all_reduce"](p)[0], f["all_reduce"](p)[1] * n] for _, p, n, _ in sel])
    (call_s, alpha, inv_beta), _ = nnls(a, np.array([r[3] for r in sel]))
    alpha, inv_beta = max(alpha, 1e-7), max(inv_beta, 1e-12)
    factors = []
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        sk = [r for r in rows if r[0] == kind]
        ak = np.array([[f[kind](p)[0], f[kind](p)[1] * n] for _, p, n, _ in sk])
        (fa, fb), _ = nnls(ak, np.maximum(np.array([r[3] for r in sk]) - call_s, 0.0))
        factors.append((kind, max(fa, 1e-7) / alpha, max(fb, 1e-12) / inv_beta))
    return float(call_s), float(alpha), float(1.0 / inv_beta), factors


def spearman_per_repeat(repeats: list[dict[str, Any]], fit: Any) -> dict[str, list[float]]:
    med = bench._median_measured(repeats)
    graphs = {k: v[0] for k, v in bench.models().items()}
    out: dict[str, list[float]] = {m: [] for m in graphs}
    for rep in repeats:
        c = dict(rep["calibration"])
        # one fit per calibration (before, [halfway,] after), combined as the benchmark does:
        # each figure's median (with two calibrations, their mean)
        fits = [fit([tuple(r) for r in rows]) for rows in c["collective_rows"]]
        c["call_s"], c["alpha_s"], c["beta_Bps"] = (statistics.median(f[i] for f in fits)
                                                    for i in range(3))
        c["factors"] = [(k, statistics.median(f[3][j][1] for f in fits),
                         statistics.median(f[3][j][2] for f in fits))
                        for j, (k, _, _) in enumerate(fits[0][3])]
        cluster, options = bench.cluster_from(c["flops"], c["alpha_s"], c["beta_Bps"]), bench.options_from(c)
        for m, graph in graphs.items():
            idx = [i for i, r in enumerate(rep["rows"]) if r["model"] == m and r["plan"] != "searched"]
            pred = [plan_cost(graph, template_plan(graph, bench.M4 if rep["rows"][i]["mesh"] == "4"
                                                   else bench.M22, rep["rows"][i]["plan"]),
                              cluster, options).time_s for i in idx]
            out[m].append(float(spearmanr(pred, [med[i] for i in idx])[0]))
    return out


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else bench.OUT / "autoddl_predicted_vs_measured.json")
    data = json.loads(src.read_text())
    if "collective_rows" not in data["repeats"][0]["calibration"]:
        sys.exit(f"error: {src} has no raw collective timings; rerun autoddl_predicted_vs_measured.py")
    cmd = "  ".join([".venv/bin/python", *sys.argv])
    md = [f"<!-- made by: {cmd} -->", "# The collective fit with and without the both-axes all-reduce",
          "", f"Command: `{cmd}`, on the timings of `{data['command']}` ({len(data['repeats'])} "
          "repeats). Spearman of each repeat's template-plan predictions against the measured "
          "order over all repeats; median (per repeat).", "", "| fit | gpt | vgg |", "|---|---|---|"]
    for label, fit in (("with the both-axes all-reduce (the benchmark's)", fit_collectives),
                       ("single calls over 2 and 4 only (before)", fit_single_calls_only)):
        r = spearman_per_repeat(data["repeats"], fit)
        md.append(f"| {label} | " + " | ".join(
            f"{statistics.median(r[m]):.2f} ({', '.join(f'{x:.2f}' for x in r[m])})" for m in ("gpt", "vgg")) + " |")
    (bench.OUT / "autoddl_fit_ablation.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
