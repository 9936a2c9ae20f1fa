"""The swizzled ("blocked") block-scale layout of CUTLASS / cuBLASLt / ``torch._scaled_mm``.

The plain layout is row-major ``[rows, cols]`` (``cols = K / 16``). The blocked
layout pads rows to a multiple of 128 and cols to a multiple of 4 with zeros,
then stores each 128x4 tile as 512 contiguous bytes, tiles row-tile-major. For
scale ``(i, j)`` with ``C = padded_cols / 4`` tiles per row::

    offset = ((i // 128) * C + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + (j % 4)

One job: this layout, both ways (:func:`swizzle_scales`, :func:`unswizzle_scales`). The GGUF /
ggml NVFP4 block layout moved to :mod:`nvfp4lab.ggml_blocks`; ``to_ggml_nvfp4`` and
``from_ggml_nvfp4`` still import from here (deprecated aliases, for one release).
"""

from __future__ import annotations

import torch

from nvfp4lab.constants import SWIZZLE_COLS, SWIZZLE_ROWS
from nvfp4lab.ggml_blocks import from_ggml_nvfp4, to_ggml_nvfp4  # deprecated aliases

__all__ = [
    "from_ggml_nvfp4",
    "padded_scale_shape",
    "swizzle_scales",
    "swizzled_offset",
    "to_ggml_nvfp4",
    "unswizzle_scales",
]

_SUBROWS = 32  # a 128-row tile is 4 interleaved groups of 32 rows


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape ``(ceil(rows/128)*128, ceil(cols/4)*4)`` of the blocked layout."""
    return _ceil_to(rows, SWIZZLE_ROWS), _ceil_to(cols, SWIZZLE_COLS)


def swizzled_offset(i: int, j: int, cols: int) -> int:
    """Byte offset of plain scale ``(i, j)`` in the blocked layout of ``[*, cols]`` scales."""
    tiles_per_row = _ceil_to(cols, SWIZZLE_COLS) // SWIZZLE_COLS
    tile = (i // SWIZZLE_ROWS) * tiles_per_row + j // SWIZZLE_COLS
    within = (i % _SUBROWS) * 16 + ((i % SWIZZLE_ROWS) // _SUBROWS) * 4 + (j % SWIZZLE_COLS)
    return tile * SWIZZLE_ROWS * SWIZZLE_COLS + within


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a 1-byte tensor as uint8 (copy kernels exist for uint8 on every device)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Plain scales ``[rows, cols]`` (or ``[..., cols]``, leading dims flattened) -> blocked 2-D.

    Returns a tensor of shape ``padded_scale_shape(rows, cols)`` and the input's dtype whose
    row-major bytes are the 128x4 blocked layout; padding entries are zero. Leading dims are
    flattened into one row space (one GEMM operand); for a batch of operands, e.g. MoE experts
    ``[E, N, K/16]`` whose rows vLLM pads per expert, swizzle each ``scales[e]`` separately.
    """
    if scales.ndim == 0:
        raise ValueError("swizzle_scales needs a [rows, cols] tensor, got a 0-d tensor")
    plain = scales.reshape(-1, scales.shape[-1]) if scales.ndim != 2 else scales
    rows, cols = plain.shape
    padded_rows, padded_cols = padded_scale_shape(rows, cols)
    src = _as_bytes(plain)
    padded = src.new_zeros((padded_rows, padded_cols))
    padded[:rows, :cols] = src
    # (row tile, 4 groups of 32 rows, 32, col tile, 4) -> (row tile, col tile, 32, 4 groups, 4)
    tiles = padded.view(
        padded_rows // SWIZZLE_ROWS, 4, _SUBROWS, padded_cols // SWIZZLE_COLS, SWIZZLE_COLS
    )
    blocked = tiles.permute(0, 3, 2, 1, 4).reshape(padded_rows, padded_cols)
    return blocked.view(scales.dtype) if blocked.dtype != scales.dtype else blocked


def unswizzle_scales(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Exact inverse of :func:`swizzle_scales`: blocked layout -> plain ``[rows, cols]``.

    ``blocked`` may be 2-D of the padded shape or 1-D of its element count.
    """
    padded_rows, padded_cols = padded_scale_shape(rows, cols)
    if blocked.numel() != padded_rows * padded_cols:
        raise ValueError(
            f"a blocked layout for {rows}x{cols} scales holds {padded_rows}x{padded_cols} = "
            f"{padded_rows * padded_cols} entries, got shape {tuple(blocked.shape)}; pass the "
            "rows/cols of the plain scale matrix (K/16 columns)"
        )
    src = _as_bytes(blocked).reshape(
        padded_rows // SWIZZLE_ROWS, padded_cols // SWIZZLE_COLS, _SUBROWS, 4, SWIZZLE_COLS
    )
    plain = src.permute(0, 3, 2, 1, 4).reshape(padded_rows, padded_cols)[:rows, :cols]
    plain = plain.contiguous()
    return plain.view(blocked.dtype) if plain.dtype != blocked.dtype else plain
