"""The one plotting style of nvfp4lab, and the figures the notebooks share.

matplotlib is imported inside the functions, so ``import nvfp4lab.plots`` stays light. Every
figure function returns the ``Figure`` with a title and axis labels (with units) already set;
callers display or save it. The style lives in ``nvfp4lab/nvfp4lab.mplstyle``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from nvfp4lab.tour import RoundingCurve

__all__ = [
    "STYLE_PATH",
    "new_figure",
    "plot_block_nmse_hist",
    "plot_e2m1_rounding",
    "plot_e4m3_grid",
    "plot_swizzle_offsets",
    "save_figure",
    "style_context",
    "use_style",
]

#: The shipped matplotlib style sheet.
STYLE_PATH: Path = Path(__file__).with_name("nvfp4lab.mplstyle")


def use_style() -> None:
    """Apply the nvfp4lab style globally (call once in a notebook's config cell)."""
    import matplotlib.pyplot as plt

    plt.style.use(str(STYLE_PATH))


@contextmanager
def style_context() -> Iterator[None]:
    """``with style_context(): ...`` applies the nvfp4lab style inside the block only."""
    import matplotlib.pyplot as plt

    with plt.style.context(str(STYLE_PATH)):
        yield


def new_figure(
    title: str,
    xlabel: str,
    ylabel: str,
    *,
    figsize: tuple[float, float] | None = None,
    **subplot_kw: Any,
) -> tuple[Figure, Axes]:
    """A new figure with one axes whose title and axis labels are set.

    Put units in the labels, e.g. ``"block scale (unitless, log scale)"``.
    """
    import matplotlib.pyplot as plt

    if not (title and xlabel and ylabel):
        raise ValueError(
            f"every nvfp4lab figure needs a title and both axis labels, got title={title!r}, "
            f"xlabel={xlabel!r}, ylabel={ylabel!r}"
        )
    fig, ax = plt.subplots(figsize=figsize, subplot_kw=subplot_kw or None)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return fig, ax


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Save ``fig`` (format from the suffix, e.g. ``.png``), creating parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def _numpy(t: torch.Tensor | Sequence[float]) -> Any:
    import numpy as np

    if hasattr(t, "detach"):
        return t.detach().cpu().double().numpy()
    return np.asarray(t, dtype=np.float64)


def plot_e2m1_rounding(curve: RoundingCurve) -> Figure:
    """Input vs E2M1 value (RNE, saturating at ±6), ties marked where they land."""
    x, y = _numpy(curve.x), _numpy(curve.rounded)
    fig, ax = new_figure(
        "E2M1 rounding: round to nearest, ties to even, saturate at ±6",
        "input x (units of the block scale)",
        "E2M1 value (units of the block scale)",
    )
    ax.plot(x, x, linestyle="--", linewidth=0.8, color="0.6", label="y = x (no rounding)")
    ax.plot(x, y, drawstyle="steps-mid", label="round_E2M1(x)")
    ax.scatter(
        _numpy(curve.tie_x), _numpy(curve.tie_rounded), zorder=3, color="C1",
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

    from nvfp4lab.constants import E4M3_MAX, E4M3_MIN_NORMAL

    v = _numpy(values)
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
    from nvfp4lab.constants import SWIZZLE_COLS, SWIZZLE_ROWS

    grid = _numpy(offsets)
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

    v = _numpy(block_nmse).reshape(-1)
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
