"""Helpers behind ``notebooks/01_format_tour.ipynb``: small, pure views of the NVFP4 format.

Nothing here plots or prints; the notebook turns these results into tables (pandas) and figures
(:mod:`nvfp4lab.plots`). Every function works on CPU tensors and is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nvfp4lab.constants import BLOCK_SIZE, E2M1_VALUES

__all__ = [
    "BlockWalkthrough",
    "RoundingCurve",
    "block_walkthrough",
    "e2m1_round",
    "e2m1_rounding_curve",
    "e2m1_tie_points",
    "e4m3_positive_values",
    "swizzle_offset_grid",
]


@dataclass(frozen=True)
class RoundingCurve:
    """Inputs ``x`` (float32 ``[n]``) and their E2M1 values ``rounded`` (float32 ``[n]``),
    plus the tie points inside the range (``tie_x``) and where RNE sends them (``tie_rounded``).
    All in units of the block scale (i.e. the value handed to the element codec)."""

    x: torch.Tensor
    rounded: torch.Tensor
    tie_x: torch.Tensor
    tie_rounded: torch.Tensor


def _round_values(values: torch.Tensor) -> torch.Tensor:
    from nvfp4lab.e2m1 import decode_e2m1, encode_e2m1

    return decode_e2m1(encode_e2m1(values.to(torch.float32)), torch.float32)


def e2m1_round(value: float) -> float:
    """The E2M1 value (RNE, saturating at ±6) of one Python float."""
    return float(_round_values(torch.tensor([value], dtype=torch.float32))[0])


def e2m1_tie_points() -> torch.Tensor:
    """float32 ``[14]``: the midpoints between neighbouring E2M1 magnitudes, both signs, sorted."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    mids = (mags[1:] + mags[:-1]) / 2
    return torch.cat([-mids.flip(0), mids])


def e2m1_rounding_curve(lo: float = -7.0, hi: float = 7.0, points: int = 2801) -> RoundingCurve:
    """E2M1 rounding of ``points`` evenly spaced inputs over ``[lo, hi]`` (values past ±6 saturate).

    The default grid (step 0.005) contains every tie point exactly.
    """
    if not (hi > lo and points >= 2):
        raise ValueError(f"need lo < hi and points >= 2, got lo={lo}, hi={hi}, points={points}")
    x = torch.linspace(lo, hi, points, dtype=torch.float64).to(torch.float32)
    ties = e2m1_tie_points()
    ties = ties[(ties >= lo) & (ties <= hi)]
    return RoundingCurve(x=x, rounded=_round_values(x), tie_x=ties, tie_rounded=_round_values(ties))


def e4m3_positive_values() -> torch.Tensor:
    """float32 ``[126]``: every positive finite FP8 E4M3 (``float8_e4m3fn``) value, ascending.

    Bit patterns 0x01..0x7E; 0x01..0x07 are subnormal (2^-9 .. 7·2^-9), 0x7E is 448, 0x7F is NaN.
    """
    bits = torch.arange(1, 0x7F, dtype=torch.uint8)
    return bits.view(torch.float8_e4m3fn).to(torch.float32)


