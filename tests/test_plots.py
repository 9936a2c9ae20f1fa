"""nvfp4lab.plots: one style, and every figure has a title and labelled axes."""

from __future__ import annotations

from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from nvfp4lab import plots, tour  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _check_labels(fig) -> None:
    ax = fig.axes[0]
    assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()


def test_style_sheet_applies() -> None:
    assert plots.STYLE_PATH.is_file()
    with plots.style_context():
        assert plt.rcParams["axes.spines.top"] is False
        _fig, ax = plots.new_figure("t", "x (s)", "y (m)")
        assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("t", "x (s)", "y (m)")


def test_new_figure_requires_labels() -> None:
    with pytest.raises(ValueError, match="title and both axis labels"):
        plots.new_figure("title", "", "y")


def test_tour_figures_are_labelled(tmp_path: Path) -> None:
    figures = [
        plots.plot_e2m1_rounding(tour.e2m1_rounding_curve()),
        plots.plot_e4m3_grid(tour.e4m3_positive_values()),
        plots.plot_swizzle_offsets(tour.swizzle_offset_grid(256, 8)),
        plots.plot_block_nmse_hist(torch.rand(100) * 1e-2 + 1e-4, tensor_nmse=5e-3),
    ]
    for fig in figures:
        _check_labels(fig)
    out = plots.save_figure(figures[0], tmp_path / "sub" / "e2m1.png")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_nmse_hist_needs_data() -> None:
    with pytest.raises(ValueError, match="no finite"):
        plots.plot_block_nmse_hist(torch.tensor([float("nan"), 0.0]))
