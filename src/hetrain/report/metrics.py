"""Run metrics: `runs/<name>/metrics.jsonl` (one row per evaluation; the scalar columns also
in metrics.csv, and as TensorBoard scalars under tensorboard/ with train.tensorboard) and
`summary.json`.

Both engines fill a `MetricsLog`; `hetrain report` reads the files back. Time-to-accuracy
(TTA) is the first evaluation time at which test accuracy reaches the target. Hardware
efficiency is achieved samples/s over the sum of the devices' samples/s.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hetrain.errors import ConfigError
from hetrain.report.tensorboard_log import TENSORBOARD_DIR, TensorBoardLog
from hetrain.validate import read_text_file


@dataclass
class WorkerTimes:
    """Where one worker's time went (seconds) and what it moved."""

    name: str
    busy_s: float = 0.0
    comm_s: float = 0.0
    idle_s: float = 0.0
    samples: int = 0
    pushes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    unsent_samples: int = 0
    """Samples the worker computed (or was computing) whose pushes the global model never got:
    in flight when the run stopped, or buffered at the server but never applied (set at the
    end of a run; a dist run also counts the work of a worker that was lost)."""


@dataclass
class RunResult:
    """What a run returns to the API and the CLI."""

    name: str
    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    run_dir: Path | None = None

    @property
    def final_accuracy(self) -> float:
        """The last test accuracy (NaN for a run that measures none: train_step, no eval_fn)."""
        acc = self.summary["final_accuracy"]
        return float("nan") if acc is None else float(acc)

    @property
    def tta_s(self) -> float | None:
        return self.summary.get("tta_s")


