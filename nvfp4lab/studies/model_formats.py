"""Notebook 05, formats part: all-MiniLM-L6-v2 through every NVFP4 path and bias epilogue, every
comparator format and NVFP4 option, on its real weights and its real activations.

Configurations (:class:`ModelConfig`) are of two kinds. An NVFP4 *path* is the real thing:
:func:`~nvfp4lab.execution.whole_model.quantize_model` with a backend ("w4a16", or "emulation" =
W4A4)
and a bias epilogue ("output", "fp32", or the seed's bug "dropped"). A *format* configuration
fake-quantizes every Linear weight with a :class:`~nvfp4lab.studies.number_formats.StudyConfig` and,
for "W+A", every Linear input too (forward pre-hooks, a dynamic per-call tensor scale); 16×16
weight tiles quantize activations with plain 16-element blocks (a tile would mix tokens).
Activations are captured with forward hooks while the model embeds the project's own
:data:`~nvfp4lab.studies.model_fidelity.SENTENCES` (padding tokens left out).

Measured on the 32 sentences (float32 CPU; notebook 05): NVFP4 w4a16 mean cosine to float
0.9767 (paraphrase recall 0.958), W4A4 emulation 0.9667 with the bias added after the GEMM or in
float32 (the two agree to 1e-4), 0.703 (min 0.52) with the bias dropped, the seed's bug. Per
layer, weights are Gaussian-like (every format at its N(0,1) NMSE) while activations are not:
the FFN inputs carry one channel 13-18× the median channel's RMS (channel 99 in blocks 0-1, 223
in blocks 2-5), the FFN-output inputs (after GELU) crest factors up to 83 and their weights up
to 175. On the FFN layers' activations INT4-g128's NMSE is 6-9× NVFP4's and MXFP4's 2.5-4.7×
(2.1× and 1.5× at the least outlier-prone layers).
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from nvfp4lab import metrics
from nvfp4lab.execution import DroppedBiasWarning, quantize_model
from nvfp4lab.models import SentenceEncoder
from nvfp4lab.plots import legend_outside, new_figure
from nvfp4lab.studies.explorer import explorer, table_output, text_output
from nvfp4lab.studies.model_fidelity import (
    SENTENCES,
    capture_inputs,
    embedding_fidelity,
    layer_sqnr,
    linear_names,
    paraphrase_recall,
)
from nvfp4lab.studies.number_formats import StudyConfig
from nvfp4lab.vocab import Backend, BiasMode, ScaleSelection

if TYPE_CHECKING:  # pragma: no cover
    import ipywidgets
    from matplotlib.figure import Figure

__all__ = [
    "ModelConfig",
    "bias_rows",
    "config_rows",
    "config_text",
    "format_configs",
    "layer_error_rows",
    "layer_formats",
    "layer_table",
    "model_explorer",
    "outlier_rows",
    "path_configs",
    "plot_bias_modes",
    "plot_configs",
    "plot_layer_errors",
    "plot_outliers",
    "plot_per_layer",
    "short_name",
    "weight_bits",
]

_BERT_PARTS = (
    (r"attention\.self\.(query|key|value)$", r"\1"),
    (r"attention\.output\.dense$", "attn_out"),
    (r"intermediate\.dense$", "ffn_in"),
    (r"output\.dense$", "ffn_out"),
)


def short_name(name: str) -> str:
    """``encoder.layer.3.attention.self.query`` → ``3.query`` (``attn_out``, ``ffn_in``,
    ``ffn_out``; ``pooler.dense`` → ``pooler``); other names unchanged."""
    if name == "pooler.dense":
        return "pooler"
    found = re.match(r"encoder\.layer\.(\d+)\.(.*)$", name)
    if found:
        for pattern, repl in _BERT_PARTS:
            part = re.search(pattern, found.group(2))
            if part:
                return f"{found.group(1)}.{part.expand(repl)}"
    return name


# --------------------------------------------------------------------------------------------
# configurations
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """One way to run the model: an NVFP4 path (``backend`` set) or a format's fake-quantization
    of the weights (and, when ``activations`` is set, of every Linear input)."""

    label: str
    weights: StudyConfig | None = None
    activations: StudyConfig | None = None
    backend: str | None = None
    bias_mode: str = BiasMode.OUTPUT

    @property
    def kind(self) -> str:
        return "nvfp4 path" if self.backend is not None else "format"

    def build(self, fp: SentenceEncoder) -> SentenceEncoder:
        """A quantized copy of ``fp`` (the float encoder is left untouched)."""
        model = copy.deepcopy(fp.model)
        if self.backend is not None:
            quantize_model(model, backend=self.backend, bias_mode=self.bias_mode,
                           share_global_scale="bert", cache_dequantized=True)
            return fp.with_model(model)
        with torch.no_grad():
            for name in linear_names(model):
                linear = model.get_submodule(name)
                if self.weights is not None:
                    linear.weight.copy_(self.weights.fake_quantize(linear.weight))
                if self.activations is not None:
                    fq = self.activations.fake_quantize
                    linear.register_forward_pre_hook(lambda _m, args, fq=fq: (fq(args[0]),))
        return fp.with_model(model)


def path_configs() -> list[ModelConfig]:
    """NVFP4 for real: weight-only, and W4A4 emulation with each bias epilogue."""
    return [
        ModelConfig("nvfp4 w4a16", backend=Backend.W4A16),
        *(ModelConfig(f"nvfp4 W4A4 emulation, bias {mode}", backend=Backend.EMULATION,
                      bias_mode=mode) for mode in BiasMode),
    ]


def layer_formats(seed: int = 0, *, fast: bool = False) -> list[StudyConfig]:
    """The formats compared on the model: NVFP4 and its options, MXFP4, INT4-g128, FP8, BF16
    (``fast`` drops ``mse_search``, the slowest)."""
    configs = [
        StudyConfig("nvfp4", "nvfp4"),
        StudyConfig("nvfp4 four_over_six", "nvfp4",
                    {"scale_selection": ScaleSelection.FOUR_OVER_SIX}),
        StudyConfig("nvfp4 mse_search", "nvfp4", {"scale_selection": ScaleSelection.MSE_SEARCH}),
        StudyConfig("nvfp4 hadamard", "nvfp4", {"hadamard": seed}),
        StudyConfig("nvfp4 16×16 blocks", "nvfp4", {"block_size": (16, 16)}),
        StudyConfig("mxfp4", "mxfp4"),
        StudyConfig("int4_g128", "int4_g128"),
        StudyConfig("fp8_e4m3", "fp8_e4m3"),
        StudyConfig("bf16", "bf16"),
    ]
    return [c for c in configs if not (fast and c.label == "nvfp4 mse_search")]


def _for_activations(config: StudyConfig) -> StudyConfig:
    """Activations get 1-D blocks: a 2-D tile would mix tokens."""
    if isinstance(config.options.get("block_size"), tuple):
        options = {k: v for k, v in config.options.items() if k != "block_size"}
        return replace(config, options=options)
    return config


def format_configs(
    seed: int = 0, *, fast: bool = False, formats: Sequence[StudyConfig] | None = None
) -> list[ModelConfig]:
    """Each format (default: :func:`layer_formats`) on the weights only ("W") and on weights
    and activations ("W+A")."""
    out = []
    for cfg in layer_formats(seed, fast=fast) if formats is None else formats:
        out.append(ModelConfig(f"{cfg.label} W", weights=cfg))
        out.append(ModelConfig(f"{cfg.label} W+A", weights=cfg, activations=_for_activations(cfg)))
    return out


def weight_bits(fp: SentenceEncoder, cfg: ModelConfig) -> float:
    """Storage of ``cfg``'s weights in bits per weight over every Linear of ``fp``: each weight's
    ``storage_bits`` for its own shape and options (16×16 tiles share one scale per 256 values:
    4.031 bits, not 4.5), weighted by its size. An NVFP4 path stores plain NVFP4."""
    weights = cfg.weights if cfg.weights is not None else StudyConfig("nvfp4", "nvfp4")
    shapes = [tuple(fp.model.get_submodule(n).weight.shape) for n in linear_names(fp.model)]
    total = sum(math.prod(s) for s in shapes)
    return sum(weights.bits(s) * math.prod(s) for s in shapes) / total


def config_rows(
    fp: SentenceEncoder,
    configs: Sequence[ModelConfig],
    sentences: Sequence[str] = SENTENCES,
    *,
    keep: dict[str, SentenceEncoder] | None = None,
) -> list[dict[str, Any]]:
    """One row per configuration: embedding cosine to float (mean, min, ``cosine_gap`` =
    1 − mean), paraphrase recall, nearest-neighbour agreement, weight bits/element
    (:func:`weight_bits`). ``keep``: a dict that receives each built encoder by label (for
    :func:`bias_rows`)."""
    rows = []
    for cfg in configs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DroppedBiasWarning)  # the bug, reproduced on purpose
            enc = cfg.build(fp)
            if keep is not None:
                keep[cfg.label] = enc
            fidelity = embedding_fidelity(fp, enc, sentences)
            recall = paraphrase_recall(enc, sentences) if sentences == SENTENCES else math.nan
        bits = weight_bits(fp, cfg)
        quantized_inputs = cfg.activations is not None or cfg.backend == Backend.EMULATION
        rows.append({
            "label": cfg.label, "kind": cfg.kind, "weight_bits": bits,
            "activations": "quantized" if quantized_inputs else "float",
            "cosine_mean": fidelity.mean, "cosine_min": fidelity.min,
            "cosine_gap": 1.0 - fidelity.mean, "recall": recall,
            "neighbor_agreement": fidelity.neighbor_agreement,
        })
    return rows


# --------------------------------------------------------------------------------------------
# real weights and activations, layer by layer
# --------------------------------------------------------------------------------------------


def _crest(x: torch.Tensor) -> float:
    """amax / RMS: how far the largest value sits above the typical one."""
    x = x.to(torch.float64)
    return float(x.abs().max() / x.square().mean().sqrt())


def layer_error_rows(
    fp: SentenceEncoder,
    configs: Sequence[StudyConfig],
    sentences: Sequence[str] = SENTENCES,
    *,
    acts: dict[str, torch.Tensor] | None = None,
    layers: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """One row per (Linear layer, format): ``weight_nmse`` of the layer's real weight,
    ``activation_nmse`` of its real inputs (``acts``, default :func:`capture_inputs` on
    ``sentences``), in module order (``index``); ``layers``: a subset (default: every Linear)."""
    acts = capture_inputs(fp, sentences) if acts is None else acts
    wanted = set(linear_names(fp.model) if layers is None else layers)
    rows = []
    for index, name in enumerate(linear_names(fp.model)):
        if name not in wanted:
            continue
        w = fp.model.get_submodule(name).weight.detach()
        x = acts[name]
        for cfg in configs:
            rows.append({
                "index": index, "layer": name, "short": short_name(name), "format": cfg.label,
                "weight_nmse": metrics.nmse(w, cfg.fake_quantize(w)),
                "activation_nmse": metrics.nmse(x, _for_activations(cfg).fake_quantize(x)),
            })
    return rows


def outlier_rows(
    fp: SentenceEncoder,
    sentences: Sequence[str] = SENTENCES,
    *,
    acts: dict[str, torch.Tensor] | None = None,
) -> list[dict[str, Any]]:
    """Where the outliers sit, per Linear layer: crest factors (amax/RMS) of the weight and of
    the input activations, the input channel with the largest RMS and its RMS over the median
    channel's (``channel_ratio``)."""
    acts = capture_inputs(fp, sentences) if acts is None else acts
    rows = []
    for index, name in enumerate(linear_names(fp.model)):
        w = fp.model.get_submodule(name).weight.detach()
        x = acts[name].to(torch.float64)
        channel_rms = x.square().mean(0).sqrt()
        rows.append({
            "index": index, "layer": name, "short": short_name(name),
            "weight_crest": _crest(w), "activation_crest": _crest(x),
            "top_channel": int(channel_rms.argmax()),
            "channel_ratio": float(channel_rms.max() / channel_rms.median()),
        })
    return rows


