"""Slow, readable reference ("oracle") for NVFP4 numerics.

Written independently of the fast implementation, from the format's definition (the facts are
restated in ``docs/nvfp4-format.md``), so that tests can compare the two bit for bit.

Everything here favours obviousness over speed:

* E2M1 and E4M3 rounding are nearest-value searches over the list of representable values,
  with exact (``fractions.Fraction``) distance comparisons and an explicit tie rule.
* Float32 arithmetic is emulated with Python floats (IEEE binary64) rounded to binary32 after
  EACH operation.  For a single ``+ - * /`` on binary32 operands this equals the IEEE binary32
  result, because binary64 has more than ``2 * 24 + 2`` significand bits (double rounding is
  innocuous).  bfloat16 / float16 operations are emulated the way torch computes them on CPU:
  the float32 result rounded (RNE) to the narrow type.
* Block quantization loops over 16-element blocks in Python.

Four block-quantization orders are provided (see docs/nvfp4-format.md):

``"kernel"``
    vLLM's reference for its CUDA kernel; everything in float32 with reciprocal multiplies.
``"compressed-tensors"``
    compressed-tensors 0.20: ``amax / 6`` in the input dtype, a division by ``s / gs``,
    zero scales replaced by 0.125.
``"modelopt"``
    NVIDIA ModelOpt 0.47 (``NVFP4QTensor.quantize``), written in the DECODE tensor scale
    ``d = amax / 2688``: ``s = e4m3(clamp(amax_b / (6 d), 2^-9, 448))`` (1 for an all-zero block),
    elements divided by ``s * d``, decoded as ``value * (s * d)``.
``"llama.cpp"``
    ggml's ``quantize_row_nvfp4_ref`` (ggml/src/ggml-quants.c, with ``ggml_fp32_to_ue4m3`` /
    ``ggml_ue4m3_to_fp32`` of ggml-impl.h, at ggml-org/llama.cpp@0c1e57098bba, the commit
    llama-cpp-python 0.3.36 vendors), transcribed statement by statement: no tensor scale (a given
    one multiplies the elements first), ``ue = fp32_to_ue4m3(amax / 6)``, ``d = ue4m3_to_fp32(ue)``
    (half the E4M3 value), each code the first ``i`` minimizing ``|kvalues[i] * d - x|``.

The KV cache as vLLM 0.33 writes and reads it (``--kv-cache-dtype``; docs/kv_cache.md) has its
own oracle at the end of this file: ``kv_quantize_nvfp4`` (``nvfp4`` and ``nvfp4_4over6``),
``kv_quantize_fp8``, ``kv_read_nvfp4`` / ``kv_read_fp8``, ``kv_fake_quantize`` and
``kv_page_bytes`` (the bytes of one page side), all in the DECODE scale vLLM stores as
``k_scale`` / ``v_scale``.
"""

from __future__ import annotations

import bisect
import math
import struct
from collections.abc import Sequence
from fractions import Fraction

import torch

__all__ = [
    "BLOCK",
    "CONVENTIONS",
    "CT_ZERO_SCALE",
    "E2M1_GRID",
    "E4M3_MAX",
    "F32_ONE_SIXTH",
    "GGML_KVALUES",
    "KV_KINDS",
    "decode_e2m1_code",
    "decode_e4m3",
    "dequantize_blocks",
    "e4m3_byte",
    "e4m3_finite_values",
    "ggml_fp32_to_ue4m3",
    "ggml_ue4m3_to_fp32",
    "global_scale",
    "kv_encode_scale",
    "kv_fake_quantize",
    "kv_page_bytes",
    "kv_quantize_fp8",
    "kv_quantize_nvfp4",
    "kv_read_fp8",
    "kv_read_nvfp4",
    "modelopt_decode_scale",
    "narrow",
    "pack_nibbles",
    "quantize_blocks",
    "round_bf16",
    "round_e2m1",
    "round_e2m1_tensor",
    "round_e4m3",
    "round_f16",
    "round_f32",
    "swizzle_offset",
    "unpack_nibbles",
]

# --------------------------------------------------------------------------------------------
# Constants (restated on purpose: no import from the fast path)
# --------------------------------------------------------------------------------------------

BLOCK: int = 16
"""Elements per block scale."""

