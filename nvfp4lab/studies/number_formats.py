"""The study behind ``notebooks/04_formats.ipynb``: error of every format and NVFP4 option.

Pure functions returning plain rows (lists of dicts) that the notebook turns into pandas tables;
the figure helpers import matplotlib lazily and draw with :func:`nvfp4lab.plots.new_figure`;
:func:`format_explorer` is the notebook's widget.

Measured at the defaults (2048×2048 float32, ``seed=0``; NMSE, lower is better):

==============================  =========  ===============
config (label)                  N(0,1)     Student-t(ν=3)
==============================  =========  ===============
bf16                            2.76e-6    2.72e-6
fp8_e4m3 per-channel            7.00e-4    6.27e-4
fp8_e4m3                        7.00e-4    6.98e-4
nvfp4 mse_search                6.77e-3    7.08e-3
nvfp4 four_over_six             7.56e-3    7.57e-3
nvfp4 hadamard + four_over_six  7.57e-3    7.61e-3
nvfp4 hadamard                  9.04e-3    9.69e-3
nvfp4 (= compressed-tensors)    9.04e-3    8.22e-3
nvfp4 no tensor scale           9.05e-3    8.23e-3
nvfp4 16×16 blocks              1.24e-2    3.29e-2
mxfp4                           1.32e-2    2.00e-2
int4_g128                       1.38e-2    5.05e-2
nvfp4 stochastic                2.08e-2    2.03e-2
==============================  =========  ===============

What changes with heavy tails (ranking by NMSE): NVFP4 and its scale-selection variants keep
(or improve) their NMSE, because the error is dominated by the large values and each 16-block
max is mapped onto the grid's top; the uniform INT4 grid over 128 values loses 3.7× and drops
to last place; MXFP4's power-of-two scale over 32 values loses 1.5× yet overtakes NVFP4 with
16×16 tiles (which loses 2.6×) and stochastic-rounding NVFP4; the Hadamard rotation, neutral on
Gaussian data, falls behind plain NVFP4; per-channel FP8 pulls ahead of per-tensor FP8;
four_over_six's gain over RTN halves (16.4 % → 8.0 %).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from nvfp4lab import metrics, number_formats
from nvfp4lab.codec import ScaleUnderflowWarning
from nvfp4lab.hadamard import rotated_matmul
from nvfp4lab.plots import legend_outside, new_figure
from nvfp4lab.studies.explorer import explorer, text_output
from nvfp4lab.vocab import OrderName, Rounding, ScaleSelection

if TYPE_CHECKING:  # pragma: no cover
    import ipywidgets
    from matplotlib.figure import Figure

__all__ = [
    "ANCHORS",
    "DISTRIBUTIONS",
    "StudyConfig",
    "bits_note",
    "default_configs",
    "error_rows",
    "error_table",
    "format_explorer",
    "format_text",
    "hadamard_gemm_study",
    "headline_numbers",
    "plot_sqnr_bars",
    "plot_stochastic_bias",
    "plot_tensor_scale_sweep",
    "rank_table",
    "sample",
    "stochastic_bias",
    "tensor_scale_counterpart",
    "tensor_scale_sweep",
]

DISTRIBUTIONS: tuple[str, ...] = ("normal", "student_t")
_DIST_LABELS = {"normal": "N(0,1)", "student_t": "Student-t(ν={df})"}

#: Published tensor-level NMSE anchors on N(0,1) (label of :func:`default_configs` → NMSE).
ANCHORS: dict[str, float] = {
    "nvfp4": 9.0e-3,
    "nvfp4 four_over_six": 7.6e-3,
    "mxfp4": 1.32e-2,
    "int4_g128": 1.38e-2,
    "fp8_e4m3": 7.0e-4,
}


def sample(
    distribution: str,
    shape: Sequence[int] = (2048, 2048),
    *,
    seed: int = 0,
    df: int = 3,
) -> torch.Tensor:
    """float32 CPU tensor of ``shape`` drawn from ``"normal"`` N(0,1) or ``"student_t"``.

    Student-t(ν=df) is built exactly as ``z / sqrt(chi2_df / df)`` with ``chi2_df`` the sum of
    ``df`` squared normals (so ``df`` is a positive int), all from one ``torch.Generator(seed)``.
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(
            f"unknown distribution {distribution!r}; accepted values: {', '.join(DISTRIBUTIONS)}"
        )
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"df must be a positive integer (degrees of freedom), got {df!r}")
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(tuple(shape), generator=gen)
    if distribution == "normal":
        return z
    chi2 = torch.randn((df, *shape), generator=gen).square_().sum(0)
    return z / torch.sqrt(chi2 / df)


