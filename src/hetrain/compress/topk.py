"""Top-k sparsification: send the k largest-magnitude entries and their positions.

On the wire a push is k values (in the update's dtype) plus k int32 indices, so
nbytes = k * (element_size + 4); with fp32 values that is 8k bytes against 4n for the dense
update, a ratio of 2k/n (top-1% moves 50x fewer bytes). What is dropped is not lost: the
engines wrap every lossy compressor in `ErrorFeedback`, which adds the residual to the next
update, so every coordinate is eventually sent (EF-SGD, Karimireddy et al. 2019). With local
steps (delta updates), `train.local_residual` makes the worker train from
`ErrorFeedback.local_start(pulled)` instead (see there).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hetrain.compress.base import Compressed, Compressor, register_compressor
from hetrain.errors import ConfigError

INDEX_BYTES = 4
"""Indices travel as int32 (models up to 2^31 parameters)."""


@register_compressor
class TopK(Compressor):
    """Keep the k = floor(ratio * n) entries with the largest |value| (at least one), so the
    density never exceeds `ratio`."""

    name = "topk"

    def __init__(self, ratio: float = 0.01) -> None:
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
            raise ConfigError(f"compression 'topk': ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)

    def k_of(self, numel: int) -> int:
        return max(1, min(numel, math.floor(self.ratio * numel + 1e-9)))

    def compress(self, flat: Tensor) -> Compressed:
        flat = flat.reshape(-1)
        k = self.k_of(flat.numel())
        idx = torch.topk(flat.abs(), k, sorted=False).indices
        values = flat[idx]
        return Compressed((values, idx.to(torch.int32)), flat.numel(), flat.dtype,
                          k * (values.element_size() + INDEX_BYTES))

    def extract(self, c: Compressed) -> Tensor:
        values, idx = c.payload
        out = torch.zeros(c.numel, dtype=c.dtype)
        out[idx.long()] = values.to(c.dtype)
        return out

    def estimate_ratio(self, numel: int) -> float:
        return self.k_of(numel) * (4 + INDEX_BYTES) / (4 * numel)