E2M1_GRID: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 magnitudes by 3-bit index; a code is ``sign << 3 | index``."""

E2M1_MAX: float = 6.0
E4M3_MAX: float = 448.0
CT_ZERO_SCALE: float = 0.125
"""compressed-tensors replaces a zero block scale by this value (the E4M3 'eps')."""

GLOBAL_SCALE_NUMERATOR: float = 448.0 * 6.0
CONVENTIONS: tuple[str, ...] = ("kernel", "compressed-tensors", "modelopt", "llama.cpp")
MODELOPT_MIN_SCALE: float = 2.0**-9
"""ModelOpt clamps every block scale to at least E4M3's smallest subnormal."""

_FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# Scalar rounding to float32 / bfloat16 / float16
# --------------------------------------------------------------------------------------------


def round_f32(value: float) -> float:
    """Round a Python float to the nearest binary32 value (RNE); overflow gives +-inf."""
    if math.isnan(value) or math.isinf(value):
        return value
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _bits_f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def round_bf16(value: float) -> float:
    """Round to bfloat16 the way torch does: to float32 first, then RNE on the f32 bit pattern."""
    v = round_f32(value)
    if math.isnan(v):
        return v
    bits = _f32_bits(v)
    lsb = (bits >> 16) & 1
    bits = ((bits + 0x7FFF + lsb) >> 16) << 16
    return _bits_f32(bits)


