"""llama.cpp's naive NVFP4 against NVFP4 with a tensor scale, on SmolLM2 (notebook 07).

llama.cpp quantizes to NVFP4 (ggml type 40) with ``quantize_row_nvfp4_ref`` (nvfp4lab's
``convention="llama.cpp"``, :mod:`nvfp4lab.orders`): no tensor scale, so the E4M3 block scales
alone must cover the weights' range, and a block whose max is below ``6 * 2**-10`` quantizes to
zeros. A GGUF converted from a ModelOpt or compressed-tensors checkpoint instead keeps that
checkpoint's block bytes and carries its tensor scale beside them (the ``<name>.scale`` sidecar
of convert_hf_to_gguf.py, llama.cpp PRs #21095, #22897), which the graph multiplies in. llama.cpp
#22858 reports that a "naive" NVFP4 GGUF "suffers greatly in quality"; this module measures the
gap. Three configurations, each W4A16 round to nearest (RTN) on every Linear of the decoder
blocks (``lm_head`` and the embeddings stay float), global scales shared by q/k/v and gate/up as
``quantize_model`` does by default:

* ``llama.cpp naive``: ``convention="llama.cpp"``, ggml's quantizer as it is (tensor scale 1);
* ``llama.cpp + tensor scale``: the same quantizer run on ``W * gs`` with ``gs = 2688/amax``
  (:data:`LLAMA_CPP_PRESCALED`, an order given as data: llama.cpp's with the kernel order's
  tensor-scale rule), decoded divided by ``gs``: it separates what the tensor scale buys from
  ggml's own rounding (round-half-up UE4M3 scales, 448 from 248 on, ties to the smaller code);
* ``converter (modelopt order)``: what a converted checkpoint holds: ModelOpt's arithmetic with
  its DECODE scale ``d = amax/2688`` kept, decoded ``value * f32(s * d)`` (llama.cpp multiplies
  the product by ``d`` after the dot product instead; the difference is float32 rounding).

:func:`weight_rows` gives each layer's weight NMSE and its block-scale census (vanished,
E4M3-subnormal, saturated at 448) per configuration, :func:`layer_kind_rows` a summary per layer
kind, and :func:`study_rows` one row per configuration: the overall weight NMSE (all decoder
weights' squared error over their energy) with the KLD / perplexity row of
:func:`nvfp4lab.studies.llm_configs.scored_row` on a :class:`~nvfp4lab.studies.llm.ReferenceRun`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from nvfp4lab.codec import ScaleUnderflowWarning, dequantize, quantize
from nvfp4lab.constants import BLOCK_SIZE, E4M3_MAX
from nvfp4lab.execution import NVFP4Linear
from nvfp4lab.orders import ORDERS, TensorScaleRule
from nvfp4lab.plots import legend_outside, log_if_wide, new_figure
from nvfp4lab.scales import abs_max
from nvfp4lab.settings import tqdm_class
from nvfp4lab.studies.llm import ReferenceRun
from nvfp4lab.studies.llm_configs import LLMConfig, build, interval_unit, scored_row
from nvfp4lab.studies.llm_layers import short_name
from nvfp4lab.vocab import Backend, OrderName

__all__ = [
    "CONVERTER",
    "LLAMA_CPP_PRESCALED",
    "MAGNITUDES",
    "NAIVE",
    "PRESCALED",
    "configurations",
    "headline_numbers",
    "kld_comparison",
    "layer_kind_rows",
    "magnitude_rows",
    "plot_weight_nmse",
    "study_rows",
    "weight_rows",
]

#: llama.cpp's order with a tensor scale: ``gs = 2688/amax`` (one float32 division) multiplies
#: the elements before ggml's quantizer runs, the decode divides by it.
LLAMA_CPP_PRESCALED = dataclasses.replace(
    ORDERS[OrderName.LLAMA_CPP],
    tensor_scale=TensorScaleRule.FLOAT32_DIVISION,
    source=f"{ORDERS[OrderName.LLAMA_CPP].source}; tensor scale as the kernel order (a study)",
)

NAIVE = "llama.cpp naive (no tensor scale)"
PRESCALED = "llama.cpp + tensor scale"
CONVERTER = "converter (modelopt order + .scale)"


def configurations() -> list[LLMConfig]:
    """The three W4A16 RTN configurations, naive first (module docstring)."""
    return [
        LLMConfig(NAIVE, Backend.W4A16, convention=OrderName.LLAMA_CPP),
        LLMConfig(PRESCALED, Backend.W4A16, convention=LLAMA_CPP_PRESCALED),
        LLMConfig(CONVERTER, Backend.W4A16, convention=OrderName.MODELOPT),
    ]


def _layer_row(name: str, weight: torch.Tensor, layer: NVFP4Linear) -> dict[str, Any]:
    """One quantized layer against its float ``weight [N, K]``: squared error and energy
    (float64), NMSE, and the fractions of its 16-element blocks whose E4M3 scale is 0 although
    the block is not (vanished), subnormal (below 2**-6) or 448 (saturated)."""
    w = weight.detach().to(torch.float64)
    w_hat = layer.weight_nvfp4().dequantize(torch.float32).to(torch.float64)
    signal, noise = float(w.square().sum()), float((w_hat - w).square().sum())
    raw = layer.weight_scale.view(torch.uint8)
    nonzero = abs_max(weight.detach().reshape(weight.shape[0], -1, BLOCK_SIZE), -1) > 0
    blocks = raw.numel()
    return {
        "layer": name,
        "short": short_name(name),
        "kind": name.rsplit(".", 1)[-1],
        "signal": signal,
        "noise": noise,
        "nmse": noise / signal if signal else 0.0,
        "vanished": int(((raw == 0) & nonzero).sum()) / blocks,
        "subnormal": int(((raw > 0) & (raw < 0x08)).sum()) / blocks,
        "saturated": int((raw.to(torch.int32) == _E4M3_MAX_BYTE).sum()) / blocks,
    }


#: The E4M3 byte of 448.
_E4M3_MAX_BYTE = int(torch.tensor(E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8))


def _build(reference: nn.Module, config: LLMConfig) -> tuple[nn.Module, float]:
    """:func:`~nvfp4lab.studies.llm_configs.build` without the codec's ScaleUnderflowWarning,
    which the naive order raises for each layer with vanishing blocks: the ``vanished`` column
    counts them instead."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ScaleUnderflowWarning)
        return build(reference, config)


