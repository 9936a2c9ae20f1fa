"""The study behind ``notebooks/02_bias_study.ipynb``: what the bias epilogue does to a layer.

One random layer ``y = x @ W.T + b`` (``x`` ``[M, K]``, ``W`` ``[N, K]``, both N(0, 1) scaled so
that ``y`` has unit RMS) is run through :func:`~nvfp4lab.execution.gemm.linear` with each bias
epilogue (``"output"``, ``"fp32"``, ``"dropped"``) while the bias grows. The bias has a random
direction and an RMS of ``bias_scale`` times the RMS of ``x @ W.T`` (a unitless ratio). The truth
is the float layer evaluated exactly (float64 on the layer's own ``dtype`` values). Nothing here
plots except the ``plot_*`` functions, which return figures (matplotlib imported inside them).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nvfp4lab import metrics
from nvfp4lab.codec import quantize
from nvfp4lab.execution.gemm import DroppedBiasWarning, linear
from nvfp4lab.plots import legend_outside, new_figure
from nvfp4lab.studies.explorer import explorer, text_output
from nvfp4lab.vocab import Backend, BiasMode

if TYPE_CHECKING:  # pragma: no cover
    import ipywidgets
    from matplotlib.figure import Figure

__all__ = [
    "DEFAULT_BIAS_SCALES",
    "BiasLayer",
    "bias_explorer",
    "bias_sweep",
    "bias_text",
    "dropped_bias_check",
    "epilogue_summary",
    "make_layer",
    "plot_epilogue_rounding",
    "plot_sqnr_vs_bias",
    "run_layer",
]

#: Bias RMS relative to the RMS of ``x @ W.T`` (unitless).
DEFAULT_BIAS_SCALES: tuple[float, ...] = (0.0, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
_MODE_LABELS = {
    BiasMode.OUTPUT: "bias after rounding (output dtype)",
    BiasMode.FP32: "bias in fp32 epilogue",
    BiasMode.DROPPED: "bias dropped (seed bug)",
    "float": "float layer in its dtype",
}


@dataclass(frozen=True)
class BiasLayer:
    """A random layer: ``x`` ``[M, K]``, ``weight`` ``[N, K]`` in ``dtype``, unit bias
    direction ``bias_dir`` ``[N]`` (float32, RMS 1) and ``gemm_rms`` = RMS of ``x @ W.T``."""

    x: torch.Tensor
    weight: torch.Tensor
    bias_dir: torch.Tensor
    gemm_rms: float

    def bias(self, scale: float) -> torch.Tensor:
        """Bias with RMS ``scale * gemm_rms``, in the layer's dtype."""
        return (self.bias_dir * (scale * self.gemm_rms)).to(self.x.dtype)

    def truth(self, bias: torch.Tensor) -> torch.Tensor:
        """The float layer, exactly: float64 ``x @ W.T + b`` on the dtype values."""
        return self.x.double() @ self.weight.double().T + bias.double()


def make_layer(
    m: int = 256, n: int = 512, k: int = 1024, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> BiasLayer:
    """Random N(0, 1) activations and N(0, 1/K) weights (so ``x @ W.T`` has RMS ~1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype)
    bias_dir = torch.randn(n, generator=g)
    bias_dir = bias_dir / bias_dir.pow(2).mean().sqrt()
    gemm_rms = float((x.double() @ w.double().T).pow(2).mean().sqrt())
    return BiasLayer(x=x, weight=w, bias_dir=bias_dir, gemm_rms=gemm_rms)


def run_layer(
    layer: BiasLayer,
    bias_scale: float,
    *,
    backend: str = Backend.EMULATION,
    bias_mode: str = BiasMode.OUTPUT,
) -> torch.Tensor:
    """The NVFP4 layer's output ``[M, N]`` (layer dtype) for one bias size and epilogue."""
    q = quantize(layer.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedBiasWarning)
        return linear(
            layer.x, q, layer.bias(bias_scale), backend=backend, bias_mode=bias_mode  # type: ignore[arg-type]
        )


def bias_sweep(
    layer: BiasLayer,
    bias_scales: Sequence[float] = DEFAULT_BIAS_SCALES,
    *,
    backends: Sequence[str] = (Backend.EMULATION, Backend.W4A16),
) -> list[dict[str, object]]:
    """Error of every (backend, epilogue) against the exact float layer, per bias size.

    Rows: ``backend``, ``mode`` ("output" | "fp32" | "dropped" | "float" = the unquantized layer
    in its dtype), ``bias_scale``, ``sqnr_db`` and ``nmse`` vs the truth, and
    ``epilogue_rel_rms`` = RMS(out - out_fp32) / RMS(truth): the error the epilogue alone adds
    relative to the fp32 epilogue of the same quantized GEMM (0 for "fp32").
    """
    q = quantize(layer.weight)
    rows: list[dict[str, object]] = []
    for scale in bias_scales:
        bias = layer.bias(scale)
        truth = layer.truth(bias)
        truth_rms = float(truth.pow(2).mean().sqrt())
        float_out = torch.nn.functional.linear(layer.x, layer.weight, bias)
        rows.append(_row("float", "float", scale, truth, float_out, None, truth_rms))
        for backend in backends:
            outs = {}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DroppedBiasWarning)
                for mode in map(str, BiasMode):
                    outs[mode] = linear(
                        layer.x, q, bias, backend=backend, bias_mode=mode  # type: ignore[arg-type]
                    )
            for mode in map(str, BiasMode):
                out_fp32 = outs[BiasMode.FP32]
                rows.append(_row(backend, mode, scale, truth, outs[mode], out_fp32, truth_rms))
    return rows