def bias_rows(
    fp: SentenceEncoder,
    sentences: Sequence[str] = SENTENCES,
    *,
    built: Mapping[str, SentenceEncoder] | None = None,
) -> list[dict[str, Any]]:
    """Per-layer output SQNR (dB, errors propagated, padding left out) of W4A4 emulation with
    each bias epilogue: one row per (layer, bias mode). ``built``: encoders already built by
    :func:`config_rows` (``keep=``), by label; missing ones are built here."""
    rows = []
    for cfg in path_configs()[1:]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DroppedBiasWarning)
            enc = built[cfg.label] if built and cfg.label in built else cfg.build(fp)
            sqnr = layer_sqnr(fp, enc, sentences, mode="propagated", mask_padding=True)
        for index, (name, db) in enumerate(sqnr.sqnr_db.items()):
            rows.append({"index": index, "layer": name, "short": short_name(name),
                         "bias_mode": cfg.bias_mode, "sqnr_db": db})
    return rows


# --------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------


def _layer_axis(ax: Any, rows: Sequence[dict[str, Any]]) -> None:
    ticks = {r["index"]: r["short"] for r in rows}
    ax.set_xticks(list(ticks), list(ticks.values()), rotation=90, fontsize=7)


_MARKERS = (".", "s", "^", "v", "D", "x", "+", "o", "*", "<", ">", "p")
#: Added after the style's colour cycle when a figure has more series than it holds.
_EXTRA_COLOURS = ("#7f7f7f", "#8c564b", "#bcbd22", "#17becf", "#9467bd", "#e377c2", "#2ca02c",
                  "#d62728", "#1f77b4", "#ff7f0e")


