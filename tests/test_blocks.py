"""The block functions, in every arithmetic order, bit for bit against the slow reference."""

from __future__ import annotations

import dataclasses
import enum
import math

import pytest
import torch

from nvfp4lab import blocks as blocks_module
from nvfp4lab import codec
from nvfp4lab import scales as scales_module
from nvfp4lab.blocks import (
    block_scales_from_blocks,
    decode_codes,
    encode_blocks,
    fixed_scale_codec,
    multiply_factors,
    quantize_blocks,
)
from nvfp4lab.codec import fake_quantize
from nvfp4lab.oracles import numbers as ref_numbers
from nvfp4lab.oracles import nvfp4 as ref_nvfp4
from nvfp4lab.orders import ORDERS, ScaleForm
from nvfp4lab.vocab import OrderName
from tests.sample_data import make

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _arithmetic_scale(x: torch.Tensor, convention: OrderName) -> float:
    """The tensor scale in the order's form, as the reference computes it."""
    if ORDERS[convention].scale_form is ScaleForm.DECODE:
        return ref_nvfp4.modelopt_decode_scale(x)
    return ref_nvfp4.global_scale(x, convention.value)


def test_the_old_block_scale_names_are_the_same_functions() -> None:
    """Issue 33: ``blocks.block_scales_of`` (takes the blocks) and ``scales.block_scales``
    (takes their maxima) are renamed to say which is which; the old names stay one release as
    deprecated aliases, the same objects, and still give the reference's scales."""
    assert blocks_module.block_scales_of is blocks_module.block_scales_from_blocks
    assert codec.block_scales_of is blocks_module.block_scales_from_blocks
    assert scales_module.block_scales is scales_module.block_scales_from_amax
    assert {"block_scales_of", "block_scales_from_blocks"} <= set(blocks_module.__all__)
    assert {"block_scales", "block_scales_from_amax"} <= set(scales_module.__all__)
    x = make("outliers", (4, 32), torch.bfloat16, seed=3)
    scale = _arithmetic_scale(x, OrderName.VLLM_KERNEL)
    _, want = ref_nvfp4.quantize_blocks(x, scale, OrderName.VLLM_KERNEL.value)
    t = torch.tensor([scale], dtype=torch.float32)
    blocks = x.reshape(4, 2, 16)
    assert torch.equal(blocks_module.block_scales_of(blocks, t), want)
    assert torch.equal(scales_module.block_scales(blocks.abs().amax(-1), t), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["normal", "outliers", "zero_blocks"])
@pytest.mark.parametrize("convention", list(OrderName))
def test_block_functions_match_the_reference(
    convention: OrderName, kind: str, dtype: torch.dtype
) -> None:
    x = make(kind, (6, 64), dtype, seed=31)
    scale = _arithmetic_scale(x, convention)
    want_codes, want_scales = ref_nvfp4.quantize_blocks(x, scale, convention.value)
    blocks = x.reshape(6, 4, 16)
    t = torch.tensor([scale], dtype=torch.float32)

    scales = block_scales_from_blocks(blocks, t, convention)
    assert torch.equal(scales, want_scales)
    codes = encode_blocks(blocks, scales, t, convention)
    assert torch.equal(codes.reshape(6, 64), want_codes)
    values = decode_codes(codes, scales, t, convention)
    want = ref_nvfp4.dequantize_blocks(want_codes, want_scales, scale, convention.value)
    assert torch.equal(values.reshape(6, 64).view(torch.int32), want.view(torch.int32))

    both_codes, both_scales = quantize_blocks(blocks, t, ORDERS[convention])
    assert torch.equal(both_codes, codes)
    assert torch.equal(both_scales.float(), scales)


def test_a_wider_search_never_loses_to_its_first_target() -> None:
    """Scale search keeps, per block, the lowest squared error of the targets it tries."""
    x = make("student_t", (32, 64), torch.float32, seed=4).reshape(32, 4, 16)
    t = torch.tensor([ref_nvfp4.global_scale(x, "kernel")])

    def error(targets: tuple[float, ...]) -> torch.Tensor:
        codes, scales = quantize_blocks(x, t, "kernel", targets=targets)
        return (decode_codes(codes, scales.float(), t) - x).square().sum(-1)

    plain, searched = error((6.0,)), error((6.0, 4.0))
    assert bool((searched <= plain).all()) and bool((searched < plain).any())


def test_stochastic_rounding_needs_a_generator() -> None:
    blocks = torch.ones(1, 16)
    with pytest.raises(ValueError, match=r"stochastic rounding needs a torch\.Generator"):
        encode_blocks(blocks, torch.ones(1), torch.ones(1), rounding="stochastic")


# -- llama.cpp: the nearest of E2M1 * s, compared in the unscaled domain --------------------------


