"""Tests of the slow reference (oracle) itself: it must be right before it judges the fast path.

The oracle is checked against torch's own conversions (float8_e4m3fn, bfloat16, float16,
float32), hand-computed tables from docs/nvfp4-format.md, and its scalar and vectorized versions
against each other.
"""

from __future__ import annotations

import itertools
import math
import struct

import pytest
import torch

from nvfp4lab.oracles import kv_cache as ref_kv
from nvfp4lab.oracles import numbers as ref_numbers
from nvfp4lab.oracles import nvfp4 as ref_nvfp4
from nvfp4lab.orders import ORDERS, ArithmeticOrder, E2M1Ties

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _f32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _random_f32(n: int, seed: int, lo_exp: int = -30, hi_exp: int = 30) -> torch.Tensor:
    """Finite float32 values with log-uniform magnitudes and random signs and mantissas."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.rand(n, generator=g, dtype=torch.float64) + 1.0
    exp = torch.randint(lo_exp, hi_exp, (n,), generator=g).to(torch.float64)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    return (sign * mant * torch.pow(2.0, exp)).to(torch.float32)


# --------------------------------------------------------------------------------------------
# E4M3
# --------------------------------------------------------------------------------------------


def test_decode_e4m3_all_256_codes_match_torch() -> None:
    torch_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    for byte in range(256):
        mine = ref_numbers.decode_e4m3(byte)
        theirs = torch_values[byte]
        if math.isnan(theirs):
            assert math.isnan(mine), byte
            assert byte in (0x7F, 0xFF)
        else:
            assert mine == theirs, (byte, mine, theirs)
            assert math.copysign(1.0, mine) == math.copysign(1.0, theirs), byte


def test_e4m3_landmarks() -> None:
    assert ref_numbers.decode_e4m3(0x7E) == 448.0
    assert ref_numbers.decode_e4m3(0x08) == 2.0**-6  # min normal
    assert ref_numbers.decode_e4m3(0x01) == 2.0**-9  # min subnormal
    assert ref_numbers.decode_e4m3(0x38) == 1.0
    negative_zero = ref_numbers.decode_e4m3(0x80)
    assert negative_zero == 0.0 and math.copysign(1, negative_zero) == -1
    values = ref_numbers.e4m3_finite_values()
    assert len(values) == 253
    assert values == sorted(values)
    assert values[0] == -448.0 and values[-1] == 448.0
    assert min(v for v in values if v > 0) == 2.0**-9
    with pytest.raises(ValueError, match="300"):
        ref_numbers.decode_e4m3(300)


def _e4m3_tie_points() -> list[float]:
    pos = [v for v in ref_numbers.e4m3_finite_values() if v >= 0]
    return [(a + b) / 2 for a, b in itertools.pairwise(pos)]


def test_round_e4m3_ties_go_to_even_mantissa() -> None:
    pos = [v for v in ref_numbers.e4m3_finite_values() if v >= 0]
    for k, (a, b) in enumerate(itertools.pairwise(pos)):
        mid = (a + b) / 2
        # codes k and k+1: the even code has mantissa bit 0
        expected = a if k % 2 == 0 else b
        assert ref_numbers.round_e4m3(mid) == expected, (a, b)
        assert ref_numbers.round_e4m3(-mid) == -expected
        assert ref_numbers.round_e4m3(math.nextafter(mid, 0)) == a
        assert ref_numbers.round_e4m3(math.nextafter(mid, 1000)) == b
    assert ref_numbers.round_e4m3(2.0**-10) == 0.0  # half the min subnormal ties to zero
    assert ref_numbers.round_e4m3(math.nextafter(2.0**-10, 1)) == 2.0**-9
    assert ref_numbers.round_e4m3(448.0) == 448.0


def test_round_e4m3_matches_torch_cast() -> None:
    """RNE of torch's float32 -> float8_e4m3fn cast on random values, every tie point +- 1 ulp."""
    values = _random_f32(4000, seed=1, lo_exp=-12, hi_exp=9).abs().clamp(max=448.0)
    ties = torch.tensor(_e4m3_tie_points(), dtype=torch.float32)
    up = torch.nextafter(ties, torch.full_like(ties, 1000.0))
    down = torch.nextafter(ties, torch.zeros_like(ties))
    x = torch.cat([values, ties, up, down, -values[:500]])
    theirs = x.to(torch.float8_e4m3fn).float().tolist()
    for v, t in zip(x.tolist(), theirs, strict=True):
        assert ref_numbers.round_e4m3(v) == t, v


