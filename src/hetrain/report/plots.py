"""Plots drawn from run files: time-to-accuracy curves and per-worker utilisation bars."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from hetrain.report.metrics import RunResult


def _label(r: RunResult) -> str:
    s = r.summary
    return f"{r.name} ({s.get('strategy', '?')}, {s.get('engine', '?')})"


def plot_time_to_accuracy(runs: list[RunResult], path: Path) -> Path:
    """Test accuracy (and loss) against time, one line per run; the target as a dashed line."""
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        t = [row["time_s"] for row in r.rows]
        acc = [float("nan") if row["test_accuracy"] is None else row["test_accuracy"]
               for row in r.rows]  # None: a train_step run without eval_fn measures no accuracy
        ax_acc.plot(t, acc, marker=".", label=_label(r))
        ax_loss.plot(t, [row["test_loss"] for row in r.rows], marker=".", label=_label(r))
    target = next((r.summary.get("target_accuracy") for r in runs
                   if r.summary.get("target_accuracy")), None)
    if target:
        ax_acc.axhline(target, color="grey", linestyle="--", linewidth=1, label="target")
    simulated = all(r.summary.get("engine") == "sim" for r in runs)
    clock = "virtual time (s, simulated)" if simulated else "time (s)"
    ax_acc.set(xlabel=clock, ylabel="test accuracy", title="time to accuracy")
    ax_loss.set(xlabel=clock, ylabel="test loss", title="test loss", yscale="log")
    ax_acc.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_utilisation(runs: list[RunResult], path: Path) -> Path:
    """Per-worker share of time busy / communicating / idle, one panel per run."""
    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 3.6), squeeze=False)
    for ax, r in zip(axes[0], runs, strict=True):
        workers = r.summary.get("workers", [])
        names = [w["name"] for w in workers]
        total = [max(w["busy_s"] + w["comm_s"] + w["idle_s"], 1e-12) for w in workers]
        busy = [w["busy_s"] / t for w, t in zip(workers, total, strict=True)]
        comm = [w["comm_s"] / t for w, t in zip(workers, total, strict=True)]
        idle = [w["idle_s"] / t for w, t in zip(workers, total, strict=True)]
        x = range(len(names))
        ax.bar(x, busy, label="compute", color="tab:green")
        ax.bar(x, comm, bottom=busy, label="communication", color="tab:blue")
        ax.bar(x, idle, bottom=[b + c for b, c in zip(busy, comm, strict=True)], label="idle",
               color="tab:grey")
        ax.set_xticks(list(x), names, rotation=60, fontsize=7)
        ax.set(ylim=(0, 1), title=f"{r.name}\nHW efficiency "
               f"{r.summary.get('hardware_efficiency', 0):.2f}")
    axes[0][0].set_ylabel("share of time")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_noise_scale(runs: list[RunResult], path: Path) -> Path | None:
    """The gradient noise scale a run measured and the global batch it trained with, against
    time (runs whose strategy logs them, e.g. auto); None when no run does."""
    logged = [r for r in runs if any(row.get("noise_scale") is not None for row in r.rows)]
    if not logged:
        return None
    fig, (ax_noise, ax_batch) = plt.subplots(1, 2, figsize=(11, 4))
    for r in logged:
        rows = [row for row in r.rows if row.get("noise_scale") is not None]
        t = [row["time_s"] for row in rows]
        ax_noise.plot(t, [row["noise_scale"] for row in rows], marker=".", label=_label(r))
        ax_batch.step([row["time_s"] for row in r.rows],
                      [row.get("global_batch") for row in r.rows], where="post", label=_label(r))
    simulated = all(r.summary.get("engine") == "sim" for r in logged)
    clock = "virtual time (s, simulated)" if simulated else "time (s)"
    ax_noise.set(xlabel=clock, ylabel="samples", yscale="log",
                 title="gradient noise scale (measured)")
    ax_batch.set(xlabel=clock, ylabel="samples per step", yscale="log",
                 title="global batch of the plan")
    ax_noise.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
