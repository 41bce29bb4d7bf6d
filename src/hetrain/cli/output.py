"""Progress display and result printing shared by the subcommands (rich; --quiet; --json)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from hetrain.context import ProgressFn


class Output:
    """Where a command writes: rich text on stderr/stdout, nothing with --quiet, JSON with --json."""

    def __init__(self, quiet: bool = False, as_json: bool = False) -> None:
        self.quiet = quiet or as_json
        self.as_json = as_json
        # Piped output (CI logs, files) gets a wide table instead of rich's 80-column default.
        width = None if sys.stdout.isatty() else 160
        self.console = Console(stderr=False, highlight=False, width=width)
        self.err = Console(stderr=True, highlight=False, width=width)

    def print(self, *objects: Any) -> None:
        if not self.quiet:
            self.console.print(*objects)

    def json(self, data: Any) -> None:
        if self.as_json:
            sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")

    @contextmanager
    def progress(self, label: str) -> Iterator[ProgressFn]:
        """A progress bar for one run; yields the callback engines call. The bar appears at
        the first call (the run's first evaluation), so that a run that fails while it is
        set up (a bad data set, a bad option) prints its one-line error and nothing else."""
        if self.quiet:
            yield lambda frac, row: None
            return
        bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                       TextColumn("{task.percentage:>3.0f}%"), TextColumn("{task.fields[info]}"),
                       TimeElapsedColumn(), console=self.err, transient=False)
        task = None

        def update(frac: float, row: dict[str, Any] | None) -> None:
            nonlocal task
            if task is None:
                bar.start()
                task = bar.add_task(escape(label), total=1.0, info="")
            info = ""
            if row is not None:
                info = (f"t={row['time_s']:.3g}s  ep={row['epoch']:.2f}  "
                        f"acc={_acc(row['test_accuracy'])}  loss={row['test_loss']:.3f}")
            bar.update(task, completed=frac, info=info)

        try:
            yield update
        finally:
            if task is not None:
                bar.stop()


def _acc(acc: float | None) -> str:
    """A row's test accuracy; "-" for a run that measures none (train_step without eval_fn)."""
    return "-" if acc is None else f"{acc:.3f}"
