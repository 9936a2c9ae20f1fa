"""The GGUF / ggml NVFP4 block layout (ggml type 40): 36 bytes per 64 elements, the four E4M3
scale bytes of its 16-element sub-blocks unchanged, then the codes repacked.

One job: converting between nvfp4lab's packing (``e2m1.pack_fp4`` codes ``[..., K/2]``, E4M3
scales ``[..., K/16]``) and ggml's blocks, both ways, exactly (:func:`to_ggml_nvfp4`,
:func:`from_ggml_nvfp4`). The GGUF checkpoint format and llama.cpp's CPU arithmetic read and write
through it; CUTLASS's swizzled scale layout is :mod:`nvfp4lab.layout`'s.
"""

from __future__ import annotations

import torch

from nvfp4lab.constants import BLOCK_SIZE, GGML_NVFP4_BLOCK, GGML_NVFP4_BLOCK_BYTES

__all__ = ["from_ggml_nvfp4", "to_ggml_nvfp4"]

# ---------------------------------------------------------------------------------------------
# GGUF / ggml NVFP4 blocks (ggml type 40)
# ---------------------------------------------------------------------------------------------
#
# Source: llama.cpp ggml/src/ggml-common.h ``block_nvfp4`` (``uint8_t d[4]`` then
# ``uint8_t qs[32]``, QK_NVFP4 = 64, QK_NVFP4_SUB = 16) and ggml-quants.c
# ``quantize_row_nvfp4_ref`` / ``dequantize_row_nvfp4`` (``qs[s*8 + j]`` holds element ``j`` of
# sub-block ``s`` in its low nibble and element ``j + 8`` in its high nibble), at
# ggml-org/llama.cpp@0c1e57098bba (the commit llama-cpp-python 0.3.36 vendors); PR #19769.
# ``ggml_ue4m3_to_fp32`` (ggml-impl.h) reads a scale byte as unsigned E4M3 (bias 7) and returns
# byte 0x7F as 0; the nibble indexes ``kvalues_fp4`` = E2M1 doubled with the scale halved, so a
# nibble is exactly nvfp4lab's E2M1 code (bit 3 = sign) and value = E4M3(byte) * E2M1(code).

_SUB_BLOCKS = GGML_NVFP4_BLOCK // BLOCK_SIZE  # 4 scale bytes per 64-element block
_HALF = BLOCK_SIZE // 2  # 8: byte j of a sub-block holds elements j and j + 8


def _ggml_k_error(what: str, k: int) -> ValueError:
    return ValueError(
        f"{what} K = {k}, not a multiple of {GGML_NVFP4_BLOCK}: GGUF NVFP4 stores blocks of "
        f"{GGML_NVFP4_BLOCK} elements; pad K to a multiple of {GGML_NVFP4_BLOCK}"
    )


def _check_scale_bytes(raw: torch.Tensor, where: str) -> None:
    """Refuse scale bytes whose UE4M3 (ggml) and E4M3 (torch) meanings differ.

    ggml reads the low 7 bits only and returns 0x7F as 0; E4M3 reads 0x7F / 0xFF as NaN and the
    top bit as the sign. So 0x7F, 0xFF and any other byte with the sign bit set on a nonzero
    magnitude decode to different values on the two sides; ``0x80`` (E4M3 -0.0) is zero on both
    and is kept as it is.
    """
    if not raw.numel():
        return
    bad = ((raw & 0x7F) == 0x7F) | ((raw & 0x80).bool() & ((raw & 0x7F) != 0))
    if bool(bad.any()):
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        byte = int(raw[first])
        raise ValueError(
            f"{where} holds {int(bad.sum())} scale byte(s) that UE4M3 (ggml) and E4M3 read as "
            f"different values (first at index {first}: 0x{byte:02x}; ggml decodes 0x7F as 0 "
            "and ignores the sign bit); NVFP4 block scales are finite and non-negative, "
            "requantize the source"
        )


