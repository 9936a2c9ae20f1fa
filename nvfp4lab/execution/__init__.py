"""Execution: how an NVFP4 linear layer runs, and the layers and models that use it.

==================  ===========================================================================
module              holds
==================  ===========================================================================
``dispatch``        :func:`select_backend`: which backend runs on a device, and why
``vllm_rules``      vLLM's NVFP4 kernel rules by release as data: releases, eras, kernels,
                    their support conditions, the variables, each with its source
``vllm_select``     what a given vLLM release picks for an NVFP4 linear layer, era by era
``llama_cpp_rules`` llama.cpp's NVFP4 matmul paths per device as data, with their sources
                    (``select_backend(engine="llama.cpp")``)
``gemm``            :func:`linear` on the ``native`` / ``emulation`` / ``w4a16`` / ``q8_0``
                    backends and the bias epilogues
``ggml_cpu``        llama.cpp's CPU arithmetic for NVFP4, bit for bit: Q8_0 activations and
                    ``ggml_vec_dot_nvfp4_q8_0`` (the ``q8_0`` backend)
``shared_scales``   the cost of merging the global scales of fused shards (vLLM's ``max``)
``layers``          :class:`NVFP4Linear` (compressed-tensors buffer names; optionally
                    Hadamard-rotated, MR-GPTQ)
``whole_model``     :func:`quantize_model`; the fused groups
``quantize_report`` what it did: :class:`QuantizeReport` (replaced, skipped, KV cache layers)
``w4a4_recipes``    :class:`W4A4Options` (``quantize_model(w4a4=)``): online rotations, GPTQ on
                    rotated quantized inputs, 4over6 block scales
``w4a4_smooth``     SmoothQuant / AWQ scales folded into stored weights
``gptq``            GPTQ of one weight for NVFP4 (MR-GPTQ with ``hadamard``), and for the
                    other block formats as a study function
``gptq_model``      GPTQ of whole models, stage by stage (``quantize_model(method="gptq" |
                    "mr-gptq")``): Hessians from calibration passes, fused groups stacked
``sequential``      a model's repeated blocks run one at a time over calibration batches
                    (block 0's inputs captured, a block's stage passes ended early)
``calibrate``       activation-scale calibration
``kv_cache``        the KV cache as vLLM 0.33 writes and reads it (``--kv-cache-dtype nvfp4``,
                    ``nvfp4_4over6``, ``fp8``): ``pack``, ``unpack``, ``fake_quantize_kv``
``attention``       a model's attention reading K / V from that cache
                    (:func:`quantize_kv_cache`, ``quantize_model(kv_cache=...)`` with
                    :class:`KVCacheOptions`)
==================  ===========================================================================

A new backend goes into :class:`nvfp4lab.vocab.Backend`, gets its branch in ``gemm.linear``
and its rule in ``dispatch``.
"""

from __future__ import annotations

from nvfp4lab.execution.attention import (
    KVCacheLayer,
    KVCacheOptions,
    quantize_kv_cache,
    remove_kv_cache_quantization,
)
from nvfp4lab.execution.calibrate import CalibrationResult, calibrate_inputs, calibration
from nvfp4lab.execution.dispatch import BackendChoice, info_report, select_backend
from nvfp4lab.execution.gemm import DroppedBiasWarning, linear
from nvfp4lab.execution.gptq import GPTQFallbackWarning, GPTQOptions, gptq_quantize
from nvfp4lab.execution.layers import NVFP4Linear
from nvfp4lab.execution.w4a4_recipes import W4A4Options
from nvfp4lab.execution.whole_model import (
    FUSED_GROUPS,
    SHARE_PRESETS,
    QuantizeReport,
    UnmatchedIgnoreWarning,
    quantize_model,
)

__all__ = [
    "FUSED_GROUPS",
    "SHARE_PRESETS",
    "BackendChoice",
    "CalibrationResult",
    "DroppedBiasWarning",
    "GPTQFallbackWarning",
    "GPTQOptions",
    "KVCacheLayer",
    "KVCacheOptions",
    "NVFP4Linear",
    "QuantizeReport",
    "UnmatchedIgnoreWarning",
    "W4A4Options",
    "calibrate_inputs",
    "calibration",
    "gptq_quantize",
    "info_report",
    "linear",
    "quantize_kv_cache",
    "quantize_model",
    "remove_kv_cache_quantization",
    "select_backend",
]
