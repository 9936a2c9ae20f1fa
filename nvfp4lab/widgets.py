"""ipywidgets explorers behind the ``if INTERACTIVE:`` cell of each notebook.

Each explorer imports ipywidgets inside itself (the ``notebooks`` extra), builds its controls and
an ``Output``, and returns them in a ``VBox``; the notebook displays it. Every update goes
through a plain function (``_rounding_text``, ``_bias_text``, ``_roofline_table``,
``_format_text``) that tests call without a kernel. Updates replace ``Output.outputs`` directly,
so nothing is printed and the result is visible outside a live kernel too.

=====================  ===========================  =============================================
explorer               notebook                     controls → shown
=====================  ===========================  =============================================
``rounding_explorer``  ``01_format_tour``           value, E4M3 block scale → E2M1 rounding
``bias_explorer``      ``02_bias_study``            bias size, epilogue, backend → SQNR
``roofline_explorer``  ``03_throughput``            GPU, model, M → modeled time per layer/path
``format_explorer``    ``04_formats``               config, distribution, magnitude → NMSE, SQNR
=====================  ===========================  =============================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nvfp4lab.constants import E2M1_MAX, E2M1_VALUES

if TYPE_CHECKING:  # pragma: no cover
    import ipywidgets
    import pandas as pd

    from nvfp4lab.bias_study import BiasLayer
    from nvfp4lab.format_study import StudyConfig

__all__ = [
    "bias_explorer",
    "format_explorer",
    "roofline_explorer",
    "rounding_explorer",
]

Outputs = tuple[dict[str, Any], ...]

# --------------------------------------------------------------------------------------------
# shared plumbing
# --------------------------------------------------------------------------------------------


def _stream(text: str, name: str = "stdout") -> dict[str, Any]:
    """One notebook stream output (what ``print`` would have produced)."""
    return {"output_type": "stream", "name": name, "text": text.rstrip("\n") + "\n"}


def _table(frame: pd.DataFrame, float_format: str = "{:.4g}") -> dict[str, Any]:
    """One notebook display output holding ``frame`` as plain text and HTML."""
    fmt = float_format.format
    return {
        "output_type": "display_data",
        "data": {
            "text/plain": frame.to_string(float_format=fmt),
            "text/html": frame.to_html(float_format=fmt),
        },
        "metadata": {},
    }


def _explorer(
    widgets: Any, controls: Sequence[ipywidgets.Widget], render: Callable[[], Outputs]
) -> ipywidgets.VBox:
    """``VBox(controls + [Output])``; ``render()`` fills the Output now and on every change.

    An exception from ``render`` is shown in the Output (stderr) instead of being lost in the
    widget callback.
    """
    out = widgets.Output()

    def refresh(_change: object = None) -> None:
        try:
            out.outputs = render()
        except Exception as exc:  # shown to the user, not raised into the comm handler
            out.outputs = (_stream(f"{type(exc).__name__}: {exc}", "stderr"),)

    for control in controls:
        control.observe(refresh, names="value")
    refresh()
    return widgets.VBox([*controls, out])


# --------------------------------------------------------------------------------------------
# 01: E2M1 rounding
# --------------------------------------------------------------------------------------------

#: The signed E2M1 grid, ascending, with one zero: -6 .. -0.5, 0, 0.5 .. 6.
_GRID: tuple[float, ...] = (*(-v for v in reversed(E2M1_VALUES[1:])), *E2M1_VALUES)


@dataclass(frozen=True)
class RoundingInfo:
    """Where one value lands: ``scaled = x / block_scale`` is what the element codec rounds.

    ``lower``/``upper`` are the signed grid points bracketing ``scaled`` (clamped to ±6), equal
    when it sits on a grid point; ``tie`` is True at their midpoint; ``element`` is the E2M1
    value of ``code`` (-0.0 for code 8) and ``dequantized = element * block_scale``.
    """

    x: float
    block_scale: float
    scaled: float
    lower: float
    upper: float
    tie: bool
    saturated: bool
    code: int
    element: float
    dequantized: float


def _rounding_info(x: float, block_scale: float = 1.0) -> RoundingInfo:
    """E2M1 rounding of ``x`` in a block with decode scale ``block_scale`` (global scale 1)."""
    import torch

    from nvfp4lab.e2m1 import decode_e2m1, encode_e2m1

    if not (math.isfinite(x) and math.isfinite(block_scale) and block_scale > 0):
        raise ValueError(
            f"need a finite x and a finite block_scale > 0, got x={x}, block_scale={block_scale}"
        )
    scaled = x / block_scale
    clamped = min(max(scaled, -E2M1_MAX), E2M1_MAX)
    lower = max(g for g in _GRID if g <= clamped)
    upper = min(g for g in _GRID if g >= clamped)
    # float64 rounds without a narrowing step, so ties stay ties
    code = int(encode_e2m1(torch.tensor([scaled], dtype=torch.float64))[0])
    element = float(decode_e2m1(torch.tensor([code], dtype=torch.uint8), torch.float64)[0])
    return RoundingInfo(
        x=x,
        block_scale=block_scale,
        scaled=scaled,
        lower=lower,
        upper=upper,
        tie=lower != upper and clamped == (lower + upper) / 2,
        saturated=abs(scaled) > E2M1_MAX,
        code=code,
        element=element,
        dequantized=element * block_scale,
    )


def _rounding_text(x: float, block_scale: float = 1.0) -> str:
    """What :func:`rounding_explorer` shows for one value and block scale."""
    r = _rounding_info(x, block_scale)
    lines = [f"x = {r.x:+.4g} with block scale s = {r.block_scale:g}  →  x/s = {r.scaled:+.6g}"]
    if r.saturated:
        lines.append(f"beyond ±{E2M1_MAX:g}: saturates to {r.element:+g}")
    elif r.lower == r.upper:
        i = _GRID.index(r.lower)
        below = f"{_GRID[i - 1]:+g}" if i > 0 else "none"
        above = f"{_GRID[i + 1]:+g}" if i + 1 < len(_GRID) else "none"
        lines.append(f"on the grid point {r.lower:+g} (neighbours {below} and {above})")
    else:
        mid = (r.lower + r.upper) / 2
        where = "a tie, so it rounds to the even code" if r.tie else (
            "rounds down" if r.element == r.lower else "rounds up")
        lines.append(
            f"between grid points {r.lower:+g} and {r.upper:+g} (midpoint {mid:+g}): {where}"
        )
    c = r.code
    bits = f"{c >> 3:b}|{(c >> 1) & 3:02b}|{c & 1:b}"
    zero = " (negative zero)" if c == 8 else ""
    lines.append(f"E2M1 {r.element:+g}  →  code {c} = 0b{c:04b}, s|ee|m {bits}{zero}")
    lines.append(
        f"dequantized x̂ = E2M1·s = {r.dequantized:+.6g}, error x̂ − x = {r.dequantized - r.x:+.4g}"
    )
    return "\n".join(lines)


def rounding_explorer(value: float = 1.25, block_scale: float = 1.0) -> ipywidgets.VBox:
    """A value slider and an E4M3 block-scale slider → the value's E2M1 rounding, its code and
    the neighbouring grid points (notebook 01). ``block_scale`` snaps to the nearest E4M3 value."""
    import ipywidgets as widgets

    from nvfp4lab.tour import e4m3_positive_values

    scales = [float(s) for s in e4m3_positive_values()]
    snapped = min(scales, key=lambda s: abs(s - block_scale))
    x = widgets.FloatSlider(
        value=value, min=-7.0, max=7.0, step=0.05, description="x", readout_format="+.2f"
    )
    s = widgets.SelectionSlider(
        options=[(f"{v:g}", v) for v in scales], value=snapped, description="block scale s"
    )
    return _explorer(widgets, [x, s], lambda: (_stream(_rounding_text(x.value, s.value)),))


# --------------------------------------------------------------------------------------------
# 02: bias epilogue
# --------------------------------------------------------------------------------------------


def _bias_text(layer: BiasLayer, bias_scale: float, mode: str, backend: str) -> str:
    """SQNR/NMSE of the NVFP4 layer vs the exact float layer for one bias size and epilogue."""
    import torch

    from nvfp4lab import metrics
    from nvfp4lab.bias_study import run_layer

    bias = layer.bias(bias_scale)
    truth = layer.truth(bias)
    out = run_layer(layer, bias_scale, backend=backend, bias_mode=mode)
    ceiling = torch.nn.functional.linear(layer.x, layer.weight, bias)
    dtype = str(layer.x.dtype).removeprefix("torch.")
    return "\n".join([
        f"bias RMS = {bias_scale:.3g} × RMS(x·Wᵀ) = {bias_scale * layer.gemm_rms:.3g}; "
        f"epilogue {mode!r}, backend {backend!r}",
        f"SQNR vs float layer: {metrics.sqnr_db(truth, out.double()):.2f} dB | "
        f"NMSE {metrics.nmse(truth, out.double()):.3e}",
        f"float layer in {dtype} (ceiling): {metrics.sqnr_db(truth, ceiling.double()):.2f} dB",
    ])


def bias_explorer(
    layer: BiasLayer, *, backends: Sequence[str] = ("emulation", "w4a16")
) -> ipywidgets.VBox:
    """Bias size, epilogue (``bias_mode``) and backend → SQNR of ``layer`` (from
    :func:`nvfp4lab.bias_study.make_layer`) against the exact float layer (notebook 02)."""
    import ipywidgets as widgets

    from nvfp4lab.linear import BIAS_MODES

    scale = widgets.FloatLogSlider(
        value=1.0, base=10, min=-2, max=1.5, step=0.1, description="bias scale",
        continuous_update=False,
    )
    mode = widgets.Dropdown(options=list(BIAS_MODES), value="output", description="bias_mode")
    backend = widgets.Dropdown(options=list(backends), description="backend")
    return _explorer(
        widgets,
        [scale, mode, backend],
        lambda: (_stream(_bias_text(layer, scale.value, mode.value, backend.value)),),
    )


# --------------------------------------------------------------------------------------------
# 03: roofline
# --------------------------------------------------------------------------------------------


def _roofline_caption(gpu: str, model: str, m: int) -> str:
    """Which path ``gpu``'s backend choice takes, and what the table shows."""
    from nvfp4lab import gpus
    from nvfp4lab.dispatch import select_backend
    from nvfp4lab.throughput import BACKEND_TO_PATH

    choice = select_backend(capability=gpus.get(gpu).capability, env={})
    return (
        f"{gpu}: backend {choice.name!r} → path {BACKEND_TO_PATH[choice.name]!r}. "
        f"Modeled (roofline) time per linear layer of one {model} block at M = {m}, µs:"
    )


