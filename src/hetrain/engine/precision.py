"""Mixed precision for a replica: autocast for the forward pass, loss scaling for fp16.

`train.precision`: "fp32" (off), "bf16" (autocast to bfloat16: fp32's range, so no scaling),
"fp16" (autocast to float16 with a dynamic loss scale, as torch.amp.GradScaler does: the loss
is multiplied by the scale before backward, gradients are divided by it after, a step whose
gradients are not finite is skipped and halves the scale, 2000 finite steps double it).
Parameters, optimizer state and everything on the wire stay fp32. The scaler is hetrain's
own because a task's update (a gradient sum or a replica's delta) leaves the worker, so the
skip must be decided on the gradients, not inside an optimizer step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """Forward passes (and the loss) under autocast to the precision's dtype; fp32: no-op."""
    if precision == "fp32":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=DTYPES[precision]):
        yield


class LossScaler:
    """Dynamic loss scale (fp16); with `enabled = False` every method is the identity."""

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_interval: int = 2000
                 ) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self._good = 0
        self.skipped = 0

    def scaled(self, loss: Tensor) -> Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale(self, params: Iterable[nn.Parameter]) -> bool:
        """Divide the gradients by the scale; False (and the scale halved) when any is not
        finite: the caller must then not use them."""
        if not self.enabled:
            return True
        finite = True
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    continue
                p.grad.div_(self.scale)
                finite = finite and bool(torch.isfinite(p.grad).all())
        self.update(finite)
        return finite

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if not finite:
            self.scale = max(self.scale / 2.0, 1.0)
            self._good = 0
            self.skipped += 1
            return
        self._good += 1
        if self._good >= self.growth_interval and math.isfinite(self.scale * 2.0):
            self.scale *= 2.0
            self._good = 0
