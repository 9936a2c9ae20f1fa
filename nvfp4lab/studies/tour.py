"""The study behind ``notebooks/01_format_tour.ipynb``: small, pure views of the NVFP4 format,
their figures, and the rounding explorer.

The view functions work on CPU tensors and are deterministic; the ``plot_*`` functions return
figures (matplotlib imported inside them); :func:`rounding_explorer` is the notebook's widget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nvfp4lab.codec import compute_global_scale, quantize
from nvfp4lab.constants import (
    BLOCK_SIZE,
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    SWIZZLE_COLS,
    SWIZZLE_ROWS,
)
from nvfp4lab.e2m1 import decode_e2m1, encode_e2m1
from nvfp4lab.layout import swizzle_scales
from nvfp4lab.plots import as_numpy, new_figure
from nvfp4lab.studies.explorer import explorer, text_output

if TYPE_CHECKING:  # pragma: no cover
    import ipywidgets
    from matplotlib.figure import Figure

__all__ = [
    "BlockWalkthrough",
    "RoundingCurve",
    "RoundingInfo",
    "block_walkthrough",
    "e2m1_round",
    "e2m1_rounding_curve",
    "e2m1_tie_points",
    "e4m3_positive_values",
    "plot_block_nmse_hist",
    "plot_e2m1_rounding",
    "plot_e4m3_grid",
    "plot_swizzle_offsets",
    "rounding_explorer",
    "rounding_info",
    "rounding_text",
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

    Tensors are 1-D over the block's elements. ``global_scale`` is the ENCODE form
    (``2688 / amax_tensor``); the decode factor of the block is ``block_scale / global_scale``.
    """

    values: torch.Tensor  # float32 [B] inputs
    global_scale: float  # encode form
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

    ``global_scale`` (encode form) defaults to ``compute_global_scale(values)``; pass the
    scale of the tensor the block came from to see a typical (non-448) block scale.
    """

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

    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be >= 1, got {rows}x{cols}")
    index = torch.arange(1, rows * cols + 1, dtype=torch.int64).reshape(rows, cols)
    blocked = swizzle_scales(index).reshape(-1)  # 0 marks padding
    filled = blocked > 0
    offsets = torch.empty(rows * cols, dtype=torch.int64)
    offsets[blocked[filled] - 1] = torch.arange(blocked.numel(), dtype=torch.int64)[filled]
    return offsets.reshape(rows, cols)


# --------------------------------------------------------------------------------------------
# figures


def plot_e2m1_rounding(curve: RoundingCurve) -> Figure:
    """Input vs E2M1 value (RNE, saturating at ±6), ties marked where they land."""
    x, y = as_numpy(curve.x), as_numpy(curve.rounded)
    fig, ax = new_figure(
        "E2M1 rounding: round to nearest, ties to even, saturate at ±6",
        "input x (units of the block scale)",
        "E2M1 value (units of the block scale)",
    )
    ax.plot(x, x, linestyle="--", linewidth=0.8, color="0.6", label="y = x (no rounding)")
    ax.plot(x, y, drawstyle="steps-mid", label="round_E2M1(x)")
    ax.scatter(
        as_numpy(curve.tie_x), as_numpy(curve.tie_rounded), zorder=3, color="C1",
        label="tie points (go to the even code)",
    )
    ax.axvspan(6.0, max(6.0, float(x.max())), color="C2", alpha=0.12, label="saturates (|x| > 6)")
    ax.axvspan(min(-6.0, float(x.min())), -6.0, color="C2", alpha=0.12)
    ax.set_xlim(float(x.min()), float(x.max()))
    ax.legend(loc="upper left")
    return fig


def plot_e4m3_grid(values: torch.Tensor | Sequence[float]) -> Figure:
    """Every positive finite E4M3 value on a log axis, against its bit pattern."""
    import numpy as np


    v = as_numpy(values)
    codes = np.arange(1, v.size + 1)
    sub = v < E4M3_MIN_NORMAL
    fig, ax = new_figure(
        f"FP8 E4M3 block-scale grid: {v.size} positive finite values",
        "scale value (unitless multiplier, log₂ axis)",
        "bit pattern (code 0x01–0x7E)",
    )
    ax.set_xscale("log", base=2)
    ax.scatter(v[~sub], codes[~sub], s=10, label="normal (8 values per binade)")
    ax.scatter(v[sub], codes[sub], s=10, color="C1", label="subnormal (spacing 2⁻⁹)")
    ax.axvline(E4M3_MIN_NORMAL, color="0.5", linestyle=":", linewidth=1)
    ax.axvline(E4M3_MAX, color="C3", linestyle="--", linewidth=1, label="max 448")
    ax.legend(loc="upper left")
    return fig


def plot_swizzle_offsets(offsets: torch.Tensor) -> Figure:
    """Heatmap of the blocked-layout byte offset of every plain scale ``(i, j)``."""

    grid = as_numpy(offsets)
    rows, cols = grid.shape
    fig, ax = new_figure(
        f"128×4 blocked scale layout: byte offset of scale (i, j), {rows}×{cols} scales",
        "scale column j (16-element block along K)",
        "scale row i (output row)",
        figsize=(6.0, 5.0),
    )
    ax.grid(False)
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                      extent=(-0.5, cols - 0.5, rows - 0.5, -0.5))
    fig.colorbar(image, ax=ax, label="offset in blocked layout (bytes)")
    for r in range(32, rows, 32):
        ax.axhline(r - 0.5, color="w", linewidth=1.6 if r % SWIZZLE_ROWS == 0 else 0.4)
    for c in range(SWIZZLE_COLS, cols, SWIZZLE_COLS):
        ax.axvline(c - 0.5, color="w", linewidth=1.6)
    return fig


def plot_block_nmse_hist(
    block_nmse: torch.Tensor | Sequence[float], *, tensor_nmse: float | None = None
) -> Figure:
    """Histogram of per-block NMSE (log-spaced bins), with the tensor-level NMSE marked."""
    import numpy as np

    v = as_numpy(block_nmse).reshape(-1)
    v = v[np.isfinite(v) & (v > 0)]
    if v.size == 0:
        raise ValueError("no finite, positive per-block NMSE to plot")
    fig, ax = new_figure(
        f"Per-block NMSE over {v.size} blocks of 16",
        "block NMSE ‖x̂−x‖² / ‖x‖² (unitless, log scale)",
        "blocks (count)",
    )
    lo, hi = float(v.min()), float(v.max())
    bins = np.geomspace(lo, hi * 1.0001, 50) if hi > lo else 10
    ax.hist(v, bins=bins)
    ax.set_xscale("log")
    if tensor_nmse is not None:
        ax.axvline(tensor_nmse, color="C1", linestyle="--",
                   label=f"whole tensor: {tensor_nmse:.2e}")
        ax.legend(loc="upper left")
    return fig


# --------------------------------------------------------------------------------------------
# explorer

#: The signed E2M1 grid, ascending, with one zero: -6 .. -0.5, 0, 0.5 .. 6.
_GRID: tuple[float, ...] = (*(-v for v in reversed(E2M1_VALUES[1:])), *E2M1_VALUES)


@dataclass(frozen=True)
class RoundingInfo:
    """Where one value lands: ``scaled = x / block_scale`` is what the element codec rounds.

    ``lower``/``upper`` are the signed grid points bracketing ``scaled`` (clamped to ±6), equal
    when it sits on a grid point; ``tie`` is True at their midpoint; ``element`` is the E2M1
    value of ``code`` (-0.0 for code 8) and ``dequantized = element * block_scale``.
    """

    x: float
    block_scale: float
    scaled: float
    lower: float
    upper: float
    tie: bool
    saturated: bool
    code: int
    element: float
    dequantized: float


def rounding_info(x: float, block_scale: float = 1.0) -> RoundingInfo:
    """E2M1 rounding of ``x`` in a block with decode scale ``block_scale`` (global scale 1)."""

    if not (math.isfinite(x) and math.isfinite(block_scale) and block_scale > 0):
        raise ValueError(
            f"need a finite x and a finite block_scale > 0, got x={x}, block_scale={block_scale}"
        )
    scaled = x / block_scale
    clamped = min(max(scaled, -E2M1_MAX), E2M1_MAX)
    lower = max(g for g in _GRID if g <= clamped)
    upper = min(g for g in _GRID if g >= clamped)
    # float64 rounds without a narrowing step, so ties stay ties
    code = int(encode_e2m1(torch.tensor([scaled], dtype=torch.float64))[0])
    element = float(decode_e2m1(torch.tensor([code], dtype=torch.uint8), torch.float64)[0])
    return RoundingInfo(
        x=x,
        block_scale=block_scale,
        scaled=scaled,
        lower=lower,
        upper=upper,
        tie=lower != upper and clamped == (lower + upper) / 2,
        saturated=abs(scaled) > E2M1_MAX,
        code=code,
        element=element,
        dequantized=element * block_scale,
    )


def rounding_text(x: float, block_scale: float = 1.0) -> str:
    """What :func:`rounding_explorer` shows for one value and block scale."""
    r = rounding_info(x, block_scale)
    lines = [f"x = {r.x:+.4g} with block scale s = {r.block_scale:g}  →  x/s = {r.scaled:+.6g}"]
    if r.saturated:
        lines.append(f"beyond ±{E2M1_MAX:g}: saturates to {r.element:+g}")
    elif r.lower == r.upper:
        i = _GRID.index(r.lower)
        below = f"{_GRID[i - 1]:+g}" if i > 0 else "none"
        above = f"{_GRID[i + 1]:+g}" if i + 1 < len(_GRID) else "none"
        lines.append(f"on the grid point {r.lower:+g} (neighbours {below} and {above})")
    else:
        mid = (r.lower + r.upper) / 2
        where = "a tie, so it rounds to the even code" if r.tie else (
            "rounds down" if r.element == r.lower else "rounds up")
        lines.append(
            f"between grid points {r.lower:+g} and {r.upper:+g} (midpoint {mid:+g}): {where}"
        )
    c = r.code
    bits = f"{c >> 3:b}|{(c >> 1) & 3:02b}|{c & 1:b}"
    zero = " (negative zero)" if c == 8 else ""
    lines.append(f"E2M1 {r.element:+g}  →  code {c} = 0b{c:04b}, s|ee|m {bits}{zero}")
    lines.append(
        f"dequantized x̂ = E2M1·s = {r.dequantized:+.6g}, error x̂ − x = {r.dequantized - r.x:+.4g}"
    )
    return "\n".join(lines)


def rounding_explorer(value: float = 1.25, block_scale: float = 1.0) -> ipywidgets.VBox:
    """A value slider and an E4M3 block-scale slider → the value's E2M1 rounding, its code and
    the neighbouring grid points (notebook 01). ``block_scale`` snaps to the nearest E4M3 value."""
    import ipywidgets as widgets

    scales = [float(s) for s in e4m3_positive_values()]
    snapped = min(scales, key=lambda s: abs(s - block_scale))
    x = widgets.FloatSlider(
        value=value, min=-7.0, max=7.0, step=0.05, description="x", readout_format="+.2f"
    )
    s = widgets.SelectionSlider(
        options=[(f"{v:g}", v) for v in scales], value=snapped, description="block scale s"
    )
    return explorer(widgets, [x, s], lambda: (text_output(
        rounding_text(x.value, s.value), f"Where x = {x.value:+.2f} lands at block scale s = "
        f"{s.value:g}: x/s on the E2M1 grid, its code and x̂"),))
