"""The compressed-tensors ``nvfp4-pack-quantized`` format: its quantization config.

Built and validated with compressed-tensors' own classes, never by hand. On disk, per quantized
Linear ``<name>``: ``<name>.weight_packed`` uint8 ``[N, K/2]`` (element ``2i`` in the low
nibble), ``<name>.weight_scale`` float8_e4m3fn ``[N, K/16]`` (plain row-major layout),
``<name>.weight_global_scale`` float32 ``[1]`` (ENCODE convention, 2688/amax),
``<name>.input_global_scale`` float32 ``[1]`` (scheme "NVFP4", W4A4 only) and ``<name>.bias``.
``config.json`` carries ``quantization_config`` with ``quant_method: "compressed-tensors"``,
``format: "nvfp4-pack-quantized"``, ``quantization_status: "compressed"`` and config groups of
4-bit float weights in ``tensor_group`` blocks of 16 (compressed-tensors' presets "NVFP4",
"NVFP4A16"). compressed-tensors is imported inside the functions that need it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from nvfp4lab.checkpoint.files import CONFIG_NAME, CheckpointError, read_json
from nvfp4lab.constants import BLOCK_SIZE

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

__all__ = [
    "CT_FORMAT",
    "QUANTIZED_TENSOR_NAMES",
    "SCHEMES",
    "check_scheme",
    "quantization_config",
    "read_quantization_config",
]

Scheme = Literal["NVFP4", "NVFP4A16"]

SCHEMES: tuple[str, ...] = ("NVFP4", "NVFP4A16")
CT_FORMAT = "nvfp4-pack-quantized"
#: Per-module tensors of a quantized Linear, as compressed-tensors names them.
QUANTIZED_TENSOR_NAMES: tuple[str, ...] = (
    "weight_packed",
    "weight_scale",
    "weight_global_scale",
    "input_global_scale",
)


def check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; accepted values: {', '.join(SCHEMES)}")
    return scheme


def quantization_config(
    scheme: Scheme = "NVFP4", *, ignore: Sequence[str] = (), targets: Sequence[str] = ("Linear",)
) -> QuantizationConfig:
    """compressed-tensors ``QuantizationConfig`` of a compressed NVFP4 checkpoint.

    ``scheme``: "NVFP4" (W4A4: weights + activations with a static ``input_global_scale``) or
    "NVFP4A16" (weight-only), compressed-tensors' preset of that name applied to ``targets``
    (module class names or ``re:`` patterns); ``ignore``: module names left unquantized.
    """
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        preset_name_to_scheme,
    )

    group = preset_name_to_scheme(check_scheme(scheme), list(targets))
    group.format = CT_FORMAT
    return QuantizationConfig(
        config_groups={"group_0": group},
        ignore=list(ignore),
        format=CT_FORMAT,
        quantization_status=QuantizationStatus.COMPRESSED,
    )


def _config_error(file: Path, message: str) -> CheckpointError:
    return CheckpointError(f"{file}: {message}")


def _value(x: object) -> object:
    """An enum member's value (compressed-tensors' str enums), anything else unchanged."""
    return getattr(x, "value", x)


def _check_group(file: Path, name: str, group: QuantizationScheme) -> None:
    """Accept only what NVFP4Linear can hold: FP4 weights in tensor_group blocks of 16."""
    w = group.weights
    if w is None:
        raise _config_error(file, f"config group {name!r} quantizes no weights; not NVFP4")
    fmt = getattr(group, "format", None)
    if fmt is not None and _value(fmt) != CT_FORMAT:
        raise _config_error(
            file, f"config group {name!r} has format {fmt!r}; nvfp4lab reads only {CT_FORMAT!r}"
        )
    found = (w.num_bits, _value(w.type), _value(w.strategy), w.symmetric)
    if found != (4, "float", "tensor_group", True):
        raise _config_error(
            file,
            f"config group {name!r} weights are num_bits={w.num_bits}, type={w.type}, "
            f"strategy={w.strategy}, symmetric={w.symmetric}; NVFP4 needs 4-bit float, "
            "tensor_group, symmetric",
        )
    if w.group_size != BLOCK_SIZE:
        raise _config_error(
            file,
            f"config group {name!r} has weights group_size={w.group_size}; NVFP4 uses blocks "
            f"of {BLOCK_SIZE} (group_size 32 with E8M0 scales would be MXFP4)",
        )
    if w.scale_dtype is not None and w.scale_dtype != torch.float8_e4m3fn:
        raise _config_error(
            file, f"config group {name!r} has scale_dtype={w.scale_dtype}; NVFP4 needs E4M3"
        )
    a = group.input_activations
    if a is not None and (
        (a.num_bits, _value(a.type), _value(a.strategy), a.group_size)
        != (4, "float", "tensor_group", BLOCK_SIZE)
    ):
        raise _config_error(
            file,
            f"config group {name!r} quantizes activations as num_bits={a.num_bits}, "
            f"type={a.type}, strategy={a.strategy}, group_size={a.group_size}; nvfp4lab "
            "supports NVFP4 activations (W4A4) or none (W4A16) only",
        )
    if group.output_activations is not None:
        raise _config_error(file, f"config group {name!r} quantizes outputs; not supported")


def _validate_config(file: Path, data: Mapping[str, Any]) -> QuantizationConfig:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    method = data.get("quant_method")
    if method != "compressed-tensors":
        raise _config_error(
            file, f"quantization_config.quant_method is {method!r}, not 'compressed-tensors'"
        )
    fmt = data.get("format")
    if fmt != CT_FORMAT:
        raise _config_error(
            file, f"quantization_config.format is {fmt!r}; nvfp4lab reads only {CT_FORMAT!r}"
        )
    fields = set(QuantizationConfig.model_fields)
    try:
        config = QuantizationConfig.model_validate({k: v for k, v in data.items() if k in fields})
    except Exception as exc:  # pydantic.ValidationError and friends
        raise _config_error(file, f"invalid quantization_config: {exc}") from exc
    status = _value(config.quantization_status)
    if status != QuantizationStatus.COMPRESSED.value:
        raise _config_error(
            file,
            f"quantization_status is {status!r}; only 'compressed' checkpoints hold packed "
            "NVFP4 weights",
        )
    if config.kv_cache_scheme is not None:
        raise _config_error(file, "KV-cache quantization (kv_cache_scheme) is not supported")
    if not config.config_groups:
        raise _config_error(file, "quantization_config has no config_groups")
    for name, group in config.config_groups.items():
        _check_group(file, name, group)
    return config


def read_quantization_config(path: str | os.PathLike[str]) -> QuantizationConfig:
    """Read and validate ``<path>/config.json``'s ``quantization_config`` (compressed-tensors).

    Raises :class:`CheckpointError` naming the file for anything but a compressed
    "nvfp4-pack-quantized" config with 4-bit float weights in blocks of 16.
    """
    file = Path(path) / CONFIG_NAME
    qdata = read_json(file).get("quantization_config")
    if not isinstance(qdata, dict):
        raise CheckpointError(
            f"{file} has no quantization_config: not a compressed-tensors checkpoint (load a "
            "float model with transformers instead)"
        )
    return _validate_config(file, qdata)
