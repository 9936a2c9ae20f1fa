"""Slow, readable oracle of NVFP4 block quantization in each arithmetic order.

One job: the tensor scale, the block scales and the codes of a tensor, and their decode, in the
four orders nvfp4lab implements, written independently of the fast path from each order's source
(the facts are restated in ``docs/nvfp4-format.md``) so that tests compare the two bit for bit.
It imports nothing from the package outside :mod:`nvfp4lab.oracles` (the scalar arithmetic
is :mod:`nvfp4lab.oracles.numbers`); block quantization loops over 16-element blocks in
Python, favouring obviousness over speed.

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

Also the byte offset of a scale in CUTLASS's swizzled layout (:func:`swizzle_offset`).
"""

from __future__ import annotations

import math

import torch

from nvfp4lab.oracles.numbers import (
    BLOCK,
    E2M1_MAX,
    E4M3_MAX,
    F32_ONE_SIXTH,
    check_input,
    decode_e2m1_code,
    decode_e4m3,
    f32_bits,
    narrow,
    round_e2m1,
    round_e4m3,
    round_f32,
)

__all__ = [
    "CONVENTIONS",
    "CT_ZERO_SCALE",
    "GGML_KVALUES",
    "GLOBAL_SCALE_NUMERATOR",
    "MODELOPT_MIN_SCALE",
    "dequantize_blocks",
    "ggml_fp32_to_ue4m3",
    "ggml_ue4m3_to_fp32",
    "global_scale",
    "modelopt_decode_scale",
    "quantize_blocks",
    "swizzle_offset",
]

CT_ZERO_SCALE: float = 0.125
"""compressed-tensors replaces a zero block scale by this value (the E4M3 'eps')."""

GLOBAL_SCALE_NUMERATOR: float = 448.0 * 6.0
CONVENTIONS: tuple[str, ...] = ("kernel", "compressed-tensors", "modelopt", "llama.cpp")
MODELOPT_MIN_SCALE: float = 2.0**-9
"""ModelOpt clamps every block scale to at least E4M3's smallest subnormal."""


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
    check_input(x)
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
    """DECODE-form tensor scale as ModelOpt 0.47 computes it on the CPU: ``amax / 2688``,
    amax exact (in x.dtype, then float32), one float32 division. An all-zero tensor gets 1.0."""
    check_input(x)
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
    bits = f32_bits(x)
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
    check_input(x)
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
