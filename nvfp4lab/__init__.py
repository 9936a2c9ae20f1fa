"""nvfp4lab: exact NVFP4 numerics, execution paths, checkpoints and studies.

Importing the package is light: names are resolved lazily from their modules on first use, and
optional dependencies (matplotlib, papermill, transformers, ipywidgets) are imported only by the
functions that need them.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# The numerics core needs only torch and is imported eagerly. This also keeps the function
# ``nvfp4lab.quantize`` from being shadowed by the submodule of the same name.
from nvfp4lab.e2m1 import decode_e2m1, encode_e2m1, pack_fp4, unpack_fp4
from nvfp4lab.layout import swizzle_scales, unswizzle_scales
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

# public name -> module that defines it, imported on first use
_EXPORTS: dict[str, str] = {
    "headline": "nvfp4lab.reports",
    "select_backend": "nvfp4lab.dispatch",
    "BackendChoice": "nvfp4lab.dispatch",
    "linear": "nvfp4lab.linear",
    "NVFP4Linear": "nvfp4lab.nn",
    "quantize_model": "nvfp4lab.nn",
    "calibrate_inputs": "nvfp4lab.nn",
}

_SUBMODULES = (
    "bench",
    "checkpoint",
    "cli",
    "constants",
    "dispatch",
    "e2m1",
    "formats",
    "gpus",
    "layout",
    "linear",
    "metrics",
    "models",
    "nn",
    "plots",
    "quantize",
    "reference",
    "reports",
    "tensor",
    "timing",
    "tour",
    "widgets",
)

__all__ = [
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
    *_EXPORTS,
    *_SUBMODULES,
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"nvfp4lab.{name}")
    raise AttributeError(f"module 'nvfp4lab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