@dataclass(frozen=True)
class StudyConfig:
    """One row of the study: a display ``label``, a registered ``format`` name and its options."""

    label: str
    format: str
    options: dict[str, Any] = field(default_factory=dict)

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        return number_formats.get(self.format).fake_quantize(x, **self.options)

    def bits(self, shape: Sequence[int]) -> float:
        return number_formats.get(self.format).storage_bits(tuple(shape), **self.options)


def default_configs(seed: int = 0, *, fast: bool = False) -> list[StudyConfig]:
    """Every format at its defaults and every NVFP4 option (``seed`` seeds the random ones).

    ``fast`` drops ``mse_search`` (8 candidate scales: the slowest row)."""
    nv = [
        StudyConfig("nvfp4", "nvfp4"),
        StudyConfig("nvfp4 compressed-tensors", "nvfp4",
                    {"convention": OrderName.COMPRESSED_TENSORS}),
        StudyConfig("nvfp4 four_over_six", "nvfp4",
                    {"scale_selection": ScaleSelection.FOUR_OVER_SIX}),
        StudyConfig("nvfp4 mse_search", "nvfp4", {"scale_selection": ScaleSelection.MSE_SEARCH}),
        StudyConfig("nvfp4 stochastic", "nvfp4",
                    {"rounding": Rounding.STOCHASTIC, "generator": seed}),
        StudyConfig("nvfp4 16×16 blocks", "nvfp4", {"block_size": (16, 16)}),
        StudyConfig("nvfp4 hadamard", "nvfp4", {"hadamard": seed}),
        StudyConfig(
            "nvfp4 hadamard + four_over_six",
            "nvfp4",
            {"hadamard": seed, "scale_selection": ScaleSelection.FOUR_OVER_SIX},
        ),
        StudyConfig("nvfp4 no tensor scale", "nvfp4", {"global_scale": 1.0}),
    ]
    if fast:
        nv = [c for c in nv if c.label != "nvfp4 mse_search"]
    return [
        *nv,
        StudyConfig("mxfp4", "mxfp4"),
        StudyConfig("int4_g128", "int4_g128"),
        StudyConfig("fp8_e4m3", "fp8_e4m3"),
        StudyConfig("fp8_e4m3 per-channel", "fp8_e4m3", {"granularity": "channel"}),
        StudyConfig("bf16", "bf16"),
    ]


def error_rows(
    x: torch.Tensor, configs: Iterable[StudyConfig], distribution: str = ""
) -> list[dict[str, Any]]:
    """One dict per config: label, format, distribution, bits (storage, all scales), nmse,
    sqnr_db, max_abs_error."""
    rows = []
    for cfg in configs:
        y = cfg.fake_quantize(x)
        rows.append({
            "label": cfg.label,
            "format": cfg.format,
            "distribution": distribution,
            "bits": cfg.bits(x.shape),
            "nmse": metrics.nmse(x, y),
            "sqnr_db": metrics.sqnr_db(x, y),
            "max_abs_error": metrics.max_abs_error(x, y),
        })
    return rows


def error_table(
    shape: Sequence[int] = (2048, 2048),
    *,
    seed: int = 0,
    df: int = 3,
    distributions: Sequence[str] = DISTRIBUTIONS,
    configs: Sequence[StudyConfig] | None = None,
) -> list[dict[str, Any]]:
    """:func:`error_rows` of every config on each distribution (label ``N(0,1)`` etc.)."""
    configs = default_configs(seed) if configs is None else configs
    rows: list[dict[str, Any]] = []
    for dist in distributions:
        x = sample(dist, shape, seed=seed, df=df)
        rows += error_rows(x, configs, _DIST_LABELS[dist].format(df=df))
    return rows


def bits_note(rows: Sequence[dict[str, Any]]) -> str:
    """One line on the storage of the NVFP4 rows of :func:`error_rows` (bits/element, 3 decimals):
    which options share the plain format's cost and which differ."""
    bits: dict[str, float] = {}
    for r in rows:
        if r["format"] == "nvfp4":
            bits.setdefault(r["label"], r["bits"])
    if not bits:
        return "no NVFP4 rows"
    groups: dict[str, list[str]] = {}
    for label, b in bits.items():
        groups.setdefault(f"{b:.3f}", []).append(label)
    common = max(groups, key=lambda k: len(groups[k]))
    parts = [f"NVFP4 storage: {common} bits/element for {len(groups[common])} of {len(bits)} "
             f"options"]
    parts += [f"{', '.join(labels)}: {b} bits/element" for b, labels in groups.items()
              if b != common]
    return "; ".join(parts)


