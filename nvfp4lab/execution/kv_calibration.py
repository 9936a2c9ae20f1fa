"""Calibrated KV cache scales: per attention layer, the DECODE ``k_scale`` / ``v_scale`` that
llm-compressor and ModelOpt compute from calibration text, instead of vLLM 0.33's default 1.0.

**The rule** (``docs/kv_cache.md``, "Calibrated scales"): ``k_scale = f32(amax(K) / 448)``,
``v_scale = f32(amax(V) / 448)``, ``amax`` the largest magnitude of K after RoPE (V as
projected) that one attention layer hands to attention over every calibration batch (every
token, KV head and element: one value per layer and side, the ``tensor`` strategy vLLM reads).
448 is E4M3's largest value: llm-compressor's FP8 scale (compressed-tensors
``calculate_qparams``, symmetric: ``amax / (bit_range / 2)`` = ``amax / 448``) and ModelOpt
0.47's for both the FP8 and the NVFP4 cache (``unified_export_hf.py``: "kv cache scale as amax /
448 for both FP8 and NVFP4", its ``k_bmm_quantizer`` amax observed at the attention call, after
RoPE). For FP8 it puts the calibrated amax at E4M3's top; for NVFP4 the largest block scale is
then ``448 / 6`` ≈ 74.7, six times below E4M3's 448, so values up to six times the calibrated
amax are still written unclipped. An ``amax`` of 0 gives 1.0 (vLLM's default).

K and V are observed with :func:`~nvfp4lab.execution.attention.observe_attention` on the model
as given, whose KV cache must not be quantized yet (its K / V would be the quantized ones):
``quantize_model`` calibrates on the model before it changes anything, as ModelOpt calibrates
every quantizer in one float pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from nvfp4lab.constants import E4M3_MAX
from nvfp4lab.execution.attention import KVCacheOptions, kv_cache_settings, observe_attention
from nvfp4lab.execution.attention_modules import find_attention_modules
from nvfp4lab.execution.calibrate import calibration_batches, run_batch
from nvfp4lab.execution.kv_cache import kv_cache_kind

__all__ = ["KV_SCALE_DIVISOR", "calibrate_kv_scales", "calibrated_kv_options",
           "kv_scale_from_amax"]

#: What a calibrated amax is divided by, for every cache kind (see the module docstring).
KV_SCALE_DIVISOR = float(E4M3_MAX)


def kv_scale_from_amax(amax: float) -> float:
    """The DECODE scale of a calibrated ``amax``: ``f32(f32(amax) / 448)``; 1.0 for 0."""
    if amax == 0:
        return 1.0
    value = torch.tensor(amax, dtype=torch.float32) / KV_SCALE_DIVISOR
    return float(value)


def calibrate_kv_scales(
    model: nn.Module, batches: Iterable[Any], kind: str, *,
    alongside: contextlib.AbstractContextManager[Any] | None = None,
) -> dict[int, tuple[float, float]]:
    """Calibrated ``(k_scale, v_scale)`` per attention layer of ``model`` (by ``layer_idx``),
    float32 DECODE values for a ``kind`` KV cache (a :class:`~nvfp4lab.vocab.KVCacheKind`
    value; every kind uses the rule of the module docstring), from ``batches`` (model inputs:
    dicts of tensors -> ``model(**b)``, tuples -> ``model(*b)``, tensors -> ``model(b)``), run
    without gradients. Pass the result as ``quantize_kv_cache(model, kind, kv_scales=...)`` or
    ``KVCacheOptions(kind, scales=...)``; ``KVCacheOptions(kind, scales="calibrated")`` runs
    this inside ``quantize_model`` with its ``calibration=`` batches.

    ``model``: a model :func:`~nvfp4lab.execution.quantize_kv_cache` accepts, whose KV cache is
    not quantized (ValueError otherwise: calibrate first, or
    ``remove_kv_cache_quantization(model)``). A layer no batch reached raises ValueError.
    ``alongside``: a context entered around the pass over ``batches`` alone (not the one-token
    probes that find the attention modules), for another observer of the same pass, e.g.
    :func:`~nvfp4lab.execution.w4a4_smooth.observing_statistics`."""
    kind = kv_cache_kind(kind)
    done = kv_cache_settings(model)
    if done:
        raise ValueError(
            f"calibrate_kv_scales: the model's KV cache is quantized already ({len(done)} "
            "layer(s)), so attention would see quantized K / V; calibrate before "
            "quantize_kv_cache, or call remove_kv_cache_quantization(model) first")
    data = calibration_batches(batches)
    amax: dict[int, list[torch.Tensor]] = {}

    def observe(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> None:
        idx = int(module.layer_idx)
        seen = [key.detach().abs().amax().float(), value.detach().abs().amax().float()]
        prev = amax.get(idx)
        amax[idx] = seen if prev is None else [torch.maximum(a, b) for a, b in zip(prev, seen,
                                                                                 strict=True)]

    also = contextlib.nullcontext() if alongside is None else alongside
    with torch.no_grad(), observe_attention(model, observe), also:  # entered after the probe
        for batch in data:
            run_batch(model, batch)
    expected = [int(f.module.layer_idx)
                for f in find_attention_modules(model, "calibrate_kv_scales")]
    missing = [i for i in expected if i not in amax]
    if missing:
        raise ValueError(f"calibrate_kv_scales: no batch reached attention layer(s) {missing}; "
                         "pass batches that run the whole model")
    return {idx: (kv_scale_from_amax(float(k)), kv_scale_from_amax(float(v)))
            for idx, (k, v) in sorted(amax.items())}


def calibrated_kv_options(
    model: nn.Module, kv: KVCacheOptions | None, calibration: Iterable[Any] | None, *,
    keep: bool,
) -> tuple[KVCacheOptions | None, Iterable[Any] | None]:
    """``quantize_model``'s KV job with calibrated scales resolved: ``kv`` with
    ``scales="calibrated"`` becomes ``KVCacheOptions(kind, scales={layer_idx: (k, v)})`` from
    :func:`calibrate_kv_scales` on ``calibration`` (ValueError when there is none), run on the
    model as it is, before anything changes; any other ``kv`` is returned as it is. The second
    value is ``calibration`` for the rest of the call: the checked batches when ``keep`` (GPTQ or
    another job reads them too), None when only the KV scales used them."""
    if kv is None or not kv.calibrated:
        return kv, calibration
    if calibration is None:
        raise ValueError(f"KVCacheOptions({kv.kind!r}, scales='calibrated') computes the k / v "
                         "scales from calibration batches: pass calibration=<model inputs>")
    batches = calibration_batches(calibration)
    scales = calibrate_kv_scales(model, batches, kv.kind)
    return KVCacheOptions(kv.kind, scales=scales), (batches if keep else None)
