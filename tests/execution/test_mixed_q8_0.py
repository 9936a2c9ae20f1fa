"""Q8_0 layers of a mixed model (:mod:`nvfp4lab.execution.mixed_q8_0`) against slow scalar
oracles: ``quantize_row_q8_0_ref`` (:mod:`nvfp4lab.oracles.ggml`) for the weights, the x86
``quantize_row_q8_0`` for the activations and ``ggml_vec_dot_q8_0_q8_0_generic``'s order
(written here on exact fractions, one rounding per float32 operation) for the dot."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from torch import nn

from nvfp4lab.execution.mixed import (
    apply_mix,
    effective_bits,
    layer_bits,
    quantizable_linears,
    quantize_layer,
)
from nvfp4lab.execution.mixed_q8_0 import Q8_0Linear, dot_q8_0, quantize_q8_0_weight
from nvfp4lab.oracles.ggml import quantize_q8_0, quantize_q8_0_ref, round_f32
from nvfp4lab.vocab import LayerFormat
from tests.tiny_decoders import tiny_model


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n).unsqueeze(1)
    w[0, :32] = 0.0  # an all-zero block: d = 0, id = 0
    w[1, :32] = torch.arange(-16, 16, dtype=torch.float32) + 0.5  # ties of roundf at d = 1
    w[1, 31] = 127.0
    return w


def _oracle_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [quantize_q8_0_ref(r) for r in w.tolist()]
    return (torch.tensor([c for c, _ in rows], dtype=torch.int8),
            torch.tensor([d for _, d in rows], dtype=torch.float16))


def test_weight_codes_and_scales_equal_quantize_row_q8_0_ref() -> None:
    w = _weights(9, 96, seed=1)
    codes, d = quantize_q8_0_weight(w)
    want_codes, want_d = _oracle_weight(w)
    assert torch.equal(codes, want_codes) and torch.equal(d, want_d)
    # roundf rounds half away from zero (round half to even would give 0 for 0.5, -2 for -1.5)
    assert codes[1, :4].tolist() == [-16, -15, -14, -13] and codes[1, 15:17].tolist() == [-1, 1]
    assert codes[0, :32].eq(0).all() and d[0, 0] == 0
    # bfloat16 weights are widened exactly
    wb = w.to(torch.bfloat16)
    assert torch.equal(quantize_q8_0_weight(wb)[0], _oracle_weight(wb.float())[0])


def _oracle_dot(wc: list[int], wd: list[float], xc: list[int], xd: list[float]) -> float:
    """``ggml_vec_dot_q8_0_q8_0_generic``: ``sumf += sumi * (d_w * d_x)``, each product and sum
    rounded once to float32."""
    sumf = 0.0
    for b in range(len(wd)):
        sumi = sum(wc[32 * b + j] * xc[32 * b + j] for j in range(32))
        scale = round_f32(Fraction(wd[b]) * Fraction(xd[b]))
        sumf = round_f32(Fraction(sumf) + Fraction(round_f32(sumi * Fraction(scale))))
    return sumf


def test_forward_equals_the_scalar_oracle() -> None:
    w = _weights(5, 128, seed=2)
    bias = torch.randn(5, generator=torch.Generator().manual_seed(3))
    linear = nn.Linear(128, 5)
    with torch.no_grad():
        linear.weight.copy_(w)
        linear.bias.copy_(bias)
    layer = Q8_0Linear.from_linear(linear)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(4)) * 3
    got = layer(x)
    assert got.shape == (2, 3, 5) and got.dtype == torch.float32
    wc, wd = layer.weight.tolist(), layer.weight_d.float().tolist()
    for i, row in enumerate(x.reshape(-1, 128).tolist()):
        xc, xd = quantize_q8_0(row)
        for j in range(5):
            want = round_f32(Fraction(_oracle_dot(wc[j], wd[j], xc, xd)) + Fraction(bias[j].item()))
            assert got.reshape(-1, 5)[i, j].item() == want, (i, j)


def test_dot_order_is_the_generic_one() -> None:
    """The same integer sums summed another way (float64, one rounding) differ somewhere: the
    oracle comparison above can fail."""
    g = torch.Generator().manual_seed(6)
    wc = torch.randint(-127, 128, (16, 512), generator=g, dtype=torch.int8)
    xc = torch.randint(-127, 128, (8, 512), generator=g, dtype=torch.int8)
    wd = (torch.rand(16, 16, generator=g) * 0.01).half()
    xd = (torch.rand(8, 16, generator=g) * 0.01).half()
    ours = dot_q8_0(wc, wd, xc, xd)
    w = wc.double().reshape(16, 16, 32) * wd.double().unsqueeze(-1)
    x = xc.double().reshape(8, 16, 32) * xd.double().unsqueeze(-1)
    exact = (x.reshape(8, -1) @ w.reshape(16, -1).T).float()
    assert not torch.equal(ours, exact)
    assert torch.allclose(ours, exact, rtol=1e-5, atol=1e-6)
    row = _oracle_dot(wc[3].tolist(), wd[3].float().tolist(), xc[5].tolist(),
                      xd[5].float().tolist())
    assert ours[5, 3].item() == row


def test_dequantized_weight_and_dtypes() -> None:
    linear = nn.Linear(64, 4, bias=False).to(torch.bfloat16)
    layer = Q8_0Linear.from_linear(linear)
    assert layer.weight.dtype == torch.int8 and layer.weight_d.dtype == torch.float16
    assert tuple(layer.weight_d.shape) == (4, 2)
    deq = layer.dequantized_weight()
    want = layer.weight.float().reshape(4, 2, 32) * layer.weight_d.float().unsqueeze(-1)
    assert torch.equal(deq, want.reshape(4, 64))
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16


def test_bad_inputs_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"K a multiple of 32, got torch.float32 \[4, 48\]"):
        quantize_q8_0_weight(torch.ones(4, 48))
    bad = torch.ones(2, 32)
    bad[0, 3] = float("nan")
    with pytest.raises(ValueError, match="must be finite"):
        quantize_q8_0_weight(bad)
    with pytest.raises(ValueError, match="exceeds float16"):
        quantize_q8_0_weight(torch.full((1, 32), 1e7))
    with pytest.raises(ValueError, match=r"float16 \[N, K/32\] = \[2, 1\] scales"):
        Q8_0Linear(torch.zeros(2, 32, dtype=torch.int8), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="int8"):
        Q8_0Linear(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 1).half())


def test_mix_wiring() -> None:
    assert layer_bits(LayerFormat.Q8_0, 64, 64) == 8.5
    assert isinstance(quantize_layer(nn.Linear(64, 8), LayerFormat.Q8_0), Q8_0Linear)
    model = tiny_model("llama", seed=4)
    names = list(quantizable_linears(model))
    mix = {names[0]: LayerFormat.Q8_0, names[1]: LayerFormat.NVFP4_RTN}
    expected = effective_bits(model, mix)
    original = model.get_submodule(names[0]).weight.detach().clone()
    report = apply_mix(model, mix)
    layer = model.get_submodule(names[0])
    assert isinstance(layer, Q8_0Linear) and report.bits == expected
    assert report.counts()[LayerFormat.Q8_0] == 1
    assert torch.equal(layer.weight, quantize_q8_0_weight(original)[0])
