"""The comparison table printed after a run or by `hetrain report`."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from hetrain.report.metrics import RunResult


def comparison_rows(runs: list[RunResult]) -> list[dict[str, Any]]:
    """One dict per run; speedup is the baseline's TTA over this run's (baseline: ddp if present,
    else the first run, among the runs of the same engine: virtual and wall seconds do not
    compare)."""
    rows = []
    for r in runs:
        s = r.summary
        same = [q for q in runs if q.summary.get("engine") == s.get("engine")]
        base = next((q for q in same if q.summary.get("strategy") == "ddp"), same[0])
        base_tta = base.summary.get("tta_s")
        tta = s.get("tta_s")
        par = s.get("parallel")
        unmeasured = isinstance(par, dict) and par.get("bytes_measured") is False
        rows.append({
            "run": r.name, "strategy": s.get("strategy"), "engine": s.get("engine"),
            "cluster": s.get("cluster"), "tta_s": tta,
            "speedup": (base_tta / tta) if (tta and base_tta) else None,
            "final_accuracy": s.get("final_accuracy"), "best_accuracy": s.get("best_accuracy"),
            "epochs": s.get("epochs"), "time_s": s.get("time_s"),
            "hardware_efficiency": s.get("hardware_efficiency"),
            "gbytes_moved": None if unmeasured else s.get("bytes_total", 0) / 1e9,
        })
    return rows


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def comparison_table(runs: list[RunResult]) -> Table:
    target = next((r.summary.get("target_accuracy") for r in runs
                   if r.summary.get("target_accuracy")), None)
    engines = {r.summary.get("engine") for r in runs}
    clocks: dict[frozenset[str | None], str] = {
        frozenset({"sim"}): "virtual s",
        frozenset({"dist"}): "wall s of training: start-up and evaluations excluded"}
    clock = clocks.get(frozenset(engines),
                       "sim: virtual s, dist: wall s; speed-ups within an engine")
    title = f"time to {target:.0%} test accuracy ({clock})" if target else f"runs ({clock})"
    t = Table(title=title)
    mixed = len(engines) > 1
    cols = ("run", "strategy", *(("engine",) if mixed else ()), "cluster", "TTA", "speedup",
            "final acc", "best acc", "epochs", "time", "HW eff.", "GB moved")
    for col in cols:
        t.add_column(col, justify="left" if col in ("run", "strategy", "engine", "cluster")
                     else "right")
    for row in comparison_rows(runs):
        t.add_row(row["run"], str(row["strategy"]), *((str(row["engine"]),) if mixed else ()),
                  str(row["cluster"]),
                  _fmt(row["tta_s"], ".3g"), _fmt(row["speedup"], ".2f") + "x"
                  if row["speedup"] else "-",
                  _fmt(row["final_accuracy"], ".3f"), _fmt(row["best_accuracy"], ".3f"),
                  _fmt(row["epochs"], ".2f"), _fmt(row["time_s"], ".3g"),
                  _fmt(row["hardware_efficiency"], ".2f"), _fmt(row["gbytes_moved"], ".3f"))
    return t


def plan_lines(runs: list[RunResult]) -> list[str]:
    """One line per [parallel] run: the plan it trained under, its predicted and measured
    step time, and what calibration changed (the table has no room for a plan)."""
    out = []
    for r in runs:
        par = r.summary.get("parallel")
        if not isinstance(par, dict) or not par.get("layout"):
            continue
        pred, meas = par.get("predicted_step_s"), par.get("measured_step_s")
        line = (f"{r.name}: plan {par['layout']} (predicted {_fmt(pred and pred * 1e3, '.1f')}"
                f" ms/step, measured {_fmt(meas and meas * 1e3, '.1f')} ms/step")
        calib = par.get("calibration")
        if isinstance(calib, dict):
            was = par.get("uncalibrated_layout")
            line += (f"; cost model calibrated on the run's processes in "
                     f"{_fmt(calib.get('seconds'), '.1f')} s"
                     + (", the cluster file alone picked the same plan" if was == par["layout"]
                        else f", the cluster file alone picked {was}"))
        out.append(line + ")")
    return out


def results_renderables(runs: list[RunResult]) -> list[Table | Text]:
    """What `hetrain run`, `launch` and `report` print: the comparison table, then the plan
    line of each [parallel] run (Text: a layout's [0, 1] is not markup)."""
    return [comparison_table(runs), *(Text(line) for line in plan_lines(runs))]
