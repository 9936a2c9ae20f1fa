"""The one plotting style of nvfp4lab: the style sheet, a figure factory, saving.

matplotlib is imported inside the functions, so ``import nvfp4lab.plots`` stays light. Every
figure of a study comes from :func:`new_figure` (title and axis labels with units are required)
and is returned to the caller to display or save. The style lives in
``nvfp4lab/nvfp4lab.mplstyle``. The figures themselves belong to the studies
(:mod:`nvfp4lab.studies`).

Two rules every figure follows: a legend never covers data the text asks the reader to look at
(:func:`legend_outside` puts it right of or below the axes), and every figure shown in a notebook
carries alt text (:func:`alt_text`, derived from its titles and axis labels), which
:func:`use_style` attaches to the ``image/png`` output's metadata and the report pages write
into the ``<img alt>`` attribute (:mod:`nvfp4lab.report.pages`).
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
    "alt_text",
    "as_numpy",
    "install_alt_text",
    "legend_outside",
    "log_if_wide",
    "new_figure",
    "save_figure",
    "style_context",
    "use_style",
]

#: The shipped matplotlib style sheet.
STYLE_PATH: Path = Path(__file__).with_name("nvfp4lab.mplstyle")


def use_style() -> None:
    """Apply the nvfp4lab style globally (call once in a notebook's config cell); inside an
    IPython kernel also :func:`install_alt_text`."""
    import matplotlib.pyplot as plt

    plt.style.use(str(STYLE_PATH))
    install_alt_text()


def alt_text(fig: Figure) -> str:
    """A one-line description of ``fig`` for readers who cannot see it: its suptitle, then each
    titled or labelled axes as ``title (y: ylabel; x: xlabel)``, colour bars included."""
    parts = []
    suptitle = fig.get_suptitle()
    if suptitle:
        parts.append(suptitle)
    for ax in fig.axes:
        title = " ".join(t for t in (ax.get_title("left"), ax.get_title(), ax.get_title("right"))
                         if t)
        labels = "; ".join(f"{k}: {v}" for k, v in (("y", ax.get_ylabel()), ("x", ax.get_xlabel()))
                           if v)
        if title or labels:
            parts.append(f"{title} ({labels})" if title and labels else title or labels)
    text = ". ".join(" ".join(p.split()) for p in parts)  # newlines in titles become spaces
    return f"Figure: {text}" if text else "Figure without a title"


def install_alt_text() -> bool:
    """Make every matplotlib figure an IPython kernel displays carry ``{"image/png": {"alt":
    alt_text(fig)}}`` in its output metadata (wrapping the kernel's PNG formatter for
    ``Figure``, once). Returns False outside IPython or when no PNG formatter is registered."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with the notebooks extra
        return False
    shell = get_ipython()
    if shell is None:
        return False
    import matplotlib
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    formatter = shell.display_formatter.formatters["image/png"]
    try:
        printer = formatter.lookup_by_type(Figure)
    except KeyError:  # the backend loads lazily: the inline one registers its formatters then
        if plt.get_fignums():
            return False  # switching the backend would close these figures
        plt.switch_backend(matplotlib.get_backend())
        try:
            printer = formatter.lookup_by_type(Figure)
        except KeyError:
            return False
    if getattr(printer, "_nvfp4lab_alt", False):
        return True

    def png_with_alt(fig: Figure) -> Any:
        data = printer(fig)
        return None if data is None else (data, {"alt": alt_text(fig)})

    png_with_alt._nvfp4lab_alt = True  # type: ignore[attr-defined]
    formatter.for_type(Figure, png_with_alt)
    return True


def legend_outside(ax: Axes, **kwargs: Any) -> Any:
    """The legend of ``ax`` beside the axes, off the data (its upper left corner at the axes'
    upper right corner; constrained layout makes room for it). Returns the legend."""
    kwargs.setdefault("loc", "upper left")
    kwargs.setdefault("bbox_to_anchor", (1.01, 1.0))
    return ax.legend(**kwargs)


def log_if_wide(ax: Axes, values: Sequence[float], *, axis: str = "y", span: float = 10.0) -> bool:
    """Put ``axis`` ("x" or "y") of ``ax`` on a log scale only when the positive ``values`` span
    at least ``span`` times (a log axis over a few percent only spreads the tick labels). Returns
    whether it did, so the caller can say "(log scale)" in the label."""
    if axis not in ("x", "y"):
        raise ValueError(f"log_if_wide: axis={axis!r}; use 'x' or 'y'")
    positive = [float(v) for v in values if v > 0]
    wide = bool(positive) and max(positive) >= span * min(positive)
    if wide:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    return wide


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
