"""Exhaustive and dense checks of the E2M1 codec against the slow reference.

Every bfloat16 and float16 bit pattern, >= 2**22 float32 bit patterns (uniform random bits, a
random sweep of the interesting magnitude range, and every tie point +- a few hundred ulps), by
the element codec and again through ``quantize`` (eager pipeline and fused kernels).
"""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4lab import decode_e2m1, encode_e2m1, pack_fp4, quantize, unpack_fp4
from nvfp4lab.oracles import numbers as ref_numbers

TIE_POINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _all_patterns(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_pattern_matches_reference(dtype: torch.dtype) -> None:
    values = _all_patterns(dtype)
    finite_or_inf = values[~torch.isnan(values)]
    assert finite_or_inf.numel() == 2**16 - (254 if dtype == torch.bfloat16 else 2046)
    assert torch.isinf(finite_or_inf).sum() == 2
    got = encode_e2m1(finite_or_inf)
    assert got.dtype == torch.uint8 and got.shape == finite_or_inf.shape
    expected = ref_numbers.round_e2m1_tensor(finite_or_inf)
    mismatch = (got != expected).nonzero().flatten()
    assert mismatch.numel() == 0, [
        (float(finite_or_inf[i]), int(got[i]), int(expected[i])) for i in mismatch[:10]
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_nan_pattern_raises(dtype: torch.dtype) -> None:
    values = _all_patterns(dtype)
    nans = values[torch.isnan(values)]
    for i in range(nans.numel()):
        with pytest.raises(ValueError, match="NaN"):
            encode_e2m1(nans[i : i + 1])
    with pytest.raises(ValueError, match=f"{nans.numel()} NaN"):
        encode_e2m1(values)


def _fp32_sample() -> torch.Tensor:
    """2**21 uniform random bit patterns + 2**21 patterns with |x| in [2**-4, 2**4) + every tie
    and grid point (and +-6) +- 300 ulps, both signs."""
    g = torch.Generator().manual_seed(1234)
    uniform = torch.randint(-(2**31), 2**31, (2**21,), generator=g, dtype=torch.int64)
    # exponent field 123..130 -> magnitudes in [2**-4, 2**4): where all the rounding happens
    mant = torch.randint(0, 2**23, (2**21,), generator=g, dtype=torch.int64)
    expo = torch.randint(123, 131, (2**21,), generator=g, dtype=torch.int64)
    sign = torch.randint(0, 2, (2**21,), generator=g, dtype=torch.int64) << 31
    focused = sign | (expo << 23) | mant
    bits = torch.cat([uniform, focused]).to(torch.int64)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    random_values = bits.view(torch.float32)
    anchors = torch.tensor([*TIE_POINTS, *ref_numbers.E2M1_GRID, 6.0], dtype=torch.float32)
    anchor_bits = anchors.view(torch.int32).to(torch.int64)
    offsets = torch.arange(-300, 301, dtype=torch.int64)
    around = (anchor_bits[:, None] + offsets[None, :]).clamp(min=0).to(torch.int32)
    sweep = around.view(torch.float32).flatten()
    values = torch.cat([random_values, sweep, -sweep])
    return values[~torch.isnan(values)]


def test_fp32_sample_matches_reference() -> None:
    values = _fp32_sample()
    assert values.numel() >= 2**22
    got = encode_e2m1(values)
    expected = ref_numbers.round_e2m1_tensor(values)
    mismatch = (got != expected).nonzero().flatten()
    assert mismatch.numel() == 0, [
        (float(values[i]), int(got[i]), int(expected[i])) for i in mismatch[:10]
    ]


def _codes_through_quantize(values: torch.Tensor, convention: str) -> torch.Tensor:
    """E2M1 codes that ``quantize`` gives ``values`` (|v| <= 6): rows of a 6 and 15 values with
    global scale 1, so every block scale is exactly 1 and ``x·gs/s == x`` in both orders."""
    n = values.numel()
    rows = torch.cat([values, values.new_zeros(-n % 15)]).reshape(-1, 15)
    x = torch.cat([torch.full((rows.shape[0], 1), 6.0, dtype=values.dtype), rows], dim=1)
    q = quantize(x, 1.0, convention=convention)
    assert torch.equal(q.scales.float(), torch.ones(rows.shape[0], 1))
    return unpack_fp4(q.packed)[:, 1:].reshape(-1)[:n]


@pytest.mark.usefixtures("fused_setting")
@pytest.mark.parametrize("convention", ["kernel", "compressed-tensors"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_every_value_through_quantize(dtype: torch.dtype, convention: str) -> None:
    """Every finite 16-bit pattern within +-6 (float32: the sample above) rounds as the
    reference does when it goes through the whole quantize pipeline, eager or fused."""
    values = _fp32_sample() if dtype == torch.float32 else _all_patterns(dtype)
    values = values[values.abs() <= 6.0]  # NaN drops out too
    got = _codes_through_quantize(values, convention)
    expected = ref_numbers.round_e2m1_tensor(values)
    mismatch = (got != expected).nonzero().flatten()
    assert mismatch.numel() == 0, [
        (float(values[i]), int(got[i]), int(expected[i])) for i in mismatch[:10]
    ]


def test_float64_input_matches_reference() -> None:
    """float64 input must be rounded in float64 (a narrowing to fp32 could create a tie)."""
    ties = torch.tensor(TIE_POINTS, dtype=torch.float64)
    near = [ties]
    for direction in (0.0, 10.0):
        p = ties
        for _ in range(3):
            p = torch.nextafter(p, torch.full_like(p, direction))
            near.append(p)
    g = torch.Generator().manual_seed(5)
    rand = (torch.rand(100_000, generator=g, dtype=torch.float64) - 0.5) * 14
    values = torch.cat([*near, rand])
    values = torch.cat([values, -values])
    assert torch.equal(encode_e2m1(values), ref_numbers.round_e2m1_tensor(values))
    # 0.25 + 2**-40 is 0.25 in float32 but must round up to 0.5 in float64
    assert int(encode_e2m1(torch.tensor([0.25 + 2**-40], dtype=torch.float64))) == 1


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0.25, 0.0),
        (0.75, 1.0),
        (1.25, 1.0),
        (1.75, 2.0),
        (2.5, 2.0),
        (3.5, 4.0),
        (5.0, 4.0),
        (0.2501, 0.5),
        (2.501, 3.0),
        (3.499, 3.0),
        (5.001, 6.0),
    ],
)
def test_tie_table(value: float, expected: float) -> None:
    for dtype in (torch.float32, torch.float64):
        codes = encode_e2m1(torch.tensor([value, -value], dtype=dtype))
        assert decode_e2m1(codes).tolist() == [expected, -expected]


def test_decode_all_16_codes() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        values = decode_e2m1(codes, dtype)
        assert values.dtype == dtype
        expected = [ref_numbers.decode_e2m1_code(c) for c in range(16)]
        assert values.float().tolist() == expected
        assert torch.signbit(values).tolist() == [False] * 8 + [True] * 8
    with pytest.raises(ValueError, match="16"):
        decode_e2m1(torch.tensor([16], dtype=torch.uint8))
    with pytest.raises(TypeError, match="int64"):
        decode_e2m1(torch.tensor([1]))


def test_encode_decode_round_trip_is_identity_on_codes() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    decoded = decode_e2m1(codes)
    again = encode_e2m1(decoded)
    # -0.0 (code 8) re-encodes as +0 (code 0): the sign bit is set only for value < 0
    assert again.tolist() == [*range(8), 0, *range(9, 16)]


def test_signed_zero() -> None:
    codes = encode_e2m1(torch.tensor([0.0, -0.0, -0.1, 0.1, -1e-45, -0.25]))
    assert codes.tolist() == [0, 0, 8, 0, 8, 8]


def test_saturation_and_infinities() -> None:
    x = torch.tensor([6.0, 7.0, 1e30, math.inf, -6.0, -7.0, -math.inf])
    assert encode_e2m1(x).tolist() == [7, 7, 7, 7, 15, 15, 15]


def test_encode_rejects_non_float() -> None:
    with pytest.raises(TypeError, match="int32"):
        encode_e2m1(torch.zeros(4, dtype=torch.int32))


def test_packing_example() -> None:
    codes = encode_e2m1(torch.tensor([0.5, 6.0, -1.0, 0.0]))
    packed = pack_fp4(codes)
    assert packed.tolist() == [0x71, 0x0A]
    assert packed.tolist() == ref_numbers.pack_nibbles(codes.tolist())
    assert unpack_fp4(packed).tolist() == codes.tolist()


def test_pack_matches_reference_and_round_trips() -> None:
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert packed.flatten().tolist() == ref_numbers.pack_nibbles(codes.flatten().tolist())
    assert torch.equal(unpack_fp4(packed), codes)
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(pack_fp4(unpack_fp4(every_byte)), every_byte)
    # non-contiguous input
    assert torch.equal(pack_fp4(codes.transpose(0, 1)), pack_fp4(codes.transpose(0, 1).clone()))


def test_pack_odd_k_raises() -> None:
    with pytest.raises(ValueError, match=r"\(3, 5\)"):
        pack_fp4(torch.zeros(3, 5, dtype=torch.uint8))
    with pytest.raises(TypeError, match="float32"):
        pack_fp4(torch.zeros(4))


def test_pack_rejects_codes_above_15() -> None:
    from nvfp4lab.e2m1 import pack_fp4

    with pytest.raises(ValueError, match="maximum of 16"):
        pack_fp4(torch.tensor([16, 1], dtype=torch.uint8))
