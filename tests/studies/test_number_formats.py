"""nvfp4lab.studies.number_formats: the error study behind notebook 04 and its explorer."""

from __future__ import annotations

import pytest

from nvfp4lab.codec import ScaleUnderflowWarning
from nvfp4lab.studies import number_formats as fs
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


# -- the explorer explains the tensor scale; figures and text from the data ---------------------


def test_explorer_shows_the_tensor_scale_effect_at_every_magnitude() -> None:
    configs = fs.default_configs(0, fast=True)
    box = fs.format_explorer(configs, seed=0, df=3, shape=SHAPE)
    shown = {}
    for mag in (-5.0, 0.0, 5.0):
        control(box, "log10 |x| scale").value = mag
        lines = text(box).splitlines()
        assert len(lines) == 3 and "scale-invariant" in lines[2]
        assert lines[1].startswith("same data, nvfp4 (block scales only): NMSE")
        shown[mag] = (lines[0].split("NMSE ")[1][:9], lines[1].split("NMSE ")[1][:9])
    # with the tensor scale the NMSE is the same; without it it moves with the magnitude
    assert shown[-5.0][0] == shown[0.0][0] == shown[5.0][0]
    assert len({shown[-5.0][1], shown[0.0][1], shown[5.0][1]}) == 3
    assert float(shown[-5.0][1]) > 0.5 and float(shown[5.0][1]) > 0.5
    control(box, "config").value = "mxfp4"
    assert len(text(box).splitlines()) == 1  # the second line is for NVFP4 only


def test_readout_never_prints_a_negative_zero() -> None:
    row = {"label": "nvfp4 no tensor scale", "distribution": "normal", "nmse": 1.0,
           "sqnr_db": -1e-9, "bits": 4.5}
    shown = fs.format_text(row, -5.0, 3, SHAPE)
    assert "SQNR 0.00 dB" in shown and "-0.00" not in shown
    other = dict(row, label="nvfp4 no tensor scale (with the tensor scale)", sqnr_db=-0.001)
    assert "-0.00" not in fs.format_text(row, -5.0, 3, SHAPE, other)


def test_bits_note_names_the_options_that_cost_less() -> None:
    rows = fs.error_rows(fs.sample("normal", SHAPE), fs.default_configs(0, fast=True))
    note = fs.bits_note(rows)
    bits = {r["label"]: r["bits"] for r in rows}
    sixteen, plain = bits["nvfp4 16×16 blocks"], bits["nvfp4"]
    # at this small shape the 32-bit tensor scale adds 0.004 bit, so "no tensor scale" differs
    assert note.startswith(f"NVFP4 storage: {plain:.3f} bits/element for 6 of 8 options")
    assert f"nvfp4 16×16 blocks: {sixteen:.3f} bits/element" in note


def test_notebook_text_does_not_claim_one_bit_cost() -> None:
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).parents[2] / "notebooks/04_formats.ipynb").read_text())
    source = "".join("".join(c["source"]) for c in nb["cells"])
    assert "same 4.5 bits" not in source and "fs.bits_note(rows)" in source


def test_sqnr_legend_leaves_every_bar_uncovered() -> None:
    import matplotlib

    matplotlib.use("Agg")
    from tests.studies.figures import legend_hits

    configs = fs.default_configs(0, fast=True)
    rows = fs.error_table(SHAPE, configs=configs)
    fig = fs.plot_sqnr_bars(rows)
    assert legend_hits(fig) == []
    matplotlib.pyplot.close(fig)
