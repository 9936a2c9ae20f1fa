"""The block functions, in every arithmetic order, bit for bit against the slow reference."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab import reference
from nvfp4lab.blocks import block_scales_of, decode_codes, encode_blocks, quantize_blocks
from nvfp4lab.orders import ORDERS, ScaleForm
from nvfp4lab.vocab import Convention
from tests.sample_data import make

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _arithmetic_scale(x: torch.Tensor, convention: Convention) -> float:
    """The tensor scale in the order's form, as the reference computes it."""
    if ORDERS[convention].scale_form is ScaleForm.DECODE:
        return reference.modelopt_decode_scale(x)
    return reference.global_scale(x, convention.value)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["normal", "outliers", "zero_blocks"])
@pytest.mark.parametrize("convention", list(Convention))
def test_block_functions_match_the_reference(
    convention: Convention, kind: str, dtype: torch.dtype
) -> None:
    x = make(kind, (6, 64), dtype, seed=31)
    scale = _arithmetic_scale(x, convention)
    want_codes, want_scales = reference.quantize_blocks(x, scale, convention.value)
    blocks = x.reshape(6, 4, 16)
    t = torch.tensor([scale], dtype=torch.float32)

    scales = block_scales_of(blocks, t, convention)
    assert torch.equal(scales, want_scales)
    codes = encode_blocks(blocks, scales, t, convention)
    assert torch.equal(codes.reshape(6, 64), want_codes)
    values = decode_codes(codes, scales, t, convention)
    want = reference.dequantize_blocks(want_codes, want_scales, scale, convention.value)
    assert torch.equal(values.reshape(6, 64).view(torch.int32), want.view(torch.int32))

    both_codes, both_scales = quantize_blocks(blocks, t, ORDERS[convention])
    assert torch.equal(both_codes, codes)
    assert torch.equal(both_scales.float(), scales)


def test_a_wider_search_never_loses_to_its_first_target() -> None:
    """Scale search keeps, per block, the lowest squared error of the targets it tries."""
    x = make("student_t", (32, 64), torch.float32, seed=4).reshape(32, 4, 16)
    t = torch.tensor([reference.global_scale(x, "kernel")])

    def error(targets: tuple[float, ...]) -> torch.Tensor:
        codes, scales = quantize_blocks(x, t, "kernel", targets=targets)
        return (decode_codes(codes, scales.float(), t) - x).square().sum(-1)

    plain, searched = error((6.0,)), error((6.0, 4.0))
    assert bool((searched <= plain).all()) and bool((searched < plain).any())


def test_stochastic_rounding_needs_a_generator() -> None:
    blocks = torch.ones(1, 16)
    with pytest.raises(ValueError, match=r"stochastic rounding needs a torch\.Generator"):
        encode_blocks(blocks, torch.ones(1), torch.ones(1), rounding="stochastic")
