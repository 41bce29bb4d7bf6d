"""The compressor interface (compress / extract / estimate_ratio) and the lossless baselines.

`estimate_ratio` lets a planner price compression without running it; the engines charge
time for `Compressed.nbytes`, the bytes that really cross the wire.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from hetrain.errors import ConfigError


@dataclass(frozen=True)
class Compressed:
    """A compressed flat tensor: the payload tensors and what they cost on the wire."""

    payload: tuple[Tensor, ...]
    numel: int
    dtype: torch.dtype
    nbytes: int


class Compressor(ABC):
    """Compresses a flat update tensor; lossy compressors are wrapped in `ErrorFeedback`."""

    name: ClassVar[str]
    lossy: ClassVar[bool] = True
    error_feedback: ClassVar[bool] = True
    """Wrap in `ErrorFeedback`: right for biased, contractive compressors (top-k, fp16); wrong
    for unbiased ones whose error can exceed the input (QSGD), where the residual would grow."""

    @abstractmethod
    def compress(self, flat: Tensor) -> Compressed: ...

    @abstractmethod
    def extract(self, c: Compressed) -> Tensor: ...

    @abstractmethod
    def estimate_ratio(self, numel: int) -> float:
        """Compressed bytes / fp32 bytes for a tensor of `numel` elements."""


class NoCompression(Compressor):
    name = "none"
    lossy = False

    def compress(self, flat: Tensor) -> Compressed:
        return Compressed((flat,), flat.numel(), flat.dtype, flat.numel() * flat.element_size())

    def extract(self, c: Compressed) -> Tensor:
        return c.payload[0]

    def estimate_ratio(self, numel: int) -> float:
        return 1.0


class FP16(Compressor):
    """Half precision on the wire: 2x fewer bytes, rounding error ~1e-3 relative."""

    name = "fp16"

    def compress(self, flat: Tensor) -> Compressed:
        half = flat.to(torch.float16)
        return Compressed((half,), flat.numel(), flat.dtype, half.numel() * 2)

    def extract(self, c: Compressed) -> Tensor:
        return c.payload[0].to(c.dtype)

    def estimate_ratio(self, numel: int) -> float:
        return 0.5


class ErrorFeedback:
    """Keeps what compression dropped and adds it to the next update (EF-SGD), per worker."""

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self.residual: Tensor | None = None

    def compress(self, flat: Tensor) -> Compressed:
        if not (self.compressor.lossy and self.compressor.error_feedback):
            return self.compressor.compress(flat)
        corrected = flat if self.residual is None else flat + self.residual
        c = self.compressor.compress(corrected)
        self.residual = corrected - self.compressor.extract(c)
        return c

    def local_start(self, params: Tensor) -> Tensor:
        """The model a delta-mode worker (update = start - end) trains from with
        `train.local_residual`: the pulled model minus its own unsent residual, i.e. its own
        progress kept in its local model.

        Why: a worker restarted on the pulled model alone (plain EF-SGD) re-learns the progress
        its residual already holds, so the residual counts it twice and grows past the update
        (3-6x its norm with top-1% on the MNIST-1D CNN). Kept in the local model ("bifurcated
        local models", CSER, Xie et al. 2020) sent + residual = pulled - end exactly. The
        double counting also inflates what reaches the server, which helps where workers push
        only a few times a run, so neither is always better (benchmarks/results/ashl_*.md).
        Not for gradient updates, whose residual is in gradient units, not parameter units.
        """
        if self.residual is None or not (self.compressor.lossy and self.compressor.error_feedback):
            return params
        return params - self.residual.to(params.dtype)


COMPRESSORS: dict[str, type[Compressor]] = {"none": NoCompression, "fp16": FP16}


def register_compressor(cls: type[Compressor]) -> type[Compressor]:
    COMPRESSORS[cls.name] = cls
    return cls


def make_compressor(name: str, **options: Any) -> Compressor:
    if name not in COMPRESSORS:
        raise ConfigError(f"train.compression = {name!r} is not allowed; choose one of: "
                          f"{', '.join(COMPRESSORS)}")
    try:
        return COMPRESSORS[name](**options)
    except TypeError as e:
        raise ConfigError(f"compression '{name}': bad options {options}: {e}") from None
