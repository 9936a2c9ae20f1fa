"""nvfp4lab: exact NVFP4 numerics, execution paths, checkpoints and studies.

The numerics and execution layers (torch only) are imported eagerly; this also keeps the functions
``nvfp4lab.quantize`` and ``nvfp4lab.linear`` from being shadowed by their same-named submodules.
Everything else (checkpoints, models, benchmarks, plots, reports) is resolved lazily on first use,
and optional dependencies (matplotlib, papermill, transformers, ipywidgets) are imported only by
the functions that need them, so ``import nvfp4lab`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from nvfp4lab.dispatch import BackendChoice, info_report, select_backend
from nvfp4lab.e2m1 import decode_e2m1, encode_e2m1, pack_fp4, unpack_fp4
from nvfp4lab.layout import swizzle_scales, unswizzle_scales
from nvfp4lab.linear import DroppedBiasWarning, linear
from nvfp4lab.nn import (
    NVFP4Linear,
    QuantizeReport,
    calibrate_inputs,
    calibration,
    quantize_model,
)
from nvfp4lab.quantize import (
    CONVENTIONS,
    compute_global_scale,
    decode_to_encode_scale,
    dequantize,
    encode_to_decode_scale,
    fake_quantize,
    quantize,
)
from nvfp4lab.tensor import NVFP4Tensor

__version__ = "0.1.0"

# public name -> module that defines it, imported on first use
_LAZY: dict[str, str] = {
    "headline": "nvfp4lab.reports",
}

_SUBMODULES = (
    "bench",
    "bias_study",
    "checkpoint",
    "cli",
    "constants",
    "dispatch",
    "e2m1",
    "format_study",
    "formats",
    "gpus",
    "hadamard",
    "layout",
    "linear",
    "metrics",
    "models",
    "nn",
    "plots",
    "quantize",
    "reference",
    "reports",
    "settings",
    "tensor",
    "throughput",
    "timing",
    "tour",
    "variants",
    "widgets",
)

__all__ = [
    # numerics
    "CONVENTIONS",
    "NVFP4Tensor",
    "compute_global_scale",
    "decode_e2m1",
    "decode_to_encode_scale",
    "dequantize",
    "encode_e2m1",
    "encode_to_decode_scale",
    "fake_quantize",
    "pack_fp4",
    "quantize",
    "swizzle_scales",
    "unpack_fp4",
    "unswizzle_scales",
    # execution
    "BackendChoice",
    "DroppedBiasWarning",
    "NVFP4Linear",
    "QuantizeReport",
    "calibrate_inputs",
    "calibration",
    "info_report",
    "linear",
    "quantize_model",
    "select_backend",
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
    raise AttributeError(f"module 'nvfp4lab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(__all__)
