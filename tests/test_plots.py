"""nvfp4lab.plots: one style, and every figure has a title and labelled axes."""

from __future__ import annotations

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from nvfp4lab import plots  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_style_sheet_applies() -> None:
    assert plots.STYLE_PATH.is_file()
    with plots.style_context():
        assert plt.rcParams["axes.spines.top"] is False
        _fig, ax = plots.new_figure("t", "x (s)", "y (m)")
        assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("t", "x (s)", "y (m)")


def test_new_figure_requires_labels() -> None:
    with pytest.raises(ValueError, match="title and both axis labels"):
        plots.new_figure("title", "", "y")


def test_as_numpy() -> None:
    import torch

    assert plots.as_numpy(torch.tensor([1.0, 2.0], dtype=torch.bfloat16)).tolist() == [1.0, 2.0]
    assert plots.as_numpy([3, 4]).dtype.name == "float64"