def _model_weight_rows(reference: nn.Module, model: nn.Module, label: str) -> list[dict[str, Any]]:
    floats = dict(reference.named_modules())
    return [
        {"label": label, **_layer_row(name, floats[name].weight, module)}
        for name, module in model.named_modules()
        if isinstance(module, NVFP4Linear)
    ]


def weight_rows(
    reference: nn.Module, configs: Sequence[LLMConfig] | None = None
) -> list[dict[str, Any]]:
    """One row per configuration and quantized Linear (``label``, ``layer``, ``short``,
    ``kind``, ``signal`` / ``noise``: sum of squares of the float weight and of the error,
    ``nmse``, and the block-scale census ``vanished`` / ``subnormal`` / ``saturated``, fractions
    of the layer's blocks). ``configs`` default: :func:`configurations`."""
    rows: list[dict[str, Any]] = []
    for config in configs or configurations():
        model, _ = _build(reference, config)
        rows += _model_weight_rows(reference, model, config.label)
        del model
    return rows


def _overall(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    signal, noise = sum(r["signal"] for r in rows), sum(r["noise"] for r in rows)
    count = len(rows)
    return {
        "weight_nmse": noise / signal if signal else 0.0,
        "weight_nmse_median": sorted(r["nmse"] for r in rows)[count // 2] if rows else 0.0,
        "weight_nmse_max": max((r["nmse"] for r in rows), default=0.0),
        "vanished": sum(r["vanished"] for r in rows) / max(count, 1),
        "subnormal": sum(r["subnormal"] for r in rows) / max(count, 1),
        "saturated": sum(r["saturated"] for r in rows) / max(count, 1),
    }


def layer_kind_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`weight_rows` summed per configuration and layer kind (``q_proj``, ``down_proj``,
    ...): the kind's NMSE (its layers' errors over their energy), the median and largest layer
    NMSE, and the census averaged over its layers (each layer weighing the same)."""
    out = []
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == label]
        for kind in dict.fromkeys(r["kind"] for r in mine):
            group = [r for r in mine if r["kind"] == kind]
            out.append({"label": label, "kind": kind, "layers": len(group), **_overall(group)})
    return out


def study_rows(
    reference: nn.Module,
    run: ReferenceRun,
    configs: Sequence[LLMConfig] | None = None,
    *,
    progress: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(one row per configuration, :func:`weight_rows`): each configuration built once, its
    weights measured and its next-token fidelity scored on ``run``: ``weight_nmse`` (all its
    quantized weights' squared error over their energy), the median and largest layer NMSE, the
    mean block-scale census, and :func:`~nvfp4lab.studies.llm_configs.scored_row`'s perplexity,
    its ratio to the reference's, mean / p99 KLD and top-1 agreement with 95 % intervals."""
    configs = list(configs or configurations())
    bar = tqdm_class()(
        configs, desc="llama.cpp configurations", unit="config", disable=not progress
    )
    rows, layers = [], []
    for config in bar:
        model, seconds = _build(reference, config)
        mine = _model_weight_rows(reference, model, config.label)
        row = scored_row(model, seconds, run, config)
        del model
        layers += mine
        rows.append({**row, **_overall(mine)})
    return rows, layers


def _block_index(name: str) -> int:
    """The decoder block of a Linear (``model.layers.3.mlp.up_proj`` -> 3; -1 outside one)."""
    head = short_name(name).split(".")[0]
    return int(head) if head.isdigit() else -1


#: Factors the weights are scaled by in :func:`magnitude_rows` (1/16 brings SmolLM2's weight
#: standard deviation, 0.19, near that of an 8B model's).
MAGNITUDES: tuple[float, ...] = (1.0, 1 / 4, 1 / 16, 1 / 64)


def magnitude_rows(
    reference: nn.Module,
    factors: Sequence[float] = MAGNITUDES,
    configs: Sequence[LLMConfig] | None = None,
    *,
    block_stride: int = 1,
) -> list[dict[str, Any]]:
    """Weight NMSE of each configuration's order on weights ``c`` times smaller: for each factor
    ``c`` (a power of two, so ``c W`` and the division back are exact) and each decoder Linear
    (those of every ``block_stride``-th decoder block), NVFP4 of ``c W`` decoded and divided by
    ``c``, against ``W``; each layer its own tensor scale. A tensor scale makes the error
    independent of ``c``; the naive order's grows as block scales fall into E4M3's subnormal
    range (3 bits and fewer below 2**-6) and then vanish (below 2**-10). Rows: ``label``,
    ``factor``, ``weight_nmse`` (errors over energy, all the layers), the mean census ``vanished``
    / ``subnormal`` / ``saturated``, ``layers``. ``configs`` default: :func:`configurations`."""
    linears = [
        (name, module.weight.detach())
        for name, module in reference.named_modules()
        if isinstance(module, nn.Linear)
        and not name.endswith("lm_head")
        and _block_index(name) % block_stride == 0
    ]
    rows = []
    for config in configs or configurations():
        for factor in factors:
            noise = signal = 0.0
            census = {"vanished": 0.0, "subnormal": 0.0, "saturated": 0.0}
            for _, weight in linears:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ScaleUnderflowWarning)
                    q = quantize(weight * factor, convention=config.convention)
                w = weight.to(torch.float64)
                w_hat = dequantize(q, torch.float32).to(torch.float64) / factor
                noise += float((w_hat - w).square().sum())
                signal += float(w.square().sum())
                raw = q.scales.view(torch.uint8)
                nonzero = abs_max((weight * factor).reshape(*raw.shape, BLOCK_SIZE), -1) > 0
                census["vanished"] += int(((raw == 0) & nonzero).sum()) / raw.numel()
                census["subnormal"] += int(((raw > 0) & (raw < 0x08)).sum()) / raw.numel()
                census["saturated"] += int((raw == _E4M3_MAX_BYTE).sum()) / raw.numel()
            rows.append(
                {
                    "label": config.label,
                    "factor": factor,
                    "weight_nmse": noise / signal if signal else 0.0,
                    **{k: v / max(len(linears), 1) for k, v in census.items()},
                    "layers": len(linears),
                }
            )
    return rows


