"""One explicit registry of strategies by name (no lookups by attribute name elsewhere)."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from hetrain.errors import ConfigError
from hetrain.strategies.base import Strategy

REGISTRY: dict[str, type[Strategy]] = {}
S = TypeVar("S", bound=type[Strategy])


def register(cls: S) -> S:
    """Class decorator: make a strategy available by its `name` (users may register theirs)."""
    if not cls.name or cls.name == "base":
        raise ValueError(f"{cls.__name__} needs a class attribute `name`")
    REGISTRY[cls.name] = cls
    return cls


def strategy_options(name: str) -> dict[str, Any]:
    """The configurable fields of a strategy and their defaults."""
    cls = get_class(name)
    return {f.name: f.default for f in dataclasses.fields(cls) if f.init}


def get_class(name: str) -> type[Strategy]:
    if name not in REGISTRY:
        raise ConfigError(f"unknown strategy '{name}'; choose one of: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def make_strategy(name: str, **options: Any) -> Strategy:
    """Build a strategy from its name and config options, naming any unknown option."""
    cls = get_class(name)
    allowed = strategy_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(f"strategy '{name}': unknown option(s) {unknown}; "
                          f"allowed: {sorted(allowed) or 'none'}")
    return cls(**options)
