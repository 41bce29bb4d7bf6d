"""The gradient-noise-scale estimator against a problem whose noise is known exactly, and the
worker-side probe against gradients computed directly."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from hetrain.config import OptimizerConfig
from hetrain.engine.core import Replica
from hetrain.plan.noise import (
    GradientNoiseScale,
    GradProbe,
    adascale_gain,
    statistical_efficiency,
)
from hetrain.strategies import WorkTask


def _least_squares(n: int = 4000, d: int = 10, noise: float = 1.0, seed: int = 0):
    """Per-sample gradients of 0.5 (x.w - y)^2 at a point w away from the optimum."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    w_star = rng.normal(size=d)
    y = x @ w_star + noise * rng.normal(size=n)
    w = w_star + 0.3 * rng.normal(size=d)
    grads = x * (x @ w - y)[:, None]                   # (n, d)
    true_g = grads.mean(axis=0)
    trace = float(((grads - true_g) ** 2).sum(axis=1).mean())
    return grads, trace / float(true_g @ true_g), rng


@pytest.mark.parametrize("batch", [2, 8, 32])
def test_estimate_within_10_percent_of_the_known_noise_scale(batch: int) -> None:
    grads, truth, rng = _least_squares()
    est = GradientNoiseScale(ema_weight=0.002)
    for _ in range(6000):
        idx = rng.integers(0, len(grads), size=batch)  # i.i.d. draws: the estimator's model
        halves = grads[idx[:batch // 2]].mean(0), grads[idx[batch // 2:]].mean(0)
        whole = grads[idx].mean(0)
        est.observe(GradProbe(0.5 * sum(float(h @ h) for h in halves), batch / 2,
                              float(whole @ whole), batch))
    assert truth > 1  # a problem where the noise matters
    assert est.noise_scale == pytest.approx(truth, rel=0.10)


def test_no_estimate_before_probes_or_from_degenerate_ones() -> None:
    est = GradientNoiseScale()
    assert est.noise_scale is None and est.grad_sqnorm is None
    est.observe(GradProbe(1.0, 1.0, 1.0, 1))        # a batch of one has no halves
    est.observe(GradProbe(float("nan"), 1.0, 1.0, 2))
    assert est.probes == 0


def test_efficiency_and_adascale_gain() -> None:
    assert statistical_efficiency(32, 100, 32) == 1.0
    assert statistical_efficiency(8, 24, 32) == 56 / 32          # small batches: more per sample
    assert statistical_efficiency(1e9, 24, 32) < 1e-6            # huge batches: almost nothing
    # the gain goes smoothly from 1 (no noise) to linear scaling (all noise)
    assert adascale_gain(128, 1e-9, 32) == pytest.approx(1.0)
    assert adascale_gain(128, 1e9, 32) == pytest.approx(4.0)
    gains = [adascale_gain(b, 64, 32) for b in (32, 64, 128, 256, 512)]
    assert gains == sorted(gains) and gains[0] == 1.0 and gains[-1] < 512 / 32


def test_probe_measures_the_halves_and_trains_on_the_whole_batch(digits_mlp) -> None:
    torch.manual_seed(0)
    opt = OptimizerConfig(name="sgd", lr=0.05, momentum=0.0)
    probed, plain = (Replica(digits_mlp, digits_mlp.build_model(), opt) for _ in range(2))
    plain.model.load_state_dict(probed.model.state_dict())
    idx = torch.arange(0, 24)
    task = WorkTask(batch_size=24, local_steps=1)
    a = probed.run(WorkTask(24, 1, probe_noise=True), "gradient", [idx])
    b = plain.run(task, "gradient", [idx])
    torch.testing.assert_close(a.update, b.update, rtol=1e-5, atol=1e-7)   # same gradient
    assert a.probe is not None and b.probe is None
    assert a.probe.big_batch == 24 and a.probe.small_batch == 12
    assert a.probe.big_sqnorm == pytest.approx(float((b.update ** 2).sum()), rel=1e-5)

    def grad_of(rows: torch.Tensor) -> torch.Tensor:
        fresh = Replica(digits_mlp, digits_mlp.build_model(), opt)
        fresh.model.load_state_dict(plain.model.state_dict())
        return fresh.run(WorkTask(len(rows), 1), "gradient", [rows]).update

    halves = [grad_of(idx[:12]), grad_of(idx[12:])]
    assert a.probe.small_sqnorm == pytest.approx(
        0.5 * sum(float((h ** 2).sum()) for h in halves), rel=1e-5)
    # delta mode: the optimizer steps on the same gradient
    c = probed.run(WorkTask(24, 2, probe_noise=True), "delta", [idx, idx + 24])
    d = plain.run(WorkTask(24, 2), "delta", [idx, idx + 24])
    torch.testing.assert_close(c.update, d.update, rtol=1e-4, atol=1e-6)


def test_reset_optimizer_clears_momentum(digits_mlp) -> None:
    opt = OptimizerConfig(name="sgd", lr=0.05, momentum=0.9)
    torch.manual_seed(0)
    rep = Replica(digits_mlp, digits_mlp.build_model(), opt)
    rep.run(WorkTask(8, 1), "delta", [torch.arange(8)])     # builds momentum

    def fresh_copy() -> Replica:
        other = Replica(digits_mlp, digits_mlp.build_model(), opt)
        other.model.load_state_dict(rep.model.state_dict())
        return other

    batch = [torch.arange(8, 16)]
    expected = fresh_copy().run(WorkTask(8, 1), "delta", batch).update
    carried = fresh_copy()
    carried.optimizer.load_state_dict(rep.optimizer.state_dict())
    with_momentum = carried.run(WorkTask(8, 1), "delta", batch).update
    reset = rep.run(WorkTask(8, 1, reset_optimizer=True), "delta", batch).update
    torch.testing.assert_close(reset, expected)
    assert not torch.allclose(with_momentum, expected)


def test_warm_up_leaves_the_replica_as_it_was(mnist1d_cnn_small) -> None:
    """The dist worker's untimed first step: parameters, buffers, gradients, optimizer state
    and the RNG stream are unchanged, so the training that follows is the same as without."""
    wl = mnist1d_cnn_small
    torch.manual_seed(0)
    opt = OptimizerConfig(name="sgd", lr=0.05, momentum=0.9)

    def model() -> torch.nn.Module:   # running statistics and a random mask to disturb
        return torch.nn.Sequential(wl.build_model(), torch.nn.BatchNorm1d(10),
                                   torch.nn.Dropout(0.5))

    warmed, plain = (Replica(wl, model(), opt) for _ in range(2))
    plain.model.load_state_dict(warmed.model.state_dict())
    batches = [torch.arange(0, 16), torch.arange(16, 32)]
    for rep in (warmed, plain):                         # momentum and buffers to keep
        torch.manual_seed(5)
        rep.run(WorkTask(16, 2), "delta", batches)
    state = {k: v.clone() for k, v in warmed.model.state_dict().items()}
    momentum = copy.deepcopy(warmed.optimizer.state_dict())
    torch.manual_seed(1)
    warmed.warm_up(32)
    rng_after = torch.get_rng_state()
    torch.manual_seed(1)
    assert torch.equal(rng_after, torch.get_rng_state())
    for k, v in warmed.model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(p.grad is None for p in warmed.model.parameters())
    after = warmed.optimizer.state_dict()["state"]
    assert after.keys() == momentum["state"].keys() and all(
        torch.equal(after[k]["momentum_buffer"], momentum["state"][k]["momentum_buffer"])
        for k in after)
    nxt = [torch.arange(32, 48)]
    torch.manual_seed(2)
    a = warmed.run(WorkTask(16, 1), "delta", nxt).update
    torch.manual_seed(2)
    b = plain.run(WorkTask(16, 1), "delta", nxt).update
    assert torch.equal(a, b)