def kld_comparison(rows: Sequence[dict[str, Any]]) -> str:
    """One paragraph from :func:`study_rows` rows: each configuration's mean KLD with its 95 %
    interval, then which pairs the intervals separate (or that none does), and how far apart the
    weight NMSEs are: what the page can claim about the naive quantizer, from the data."""
    if not rows:
        return "no configurations"
    said = "; ".join(f"{r['label']} {r['kld_mean']:.4f} [{r['kld_lo']:.4f}, {r['kld_hi']:.4f}]"
                     for r in rows)
    apart = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1:]
             if a["kld_hi"] < b["kld_lo"] or b["kld_hi"] < a["kld_lo"]]
    if apart:
        verdict = "; ".join(
            f"{hi['label']} is measurably worse than {lo['label']}"
            for lo, hi in (sorted(pair, key=lambda r: r["kld_mean"]) for pair in apart))
    else:
        verdict = ("every pair of intervals overlaps: on this model and text the configurations "
                   "are not told apart by KLD")
    nmse = [r["weight_nmse"] for r in rows]
    spread = 100.0 * (max(nmse) - min(nmse)) / min(nmse) if min(nmse) > 0 else float("inf")
    return (f"Mean KLD (nats/token) with 95 % intervals: {said}. {verdict[0].upper()}"
            f"{verdict[1:]}; their weight NMSEs differ by {spread:.1f} %.")