def _roofline_table(gpu: str, model: str, m: int) -> pd.DataFrame:
    """Modeled time (µs) per linear layer (rows, plus the block total) and path (columns);
    paths ``gpu`` cannot run are absent."""
    from nvfp4lab import gpus
    from nvfp4lab.throughput import layer_frame

    frame = layer_frame(model, gpu, ms=[m])
    table = frame.pivot(index="layer", columns="path", values="time_s") * 1e6
    layers = [s.layer for s in gpus.linear_shapes(model)]
    table = table.reindex(index=layers, columns=[p for p in gpus.PATHS if p in table.columns])
    counts = {s.layer: s.count for s in gpus.linear_shapes(model)}
    table.loc["block total"] = table.mul(list(counts.values()), axis=0).sum()
    table.columns.name = "path"
    return table


def roofline_explorer(
    models: Sequence[str], m_grid: Sequence[int], *, gpu: str = "B200"
) -> ipywidgets.VBox:
    """GPU, model and tokens M → modeled time of each linear layer per path (notebook 03)."""
    import ipywidgets as widgets

    from nvfp4lab import gpus

    names = list(gpus.CATALOGUE)
    if not models or not m_grid:
        raise ValueError(f"need at least one model and one M, got {models!r} and {m_grid!r}")
    g = widgets.Dropdown(options=names, value=gpus.get(gpu).name, description="GPU")
    model = widgets.Dropdown(options=list(models), description="model")
    m = widgets.SelectionSlider(
        options=list(m_grid), value=m_grid[len(m_grid) // 2], description="tokens M"
    )

    def render() -> Outputs:
        return (
            _stream(_roofline_caption(g.value, model.value, m.value)),
            _table(_roofline_table(g.value, model.value, m.value)),
        )

    return _explorer(widgets, [g, model, m], render)


# --------------------------------------------------------------------------------------------
# 04: formats
# --------------------------------------------------------------------------------------------


def _format_row(
    config: StudyConfig,
    distribution: str,
    log10_magnitude: float,
    *,
    seed: int,
    df: int,
    shape: Sequence[int] = (256, 1024),
) -> dict[str, Any]:
    """:func:`nvfp4lab.format_study.error_rows` row of ``config`` on seeded ``distribution`` data
    scaled by ``10**log10_magnitude``."""
    from nvfp4lab import format_study as fs

    x = fs.sample(distribution, shape, seed=seed, df=df) * 10.0**log10_magnitude
    return fs.error_rows(x, [config], distribution)[0]


def _format_text(
    config: StudyConfig,
    distribution: str,
    log10_magnitude: float,
    *,
    seed: int,
    df: int,
    shape: Sequence[int] = (256, 1024),
) -> str:
    """What :func:`format_explorer` shows for one configuration, distribution and magnitude."""
    row = _format_row(config, distribution, log10_magnitude, seed=seed, df=df, shape=shape)
    data = f"{distribution}{f'(ν={df})' if distribution == 'student_t' else ''}"
    return (
        f"{config.label} on {data} × 10^{log10_magnitude:g} ({shape[0]}×{shape[1]}): "
        f"NMSE {row['nmse']:.3e} | SQNR {row['sqnr_db']:.2f} dB | "
        f"{row['bits']:.3f} bits/element"
    )


def format_explorer(
    configs: Sequence[StudyConfig],
    *,
    seed: int,
    df: int,
    shape: Sequence[int] = (256, 1024),
) -> ipywidgets.VBox:
    """Format configuration, distribution and data magnitude → NMSE, SQNR and storage bits
    (notebook 04; ``configs`` from :func:`nvfp4lab.format_study.default_configs`)."""
    import ipywidgets as widgets

    from nvfp4lab.format_study import DISTRIBUTIONS

    if not configs:
        raise ValueError("format_explorer needs at least one config; pass default_configs(seed)")
    by_label = {c.label: c for c in configs}
    label = widgets.Dropdown(options=list(by_label), description="config")
    dist = widgets.Dropdown(options=list(DISTRIBUTIONS), description="distribution")
    mag = widgets.FloatSlider(
        value=0.0, min=-5.0, max=5.0, step=0.5, description="log10 |x| scale",
        continuous_update=False,
    )
    return _explorer(
        widgets,
        [label, dist, mag],
        lambda: (_stream(_format_text(by_label[label.value], dist.value, mag.value, seed=seed,
                                      df=df, shape=shape)),),
    )