def to_ggml_nvfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """nvfp4lab's packing -> GGUF NVFP4 blocks, uint8 ``[..., (K/64)*36]``.

    ``codes``: uint8 ``[..., K/2]`` in nvfp4lab's packing (``e2m1.pack_fp4``: element ``2i`` in
    the low nibble, ``2i+1`` in the high one); ``scales``: ``torch.float8_e4m3fn`` (or its uint8
    bytes) ``[..., K/16]``. Each 64 elements become 36 bytes: the 4 scale bytes of its 16-element
    sub-blocks, unchanged (UE4M3 = E4M3 with sign 0, the same bits), then 8 bytes per sub-block
    with element ``j`` in the low nibble and ``j + 8`` in the high one (layout: the comment above,
    llama.cpp ggml-common.h ``block_nvfp4`` @0c1e57098bba). The E2M1 codes are kept as they are.
    There is no tensor scale in a block: GGUF stores it beside the tensor. ValueError for K not a
    multiple of 64, mismatched shapes, or a scale byte whose meaning differs between UE4M3 and
    E4M3 (0x7F, 0xFF, a negative nonzero scale; ``-0.0`` is kept, ggml reads it as 0).
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"to_ggml_nvfp4 expects uint8 packed codes, got dtype {codes.dtype}")
    if scales.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(
            f"to_ggml_nvfp4 expects torch.float8_e4m3fn scales, got dtype {scales.dtype}"
        )
    if codes.ndim == 0 or scales.ndim != codes.ndim or codes.shape[:-1] != scales.shape[:-1]:
        raise ValueError(
            f"to_ggml_nvfp4 shapes do not match: codes {tuple(codes.shape)} must be [..., K/2] "
            f"and scales {tuple(scales.shape)} [..., K/16] with the same leading dims"
        )
    k = 2 * codes.shape[-1]
    if k != scales.shape[-1] * BLOCK_SIZE:
        raise ValueError(
            f"to_ggml_nvfp4 shapes do not match: codes {tuple(codes.shape)} hold {k} elements per "
            f"row but scales {tuple(scales.shape)} cover {scales.shape[-1] * BLOCK_SIZE}"
        )
    if k % GGML_NVFP4_BLOCK:
        raise _ggml_k_error("to_ggml_nvfp4 got", k)
    raw = scales if scales.dtype == torch.uint8 else scales.view(torch.uint8)
    _check_scale_bytes(raw, "to_ggml_nvfp4's scales")
    lead, blocks = codes.shape[:-1], k // GGML_NVFP4_BLOCK
    # nvfp4lab bytes hold elements (2i, 2i+1); unpack to one code per element
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1)
    nibbles = nibbles.reshape(*lead, blocks, _SUB_BLOCKS, 2, _HALF)
    qs = nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)  # [..., blocks, 4, 8]
    d = raw.reshape(*lead, blocks, _SUB_BLOCKS)
    out = torch.cat((d, qs.reshape(*lead, blocks, _SUB_BLOCKS * _HALF)), dim=-1)
    return out.reshape(*lead, blocks * GGML_NVFP4_BLOCK_BYTES)


def from_ggml_nvfp4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF NVFP4 blocks uint8 ``[..., (K/64)*36]`` -> (codes, scales), the exact inverse.

    Returns ``codes`` uint8 ``[..., K/2]`` in nvfp4lab's packing and ``scales``
    ``torch.float8_e4m3fn`` ``[..., K/16]`` with the block's scale bytes unchanged (layout:
    :func:`to_ggml_nvfp4`). ValueError for a last dimension not a multiple of 36, or a scale
    byte that ggml and E4M3 read differently (0x7F is 0 to ggml and NaN to E4M3; a set sign bit
    on a nonzero magnitude is ignored by ggml): nvfp4lab could not hold its value exactly.
    """
    if blocks.dtype != torch.uint8:
        raise TypeError(f"from_ggml_nvfp4 expects uint8 GGUF blocks, got dtype {blocks.dtype}")
    if blocks.ndim == 0 or blocks.shape[-1] % GGML_NVFP4_BLOCK_BYTES:
        raise ValueError(
            f"from_ggml_nvfp4 needs [..., (K/{GGML_NVFP4_BLOCK})*{GGML_NVFP4_BLOCK_BYTES}] bytes, "
            f"got shape {tuple(blocks.shape)}; the last dimension is not a multiple of "
            f"{GGML_NVFP4_BLOCK_BYTES} (K must be a multiple of {GGML_NVFP4_BLOCK})"
        )
    lead, n = blocks.shape[:-1], blocks.shape[-1] // GGML_NVFP4_BLOCK_BYTES
    split = blocks.reshape(*lead, n, GGML_NVFP4_BLOCK_BYTES)
    d = split[..., :_SUB_BLOCKS]
    _check_scale_bytes(d, "from_ggml_nvfp4's blocks")
    qs = split[..., _SUB_BLOCKS:].reshape(*lead, n, _SUB_BLOCKS, 1, _HALF)
    nibbles = torch.cat((qs & 0xF, qs >> 4), dim=-2)  # [..., n, 4, 2, 8]: elements j, j + 8
    nibbles = nibbles.reshape(*lead, n * GGML_NVFP4_BLOCK // 2, 2)
    codes = nibbles[..., 0] | (nibbles[..., 1] << 4)
    scales = d.reshape(*lead, n * _SUB_BLOCKS).contiguous().view(torch.float8_e4m3fn)
    return codes, scales
