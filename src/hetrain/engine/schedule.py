"""Learning-rate schedules: any torch.optim.lr_scheduler by name, stepped by the global step.

The global step is the server's model version, the number of updates applied so far; it is
the one clock both engines agree on (the simulator's virtual time and the dist engine's wall
time differ, and so do the workers' local step counts). `LrSchedule.factor(step)` is the
multiplier of optimizer.lr after `step` scheduler steps, computed by torch's own scheduler
on a dummy optimizer whose one parameter has lr 1.0. Using torch's code (not a re-derived
formula) keeps every scheduler's quirks, e.g. the recursive form of CosineAnnealingLR.

Because the dummy's base lr is 1.0, options that are learning rates (eta_min, max_lr,
base_lr of CyclicLR) are given as FACTORS of optimizer.lr: eta_min = 0.01 means
0.01 x optimizer.lr.

SequentialLR and ChainedScheduler take their sub-schedulers as tables, {"name": ..., **its
options} in scheduler_options.schedulers; they are built with torch's own classes on the same
dummy optimizer, in order, as a torch user would build them. LambdaLR and MultiplicativeLR take
their lr_lambda, a Python callable, from the Python API (hetrain.train(scheduler={"name":
"LambdaLR", "lr_lambda": fn})); it must be a pure function of the step, called again from
step 0 when an older step than the cache holds is asked for.

ReduceLROnPlateau steps on the evaluations instead (`PlateauSchedule`): after each evaluation
row the server calls `observe` with its test loss (mode "min") or test accuracy (mode "max"),
torch's scheduler steps on that metric, and its factor holds from that global step on. Both
engines evaluate at the same cadence, so the same metrics give the same factors; its
`patience` and `cooldown` count evaluations, not steps.

The abstract base classes are refused (`REFUSED`).
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim import lr_scheduler

from hetrain.errors import ConfigError

REFUSED: dict[str, str] = {
    "LRScheduler": "it is the abstract base class",
    "_LRScheduler": "it is the abstract base class",
}
"""torch schedulers a global-step schedule cannot use, and why."""

CALLABLES = ("LambdaLR", "MultiplicativeLR")
"""Schedulers of a Python callable (lr_lambda): from the Python API only, not from TOML."""

COMPOSITES = ("SequentialLR", "ChainedScheduler")
"""Schedulers of sub-schedulers, given as tables in scheduler_options.schedulers."""


def _build(optimizer: torch.optim.Optimizer, name: str,
           options: Mapping[str, Any]) -> lr_scheduler.LRScheduler:
    """torch's scheduler `name` on `optimizer`; a composite's sub-schedulers first, in order,
    on the same optimizer (as torch's documentation builds them)."""
    cls = scheduler_class(name)
    if name not in COMPOSITES:
        return cls(optimizer, **options)
    rest = {k: v for k, v in options.items() if k != "schedulers"}
    subs = [_build(optimizer, sub["name"], {k: v for k, v in sub.items() if k != "name"})
            for sub in options.get("schedulers", [])]
    if name == "ChainedScheduler":
        return lr_scheduler.ChainedScheduler(subs, optimizer=optimizer, **rest)
    return lr_scheduler.SequentialLR(optimizer, schedulers=subs, **rest)


def scheduler_names() -> list[str]:
    """The torch.optim.lr_scheduler classes a config may name."""
    return sorted(n for n, c in vars(lr_scheduler).items()
                  if isinstance(c, type) and issubclass(c, lr_scheduler.LRScheduler)
                  and n not in REFUSED)


def scheduler_class(name: str, key: str = "optimizer.scheduler"
                    ) -> type[lr_scheduler.LRScheduler]:
    """The class `name` names, or a ConfigError saying why not and what may be named (`key`:
    where the name was given)."""
    if name in REFUSED:
        raise ConfigError(f"{key} = {name!r} cannot be used: {REFUSED[name]}; "
                          f"choose one of: {', '.join(scheduler_names())}")
    if name not in scheduler_names():
        raise ConfigError(f"{key} = {name!r} is not a torch.optim.lr_scheduler "
                          f"scheduler; choose one of: {', '.join(scheduler_names())} "
                          "(or leave it empty for a constant lr)")
    return getattr(lr_scheduler, name)


class LrSchedule:
    """factor(step): optimizer.lr's multiplier at global step `step` (0: before any update).

    The dummy scheduler steps forward and the newest `cache` factors are kept, so the
    increasing steps an engine asks for cost one torch step each, and a recent earlier step
    (an evaluation row, a task released at an older version) is a cache hit; a step older
    than the cache is recomputed from scratch. A scheduler with an end (OneCycleLR past
    total_steps) holds its last factor from then on, where torch would raise."""

    def __init__(self, name: str, options: Mapping[str, Any] | None = None,
                 cache: int = 4096) -> None:
        if cache < 1:
            raise ValueError(f"cache must be >= 1, got {cache}")
        self.name = name
        self.options = dict(options or {})
        self.cache = cache
        self._start()

    def _start(self) -> None:
        self._optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._scheduler = _build(self._optimizer, self.name, self.options)
        self._factors: deque[float] = deque([float(self._scheduler.get_last_lr()[0])],
                                            maxlen=self.cache)
        self._last = 0
        """The step of the newest factor, self._factors[-1]."""
        self._ended = False

    def _advance(self) -> None:
        # OneCycleLR defines steps 0..total_steps-1 only (torch extrapolates one step past
        # them, then raises): hold the last defined factor from there on.
        self._last += 1
        if self._last >= getattr(self._scheduler, "total_steps", math.inf):
            self._ended = True
        if not self._ended:
            self._optimizer.step()  # no gradient: a no-op, but torch warns without it
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self._scheduler.step()
            except ValueError:  # a scheduler that refuses to go on
                self._ended = True
        self._factors.append(self._factors[-1] if self._ended
                             else float(self._scheduler.get_last_lr()[0]))

    def factor(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"a global step is >= 0, got {step}")
        if step <= self._last - len(self._factors):  # older than the cache: start over
            self._start()
        while self._last < step:
            self._advance()
        return self._factors[step - self._last - 1]

    def observe(self, step: int, test_loss: float, test_accuracy: float | None) -> None:
        """An evaluation at global step `step`: nothing for a schedule of the step alone."""

    def check(self, steps: int = 2, what: str | None = None) -> None:
        """ConfigError unless the first `steps` factors are finite and >= 0 (`what`: the
        scheduler as the error names it)."""
        for k in range(steps + 1):
            f = self.factor(k)
            if not (math.isfinite(f) and f >= 0):
                what = what or (f"optimizer.scheduler {self.name} with scheduler_options "
                                f"{self.options}")
                raise ConfigError(f"{what} gives lr factor {f} at step {k}; a factor must be "
                                  "finite and >= 0")


class PlateauSchedule(LrSchedule):
    """ReduceLROnPlateau, stepped by `observe` after each evaluation on its test loss (mode
    "min", the default) or test accuracy (mode "max"); factor(step) is the factor in force at
    global step `step`: the one set by the latest evaluation at or before it."""

    _scheduler: lr_scheduler.ReduceLROnPlateau

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.name = "ReduceLROnPlateau"
        self.options = dict(options or {})
        self._optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        self._scheduler = lr_scheduler.ReduceLROnPlateau(self._optimizer, **self.options)
        self._changes: list[tuple[int, float]] = [(0, 1.0)]
        """(global step, factor from then on), in the order observed."""

    def factor(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"a global step is >= 0, got {step}")
        return next(f for s, f in reversed(self._changes) if s <= step)

    def observe(self, step: int, test_loss: float, test_accuracy: float | None) -> None:
        if self._scheduler.mode == "min":
            metric = test_loss
        elif test_accuracy is None:  # mode "max"
            raise ConfigError("optimizer.scheduler ReduceLROnPlateau with mode = \"max\" "
                              "follows the test accuracy, which this run does not measure "
                              "(a train_step without eval_fn); use mode = \"min\" (the test "
                              "loss)")
        else:
            metric = test_accuracy
        self._scheduler.step(metric)
        self._change(step, self._optimizer.param_groups[0]["lr"])

    def follow(self, step: int, factor: float) -> None:
        """Take the factor rank 0's schedule gives global step `step` (all-reduce workers and
        PS shards run their own server but never see the evaluations it steps on)."""
        self._change(step, factor)

    def _change(self, step: int, factor: float) -> None:
        """`factor` from global step `step` on (steps are observed in order)."""
        if factor != self._changes[-1][1]:
            self._changes.append((max(step, self._changes[-1][0]), factor))


def make_schedule(name: str, options: Mapping[str, Any] | None = None) -> LrSchedule | None:
    """The schedule of optimizer.scheduler / scheduler_options; None for "" (constant lr)."""
    if name == "ReduceLROnPlateau":
        return PlateauSchedule(options)
    return LrSchedule(name, options) if name else None
