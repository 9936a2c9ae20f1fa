"""nvfp4lab.tour: the helpers behind notebook 01."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pytest
import torch

from nvfp4lab.constants import E4M3_MAX, E4M3_MIN_SUBNORMAL
from nvfp4lab.e2m1 import pack_fp4
from nvfp4lab.layout import swizzled_offset
from nvfp4lab.plots import save_figure
from nvfp4lab.studies import tour

matplotlib.use("Agg")
from tests.studies.widgets import control, text


def test_tie_points_and_where_they_go() -> None:
    curve = tour.e2m1_rounding_curve()
    ties = dict(zip(curve.tie_x.tolist(), curve.tie_rounded.tolist(), strict=True))
    assert ties == {
        0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0,
        -0.25: -0.0, -0.75: -1.0, -1.25: -1.0, -1.75: -2.0, -2.5: -2.0, -3.5: -4.0, -5.0: -4.0,
    }
    # every tie point is on the default input grid, and the curve saturates past ±6
    assert set(curve.tie_x.tolist()) <= set(curve.x.tolist())
    assert curve.rounded.max() == 6.0 and curve.rounded.min() == -6.0
    assert tour.e2m1_round(6.9) == 6.0 and tour.e2m1_round(2.501) == 3.0


def test_rounding_curve_rejects_bad_range() -> None:
    with pytest.raises(ValueError, match="lo < hi"):
        tour.e2m1_rounding_curve(1.0, -1.0)


def test_e4m3_positive_values() -> None:
    v = tour.e4m3_positive_values()
    assert v.numel() == 126 and v.dtype == torch.float32
    assert bool((v[1:] > v[:-1]).all())
    assert float(v[0]) == E4M3_MIN_SUBNORMAL and float(v[-1]) == E4M3_MAX


def test_swizzle_offset_grid_matches_the_formula() -> None:
    for rows, cols in [(256, 8), (130, 5), (1, 1)]:
        grid = tour.swizzle_offset_grid(rows, cols)
        expected = torch.tensor(
            [[swizzled_offset(i, j, cols) for j in range(cols)] for i in range(rows)]
        )
        assert torch.equal(grid, expected)


def test_block_walkthrough_is_consistent() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    walk = tour.block_walkthrough(x[1, 16:32], global_scale=2688.0 / float(x.abs().max()))
    assert walk.amax == pytest.approx(float(x[1, 16:32].abs().max()))
    assert walk.block_scale > 0 and walk.block_scale <= E4M3_MAX
    assert torch.equal(pack_fp4(walk.codes), walk.packed)
    assert len(walk.packed_hex.split()) == 8
    table = walk.table()
    assert all(len(col) == 16 for col in table.values())
    factor = walk.block_scale / walk.global_scale
    for value, deq in zip(table["E2M1 value"], table["x̂ (dequantized)"], strict=True):
        assert deq == pytest.approx(value * factor, rel=1e-6)
    assert walk.summary()["packed bytes (hex)"] == walk.packed_hex
    with pytest.raises(ValueError, match="one block of 16"):
        tour.block_walkthrough(torch.ones(15))


def test_block_walkthrough_default_scale_maps_amax_to_448() -> None:
    walk = tour.block_walkthrough(torch.linspace(-3.0, 1.0, 16))
    assert walk.block_scale == 448.0
    assert walk.table()["E2M1 value"][0] == -6.0


# -- figures ---------------------------------------------------------------------------------


def _check_labels(fig) -> None:
    ax = fig.axes[0]
    assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()


def test_tour_figures_are_labelled(tmp_path: Path) -> None:
    figures = [
        tour.plot_e2m1_rounding(tour.e2m1_rounding_curve()),
        tour.plot_e4m3_grid(tour.e4m3_positive_values()),
        tour.plot_swizzle_offsets(tour.swizzle_offset_grid(256, 8)),
        tour.plot_block_nmse_hist(torch.rand(100) * 1e-2 + 1e-4, tensor_nmse=5e-3),
    ]
    for fig in figures:
        _check_labels(fig)
    out = save_figure(figures[0], tmp_path / "sub" / "e2m1.png")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_nmse_hist_needs_data() -> None:
    with pytest.raises(ValueError, match="no finite"):
        tour.plot_block_nmse_hist(torch.tensor([float("nan"), 0.0]))


# -- explorer --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "code", "element", "lower", "upper", "tie"),
    [
        (1.25, 2, 1.0, 1.0, 1.5, True),  # tie between 1 and 1.5 -> even code
        (-0.1, 8, -0.0, -0.5, 0.0, False),  # negative zero
        (-0.25, 8, -0.0, -0.5, 0.0, True),
        (2.5, 4, 2.0, 2.0, 3.0, True),
        (2.6, 5, 3.0, 2.0, 3.0, False),
        (1.0, 2, 1.0, 1.0, 1.0, False),  # on the grid
        (6.9, 7, 6.0, 6.0, 6.0, False),  # saturates
        (-7.0, 15, -6.0, -6.0, -6.0, False),
    ],
)
def test_rounding_info(
    x: float, code: int, element: float, lower: float, upper: float, tie: bool
) -> None:
    r = tour.rounding_info(x)
    assert (r.code, r.element, r.lower, r.upper, r.tie) == (code, element, lower, upper, tie)
    assert str(r.element) == str(element)  # the sign of zero too
    assert r.saturated == (abs(x) > 6)


def test_rounding_with_block_scale() -> None:
    r = tour.rounding_info(2.5, block_scale=0.5)  # x/s = 5: tie between 4 and 6 -> 4
    assert (r.scaled, r.code, r.element, r.dequantized, r.tie) == (5.0, 6, 4.0, 2.0, True)
    with pytest.raises(ValueError, match="block_scale > 0"):
        tour.rounding_info(1.0, block_scale=0.0)


def test_rounding_text() -> None:
    text = tour.rounding_text(-0.1)
    assert "code 8 = 0b1000" in text and "negative zero" in text
    assert "between grid points -0.5 and +0" in text
    assert "neighbours +0.5 and +1.5" in tour.rounding_text(1.0)
    assert "saturates to +6" in tour.rounding_text(6.9)


def test_rounding_explorer_follows_its_sliders() -> None:
    box = tour.rounding_explorer()
    assert "E2M1 +1  →  code 2 " in text(box)  # default 1.25
    control(box, "x").value = -0.1
    assert text(box) == tour.rounding_text(-0.1, 1.0) + "\n"
    assert "code 8" in text(box)
    scale = control(box, "block scale s")
    assert scale.value == 1.0 and 448.0 in scale.options[-1]
    control(box, "x").value = 3.0
    scale.value = 0.5
    assert "x/s = +6" in text(box) and "x̂ = E2M1·s = +3" in text(box)