def _row(
    backend: str,
    mode: str,
    scale: float,
    truth: torch.Tensor,
    out: torch.Tensor,
    out_fp32: torch.Tensor | None,
    truth_rms: float,
) -> dict[str, object]:
    epilogue = (
        float((out.double() - out_fp32.double()).pow(2).mean().sqrt()) / truth_rms
        if out_fp32 is not None
        else float("nan")
    )
    return {
        "backend": backend,
        "mode": mode,
        "bias_scale": float(scale),
        "sqnr_db": metrics.sqnr_db(truth, out.double()),
        "nmse": metrics.nmse(truth, out.double()),
        "epilogue_rel_rms": epilogue,
    }


def dropped_bias_check(
    layer: BiasLayer,
    bias_scales: Sequence[float] = DEFAULT_BIAS_SCALES,
    *,
    backend: str = Backend.EMULATION,
) -> list[dict[str, object]]:
    """The seed bug in numbers: dropping the bias removes exactly ``b`` from every output.

    Rows: ``bias_scale``; ``output_is_dropped_plus_bias`` (True when the correct output equals
    the dropped output plus ``b``, bit for bit, in the layer dtype: the only difference between
    the two paths is the bias); ``nmse_quant`` (NMSE with the bias kept); ``nmse_dropped``
    measured; ``nmse_predicted`` = ``nmse_quant + ||b||²/||y||²`` over all M rows (the bias error
    adds to the quantization error, up to a cross term); ``sqnr_dropped_db``.
    """
    q = quantize(layer.weight)
    rows: list[dict[str, object]] = []
    for scale in bias_scales:
        bias = layer.bias(scale)
        truth = layer.truth(bias)
        good = linear(layer.x, q, bias, backend=backend)  # type: ignore[arg-type]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DroppedBiasWarning)
            dropped = linear(layer.x, q, bias, backend=backend, bias_mode=BiasMode.DROPPED)  # type: ignore[arg-type]
        n_quant = metrics.nmse(truth, good.double())
        bias_power = float(bias.double().pow(2).sum()) * layer.x.shape[0]
        rows.append(
            {
                "bias_scale": float(scale),
                "output_is_dropped_plus_bias": bool(torch.equal(good, dropped + bias)),
                "nmse_quant": n_quant,
                "nmse_dropped": metrics.nmse(truth, dropped.double()),
                "nmse_predicted": n_quant + bias_power / float(truth.pow(2).sum()),
                "sqnr_dropped_db": metrics.sqnr_db(truth, dropped.double()),
            }
        )
    return rows


def epilogue_summary(rows_by_dtype: dict[str, Sequence[dict[str, object]]]) -> str:
    """One sentence, computed from :func:`bias_sweep` rows (emulation, ``"output"`` epilogue,
    bias scale > 0) per dtype: the range of the epilogue-order difference (RMS relative to
    RMS(y)) and how many times smaller it is than the NVFP4 error (sqrt NMSE) at the same bias,
    e.g. ``"bfloat16: 9.1e-04 to 2.6e-03 of RMS(y), 8× to 51× below the NVFP4 error"``."""
    parts = []
    for dtype_name, rows in rows_by_dtype.items():
        sel = [r for r in rows if r["mode"] == BiasMode.OUTPUT and r["backend"] == Backend.EMULATION
               and float(r["bias_scale"]) > 0]  # type: ignore[arg-type]
        if not sel:
            continue
        diffs = [float(r["epilogue_rel_rms"]) for r in sel]  # type: ignore[arg-type]
        ratios = [math.sqrt(float(r["nmse"])) / d for r, d in zip(sel, diffs, strict=True)  # type: ignore[arg-type]
                  if d > 0]
        below = (f", {min(ratios):.0f}× to {max(ratios):.0f}× below the NVFP4 error at the same "
                 f"bias" if ratios else "")
        parts.append(f"{dtype_name}: {min(diffs):.1e} to {max(diffs):.1e} of RMS(y){below}")
    if not parts:
        return "no emulation rows with a bias"
    return "Epilogue order, measured: " + "; ".join(parts) + "."


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------


