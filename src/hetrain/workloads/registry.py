"""Name -> builder registries for models and data sets, filled by two explicit decorators.

A model builder is `(input_shape, num_classes, **options) -> nn.Module`; a data set loader is
`(**options) -> (train, test, meta)`. Each model declares which input kinds it accepts so that
get_workload can reject a bad pairing (vgg on a 1-D signal, gpt on images) before building it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar

from torch import nn

InputKind = Literal["signal", "image", "tokens"]
"""signal: (L,) or (C, L) floats; image: (C, H, W) floats; tokens: (T,) longs."""

ModelBuilder = Callable[..., nn.Module]
DatasetLoader = Callable[..., tuple[Any, Any, dict[str, Any]]]

MODELS: dict[str, ModelBuilder] = {}
MODEL_INPUTS: dict[str, frozenset[str]] = {}
DATASETS: dict[str, DatasetLoader] = {}

F = TypeVar("F", bound=Callable[..., Any])


def register_model(name: str, *, inputs: tuple[InputKind, ...]) -> Callable[[F], F]:
    """Register `fn` as model `name` accepting the given input kinds."""

    def deco(fn: F) -> F:
        if name in MODELS:
            raise ValueError(f"model '{name}' is already registered")
        MODELS[name], MODEL_INPUTS[name] = fn, frozenset(inputs)
        return fn

    return deco


def register_dataset(name: str) -> Callable[[F], F]:
    """Register `fn` as data set loader `name`."""

    def deco(fn: F) -> F:
        if name in DATASETS:
            raise ValueError(f"dataset '{name}' is already registered")
        DATASETS[name] = fn
        return fn

    return deco


def input_kind(task: str, input_shape: tuple[int, ...]) -> InputKind:
    """The kind of input a data set yields, from its task and sample shape."""
    if task == "language_model":
        return "tokens"
    return "image" if len(input_shape) == 3 else "signal"


def make_meta(
    num_classes: int, input_shape: tuple[int, ...], task: str, sample_bytes: int, **extra: Any
) -> dict[str, Any]:
    """The meta dict every loader returns (the required keys plus loader-specific extras)."""
    return dict(
        num_classes=num_classes, input_shape=tuple(input_shape), task=task,
        sample_bytes=sample_bytes, **extra,
    )