def _grid_neighbourhood() -> tuple[torch.Tensor, torch.Tensor]:
    """(scales [126], values [126, V]): for every positive E4M3 scale s, every E2M1 value and
    midpoint times s (exact) and 48 float32 neighbours on each side, both signs."""
    s = torch.arange(1, 0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    points = s[:, None] * torch.cat([grid, (grid[1:] + grid[:-1]) / 2])[None, :]
    near = [points]
    for direction in (0.0, math.inf):
        a = points
        for _ in range(48):
            a = torch.nextafter(a, torch.full_like(a, direction))
            near.append(a)
    x = torch.stack(near, -1).reshape(s.numel(), -1)
    return s, torch.cat([x, -x], 1)


def test_llama_cpp_codes_match_the_reference_scan() -> None:
    """encode_blocks in the llama.cpp order = the reference's transcription of ggml's
    best_index_mxfp4 loop, on values at and around every code and midpoint of every scale."""
    s, x = _grid_neighbourhood()
    rows = list(range(0, s.numel(), 5))
    got = encode_blocks(x[:, None, :], s[:, None], torch.ones(1), "llama.cpp")[:, 0]
    for r in rows:
        d = ref_nvfp4.ggml_ue4m3_to_fp32(ref_numbers.e4m3_byte(float(s[r])))
        for c, v in enumerate(x[r].tolist()):
            errs = [
                abs(ref_numbers.round_f32(ref_numbers.round_f32(k * d) - v))
                for k in ref_nvfp4.GGML_KVALUES
            ]
            want = min(range(16), key=lambda i: (errs[i], i))  # first minimum
            assert int(got[r, c]) == want, (float(s[r]), v)


def test_llama_cpp_unscaled_comparison_equals_exact_division_in_range() -> None:
    """Whether comparing |E2M1 * s - x| (ggml) can differ from rounding x / s: within |x| <= 6 s
    it cannot when x / s is a correctly rounded float32 division (ties to the smaller magnitude),
    checked on every scale's codes and midpoints +- 48 ulps; it does differ from a multiply by the
    float32 reciprocal 1/s, and beyond 6 s, where float32 errors of several codes round equal."""
    s, x = _grid_neighbourhood()
    ggml = encode_blocks(x[:, None, :], s[:, None], torch.ones(1), "llama.cpp")[:, 0]

    def toward_smaller(q: torch.Tensor) -> torch.Tensor:  # nearest, ties to the smaller index
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
        index = (q.double().abs().clamp(max=6)[..., None] - grid).abs().argmin(-1)
        return (index | ((q < 0) & (index > 0)) * 8).to(torch.uint8)

    assert torch.equal(ggml, toward_smaller(x / s[:, None]))
    assert not torch.equal(ggml, toward_smaller(x * torch.reciprocal(s)[:, None]))
    huge = torch.tensor([[[3e3, 1e10, 2e10, 1e11, -1e11]]])
    codes = encode_blocks(huge, torch.tensor([[448.0]]), torch.ones(1), "llama.cpp")
    assert codes.flatten().tolist() == [7, 7, 5, 0, 0]  # saturation, then smaller codes
    assert toward_smaller(huge / 448.0).flatten().tolist() == [7, 7, 7, 7, 15]


class _NewDecodeRule(enum.Enum):
    """A decode rule no function here implements (as a new member of DecodeRule would be)."""

    SOMETHING_ELSE = enum.auto()


def test_an_unknown_decode_rule_is_refused_not_decoded_as_another() -> None:
    """Issue 32, case 15 (found there): the eager block functions decoded every rule but
    ``SCALE_TIMES_DECODE`` as ``value * (s / gs)``; a new rule is refused by name."""
    order = dataclasses.replace(ORDERS[OrderName.VLLM_KERNEL], decode=_NewDecodeRule.SOMETHING_ELSE)
    scales, scale = torch.full((2,), 1.5), torch.tensor(2.0)
    codes = torch.zeros((2, 16), dtype=torch.uint8)
    for call in (lambda: decode_codes(codes, scales, scale, order),
                 lambda: fixed_scale_codec(scales, scale, order),
                 lambda: multiply_factors(scales, scale, order)):
        with pytest.raises(NotImplementedError, match=r"decode rule .*SOMETHING_ELSE"):
            call()
    # the pipeline's options refuse an order whose step is no member of the step's enum
    for fused in (False, True):
        with pytest.raises(ValueError, match=r"kernel order's decode step is .*SOMETHING_ELSE.*"
                           r"not a member of DecodeRule \(SCALE_OVER_ENCODE, SCALE_TIMES_DECODE\)"):
            fake_quantize(torch.randn(4, 32), convention=order, fused=fused)
