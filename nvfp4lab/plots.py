"""The one plotting style of nvfp4lab: the style sheet, a figure factory, saving.

matplotlib is imported inside the functions, so ``import nvfp4lab.plots`` stays light. Every
figure of a study comes from :func:`new_figure` (title and axis labels with units are required)
and is returned to the caller to display or save. The style lives in
``nvfp4lab/nvfp4lab.mplstyle``. The figures themselves belong to the studies
(:mod:`nvfp4lab.studies`).
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

__all__ = [
    "STYLE_PATH",
    "as_numpy",
    "new_figure",
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


def as_numpy(t: torch.Tensor | Sequence[float]) -> Any:
    """float64 numpy array of a tensor (any device) or a sequence of numbers."""
    import numpy as np

    if hasattr(t, "detach"):
        return t.detach().cpu().double().numpy()
    return np.asarray(t, dtype=np.float64)