def _xs(scales: Sequence[float]) -> list[float]:
    """Bias scales for a log axis: 0 is drawn at a tenth of the smallest positive scale."""
    positive = [s for s in scales if s > 0]
    floor = min(positive) / 10 if positive else 1e-3
    return [s if s > 0 else floor for s in scales]


def plot_sqnr_vs_bias(
    rows: Sequence[dict[str, object]], backend: str = Backend.EMULATION
) -> Figure:
    """SQNR (dB) vs bias size for each epilogue of ``backend``, with the float layer."""
    fig, ax = new_figure(
        f"Layer output SQNR vs bias size ({backend})",
        "bias RMS / RMS(x·Wᵀ) (unitless, log scale; 0 drawn at the left edge)",
        "SQNR vs exact float layer (dB)",
        figsize=(9.0, 4.2),
    )
    styles = (
        ("float", ":"), (BiasMode.FP32, "-"), (BiasMode.OUTPUT, "--"), (BiasMode.DROPPED, "-")
    )
    for mode, style in styles:
        sel = [r for r in rows if r["mode"] == mode and r["backend"] in (backend, "float")]
        scales = [float(r["bias_scale"]) for r in sel]  # type: ignore[arg-type]
        ax.plot(_xs(scales), [r["sqnr_db"] for r in sel], style, marker="o",
                label=_MODE_LABELS[mode])
    ax.set_xscale("log")
    legend_outside(ax)
    return fig


def plot_epilogue_rounding(rows_by_dtype: dict[str, Sequence[dict[str, object]]]) -> Figure:
    """RMS(out_output - out_fp32) / RMS(y) vs bias size, one line per dtype (emulation), with
    the NVFP4 error itself (sqrt of the NMSE vs the float layer) dashed for comparison. Bias
    scale 0 (no bias, no epilogue difference) is left out."""
    fig, ax = new_figure(
        "Extra error of adding the bias after rounding (emulation)",
        "bias RMS / RMS(x·Wᵀ) (unitless, log scale)",
        "error RMS / RMS(y) (unitless, log scale)",
        figsize=(9.0, 4.2),
    )
    for dtype_name, rows in rows_by_dtype.items():
        sel = [
            r for r in rows
            if r["mode"] == BiasMode.OUTPUT and r["backend"] == Backend.EMULATION
            and r["bias_scale"] > 0  # type: ignore[operator]
        ]
        scales = [float(r["bias_scale"]) for r in sel]  # type: ignore[arg-type]
        line = ax.plot(
            scales, [r["epilogue_rel_rms"] for r in sel], marker="o",
            label=f"{dtype_name}: output − fp32 epilogue",
        )[0]
        ax.plot(
            scales, [math.sqrt(float(r["nmse"])) for r in sel], "--", color=line.get_color(),  # type: ignore[arg-type]
            label=f"{dtype_name}: NVFP4 W4A4 error vs float layer",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    legend_outside(ax)  # off the lines: the text asks to compare them
    return fig


# --------------------------------------------------------------------------------------------
# explorer


def bias_text(layer: BiasLayer, bias_scale: float, mode: str, backend: str) -> str:
    """SQNR/NMSE of the NVFP4 layer vs the exact float layer for one bias size and epilogue."""
    bias = layer.bias(bias_scale)
    truth = layer.truth(bias)
    out = run_layer(layer, bias_scale, backend=backend, bias_mode=mode)
    ceiling = torch.nn.functional.linear(layer.x, layer.weight, bias)
    dtype = str(layer.x.dtype).removeprefix("torch.")
    return "\n".join([
        f"bias RMS = {bias_scale:.3g} × RMS(x·Wᵀ) = {bias_scale * layer.gemm_rms:.3g}; "
        f"epilogue {str(mode)!r}, backend {str(backend)!r}",
        f"SQNR vs float layer: {metrics.sqnr_db(truth, out.double()):.2f} dB | "
        f"NMSE {metrics.nmse(truth, out.double()):.3e}",
        f"float layer in {dtype} (ceiling): {metrics.sqnr_db(truth, ceiling.double()):.2f} dB",
    ])


def bias_explorer(
    layer: BiasLayer, *, backends: Sequence[str] = (Backend.EMULATION, Backend.W4A16)
) -> ipywidgets.VBox:
    """Bias size, epilogue (``bias_mode``) and backend → SQNR of ``layer`` (from
    :func:`make_layer`) against the exact float layer (notebook 02)."""
    import ipywidgets as widgets

    scale = widgets.FloatLogSlider(
        value=1.0, base=10, min=-2, max=1.5, step=0.1, description="bias scale",
        continuous_update=False,
    )
    mode = widgets.Dropdown(
        options=[str(m) for m in BiasMode], value=str(BiasMode.OUTPUT), description="bias_mode"
    )
    backend = widgets.Dropdown(options=[str(b) for b in backends], description="backend")
    return explorer(
        widgets,
        [scale, mode, backend],
        lambda: (text_output(bias_text(layer, scale.value, mode.value, backend.value),
                             "The NVFP4 layer against the exact float layer"),),
    )
