"""TensorBoard event files of a run (train.tensorboard): every evaluation row's numeric columns
as scalars under runs/<name>/tensorboard/, beside metrics.jsonl; view with
`tensorboard --logdir runs`.

tensorboard is an optional dependency: the config refuses the option when the package is
missing (hetrain.validate.check_tensorboard), so a run never trains only to fail at its first
row. Only `MetricsLog` writes here, so both engines write the same events (the dist engine on
rank 0, which alone keeps the log).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

TENSORBOARD_DIR = "tensorboard"
"""The events folder inside a run directory."""


def row_scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numeric columns of an evaluation row (what metrics.csv holds, less the empty ones):
    per-worker lists, strings and None (no accuracy, no train loss yet) have no scalar."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


class TensorBoardLog:
    """Writes evaluation rows as scalars, one tag per column (the metrics.jsonl key).

    Global step: the row's `updates`, the model version (the step the lr schedule follows).
    Wall time: when the log was opened plus the row's time_s, so that TensorBoard's RELATIVE
    axis shows run time, the time of time to accuracy (virtual seconds on the simulator, whose
    rows would otherwise all land within the seconds it took to simulate them).

    The writer opens at the first row, so that a resumed run can first say from which step the
    events of its earlier attempt are stale (`purge_from`). Every row is flushed: rows are
    few, and a run killed outright keeps what it showed."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.start_walltime = time.time()
        self.purge_step: int | None = None
        self._writer: SummaryWriter | None = None
        self._closed = False

    def purge_from(self, step: int) -> None:
        """A resumed run: hide the earlier attempt's events at steps >= `step` (it wrote them
        after the checkpoint the run continues from; they are written again)."""
        self.purge_step = step

    def write(self, row: dict[str, Any]) -> None:
        if self._closed:
            return
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self.purge_step)
        step = int(row["updates"])
        walltime = self.start_walltime + float(row["time_s"])
        for tag, value in row_scalars(row).items():
            self._writer.add_scalar(tag, value, global_step=step, walltime=walltime)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; later rows are dropped (idempotent)."""
        self._closed = True
        if self._writer is not None:
            self._writer.close()
            self._writer = None
