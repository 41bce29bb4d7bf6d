"""FLOPs of one training sample, which the simulator divides by a device's FLOP/s."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from hetrain.workloads.base import Workload

_CACHE: dict[tuple[Any, ...], float] = {}


def _sdpa(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kw: Any) -> int:
    return sdpa_flop_count(q, k, v)


def _sdpa_backward(g: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None,
                   **kw: Any) -> int:
    return sdpa_backward_flop_count(g, q, k, v)


def _extra_formulas() -> dict[Any, Any]:
    """torch counts the CUDA attention kernels but not the CPU flash kernel; add it."""
    aten, out = torch.ops.aten, {}
    for name, fn in (("_scaled_dot_product_flash_attention_for_cpu", _sdpa),
                     ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_backward)):
        if hasattr(aten, name):
            out[getattr(aten, name)] = fn
    return out


def flops_per_sample(workload: Workload, batch_size: int = 2) -> float:
    """Forward + backward FLOPs of one training sample, counted by FlopCounterMode on a small
    training batch (matmuls, convolutions and attention; elementwise ops are not counted).

    If nothing is counted (a model made only of uncounted ops) it falls back to the dense-layer
    rule of thumb 6 * parameters per token (2 forward + 4 backward), tokens = T for a language
    model, 1 otherwise. Cached per (name, model options, input shape, classes); the global RNG
    is left untouched.
    """
    key = (workload.name, repr(sorted(workload.model_options.items())), workload.input_shape,
           workload.num_classes)
    if key in _CACHE:
        return _CACHE[key]
    with torch.random.fork_rng(devices=[]):
        model = workload.build_model().train()
        n = min(batch_size, len(workload.train))  # type: ignore[arg-type]
        batch = workload.batch(torch.arange(n))
        with FlopCounterMode(display=False, custom_mapping=_extra_formulas()) as counter:
            workload.loss(model, batch).backward()
    flops = counter.get_total_flops() / n
    if flops <= 0:
        tokens = workload.input_shape[0] if workload.task == "language_model" else 1
        flops = 6.0 * num_params(model) * tokens
    _CACHE[key] = float(flops)
    return _CACHE[key]


def num_params(model: torch.nn.Module) -> int:
    """Number of parameters (a tied weight counts once: parameters() deduplicates)."""
    return sum(p.numel() for p in model.parameters())
