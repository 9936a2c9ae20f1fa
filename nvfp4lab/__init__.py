"""nvfp4lab: exact NVFP4 numerics, execution paths, checkpoints and studies.

The numerics and execution layers (torch only) are imported eagerly and their main names are
re-exported here. Every subpackage and module (checkpoints, formats, models, benchmarks, studies,
reports) is imported on first use as ``nvfp4lab.<name>``, and optional dependencies (matplotlib,
papermill, transformers, ipywidgets) only by the functions that need them, so
``import nvfp4lab`` stays light. The layers are described in ``docs/architecture.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

# first of the package: importing it makes Ctrl-C while the command line imports the rest one
# line and exit 130 (nvfp4lab/cli_start.py)
from nvfp4lab import cli_start  # noqa: F401
from nvfp4lab.codec import compute_global_scale, dequantize, fake_quantize, quantize
from nvfp4lab.e2m1 import decode_e2m1, encode_e2m1, pack_fp4, unpack_fp4
from nvfp4lab.execution import (  # the whole of nvfp4lab.execution.__all__
    FUSED_GROUPS,
    SHARE_PRESETS,
    BackendChoice,
    CalibrationResult,
    DroppedBiasWarning,
    GPTQFallbackWarning,
    GPTQOptions,
    KVCacheLayer,
    KVCacheOptions,
    NVFP4Linear,
    QuantizeReport,
    UnmatchedIgnoreWarning,
    calibrate_inputs,
    calibration,
    gptq_quantize,
    info_report,
    linear,
    quantize_kv_cache,
    quantize_model,
    remove_kv_cache_quantization,
    select_backend,
)
from nvfp4lab.layout import swizzle_scales, unswizzle_scales
from nvfp4lab.orders import ORDERS, ArithmeticOrder
from nvfp4lab.scales import decode_to_encode_scale, encode_to_decode_scale
from nvfp4lab.tensor import NVFP4Tensor, RotatedNVFP4Tensor
from nvfp4lab.vocab import Backend, BiasMode, OrderName

__version__ = "0.1.0"

#: The arithmetic orders' names (``order=`` of quantize / fake_quantize / quantize_model).
ORDER_NAMES: tuple[str, ...] = tuple(OrderName)
#: The old name of :data:`ORDER_NAMES` (the same tuple).
CONVENTIONS = ORDER_NAMES

# public name -> module that defines it, imported on first use
_LAZY: dict[str, str] = {
    "headline": "nvfp4lab.report",
}

_SUBMODULES = (
    "bench",
    "checkpoint",
    "cli",
    "cli_start",
    "cli_study",
    "cli_support",
    "blocks",
    "codec",
    "constants",
    "corpus",
    "e2m1",
    "execution",
    "formats",
    "number_formats",
    "ggml_blocks",
    "gpus",
    "hadamard",
    "inputs",
    "kernels",
    "layout",
    "local_models",
    "metrics",
    "models",
    "notebook_imports",  # deprecated alias of a module of nvfp4lab.report
    "options",
    "oracles",
    "orders",
    "plots",
    "reference",  # deprecated alias of modules of nvfp4lab.oracles
    "reference_ggml",  # deprecated alias of nvfp4lab.oracles.ggml
    "report",
    "report_kernels",  # deprecated alias of a module of nvfp4lab.report
    "report_outputs",  # deprecated alias of a module of nvfp4lab.report
    "report_pages",  # deprecated alias of a module of nvfp4lab.report
    "reports",  # deprecated alias of a module of nvfp4lab.report
    "roofline",
    "scales",
    "settings",
    "studies",
    "tensor",
    "texts",
    "vocab",
)

__all__ = [
    "CONVENTIONS",
    "ORDER_NAMES",
    "FUSED_GROUPS",
    "ORDERS",
    "SHARE_PRESETS",
    "ArithmeticOrder",
    "Backend",
    "BackendChoice",
    "BiasMode",
    "CalibrationResult",
    "OrderName",
    "DroppedBiasWarning",
    "GPTQFallbackWarning",
    "GPTQOptions",
    "KVCacheLayer",
    "KVCacheOptions",
    "NVFP4Linear",
    "NVFP4Tensor",
    "QuantizeReport",
    "RotatedNVFP4Tensor",
    "UnmatchedIgnoreWarning",
    "calibrate_inputs",
    "calibration",
    "compute_global_scale",
    "decode_e2m1",
    "decode_to_encode_scale",
    "dequantize",
    "encode_e2m1",
    "encode_to_decode_scale",
    "fake_quantize",
    "gptq_quantize",
    "info_report",
    "linear",
    "pack_fp4",
    "quantize",
    "quantize_kv_cache",
    "quantize_model",
    "remove_kv_cache_quantization",
    "select_backend",
    "swizzle_scales",
    "unpack_fp4",
    "unswizzle_scales",
    # lazy
    *_LAZY,
    *_SUBMODULES,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"nvfp4lab.{name}")
    if name == "Convention":  # the old name of OrderName (issue 33), warns
        return getattr(importlib.import_module("nvfp4lab.vocab"), name)
    raise AttributeError(f"module 'nvfp4lab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(__all__)