def _distinct_colours(n: int) -> list[str]:
    """``n`` different colours: the active style's cycle first, then fixed extras (the cycle
    alone repeats after 8, which gave nvfp4 and the 9th format, bf16, one colour)."""
    import matplotlib as mpl

    cycle = [c["color"] for c in mpl.rcParams["axes.prop_cycle"] if "color" in c]
    pool = list(dict.fromkeys([*cycle, *_EXTRA_COLOURS]))
    if n > len(pool):
        raise ValueError(f"{n} series need more than {len(pool)} distinct colours")
    return pool[:n]


def plot_per_layer(
    rows: Sequence[dict[str, Any]], *, series: str, value: str, title: str, ylabel: str
) -> Figure:
    """One line per distinct ``row[series]`` of ``row[value]`` over the Linear layers in module
    order (``row["index"]``, ticks ``row["short"]``), log y axis."""
    fig, ax = new_figure(
        title, "Linear layer (block.part, module order)", ylabel, figsize=(10.0, 4.5),
        yscale="log",
    )
    labels = list(dict.fromkeys(r[series] for r in rows))
    for label, colour, marker in zip(labels, _distinct_colours(len(labels)),
                                     _MARKERS * len(labels), strict=False):
        mine = [r for r in rows if r[series] == label]
        ax.plot([r["index"] for r in mine], [r[value] for r in mine], marker=marker,
                markersize=4, color=colour, label=label)
    _layer_axis(ax, rows)
    legend_outside(ax, fontsize=7)  # off the curves the text compares
    return fig


