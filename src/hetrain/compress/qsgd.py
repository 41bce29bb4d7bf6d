"""QSGD-style stochastic quantisation (Alistarh et al. 2017), bit-packed on the wire.

The update is cut into buckets of `bucket_size` entries; a bucket v is sent as its norm
||v|| (fp32), one sign bit per entry and a level l_i in {0..s} per entry, where
r_i = s |v_i| / ||v|| is rounded up with probability r_i - floor(r_i) and down otherwise.
The receiver rebuilds v_i ~ sign_i * ||v|| * l_i / s. Unbiased: E[l_i] = r_i, so
E[Q(v)] = v; the per-entry variance is (||v|| / s)^2 p_i (1 - p_i) with p_i = frac(r_i)
(at most ||v||^2 / (4 s^2)). Levels take b = ceil(log2(s + 1)) bits, so a push costs
4 * n_buckets + ceil(n / 8) + ceil(n * b / 8) bytes: the payload tensors really are packed
bits, and `nbytes` is their size. s = 15, b = 4: 5 bits per entry, 6.4x fewer bytes than fp32.
QSGD is sent without error feedback (see `error_feedback`): its unbiasedness is what makes
the asynchronous average converge.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from hetrain.compress.base import Compressed, Compressor, register_compressor
from hetrain.errors import ConfigError


def pack_bits(values: Tensor, bits: int) -> Tensor:
    """Non-negative ints < 2^bits -> a uint8 tensor of exactly ceil(n * bits / 8) bytes."""
    shifts = torch.arange(bits, dtype=torch.int64)
    planes = ((values.to(torch.int64).unsqueeze(1) >> shifts) & 1).to(torch.uint8)
    return torch.from_numpy(np.packbits(planes.reshape(-1).numpy()))


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    flat = np.unpackbits(packed.numpy(), count=n * bits).reshape(n, bits).astype(np.int64)
    return torch.from_numpy((flat << np.arange(bits, dtype=np.int64)).sum(axis=1))


@register_compressor
class QSGD(Compressor):
    """Stochastic quantisation to `levels` (s) magnitude levels per bucket of `bucket_size`."""

    name = "qsgd"
    error_feedback = False
    """Unbiased already; its error ||Q(v) - v|| can exceed ||v|| for few levels, so a residual
    fed back would grow without bound (error feedback needs a contraction)."""

    def __init__(self, levels: int = 15, bucket_size: int = 512, seed: int = 0) -> None:
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 2**16 - 1:
            raise ConfigError(f"compression 'qsgd': levels must be an integer in [1, 65535], "
                              f"got {levels!r}")
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
            raise ConfigError(f"compression 'qsgd': bucket_size must be an integer >= 1, "
                              f"got {bucket_size!r}")
        self.levels = levels
        self.bucket_size = bucket_size
        self.bits = max(1, math.ceil(math.log2(levels + 1)))
        self.generator = torch.Generator().manual_seed(int(seed))

    def _buckets(self, numel: int) -> int:
        return max(1, math.ceil(numel / self.bucket_size))

    def compress(self, flat: Tensor) -> Compressed:
        flat = flat.reshape(-1)
        n, nb = flat.numel(), self._buckets(flat.numel())
        padded = torch.zeros(nb * self.bucket_size, dtype=torch.float32)
        padded[:n] = flat.to(torch.float32)
        buckets = padded.view(nb, self.bucket_size)
        norms = buckets.norm(dim=1)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        r = (buckets.abs() / safe.unsqueeze(1) * self.levels).clamp(max=self.levels)
        low = r.floor()
        up = torch.rand(r.shape, generator=self.generator) < (r - low)
        lv = (low + up.to(low.dtype)).reshape(-1)[:n]
        signs = (buckets.reshape(-1)[:n] < 0).to(torch.uint8)
        packed_signs = torch.from_numpy(np.packbits(signs.numpy()))
        packed_levels = pack_bits(lv, self.bits)
        nbytes = norms.numel() * 4 + packed_signs.numel() + packed_levels.numel()
        return Compressed((norms, packed_signs, packed_levels), n, flat.dtype, nbytes)

    def extract(self, c: Compressed) -> Tensor:
        norms, packed_signs, packed_levels = c.payload
        n = c.numel
        signs = torch.from_numpy(np.unpackbits(packed_signs.numpy(), count=n).astype(np.float32))
        lv = unpack_bits(packed_levels, self.bits, n).to(torch.float32)
        scale = norms.repeat_interleave(self.bucket_size)[:n] / self.levels
        return ((1 - 2 * signs) * lv * scale).to(c.dtype)

    def estimate_ratio(self, numel: int) -> float:
        nbytes = 4 * self._buckets(numel) + math.ceil(numel / 8) + math.ceil(numel * self.bits / 8)
        return nbytes / (4 * numel)
