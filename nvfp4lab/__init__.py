"""nvfp4lab: exact NVFP4 numerics, execution paths, checkpoints and studies.

Importing the package is light: names are resolved lazily from their modules on first use, and
optional dependencies (matplotlib, papermill, transformers, ipywidgets) are imported only by the
functions that need them.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # numerics
    "NVFP4Tensor": "nvfp4lab.tensor",
    "quantize": "nvfp4lab.quantize",
    "dequantize": "nvfp4lab.quantize",
    "fake_quantize": "nvfp4lab.quantize",
    "compute_global_scale": "nvfp4lab.quantize",
    "encode_to_decode_scale": "nvfp4lab.quantize",
    "decode_to_encode_scale": "nvfp4lab.quantize",
    "CONVENTIONS": "nvfp4lab.quantize",
    "encode_e2m1": "nvfp4lab.e2m1",
    "decode_e2m1": "nvfp4lab.e2m1",
    "pack_fp4": "nvfp4lab.e2m1",
    "unpack_fp4": "nvfp4lab.e2m1",
    "swizzle_scales": "nvfp4lab.layout",
    "unswizzle_scales": "nvfp4lab.layout",
    # execution
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
    "widgets",
)

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


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