@dataclass
class MetricsLog:
    """Accumulates evaluation rows and per-worker times; writes JSONL as it goes."""

    name: str
    workers: list[WorkerTimes]
    run_dir: Path | None = None
    target_accuracy: float = 0.0
    target_loss: float = 0.0
    rows: list[dict[str, Any]] = field(default_factory=list)
    tta_s: float | None = None
    tta_samples: int | None = None

    csv_fields: list[str] = field(default_factory=list)
    """The columns of metrics.csv: the first row's scalar fields."""
    tensorboard: bool = False
    """Also write every row to TensorBoard events in run_dir/tensorboard (train.tensorboard;
    nothing without a run_dir). The engine calls `close` when the run ends, however it ends."""
    tb: TensorBoardLog | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "metrics.jsonl").write_text("")
            (self.run_dir / "metrics.csv").write_text("")
            if self.tensorboard:
                self.tb = TensorBoardLog(self.run_dir / TENSORBOARD_DIR)

    def target_reached(self) -> bool:
        return self.tta_s is not None

    def record(self, *, time_s: float, samples: int, epoch: float, updates: int,
               test_loss: float, test_accuracy: float | None, train_loss: float | None,
               bytes_total: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """One evaluation row; `extra` holds the strategy's own figures (Strategy.metrics)."""
        row = {"time_s": time_s, "samples": samples, "epoch": epoch, "updates": updates,
               "test_loss": test_loss, "test_accuracy": test_accuracy, "train_loss": train_loss,
               "bytes_total": bytes_total,
               "busy_s": [w.busy_s for w in self.workers],
               "comm_s": [w.comm_s for w in self.workers],
               "idle_s": [w.idle_s for w in self.workers], **(extra or {})}
        self.rows.append(row)
        if self.tta_s is None and self._hits_target(test_accuracy, test_loss):
            self.tta_s, self.tta_samples = time_s, samples
        if self.run_dir is not None:
            with (self.run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            self._write_csv(row)
        if self.tb is not None:
            self.tb.write(row)
        return row

    def restore(self, rows: list[dict[str, Any]], updates: int) -> None:
        """A resumed run's rows so far (from its checkpoint at model version `updates`):
        metrics.jsonl and metrics.csv are written again with them; the TensorBoard events
        already hold them, and those its earlier attempt wrote after the checkpoint are
        hidden (written again as the run redoes those updates)."""
        self.rows.extend(rows)
        if self.run_dir is not None:
            with (self.run_dir / "metrics.jsonl").open("w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            for row in rows:
                self._write_csv(row)
        if self.tb is not None:
            self.tb.purge_from(updates + 1)

    def close(self) -> None:
        """Flush and close the TensorBoard events (the JSONL and CSV files are closed after
        every row)."""
        if self.tb is not None:
            self.tb.close()

    def _write_csv(self, row: dict[str, Any]) -> None:
        """metrics.csv: the scalar columns of metrics.jsonl (per-worker lists left out), for
        a spreadsheet or pandas.read_csv."""
        assert self.run_dir is not None
        header = not self.csv_fields
        if header:
            self.csv_fields = [k for k, v in row.items() if not isinstance(v, list | dict)]
        with (self.run_dir / "metrics.csv").open("a", newline="") as f:
            writer = csv.DictWriter(f, self.csv_fields, extrasaction="ignore")
            if header:
                writer.writeheader()
            writer.writerow({k: ("" if row.get(k) is None else row.get(k))
                             for k in self.csv_fields})

    def _hits_target(self, acc: float | None, loss: float) -> bool:
        if self.target_accuracy > 0:
            return acc is not None and acc >= self.target_accuracy
        return self.target_loss > 0 and loss <= self.target_loss

    def summarise(self, *, time_s: float, ideal_samples_per_s: float,
                  extra: dict[str, Any]) -> RunResult:
        samples = sum(w.samples for w in self.workers)
        last = self.rows[-1] if self.rows else {}
        achieved = samples / time_s if time_s > 0 else 0.0
        summary = {
            "name": self.name,
            **extra,
            "time_s": time_s,
            "samples": samples,
            "epochs": last.get("epoch", 0.0),
            "updates": last.get("updates", 0),
            "final_accuracy": last.get("test_accuracy", 0.0),
            "best_accuracy": max((r["test_accuracy"] for r in self.rows
                                  if r["test_accuracy"] is not None),
                                 default=None if self.rows and last["test_accuracy"] is None
                                 else 0.0),
            "final_loss": last.get("test_loss", float("nan")),
            "target_accuracy": self.target_accuracy or None,
            "target_loss": self.target_loss or None,
            "tta_s": self.tta_s,
            "tta_samples": self.tta_samples,
            "achieved_samples_per_s": achieved,
            "ideal_samples_per_s": ideal_samples_per_s,
            "hardware_efficiency": achieved / ideal_samples_per_s if ideal_samples_per_s else 0.0,
            "bytes_total": sum(w.bytes_sent + w.bytes_received for w in self.workers),
            "workers": [asdict(w) for w in self.workers],
        }
        if self.run_dir is not None:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return RunResult(self.name, self.rows, summary, self.run_dir)


def load_run(path: str | Path) -> RunResult:
    """Read a run directory (or its summary.json) back."""
    p = Path(path)
    run_dir = p.parent if p.name == "summary.json" else p
    summary_file = run_dir / "summary.json"
    if not summary_file.is_file():
        raise ConfigError(f"'{run_dir}' is not a run directory (no summary.json); "
                          "give directories under runs/ written by `hetrain run`")
    summary = _read_json(summary_file, "run summary")
    if not isinstance(summary, dict):
        raise ConfigError(f"run summary '{summary_file}' holds {type(summary).__name__}, not "
                          "a JSON object: not a summary written by `hetrain run`")
    _check_summary(summary, f"run summary '{summary_file}'")
    rows_file = run_dir / "metrics.jsonl"
    rows = []
    if rows_file.is_file():
        text = read_text_file(rows_file, "run metrics", max_bytes=None)
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                row = _parse_json(line, f"run metrics '{rows_file}' line {n}")
                if not isinstance(row, dict):
                    raise ConfigError(f"run metrics '{rows_file}' line {n} is not a JSON "
                                      f"object")
                _check_types(row, ROW_NUMBERS, f"run metrics '{rows_file}' line {n}",
                             required=("time_s", "test_loss", "test_accuracy"))
                rows.append(row)
    return RunResult(str(summary.get("name", run_dir.name)), rows, summary, run_dir)


SUMMARY_NUMBERS = ("tta_s", "final_accuracy", "best_accuracy", "epochs", "time_s",
                   "hardware_efficiency", "bytes_total", "target_accuracy")
SUMMARY_STRINGS = ("name", "strategy", "engine", "cluster")
WORKER_NUMBERS = ("busy_s", "comm_s", "idle_s")
ROW_NUMBERS = ("time_s", "test_loss", "test_accuracy", "noise_scale", "global_batch")
"""The fields `hetrain report` computes or plots with: numbers (or null) when present."""


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_types(obj: dict[str, Any], numbers: tuple[str, ...], what: str,
                 required: tuple[str, ...] = ()) -> None:
    """A file damaged or edited by hand fails here with one line, not in a plot."""
    for key in required:
        if key not in obj:
            raise ConfigError(f"{what} has no '{key}'; the file is damaged: rerun or leave "
                              "this run out")
    for key in numbers:
        if obj.get(key) is not None and not _is_number(obj[key]):
            raise ConfigError(f"{what}: '{key}' is {obj[key]!r}, not a number; the file is "
                              "damaged: rerun or leave this run out")


def _check_summary(summary: dict[str, Any], what: str) -> None:
    _check_types(summary, SUMMARY_NUMBERS, what)
    for key in SUMMARY_STRINGS:
        if summary.get(key) is not None and not isinstance(summary[key], str):
            raise ConfigError(f"{what}: '{key}' is {summary[key]!r}, not a string; the file "
                              "is damaged: rerun or leave this run out")
    workers = summary.get("workers", [])
    if not isinstance(workers, list) or not all(isinstance(w, dict) for w in workers):
        raise ConfigError(f"{what}: 'workers' is not a list of objects; the file is damaged: "
                          "rerun or leave this run out")
    for k, w in enumerate(workers):
        _check_types(w, WORKER_NUMBERS, f"{what} workers[{k}]",
                     required=("name", *WORKER_NUMBERS))


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} is not valid JSON ({e}); the file is damaged: rerun or "
                          "leave this run out") from None


def _read_json(path: Path, what: str) -> Any:
    return _parse_json(read_text_file(path, what, max_bytes=None), f"{what} '{path}'")
