"""studies.audit: the table the audit notebook reads, flagged layers first; its figures."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from nvfp4lab.report import notebook_parameters
from nvfp4lab.studies import audit as study

ROWS = [
    {"layer": "a.q", "shape": "64x64", "scale_form": "encode", "tensor_scale": 1e4,
     "scale_min": 96.0, "scale_max": 448.0, "saturated_frac": 0.0, "underflow_frac": 0.0,
     "fused_group": "q/k/v", "fused_shared": False, "merge_sqnr_db": 19.0,
     "weight_sqnr_db": None, "issues": ""},
    {"layer": "a.k", "shape": "32x64", "scale_form": "encode", "tensor_scale": 2e4,
     "scale_min": 48.0, "scale_max": 224.0, "saturated_frac": 0.0, "underflow_frac": 0.0,
     "fused_group": "q/k/v", "fused_shared": False, "merge_sqnr_db": 6.0,
     "weight_sqnr_db": None, "issues": "fused group q/k/v has unshared tensor scales"},
    {"layer": "a.o", "shape": "64x64", "scale_form": "encode", "tensor_scale": 3e4,
     "scale_min": 2.0**-9, "scale_max": 448.0, "saturated_frac": 0.1, "underflow_frac": 0.0,
     "fused_group": None, "fused_shared": None, "merge_sqnr_db": math.inf,
     "weight_sqnr_db": None, "issues": "10.0% of blocks saturated at 448"},
]


def _csv(tmp_path: Path) -> Path:
    path = tmp_path / "audit.csv"
    pd.DataFrame(ROWS).to_csv(path, index=False)
    return path


def test_flagged_layers_come_first_in_checkpoint_order(tmp_path: Path) -> None:
    df = study.load_table(_csv(tmp_path))
    assert list(df["layer"]) == ["a.k", "a.o", "a.q"]
    assert list(df["flagged"]) == [True, True, False]
    assert list(study.flagged_table(df)["layer"]) == ["a.k", "a.o"]
    assert study.summary(df) == {"layers": 3, "flagged": 2, "unshared fused layers": 2,
                                 "worst weight SQNR (dB)": None, "worst merge SQNR (dB)": 6.0}


def test_the_flagged_table_shows_the_scale_form(tmp_path: Path) -> None:
    """The tensor scale's ENCODE/DECODE form is the ``scale_form`` column (issue 33: it was
    ``convention``, the word for an arithmetic order); an audit.csv an older release wrote,
    with the old column, still reads and shows the same table."""
    new = study.flagged_table(study.load_table(_csv(tmp_path)))
    assert list(new.columns) == ["layer", "shape", "scale_form", "tensor_scale", "issues"]
    old_csv = tmp_path / "old.csv"
    pd.DataFrame(ROWS).rename(columns={"scale_form": "convention"}).to_csv(old_csv, index=False)
    old = study.flagged_table(study.load_table(old_csv))
    pd.testing.assert_frame_equal(old, new)
    assert study.RENAMED_COLUMNS == {"convention": "scale_form"}


def test_figures_have_titles_and_labels(tmp_path: Path) -> None:
    df = study.load_table(_csv(tmp_path))
    for fig in (study.plot_scale_ranges(df), study.plot_layer_error(df)):
        ax = fig.axes[0]
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    assert "SQNR" in study.plot_layer_error(df).axes[0].get_ylabel()
    no_error = df.drop(columns=["merge_sqnr_db"])
    assert "%" in study.plot_layer_error(no_error).axes[0].get_ylabel()


def test_figures_keep_the_style_layout_and_draw_without_warnings(tmp_path: Path) -> None:
    """The style's constrained layout stays: a ``tight_layout()`` call switched engines and
    printed "The figure layout has changed to tight" in every audit page."""
    import warnings

    import matplotlib.pyplot as plt

    from nvfp4lab.plots import style_context

    df = study.load_table(_csv(tmp_path))
    with style_context(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for fig in (study.plot_scale_ranges(df), study.plot_layer_error(df)):
            fig.canvas.draw()
            assert type(fig.get_layout_engine()).__name__ == "ConstrainedLayoutEngine"
            plt.close(fig)


def test_template_is_package_data_with_its_parameters() -> None:
    assert study.TEMPLATE.is_file() and not study.TEMPLATE.name[:2].isdigit()
    params = notebook_parameters(study.TEMPLATE)
    assert {"AUDIT_CSV", "TITLE", "SEED", "SMOKE", "INTERACTIVE"} <= set(params)
