"""NVFP4 as a registered format: the codec's one pipeline, its options as format options.

Options (see :mod:`nvfp4lab.codec` for what each does; the defaults are plain NVFP4):
``global_scale`` (None = 2688/amax, an ENCODE float/tensor, 1.0 = no tensor scale),
``block_size`` (16, or a 2-D tile such as ``(16, 16)``), ``convention``, ``pad``, ``nonfinite``,
``rounding``, ``generator``, ``scale_selection``, ``search_targets``, ``hadamard``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from types import MappingProxyType
from typing import Any

import torch

from nvfp4lab.codec import dequantize, fake_quantize, quantize
from nvfp4lab.number_formats.base import QuantFormat
from nvfp4lab.options import NVFP4Options, nvfp4_options
from nvfp4lab.scales import as_global_scale
from nvfp4lab.tensor import NVFP4Tensor

__all__ = ["OPTION_DEFAULTS", "NVFP4Format", "options_label"]

#: Plain NVFP4: the pipeline's own defaults, the one place they are written.
_PLAIN = NVFP4Options()

#: Fields of NVFP4Options that are no keyword of their own: ``block_shape`` is ``block_size``'s
#: validated form, ``arithmetic`` a custom order passed as ``convention=``.
_DERIVED_FIELDS = ("block_shape", "arithmetic")

#: Accepted option names of the NVFP4 format and their defaults (the pipeline's, plus
#: ``global_scale``; ``block_size`` is the width of the default ``(1, 16)`` block shape).
OPTION_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "global_scale": None,
        "block_size": _PLAIN.block_shape[1],
        **{f.name: getattr(_PLAIN, f.name) for f in fields(_PLAIN)
           if f.name not in _DERIVED_FIELDS},
    }
)


def _pipeline_options(opts: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if k != "global_scale"}


class NVFP4Format(QuantFormat):
    """NVFP4 with the research options of :mod:`nvfp4lab.codec` (defaults: plain NVFP4)."""

    name = "nvfp4"
    bits_per_element = 4.5
    description = "E2M1, E4M3 scale per 16 along K, FP32 tensor scale"
    options: Mapping[str, Any] = OPTION_DEFAULTS

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        opts = super().check_options(options)
        nvfp4_options(**_pipeline_options(opts))  # full validation, names every accepted value
        if opts["global_scale"] is not None:
            as_global_scale(opts["global_scale"])
        return opts

    def _fake(self, x: torch.Tensor, opts: dict[str, Any]) -> torch.Tensor:
        return fake_quantize(x, opts["global_scale"], **_pipeline_options(opts))

    def _quantize(self, x: torch.Tensor, opts: dict[str, Any]) -> NVFP4Tensor:
        return quantize(x, opts["global_scale"], **_pipeline_options(opts))

    def dequantize(
        self, q: Any, dtype: torch.dtype | None = None, *, hadamard: int | None = None
    ) -> torch.Tensor:
        """Decode an :class:`NVFP4Tensor` (a rotated one rotates back by itself; ``hadamard=``
        names the seed for a plain tensor holding rotated codes)."""
        return dequantize(q, dtype, hadamard=hadamard)

    def _bits(self, shape: tuple[int, ...], numel: int, opts: dict[str, Any]) -> float:
        per_element = nvfp4_options(**_pipeline_options(opts)).bits_per_element
        gs = opts["global_scale"]
        no_tensor_scale = gs is not None and float(as_global_scale(gs)) == 1.0
        return per_element + (0.0 if no_tensor_scale else 32.0 / numel)


def options_label(options: Mapping[str, Any]) -> str:
    """Short human label of non-default options, e.g. ``"scale_selection=four_over_six"``."""

    def is_default(key: str, value: Any) -> bool:
        default = OPTION_DEFAULTS.get(key, object())
        if isinstance(value, torch.Tensor | torch.Generator):
            return False
        if key == "block_size":
            return nvfp4_options(block_size=value).block_shape == _PLAIN.block_shape
        return bool(value == default)

    parts = [f"{k}={v}" for k, v in options.items() if not is_default(k, v)]
    return ", ".join(parts) or "defaults"
