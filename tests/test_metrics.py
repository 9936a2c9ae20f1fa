"""Error metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4lab import metrics

REF = torch.tensor([1.0, 2.0, 3.0, 4.0])
APPROX = torch.tensor([1.0, 2.0, 3.0, 5.0])  # one error of 1 at the last element


def test_hand_computed_values() -> None:
    assert metrics.mse(REF, APPROX) == 0.25  # 1 / 4
    assert metrics.nmse(REF, APPROX) == pytest.approx(1 / 30, rel=1e-15)  # 1 / (1+4+9+16)
    assert metrics.sqnr_db(REF, APPROX) == pytest.approx(10 * math.log10(30), rel=1e-15)
    assert metrics.sqnr_db(REF, APPROX) == pytest.approx(14.771212547196624)
    assert metrics.max_abs_error(REF, APPROX) == 1.0
    # (1 + 4 + 9 + 20) / (sqrt(30) * sqrt(39))
    assert metrics.cosine_similarity(REF, APPROX) == pytest.approx(34 / math.sqrt(1170), 1e-15)


def test_results_are_python_floats_computed_in_float64() -> None:
    ref = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)
    approx = torch.tensor([1.0078125, 3.0], dtype=torch.bfloat16)  # 1 + 2**-7
    value = metrics.mse(ref, approx)
    assert type(value) is float
    assert value == 2.0**-14 / 2  # (2**-7)**2 / 2, exact in float64
    big = torch.tensor([1e20, -1e20], dtype=torch.float32)
    assert metrics.nmse(big, big * 0.5) == pytest.approx(0.25)  # sum of squares > float32 max


def test_exact_approximation() -> None:
    assert metrics.mse(REF, REF) == 0.0
    assert metrics.nmse(REF, REF) == 0.0
    assert metrics.sqnr_db(REF, REF) == math.inf
    assert metrics.max_abs_error(REF, REF) == 0.0
    assert metrics.cosine_similarity(REF, REF) == pytest.approx(1.0, abs=1e-15)
    assert metrics.cosine_similarity(REF, -REF) == pytest.approx(-1.0, abs=1e-15)
    assert metrics.cosine_similarity(REF, 3 * REF) == pytest.approx(1.0, abs=1e-15)


def test_zero_reference() -> None:
    zeros = torch.zeros(4)
    assert metrics.nmse(zeros, zeros) == 0.0
    assert metrics.nmse(zeros, REF) == math.inf
    assert metrics.sqnr_db(zeros, REF) == -math.inf
    assert metrics.cosine_similarity(zeros, zeros) == 1.0
    assert metrics.cosine_similarity(zeros, REF) == 0.0


def test_shape_mismatch_and_empty_raise() -> None:
    with pytest.raises(ValueError, match=r"\(4,\).*\(2, 2\)"):
        metrics.mse(REF, APPROX.reshape(2, 2))
    with pytest.raises(ValueError, match="empty"):
        metrics.nmse(torch.zeros(0), torch.zeros(0))


def test_per_block_nmse_and_summary() -> None:
    ref = torch.ones(1, 64, dtype=torch.float64)
    deltas = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    approx = ref + deltas.repeat_interleave(16)
    per_block = metrics.per_block_nmse(ref, approx)
    assert per_block.shape == (1, 4)
    assert per_block.flatten().tolist() == pytest.approx([0.01, 0.04, 0.09, 0.16], rel=1e-12)
    summary = metrics.block_error_summary(ref, approx)
    assert summary["blocks"] == 4
    assert summary["mean_nmse"] == pytest.approx(0.075)
    assert summary["median_nmse"] == pytest.approx(0.065)  # linear between 0.04 and 0.09
    assert summary["p90_nmse"] == pytest.approx(0.09 + 0.7 * 0.07)
    assert summary["p99_nmse"] == pytest.approx(0.09 + 0.97 * 0.07)
    assert summary["max_nmse"] == pytest.approx(0.16)
    assert summary["worst_block"] == 3
    assert summary["exact_blocks"] == 0 and summary["zero_reference_blocks"] == 0


def test_per_block_nmse_zero_blocks() -> None:
    ref = torch.zeros(2, 16)
    ref[0] = 2.0
    approx = ref.clone()
    approx[0, 0] = 3.0  # block 0: 1 / (16 * 4)
    per_block = metrics.per_block_nmse(ref, approx)
    assert per_block[0, 0].item() == pytest.approx(1 / 64)
    assert per_block[1, 0].item() == 0.0  # zero reference, zero error
    approx[1, 5] = 1.0
    assert math.isinf(metrics.per_block_nmse(ref, approx)[1, 0].item())  # like nmse()
    summary = metrics.block_error_summary(ref, approx)
    assert summary["mean_nmse"] == pytest.approx(1 / 64)  # zero-reference blocks left out
    assert summary["zero_reference_blocks"] == 1 and summary["exact_blocks"] == 0
    assert summary["worst_block"] == 0
    with pytest.raises(ValueError, match="no block"):
        metrics.block_error_summary(torch.zeros(1, 16), torch.ones(1, 16))


def test_per_block_nmse_bad_block_size() -> None:
    with pytest.raises(ValueError, match="20"):
        metrics.per_block_nmse(torch.ones(2, 20), torch.ones(2, 20))


def test_nvfp4_normal_anchor() -> None:
    """Published anchor: NVFP4 RTN on N(0,1) has NMSE ~ 9.0e-3 (SQNR ~ 20.4 dB)."""
    from nvfp4lab.codec import fake_quantize

    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    value = metrics.nmse(x, fake_quantize(x))
    assert 8.5e-3 < value < 9.5e-3
    assert metrics.sqnr_db(x, fake_quantize(x)) == pytest.approx(-10 * math.log10(value))
