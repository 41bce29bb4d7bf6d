"""Strategy options declare their ranges and choices once, with the field; one check applies them.

A strategy's options are its dataclass's init fields (the config's [strategy] table). A field
says what it accepts in its annotation, in hetrain.validate's vocabulary of number ranges:

    local_steps: Annotated[int, integer(1, MAX_STEPS)] = 1
    momentum: Annotated[float, fraction(lo_open=False)] = 0.5        # in [0, 1)
    commits_init: Annotated[int, integer(0, MAX_STEPS).with_note("0: auto")] = 0
    weighting: Literal["samples", "uniform"] = "samples"

`Strategy.__post_init__` calls `check_declared`, so every construction (a config, the Python
API, a test) is checked the same way, and `hetrain.validate.check_options` reads the same
declarations when it checks a config's table, before any strategy is built. A ConfigError
names the strategy, the field and the allowed range or choices:

    strategy ashl: switch_patience must be an integer >= 1, got 0

A range rejects booleans (TOML and JSON give `true` where a number was meant, and Python's
bool is an int), non-finite floats, and floats where it wants an integer. What one field
cannot say alone (cadp's min_local_steps <= max_local_steps) stays in the strategy's own
`__post_init__`, after `super().__post_init__()`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from typing import Any

from hetrain.errors import ConfigError
from hetrain.validate import (
    MAX_STEPS,
    Limit,
    check_limit,
    declared_choices,
    declared_limit,
    fraction,
    integer,
    non_negative,
    positive,
    type_hints,
)

__all__ = ["MAX_STEPS", "Declared", "Limit", "check_declared", "declarations", "fraction",
           "integer", "non_negative", "positive"]
"""The toolkit: the range vocabulary of hetrain.validate, and the check of a dataclass's
declarations (any dataclass's, not only a strategy's)."""


@dataclass(frozen=True)
class Declared:
    """What one init field of a dataclass declares it accepts: a range, choices, or both."""

    name: str
    limit: Limit | None = None
    choices: tuple[Any, ...] | None = None


@cache
def declarations(cls: type) -> tuple[Declared, ...]:
    """The declared range and choices of every init field of `cls` that has any, in field
    order (fields a subclass re-declares carry the subclass's annotation)."""
    hints = type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name)
        d = Declared(f.name, declared_limit(tp), declared_choices(tp))
        if f.init and (d.limit is not None or d.choices is not None):
            out.append(d)
    return tuple(out)


def check_declared(obj: Any, what: str) -> None:
    """Check every declared field of the dataclass instance `obj`; `what` names it in the
    ConfigError ("strategy ashl")."""
    cls: type = type(obj)
    for d in declarations(cls):
        value = getattr(obj, d.name)
        if d.limit is not None:
            check_limit(f"{what}: {d.name}", value, d.limit)
        if d.choices is not None and not any(value == c and type(value) is type(c)
                                             for c in d.choices):
            raise ConfigError(f"{what}: {d.name} = {value!r}; choose one of: "
                              f"{', '.join(map(str, d.choices))}")