def rank_table(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """label → {distribution → rank by NMSE}: 1 = lowest error; NMSEs equal to the 4 significant
    digits the notebook's tables show share a rank (the smallest: 1, 2, 2, 4), so two errors the
    reader sees as equal never get different ranks."""
    ranks: dict[str, dict[str, int]] = {}
    for dist in dict.fromkeys(r["distribution"] for r in rows):
        values = sorted(_shown(r["nmse"]) for r in rows if r["distribution"] == dist)
        for r in rows:
            if r["distribution"] == dist:
                ranks.setdefault(r["label"], {})[dist] = 1 + values.index(_shown(r["nmse"]))
    return ranks


def _shown(value: float) -> float:
    """``value`` as a table shows it: 4 significant digits."""
    return float(f"{value:.4g}")


def headline_numbers(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Headline records ``{"name", "value", "unit"}``: SQNR of nvfp4 and mxfp4 and
    four_over_six's NMSE reduction over nvfp4, per distribution present in ``rows``."""
    out: list[dict[str, Any]] = []
    for dist in dict.fromkeys(r["distribution"] for r in rows):
        by = {r["label"]: r for r in rows if r["distribution"] == dist}
        for label in ("nvfp4", "mxfp4"):
            if label in by:
                out.append({"name": f"{label} SQNR, {dist}", "value": by[label]["sqnr_db"],
                            "unit": "dB"})
        if "nvfp4" in by and "nvfp4 four_over_six" in by:
            gain = 1.0 - by["nvfp4 four_over_six"]["nmse"] / by["nvfp4"]["nmse"]
            out.append({"name": f"four_over_six NMSE reduction, {dist}", "value": 100.0 * gain,
                        "unit": "%"})
    return out


def hadamard_gemm_study(
    m: int = 256, n: int = 512, k: int = 1024, *, seed: int = 0, df: int = 3
) -> list[dict[str, Any]]:
    """GEMM ``x [m, k] @ W [n, k]^T`` with both operands NVFP4 fake-quantized, with and without
    the paired Hadamard rotation; activations N(0,1) or Student-t(df), weights N(0,1).

    Rows: activations, rotation, ``gemm_nmse`` (vs the float64 product) and
    ``identity_max_abs`` = max |(xQ)(WQ)^T − xW^T| without quantization (float32 rounding only).
    Measured at the defaults: rotation raises the output NMSE slightly (1.80e-2 → 1.82e-2 on
    N(0,1), 1.74e-2 → 1.88e-2 on Student-t(3)): 16-element blocks already confine outliers.
    """
    fq = number_formats.get("nvfp4").fake_quantize
    w = sample("normal", (n, k), seed=seed + 1)
    rows = []
    for dist in DISTRIBUTIONS:
        x = sample(dist, (m, k), seed=seed, df=df)
        ref = x.double() @ w.double().T
        exact = (rotated_matmul(x, w, seed).double() - ref).abs().max().item()
        for rotation in ("none", "hadamard"):
            if rotation == "none":
                out = fq(x) @ fq(w).T
            else:
                out = rotated_matmul(x, w, seed, quantize_input=fq, quantize_weight=fq)
            rows.append({
                "activations": _DIST_LABELS[dist].format(df=df),
                "rotation": rotation,
                "gemm_nmse": metrics.nmse(ref, out),
                "identity_max_abs": exact,
            })
    return rows


def tensor_scale_sweep(
    magnitudes: Sequence[float],
    shape: Sequence[int] = (256, 1024),
    *,
    seed: int = 0,
) -> list[dict[str, float]]:
    """NVFP4 NMSE of ``m · N(0,1)`` for each magnitude ``m``, with and without the tensor scale.

    Without it the E4M3 block scales must cover the data: they underflow (2^-9) for small ``m``
    and saturate (448) for large ``m``; with it the NMSE does not depend on ``m``.
    """
    fmt = number_formats.get("nvfp4")
    base = sample("normal", shape, seed=seed)
    rows = []
    for m in magnitudes:
        x = base * float(m)
        with warnings.catch_warnings():  # the underflow of tiny data is what this row shows
            warnings.simplefilter("ignore", ScaleUnderflowWarning)
            without = fmt.fake_quantize(x, global_scale=1.0)
        rows.append({
            "magnitude": float(m),
            "nmse_tensor_scale": metrics.nmse(x, fmt.fake_quantize(x)),
            "nmse_no_tensor_scale": metrics.nmse(x, without),
        })
    return rows


def stochastic_bias(
    x: torch.Tensor, n_seeds: int = 64, *, checkpoints: Sequence[int] | None = None
) -> list[dict[str, float]]:
    """Bias of NVFP4 stochastic rounding averaged over seeds ``0..n_seeds-1``.

    For each checkpoint ``n`` (default: powers of two up to ``n_seeds``): ``rms_mean_error`` =
    RMS over elements of the error averaged over ``n`` seeds (→ 0 like ``1/sqrt(n)`` if unbiased,
    down to the clipped block maxima's deterministic bias), and ``rne_rms_error`` for scale.
    """
    if n_seeds < 1:
        raise ValueError(f"n_seeds must be >= 1, got {n_seeds}")
    fmt = number_formats.get("nvfp4")
    if checkpoints is None:
        checkpoints = [2**i for i in range(int(math.log2(n_seeds)) + 1)]
    wanted = set(checkpoints)
    rne_rms = math.sqrt(metrics.mse(x, fmt.fake_quantize(x)))
    total = torch.zeros_like(x, dtype=torch.float64)
    rows = []
    for n in range(1, n_seeds + 1):
        y = fmt.fake_quantize(x, rounding=Rounding.STOCHASTIC, generator=n - 1)
        total += (y - x).to(torch.float64)
        if n in wanted:
            rms = float((total / n).square().mean().sqrt())
            rows.append({"seeds": n, "rms_mean_error": rms, "rne_rms_error": rne_rms})
    return rows


# --------------------------------------------------------------------------------------------
# figures


def plot_sqnr_bars(rows: Sequence[dict[str, Any]]) -> Figure:
    """Horizontal grouped bars: SQNR (dB) of every config, one colour per distribution."""
    dists = list(dict.fromkeys(r["distribution"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, ax = new_figure(
        "Quantization SQNR by format and NVFP4 option (higher is better)",
        "SQNR = −10·log10(NMSE) (dB)",
        "format / option",
        figsize=(8.0, 0.25 * len(labels) * len(dists) + 1.5),
    )
    height = 0.8 / len(dists)
    for i, dist in enumerate(dists):
        by = {r["label"]: r["sqnr_db"] for r in rows if r["distribution"] == dist}
        ys = [j + i * height for j in range(len(labels))]
        ax.barh(ys, [by.get(lbl, math.nan) for lbl in labels], height=height, label=dist)
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(labels))], labels)
    ax.invert_yaxis()
    # outside the axes, right of the bars: inside, every corner covers the end of some bar
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="data")
    fig.set_layout_engine("constrained")
    return fig


def plot_tensor_scale_sweep(rows: Sequence[dict[str, float]]) -> Figure:
    """NMSE vs data magnitude with and without the FP32 tensor scale (log-log)."""
    fig, ax = new_figure(
        "NVFP4 error vs data magnitude: why the FP32 tensor scale exists",
        "data magnitude m (x = m·N(0,1), unitless, log scale)",
        "NMSE (unitless, log scale)",
        xscale="log",
        yscale="log",
    )
    m = [r["magnitude"] for r in rows]
    ax.plot(m, [r["nmse_tensor_scale"] for r in rows], marker="o", label="with tensor scale")
    ax.plot(m, [r["nmse_no_tensor_scale"] for r in rows], marker="s",
            label="block scales only (global_scale=1, no tensor scale)")
    legend_outside(ax)
    return fig


def plot_stochastic_bias(rows: Sequence[dict[str, float]]) -> Figure:
    """RMS of the seed-averaged error vs number of seeds, with the 1/sqrt(n) reference."""
    n = [r["seeds"] for r in rows]
    rms = [r["rms_mean_error"] for r in rows]
    fig, ax = new_figure(
        "Stochastic rounding is unbiased: the seed-averaged error shrinks like 1/√n",
        "number of seeds averaged n (count, log₂ scale)",
        "RMS of mean error (data units, log scale)",
        yscale="log",
    )
    ax.set_xscale("log", base=2)
    ax.plot(n, rms, marker="o", label="stochastic rounding, mean over n seeds")
    ax.plot(n, [rms[0] / math.sqrt(k) for k in n], linestyle="--", label="1/√n from n = 1")
    ax.axhline(rows[0]["rne_rms_error"], color="C2", linestyle=":", label="RNE error (RMS)")
    legend_outside(ax)
    return fig


# --------------------------------------------------------------------------------------------
# explorer


def format_row(
    config: StudyConfig,
    distribution: str,
    log10_magnitude: float,
    *,
    seed: int,
    df: int,
    shape: Sequence[int] = (256, 1024),
) -> dict[str, Any]:
    """:func:`error_rows` row of ``config`` on seeded ``distribution`` data
    scaled by ``10**log10_magnitude``."""
    x = sample(distribution, shape, seed=seed, df=df) * 10.0**log10_magnitude
    return error_rows(x, [config], distribution)[0]


def _db(value: float) -> str:
    """``value`` to 2 decimals, never ``-0.00``."""
    shown = f"{value:.2f}"
    return "0.00" if shown == "-0.00" else shown


def tensor_scale_counterpart(config: StudyConfig) -> StudyConfig | None:
    """The same NVFP4 config with the FP32 tensor scale toggled (``global_scale=1.0`` added or
    removed); None for other formats."""
    if config.format != "nvfp4":
        return None
    options = dict(config.options)
    if "global_scale" in options:
        del options["global_scale"]
        return StudyConfig(f"{config.label} (with the tensor scale)", config.format, options)
    options["global_scale"] = 1.0
    return StudyConfig(f"{config.label} (block scales only)", config.format, options)


def format_text(
    row: dict[str, Any],
    log10_magnitude: float,
    df: int,
    shape: Sequence[int],
    counterpart: dict[str, Any] | None = None,
) -> str:
    """What :func:`format_explorer` shows for one :func:`format_row` row; ``counterpart`` is the
    row of :func:`tensor_scale_counterpart` at the same data, shown on a second line."""
    dist = row["distribution"]
    data = f"{dist}{f'(ν={df})' if dist == 'student_t' else ''}"
    text = (
        f"{row['label']} on {data} × 10^{log10_magnitude:g} ({shape[0]}×{shape[1]}): "
        f"NMSE {row['nmse']:.3e} | SQNR {_db(row['sqnr_db'])} dB | "
        f"{row['bits']:.3f} bits/element"
    )
    if counterpart is None:
        return text
    with_scale, without = (
        (counterpart, row) if counterpart["label"].endswith("(with the tensor scale)")
        else (row, counterpart)
    )
    return (
        f"{text}\n"
        f"same data, {counterpart['label']}: NMSE {counterpart['nmse']:.3e} | "
        f"SQNR {_db(counterpart['sqnr_db'])} dB\n"
        f"With the FP32 tensor scale NVFP4 is scale-invariant (NMSE {with_scale['nmse']:.3e} at "
        "every magnitude); with block scales only, the E4M3 scales (2^-9 to 448) underflow on "
        f"tiny data and saturate on large data (here NMSE {without['nmse']:.3e}). Move the "
        "magnitude to see it."
    )


def format_explorer(
    configs: Sequence[StudyConfig],
    *,
    seed: int,
    df: int,
    shape: Sequence[int] = (256, 1024),
) -> ipywidgets.VBox:
    """Format configuration, distribution and data magnitude → NMSE, SQNR and storage bits
    (notebook 04; ``configs`` from :func:`default_configs`)."""
    import ipywidgets as widgets

    if not configs:
        raise ValueError("format_explorer needs at least one config; pass default_configs(seed)")
    by_label = {c.label: c for c in configs}
    label = widgets.Dropdown(options=list(by_label), description="config")
    dist = widgets.Dropdown(options=list(DISTRIBUTIONS), description="distribution")
    mag = widgets.FloatSlider(
        value=0.0, min=-5.0, max=5.0, step=0.5, description="log10 |x| scale",
        continuous_update=False,
    )
    def render() -> tuple[dict[str, Any], ...]:
        config = by_label[label.value]
        row = format_row(config, dist.value, mag.value, seed=seed, df=df, shape=shape)
        other = tensor_scale_counterpart(config)
        counterpart = None
        if other is not None:
            with warnings.catch_warnings():  # the underflow is what the second line explains
                warnings.simplefilter("ignore", ScaleUnderflowWarning)
                counterpart = format_row(other, dist.value, mag.value, seed=seed, df=df,
                                         shape=shape)
        title = f"Error of {label.value} on {dist.value} data × 10^{mag.value:g}"
        return (text_output(format_text(row, mag.value, df, shape, counterpart), title),)

    return explorer(widgets, [label, dist, mag], render)