def test_round_e4m3_rejects_nan_and_unclamped() -> None:
    with pytest.raises(ValueError, match="NaN"):
        ref_numbers.round_e4m3(math.nan)
    with pytest.raises(ValueError, match="449"):
        ref_numbers.round_e4m3(449.0)


# --------------------------------------------------------------------------------------------
# E2M1
# --------------------------------------------------------------------------------------------

TIE_TABLE = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]
NEAR_TIES = [(0.2501, 0.5), (2.501, 3.0), (3.499, 3.0), (5.001, 6.0), (0.2499, 0.0), (4.999, 4.0)]


@pytest.mark.parametrize(("value", "expected"), TIE_TABLE + NEAR_TIES)
def test_round_e2m1_tie_table(value: float, expected: float) -> None:
    assert ref_numbers.decode_e2m1_code(ref_numbers.round_e2m1(value)) == expected
    assert ref_numbers.decode_e2m1_code(ref_numbers.round_e2m1(-value)) == -expected
    t = torch.tensor([value, -value], dtype=torch.float64)
    codes = ref_numbers.round_e2m1_tensor(t).tolist()
    assert codes == [ref_numbers.round_e2m1(value), ref_numbers.round_e2m1(-value)]


def test_round_e2m1_grid_points_clamp_and_sign() -> None:
    for index, magnitude in enumerate(ref_numbers.E2M1_GRID):
        assert ref_numbers.round_e2m1(magnitude) == index
        assert ref_numbers.round_e2m1(-magnitude) == (index | 8 if magnitude else 0)
    assert ref_numbers.round_e2m1(7.0) == 7 and ref_numbers.round_e2m1(-1e30) == 15
    assert ref_numbers.round_e2m1(math.inf) == 7 and ref_numbers.round_e2m1(-math.inf) == 15
    assert ref_numbers.round_e2m1(-0.0) == 0  # exact -0.0: positive zero code
    assert ref_numbers.round_e2m1(-0.1) == 8  # small negative: negative zero code
    assert ref_numbers.round_e2m1(-1e-45) == 8
    assert ref_numbers.round_e2m1(5.0000001) == 7
    with pytest.raises(ValueError, match="NaN"):
        ref_numbers.round_e2m1(math.nan)
    with pytest.raises(ValueError, match="NaN"):
        ref_numbers.round_e2m1_tensor(torch.tensor([1.0, math.nan]))


def test_decode_e2m1_code_table() -> None:
    values = [ref_numbers.decode_e2m1_code(c) for c in range(16)]
    assert values[:8] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert values[8:] == [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert math.copysign(1.0, values[8]) == -1.0
    with pytest.raises(ValueError, match="16"):
        ref_numbers.decode_e2m1_code(16)


def test_round_e2m1_scalar_equals_vectorized() -> None:
    """The scalar (exact Fraction) and vectorized (float64 argmin) versions agree."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    pts = torch.tensor(ties + list(ref_numbers.E2M1_GRID), dtype=torch.float32)
    near = [pts]
    for direction in (0.0, 10.0):
        p = pts
        for _ in range(4):
            p = torch.nextafter(p, torch.full_like(p, direction))
            near.append(p)
    rand = _random_f32(20000, seed=2, lo_exp=-8, hi_exp=4)
    x = torch.cat([*near, rand, torch.tensor([1e-45, 6.0000005, 100.0, 0.0, -0.0])])
    x = torch.cat([x, -x])
    vec = ref_numbers.round_e2m1_tensor(x).tolist()
    scalar = [ref_numbers.round_e2m1(v) for v in x.tolist()]
    assert vec == scalar


def test_round_e2m1_tensor_matches_compressed_tensors_cast() -> None:
    """Third opinion: compressed-tensors' threshold cast + signbit gives the same codes."""
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    x = torch.cat([_random_f32(50000, seed=3, lo_exp=-6, hi_exp=4), torch.tensor([-0.0, 0.0])])
    x = x.clamp(-6, 6)
    v = cast_to_fp4(x.clone())
    magnitude_index = torch.bucketize(v.abs(), torch.tensor(ref_numbers.E2M1_GRID))
    theirs = magnitude_index.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)
    assert torch.equal(ref_numbers.round_e2m1_tensor(x), theirs)


