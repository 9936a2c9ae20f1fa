"""nvfp4lab.constants against the format definitions and torch's own float8 type.

Oracles: an exhaustive decode of the 16 E2M1 codes from the bit layout (1 sign, 2 exponent bits
with bias 1, 1 mantissa bit, no infinities or NaN), and an exhaustive view of the 256 E4M3 bytes
as ``torch.float8_e4m3fn``.
"""

from __future__ import annotations

import torch

from nvfp4lab import constants as C
from nvfp4lab.layout import swizzle_scales


def _e2m1_from_bits(code: int) -> float:
    """Value of a 4-bit E2M1 code: s ee m, bias 1, exponent 0 subnormal."""
    sign = -1.0 if code >> 3 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    magnitude = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1.0 + man / 2.0)
    return sign * magnitude


def _all_e4m3() -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def test_e2m1_grid_is_the_exhaustive_decode_of_16_codes() -> None:
    for code in range(16):
        index = code & ~C.E2M1_SIGN_BIT
        signed = -C.E2M1_VALUES[index] if code & C.E2M1_SIGN_BIT else C.E2M1_VALUES[index]
        want = _e2m1_from_bits(code)
        assert signed == want and (code == 8) == (str(want) == "-0.0"), code
    positives = sorted({abs(_e2m1_from_bits(c)) for c in range(16)})
    assert list(C.E2M1_VALUES) == positives  # strictly increasing, 8 magnitudes
    assert C.E2M1_MAX == max(positives) == 6.0
    assert C.E2M1_SIGN_BIT == 0b1000


def test_e4m3_range_matches_torch_float8() -> None:
    finfo = torch.finfo(torch.float8_e4m3fn)
    assert C.E4M3_MAX == float(finfo.max) == 448.0
    assert C.E4M3_MIN_NORMAL == float(finfo.smallest_normal) == 2.0**-6
    values = _all_e4m3()
    finite = values[torch.isfinite(values)]
    assert float(finite.max()) == C.E4M3_MAX
    assert float(finite[finite > 0].min()) == C.E4M3_MIN_SUBNORMAL == 2.0**-9
    # E4M3_MIN_NORMAL is the smallest positive value with a nonzero exponent field (byte 0x08)
    assert float(values[0x08]) == C.E4M3_MIN_NORMAL and float(values[0x07]) < C.E4M3_MIN_NORMAL


def test_global_scale_numerator_is_2688() -> None:
    assert C.GLOBAL_SCALE_NUMERATOR == 2688.0 == 448 * 6
    assert C.GLOBAL_SCALE_NUMERATOR == C.E4M3_MAX * C.E2M1_MAX
    # an amax of 2688 gives global scale 1: the largest block then gets the largest E4M3 scale
    assert float(torch.finfo(torch.float8_e4m3fn).max) == C.GLOBAL_SCALE_NUMERATOR / C.E2M1_MAX


def test_ct_zero_scale_replacement_is_an_exact_e4m3_value() -> None:
    eps = torch.tensor([C.CT_ZERO_SCALE_REPLACEMENT]).to(torch.float8_e4m3fn)
    assert float(eps.float()) == C.CT_ZERO_SCALE_REPLACEMENT == 2.0**-3
    assert int(eps.view(torch.uint8)) == 0x20  # biased exponent 4, mantissa 0
    assert C.BLOCK_SIZE == 16


def test_swizzle_tile_is_128_by_4() -> None:
    # one scale padded to the layout's tile: SWIZZLE_ROWS x SWIZZLE_COLS, 512 bytes of E4M3
    one = torch.ones(1, 1).to(torch.float8_e4m3fn)
    tile = swizzle_scales(one)
    assert tuple(tile.shape) == (C.SWIZZLE_ROWS, C.SWIZZLE_COLS) == (128, 4)
    assert tile.nbytes == 512
    assert int((tile.float() != 0).sum()) == 1
    # rows and columns beyond one tile start a second tile
    assert tuple(swizzle_scales(torch.ones(C.SWIZZLE_ROWS + 1, C.SWIZZLE_COLS + 1)).shape) == (
        2 * C.SWIZZLE_ROWS, 2 * C.SWIZZLE_COLS)
