"""nvfp4lab.tour: the helpers behind notebook 01."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab import tour
from nvfp4lab.constants import E4M3_MAX, E4M3_MIN_SUBNORMAL
from nvfp4lab.e2m1 import pack_fp4
from nvfp4lab.layout import swizzled_offset


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
