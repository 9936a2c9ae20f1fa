"""Slow, readable oracle of llama.cpp's CPU arithmetic for NVFP4 weights (ggml type 40).

One job: llama.cpp's CPU matmul arithmetic (Q8_0 activations, the NVFP4 x Q8_0 dot), written
from llama.cpp's source (llama.cpp@0c1e57098, the copy llama-cpp-python 0.3.36 vendors),
independently of :mod:`nvfp4lab.execution.ggml_cpu`; like every oracle it imports nothing from
the package. Every float32 / float16 operation is done exactly on ``fractions.Fraction``
values and rounded once, to nearest even, by integer arithmetic (:func:`round_binary`), so a
fused multiply-add is one rounding and a product or a sum another.

* :func:`quantize_q8_0` - ``quantize_row_q8_0`` of ggml-cpu/arch/x86/quants.c (AVX/AVX2): per 32
  values ``amax``, ``d = amax / 127.f`` stored as fp16, ``id = 127.f / amax`` (0 when amax is 0),
  codes ``x * id`` rounded half to even (``_mm256_round_ps(.., _MM_ROUND_NEAREST)``).
* :func:`quantize_q8_0_ref` - ``quantize_row_q8_0_ref`` of ggml-quants.c (what
  ``ggml_quantize_chunk`` runs): ``id = 1.0f / d`` and ``roundf`` (half away from zero).
* :func:`vec_dot_nvfp4_q8_0` - ``ggml_vec_dot_nvfp4_q8_0`` of ggml-cpu/arch/x86/quants.c
  (``__AVX2__``): 8 float lanes, lane ``l`` of each Q8_0 block the integer sum of values
  ``4l .. 4l+3``, scaled by ``UE4M3(d_sub) * d_q8`` (sub-block ``l // 4`` of that block) and added
  with one FMA; then ``hsum_float_8``.
* :func:`vec_dot_nvfp4_q8_0_generic` - ``ggml_vec_dot_nvfp4_q8_0_generic`` of ggml-cpu/quants.c:
  per 16-value sub-block ``sumf += dy * d * (sumi_lo + sumi_hi)``, three roundings (a build
  without FMA contraction).
* :func:`ue4m3` - ``ggml_ue4m3_to_fp32`` (ggml-impl.h): the UE4M3 byte's value HALVED; 0 and
  0x7F read as 0; the sign bit ignored. The codes are doubled (``kvalues_mxfp4``: 0, 1, 2, 3, 4,
  6, 8, 12, sign in bit 3), so ``kvalue * ue4m3`` is the E2M1 value times the E4M3 scale.

Inputs are lists of Python floats holding float32 values (``tensor.tolist()``), E2M1 codes in
logical order (value ``i`` of a row is code ``i``) and scale bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

__all__ = [
    "KVALUES",
    "quantize_q8_0",
    "quantize_q8_0_ref",
    "round_binary",
    "round_f16",
    "round_f32",
    "ue4m3",
    "vec_dot_nvfp4_q8_0",
    "vec_dot_nvfp4_q8_0_generic",
]

#: ``kvalues_mxfp4`` (ggml-common.h): E2M1 code -> twice its value.
KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def round_binary(
    value: Fraction, mantissa_bits: int, min_exponent: int, max_exponent: int
) -> float:
    """``value`` rounded to nearest (ties to even) in a binary format with ``mantissa_bits``
    significand bits (the implicit one included), normal exponents ``min_exponent ..
    max_exponent`` and subnormals below; +-inf past the largest finite value."""
    if value == 0:
        return 0.0
    sign = -1 if value < 0 else 1
    a = abs(value)
    exponent = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** exponent > a:
        exponent -= 1  # now 2^exponent <= a < 2^(exponent + 1)
    exponent = max(exponent, min_exponent)  # subnormals share the smallest normal's quantum
    quantum = Fraction(2) ** (exponent - (mantissa_bits - 1))
    steps = round(a / quantum)  # Fraction.__round__: half to even
    largest = (2 - Fraction(2) ** (1 - mantissa_bits)) * Fraction(2) ** max_exponent
    result = steps * quantum
    if result > largest:
        return sign * float("inf")
    return sign * float(result)


def round_f32(value: Fraction | float | int) -> float:
    """IEEE binary32, round to nearest even."""
    return round_binary(Fraction(value), 24, -126, 127)


def round_f16(value: Fraction | float | int) -> float:
    """IEEE binary16, round to nearest even (``_cvtss_sh(x, 0)``, F16C)."""
    return round_binary(Fraction(value), 11, -14, 15)


def _half_even(value: float) -> int:
    return round(Fraction(value))


def _half_away(value: float) -> int:
    f = Fraction(value)
    n = int(abs(f) + Fraction(1, 2))  # floor(|x| + 1/2): C roundf
    return n if f >= 0 else -n


def quantize_q8_0(xs: Sequence[float]) -> tuple[list[int], list[float]]:
    """x86 ``quantize_row_q8_0`` of one row (len a multiple of 32): (codes, fp16 d per block)."""
    codes: list[int] = []
    scales: list[float] = []
    for start in range(0, len(xs), 32):
        block = xs[start : start + 32]
        amax = max(abs(v) for v in block)
        d = round_f32(Fraction(amax) / 127)
        scales.append(round_f16(d))
        inv = round_f32(Fraction(127) / Fraction(amax)) if amax != 0 else 0.0
        for v in block:
            q = _half_even(round_f32(Fraction(v) * Fraction(inv)))
            codes.append(max(-128, min(127, q)))
    return codes, scales


def quantize_q8_0_ref(xs: Sequence[float]) -> tuple[list[int], list[float]]:
    """``quantize_row_q8_0_ref`` (ggml-quants.c) of one row: ``id = 1/d``, ``roundf``."""
    codes: list[int] = []
    scales: list[float] = []
    for start in range(0, len(xs), 32):
        block = xs[start : start + 32]
        amax = max(abs(v) for v in block)
        d = round_f32(Fraction(amax) / 127)
        scales.append(round_f16(d))
        inv = round_f32(1 / Fraction(d)) if d != 0 else 0.0
        codes += [_half_away(round_f32(Fraction(v) * Fraction(inv))) for v in block]
    return codes, scales


def ue4m3(byte: int) -> float:
    """``ggml_ue4m3_to_fp32``: the halved UE4M3 value of a scale byte."""
    if byte in (0, 0x7F):
        return 0.0
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    if exponent == 0:
        raw = Fraction(mantissa, 512)
    else:
        raw = (1 + Fraction(mantissa, 8)) * Fraction(2) ** (exponent - 7)
    return float(raw / 2)


def vec_dot_nvfp4_q8_0(
    codes: Sequence[int], scale_bytes: Sequence[int], q8: Sequence[int], q8_scales: Sequence[float]
) -> float:
    """One weight row (``codes`` K E2M1 codes, ``scale_bytes`` K/16) dotted with one Q8_0 row
    (``q8`` K int8 codes, ``q8_scales`` K/32 fp16 values) in the AVX2 order."""
    lanes = [0.0] * 8
    for ib in range(len(codes) // 64):
        for half in range(2):  # the two Q8_0 blocks of the 64 values
            block = 2 * ib + half
            dy = q8_scales[block]
            for lane in range(8):
                sub = 4 * ib + 2 * half + lane // 4
                s = round_f32(Fraction(ue4m3(scale_bytes[sub])) * Fraction(dy))
                first = 32 * block + 4 * lane
                total = sum(KVALUES[codes[i]] * q8[i] for i in range(first, first + 4))
                lanes[lane] = round_f32(Fraction(s) * total + Fraction(lanes[lane]))  # FMA
    pairs = [round_f32(Fraction(lanes[i + 4]) + Fraction(lanes[i])) for i in range(4)]
    left = round_f32(Fraction(pairs[0]) + Fraction(pairs[2]))
    right = round_f32(Fraction(pairs[1]) + Fraction(pairs[3]))
    return round_f32(Fraction(left) + Fraction(right))


def vec_dot_nvfp4_q8_0_generic(
    codes: Sequence[int], scale_bytes: Sequence[int], q8: Sequence[int], q8_scales: Sequence[float]
) -> float:
    """The same dot in ``ggml_vec_dot_nvfp4_q8_0_generic``'s order (no FMA contraction)."""
    total = 0.0
    for sub in range(len(codes) // 16):
        d = ue4m3(scale_bytes[sub])
        dy = q8_scales[sub // 2]
        sumi = sum(KVALUES[codes[i]] * q8[i] for i in range(16 * sub, 16 * sub + 16))
        scale = round_f32(Fraction(dy) * Fraction(d))
        total = round_f32(Fraction(total) + Fraction(round_f32(Fraction(scale) * sumi)))
    return total