def test_pack_nibbles_example_and_round_trip() -> None:
    codes = [ref_numbers.round_e2m1(v) for v in (0.5, 6.0, -1.0, 0.0)]
    assert ref_numbers.pack_nibbles(codes) == [0x71, 0x0A]
    assert ref_numbers.unpack_nibbles([0x71, 0x0A]) == codes
    all_codes = list(range(16)) + list(reversed(range(16)))
    assert ref_numbers.unpack_nibbles(ref_numbers.pack_nibbles(all_codes)) == all_codes
    with pytest.raises(ValueError, match="3"):
        ref_numbers.pack_nibbles([1, 2, 3])


# --------------------------------------------------------------------------------------------
# float32 / bfloat16 / float16 emulation
# --------------------------------------------------------------------------------------------


def test_round_f32_matches_torch() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5000, generator=g, dtype=torch.float64) * torch.pow(
        10.0, torch.randint(-45, 39, (5000,), generator=g).to(torch.float64)
    )
    x = torch.cat([x, torch.tensor([3.5e38, -3.5e38, 3.4028235e38, 1e-46, 7e-46, 0.0])])
    theirs = x.to(torch.float32).tolist()
    for v, t in zip(x.tolist(), theirs, strict=True):
        mine = ref_numbers.round_f32(v)
        assert mine == t or (math.isinf(mine) and mine == t), v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrowing_matches_torch(dtype: torch.dtype) -> None:
    bits = torch.randint(-(2**31), 2**31 - 1, (40000,), generator=torch.Generator().manual_seed(5))
    x = _f32_from_bits(bits)
    x = x[torch.isfinite(x)]
    big = torch.tensor([65504.0, 65519.99, 65520.0, 65535.0, 3.3961e38, 3.3962e38, 3.4e38])
    x = torch.cat([x, big, -big, _random_f32(20000, seed=6, lo_exp=-26, hi_exp=17)])
    theirs = x.to(dtype).float().tolist()
    for v, t in zip(x.tolist(), theirs, strict=True):
        assert ref_numbers.narrow(v, dtype) == t, (v, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_narrow_emulates_torch_division_and_reciprocal(dtype: torch.dtype) -> None:
    """torch computes bf16/fp16 elementwise ops in float32 and narrows: so does ``narrow``."""
    a = _random_f32(3000, seed=7, lo_exp=-10, hi_exp=10).abs().to(dtype)
    div = (a / torch.tensor(6.0, dtype=dtype)).tolist()
    rec = a.reciprocal().tolist()
    rdiv = (2688.0 / a).tolist()  # Tensor.__rtruediv__ == reciprocal() * 2688
    for v, d, r, rd in zip(a.tolist(), div, rec, rdiv, strict=True):
        assert ref_numbers.narrow(v / 6.0, dtype) == d
        assert ref_numbers.narrow(1.0 / v, dtype) == r
        assert ref_numbers.narrow(ref_numbers.narrow(1.0 / v, dtype) * 2688.0, dtype) == rd


def test_f32_one_sixth() -> None:
    assert struct.unpack("<f", struct.pack("<f", 1 / 6))[0] == ref_numbers.F32_ONE_SIXTH
    assert ref_numbers.F32_ONE_SIXTH != 1 / 6


# --------------------------------------------------------------------------------------------
# swizzle formula
# --------------------------------------------------------------------------------------------


def test_swizzle_offset_landmarks() -> None:
    assert ref_nvfp4.swizzle_offset(0, 0, 4) == 0
    assert ref_nvfp4.swizzle_offset(0, 1, 4) == 1
    assert ref_nvfp4.swizzle_offset(1, 0, 4) == 16
    assert ref_nvfp4.swizzle_offset(31, 3, 4) == 31 * 16 + 3
    assert ref_nvfp4.swizzle_offset(32, 0, 4) == 4
    assert ref_nvfp4.swizzle_offset(127, 3, 4) == 511
    assert ref_nvfp4.swizzle_offset(0, 4, 8) == 512
    assert ref_nvfp4.swizzle_offset(128, 0, 8) == 2 * 512
    assert ref_nvfp4.swizzle_offset(128, 0, 5) == 2 * 512  # 5 cols pad to 8: 2 tiles per row


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (128, 4), (129, 7), (300, 33)])
def test_swizzle_offset_is_a_bijection_onto_padded_tiles(rows: int, cols: int) -> None:
    padded = (-(-rows // 128) * 128) * (-(-cols // 4) * 4)
    offsets = {ref_nvfp4.swizzle_offset(i, j, cols) for i in range(rows) for j in range(cols)}
    assert len(offsets) == rows * cols
    assert min(offsets) >= 0 and max(offsets) < padded


# --------------------------------------------------------------------------------------------
# global scale, block quantization, dequantization
# --------------------------------------------------------------------------------------------


def test_global_scale_hand_values() -> None:
    x = torch.tensor([0.5, -1.0, 0.25, 0.0])
    assert ref_nvfp4.global_scale(x, "kernel") == 2688.0
    assert ref_nvfp4.global_scale(x, "compressed-tensors") == 2688.0
    zeros = torch.zeros(16)
    assert ref_nvfp4.global_scale(zeros, "kernel") == 1.0
    assert ref_nvfp4.global_scale(zeros, "compressed-tensors") == 1.0
    # fp16: 2688 / 0.01 overflows float16 -> inf -> 1.0 (CT's fallback); the kernel is fine
    small = torch.full((16,), 0.01, dtype=torch.float16)
    assert ref_nvfp4.global_scale(small, "compressed-tensors") == 1.0
    expected_gs = ref_numbers.round_f32(2688.0 / float(small[0]))
    assert ref_nvfp4.global_scale(small, "kernel") == expected_gs
    # bf16 global scale is bf16-rounded
    x3 = torch.tensor([3.0], dtype=torch.bfloat16)
    assert ref_nvfp4.global_scale(x3, "compressed-tensors") == ref_numbers.round_bf16(
        ref_numbers.round_bf16(1 / 3) * 2688
    )
    with pytest.raises(ValueError, match="kernal"):
        ref_nvfp4.global_scale(x, "kernal")


def test_the_oracle_covers_every_order() -> None:
    assert set(ref_nvfp4.CONVENTIONS) == {str(c) for c in ORDERS}


@pytest.mark.parametrize("order", list(ORDERS.values()), ids=lambda o: str(o.convention))
def test_quantize_blocks_exact_grid_block(order: ArithmeticOrder) -> None:
    """Each order's oracle on grid values and an all-zero block; what differs between orders
    is read from the order's steps, not its name."""
    convention = str(order.convention)
    vals = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, -0.1]
    x = torch.tensor([vals, [0.0] * 16])
    codes, scales = ref_nvfp4.quantize_blocks(x, 1.0, convention)
    # ties to the earlier index (llama.cpp's nearest-of-table) keep +0 for -0.1 (code 0)
    earlier = order.e2m1_ties is E2M1Ties.FIRST_NEAREST_SCALED_TABLE
    minus_zero = 0 if earlier else 8
    assert codes[0].tolist() == [*range(8), *range(9, 16), minus_zero]
    assert codes[1].tolist() == [0] * 16
    assert scales[0].item() == 1.0
    # an all-zero block: the order's zero-block scale, else its replacement of a 0 scale, else 0
    zero_block_scale = next((v for v in (order.zero_block_scale, order.zero_scale_replacement)
                             if v is not None), 0.0)
    assert scales[1].item() == zero_block_scale
    deq = ref_nvfp4.dequantize_blocks(codes, scales, 1.0, convention)
    assert deq[0, :15].tolist() == vals[:15]
    sign = 1 if earlier else -1
    assert deq[0, 15].item() == 0.0 and math.copysign(1, deq[0, 15].item()) == sign
    assert deq[1].tolist() == [0.0] * 16


def test_the_zero_block_scales_are_the_published_ones() -> None:
    """The step values above, as the four sources publish them (a hand-written check of the
    table the previous test reads)."""
    published = {"kernel": 0.0, "compressed-tensors": 0.125, "modelopt": 1.0, "llama.cpp": 0.0}
    for name, want in published.items():
        x = torch.zeros(1, 16)
        assert ref_nvfp4.quantize_blocks(x, 1.0, name)[1].item() == want


def test_quantize_blocks_kernel_by_hand() -> None:
    """One block worked through steps 1-5 of docs/nvfp4-format.md (kernel order), gs = 2688/amax."""
    x = torch.tensor([[0.1 * (i - 7) for i in range(16)]])  # amax 0.8 (f32(0.1) * 8)
    amax = float(x.abs().max())
    n = ref_numbers
    gs = n.round_f32(2688.0 / amax)
    s = n.round_e4m3(min(n.round_f32(gs * n.round_f32(amax * n.F32_ONE_SIXTH)), 448.0))
    assert s == 448.0
    m = n.round_f32(1.0 / n.round_f32(s * n.round_f32(1.0 / gs)))
    expected = [n.round_e2m1(max(-6.0, min(6.0, n.round_f32(v * m)))) for v in x[0].tolist()]
    codes, scales = ref_nvfp4.quantize_blocks(x, gs, "kernel")
    assert codes[0].tolist() == expected
    assert scales.tolist() == [[448.0]]


def test_conventions_differ_on_zero_and_underflow_scales() -> None:
    # a block whose scale underflows E4M3 next to a block that sets the global scale
    x = torch.cat([torch.full((16,), 1000.0), torch.full((16,), 1e-4)]).reshape(1, 32)
    gs = ref_nvfp4.global_scale(x, "kernel")
    kc, ks = ref_nvfp4.quantize_blocks(x, gs, "kernel")
    cc, cs = ref_nvfp4.quantize_blocks(x, gs, "compressed-tensors")
    assert ks[0, 1].item() == 0.0 and cs[0, 1].item() == 0.125
    assert kc[0, 16:].tolist() == [0] * 16 and cc[0, 16:].tolist() == [0] * 16


def test_quantize_blocks_validation() -> None:
    with pytest.raises(ValueError, match=r"\(2, 17\)"):
        ref_nvfp4.quantize_blocks(torch.zeros(2, 17), 1.0)
    with pytest.raises(ValueError, match="global_scale"):
        ref_nvfp4.quantize_blocks(torch.zeros(2, 16), 0.0)
    with pytest.raises(ValueError, match="finite"):
        ref_nvfp4.quantize_blocks(torch.tensor([math.inf] * 16), 1.0)
    with pytest.raises(TypeError, match="int32"):
        ref_nvfp4.quantize_blocks(torch.zeros(16, dtype=torch.int32), 1.0)
    codes, scales = ref_nvfp4.quantize_blocks(torch.zeros(0, 32), 1.0)
    assert codes.shape == (0, 32) and scales.shape == (0, 2)


def test_kernel_order_multiplier_overflow_is_reported() -> None:
    """1/(s*(1/gs)) overflows float32 for float32-subnormal blocks with a large global scale:
    0 * inf is NaN, so the kernel order has no defined code. The oracle refuses."""
    x = torch.zeros(1, 32)
    x[0, :16] = 1e-34  # sets gs = 2688 / 1e-34
    x[0, 16] = 1e-38  # second block: s small, s / gs ~ 1.7e-39, 1 / that overflows
    gs = ref_numbers.round_f32(2688.0 / 1e-34)  # the uncapped 2688/amax
    with pytest.raises(ValueError, match="overflowed"):
        ref_nvfp4.quantize_blocks(x, gs, "kernel")
    codes, _ = ref_nvfp4.quantize_blocks(x, gs, "compressed-tensors")  # CT divides: fine
    assert codes[0, 16].item() != 0
    # nvfp4lab refuses such an explicit scale in the kernel order, and its automatic scale is
    # capped at 2**116 where the arithmetic is defined; the oracle agrees with the cap.
    from nvfp4lab.codec import (
        KERNEL_MAX_GLOBAL_SCALE,
        ScaleUnderflowWarning,
        compute_global_scale,
        quantize,
    )

    with pytest.raises(ValueError, match="2\\*\\*116"):
        quantize(x, gs)
    assert ref_nvfp4.global_scale(x, "kernel") == KERNEL_MAX_GLOBAL_SCALE
    assert float(compute_global_scale(x)) == KERNEL_MAX_GLOBAL_SCALE
    codes, _ = ref_nvfp4.quantize_blocks(x, KERNEL_MAX_GLOBAL_SCALE, "kernel")
    # the 1e-34 block keeps its values; the lone 1e-38 one underflows the E4M3 block scale
    assert bool((codes[0, :16] == 7).all()) and codes[0, 16].item() == 0
    with pytest.warns(ScaleUnderflowWarning, match="1 of 2 non-zero blocks"):  # said, not silent
        assert torch.equal(quantize(x).codes(), codes)


# --------------------------------------------------------------------------------------------
# the KV-cache oracle (vLLM 0.33's --kv-cache-dtype nvfp4 / nvfp4_4over6 / fp8)
# --------------------------------------------------------------------------------------------


def test_e4m3_byte_inverts_torch_for_all_finite_codes() -> None:
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    for byte, value in enumerate(values):
        if math.isnan(value):
            continue
        assert ref_numbers.e4m3_byte(value) == byte, (byte, value)
    with pytest.raises(ValueError, match="not a finite E4M3 value"):
        ref_numbers.e4m3_byte(0.3)


def test_kv_encode_scale_by_hand() -> None:
    assert ref_kv.kv_encode_scale(0.25) == 4.0
    assert ref_kv.kv_encode_scale(3.0) == ref_numbers.round_f32(1.0 / 3.0)
    with pytest.raises(ValueError, match="finite and > 0"):
        ref_kv.kv_encode_scale(0.0)


def test_kv_quantize_fp8_by_hand() -> None:
    """x / 2: 2.25 / 2 = 1.125 is E4M3; 2.125 / 2 = 1.0625, the midpoint of 1.0 and 1.125, goes
    to the even mantissa (1.0), 2.375 / 2 = 1.1875 likewise up to 1.25; 1000 saturates to 448; a
    tiny negative value and -0.0 keep their sign (-0.0)."""
    x = torch.tensor([2.25, 2.125, 2.375, 1000.0, -1e-9, -0.0])
    got = ref_kv.kv_quantize_fp8(x, 2.0).tolist()
    assert got == [1.125, 1.0, 1.25, 448.0, 0.0, 0.0]
    assert [math.copysign(1.0, v) for v in got] == [1.0, 1.0, 1.0, 1.0, -1.0, -1.0]
    assert ref_kv.kv_read_fp8(torch.tensor(got), 2.0).tolist() == [2.25, 2.0, 2.5, 896.0, 0.0, 0.0]


def test_kv_quantize_nvfp4_by_hand() -> None:
    """Scale 0.5 (encode 2): block (3, -1.5, 0.25, 0 ...) has amax 3, s = e4m3(2 * 3 * f32(1/6))
    = 1.0, scaled values 6, -3, 0.5 -> codes 7, 13 (sign | 3.0), 1; read back value * 1 * 0.5."""
    x = torch.tensor([3.0, -1.5, 0.25] + [0.0] * 13)
    codes, scales = ref_kv.kv_quantize_nvfp4(x, 0.5)
    assert codes.tolist()[:3] == [7, 13, 1] and scales.tolist() == [1.0]
    assert ref_kv.kv_read_nvfp4(codes, scales, 0.5).tolist()[:3] == [3.0, -1.5, 0.25]
    assert ref_kv.kv_page_bytes([codes.tolist()], [scales.tolist()]) == [0xD7, 0x01] + [0] * 6 + [
        0x38
    ]


def test_kv_four_over_six_by_hand() -> None:
    """16 x 5.0 at scale 1: max -> 6 stores s = 0.8125 and reads 4.875; max -> 4 stores s = 1.25
    and reads 5.0: 4over6 keeps the second; (6, 3) is exact both ways and keeps s = 1."""
    five = torch.full((16,), 5.0)
    assert ref_kv.kv_quantize_nvfp4(five, 1.0)[1].tolist() == [0.8125]
    assert ref_kv.kv_quantize_nvfp4(five, 1.0, four_over_six=True)[1].tolist() == [1.25]
    assert ref_kv.kv_fake_quantize(five, "nvfp4_4over6", 1.0).tolist() == [5.0] * 16
    tie = torch.tensor([6.0, 3.0] + [0.0] * 14)
    assert ref_kv.kv_quantize_nvfp4(tie, 1.0, four_over_six=True)[1].tolist() == [1.0]
    with pytest.raises(ValueError, match="below 2\\*\\*-116"):
        ref_kv.kv_quantize_nvfp4(five, 2.0**-120)
