"""`hetrain report RUN...`: table and plots from run directories."""

from __future__ import annotations

import argparse
from pathlib import Path

from hetrain.cli.output import Output
from hetrain.errors import ConfigError
from hetrain.report.metrics import load_run
from hetrain.report.table import comparison_rows, results_renderables
from hetrain.validate import check_output_dir


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="compare runs: table, time-to-accuracy and utilisation plots",
                       description="Compare finished runs: a table (time to accuracy, "
                       "speed-up, final accuracy, hardware efficiency, bytes moved) and PNG "
                       "plots of accuracy over time, per-worker utilisation and the noise scale.")
    p.add_argument("runs", nargs="+", help="run directories (runs/<name>) or their summary.json")
    p.add_argument("--out", help="folder for the PNGs (default: <first run>/../report)")
    p.add_argument("--quiet", action="store_true", help="no table (the plots are written)")
    p.add_argument("--json", action="store_true", help="print the table rows as JSON")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    # matplotlib is imported here, not when the parser registers this command: every other
    # command (and every rank a launcher starts) would pay half a second for it
    from hetrain.report.plots import plot_noise_scale, plot_time_to_accuracy, plot_utilisation

    out = Output(args.quiet, args.json)
    runs = [load_run(r) for r in args.runs]
    if not runs:
        raise ConfigError("give at least one run directory")
    out_dir = Path(args.out) if args.out else Path(runs[0].run_dir or ".").parent / "report"
    check_output_dir(out_dir, "--out")
    out_dir.mkdir(parents=True, exist_ok=True)
    for shown in results_renderables(runs):
        out.print(shown)
    tta = plot_time_to_accuracy(runs, out_dir / "time_to_accuracy.png")
    util = plot_utilisation(runs, out_dir / "utilisation.png")
    plots = [tta, util, plot_noise_scale(runs, out_dir / "noise_scale.png")]
    out.print("plots: " + "  ".join(str(p) for p in plots if p))
    out.json({"runs": comparison_rows(runs), "plots": [str(p) for p in plots if p]})
    return 0
