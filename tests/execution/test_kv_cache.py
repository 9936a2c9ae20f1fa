"""The KV cache as vLLM 0.33 writes it (nvfp4lab.execution.kv_cache), against the slow oracle in
nvfp4lab.oracles.kv_cache (bit for bit: torch.equal, and the packed bytes), exhaustive enumerations,
hand-built 4over6 cases, the layout, and the error messages."""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4lab.constants import E2M1_VALUES
from nvfp4lab.execution import kv_cache as kv
from nvfp4lab.oracles import kv_cache as ref_kv
from nvfp4lab.oracles import numbers as ref_numbers
from nvfp4lab.vocab import SUPPORTED_DTYPES, KVCacheKind
from tests.sample_data import make

KINDS = [k.value for k in KVCacheKind]
NVFP4_KINDS = [KVCacheKind.NVFP4.value, KVCacheKind.NVFP4_4OVER6.value]
DATA = ["normal", "student_t", "outliers", "zero_blocks", "small_amax", "tiny_blocks"]
#: DECODE scales: vLLM's default, an amax-derived one (not a power of two), a large one.
SCALES = [1.0, 0.0071, 3.3]
#: The 16 E2M1 code values by code (code 8 is -0.0).
CODE_VALUES = [*E2M1_VALUES, *(-v for v in E2M1_VALUES)]
#: Every positive finite E4M3 value, by byte 0x01..0x7E.
E4M3_POSITIVE = [ref_numbers.decode_e4m3(b) for b in range(1, 0x7F)]