def round_f16(value: float) -> float:
    """Round to float16 the way torch does: to float32 first, then RNE to binary16."""
    v = round_f32(value)
    if math.isnan(v) or math.isinf(v):
        return v
    try:
        return struct.unpack("<e", struct.pack("<e", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def narrow(value: float, dtype: torch.dtype) -> float:
    """Round ``value`` (the exact result of one operation) to ``dtype`` as torch's CPU kernels do.

    float32: one RNE rounding. bfloat16/float16: computed in float32, then narrowed (RNE).
    """
    if dtype == torch.float32:
        return round_f32(value)
    if dtype == torch.bfloat16:
        return round_bf16(value)
    if dtype == torch.float16:
        return round_f16(value)
    raise TypeError(f"reference supports float32/bfloat16/float16, got {dtype}")


F32_ONE_SIXTH: float = round_f32(1.0 / 6.0)
"""``1/6`` rounded to float32 (the kernel order multiplies by it)."""


# --------------------------------------------------------------------------------------------
# E2M1
# --------------------------------------------------------------------------------------------


def _nearest_index(magnitude: float, grid: Sequence[float]) -> int:
    """Index of the grid value nearest to ``magnitude`` (grid sorted ascending, magnitude within
    [grid[0], grid[-1]]), exact comparison; a tie goes to the EVEN index."""
    hi = bisect.bisect_left(grid, magnitude)
    if grid[hi] == magnitude:
        return hi
    lo = hi - 1
    d_lo = Fraction(magnitude) - Fraction(grid[lo])
    d_hi = Fraction(grid[hi]) - Fraction(magnitude)
    if d_lo < d_hi:
        return lo
    if d_hi < d_lo:
        return hi
    return lo if lo % 2 == 0 else hi


def round_e2m1(value: float) -> int:
    """Encode one real value as a 4-bit E2M1 code (int in 0..15).

    Clamp to [-6, 6], nearest grid magnitude with ties to the even index (mantissa bit 0),
    sign bit (8) set iff ``value < 0`` (so -0.0 -> 0, -0.1 -> 8). NaN -> ValueError.
    """
    if math.isnan(value):
        raise ValueError("cannot encode NaN as E2M1")
    clamped = min(max(value, -E2M1_MAX), E2M1_MAX)
    index = _nearest_index(abs(clamped), E2M1_GRID)
    return (8 if value < 0 else 0) | index


def decode_e2m1_code(code: int) -> float:
    """Value of a 4-bit E2M1 code; code 8 is -0.0."""
    if not 0 <= code <= 15:
        raise ValueError(f"E2M1 code must be in 0..15, got {code}")
    magnitude = E2M1_GRID[code & 7]
    return -magnitude if code & 8 else magnitude


def round_e2m1_tensor(t: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """Vectorized E2M1 encoding: uint8 codes with ``t``'s shape.

    Works in float64 (exact for every float32/bf16/fp16 input): distance to all 8 grid
    magnitudes, argmin, and when two grid points are equally near the even index wins.
    Distances to the two bracketing grid points are exact in float64 (Sterbenz, grid ratios
    <= 2, or the lower point is 0), so ties are detected exactly. NaN -> ValueError.
    """
    if not t.is_floating_point():
        raise TypeError(f"expected a floating tensor, got {t.dtype}")
    flat = t.detach().reshape(-1).to("cpu", torch.float64)
    if torch.isnan(flat).any():
        raise ValueError("cannot encode NaN as E2M1")
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    out = torch.empty(flat.numel(), dtype=torch.uint8)
    for start in range(0, flat.numel(), chunk):
        v = flat[start : start + chunk]
        mag = v.clamp(-E2M1_MAX, E2M1_MAX).abs()
        dist = (mag[:, None] - grid[None, :]).abs()
        is_min = dist == dist.min(dim=1, keepdim=True).values
        n_min = is_min.sum(dim=1)
        first = is_min.to(torch.uint8).argmax(dim=1)  # lowest index among the nearest
        # two nearest (always adjacent): keep the even one
        tie = n_min == 2
        index = torch.where(tie & (first % 2 == 1), first + 1, first)
        code = index.to(torch.uint8) | torch.where(v < 0, 8, 0).to(torch.uint8)
        out[start : start + chunk] = code
    return out.reshape(t.shape)


def pack_nibbles(codes: Sequence[int]) -> list[int]:
    """Pack 4-bit codes two per byte: element 2i in the low nibble, 2i+1 in the high nibble."""
    if len(codes) % 2:
        raise ValueError(f"need an even number of codes, got {len(codes)}")
    out = []
    for i in range(0, len(codes), 2):
        lo, hi = int(codes[i]), int(codes[i + 1])
        if not (0 <= lo <= 15 and 0 <= hi <= 15):
            raise ValueError(f"codes must be in 0..15, got {lo}, {hi}")
        out.append(lo | (hi << 4))
    return out


def unpack_nibbles(packed: Sequence[int]) -> list[int]:
    """Inverse of :func:`pack_nibbles`."""
    out = []
    for byte in packed:
        out.append(int(byte) & 0x0F)
        out.append((int(byte) >> 4) & 0x0F)
    return out


# --------------------------------------------------------------------------------------------
# E4M3 (float8_e4m3fn)
# --------------------------------------------------------------------------------------------


def decode_e4m3(byte: int) -> float:
    """Value of an E4M3 (fn) byte from its bit fields.

    1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
    (``m/8 * 2**-6``); 0x7F and 0xFF are NaN; no infinities.
    """
    if not 0 <= byte <= 255:
        raise ValueError(f"E4M3 byte must be in 0..255, got {byte}")
    sign = (byte >> 7) & 1
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        magnitude = (mantissa / 8.0) * 2.0 ** (1 - 7)
    else:
        magnitude = (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    return -magnitude if sign else magnitude


_E4M3_POSITIVE: tuple[float, ...] = tuple(decode_e4m3(b) for b in range(0x7F))
"""Non-negative finite E4M3 values by code 0x00..0x7E (strictly increasing)."""


def e4m3_byte(value: float) -> int:
    """The ``float8_e4m3fn`` byte of an E4M3-representable ``value``: the code of its magnitude,
    with the sign bit taken from the sign (so -0.0 gives 0x80). Not representable: ValueError."""
    magnitude = abs(value)
    if magnitude not in _E4M3_POSITIVE:
        raise ValueError(f"{value} is not a finite E4M3 value")
    return _E4M3_POSITIVE.index(magnitude) | (0x80 if math.copysign(1.0, value) < 0 else 0)


def e4m3_finite_values() -> list[float]:
    """All distinct finite E4M3 values, ascending (253 values: +-0 counted once)."""
    values = {decode_e4m3(b) for b in range(256)}
    return sorted(v for v in values if not math.isnan(v))


def round_e4m3(value: float) -> float:
    """Nearest finite E4M3 value, ties to even mantissa (even code). Returns a Python float.

    The caller must clamp to [-448, 448] first (torch's cast does not saturate); values outside
    raise ValueError, as does NaN.
    """
    if math.isnan(value):
        raise ValueError("cannot round NaN to E4M3")
    if abs(value) > E4M3_MAX:
        raise ValueError(f"|{value}| > 448: clamp before rounding to E4M3")
    index = _nearest_index(abs(value), _E4M3_POSITIVE)
    magnitude = _E4M3_POSITIVE[index]
    return -magnitude if value < 0 else magnitude


# --------------------------------------------------------------------------------------------
# Swizzled scale layout
# --------------------------------------------------------------------------------------------


def swizzle_offset(i: int, j: int, cols: int) -> int:
    """Byte offset of scale (i, j) in the 128x4-blocked layout; ``cols`` = unpadded scale cols."""
    tiles_per_row = -(-cols // 4)  # padded_cols / 4
    return (
        ((i // 128) * tiles_per_row + j // 4) * 512
        + (i % 32) * 16
        + ((i % 128) // 32) * 4
        + (j % 4)
    )


# --------------------------------------------------------------------------------------------
# Global scale and block quantization
# --------------------------------------------------------------------------------------------


def _check_convention(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")


def _check_input(x: torch.Tensor) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"reference supports {_FLOAT_DTYPES}, got {x.dtype}")
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("reference requires finite input")


def global_scale(x: torch.Tensor, convention: str = "kernel") -> float:
    """Encode-convention global scale ``~ 2688 / amax(|x|)`` as a float32 value (Python float).

    kernel: ``f32(2688 / amax)`` (one float32 division).
    compressed-tensors: what CT 0.20's ``generate_gparam`` computes: amax (in x.dtype) clamped
    below at ``finfo(x.dtype).tiny``, then ``2688 / amax`` evaluated by torch's
    ``Tensor.__rtruediv__``, i.e. ``reciprocal(amax) * 2688`` with a rounding to x.dtype after
    each of the two operations; then to float32.
    Both: a non-finite result (amax 0 or tiny) gives 1.0; kernel: capped at 2**116.
    llama.cpp: 1.0 (ggml's NVFP4 blocks have no tensor scale).
    """
    _check_convention(convention)
    _check_input(x)
    if convention == "llama.cpp":
        return 1.0
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    if convention == "kernel":
        if amax == 0.0:
            return 1.0
        # nvfp4lab's documented cap (KERNEL_MAX_GLOBAL_SCALE): beyond 2**116 the kernel order's
        # 1 / (s * (1/gs)) can overflow float32, so the automatic scale stops there.
        gs = min(round_f32(GLOBAL_SCALE_NUMERATOR / amax), 2.0**116)
    else:
        amax = max(amax, torch.finfo(x.dtype).tiny)
        reciprocal = narrow(1.0 / amax, x.dtype)
        gs = narrow(reciprocal * GLOBAL_SCALE_NUMERATOR, x.dtype)
    return gs if math.isfinite(gs) else 1.0


def modelopt_decode_scale(x: torch.Tensor) -> float:
    """DECODE-convention tensor scale as ModelOpt 0.47 computes it on the CPU: ``amax / 2688``,
    amax exact (in x.dtype, then float32), one float32 division. An all-zero tensor gets 1.0."""
    _check_input(x)
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    return round_f32(amax / GLOBAL_SCALE_NUMERATOR) if amax > 0 else 1.0


def _block_modelopt(block: list[float], decode: float) -> tuple[list[int], float]:
    """ModelOpt's order for one block, with the DECODE tensor scale ``decode`` (amax/2688)."""
    amax = max(abs(v) for v in block)
    pre = round_f32(amax / round_f32(E2M1_MAX * decode))  # block amax / (6 * decode)
    if pre == 0.0:
        pre = 1.0  # an all-zero block gets scale 1
    scale = round_e4m3(min(max(pre, MODELOPT_MIN_SCALE), E4M3_MAX))
    divisor = round_f32(scale * decode)  # the element divisor: block scale times decode scale
    codes = []
    for v in block:
        scaled = round_f32(v / divisor)
        codes.append(round_e2m1(min(max(scaled, -E2M1_MAX), E2M1_MAX)))
    return codes, scale


#: ggml-common.h ``kvalues_fp4``: the E2M1 values doubled, by 4-bit code.
GGML_KVALUES: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def ggml_fp32_to_ue4m3(x: float) -> int:
    """``ggml_fp32_to_ue4m3`` of ggml-impl.h, statement by statement on a float32 ``x``."""
    if not x > 0.0:  # also NaN
        return 0
    if x > 448.0:
        x = 448.0
    bits = _f32_bits(x)
    fp32_exp = ((bits >> 23) & 0xFF) - 127
    fp32_man = (bits >> 20) & 0x7
    ue4m3_exp = fp32_exp + 7
    if ue4m3_exp <= 0:
        man = int(round_f32(round_f32(x * 512.0) + 0.5))  # C's (int) truncates (x >= 0)
        if man > 7:
            man = 7
        if man < 1:
            return 0
        return man
    if ue4m3_exp >= 15:
        return 0x7E
    round_bit = (bits >> 19) & 1
    ue4m3_man = fp32_man + round_bit
    if ue4m3_man > 7:
        ue4m3_man = 0
        ue4m3_exp += 1
        if ue4m3_exp >= 15:
            return 0x7E
    return (ue4m3_exp << 3) | ue4m3_man


def ggml_ue4m3_to_fp32(byte: int) -> float:
    """``ggml_ue4m3_to_fp32`` of ggml-impl.h: HALF the UE4M3 value (kvalues are doubled); 0x00 and
    0x7F give 0."""
    if byte in (0, 0x7F):
        return 0.0
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    raw = (
        math.ldexp(mantissa, -9)
        if exponent == 0
        else math.ldexp(1.0 + mantissa / 8.0, exponent - 7)
    )
    return round_f32(raw * 0.5)


def _block_llama_cpp(block: list[float], gs: float) -> tuple[list[int], float]:
    """ggml's ``quantize_row_nvfp4_ref`` for one 16-element sub-block of float32 values, the block
    first multiplied by ``gs`` in float32 (1.0: llama.cpp as it is). Returns (codes, the E4M3 value
    of the stored byte)."""
    xb = [round_f32(gs * v) for v in block]
    amax = 0.0
    for v in xb:
        if amax < abs(v):
            amax = abs(v)
    ue = ggml_fp32_to_ue4m3(round_f32(amax / 6.0))
    d = ggml_ue4m3_to_fp32(ue)
    codes = []
    for v in xb:  # best_index_mxfp4(x, d)
        best_index = 0
        best_err = abs(round_f32(round_f32(GGML_KVALUES[0] * d) - v))
        for i in range(1, 16):
            err = abs(round_f32(round_f32(GGML_KVALUES[i] * d) - v))
            if err < best_err:
                best_index = i
                best_err = err
        codes.append(best_index)
    return codes, decode_e4m3(ue)


def _block_kernel(
    block: list[float], gs: float, target: float = E2M1_MAX
) -> tuple[list[int], float]:
    """Kernel order for one block of float32-exact values; returns (codes, scale). ``target`` is
    the value the block max maps to (6 for plain NVFP4, 4 for the max/4 candidate of 4over6)."""
    amax = max(abs(v) for v in block)
    inverse_target = F32_ONE_SIXTH if target == E2M1_MAX else round_f32(1.0 / target)
    pre = round_f32(gs * round_f32(amax * inverse_target))  # step 2
    pre = min(max(pre, -E4M3_MAX), E4M3_MAX)
    scale = round_e4m3(pre)
    # step 3: m = 1 / (s * (1/gs)), and m = 0 where s == 0
    multiplier = 0.0 if scale == 0.0 else round_f32(1.0 / round_f32(scale * round_f32(1.0 / gs)))
    if math.isinf(multiplier) and any(v == 0.0 for v in block):
        # 1 / (s * (1/gs)) overflowed (s * (1/gs) below ~2.9e-39): 0 * inf is NaN, and the
        # kernel order has no defined answer.  Only reachable with float32/bf16 values in the
        # subnormal range or an explicit, very large global scale.
        raise ValueError(
            f"kernel order undefined: block multiplier overflowed (scale={scale}, gs={gs})"
        )
    codes = []
    for v in block:  # step 4 (Python: nonzero * inf = +-inf, clamped to +-6 below)
        scaled = round_f32(v * multiplier)
        codes.append(round_e2m1(min(max(scaled, -E2M1_MAX), E2M1_MAX)))
    return codes, scale


def _block_ct(block: list[float], gs: float, dtype: torch.dtype) -> tuple[list[int], float]:
    """compressed-tensors order for one block (values exact in ``dtype``)."""
    amax = max(abs(v) for v in block)  # exact in dtype
    local = narrow(amax / 6.0, dtype)  # amax / 6 in the input dtype
    pre = round_f32(gs * local)  # float32 global scale * dtype scale -> float32
    pre = min(max(pre, -E4M3_MAX), E4M3_MAX)
    scale = round_e4m3(pre)
    if scale == 0.0:
        scale = CT_ZERO_SCALE
    divisor = round_f32(scale / gs)
    codes = []
    for v in block:
        scaled = round_f32(v / divisor)
        codes.append(round_e2m1(min(max(scaled, -E2M1_MAX), E2M1_MAX)))
    return codes, scale


def quantize_blocks(
    x: torch.Tensor, global_scale: float, convention: str = "kernel"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [..., K] (K a multiple of 16; float32/bfloat16/float16, finite).

    ``global_scale``: the tensor scale in the form the convention's arithmetic is written in,
    used as a float32 value: ENCODE (``2688 / amax``) for "kernel" and "compressed-tensors",
    DECODE (``amax / 2688``, ModelOpt's ``weight_scale_2``) for "modelopt"; for "llama.cpp" an
    ENCODE factor the elements are multiplied by first (1.0: ggml's quantizer as it is).
    Returns ``(codes, scales)``: codes uint8 [..., K] (unpacked 4-bit codes), scales float32
    [..., K/16] holding E4M3-representable values. Runs on CPU; slow (pure Python loops).
    """
    _check_convention(convention)
    _check_input(x)
    if x.ndim == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"last dim must be a multiple of {BLOCK}, got shape {tuple(x.shape)}")
    gs = round_f32(float(global_scale))
    if not (math.isfinite(gs) and gs > 0):
        raise ValueError(f"global_scale must be finite and > 0, got {global_scale}")
    k = x.shape[-1]
    if x.numel() == 0:
        return (
            torch.zeros(x.shape, dtype=torch.uint8),
            torch.zeros(*x.shape[:-1], k // BLOCK, dtype=torch.float32),
        )
    rows = x.detach().to("cpu").reshape(-1, k).to(torch.float64).tolist()
    codes_out: list[list[int]] = []
    scales_out: list[list[float]] = []
    for row in rows:
        row_codes: list[int] = []
        row_scales: list[float] = []
        for start in range(0, k, BLOCK):
            block = row[start : start + BLOCK]
            if convention == "kernel":
                codes, scale = _block_kernel(block, gs)
            elif convention == "modelopt":
                codes, scale = _block_modelopt(block, gs)
            elif convention == "llama.cpp":
                codes, scale = _block_llama_cpp(block, gs)
            else:
                codes, scale = _block_ct(block, gs, x.dtype)
            row_codes.extend(codes)
            row_scales.append(scale)
        codes_out.append(row_codes)
        scales_out.append(row_scales)
    codes_t = torch.tensor(codes_out, dtype=torch.uint8).reshape(x.shape)
    scales_t = torch.tensor(scales_out, dtype=torch.float32).reshape(*x.shape[:-1], k // BLOCK)
    return codes_t, scales_t


def dequantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, global_scale: float, convention: str = "kernel"
) -> torch.Tensor:
    """float32 [..., K]: ``value(code) * f32(s / gs)`` per element, in float32 arithmetic; for
    "modelopt" ``value(code) * f32(s * decode)`` with ``global_scale`` the DECODE scale.

    ``codes`` uint8 [..., K]; ``scales`` [..., K/16] (any float dtype holding E4M3 values).
    """
    _check_convention(convention)
    if codes.shape[:-1] != scales.shape[:-1] or codes.shape[-1] != scales.shape[-1] * BLOCK:
        raise ValueError(
            f"shape mismatch: codes {tuple(codes.shape)}, scales {tuple(scales.shape)}"
        )
    gs = round_f32(float(global_scale))
    k = codes.shape[-1]
    if codes.numel() == 0:
        return torch.zeros(codes.shape, dtype=torch.float32)
    code_rows = codes.reshape(-1, k).tolist()
    scale_rows = scales.detach().to(torch.float64).reshape(-1, k // BLOCK).tolist()
    out: list[list[float]] = []
    for code_row, scale_row in zip(code_rows, scale_rows, strict=True):
        values = []
        for j, code in enumerate(code_row):
            s_b = scale_row[j // BLOCK]
            factor = round_f32(s_b * gs) if convention == "modelopt" else round_f32(s_b / gs)
            values.append(round_f32(decode_e2m1_code(int(code)) * factor))
        out.append(values)
    return torch.tensor(out, dtype=torch.float32).reshape(codes.shape)


# --------------------------------------------------------------------------------------------
# KV cache: vLLM 0.33's --kv-cache-dtype nvfp4 / nvfp4_4over6 / fp8 (docs/kv_cache.md)
# --------------------------------------------------------------------------------------------

KV_KINDS: tuple[str, ...] = ("nvfp4", "nvfp4_4over6", "fp8")
"""The KV-cache kinds this oracle writes (vLLM's ``--kv-cache-dtype`` values)."""

KV_MAX_ENCODE_SCALE: float = 2.0**116
"""Largest ENCODE scale ``1/decode`` the NVFP4 write accepts (the kernel order's cap)."""


def _kv_decode_scale(decode_scale: float) -> float:
    """``decode_scale`` as the float32 value vLLM keeps in ``layer._k_scale`` (checked)."""
    d = round_f32(float(decode_scale))
    if not (math.isfinite(d) and d > 0):
        raise ValueError(f"KV decode scale must be finite and > 0, got {decode_scale}")
    return d


def kv_encode_scale(decode_scale: float) -> float:
    """The ENCODE scale the NVFP4 write multiplies by: ``f32(1 / f32(decode_scale))`` (the CUDA
    writer's ``1.0f / *k_scale_ptr``)."""
    return round_f32(1.0 / _kv_decode_scale(decode_scale))


def _check_kv_input(x: torch.Tensor) -> None:
    _check_input(x)
    if x.ndim == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"last dim must be a multiple of {BLOCK}, got shape {tuple(x.shape)}")


def _rows(x: torch.Tensor) -> list[list[float]]:
    return x.detach().to("cpu").reshape(-1, x.shape[-1]).to(torch.float64).tolist()


def _kv_read_value(code: int, scale: float, decode: float) -> float:
    """What attention reads for one NVFP4 element: ``f32(value * s * decode)``; ``value * s`` is
    exact (2 x 4 significand bits) and so is its product with a float32 ``decode`` in binary64,
    so one rounding to float32 gives ``f32(f32(value * s) * decode)``."""
    return round_f32(decode_e2m1_code(code) * scale * decode)


def _kv_block_error(block: list[float], codes: list[int], scale: float, decode: float) -> float:
    """Squared reconstruction error of one block in float32: ``e = f32(x - read)``, ``acc =
    f32(acc + f32(e * e))``, summed element 0 to 15 in order."""
    acc = 0.0
    for v, code in zip(block, codes, strict=True):
        e = round_f32(v - _kv_read_value(code, scale, decode))
        acc = round_f32(acc + round_f32(e * e))
    return acc


def _kv_block_nvfp4(
    block: list[float], decode: float, four_over_six: bool
) -> tuple[list[int], float]:
    """One 16-value block of an NVFP4 KV write: the kernel order at ``gs = f32(1/decode)``; with
    ``four_over_six`` also the max -> 4 candidate, kept only when its error is strictly lower
    (a tie keeps max -> 6, the plain NVFP4 choice)."""
    gs = round_f32(1.0 / decode)
    codes6, scale6 = _block_kernel(block, gs, E2M1_MAX)
    if not four_over_six:
        return codes6, scale6
    codes4, scale4 = _block_kernel(block, gs, 4.0)
    err6 = _kv_block_error(block, codes6, scale6, decode)
    err4 = _kv_block_error(block, codes4, scale4, decode)
    return (codes4, scale4) if err4 < err6 else (codes6, scale6)


def kv_quantize_nvfp4(
    x: torch.Tensor, decode_scale: float, four_over_six: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 KV write of ``x [..., D]`` (D a multiple of 16; float32/bfloat16/float16, finite).

    ``decode_scale``: vLLM's ``k_scale`` / ``v_scale`` (values read back as ``code * s *
    decode``); the write uses ``gs = f32(1/decode)``, which must not exceed 2**116.
    Returns ``(codes, scales)``: codes uint8 [..., D] (4-bit, unpacked), scales float32
    [..., D/16] holding E4M3 values. Pure Python loops: slow.
    """
    _check_kv_input(x)
    decode = _kv_decode_scale(decode_scale)
    if round_f32(1.0 / decode) > KV_MAX_ENCODE_SCALE:
        raise ValueError(f"KV decode scale {decode_scale} is below 2**-116")
    d = x.shape[-1]
    codes_out: list[list[int]] = []
    scales_out: list[list[float]] = []
    for row in _rows(x):
        row_codes: list[int] = []
        row_scales: list[float] = []
        for start in range(0, d, BLOCK):
            codes, scale = _kv_block_nvfp4(row[start : start + BLOCK], decode, four_over_six)
            row_codes.extend(codes)
            row_scales.append(scale)
        codes_out.append(row_codes)
        scales_out.append(row_scales)
    codes_t = torch.tensor(codes_out, dtype=torch.uint8).reshape(x.shape)
    scales_t = torch.tensor(scales_out, dtype=torch.float32).reshape(*x.shape[:-1], d // BLOCK)
    return codes_t, scales_t


def kv_read_nvfp4(codes: torch.Tensor, scales: torch.Tensor, decode_scale: float) -> torch.Tensor:
    """float32 [..., D]: ``f32(value(code) * s * decode)`` per element (the NVFP4 KV read)."""
    decode = _kv_decode_scale(decode_scale)
    d = codes.shape[-1]
    code_rows = codes.reshape(-1, d).tolist()
    scale_rows = scales.detach().to(torch.float64).reshape(-1, d // BLOCK).tolist()
    out = [
        [_kv_read_value(int(c), s_row[j // BLOCK], decode) for j, c in enumerate(c_row)]
        for c_row, s_row in zip(code_rows, scale_rows, strict=True)
    ]
    return torch.tensor(out, dtype=torch.float32).reshape(codes.shape)


def _kv_fp8_value(v: float, decode: float) -> float:
    """One FP8 KV write: ``f32(v / decode)``, saturated to +-448, nearest E4M3 (ties to even),
    the sign kept (so -0.0 and values rounding to zero from below give -0.0)."""
    q = min(max(round_f32(v / decode), -E4M3_MAX), E4M3_MAX)
    return math.copysign(round_e4m3(q), q)


def kv_quantize_fp8(x: torch.Tensor, decode_scale: float) -> torch.Tensor:
    """FP8 (E4M3) KV write of ``x [..., D]``: float32 E4M3 values of ``f32(x / decode)``
    saturated to +-448 (vLLM's ``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, E4M3)``)."""
    _check_input(x)
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension")
    decode = _kv_decode_scale(decode_scale)
    out = [[_kv_fp8_value(v, decode) for v in row] for row in _rows(x)]
    return torch.tensor(out, dtype=torch.float32).reshape(x.shape)


def kv_read_fp8(values: torch.Tensor, decode_scale: float) -> torch.Tensor:
    """float32: ``f32(e4m3 value * decode)`` per element."""
    decode = _kv_decode_scale(decode_scale)
    flat = values.detach().to(torch.float64).reshape(-1).tolist()
    return torch.tensor([round_f32(v * decode) for v in flat], dtype=torch.float32).reshape(
        values.shape
    )


def kv_fake_quantize(x: torch.Tensor, kind: str, decode_scale: float) -> torch.Tensor:
    """What attention reads back after a KV write of ``x`` (``kind`` one of ``KV_KINDS``), in
    ``x.dtype``: the float32 read rounded once (RNE) to ``x.dtype``."""
    if kind not in KV_KINDS:
        raise ValueError(f"kind must be one of {KV_KINDS}, got {kind!r}")
    if kind == "fp8":
        read = kv_read_fp8(kv_quantize_fp8(x, decode_scale), decode_scale)
    else:
        codes, scales = kv_quantize_nvfp4(x, decode_scale, four_over_six=kind != "nvfp4")
        read = kv_read_nvfp4(codes, scales, decode_scale)
    flat = [narrow(v, x.dtype) for v in read.to(torch.float64).reshape(-1).tolist()]
    return torch.tensor(flat, dtype=torch.float64).reshape(x.shape).to(x.dtype)


def kv_page_bytes(codes: Sequence[Sequence[int]], scales: Sequence[Sequence[float]]) -> list[int]:
    """The bytes of one NVFP4 page side (K or V) holding ``codes`` (one list of D 4-bit codes per
    row, rows in memory order) and their ``scales`` (D/16 E4M3 values per row): every row's
    packed codes (low nibble first) one row after another, then every row's scale bytes."""
    out: list[int] = []
    for row in codes:
        out.extend(pack_nibbles(row))
    for row in scales:
        out.extend(e4m3_byte(v) for v in row)
    return out
