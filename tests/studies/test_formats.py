"""nvfp4lab.studies.formats: the error study behind notebook 04 and its explorer."""

from __future__ import annotations

import pytest

from nvfp4lab.codec import ScaleUnderflowWarning
from nvfp4lab.studies import formats as fs
from tests.studies.widgets import control, text

# -- explorer --------------------------------------------------------------------------------------

SHAPE = (32, 256)


def test_format_explorer_matches_error_rows() -> None:
    configs = fs.default_configs(0, fast=True)
    box = fs.format_explorer(configs, seed=0, df=3, shape=SHAPE)
    assert list(control(box, "config").options) == [c.label for c in configs]
    assert text(box).startswith("nvfp4 on normal × 10^0 (32×256): NMSE")

    control(box, "config").value = "mxfp4"
    control(box, "distribution").value = "student_t"
    control(box, "log10 |x| scale").value = 2.0
    x = fs.sample("student_t", SHAPE, seed=0, df=3) * 100.0
    (row,) = fs.error_rows(x, [c for c in configs if c.label == "mxfp4"], "student_t")
    assert row["bits"] == 4.25
    assert text(box) == (
        f"mxfp4 on student_t(ν=3) × 10^2 (32×256): NMSE {row['nmse']:.3e} | "
        f"SQNR {row['sqnr_db']:.2f} dB | 4.250 bits/element\n"
    )


def test_format_text_shows_tensor_scale_underflow() -> None:
    (no_gs,) = [c for c in fs.default_configs(0, fast=True) if c.label == "nvfp4 no tensor scale"]
    with pytest.warns(ScaleUnderflowWarning):  # no tensor scale: every block underflows
        row = fs.format_row(no_gs, "normal", -5.0, seed=0, df=3, shape=SHAPE)
    assert row["nmse"] > 0.5  # E4M3 block scales alone underflow at 1e-5
    assert f"NMSE {row['nmse']:.3e}" in fs.format_text(row, -5.0, 3, SHAPE)


def test_errors_are_shown_in_the_output() -> None:
    box = fs.format_explorer(fs.default_configs(0, fast=True), seed=0, df=0, shape=SHAPE)
    (out,) = box.children[-1].outputs
    assert out["name"] == "stderr" and "df must be a positive integer" in out["text"]
    with pytest.raises(ValueError, match="at least one config"):
        fs.format_explorer([], seed=0, df=3)
