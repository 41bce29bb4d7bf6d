"""DTensor sharding rules for CPU scaled-dot-product attention.

torch registers DTensor strategies for the CUDA flash/efficient SDPA kernels but not for
`aten._scaled_dot_product_flash_attention_for_cpu`, which F.scaled_dot_product_attention picks
on CPU; the math fallback builds a plain-tensor causal mask that DTensor refuses. Attention is
independent per (batch, head), so the kernel may run locally on inputs split on the batch dim
(data parallel) or the head dim (tensor parallel, Megatron-style), or replicated. We register
exactly those three with torch's public experimental `register_sharding`.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

aten = torch.ops.aten
_registered = False


def register_cpu_sdpa_sharding() -> None:
    """Idempotent; call before running attention on DTensors on CPU."""
    global _registered
    if _registered or not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def _fwd(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        out = []
        for p in (Replicate(), Shard(0), Shard(1)):
            out.append(([p, p], [p, p, p, None, None]))
        return out

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _bwd(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
             attn_mask=None, scale=None):
        res = []
        for p in (Replicate(), Shard(0), Shard(1)):
            res.append(([p, p, p], [p, p, p, p, p, p, None, None]))
        return res

    _registered = True
