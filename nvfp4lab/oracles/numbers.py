"""Slow, readable oracle of the number formats NVFP4 is built from: float32 / bfloat16 / float16
rounding, E2M1 and E4M3 values and codes, and 4-bit nibble packing.

One job: the scalar arithmetic the block oracles (:mod:`nvfp4lab.oracles.nvfp4`,
:mod:`nvfp4lab.oracles.kv_cache`) are written in. Like every oracle it imports nothing from the
package outside :mod:`nvfp4lab.oracles`: the format's facts are restated here on purpose
(``docs/nvfp4-format.md``).

* E2M1 and E4M3 rounding are nearest-value searches over the list of representable values,
  with exact (``fractions.Fraction``) distance comparisons and an explicit tie rule.
* Float32 arithmetic is emulated with Python floats (IEEE binary64) rounded to binary32 after
  EACH operation.  For a single ``+ - * /`` on binary32 operands this equals the IEEE binary32
  result, because binary64 has more than ``2 * 24 + 2`` significand bits (double rounding is
  innocuous).  bfloat16 / float16 operations are emulated the way torch computes them on CPU:
  the float32 result rounded (RNE) to the narrow type.
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
    "E2M1_GRID",
    "E2M1_MAX",
    "E4M3_MAX",
    "F32_ONE_SIXTH",
    "check_input",
    "decode_e2m1_code",
    "decode_e4m3",
    "e4m3_byte",
    "e4m3_finite_values",
    "f32_bits",
    "narrow",
    "pack_nibbles",
    "round_bf16",
    "round_e2m1",
    "round_e2m1_tensor",
    "round_e4m3",
    "round_f16",
    "round_f32",
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


def f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _bits_f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def round_bf16(value: float) -> float:
    """Round to bfloat16 the way torch does: to float32 first, then RNE on the f32 bit pattern."""
    v = round_f32(value)
    if math.isnan(v):
        return v
    bits = f32_bits(v)
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


def check_input(x: torch.Tensor) -> None:
    """Refuse a tensor the oracles do not take: a dtype other than float32/bfloat16/float16
    (TypeError) or a non-finite value (ValueError)."""
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"reference supports {_FLOAT_DTYPES}, got {x.dtype}")
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("reference requires finite input")

