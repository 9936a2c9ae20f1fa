"""Deprecated alias of the NVFP4 and KV-cache oracles, which moved to :mod:`nvfp4lab.oracles`
(:mod:`~nvfp4lab.oracles.numbers`, :mod:`~nvfp4lab.oracles.nvfp4`,
:mod:`~nvfp4lab.oracles.kv_cache`); importing it warns, and it goes in the next release.
Every name it had still resolves here."""

from __future__ import annotations

import warnings
from typing import Any

from nvfp4lab.oracles import kv_cache as _kv_cache
from nvfp4lab.oracles import numbers as _numbers
from nvfp4lab.oracles import nvfp4 as _nvfp4
from nvfp4lab.oracles.kv_cache import (
    KV_KINDS,
    kv_encode_scale,
    kv_fake_quantize,
    kv_page_bytes,
    kv_quantize_fp8,
    kv_quantize_nvfp4,
    kv_read_fp8,
    kv_read_nvfp4,
)
from nvfp4lab.oracles.numbers import (
    BLOCK,
    E2M1_GRID,
    E4M3_MAX,
    F32_ONE_SIXTH,
    decode_e2m1_code,
    decode_e4m3,
    e4m3_byte,
    e4m3_finite_values,
    narrow,
    pack_nibbles,
    round_bf16,
    round_e2m1,
    round_e2m1_tensor,
    round_e4m3,
    round_f16,
    round_f32,
    unpack_nibbles,
)
from nvfp4lab.oracles.nvfp4 import (
    CONVENTIONS,
    CT_ZERO_SCALE,
    GGML_KVALUES,
    dequantize_blocks,
    ggml_fp32_to_ue4m3,
    ggml_ue4m3_to_fp32,
    global_scale,
    modelopt_decode_scale,
    quantize_blocks,
    swizzle_offset,
)

__all__ = [
    "BLOCK",
    "CONVENTIONS",
    "CT_ZERO_SCALE",
    "E2M1_GRID",
    "E4M3_MAX",
    "F32_ONE_SIXTH",
    "GGML_KVALUES",
    "KV_KINDS",
    "decode_e2m1_code",
    "decode_e4m3",
    "dequantize_blocks",
    "e4m3_byte",
    "e4m3_finite_values",
    "ggml_fp32_to_ue4m3",
    "ggml_ue4m3_to_fp32",
    "global_scale",
    "kv_encode_scale",
    "kv_fake_quantize",
    "kv_page_bytes",
    "kv_quantize_fp8",
    "kv_quantize_nvfp4",
    "kv_read_fp8",
    "kv_read_nvfp4",
    "modelopt_decode_scale",
    "narrow",
    "pack_nibbles",
    "quantize_blocks",
    "round_bf16",
    "round_e2m1",
    "round_e2m1_tensor",
    "round_e4m3",
    "round_f16",
    "round_f32",
    "swizzle_offset",
    "unpack_nibbles",
]

warnings.warn(
    "nvfp4lab.reference is deprecated: import nvfp4lab.oracles.nvfp4 (block quantization), "
    "nvfp4lab.oracles.numbers (rounding, E2M1, E4M3) or nvfp4lab.oracles.kv_cache",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    """Every other name the module had (``E2M1_MAX``, ``KV_MAX_ENCODE_SCALE``, private helpers)
    as the oracle that now holds it has it."""
    for module in (_nvfp4, _numbers, _kv_cache):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module 'nvfp4lab.reference' has no attribute {name!r}")
