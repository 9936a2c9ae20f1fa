"""Slow, readable oracle of the KV cache as vLLM 0.33 writes and reads it (``--kv-cache-dtype``;
docs/kv_cache.md).

One job: the KV write and read, written from vLLM's source independently of
:mod:`nvfp4lab.execution.kv_cache`: ``kv_quantize_nvfp4`` (``nvfp4`` and ``nvfp4_4over6``),
``kv_quantize_fp8``, ``kv_read_nvfp4`` / ``kv_read_fp8``, ``kv_fake_quantize`` and
``kv_page_bytes`` (the bytes of one page side), all in the DECODE scale vLLM stores as
``k_scale`` / ``v_scale``. The NVFP4 write is the kernel order of :mod:`nvfp4lab.oracles.nvfp4`
at ``gs = 1 / decode``. Imports nothing from the package outside :mod:`nvfp4lab.oracles`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from nvfp4lab.oracles.numbers import (
    BLOCK,
    E2M1_MAX,
    E4M3_MAX,
    check_input,
    decode_e2m1_code,
    e4m3_byte,
    narrow,
    pack_nibbles,
    round_e4m3,
    round_f32,
)
from nvfp4lab.oracles.nvfp4 import _block_kernel  # the kernel order, with a max -> 4 target

__all__ = [
    "KV_KINDS",
    "KV_MAX_ENCODE_SCALE",
    "kv_encode_scale",
    "kv_fake_quantize",
    "kv_page_bytes",
    "kv_quantize_fp8",
    "kv_quantize_nvfp4",
    "kv_read_fp8",
    "kv_read_nvfp4",
]

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
    check_input(x)
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
    check_input(x)
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
