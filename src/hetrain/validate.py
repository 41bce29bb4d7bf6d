"""Input validation: one set of rules for everything a user hands hetrain before it trains.

Config loading (hetrain.config), cluster files (hetrain.cluster), the workload registry and
the CLI call these checks, so that a bad input fails at once with one ConfigError that names
the key, what it must be and how to fix it, before any data is loaded, any process spawned or
any file written:

- numbers: `check_number` (finite, of the right kind, in a named range); the ranges of the
  run config's numeric fields are `FIELD_LIMITS`, documented in docs/config.md;
- option tables (`workload.model_options`, `workload.dataset_options`, strategy options,
  `train.compression_options`): `check_options` checks the keys against the signature or the
  dataclass that consumes them, the values against its annotations (a `Literal[...]` names
  the choices), and the ranges in `OPTION_LIMITS` or declared with the annotation itself,
  `Annotated[int, integer(1, MAX_STEPS)]` (`declared_limit`; the strategies declare theirs so,
  hetrain.strategies.options);
- files and names: `read_text_file` (missing, a directory, binary, not UTF-8), `check_run_name`
  (a run directory under the runs dir, never outside it), `check_runs_dir`;
- `preflight`: what needs more than the config itself (the cluster file, the number of PS
  shards it can take, the runs dir), run by the CLI before it starts a run.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import math
import numbers
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, cast

from hetrain.errors import ConfigError

if TYPE_CHECKING:
    from hetrain.config import RunConfig

MAX_DEVICES = 100_000
"""Largest cluster (devices, `count` included) a cluster file may declare."""
MAX_CONFIG_BYTES = 10_000_000
"""Largest config or cluster file read (a run config is a few hundred bytes of TOML)."""
MAX_NAME_CHARS = 200
"""Longest run name (the run directory's name; variants append a suffix to it)."""
SEED_MAX = 2**32 - 1


def _fmt(x: float) -> str:
    """1000 -> '1000', 10**9 -> '1e9', 0.5 -> '0.5', 2**32 - 1 -> '4294967295'."""
    exp = math.log10(abs(x)) if x else 0.0
    if exp >= 6 and exp.is_integer() and float(x) == 10 ** int(exp) * (1 if x > 0 else -1):
        return f"{'-' if x < 0 else ''}1e{int(exp)}"
    if isinstance(x, int) or float(x).is_integer():
        return str(int(x))
    return f"{x:g}"


@dataclass(frozen=True)
class Limit:
    """A named range: lo..hi (each end closed unless *_open), integers only if `integer`.
    For a list-valued option the range applies to each entry and `length` bounds its size."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    length: tuple[int, int] | None = None
    note: str = ""
    """What a special value inside the range means ("0: auto"): error messages add it, so a
    user who tried a negative number learns that 0 is the way to ask for the default."""

    def with_note(self, note: str) -> Limit:
        """This range, with `note` in its error messages."""
        return dataclasses.replace(self, note=note)

    def contains(self, v: float) -> bool:
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below

    def describe(self) -> str:
        """'a positive number <= 1000', 'an integer >= 1 and <= 1024', 'in [0, 1)' ..."""
        if math.isinf(self.hi):
            if self.lo == 0 and not self.integer:
                return "a positive number" if self.lo_open else "a non-negative number"
            return (f"{'an integer' if self.integer else 'a number'} "
                    f"{'>' if self.lo_open else '>='} {_fmt(self.lo)}")
        hi = f"{'<' if self.hi_open else '<='} {_fmt(self.hi)}"
        if self.integer:
            if self.lo_open:
                return f"an integer > {_fmt(self.lo)} and {hi}"
            return f"an integer >= {_fmt(self.lo)} and {hi}"
        if self.lo == 0 and self.lo_open:
            return f"a positive number {hi}"
        if self.lo == 0 and not self.hi_open and self.hi >= 1e3:
            return f"a non-negative number {hi}"
        return (f"in {'(' if self.lo_open else '['}{_fmt(self.lo)}, {_fmt(self.hi)}"
                f"{')' if self.hi_open else ']'}")


def positive(hi: float = math.inf) -> Limit:
    return Limit(0, hi, lo_open=True)


def non_negative(hi: float = math.inf) -> Limit:
    return Limit(0, hi)


def integer(lo: int, hi: float = math.inf, length: tuple[int, int] | None = None) -> Limit:
    return Limit(lo, hi, integer=True, length=length)


def fraction(lo_open: bool = True, hi_open: bool = True) -> Limit:
    return Limit(0, 1, lo_open=lo_open, hi_open=hi_open)


FIELD_LIMITS: dict[str, Limit] = {
    "optimizer.lr": positive(1e3),
    "optimizer.momentum": fraction(lo_open=False),
    "optimizer.weight_decay": non_negative(1e3),
    "optimizer.clip_grad_norm": non_negative(1e9),
    "train.batch_size": integer(1, 10**9),
    "train.seed": integer(0, SEED_MAX),
    "train.eval_every_epochs": positive(1e6),
    "train.eval_every_s": non_negative(1e9),
    "train.threads": integer(1, 1024),
    "train.checkpoint_every": integer(0, 10**9),
    "stop.max_epochs": positive(1e6),
    "stop.max_time_s": non_negative(1e9),
    "stop.target_accuracy": Limit(0, 1),
    "stop.target_loss": non_negative(1e6),
    "dist.time_scale": positive(1e3),
    "dist.contention_k": positive(1e3),
    "dist.worker_timeout_s": positive(1e6),
    "dist.init_timeout_s": positive(1e6),
    "dist.port": integer(0, 65535),
    "dist.ps_shards": integer(1, 1024),
    "parallel.n_micro": integer(0, 4096),
    "parallel.restarts": integer(1, 100),
    "parallel.eval_batch_size": integer(1, 10**6),
}
"""The range of every numeric field of the run config, by `section.key` (docs/config.md
shows them). Every value must also be finite; integers must be TOML integers (2.0 is not)."""

MAX_STEPS = 10_000
"""Largest step count (local steps, gaps, staleness): a round of more steps than this would
run for hours on one task before the run could stop."""
_SEED = integer(0, SEED_MAX)
_SIZE = integer(1, 65536)

OPTION_LIMITS: dict[tuple[str, str, str], Limit] = {
    # models: sizes that build in memory on one machine
    ("model", "mlp", "hidden"): integer(1, 16384, length=(0, 64)),
    ("model", "cnn", "channels"): integer(1, 4096),
    ("model", "cnn", "layers"): integer(1, 64),
    ("model", "vgg", "width"): integer(1, 1024),
    ("model", "vgg", "convs"): integer(0, 16, length=(1, 8)),
    ("model", "vgg", "fc"): integer(1, 16384),
    ("model", "resnet", "width"): integer(1, 1024),
    ("model", "resnet", "blocks"): integer(1, 64, length=(1, 8)),
    ("model", "gpt", "n_layer"): integer(1, 256),
    ("model", "gpt", "n_head"): integer(1, 256),
    ("model", "gpt", "n_embd"): integer(1, 16384),
    ("model", "gpt", "block_size"): _SIZE,
    ("model", "gpt", "dropout"): fraction(lo_open=False),
    # data sets
    ("dataset", "digits", "seed"): _SEED,
    ("dataset", "digits", "test_fraction"): fraction(),
    ("dataset", "mnist1d", "num_samples"): integer(10, 10**7),
    ("dataset", "mnist1d", "seed"): _SEED,
    ("dataset", "text", "max_chars"): integer(1, 2**31 - 1),
    ("dataset", "text", "block_size"): _SIZE,
    ("dataset", "text", "stride"): _SIZE,
    ("dataset", "text", "test_fraction"): fraction(),
    ("dataset", "imagefolder", "size"): integer(1, 4096),
    ("dataset", "imagefolder", "test_fraction"): fraction(),
    ("dataset", "imagefolder", "seed"): _SEED,
    ("dataset", "imagefolder", "max_per_class"): integer(1, 10**9),
    ("dataset", "imagefolder", "mean"): Limit(-1e3, 1e3, length=(3, 3)),
    ("dataset", "imagefolder", "std"): Limit(0, 1e3, lo_open=True, length=(3, 3)),
    ("dataset", "cifar10", "max_train"): integer(1, 10**9),
    ("dataset", "cifar10", "mean"): Limit(-1e3, 1e3, length=(3, 3)),
    ("dataset", "cifar10", "std"): Limit(0, 1e3, lo_open=True, length=(3, 3)),
    # strategies: none here, each declares its ranges with its fields (strategies/options.py)
    # compressors
    ("compression", "qsgd", "seed"): _SEED,
    # `hetrain plan --model M --model-option KEY=VALUE` (layer graphs for the cost model)
    ("plan", "gpt", "n_layer"): integer(1, 128),
    ("plan", "gpt", "n_embd"): integer(1, 65536),
    ("plan", "gpt", "n_head"): integer(1, 1024),
    ("plan", "gpt", "vocab"): integer(1, 10**7),
    ("plan", "gpt", "block_size"): integer(1, 10**6),
    ("plan", "vgg", "image"): integer(1, 4096, length=(3, 3)),
    ("plan", "vgg", "width"): integer(1, 4096),
    ("plan", "vgg", "convs"): integer(0, 16, length=(1, 8)),
    ("plan", "vgg", "fc"): integer(1, 65536),
    ("plan", "vgg", "num_classes"): integer(1, 10**6),
    ("plan", "mlp", "input_shape"): integer(1, 10**6, length=(1, 3)),
    ("plan", "mlp", "num_classes"): integer(1, 10**5),
    ("plan", "cnn", "input_shape"): integer(1, 10**6, length=(1, 3)),
    ("plan", "cnn", "num_classes"): integer(1, 10**5),
}
"""Ranges of the built-in option tables' values, by (kind, name, option), for consumers that do
not declare them in their annotations (the model, data set and compressor builders). Options
with neither an entry here nor a declared range (`declared_limit`) need only be finite and of
their annotated type."""

INT_OPTION_MAX = 2**31 - 1
"""Bound on the magnitude of any integer option without a range bounded on both sides."""


# ---- numbers --------------------------------------------------------------------------------
def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, numbers.Integral):
        return "an integer"
    if isinstance(value, numbers.Real):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def check_number(where: str, value: Any, limit: Limit, hint: str = "") -> int | float:
    """`value` as a number inside `limit`, or a ConfigError naming `where` and the range."""
    hint = f"; {hint}" if hint else ""
    want = limit.describe() + (f" ({limit.note})" if limit.note else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{where} must be {want}, got {value!r} ({_kind(value)}){hint}")
    if limit.integer and not isinstance(value, numbers.Integral):
        raise ConfigError(f"{where} must be {want}, got {value!r} (write a whole number "
                          f"without a decimal point){hint}")
    if not isinstance(value, numbers.Integral) and not math.isfinite(float(value)):
        raise ConfigError(f"{where} must be a finite number ({want}), got {value!r}{hint}")
    # typeshed leaves the numeric tower vague (int and float are no numbers.Real to a type
    # checker): a Real (int, float, a numpy scalar) compares and returns as a float does
    number = cast(float, value)
    if not limit.contains(number):
        raise ConfigError(f"{where} must be {want}, got {value!r}{hint}")
    return number


def _check_length(where: str, value: list[Any] | tuple[Any, ...], limit: Limit) -> None:
    if limit.length is not None:
        lo, hi = limit.length
        if not lo <= len(value) <= hi:
            n = f"{lo}" if lo == hi else f"{lo} to {hi}"
            raise ConfigError(f"{where} must have {n} entries, got {len(value)}")


def check_limit(key: str, value: Any, limit: Limit, label: str = "") -> None:
    """`value` inside `limit`: a number, or where the limit has a `length`, a list of numbers
    (each entry named key[i]); `label` follows the key in messages."""
    if limit.length is not None and isinstance(value, list | tuple):
        _check_length(f"{key}{label}", value, limit)
        for i, v in enumerate(value):
            check_number(f"{key}[{i}]{label}", v, limit)
    else:
        check_number(f"{key}{label}", value, limit)


def check_fields(section: str, obj: Any) -> None:
    """Check every field of a config dataclass that has a range in FIELD_LIMITS."""
    for f in dataclasses.fields(obj):
        limit = FIELD_LIMITS.get(f"{section}.{f.name}")
        if limit is not None:
            check_number(f"{section}.{f.name}", getattr(obj, f.name), limit)


# ---- values against annotations ------------------------------------------------------------
def unannotated(tp: Any) -> Any:
    """`int` for `Annotated[int, ...]`; anything else as it is."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp


def declared_limit(tp: Any) -> Limit | None:
    """The range an annotation declares, `Annotated[int, integer(1, 100)]`; None if none."""
    if typing.get_origin(tp) is not typing.Annotated:
        return None
    return next((m for m in tp.__metadata__ if isinstance(m, Limit)), None)


def declared_choices(tp: Any) -> tuple[Any, ...] | None:
    """The values a `Literal[...]` annotation (optionally inside Annotated) allows; else None."""
    tp = unannotated(tp)
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else None


_SEQUENCES = (collections.abc.Sequence, collections.abc.Iterable, list, tuple)


def _matches(value: Any, tp: Any) -> bool:
    """Does a TOML value fit the annotation `tp`? Unknown annotations accept anything."""
    tp = unannotated(tp)
    if tp is Any or tp is inspect.Parameter.empty:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or isinstance(tp, types.UnionType):
        return any(_matches(value, a) for a in args)
    if tp is type(None) or tp is None:
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp in (Path, PurePath, os.PathLike):
        return isinstance(value, str | PurePath)
    if origin is typing.Literal:
        return value in args
    if origin in _SEQUENCES or tp in _SEQUENCES:
        if not isinstance(value, list | tuple):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(map(_matches, value, args))
        return not args or all(_matches(v, args[0]) for v in value)
    if origin in (dict, collections.abc.Mapping) or tp in (dict, collections.abc.Mapping):
        return isinstance(value, Mapping)
    return True


_PLURAL = {"an integer": "integers", "a number": "numbers", "a string": "strings",
           "a path": "paths", "true or false": "booleans"}


def _describe_type(tp: Any) -> str:
    """'an integer', 'a list of integers', 'a string or a list of strings or paths' ..."""
    tp = unannotated(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or isinstance(tp, types.UnionType):
        arms = [_describe_type(a) for a in args if a is not type(None)]
        return " or ".join(dict.fromkeys(arms))
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp in (Path, PurePath, os.PathLike):
        return "a path"
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in _SEQUENCES or tp in _SEQUENCES:
        if not args:
            return "a list"
        inner = _describe_type(args[0]).split(" or ")
        return "a list of " + " or ".join(dict.fromkeys(_PLURAL.get(t, t) for t in inner))
    if origin in (dict, collections.abc.Mapping) or tp in (dict, collections.abc.Mapping):
        return "a table"
    return getattr(tp, "__name__", str(tp))


def type_hints(obj: Any) -> dict[str, Any]:
    """Resolved annotations of a function or class, Annotated kept (its metadata may declare
    a range); {} where they cannot be resolved."""
    try:
        return typing.get_type_hints(obj, include_extras=True)
    except Exception:  # a user's builder with annotations we cannot evaluate: no type checks
        return {}


def _check_value(key: str, label: str, value: Any, tp: Any, limit: Limit | None) -> None:
    """`key` names the value (e.g. workload.model_options.hidden), `label` what takes it."""
    where = f"{key}{label}"
    if not _matches(value, tp):
        raise ConfigError(f"{where} must be {_describe_type(tp)}, got {value!r} "
                          f"({_kind(value)})")
    items = list(value) if isinstance(value, list | tuple) else [value]
    if isinstance(value, list | tuple) and limit is not None:
        _check_length(where, value, limit)
    for i, v in enumerate(items):
        at = f"{key}[{i}]{label}" if isinstance(value, list | tuple) else where
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            continue
        if limit is not None:
            check_number(at, v, limit)
        elif not isinstance(v, numbers.Integral) and not math.isfinite(float(v)):
            raise ConfigError(f"{at} must be a finite number, got {v!r}")
        bounded = limit is not None and math.isfinite(limit.lo) and math.isfinite(limit.hi)
        if not bounded and isinstance(v, numbers.Integral) and abs(int(v)) > INT_OPTION_MAX:
            raise ConfigError(f"{at} must be an integer of magnitude <= {INT_OPTION_MAX}, "
                              f"got {v}")


def _constructor(cls: type[Any]) -> Callable[..., Any]:
    """`cls.__init__`, self first (mypy refuses `__init__` on a value narrowed to `type`)."""
    return cls.__init__


def check_options(kind: str, name: str, consumer: Callable[..., Any] | type,
                  options: Any, skip: int = 0, table: str = "") -> None:
    """Check an option table against what consumes it: a builder's keyword parameters
    (after the first `skip`), a constructor's, or a dataclass's init fields. Unknown keys,
    missing required ones, values of the wrong type and values out of their range
    (OPTION_LIMITS, else the one the annotation declares, `declared_limit`) are ConfigErrors
    naming the table (`table`, e.g. "workload.model_options"), the key and the accepted
    keys."""
    what = f"{kind} '{name}'"
    if not isinstance(options, Mapping):
        raise ConfigError(f"{table or 'the options'} must be a table of options for {what}, "
                          f"got {options!r} ({_kind(options)})")
    if dataclasses.is_dataclass(consumer):
        fields = [f for f in dataclasses.fields(consumer) if f.init]
        required = [f.name for f in fields if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        allowed = [f.name for f in fields]
        hints = type_hints(consumer)
    else:
        fn = _constructor(consumer) if isinstance(consumer, type) else consumer
        params = list(inspect.signature(fn).parameters.values())[skip:]
        if isinstance(consumer, type):
            params = params[1:]  # self
        params = [p for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        allowed = [p.name for p in params]
        required = [p.name for p in params if p.default is p.empty]
        hints = type_hints(fn)
    at = f"{table}: " if table else ""
    if unknown := sorted(set(options) - set(allowed)):
        raise ConfigError(f"{at}unknown option(s) {unknown} for {what}; choose from: "
                          f"{', '.join(sorted(allowed)) or '(none: remove them)'}")
    if missing := [k for k in required if k not in options]:
        raise ConfigError(f"{at}{what} needs option(s) {missing}")
    for key, value in options.items():
        tp = hints.get(key, Any)
        limit = OPTION_LIMITS.get((kind, name, key)) or declared_limit(tp)
        _check_value(f"{table}.{key}" if table else f"{what}: option {key}",
                     f" ({what})" if table else "", value, tp, limit)


BUILTIN_OPTIMIZERS = ("sgd", "adam", "adamw")


def optimizer_class(name: str) -> type:
    """The torch.optim class `name` names (a ConfigError listing them otherwise)."""
    import torch

    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
            and cls is not torch.optim.Optimizer):
        names = sorted(n for n, c in vars(torch.optim).items() if isinstance(c, type)
                       and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer)
        raise ConfigError(f"optimizer.name = {name!r} is neither sgd, adam, adamw nor a "
                          f"torch.optim optimizer; choose one of: sgd, adam, adamw, "
                          f"{', '.join(names)}")
    return cls


def check_optimizer(name: Any, options: Any) -> None:
    """optimizer.name and optimizer.options: a built-in name takes no options; a torch.optim
    class takes its own keyword arguments (besides params and lr)."""
    if not isinstance(name, str):
        raise ConfigError(f"optimizer.name must be a string, got {name!r}")
    if name in BUILTIN_OPTIMIZERS:
        if options:
            raise ConfigError(f"optimizer.options are for a torch.optim class named in "
                              f"optimizer.name; {name} takes momentum, weight_decay and "
                              "nesterov in [optimizer] itself")
        return
    cls = optimizer_class(name)
    if isinstance(options, Mapping) and "lr" in options:
        raise ConfigError("optimizer.options: set lr as optimizer.lr (strategies scale it)")
    check_options("optimizer", name, cls, options, skip=1, table="optimizer.options")


def _non_finite(value: Any) -> Any:
    """The first non-finite float inside `value` (nested lists / tables), else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return value
    items = value.values() if isinstance(value, Mapping) else (
        value if isinstance(value, list | tuple) else ())
    for v in items:
        if (bad := _non_finite(v)) is not None:
            return bad
    return None


def check_scheduler(name: Any, options: Any) -> None:
    """optimizer.scheduler and optimizer.scheduler_options: a torch.optim.lr_scheduler class
    that the global step alone can drive (hetrain.engine.schedule), and keyword arguments it
    accepts, checked by building it once on a dummy optimizer and taking its first steps.
    SequentialLR / ChainedScheduler: each table of scheduler_options.schedulers is checked the
    same way first, and an error names the one at fault."""
    if not isinstance(name, str):
        raise ConfigError(f"optimizer.scheduler must be a string, got {name!r}")
    if not isinstance(options, Mapping):
        raise ConfigError(f"optimizer.scheduler_options must be a table of keyword arguments, "
                          f"got {options!r} ({_kind(options)})")
    if not name:
        if options:
            raise ConfigError("optimizer.scheduler_options are set but optimizer.scheduler is "
                              "empty; name the torch.optim.lr_scheduler (e.g. \"StepLR\")")
        return
    from hetrain.engine.schedule import COMPOSITES

    if name in COMPOSITES:
        _check_composite(name, options)
    _check_one_scheduler(name, options, "optimizer.scheduler", "optimizer.scheduler_options")


def _check_composite(name: str, options: Mapping[str, Any]) -> None:
    """SequentialLR / ChainedScheduler: scheduler_options.schedulers, a non-empty list of
    tables {name = ..., **options}, each a scheduler checked like a top-level one."""
    from hetrain.engine.schedule import COMPOSITES

    subs = options.get("schedulers")
    example = ('{schedulers = [{name = "LinearLR", start_factor = 0.1, total_iters = 5}, '
               '{name = "CosineAnnealingLR", T_max = 95}]'
               + (", milestones = [5]}" if name == "SequentialLR" else "}"))
    if not isinstance(subs, list | tuple) or not subs:
        raise ConfigError(f"optimizer.scheduler {name} needs scheduler_options.schedulers, a "
                          f"list of scheduler tables, e.g. scheduler_options = {example}; "
                          f"got {subs!r}")
    for k, sub in enumerate(subs):
        key = f"optimizer.scheduler_options.schedulers[{k}]"
        if not isinstance(sub, Mapping) or not isinstance(sub.get("name"), str):
            raise ConfigError(f"{key} must be a table with a scheduler name, e.g. "
                              f"{{name = \"StepLR\", step_size = 10}}; got {sub!r}")
        if sub["name"] in COMPOSITES or sub["name"] == "ReduceLROnPlateau":
            raise ConfigError(f"{key}.name = {sub['name']!r} cannot be used inside {name}: "
                              "name a scheduler of the global step (no nesting)")
        _check_one_scheduler(sub["name"], {k2: v for k2, v in sub.items() if k2 != "name"},
                             f"{key}.name", key)


def _check_one_scheduler(name: str, options: Mapping[str, Any], key: str, opts_key: str
                         ) -> None:
    """One scheduler: `key` names where its name was given, `opts_key` its options."""
    from hetrain.engine.schedule import CALLABLES, make_schedule, scheduler_class

    scheduler_class(name, key)
    if name in CALLABLES and not callable(options.get("lr_lambda")):
        raise ConfigError(f"{key} = {name!r} needs {opts_key}.lr_lambda, a Python callable "
                          f"(got {options.get('lr_lambda')!r}), which a TOML config cannot "
                          f"hold; use the Python API: hetrain.train(scheduler={{'name': "
                          f"'{name}', 'lr_lambda': fn}})")
    for k in ("optimizer", "last_epoch"):
        if k in options:
            raise ConfigError(f"{opts_key}.{k} cannot be set: hetrain steps "
                              "the scheduler by the global step (the server's update count)")
    if (bad := _non_finite(dict(options))) is not None:
        raise ConfigError(f"{opts_key} must hold finite numbers, got {bad!r} "
                          f"in {dict(options)}")
    what = (f"optimizer.scheduler {name} with scheduler_options {dict(options)}"
            if key == "optimizer.scheduler" else f"{opts_key} ({name}, {dict(options)})")
    try:
        schedule = make_schedule(name, options)
        assert schedule is not None
        schedule.check(what=what)
    except ConfigError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        msg = " ".join(str(e).split())
        raise ConfigError(f"{opts_key} {dict(options)} do not fit {name}: "
                          f"{msg}; see torch.optim.lr_scheduler.{name} (learning rates such "
                          "as eta_min or max_lr are factors of optimizer.lr)") from None


def check_limits(kind: str, name: str, values: Mapping[str, Any], table: str) -> None:
    """Values already of the right type (e.g. parsed from the command line) against
    OPTION_LIMITS[(kind, name, key)]; `table` names where they came from."""
    for key, value in values.items():
        _check_value(f"{table} {key}", "", value, Any, OPTION_LIMITS.get((kind, name, key)))


# ---- the parts of a run config that name registered things --------------------------------
def check_workload(model: str, dataset: str, model_options: Any, dataset_options: Any) -> None:
    """Registered names and their option tables (before any data is loaded)."""
    from hetrain.workloads import DATASETS, MODELS

    for what, name, registry in (("model", model, MODELS), ("dataset", dataset, DATASETS)):
        if name not in registry:
            raise ConfigError(f"unknown {what} '{name}'; choose one of: "
                              f"{', '.join(sorted(registry))}")
    check_options("model", model, MODELS[model], model_options, skip=2,
                  table="workload.model_options")
    check_options("dataset", dataset, DATASETS[dataset], dataset_options,
                  table="workload.dataset_options")


def check_strategy(name: str, options: Mapping[str, Any], registered: bool = True) -> None:
    """A registered strategy and options it accepts; building it runs its own range checks.
    registered=False: a name that is not registered passes (the caller brings an instance)."""
    from hetrain.strategies import REGISTRY, make_strategy
    from hetrain.strategies.registry import get_class

    if not registered and name not in REGISTRY:
        return
    cls = get_class(name)
    check_options("strategy", name, cls, options, table="strategy")
    make_strategy(name, **options)


def check_compression(name: str, options: Any) -> None:
    from hetrain.compress import COMPRESSORS, make_compressor

    if name not in COMPRESSORS:
        raise ConfigError(f"train.compression = {name!r} is not allowed; choose one of: "
                          f"{', '.join(COMPRESSORS)}")
    check_options("compression", name, COMPRESSORS[name], options,
                  table="train.compression_options")
    make_compressor(name, **options)


# ---- names, files and directories ------------------------------------------------------------
DEVICE_KINDS = ("cpu", "cuda", "auto")


def check_device_kind(where: str, kind: Any) -> str:
    """A torch device kind for the real engine: cpu | cuda | cuda:N | auto."""
    if isinstance(kind, str) and (kind in DEVICE_KINDS
                                  or (kind.startswith("cuda:") and kind[5:].isdigit())):
        return kind
    raise ConfigError(f"{where} = {kind!r} is not a device kind: use 'cpu', 'cuda', "
                      "'cuda:N' or 'auto'")


def tensorboard_available() -> bool:
    """Whether torch's SummaryWriter can be imported: tensorboard is an optional dependency."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def check_tensorboard() -> None:
    """train.tensorboard needs the tensorboard package: say so when the config is read, before
    any data is loaded, rather than at a run's first evaluation row."""
    if not tensorboard_available():
        raise ConfigError("train.tensorboard = true needs the tensorboard package: "
                          "pip install tensorboard")


def check_run_name(name: Any) -> str:
    """A run's name is the name of its directory under the runs dir: one path component."""
    if not isinstance(name, str):
        raise ConfigError(f"name must be a string, got {name!r} ({_kind(name)})")
    fix = "use letters, digits, '-', '_' and '.', e.g. name = \"hetero8-cadp\""
    if not name.strip():
        raise ConfigError(f"name must not be empty; {fix}")
    if name in (".", ".."):
        raise ConfigError(f"name = {name!r} would write outside the runs directory; {fix}")
    if bad := sorted({c for c in name if c in "/\\" or ord(c) < 32 or ord(c) == 127}):
        raise ConfigError(f"name = {name!r} contains {''.join(bad)!r}: the name is one "
                          f"directory under the runs directory, not a path; {fix}")
    if len(name) > MAX_NAME_CHARS:
        raise ConfigError(f"name is {len(name)} characters long; use at most {MAX_NAME_CHARS}")
    return name


def read_text_file(path: str | Path, what: str = "config file",
                   max_bytes: int | None = MAX_CONFIG_BYTES) -> str:
    """The UTF-8 text of a file (at most max_bytes), or a ConfigError that says what is wrong
    with it: missing, a directory, too large, binary or not UTF-8."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what} '{p}' is a directory; give the path of a TOML file")
    if not p.is_file():
        if p.exists():
            raise ConfigError(f"{what} '{p}' is not a regular file; give the path of a TOML file")
        raise ConfigError(f"{what} '{p}' not found")
    try:
        size = p.stat().st_size
        if max_bytes is not None and size > max_bytes:
            raise ConfigError(f"{what} '{p}' is {size:,} bytes, more than the {max_bytes:,} "
                              f"such a file can have; is it the right file?")
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} '{p}' cannot be read: {e.strerror or e}") from None
    if b"\x00" in raw:
        raise ConfigError(f"{what} '{p}' is a binary file, not text; give the right file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} '{p}' is not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                          f"offset {e.start}); save it as UTF-8") from None


def check_output_dir(path: str | Path, flag: str = "--runs-dir",
                     names: list[str] | tuple[str, ...] = ()) -> None:
    """The directory `path` given with `flag` (and path/<name> for each name) can be created
    and written: checked before a command does any work, not when it saves its results."""
    root = Path(path)
    at = f"{flag} '{root}'"
    for p in (root, *(root / n for n in names)):
        if p.exists() and not p.is_dir():
            raise ConfigError(f"{at}: '{p}' is a file, not a directory; pass another {flag} "
                              f"or move the file")
    parent = root
    while not parent.exists() and parent.parent != parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"{at}: '{parent}' is a file, so the directory cannot be created; "
                          f"pass another {flag}")
    if parent.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{at}: '{parent}' is not writable; pass another {flag}")


def check_runs_dir(runs_dir: str | Path, names: list[str] | tuple[str, ...] = ()) -> None:
    """The runs dir (and runs_dir/<name> for each run) can be created and written."""
    check_output_dir(runs_dir, "--runs-dir", names)


def check_output_file(path: str | Path, flag: str) -> None:
    """A file a command will write (`flag` names the option): not a directory, in an
    existing, writable directory."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} '{p}' is a directory; give a file path")
    parent = p.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} '{p}': the directory '{parent}' does not exist; create it "
                          f"or give another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"{flag} '{p}' is not writable; give another path")


def check_ps_shard_count(shards: int, strategy: str, comm: str | None, devices: int,
                    tensors: int | None = None) -> None:
    """dist.ps_shards > 1 needs a PS strategy (`comm`: the strategy class's, None: not known
    yet), a whole parameter tensor per shard (`tensors`: the model's count, None: not built
    yet) and at most one shard per device of the cluster."""
    if shards == 1:
        return
    if comm is not None and comm != "ps":
        raise ConfigError(f"dist.ps_shards = {shards}: strategy '{strategy}' all-reduces among "
                          f"the workers and has no parameter server; set dist.ps_shards = 1 or "
                          f"pick a PS strategy")
    if tensors is not None and shards > tensors:
        raise ConfigError(f"dist.ps_shards = {shards} but the model has only {tensors} "
                          f"parameter tensors (a shard holds whole tensors); use at most "
                          f"{tensors}")
    if shards > devices:
        raise ConfigError(f"dist.ps_shards = {shards} is more parameter-server shards than the "
                          f"cluster has devices ({devices}); use at most {devices}")


def preflight(cfg: RunConfig, runs_dir: str | Path | None = None) -> None:
    """What the CLI checks before a run starts, beyond the config itself: the cluster (a file
    or preset must load), dist.ps_shards against it, and the runs dir."""
    from hetrain.cluster import load_cluster
    from hetrain.strategies.registry import REGISTRY

    cluster = load_cluster(cfg.cluster)
    if cfg.engine == "dist":
        cls = REGISTRY.get(cfg.strategy.name)
        check_ps_shard_count(cfg.dist.ps_shards, cfg.strategy.name,
                        cls.comm if cls is not None else None, cluster.n)
    if runs_dir is not None:
        check_runs_dir(runs_dir, [cfg.name])