@dataclass(frozen=True)
class BlockWalkthrough:
    """One block through the kernel-order arithmetic (see ``nvfp4-format.md``), step by step.

    Tensors are 1-D over the block's elements. ``global_scale`` is the ENCODE convention
    (``2688 / amax_tensor``); the decode factor of the block is ``block_scale / global_scale``.
    """

    values: torch.Tensor  # float32 [B] inputs
    global_scale: float  # encode convention
    amax: float  # max |x| over the block
    block_scale: float  # the E4M3 block scale, as a float
    block_scale_bits: int  # its FP8 bit pattern (0..126)
    scaled: torch.Tensor  # float32 [B] x * (global_scale / block_scale): what the codec rounds
    codes: torch.Tensor  # uint8 [B] E2M1 codes
    packed: torch.Tensor  # uint8 [B/2] two codes per byte, element 2i in the low nibble
    dequantized: torch.Tensor  # float32 [B] value(code) * block_scale / global_scale

    @property
    def packed_hex(self) -> str:
        """The packed bytes as hex, in memory order (e.g. ``"71 0A ..."``)."""
        return " ".join(f"{int(b):02X}" for b in self.packed)

    def table(self) -> dict[str, list[object]]:
        """Per-element columns (for ``pandas.DataFrame(walk.table())``)."""
        from nvfp4lab.e2m1 import decode_e2m1

        values = decode_e2m1(self.codes, torch.float32)
        return {
            "x": [float(v) for v in self.values],
            "x·gs/s (scaled)": [float(v) for v in self.scaled],
            "code": [int(c) for c in self.codes],
            "bits s|ee|m": [f"{int(c) >> 3:b}|{(int(c) >> 1) & 3:02b}|{int(c) & 1:b}"
                             for c in self.codes],
            "E2M1 value": [float(v) for v in values],
            "x̂ (dequantized)": [float(v) for v in self.dequantized],
            "x̂ − x": [float(d - v) for d, v in zip(self.dequantized, self.values, strict=True)],
        }

    def summary(self) -> dict[str, object]:
        """Block-level facts (for a small two-column table)."""
        return {
            "amax of block": self.amax,
            "global scale gs (encode, 2688/amax_tensor)": self.global_scale,
            "block scale s = e4m3(gs·amax/6)": self.block_scale,
            "block scale bits": f"0x{self.block_scale_bits:02X}",
            "decode factor s/gs": self.block_scale / self.global_scale,
            "packed bytes (hex)": self.packed_hex,
        }


def block_walkthrough(
    values: torch.Tensor, global_scale: float | torch.Tensor | None = None
) -> BlockWalkthrough:
    """Quantize one block of ``BLOCK_SIZE`` values (float, 1-D) and keep every intermediate.

    ``global_scale`` (encode convention) defaults to ``compute_global_scale(values)``; pass the
    scale of the tensor the block came from to see a typical (non-448) block scale.
    """
    from nvfp4lab.quantize import compute_global_scale, quantize

    x = values.detach().to(torch.float32).reshape(-1)
    if x.numel() != BLOCK_SIZE:
        raise ValueError(f"block_walkthrough takes one block of {BLOCK_SIZE} values, got "
                         f"{x.numel()}; slice one block, e.g. x[0, :{BLOCK_SIZE}]")
    gs = compute_global_scale(x) if global_scale is None else global_scale
    q = quantize(x.reshape(1, -1), torch.as_tensor(gs, dtype=torch.float32).reshape(1))
    gs_value = float(q.global_scale)
    scale = q.scales.reshape(-1)[:1]
    block_scale = float(scale.to(torch.float32))
    # Kernel order: multiply by the reciprocal of the decode factor (0 for an all-zero block).
    multiplier = 0.0 if block_scale == 0 else 1.0 / (block_scale * (1.0 / gs_value))
    return BlockWalkthrough(
        values=x,
        global_scale=gs_value,
        amax=float(x.abs().max()),
        block_scale=block_scale,
        block_scale_bits=int(scale.view(torch.uint8)[0]),
        scaled=x * torch.tensor(multiplier, dtype=torch.float32),
        codes=q.codes().reshape(-1),
        packed=q.packed.reshape(-1),
        dequantized=q.dequantize(torch.float32).reshape(-1),
    )


def swizzle_offset_grid(rows: int = 256, cols: int = 8) -> torch.Tensor:
    """int64 ``[rows, cols]``: for plain scale ``(i, j)``, its byte offset in the 128x4 blocked
    layout, found by running :func:`nvfp4lab.layout.swizzle_scales` on an index matrix."""
    from nvfp4lab.layout import swizzle_scales

    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be >= 1, got {rows}x{cols}")
    index = torch.arange(1, rows * cols + 1, dtype=torch.int64).reshape(rows, cols)
    blocked = swizzle_scales(index).reshape(-1)  # 0 marks padding
    filled = blocked > 0
    offsets = torch.empty(rows * cols, dtype=torch.int64)
    offsets[blocked[filled] - 1] = torch.arange(blocked.numel(), dtype=torch.int64)[filled]
    return offsets.reshape(rows, cols)