def headline_numbers(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The headlines: mean KLD and perplexity ratio of each configuration, and how many times
    the naive quantizer's mean KLD is the converter's."""
    out = []
    by_label = {r["label"]: r for r in rows}
    for row in rows:
        out.append(
            {
                "name": f"SmolLM2 W4A16 RTN, {row['label']}: mean KLD",
                "value": round(row["kld_mean"], 4),
                "unit": interval_unit("nats/token", row, "kld"),
            }
        )
        out.append(
            {
                "name": f"SmolLM2 W4A16 RTN, {row['label']}: perplexity / reference's",
                "value": round(row["perplexity_ratio"], 4),
                "unit": interval_unit("×", row, "perplexity_ratio"),
            }
        )
    naive, converter = by_label.get(NAIVE), by_label.get(CONVERTER)
    if naive is not None and converter is not None and converter["kld_mean"] > 0:
        bounds = [r.get(k) for r in (naive, converter) for k in ("kld_lo", "kld_hi")]
        if not all(isinstance(b, int | float) and math.isfinite(b) for b in bounds):
            said = "× (a ratio of means; no interval)"
        elif bounds[0] > bounds[3] or bounds[2] > bounds[1]:
            said = "× (a ratio of means; their 95 % intervals do not overlap)"
        else:
            said = "× (a ratio of means; their 95 % intervals overlap: no difference shown)"
        out.append(
            {
                "name": "SmolLM2: llama.cpp naive NVFP4's mean KLD / the converter's",
                "value": round(naive["kld_mean"] / converter["kld_mean"], 2),
                "unit": said,
            }
        )
    return out


def plot_weight_nmse(rows: Sequence[dict[str, Any]]) -> Any:
    """Weight NMSE per decoder layer (the mean over its Linear layers), one line per
    configuration of :func:`weight_rows`; a log y axis only when the values span 10× or more
    (:func:`nvfp4lab.plots.log_if_wide`), else the label says how narrow the zoomed axis is;
    the legend sits outside the axes."""
    ylabel = "weight NMSE, mean over the layer's Linear layers"
    fig, ax = new_figure(
        "SmolLM2-135M: weight NMSE per decoder layer, llama.cpp naive vs tensor scale",
        "decoder layer",
        ylabel,
        figsize=(9.0, 4.0),
    )
    shown: list[float] = []
    for i, label in enumerate(dict.fromkeys(r["label"] for r in rows)):
        per_layer: dict[int, list[float]] = {}
        for r in rows:
            if r["label"] == label and r["short"].split(".")[0].isdigit():
                per_layer.setdefault(int(r["short"].split(".")[0]), []).append(r["nmse"])
        xs = sorted(per_layer)
        ys = [sum(per_layer[x]) / len(per_layer[x]) for x in xs]
        shown += ys
        ax.plot(xs, ys, marker=".", color=f"C{i}", label=label)
    if log_if_wide(ax, shown):
        ax.set_ylabel(f"{ylabel} (log scale)")
    elif shown and min(shown) > 0 and max(shown) < 2.0 * min(shown):
        # a linear axis zoomed on data within 2x: say how narrow it is
        spread = 100.0 * (max(shown) / min(shown) - 1.0)
        ax.set_ylabel(f"{ylabel}\n(axis zoomed: the lines span {spread:.1f} %)")
    legend_outside(ax, fontsize=7)
    return fig
