"""The checkpoint audit report: the table :func:`nvfp4lab.checkpoint.audit` writes, its figures.

The notebook template ``nvfp4lab/studies/audit.ipynb`` (package data, not a numbered report
notebook) calls these with the ``audit.csv`` that ``nvfp4lab audit --out DIR`` writes, and the
report runner renders it to ``DIR/audit.html``. Flagged layers (non-empty ``issues``) come first
in every table and are drawn in red in every figure.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nvfp4lab.plots import new_figure

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = [
    "TEMPLATE",
    "flagged_table",
    "load_table",
    "plot_layer_error",
    "plot_scale_ranges",
    "summary",
]

#: The parameterised notebook that renders an audit table.
TEMPLATE = Path(__file__).with_name("audit.ipynb")
FLAGGED, CLEAN = "#b00020", "#4a7ab5"
#: Columns renamed since an older release, old name -> new: an old ``audit.csv`` still reads.
#: ``convention`` named the ENCODE/DECODE form of the stored tensor scale (deprecated; dropped
#: in the next release).
RENAMED_COLUMNS: dict[str, str] = {"convention": "scale_form"}


def load_table(csv: str | os.PathLike[str]) -> pd.DataFrame:
    """The audit CSV as a DataFrame with a boolean ``flagged`` column, flagged layers first
    (checkpoint order kept within each part); an older CSV's columns take their new names
    (:data:`RENAMED_COLUMNS`)."""
    import pandas as pd

    df = pd.read_csv(csv)
    df = df.rename(columns={old: new for old, new in RENAMED_COLUMNS.items()
                            if old in df and new not in df})
    df["issues"] = df["issues"].fillna("").astype(str)
    df["flagged"] = df["issues"] != ""
    df["order"] = range(len(df))
    return df.sort_values(["flagged", "order"], ascending=[False, True]).reset_index(drop=True)


def summary(df: pd.DataFrame) -> dict[str, Any]:
    """Headline numbers: layers audited, layers flagged, unshared fused layers, and the worst
    weight SQNR against the reference / under vLLM's merge (dB; None without data)."""

    def worst(column: str) -> float | None:
        if column not in df or df[column].dropna().empty:
            return None
        return float(df[column].dropna().min())

    shared = df["fused_shared"].dropna() if "fused_shared" in df else []
    return {
        "layers": len(df),
        "flagged": int(df["flagged"].sum()),
        "unshared fused layers": int(sum(1 for v in shared if str(v) == "False")),
        "worst weight SQNR (dB)": worst("weight_sqnr_db"),
        "worst merge SQNR (dB)": worst("merge_sqnr_db"),
    }


def flagged_table(df: pd.DataFrame) -> pd.DataFrame:
    """Layer, shape, tensor scale (its form and value) and issues of the flagged layers."""
    cols = [c for c in ("layer", "shape", "scale_form", "tensor_scale", "issues") if c in df]
    return df.loc[df["flagged"], cols].reset_index(drop=True)


def _height(rows: int) -> float:
    return min(max(3.0, 0.22 * rows + 1.2), 40.0)


def plot_scale_ranges(df: pd.DataFrame) -> Figure:
    """Per layer, the range of its nonzero E4M3 block scales (log2), flagged layers in red."""
    fig, ax = new_figure("Block-scale range per layer (flagged layers first, in red)",
                         "block scale (log2 of the E4M3 value, unitless)", "layer",
                         figsize=(9.0, _height(len(df))))
    for i, row in enumerate(df.itertuples()):
        lo, hi = row.scale_min, row.scale_max
        if not (isinstance(lo, float) and math.isfinite(lo) and math.isfinite(hi)):
            continue
        color = FLAGGED if row.flagged else CLEAN
        ax.plot([math.log2(lo), math.log2(hi)], [i, i], color=color, lw=4, solid_capstyle="butt")
    ax.axvline(math.log2(448.0), color="grey", ls="--", lw=1, label="448 (E4M3 max)")
    ax.axvline(-9, color="grey", ls=":", lw=1, label="2^-9 (smallest subnormal)")
    ax.set_yticks(range(len(df)), list(df["layer"]), fontsize=7)
    ax.invert_yaxis()
    ax.legend(loc="lower left", fontsize=8)
    return fig


def plot_layer_error(df: pd.DataFrame) -> Figure:
    """Per layer, the weight SQNR against the reference and under vLLM's fused max-merge (dB);
    without either, the fractions of saturated and underflowed blocks (%)."""
    series = [(c, label) for c, label in (("weight_sqnr_db", "weight SQNR vs reference"),
                                          ("merge_sqnr_db", "weight SQNR under vLLM's merge"))
              if c in df and df[c].replace([math.inf], math.nan).notna().any()]
    unit = "dB"
    if not series:
        series = [("saturated_frac", "blocks saturated at 448"),
                  ("underflow_frac", "blocks at or below 2^-9")]
        unit = "% of blocks"
    fig, ax = new_figure("Per-layer error (flagged layers first, in red)", "layer index "
                         "(table order)", f"{'SQNR' if unit == 'dB' else 'fraction'} ({unit})",
                         figsize=(9.0, 4.0))
    x = range(len(df))
    colors = [FLAGGED if f else CLEAN for f in df["flagged"]]
    for (column, label), marker in zip(series, ("o", "s"), strict=False):
        values = df[column].astype(float) * (100.0 if unit != "dB" else 1.0)
        values = values.replace([math.inf], math.nan)
        ax.scatter(x, values, c=colors, marker=marker, s=18, label=label)
    ax.legend(fontsize=8)
    return fig
