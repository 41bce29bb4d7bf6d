"""Online gradient noise scale: how large a batch the current training phase can use.

McCandlish et al. (2018), "An Empirical Model of Large-Batch Training": with per-sample gradient
covariance Sigma and true gradient G, the "simple" noise scale B_simple = tr(Sigma) / |G|^2 is
the batch at which one step makes about half the progress of a step on the full data. Neither
term is observable, but a gradient g_b estimated from a batch of b samples has
E|g_b|^2 = |G|^2 + tr(Sigma) / b, so two batch sizes b < B give unbiased estimates (their App. A):

    |G|^2    ~ (B |g_B|^2 - b |g_b|^2) / (B - b)
    tr(Sigma) ~ (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

Each estimate is very noisy, and the ratio of two noisy quantities is biased, so (like AdaptDL's
`GradientNoiseScale`) the two terms are smoothed separately by exponential moving averages with
bias correction, and their ratio is taken only when asked.

What feeds it. A worker that is asked to probe (`WorkTask.probe_noise`) splits the first batch of
its task into two halves and back-propagates them one at a time: it gets |g_half|^2 of both
halves and |g_full|^2 of their weighted sum, which IS the batch's gradient, so training is
unchanged (up to float summation order, and BatchNorm statistics taken per half). The push
carries a `GradProbe`; the planner never sees a tensor. This works the same on every engine, for
gradient and delta updates, for synchronous and asynchronous strategies (every probe is taken
at one model version, the one the worker pulled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hetrain.plan.ema import EMA, check_weight


@dataclass(frozen=True)
class GradProbe:
    """Squared gradient norms of one batch and of its two halves, at one model version."""

    small_sqnorm: float
    """Mean |g_b|^2 of the two halves."""
    small_batch: float
    """b: samples per half (the mean of the two halves' sizes)."""
    big_sqnorm: float
    """|g_B|^2 of the whole batch (the halves' sample-weighted mean gradient)."""
    big_batch: float
    """B: samples in the whole batch (hetrain.ddp: a harmonic mean over the steps it
    averages, an integer unless the global batch changed within them)."""

    def estimates(self) -> tuple[float, float]:
        """The unbiased (|G|^2, tr(Sigma)) of this probe alone (either may be negative)."""
        b, big = self.small_batch, float(self.big_batch)
        grad_sq = (big * self.big_sqnorm - b * self.small_sqnorm) / (big - b)
        trace = (self.small_sqnorm - self.big_sqnorm) / (1.0 / b - 1.0 / big)
        return grad_sq, trace


class GradientNoiseScale:
    """Bias-corrected moving averages of |G|^2 and tr(Sigma) from a stream of probes."""

    def __init__(self, ema_weight: float = 0.05) -> None:
        self.ema_weight = check_weight(ema_weight, "noise-scale ema_weight")
        self._grad_sq = EMA(ema_weight, bias_corrected=True)
        self._trace = EMA(ema_weight, bias_corrected=True)
        self.probes = 0

    @staticmethod
    def _upgrade_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint written before the averages were `EMA`s holds their raw floats and
        one shared `_decay` (hetrain.engine.codec calls this when it reads one back)."""
        if "_decay" in attrs:
            decay = attrs.pop("_decay")
            for name in ("_grad_sq", "_trace"):
                ema = EMA(attrs["ema_weight"], bias_corrected=True)
                ema.mean, ema.decay, ema.count = attrs[name], decay, attrs["probes"]
                attrs[name] = ema
        return attrs

    def observe(self, probe: GradProbe, weight: float | None = None) -> None:
        """Fold one probe into the averages with `weight` (default: ema_weight); a probe that
        averages k steps may weigh 1 - (1 - w)^k, as k probes of weight w would together."""
        if probe.big_batch < 2 or not 0 < probe.small_batch < probe.big_batch:
            return
        grad_sq, trace = probe.estimates()
        if not (math.isfinite(grad_sq) and math.isfinite(trace)):
            return
        w = check_weight(self.ema_weight if weight is None else weight,
                         "noise-scale probe weight")
        self._grad_sq.update(grad_sq, w)
        self._trace.update(trace, w)
        self.probes += 1

    @property
    def grad_sqnorm(self) -> float | None:
        """Smoothed |G|^2 (None before the first probe)."""
        return self._grad_sq.value if self.probes else None

    @property
    def trace_cov(self) -> float | None:
        """Smoothed tr(Sigma), the per-sample gradient variance (None before the first probe)."""
        return self._trace.value if self.probes else None

    @property
    def noise_scale(self) -> float | None:
        """B_simple = tr(Sigma) / |G|^2 in samples; None until both averages are positive
        (early, or when the gradient is pure noise, where any batch is as good as another)."""
        g, t = self.grad_sqnorm, self.trace_cov
        if g is None or t is None or g <= 0 or t <= 0:
            return None
        return t / g


def statistical_efficiency(batch: float, noise_scale: float, base_batch: float) -> float:
    """Progress per sample at `batch` relative to `base_batch` (Pollux's E, McCandlish's model).

    A step at batch B makes progress proportional to B / (B_noise + B) of a noise-free step, so
    per sample (B_noise + B0) / (B_noise + B) relative to B0: above 1 for smaller batches, and
    B_noise / (B_noise + B) of linear scaling for large ones."""
    return (noise_scale + base_batch) / (noise_scale + batch)


def adascale_gain(batch: float, noise_scale: float, base_batch: float) -> float:
    """AdaScale's learning-rate gain r for a batch `batch` / `base_batch` times the base
    (Johnson et al. 2020): r = (sigma^2 + |G|^2) / (sigma^2 / s + |G|^2) with s the scale and
    sigma^2 the base batch's gradient variance. In noise-scale terms r = s * E(batch): from 1 (no
    noise: a bigger batch is no better) to s (all noise: linear scaling), never a cliff."""
    return batch / base_batch * statistical_efficiency(batch, noise_scale, base_batch)
