"""The input side every quantizer shares: the input check, the amax of the finite values (with
the NaN/Inf refusal) and the cut of ``[..., K]`` into blocks or 2-D tiles.

One job: what a quantization does to its input before any arithmetic. :mod:`nvfp4lab.codec` (NVFP4)
and the study formats of :mod:`nvfp4lab.number_formats` (MXFP4, INT4-g128, ...) call it; it names no
format's arithmetic. Shapes: ``x [..., K]`` (fp32/bf16/fp16); blocks ``[..., K/B, B]``; tiles of
a 2-D ``[M, K]`` as ``[M/r, K/c, r*c]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nvfp4lab.options import NVFP4Options, block_shape
from nvfp4lab.scales import abs_max
from nvfp4lab.vocab import NonFinite, check_dtype

__all__ = [
    "check_geometry",
    "check_input",
    "finite_amax",
    "from_blocks",
    "split_blocks",
    "to_blocks",
]


def check_input(x: torch.Tensor, what: str = "x") -> None:
    """TypeError/ValueError unless ``x`` is a ≥1-d fp32/bf16/fp16 tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    check_dtype(x.dtype, f"NVFP4 quantization input {what} (dtype)")
    if x.ndim == 0:
        raise ValueError(f"{what} must have at least one dimension (the K axis), got a 0-d tensor")


def finite_amax(
    x: torch.Tensor, nonfinite: str = NonFinite.RAISE, *, fix: str | None = None
) -> torch.Tensor:
    """``abs_max(x)`` of the finite values (0-d, x.dtype); raises under ``nonfinite="raise"``
    when ``x`` holds NaN/Inf, naming the count, the first index and ``fix`` (the remedy).

    One ``aminmax`` pass in the common all-finite case (NaN and Inf propagate into it).
    """
    amax = abs_max(x)
    if x.is_meta or bool(torch.isfinite(amax)):
        return amax
    finite = torch.isfinite(x)
    if nonfinite == NonFinite.RAISE:
        bad = ~finite
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"input of shape {tuple(x.shape)} holds {int(bad.sum())} NaN/Inf value(s), first at "
            f"index {first} (value {x[first].item()}); "
            + (fix or "clean the input, or pass nonfinite='propagate' to quantize it anyway "
               "(NaN blocks get NaN scales)")
        )
    return abs_max(torch.where(finite, x, 0))  # NaN/Inf must not set the finite values' scale


def split_blocks(
    x: torch.Tensor, block_size: int, pad: bool = False, what: str = "NVFP4"
) -> torch.Tensor:
    """View ``x [..., K]`` as ``[..., K/block, block]``, zero-padding K when ``pad``.

    A K that is not a multiple of ``block_size`` without ``pad`` raises ValueError naming the
    shape, the format ``what`` and the fix.
    """
    block_shape(block_size)
    if not isinstance(pad, bool):
        raise ValueError(f"pad must be True or False, got {pad!r}")
    k = x.shape[-1]
    if k % block_size:
        if not pad:
            raise ValueError(
                f"{what}: the last dimension K={k} of shape {tuple(x.shape)} is not a multiple "
                f"of {block_size}; pass pad=True to zero-pad K to "
                f"{-(-k // block_size) * block_size}"
            )
        x = F.pad(x, (0, -k % block_size))
    return x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


def to_blocks(x: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``[..., K]`` → ``[..., K/c, c]`` for ``(1, c)``; ``[M, K]`` → ``[M/r, K/c, r·c]`` tiles."""
    rows, cols = shape
    if rows == 1:
        return x.reshape(*x.shape[:-1], x.shape[-1] // cols, cols)
    m, k = x.shape
    tiles = x.reshape(m // rows, rows, k // cols, cols).permute(0, 2, 1, 3)
    return tiles.reshape(m // rows, k // cols, rows * cols)


def from_blocks(values: torch.Tensor, like: torch.Size, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`to_blocks`, back to the shape ``like``."""
    rows, cols = shape
    if rows == 1:
        return values.reshape(like)
    m, k = like
    tiles = values.reshape(m // rows, k // cols, rows, cols).permute(0, 2, 1, 3)
    return tiles.reshape(m, k)


def check_geometry(x: torch.Tensor, opts: NVFP4Options) -> None:
    """ValueError unless ``x``'s shape fits ``opts.block_shape``: 2-D tiles need ``[M, K]`` with
    M and K multiples of the tile, 1-D blocks a K that is a multiple of the block or ``pad``."""
    rows, cols = opts.block_shape
    if rows > 1 and (x.ndim != 2 or x.shape[0] % rows or x.shape[1] % cols):
        raise ValueError(
            f"block_size {opts.block_shape} needs a 2-D tensor [M, K] with M a multiple of "
            f"{rows} and K of {cols}, got shape {tuple(x.shape)}"
        )
    k = x.shape[-1]
    if rows == 1 and k % cols and not opts.pad:
        raise ValueError(
            f"NVFP4: the last dimension K={k} of shape {tuple(x.shape)} is not a multiple of "
            f"{cols}; pass pad=True to zero-pad K to {-(-k // cols) * cols}"
        )

