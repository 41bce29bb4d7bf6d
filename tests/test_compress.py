"""Compressors: round trips keep shapes and dtypes, bytes are honest, QSGD is unbiased, error
feedback loses nothing and keeps its residual bounded."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.compress import COMPRESSORS, QSGD, ErrorFeedback, TopK, make_compressor
from hetrain.compress.qsgd import pack_bits, unpack_bits
from hetrain.compress.topk import MAX_GAP, decode_positions, encode_positions
from hetrain.errors import ConfigError


@pytest.mark.parametrize("name", ["none", "fp16", "topk", "qsgd"])
@pytest.mark.parametrize("numel", [1, 7, 1000, 4097])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_round_trip_keeps_shape_and_dtype(name, numel, dtype):
    c = make_compressor(name)
    x = torch.randn(numel, dtype=dtype, generator=torch.Generator().manual_seed(numel))
    packed = c.compress(x)
    y = c.extract(packed)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert packed.numel == numel
    if dtype == torch.float32:  # estimate_ratio prices fp32 updates
        assert packed.nbytes == pytest.approx(c.estimate_ratio(numel) * 4 * numel, abs=1)
    if name in ("none", "fp16"):
        torch.testing.assert_close(y, x, rtol=1e-3, atol=1e-3)


def test_registry_has_all_compressors():
    assert {"none", "fp16", "topk", "qsgd"} <= set(COMPRESSORS)


def test_topk_keeps_the_largest_and_charges_values_plus_16_bit_gaps():
    x = torch.tensor([0.1, -5.0, 0.3, 4.0, -0.2, 0.0, 1.0, -2.0, 0.05, 3.0])
    c = TopK(ratio=0.3)
    p = c.compress(x)
    y = c.extract(p)
    assert p.nbytes == 3 * (4 + 2)
    assert p.payload[1].dtype == torch.int16
    torch.testing.assert_close(y, torch.tensor([0, -5.0, 0, 4.0, 0, 0, 0, 0, 0, 3.0]))
    n = 13706  # the MNIST-1D CNN: 1% top-k is 66x fewer bytes than fp32 (50x with int32)
    assert 4 * n / (TopK(0.01).estimate_ratio(n) * 4 * n) >= 66


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 400_000), data=st.data())
def test_gap_coding_round_trips_any_positions(n, data):
    """Positions far apart (gaps over 65,535) are bridged by zero-valued fillers: the decoded
    tensor is exactly the kept entries, and the bytes count every filler."""
    k = data.draw(st.integers(1, min(n, 50)))
    positions = data.draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k, unique=True))
    idx = torch.tensor(positions)
    values = torch.arange(1, k + 1, dtype=torch.float32) * torch.where(idx % 2 == 0, 1.0, -1.0)
    sent, gaps = encode_positions(idx, values)
    out = torch.zeros(n)
    out[decode_positions(gaps)] = sent
    want = torch.zeros(n)
    want[idx] = values
    assert torch.equal(out, want)
    span = max(positions) + 1
    assert k <= sent.numel() <= k + span // MAX_GAP
    x = want.clone()
    packed = TopK(k / n).compress(x)
    assert torch.equal(TopK(k / n).extract(packed), want)
    assert packed.nbytes == packed.payload[0].numel() * (4 + 2)
    assert packed.nbytes <= TopK(k / n).estimate_ratio(n) * 4 * n + 1e-6


def test_bit_packing_round_trip_and_size():
    v = torch.randint(0, 16, (1001,))
    packed = pack_bits(v, 4)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(1001 * 4 / 8)
    torch.testing.assert_close(unpack_bits(packed, 4, 1001), v)


def test_qsgd_bytes_are_the_packed_bits():
    c = QSGD(levels=15, bucket_size=512)
    n = 10_000
    p = c.compress(torch.randn(n))
    n_buckets = math.ceil(n / 512)
    assert p.nbytes == 4 * n_buckets + math.ceil(n / 8) + math.ceil(n * 4 / 8)
    assert p.nbytes == sum(t.numel() * t.element_size() for t in p.payload)


def test_qsgd_is_unbiased_with_the_predicted_variance():
    """Mean of N quantisations vs the truth, in units of the predicted standard error.

    Per entry, Q(v)_i = sign * ||v|| / s * l_i with l_i = floor(r_i) + Bernoulli(frac(r_i)),
    r_i = s |v_i| / ||v||, so Var = (||v|| / s)^2 p (1 - p). With N draws the mean's error
    is N(0, Var / N); |z| < 5 for all 64 entries fails with probability ~4e-5 if unbiased.
    """
    torch.manual_seed(0)
    v = torch.randn(64)
    s, n_draws = 3, 4000
    c = QSGD(levels=s, bucket_size=64, seed=123)
    draws = torch.stack([c.extract(c.compress(v)) for _ in range(n_draws)])
    r = s * v.abs() / v.norm()
    p = r - r.floor()
    var = (v.norm() / s) ** 2 * p * (1 - p)
    mean = draws.mean(0)
    random = var > 1e-12
    z = (mean[random] - v[random]) / (var[random] / n_draws).sqrt()
    assert z.abs().max() < 5
    torch.testing.assert_close(mean[~random], v[~random])
    # the spread is the predicted one (chi-square: within 15% for N = 4000)
    ratio = draws.var(0)[random] / var[random]
    assert 0.85 < ratio.mean() < 1.15


def test_qsgd_rejects_bad_options():
    with pytest.raises(ConfigError, match="levels"):
        make_compressor("qsgd", levels=0)
    with pytest.raises(ConfigError, match="ratio"):
        make_compressor("topk", ratio=0.0)
    with pytest.raises(ConfigError, match="bad options"):
        make_compressor("topk", k=3)


def test_qsgd_is_sent_without_error_feedback():
    ef = ErrorFeedback(QSGD(levels=3))
    ef.compress(torch.randn(100))
    assert ef.residual is None


@pytest.mark.parametrize("compressor", [TopK(0.01), TopK(0.1), make_compressor("fp16")])
def test_error_feedback_loses_nothing_and_its_residual_stays_bounded(compressor):
    """EF sends C(g_t + e_t) and keeps e_{t+1} = g_t + e_t - C(g_t + e_t), so
    sum(sent) = sum(g) - e_T exactly. For top-k, ||x - C(x)||^2 <= (1 - k/n) ||x||^2, hence
    ||e_{t+1}|| <= q (||g_t|| + ||e_t||) with q = sqrt(1 - k/n): ||e|| <= q / (1 - q) max||g||."""
    gen = torch.Generator().manual_seed(1)
    n, steps = 1000, 600
    ef = ErrorFeedback(compressor)
    total_in, total_sent = torch.zeros(n), torch.zeros(n)
    norms = []
    for _ in range(steps):
        g = torch.randn(n, generator=gen)
        total_in += g
        total_sent += compressor.extract(ef.compress(g))
        norms.append(float(ef.residual.norm()))
    torch.testing.assert_close(total_sent + ef.residual, total_in, rtol=0, atol=1e-3)
    g_max = math.sqrt(n) * 1.2
    if isinstance(compressor, TopK):
        q = math.sqrt(1 - compressor.k_of(n) / n)
        assert max(norms) <= q / (1 - q) * g_max
    # bounded in practice: no growth over the second half, far below the input's sum
    first, second = norms[200:400], norms[400:]
    assert sum(second) / len(second) < 1.15 * sum(first) / len(first)
    assert max(norms) < 0.5 * float(total_in.norm())
    assert max(norms) > 0  # lossy: there is a residual to keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_local_start_keeps_the_unsent_progress_in_the_local_model(dtype):
    """A delta-mode worker that starts from `local_start(pulled)` sends, over its pushes,
    exactly its displacement from each pulled model: sent + residual = pulled - end, so its
    unsent progress is neither lost nor re-learned and counted twice."""
    gen = torch.Generator().manual_seed(2)
    n = 500
    ef = ErrorFeedback(TopK(0.01))
    pulled = torch.randn(n, dtype=dtype, generator=gen)
    assert ef.local_start(pulled) is pulled  # no residual yet
    for _ in range(50):
        pulled = pulled + 0.1 * torch.randn(n, dtype=dtype, generator=gen)  # others' commits
        start = ef.local_start(pulled)
        assert start.shape == pulled.shape and start.dtype == dtype
        end = start - 0.05 * torch.randn(n, dtype=dtype, generator=gen)  # local training
        sent = ef.compressor.extract(ef.compress(start - end))
        torch.testing.assert_close(sent + ef.residual, pulled - end)
        assert int((sent != 0).sum()) <= ef.compressor.k_of(n)


def test_local_start_is_the_pulled_model_without_a_residual():
    x = torch.randn(10)
    for compressor in (make_compressor("none"), QSGD(levels=3)):
        ef = ErrorFeedback(compressor)
        ef.compress(torch.randn(10))
        assert ef.local_start(x) is x