def plot_layer_errors(rows: Sequence[dict[str, Any]], quantity: str = "weight_nmse") -> Figure:
    """NMSE per layer (module order), one line per format; ``quantity``: "weight_nmse" or
    "activation_nmse"."""
    what = {"weight_nmse": "weights", "activation_nmse": "input activations"}[quantity]
    return plot_per_layer(
        rows, series="format", value=quantity,
        title=f"MiniLM: quantization error of each Linear layer's {what}, by format",
        ylabel="NMSE (unitless, log scale)",
    )


def plot_outliers(rows: Sequence[dict[str, Any]]) -> Figure:
    """Crest factors (amax/RMS) of each layer's weight and input, and the largest channel's RMS
    over the median channel's."""
    fig, ax = new_figure(
        "MiniLM: where the outliers sit (crest factor = amax / RMS)",
        "Linear layer (block.part, module order)",
        "ratio (unitless, log scale)",
        figsize=(10.0, 4.0),
        yscale="log",
    )
    x = [r["index"] for r in rows]
    ax.plot(x, [r["weight_crest"] for r in rows], marker="o", label="weight crest factor")
    ax.plot(x, [r["activation_crest"] for r in rows], marker="s", label="input crest factor")
    ax.plot(x, [r["channel_ratio"] for r in rows], marker="^",
            label="largest input channel RMS / median channel RMS")
    _layer_axis(ax, rows)
    legend_outside(ax, fontsize=8)
    return fig