def _reference_bytes(x: torch.Tensor, kind: str, scale: float) -> list[int]:
    """The oracle's bytes of ``x`` laid out as kv_cache.pack lays them out (dim 0 = pages)."""
    if kind == KVCacheKind.FP8:
        values = ref_kv.kv_quantize_fp8(x, scale).reshape(-1).tolist()
        return [ref_numbers.e4m3_byte(v) for v in values]
    codes, scales = ref_kv.kv_quantize_nvfp4(x, scale, four_over_six=kind != KVCacheKind.NVFP4)
    d = x.shape[-1]
    pages = 1 if x.ndim == 1 else x.shape[0]
    out: list[int] = []
    for c_page, s_page in zip(codes.reshape(pages, -1, d), scales.reshape(pages, -1, d // 16),
                              strict=True):
        out += ref_kv.kv_page_bytes(c_page.tolist(), s_page.tolist())
    return out


# --------------------------------------------------------------------------------------------
# the fast path against the oracle
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", KINDS)
def test_fake_quantize_kv_equals_the_oracle(kind: str, dtype: torch.dtype, data: str,
                                            scale: float) -> None:
    x = make(data, (3, 2, 64), dtype, seed=DATA.index(data) * 10 + SCALES.index(scale))
    ours = kv.fake_quantize_kv(x, kind, scale)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert torch.equal(ours, ref_kv.kv_fake_quantize(x, kind, scale))


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", KINDS)
def test_pack_bytes_equal_the_oracle_and_unpack_reads_them_back(kind: str,
                                                                 dtype: torch.dtype) -> None:
    for shape, data in [((2, 4, 3, 32), "normal"), ((5, 48), "student_t"), ((64,), "outliers"),
                        ((3, 2, 16), "tiny_blocks")]:
        x = make(data, shape, dtype, seed=len(shape))
        packed = kv.pack(x, kind, 0.25)
        assert packed.dtype == torch.uint8
        assert packed.shape == (*shape[:-1], kv.packed_dim(shape[-1], kind))
        assert packed.reshape(-1).tolist() == _reference_bytes(x, kind, 0.25)
        # what attention reads: the same as the fast path, in any dtype
        assert torch.equal(kv.unpack(packed, kind, 0.25, dtype=dtype),
                           kv.fake_quantize_kv(x, kind, 0.25))
        read32 = kv.unpack(packed, kind, 0.25)
        assert read32.dtype == torch.float32
        assert torch.equal(read32.to(dtype), kv.fake_quantize_kv(x, kind, 0.25))


@pytest.mark.parametrize("kind", NVFP4_KINDS)
def test_split_packed_gives_the_oracle_codes_and_scales(kind: str) -> None:
    x = make("outliers", (4, 3, 2, 128), torch.bfloat16, seed=7)
    codes, scales = kv.split_packed(kv.pack(x, kind, 1.0), kind)
    want_codes, want_scales = ref_kv.kv_quantize_nvfp4(x, 1.0, four_over_six=kind != "nvfp4")
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float8_e4m3fn
    assert torch.equal(codes, want_codes)
    assert torch.equal(scales.to(torch.float32), want_scales)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", KINDS)
def test_every_finite_16_bit_value_equals_the_oracle(kind: str, dtype: torch.dtype) -> None:
    """All finite bf16 / fp16 bit patterns, in order (similar magnitudes share a block) and
    shuffled (blocks mix magnitudes), at scale 1 and at 0.0071."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.isfinite(x)]
    x = x[: x.numel() // 16 * 16]
    shuffled = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(3))]
    for values, scale in [(x, 1.0), (shuffled, 0.0071)]:
        rows = values.reshape(-1, 16)
        assert torch.equal(kv.fake_quantize_kv(rows, kind, scale),
                           ref_kv.kv_fake_quantize(rows, kind, scale))


# --------------------------------------------------------------------------------------------
# exhaustive: every E4M3 scale x every E2M1 code, every E4M3 byte
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 2.0**-3, 8.0])
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", NVFP4_KINDS)
def test_every_e4m3_scale_times_every_code_is_written_and_read_exactly(
    kind: str, dtype: torch.dtype, scale: float
) -> None:
    """Row ``i`` holds ``value(c) * s_i * scale`` for the 16 codes ``c``, ``s_i`` the i-th positive
    E4M3 value: its max maps to 6 exactly, so the write must give block scale ``s_i`` and codes
    0..15, and the read must give the row back (4over6 too: max -> 6 has no error, and a tie keeps
    it). The powers-of-two ``scale`` keep every value exact in every dtype. Code 8's value, -0.0,
    is written as code 0: the sign bit is set for values < 0 only (nvfp4lab's E2M1 rule)."""
    rows = torch.tensor([[v * s * scale for v in CODE_VALUES] for s in E4M3_POSITIVE],
                        dtype=torch.float64)
    x = rows.to(dtype)
    assert torch.equal(x.to(torch.float64), rows)  # the enumeration itself is exact
    codes, scales = kv.split_packed(kv.pack(x, kind, scale), kind)
    want = [c if c != 8 else 0 for c in range(16)]
    assert torch.equal(codes, torch.tensor(want, dtype=torch.uint8).expand(len(E4M3_POSITIVE), 16))
    assert scales.view(torch.uint8).reshape(-1).tolist() == list(range(1, 0x7F))
    assert torch.equal(kv.fake_quantize_kv(x, kind, scale), x)
    assert torch.equal(kv.fake_quantize_kv(x, kind, scale), ref_kv.kv_fake_quantize(x, kind, scale))


def test_a_zero_block_has_scale_zero_and_reads_zero() -> None:
    """All-zero blocks store scale byte 0 and codes 0; 16 x 1.0 stores e4m3(1/6) = 0.171875
    (0x23) with nvfp4 and 0.25 (0x28, read back exactly) with nvfp4_4over6."""
    x = torch.zeros(2, 32)
    x[1, 16:] = 1.0
    for kind, byte in [("nvfp4", 0x23), ("nvfp4_4over6", 0x28)]:
        codes, scales = kv.split_packed(kv.pack(x, kind, 1.0), kind)
        assert scales.view(torch.uint8).tolist() == [[0, 0], [0, byte]]
        assert bool((codes[0] == 0).all()) and bool((codes[1, :16] == 0).all())
        read = kv.fake_quantize_kv(x, kind, 1.0)
        assert torch.equal(read, ref_kv.kv_fake_quantize(x, kind, 1.0))
        assert read[1, 16:].tolist() == [1.03125 if kind == "nvfp4" else 1.0] * 16


@pytest.mark.parametrize("scale", [1.0, 2.0**-5, 16.0])
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_e4m3_byte_is_an_fp8_fixed_point(dtype: torch.dtype, scale: float) -> None:
    """``byte * scale`` (powers of two: exact) writes back that byte, -0.0 included (0x80), and
    reads back as itself; values past 448 * scale saturate to 0x7E / 0xFE."""
    codes = [b for b in range(256) if b not in (0x7F, 0xFF)]
    values = torch.tensor([ref_numbers.decode_e4m3(b) * scale for b in codes], dtype=torch.float64)
    x = values.to(dtype)
    if dtype == torch.float16:  # the smallest E4M3 values times 2**-5 underflow float16
        keep = x.to(torch.float64) == values
        x, codes = x[keep], [b for b, k in zip(codes, keep.tolist(), strict=True) if k]
    assert kv.pack(x, "fp8", scale).tolist() == codes
    assert torch.equal(kv.fake_quantize_kv(x, "fp8", scale), x)
    big = torch.tensor([500.0 * scale, -1e3 * scale, 464.0 * scale], dtype=dtype)
    assert kv.pack(big, "fp8", scale).tolist() == [0x7E, 0xFE, 0x7E]


def test_fp8_division_is_a_true_float32_division() -> None:
    """Around x = 3 * 1.1875 (x / 3 on the E4M3 midpoint between 1.125 and 1.25) dividing by 3
    and multiplying by f32(1/3) give different bytes for some x; the write divides (vLLM:
    ``x / scale``), as the oracle does."""
    ulp = 2.0**-22  # float32 spacing in [2, 4)
    x = torch.tensor([3.5625 + k * ulp for k in range(-64, 65)], dtype=torch.float32)
    three = torch.full_like(x, 3.0)
    divided = (x / three).to(torch.float8_e4m3fn).view(torch.uint8)
    multiplied = (x * (1 / three)).to(torch.float8_e4m3fn).view(torch.uint8)
    assert not torch.equal(divided, multiplied)  # the data can tell the two rules apart
    assert torch.equal(kv.pack(x, "fp8", 3.0), divided)
    assert kv.pack(x, "fp8", 3.0).tolist() == [ref_numbers.e4m3_byte(v) for v in
                                               ref_kv.kv_quantize_fp8(x, 3.0).tolist()]


# --------------------------------------------------------------------------------------------
# 4over6: the lower squared error wins, a tie keeps max -> 6
# --------------------------------------------------------------------------------------------


def _block(*values: float) -> torch.Tensor:
    return torch.tensor([*values, *[0.0] * (16 - len(values))])


def test_4over6_takes_max_to_4_when_it_is_better() -> None:
    """16 x 5.0: max -> 6 gives s = e4m3(5/6) = 0.8125 and reads 6 * 0.8125 = 4.875 (error
    16 * 0.125**2); max -> 4 gives s = 1.25 and reads 4 * 1.25 = 5 exactly."""
    x = torch.full((16,), 5.0)
    assert kv.fake_quantize_kv(x, "nvfp4", 1.0).tolist() == [4.875] * 16
    assert kv.fake_quantize_kv(x, "nvfp4_4over6", 1.0).tolist() == [5.0] * 16
    codes, scales = kv.split_packed(kv.pack(x, "nvfp4_4over6", 1.0), "nvfp4_4over6")
    assert scales.float().tolist() == [1.25] and codes.tolist() == [6] * 16  # code 6 = 4.0
    assert torch.equal(ref_kv.kv_fake_quantize(x, "nvfp4_4over6", 1.0), torch.full((16,), 5.0))


def test_4over6_keeps_max_to_6_when_it_is_better() -> None:
    """(6, 1): max -> 6 (s = 1) is exact; max -> 4 (s = 1.5) reads 1 as 0.75 or 1.5."""
    x = _block(6.0, 1.0)
    assert torch.equal(kv.fake_quantize_kv(x, "nvfp4_4over6", 1.0), x)
    _, scales = kv.split_packed(kv.pack(x, "nvfp4_4over6", 1.0), "nvfp4_4over6")
    assert scales.float().tolist() == [1.0]


@pytest.mark.parametrize("second", [3.0, 2.625])
def test_4over6_tie_keeps_max_to_6(second: float) -> None:
    """(6, 3): both candidates are exact (error 0 each). (6, 2.625): max -> 6 reads 2.625 as 3
    (error 0.375**2); max -> 4 scales it to 2.625 / 1.5 = 1.75, a tie that rounds to even code
    2.0 and reads 3 as well: equal non-zero errors. Either way the max -> 6 scale (1.0) stays,
    which the bytes show (max -> 4 would store 1.5)."""
    x = _block(6.0, second)
    for fn in (kv.fake_quantize_kv, ref_kv.kv_fake_quantize):
        assert fn(x, "nvfp4_4over6", 1.0).tolist()[:2] == [6.0, 3.0]
    _, scales = kv.split_packed(kv.pack(x, "nvfp4_4over6", 1.0), "nvfp4_4over6")
    assert scales.float().tolist() == [1.0]
    _, ref_scales = ref_kv.kv_quantize_nvfp4(x, 1.0, four_over_six=True)
    assert ref_scales.tolist() == [1.0]


def test_4over6_picks_one_candidate_per_block_and_never_loses_on_average() -> None:
    x = make("student_t", (64, 128), torch.float32, seed=11)
    codes6, scales6 = kv.split_packed(kv.pack(x, "nvfp4", 0.02))
    codes46, scales46 = kv.split_packed(kv.pack(x, "nvfp4_4over6", 0.02), "nvfp4_4over6")
    four = kv.FOUR_OVER_SIX_TARGET
    blocks = x.reshape(64, 8, 16)
    amax = blocks.abs().amax(-1)
    gs = torch.tensor(kv.kv_encode_scale(0.02))
    want4 = (gs * (amax * (1 / four))).clamp(max=448).to(torch.float8_e4m3fn)
    bytes46 = scales46.view(torch.uint8)
    same6 = bytes46 == scales6.view(torch.uint8)
    assert bool((same6 | (bytes46 == want4.view(torch.uint8))).all())
    assert 0 < int((~same6).sum()) < same6.numel()  # both candidates occur
    blocks_codes = codes46.reshape(64, 8, 16)
    assert torch.equal(blocks_codes[same6], codes6.reshape(64, 8, 16)[same6])
    err = {k: (kv.fake_quantize_kv(x, k, 0.02).double() - x.double()).square().sum().item()
           for k in NVFP4_KINDS}
    assert err["nvfp4_4over6"] < err["nvfp4"]


# --------------------------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------------------------


def test_nibble_order_and_row_layout_by_hand() -> None:
    """One row [0.5, 1.0, 6.0, 0 ...] at scale 1: block scale 1.0 (byte 0x38); codes 1, 2, 7 ->
    bytes 0x21 (element 0 in the LOW nibble), 0x07, then zeros, then the scale byte."""
    packed = kv.pack(_block(0.5, 1.0, 6.0), "nvfp4", 1.0)
    assert packed.tolist() == [0x21, 0x07, 0, 0, 0, 0, 0, 0, 0x38]


def test_pages_hold_all_data_then_all_scales() -> None:
    """[pages, block_size, heads, head_size]: page p's bytes are every row's 16 data bytes (row
    order n, h), then every row's 2 scale bytes: what vLLM's nvfp4_split_data_scale expects."""
    x = make("normal", (2, 3, 2, 32), torch.float32, seed=5)
    packed = kv.pack(x, "nvfp4", 1.0)
    codes, scales = ref_kv.kv_quantize_nvfp4(x, 1.0)
    for p in range(2):
        page = packed[p].reshape(-1).tolist()
        rows = [(n, h) for n in range(3) for h in range(2)]
        data = [b for n, h in rows for b in ref_numbers.pack_nibbles(codes[p, n, h].tolist())]
        sc = [ref_numbers.e4m3_byte(v) for n, h in rows for v in scales[p, n, h].tolist()]
        assert page == data + sc
        assert len(data) == 6 * 16 and len(sc) == 6 * 2


def test_packed_dim() -> None:
    assert kv.packed_dim(128) == 72 == 128 // 2 + 128 // 16  # vLLM's HND page row: 72 bytes
    assert kv.packed_dim(64, "nvfp4_4over6") == 36
    assert kv.packed_dim(80, "fp8") == 80


# --------------------------------------------------------------------------------------------
# the global scale
# --------------------------------------------------------------------------------------------


def test_kv_global_scale_follows_vllm_rules() -> None:
    assert kv.kv_global_scale() == (1.0, 1.0)
    assert kv.kv_global_scale(0.5) == (0.5, 0.5)  # a single kv_scale serves both sides
    assert kv.kv_global_scale(0.5, 0.25) == (0.5, 0.25)
    f32 = float(torch.tensor(0.1, dtype=torch.float32))
    assert kv.kv_global_scale(torch.tensor([0.1]), 0.1) == (f32, f32)
    with pytest.raises(ValueError, match="v_scale without a k_scale"):
        kv.kv_global_scale(None, 0.5)


def test_kv_encode_scale_is_the_float32_reciprocal() -> None:
    assert kv.kv_encode_scale(0.25) == 4.0
    assert kv.kv_encode_scale(3.0) == float(torch.tensor(1.0) / torch.tensor(3.0))
    assert kv.kv_encode_scale(3.0) == ref_kv.kv_encode_scale(3.0)


def test_global_scale_is_the_decode_scale() -> None:
    """Doubling the DECODE scale halves the stored magnitudes and leaves the read-back alone for
    values that stay inside E4M3's normal range."""
    x = make("normal", (4, 32), torch.float32, seed=2)
    codes1, scales1 = kv.split_packed(kv.pack(x, "nvfp4", 1.0))
    codes2, scales2 = kv.split_packed(kv.pack(x, "nvfp4", 2.0))
    assert torch.equal(codes1, codes2)
    assert torch.equal(scales1.float(), 2 * scales2.float())
    assert torch.equal(kv.fake_quantize_kv(x, "nvfp4", 1.0), kv.fake_quantize_kv(x, "nvfp4", 2.0))


# --------------------------------------------------------------------------------------------
# errors: one line each, naming the value and the fix
# --------------------------------------------------------------------------------------------


BAD_CALLS = [
    (lambda: kv.pack(torch.zeros(16), "nvfp5", 1.0), "unknown KV cache kind 'nvfp5'"),
    (lambda: kv.pack(torch.zeros(16, dtype=torch.float64), "nvfp4", 1.0), "convert it with"),
    (lambda: kv.pack(torch.zeros(16, dtype=torch.int32), "fp8", 1.0), "torch.int32"),
    (lambda: kv.pack([0.0] * 16, "nvfp4", 1.0), "must be a torch.Tensor"),
    (lambda: kv.pack(torch.tensor(1.0), "fp8", 1.0), "0-d"),
    (lambda: kv.pack(torch.zeros(2, 40), "nvfp4", 1.0), "head_size 40"),
    (lambda: kv.fake_quantize_kv(torch.zeros(2, 8), "nvfp4_4over6", 1.0), "head_size 8"),
    (lambda: kv.pack(torch.tensor([1.0, math.nan] * 8), "nvfp4", 1.0), "first at index \\(1,\\)"),
    (lambda: kv.fake_quantize_kv(torch.tensor([math.inf] * 16), "fp8", 1.0), "NaN/Inf"),
    (lambda: kv.pack(torch.zeros(16), "nvfp4", 0.0), "got 0.0"),
    (lambda: kv.pack(torch.zeros(16), "nvfp4", -1.0), "got -1.0"),
    (lambda: kv.pack(torch.zeros(16), "fp8", math.nan), "got nan"),
    (lambda: kv.pack(torch.zeros(16), "fp8", math.inf), "got inf"),
    (lambda: kv.pack(torch.zeros(16), "nvfp4", 1e-39), "exceeds 2\\*\\*116"),
    (lambda: kv.pack(torch.zeros(16), "nvfp4", torch.ones(2)), "shape \\(2,\\)"),
    (lambda: kv.pack(torch.zeros(16), "nvfp4", "1.0"), "got str"),
    (lambda: kv.unpack(torch.zeros(9, dtype=torch.int8), "nvfp4", 1.0), "uint8"),
    (lambda: kv.unpack(torch.zeros(40, dtype=torch.uint8), "nvfp4", 1.0), "last dim of 40"),
    (lambda: kv.unpack(torch.zeros(9, dtype=torch.uint8), "nvfp4", 1.0, dtype=torch.float64),
     "dtype=torch.float32"),
    (lambda: kv.split_packed(torch.zeros(9, dtype=torch.uint8), "fp8"), "fp8 has no scales"),
    (lambda: kv.packed_dim(40), "got 40"),
    (lambda: kv.packed_dim(0, "fp8"), "got 0"),
    (lambda: kv.kv_global_scale(-0.5), "got -0.5"),
    (lambda: kv.kv_global_scale(torch.ones(8)), "per-tensor KV scales only"),
    (lambda: kv.kv_encode_scale(0.0), "got 0.0"),
]


@pytest.mark.parametrize(("call", "match"), BAD_CALLS, ids=[m for _, m in BAD_CALLS])
def test_bad_input_raises_one_line_value_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_fp8_accepts_any_head_size_and_unpack_any_length() -> None:
    x = make("normal", (3, 40), torch.float16, seed=1)
    assert kv.pack(x, "fp8", 1.0).shape == (3, 40)
    assert torch.equal(kv.unpack(kv.pack(x, "fp8", 1.0), "fp8", 1.0, dtype=torch.float16),
                       ref_kv.kv_fake_quantize(x, "fp8", 1.0))


# --------------------------------------------------------------------------------------------
# Issue 32: pack / unpack of zero rows raised torch's reshape error (fake_quantize_kv worked);
# vLLM's other name of the fp8 cache, fp8_e4m3, documented here, was refused; a scale whose
# float32 reciprocal overflows (1e-40) was accepted.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [*KVCacheKind, "fp8_e4m3"])
@pytest.mark.parametrize("shape", [(0, 16), (0, 4, 32), (2, 0, 16), (3, 0, 2, 32), (0, 0, 16)])
def test_zero_rows_pack_and_unpack_to_empty_tensors(kind: str, shape: tuple[int, ...]) -> None:
    x = torch.zeros(shape, dtype=torch.bfloat16)
    packed = kv.pack(x, kind, 2.0)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*shape[:-1], kv.packed_dim(shape[-1], kind))
    read = kv.unpack(packed, kind, 2.0, dtype=torch.bfloat16)
    assert read.shape == shape and torch.equal(read, kv.fake_quantize_kv(x, kind, 2.0))
    if kind not in ("fp8", "fp8_e4m3"):
        codes, scales = kv.split_packed(packed, kind)
        assert codes.shape == shape and scales.shape == (*shape[:-1], shape[-1] // 16)


def test_fp8_e4m3_is_vllms_other_name_of_fp8() -> None:
    x = make("outliers", (3, 2, 32), torch.float32, seed=4)
    assert kv.kv_cache_kind("fp8_e4m3") is KVCacheKind.FP8
    assert torch.equal(kv.pack(x, "fp8_e4m3", 0.5), kv.pack(x, "fp8", 0.5))
    assert kv.pack(x, "fp8_e4m3", 0.5).reshape(-1).tolist() == _reference_bytes(x, "fp8", 0.5)
    assert torch.equal(kv.unpack(kv.pack(x, "fp8", 0.5), "fp8_e4m3", 0.5),
                       kv.fake_quantize_kv(x, "fp8_e4m3", 0.5))
    assert kv.packed_dim(32, "fp8_e4m3") == 32
    with pytest.raises(ValueError, match=r"^unknown KV cache kind 'fp8_e5m2'; accepted values: "
                       r"'nvfp4', 'nvfp4_4over6', 'fp8', or vLLM's alias 'fp8_e4m3' \(= 'fp8'\)$"):
        kv.pack(x, "fp8_e5m2", 1.0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: kv.kv_global_scale(1e-40),
         r"^k_scale 1e-40 is too small: its reciprocal .* overflows float32; pass a DECODE scale "
         r">= 2\*\*-127$"),
        (lambda: kv.kv_global_scale(1.0, 1e-40, "fp8"), r"^v_scale 1e-40 is too small"),
        (lambda: kv.kv_global_scale(1e-36, None, "nvfp4"),
         r"^k_scale 1e-36 is too small for an nvfp4 KV cache: its ENCODE scale 1/1e-36 exceeds "
         r"2\*\*116; pass a DECODE scale >= 2\*\*-116$"),
        (lambda: kv.kv_global_scale(1.0, 1e-36, "nvfp4_4over6"), r"^v_scale 1e-36 .* nvfp4_4over6"),
        (lambda: kv.kv_global_scale(1e-50), r"^k_scale must be finite and > 0, got 1e-50"),
    ],
)
def test_scales_whose_reciprocal_overflows_are_refused_by_name(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_small_scales_with_a_finite_reciprocal_are_kept() -> None:
    assert kv.kv_global_scale(1e-36, None, "fp8") == (pytest.approx(1e-36, rel=1e-6),) * 2
    assert kv.kv_global_scale(2.0**-116, 2.0**-116, "nvfp4") == (2.0**-116, 2.0**-116)