def plot_configs(rows: Sequence[dict[str, Any]]) -> Figure:
    """Horizontal bars: 1 − mean embedding cosine to float per configuration (log scale),
    paraphrase recall written next to each bar."""
    fig, ax = new_figure(
        "MiniLM: embedding error per configuration (lower is better; recall at the bar's end)",
        "1 − mean cosine(float, quantized) (unitless, log scale)",
        "configuration",
        figsize=(9.0, 0.28 * len(rows) + 1.5),
        xscale="log",
    )
    gaps = [max(r["cosine_gap"], 1e-9) for r in rows]
    colors = ["C3" if r["kind"] == "nvfp4 path" else "C0" for r in rows]
    ax.barh(range(len(rows)), gaps, color=colors)
    for i, r in enumerate(rows):
        ax.text(gaps[i], i, f" recall {r['recall']:.2f}", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    return fig


def plot_bias_modes(rows: Sequence[dict[str, Any]]) -> Figure:
    """Per-layer output SQNR of W4A4 emulation with the bias added ("output", "fp32") vs
    dropped (the seed's bug)."""
    fig, ax = new_figure(
        "MiniLM W4A4 emulation: bias added vs dropped, error propagated through the encoder",
        "Linear layer (block.part, module order)",
        "output SQNR vs float (dB, higher is better)",
        figsize=(10.0, 4.0),
    )
    for mode in dict.fromkeys(r["bias_mode"] for r in rows):
        mine = [r for r in rows if r["bias_mode"] == mode]
        ax.plot([r["index"] for r in mine], [r["sqnr_db"] for r in mine], marker=".",
                linestyle="--" if mode == BiasMode.FP32 else "-", label=f"bias {mode}")
    _layer_axis(ax, rows)
    legend_outside(ax)
    return fig


# --------------------------------------------------------------------------------------------
# explorer
# --------------------------------------------------------------------------------------------


def layer_table(rows: Sequence[dict[str, Any]], layer: str) -> Any:
    """pandas DataFrame: the formats' weight and activation NMSE on one layer (short name)."""
    import pandas as pd

    mine = [r for r in rows if r["short"] == layer]
    if not mine:
        raise ValueError(f"no rows for layer {layer!r}; pick one of the layer_error_rows")
    return pd.DataFrame(mine).set_index("format")[["weight_nmse", "activation_nmse"]]


def config_text(row: dict[str, Any]) -> str:
    """One line for one :func:`config_rows` row."""
    return (
        f"{row['label']} ({row['kind']}, activations {row['activations']}): cosine to float "
        f"mean {row['cosine_mean']:.4f}, min {row['cosine_min']:.4f} | paraphrase recall "
        f"{row['recall']:.3f} | nearest-neighbour agreement {row['neighbor_agreement']:.3f}"
    )


def model_explorer(
    fp: SentenceEncoder,
    formats: Sequence[StudyConfig],
    configs: Sequence[ModelConfig],
    *,
    layer_rows: Sequence[dict[str, Any]] = (),
    model_rows: Sequence[dict[str, Any]] = (),
) -> ipywidgets.VBox:
    """Pick a layer (every format's error on its real weight and inputs) and a configuration
    (embedding fidelity, recall) of MiniLM ``fp`` (notebook 05).

    Needs only the notebook's setup cell: a pick not found in ``layer_rows`` / ``model_rows``
    (rows the later cells computed, when they ran) is computed on first use and kept — one
    layer's errors in about a second (the inputs are captured once), one configuration in a few
    seconds."""
    import ipywidgets as widgets

    if not formats or not configs:
        raise ValueError("model_explorer needs formats (layer_formats) and configs")
    names = linear_names(fp.model)
    shorts = {short_name(n): n for n in names}
    by_layer: dict[str, list[dict[str, Any]]] = {}
    for row in layer_rows:
        by_layer.setdefault(row["short"], []).append(row)
    by_label = {r["label"]: r for r in model_rows}
    by_config = {c.label: c for c in configs}
    acts: dict[str, torch.Tensor] = {}
    layer = widgets.Dropdown(options=list(shorts), description="layer")
    config = widgets.Dropdown(options=list(by_config), description="config")

    def layer_error(short: str) -> list[dict[str, Any]]:
        if short not in by_layer:
            if not acts:
                acts.update(capture_inputs(fp))
            by_layer[short] = layer_error_rows(fp, formats, acts=acts, layers=[shorts[short]])
        return by_layer[short]

    def model_row(label: str) -> dict[str, Any]:
        if label not in by_label:
            (by_label[label],) = config_rows(fp, [by_config[label]])
        return by_label[label]

    def render() -> tuple[dict[str, Any], ...]:
        return (table_output(layer_table(layer_error(layer.value), layer.value), "{:.3e}",
                             f"Layer {layer.value} ({shorts[layer.value]}): every format's NMSE "
                             "on its weight and its inputs"),
                text_output(config_text(model_row(config.value)),
                            f"Configuration {config.value}: embedding fidelity on the whole "
                            "model"))

    return explorer(widgets, [layer, config], render)
