"""compressed-tensors "nvfp4-pack-quantized" checkpoints: write, read and validate.

On disk (one directory, the layout transformers, compressed-tensors and vLLM read):

* ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``)
  holding, per quantized Linear ``<name>``: ``<name>.weight_packed`` uint8 ``[N, K/2]`` (element
  ``2i`` in the low nibble), ``<name>.weight_scale`` float8_e4m3fn ``[N, K/16]`` (plain row-major
  layout), ``<name>.weight_global_scale`` float32 ``[1]`` (ENCODE convention, 2688/amax),
  ``<name>.input_global_scale`` float32 ``[1]`` (scheme "NVFP4", W4A4 only) and ``<name>.bias``
  ``[N]`` when the layer has one. Every other tensor is stored as the model holds it.
* ``config.json``: the model config plus ``quantization_config``, built with compressed-tensors'
  own classes (:func:`quantization_config`, ``ModelCompressor.update_config``), never by hand.
* tokenizer / generation / sentence-transformers files copied from the source model when present.

:func:`save_pretrained` writes into a hidden temporary directory next to ``path`` and renames it
into place only when everything is written, so a failed save never leaves a directory that looks
like a checkpoint. :func:`load` builds the model from its config with every parameter moved to
the meta device as it is created (no float weight is ever materialized for a quantized layer),
then streams tensors from the safetensors files with ``safe_open`` one module at a time;
quantized Linears become
:class:`nvfp4lab.nn.NVFP4Linear` holding the stored bytes and scales unchanged. Pickle files
(``.bin``, ``.pt``, ...) are refused, never unpickled.

compressed-tensors and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import secrets
import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from nvfp4lab.constants import BLOCK_SIZE
from nvfp4lab.nn import SHARE_PRESETS, NVFP4Linear
from nvfp4lab.tensor import NVFP4Tensor

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

__all__ = [
    "CT_FORMAT",
    "FUSED_GROUPS",
    "QUANTIZED_TENSOR_NAMES",
    "SCHEMES",
    "CheckpointError",
    "UnsharedGlobalScaleWarning",
    "fused_groups",
    "load",
    "quantization_config",
    "read_quantization_config",
    "save_pretrained",
]

Scheme = Literal["NVFP4", "NVFP4A16"]
SCHEMES: tuple[str, ...] = ("NVFP4", "NVFP4A16")
CT_FORMAT = "nvfp4-pack-quantized"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
#: Per-module tensors of a quantized Linear, as compressed-tensors names them.
QUANTIZED_TENSOR_NAMES: tuple[str, ...] = (
    "weight_packed",
    "weight_scale",
    "weight_global_scale",
    "input_global_scale",
)
#: Sibling Linear names that inference engines fuse into one GEMM (vLLM's packed modules); they
#: must share one weight global scale (vLLM takes the max over the shards). Same groups as
#: :data:`nvfp4lab.nn.SHARE_PRESETS`.
FUSED_GROUPS: tuple[tuple[str, ...], ...] = tuple(
    dict.fromkeys(group for groups in SHARE_PRESETS.values() for group in groups)
)
#: Small files copied verbatim from the source model directory when they exist.
COPIED_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
)
PICKLE_SUFFIXES: tuple[str, ...] = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read; the message names the file and tensor."""


class UnsharedGlobalScaleWarning(UserWarning):
    """A fused group (q/k/v, gate/up) is saved with different global scales: vLLM, which
    decodes all shards of a fused layer with the largest scale, would compute wrong outputs."""


# ---------------------------------------------------------------------------------------------
# Quantization config (compressed-tensors' own classes)
# ---------------------------------------------------------------------------------------------


def _check_scheme(scheme: str) -> str:
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

    group = preset_name_to_scheme(_check_scheme(scheme), list(targets))
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


def _read_json(file: Path) -> dict[str, Any]:
    try:
        with open(file, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise CheckpointError(f"{file} not found: not a checkpoint directory") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def read_quantization_config(path: str | os.PathLike[str]) -> QuantizationConfig:
    """Read and validate ``<path>/config.json``'s ``quantization_config`` (compressed-tensors).

    Raises :class:`CheckpointError` naming the file for anything but a compressed
    "nvfp4-pack-quantized" config with 4-bit float weights in blocks of 16.
    """
    file = Path(path) / CONFIG_NAME
    qdata = _read_json(file).get("quantization_config")
    if not isinstance(qdata, dict):
        raise CheckpointError(
            f"{file} has no quantization_config: not a compressed-tensors checkpoint (load a "
            "float model with transformers instead)"
        )
    return _validate_config(file, qdata)


# ---------------------------------------------------------------------------------------------
# Helpers shared by save and load
# ---------------------------------------------------------------------------------------------


def fused_groups(
    model: nn.Module, groups: Sequence[Sequence[str]] = FUSED_GROUPS
) -> list[list[str]]:
    """Full module names of sibling Linears that engines fuse (q/k/v, gate/up, ...).

    Only groups whose members all exist under the same parent are returned.
    """
    names = {name for name, _ in model.named_modules()}
    found: list[list[str]] = []
    for parent, _ in model.named_modules():
        prefix = f"{parent}." if parent else ""
        for group in groups:
            members = [prefix + leaf for leaf in group]
            if all(member in names for member in members):
                found.append(members)
    return found


def _check_shared_global_scales(model: nn.Module, quantized: Mapping[str, nn.Module]) -> None:
    for members in fused_groups(model):
        if not all(m in quantized for m in members):
            continue
        for attr in ("weight_global_scale", "input_global_scale"):
            values = [getattr(quantized[m], attr, None) for m in members]
            if any(v is None for v in values):
                continue
            floats = [float(v) for v in values]
            if len(set(floats)) > 1:
                detail = ", ".join(f"{m}={v:.9g}" for m, v in zip(members, floats, strict=True))
                raise CheckpointError(
                    f"fused group {members} has different {attr}s ({detail}); vLLM fuses these "
                    "layers and needs one shared scale. Quantize with "
                    "nvfp4lab.nn.quantize_model(..., share_global_scale='auto') first, or pass "
                    "require_shared_global_scale=False to save it anyway"
                )


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------


def _resolve_scheme(scheme: str | None, quantized: Mapping[str, nn.Module]) -> str:
    with_input = [
        n for n, m in quantized.items() if getattr(m, "input_global_scale", None) is not None
    ]
    if scheme is None:
        if len(with_input) == len(quantized):
            return "NVFP4"
        if not with_input:
            return "NVFP4A16"
        missing = sorted(set(quantized) - set(with_input))
        raise ValueError(
            f"{len(with_input)} of {len(quantized)} NVFP4Linear layers have an "
            f"input_global_scale (missing e.g. {missing[0]!r}); pass scheme='NVFP4A16' to save "
            "weight-only, or calibrate all layers for scheme='NVFP4'"
        )
    _check_scheme(scheme)
    if scheme == "NVFP4" and len(with_input) != len(quantized):
        missing = sorted(set(quantized) - set(with_input))
        raise ValueError(
            f"scheme 'NVFP4' (W4A4) needs an input_global_scale on every quantized layer; "
            f"{len(missing)} have none (e.g. {missing[0]!r}). Calibrate with "
            "nvfp4lab.nn.calibrate_inputs, or save with scheme='NVFP4A16'"
        )
    return scheme


def _quantized_tensors(name: str, module: nn.Module, scheme: str) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one NVFP4Linear, validated."""
    out: dict[str, torch.Tensor] = {}
    packed = module.weight_packed
    scale = module.weight_scale
    n, k = int(module.out_features), int(module.in_features)
    if k % BLOCK_SIZE:
        raise CheckpointError(
            f"{name}: in_features={k} is not a multiple of {BLOCK_SIZE}; the "
            f"{CT_FORMAT} format cannot store a padded NVFP4 weight"
        )
    expected = {
        "weight_packed": (packed, torch.uint8, (n, k // 2)),
        "weight_scale": (scale, torch.float8_e4m3fn, (n, k // BLOCK_SIZE)),
        "weight_global_scale": (module.weight_global_scale, torch.float32, (1,)),
    }
    if scheme == "NVFP4":
        expected["input_global_scale"] = (module.input_global_scale, torch.float32, (1,))
    for leaf, (tensor, dtype, shape) in expected.items():
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{name}.{leaf}: expected {dtype} {list(shape)}, the module holds "
                f"{tensor.dtype} {list(tensor.shape)}"
            )
        out[leaf] = tensor
    bias = getattr(module, "bias", None)
    if bias is not None:
        out["bias"] = bias
    return {f"{name}.{leaf}": t for leaf, t in out.items()}


def _state_to_save(
    model: nn.Module, quantized: Mapping[str, nn.Module], scheme: str, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Name -> tensor in ``model.state_dict()`` order; tied (aliased) tensors written once.

    ``dtype``: cast unquantized floating tensors (and biases) to it; packed weights, block
    scales and float32 global scales are never touched.
    """
    tensors: dict[str, torch.Tensor] = {}
    for name, module in quantized.items():
        for key, tensor in _quantized_tensors(name, module, scheme).items():
            if dtype is not None and key.endswith(".bias"):
                tensor = tensor.to(dtype)
            tensors[key] = tensor
    skip = {"" if not name else f"{name}." for name in quantized}
    tied_targets = _tied_targets(model)
    seen: dict[tuple[int, int, tuple[int, ...], torch.dtype], str] = {}
    ordered: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict(keep_vars=False).items():
        owner = next((p for p in skip if key.startswith(p)), None)
        if owner is not None:
            if key in tensors:
                ordered[key] = tensors[key]
            continue
        if tensor.device.type == "meta":
            raise CheckpointError(f"{key} is on the meta device (never loaded); cannot save it")
        ident = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.dtype,
        )
        if tensor.numel() and ident in seen:
            if key in tied_targets:
                continue  # transformers re-ties it from the source on load
            if seen[ident] in tied_targets:
                del ordered[seen[ident]]
            else:
                continue
        seen[ident] = key
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        ordered[key] = tensor
    for key, tensor in tensors.items():
        ordered.setdefault(key, tensor)
    return ordered


def _tied_targets(model: nn.Module) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None)
    if isinstance(keys, Mapping):
        return set(keys)
    if isinstance(keys, list | tuple | set):
        return set(keys)
    return set()


def _write_shards(
    tensors: Mapping[str, torch.Tensor], directory: Path, max_shard_bytes: int
) -> list[str]:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor.detach().to("cpu").contiguous()
        size += nbytes
    if len(shards) == 1:
        names = [WEIGHTS_NAME]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(directory / WEIGHTS_INDEX_NAME, "w", encoding="utf-8") as handle:
            json.dump(index, handle, indent=2, sort_keys=True)
    return names


def _model_dtype(model: nn.Module, quantized: Mapping[str, nn.Module]) -> torch.dtype:
    for module in quantized.values():
        dtype = getattr(module, "dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _write_config(
    model: nn.Module, directory: Path, source: Path | None, dtype: torch.dtype
) -> None:
    """config.json as transformers writes it (diff against defaults); the quantization config is
    added afterwards by compressed-tensors' ``ModelCompressor.update_config``."""
    config = getattr(model, "config", None)
    file = directory / CONFIG_NAME
    if config is not None and hasattr(config, "to_json_file"):
        config = copy.deepcopy(config)
        if type(model).__module__.startswith("transformers."):
            config.architectures = [type(model).__name__]
        config.dtype = dtype
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.to_json_file(str(file), use_diff=True)
        return
    if source is not None and (source / CONFIG_NAME).is_file():
        data = _read_json(source / CONFIG_NAME)
        data.pop("quantization_config", None)
    else:
        data = {}
    with open(file, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)


def _source_dir(model: nn.Module, source: str | os.PathLike[str] | None) -> Path | None:
    if source is not None:
        path = Path(source)
        if not path.is_dir():
            raise FileNotFoundError(f"source={str(source)!r} is not a directory")
        return path
    config = getattr(model, "config", None)
    for candidate in (
        getattr(config, "_name_or_path", None),
        getattr(model, "name_or_path", None),
    ):
        if isinstance(candidate, str) and candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


def _copy_side_files(source: Path | None, directory: Path, written: set[str]) -> list[str]:
    copied: list[str] = []
    if source is None:
        return copied
    for rel in COPIED_FILES:
        src = source / rel
        if rel in written or not src.is_file():
            continue
        dst = directory / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        copied.append(rel)
    return copied


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    scheme: Scheme | None = None,
    source: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    require_shared_global_scale: bool | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write ``model`` (quantized Linears are NVFP4Linear) as a compressed-tensors checkpoint.

    ``scheme``: "NVFP4" (W4A4; every quantized layer needs ``input_global_scale``),
    "NVFP4A16" (weight-only; input scales are not written), or None to infer it from the
    layers. Plain ``nn.Linear`` layers stay float and are listed in the config's ``ignore``.
    ``source``: a directory whose tokenizer/generation files are copied (default: the model's
    ``config._name_or_path`` when that is a local directory). ``require_shared_global_scale``:
    every fused group (:data:`FUSED_GROUPS`: q/k/v, gate/up, ...) must share its global scales
    to load correctly in vLLM (it decodes all shards with the max); ``True`` raises when one does
    not, ``None`` (default) warns with :class:`UnsharedGlobalScaleWarning`, ``False`` is silent.
    ``dtype``: cast the unquantized floating tensors (embeddings,
    norms, biases, float Linears) to it and record it as the config's dtype; default: keep them.
    ``overwrite``: replace an existing ``path``; ``max_shard_bytes``: split the weights into
    several files (with ``model.safetensors.index.json``) above this size.

    The packed bytes and scales are written exactly as the modules hold them. The directory is
    assembled under a temporary name and renamed into place at the end. Returns ``path``.

    Note: compressed-tensors 0.20 decompresses NVFP4 weights to bfloat16 whatever the model
    dtype (fixed upstream later, compressed-tensors PR #839), so transformers can run a
    checkpoint only in bfloat16: save with ``dtype=torch.bfloat16`` or load it with
    ``from_pretrained(..., dtype=torch.bfloat16)``.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.utils.match import is_match

    target = Path(path)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    if not quantized:
        raise ValueError(
            "the model has no NVFP4Linear layer; quantize it first "
            "(nvfp4lab.nn.quantize_model) or save it with transformers"
        )
    if "" in quantized:
        raise ValueError("the model itself is an NVFP4Linear; wrap it in a container module")
    resolved = _resolve_scheme(scheme, quantized)
    if require_shared_global_scale is not False:
        try:
            _check_shared_global_scales(model, quantized)
        except CheckpointError as err:
            if require_shared_global_scale:
                raise
            warnings.warn(str(err), UnsharedGlobalScaleWarning, stacklevel=2)
    ignore = [
        name
        for name, module in model.named_modules()
        if name and not isinstance(module, NVFP4Linear) and is_match(name, module, "Linear")
    ]
    config = quantization_config(resolved, ignore=ignore)  # type: ignore[arg-type]
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    tensors = _state_to_save(model, quantized, resolved, dtype)
    src = _source_dir(model, source)

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_dir(target, "tmp")
    try:
        shards = _write_shards(tensors, tmp, max_shard_bytes)
        _write_config(model, tmp, src, dtype or _model_dtype(model, quantized))
        ModelCompressor(quantization_config=config).update_config(str(tmp))
        written = {CONFIG_NAME, *shards}
        generation = getattr(model, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained") and (
            src is None or not (src / "generation_config.json").is_file()
        ):
            generation.save_pretrained(str(tmp))
            written.add("generation_config.json")
        _copy_side_files(src, tmp, written)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _fresh_dir(target: Path, tag: str) -> Path:
    """A new hidden sibling ``.<name>.<tag>-<random>`` of ``target`` (mode from the umask)."""
    for _ in range(100):
        candidate = target.parent / f".{target.name}.{tag}-{secrets.token_hex(4)}"
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"cannot create a temporary directory next to {target}")


def _replace_dir(tmp: Path, target: Path) -> None:
    """Move the finished ``tmp`` to ``target``; an old ``target`` is removed only afterwards."""
    if not target.exists():
        os.replace(tmp, target)
        return
    old = _fresh_dir(target, "old")
    old.rmdir()
    os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.replace(old, target)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------


def _refuse_pickle(file: Path) -> CheckpointError:
    return CheckpointError(
        f"{file} is a pickle file ({file.suffix}); nvfp4lab never unpickles checkpoints "
        "(unpickling runs arbitrary code). Convert it to safetensors with a trusted tool first"
    )


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, refusing pickles."""
    index = directory / WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = sorted({directory / str(v) for v in weight_map.values()})
        for file in files:
            if file.suffix in PICKLE_SUFFIXES:
                raise _refuse_pickle(file)
        return files
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if found:
        return found
    pickles = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise _refuse_pickle(pickles[0])
    raise CheckpointError(f"{directory} holds no .safetensors weight file")


class _TensorSource:
    """Lazy access to the tensors of several safetensors files (memory-mapped, no unpickling).

    ``entries`` maps the model-side key to (file, stored key); :meth:`rekey` renames keys.
    """

    def __init__(self, files: Sequence[Path], device: torch.device, stack: contextlib.ExitStack):
        from safetensors import safe_open

        self.entries: dict[str, tuple[Path, str]] = {}
        self._handles: dict[Path, Any] = {}
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file} is listed in the checkpoint but does not exist")
            try:
                handle = stack.enter_context(
                    safe_open(str(file), framework="pt", device=str(device))
                )
                keys = list(handle.keys())
            except Exception as exc:  # SafetensorError for truncated / corrupt headers
                raise CheckpointError(
                    f"{file}: cannot read it as safetensors ({exc}); the file is truncated, "
                    "corrupt or not a safetensors file"
                ) from exc
            self._handles[file] = handle
            for key in keys:
                self.entries.setdefault(key, (file, key))

    def rekey(self, strip: str, add: str) -> None:
        """Rename every key ``k`` to ``add + k.removeprefix(strip)``."""
        self.entries = {add + k.removeprefix(strip): v for k, v in self.entries.items()}

    def file_of(self, key: str) -> Path | None:
        entry = self.entries.get(key)
        return None if entry is None else entry[0]

    def files(self) -> str:
        return ", ".join(sorted({str(f) for f, _ in self.entries.values()}))

    def get(self, key: str) -> torch.Tensor:
        file, stored = self.entries[key]
        try:
            return self._handles[file].get_tensor(stored)
        except Exception as exc:
            raise CheckpointError(f"{file}: cannot read tensor {stored!r} ({exc})") from exc

    def meta(self, key: str) -> tuple[str, list[int]]:
        """(safetensors dtype string such as "U8", shape) without reading the data."""
        file, stored = self.entries[key]
        view = self._handles[file].get_slice(stored)
        return view.get_dtype(), list(view.get_shape())


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create every ``nn.Parameter`` on the meta device while modules are built.

    Buffers stay real (position ids, rotary frequencies are computed in ``__init__`` and often
    not stored in checkpoints). Not thread-safe: it patches ``nn.Module.register_parameter``.
    """
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _config_dtype(config: Any) -> torch.dtype | None:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


def _build_skeleton(
    directory: Path, dtype: torch.dtype | None, model_class: type[nn.Module] | None
) -> tuple[nn.Module, torch.dtype]:
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"{directory / CONFIG_NAME}: transformers cannot build a config from it ({exc})"
        ) from exc
    dtype = dtype or _config_dtype(config) or torch.float32
    cls: Any = model_class
    if cls is None:
        for arch in getattr(config, "architectures", None) or ():
            cls = getattr(transformers, arch, None)
            if cls is not None:
                break
    with _parameters_on_meta():
        if cls is None:
            model = transformers.AutoModel.from_config(config, dtype=dtype)
        elif hasattr(cls, "_from_config"):
            model = cls._from_config(config, dtype=dtype)
        else:
            model = cls(config)
    return model, dtype


_ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


def _missing(source: _TensorSource, key: str) -> CheckpointError:
    return CheckpointError(
        f"missing tensor {key!r}: it is in none of the checkpoint's weight files "
        f"({source.files()})"
    )


def _stored(source: _TensorSource, key: str) -> tuple[Path, torch.dtype | str, list[int]]:
    file = source.file_of(key)
    if file is None:
        raise _missing(source, key)
    st_dtype, shape = source.meta(key)
    return file, _ST_DTYPES.get(st_dtype, st_dtype), shape


def _read_exact(
    source: _TensorSource, key: str, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """Read ``key`` after checking its stored dtype and shape (errors name file and tensor)."""
    file, found, found_shape = _stored(source, key)
    if found != dtype:
        raise CheckpointError(f"{file}: tensor {key!r} has dtype {found}, expected {dtype}")
    if found_shape != list(shape):
        raise CheckpointError(
            f"{file}: tensor {key!r} has shape {found_shape}, expected {list(shape)}"
        )
    return source.get(key)


def _read_like(source: _TensorSource, key: str, like: torch.Tensor) -> torch.Tensor:
    """Read ``key`` for a parameter/buffer shaped like ``like``; floats are cast to its dtype."""
    file, found, found_shape = _stored(source, key)
    if found_shape != list(like.shape):
        raise CheckpointError(
            f"{file}: tensor {key!r} has shape {found_shape}, the model expects "
            f"{list(like.shape)}"
        )
    if not isinstance(found, torch.dtype) or found.is_floating_point != like.is_floating_point():
        raise CheckpointError(
            f"{file}: tensor {key!r} has dtype {found}, the model expects {like.dtype}"
        )
    return source.get(key).to(like.dtype)


def _check_global_scale(source: _TensorSource, key: str, value: torch.Tensor) -> torch.Tensor:
    flat = value.reshape(-1).to(torch.float64)
    if not (math.isfinite(float(flat)) and float(flat) > 0):
        raise CheckpointError(
            f"{source.file_of(key)}: tensor {key!r} must be finite and > 0 (ENCODE convention, "
            f"2688/amax), got {float(flat)}"
        )
    return value.reshape(1)


def _check_block_scales(source: _TensorSource, key: str, scales: torch.Tensor) -> torch.Tensor:
    """Block scales are unsigned in hardware (UE4M3): refuse NaN codes and negative values."""
    raw = scales.view(torch.uint8)
    nan = (raw & 0x7F) == 0x7F
    negative = (raw & 0x80).bool() & ((raw & 0x7F) != 0)
    bad = nan | negative
    if bool(bad.any()):
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise CheckpointError(
            f"{source.file_of(key)}: tensor {key!r} holds {int(nan.sum())} NaN and "
            f"{int(negative.sum())} negative E4M3 block scale(s) (first at {first}, byte "
            f"0x{int(raw[first]):02x}); NVFP4 block scales are non-negative and finite, so this "
            "checkpoint is corrupt or not NVFP4"
        )
    return scales


def _quantized_modules(
    model: nn.Module, config: QuantizationConfig, config_file: Path
) -> dict[str, QuantizationScheme]:
    """Module name -> scheme, matched with compressed-tensors' own target/ignore rules."""
    from compressed_tensors.utils.match import match_named_modules, match_targets

    target_to_scheme: dict[str, QuantizationScheme] = {}
    for group in config.config_groups.values():
        for target in group.targets:
            target_to_scheme[target] = group
    out: dict[str, QuantizationScheme] = {}
    for name, module in match_named_modules(model, list(target_to_scheme), config.ignore or []):
        if not isinstance(module, nn.Linear):
            raise CheckpointError(
                f"{config_file}: module {name!r} ({type(module).__name__}) is targeted for "
                "quantization; nvfp4lab loads quantized nn.Linear layers only"
            )
        out[name] = target_to_scheme[match_targets(name, module, target_to_scheme)[0]]
    if not out:
        raise CheckpointError(
            f"{config_file}: the quantization_config targets no module of the model "
            f"(targets {list(target_to_scheme)}, ignore {config.ignore})"
        )
    return out


def _expected_keys(model: nn.Module, quantized: Mapping[str, QuantizationScheme]) -> set[str]:
    prefixes = tuple(f"{name}." for name in quantized)
    keys = {k for k in model.state_dict() if not k.startswith(prefixes)}
    for name in quantized:
        keys.update(f"{name}.{leaf}" for leaf in ("weight_packed", "weight_scale"))
    return keys


def _key_prefix_fix(model: nn.Module, keys: set[str], expected: set[str]) -> tuple[str, str]:
    """(strip, add) turning stored keys into model keys via ``base_model_prefix``.

    Handles a checkpoint saved from ``BertForX`` (keys ``bert.…``) loaded as ``BertModel`` and
    the reverse, as transformers does.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix or keys & expected:
        return "", ""
    dotted = f"{prefix}."
    if {k.removeprefix(dotted) for k in keys if k.startswith(dotted)} & expected:
        return dotted, ""
    if {dotted + k for k in keys} & expected:
        return "", dotted
    return "", ""


def _load_quantized_linear(
    source: _TensorSource,
    name: str,
    module: nn.Linear,
    scheme: QuantizationScheme,
    dtype: torch.dtype,
    backend: str,
) -> tuple[nn.Module, set[str]]:

    n, k = module.out_features, module.in_features
    if k % BLOCK_SIZE:
        raise CheckpointError(f"{name}: in_features={k} is not a multiple of {BLOCK_SIZE}")
    keys = {leaf: f"{name}.{leaf}" for leaf in (*QUANTIZED_TENSOR_NAMES, "bias")}
    packed = _read_exact(source, keys["weight_packed"], torch.uint8, (n, k // 2))
    scales = _read_exact(
        source, keys["weight_scale"], torch.float8_e4m3fn, (n, k // BLOCK_SIZE)
    )
    scales = _check_block_scales(source, keys["weight_scale"], scales)
    gs = _read_exact(source, keys["weight_global_scale"], torch.float32, (1,))
    gs = _check_global_scale(source, keys["weight_global_scale"], gs)
    used = {keys["weight_packed"], keys["weight_scale"], keys["weight_global_scale"]}
    input_gs = None
    acts = scheme.input_activations
    if acts is not None and acts.dynamic is not True:
        input_gs = _read_exact(source, keys["input_global_scale"], torch.float32, (1,))
        input_gs = _check_global_scale(source, keys["input_global_scale"], input_gs)
        used.add(keys["input_global_scale"])
    bias = None
    if module.bias is not None:
        bias = _read_like(source, keys["bias"], module.bias)
        used.add(keys["bias"])
    weight = NVFP4Tensor(packed=packed, scales=scales, global_scale=gs, shape=(n, k), dtype=dtype)
    layer = NVFP4Linear.from_quantized(
        weight, bias, input_global_scale=input_gs, backend=backend
    )
    return layer, used


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, leaf = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), leaf


def _load_plain_tensors(
    model: nn.Module, source: _TensorSource, skip: Sequence[str]
) -> set[str]:
    """Fill every parameter and buffer outside ``skip`` (module names) that the files hold.

    Tied parameters (one Parameter under several names) are read once and stay tied.
    """
    prefixes = tuple(f"{name}." for name in skip)
    used: set[str] = set()
    aliases: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if not name.startswith(prefixes):
            aliases.setdefault(id(param), (param, []))[1].append(name)
    for param, names in aliases.values():
        present = [n for n in names if source.file_of(n) is not None]
        if not present:
            continue
        value = _read_like(source, present[0], param)
        new = nn.Parameter(value, requires_grad=param.requires_grad)
        for name in names:
            owner, leaf = _owner(model, name)
            owner._parameters[leaf] = new
        used.update(present)
    for name, buffer in list(model.named_buffers(remove_duplicate=False)):
        if name.startswith(prefixes) or source.file_of(name) is None:
            continue
        owner, leaf = _owner(model, name)
        owner._buffers[leaf] = _read_like(source, name, buffer)
        used.add(name)
    return used


def load(
    path: str | os.PathLike[str],
    *,
    backend: str = "auto",
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    model_class: type[nn.Module] | None = None,
    strict: bool = True,
) -> nn.Module:
    """Load a compressed-tensors NVFP4 checkpoint directory into a transformers model.

    Targeted Linears (compressed-tensors' target/ignore matching) become
    :class:`nvfp4lab.nn.NVFP4Linear` (``backend`` passed on) holding the stored
    ``weight_packed`` / ``weight_scale`` / global scales byte for byte; other float tensors are
    cast to ``dtype`` (default: the config's dtype, else float32). ``model_class``: the
    transformers class to build (default: ``config.architectures[0]``, else ``AutoModel``).
    ``strict``: raise on stored tensors the model has no place for. Raises
    :class:`CheckpointError` naming the file and tensor for a missing tensor, a wrong dtype or
    shape, a format other than nvfp4-pack-quantized, a group size other than 16, a pickle file
    or a truncated file. Returns the model in eval mode on ``device``.
    """
    directory = Path(path)
    if directory.is_file():
        if directory.suffix in PICKLE_SUFFIXES:
            raise _refuse_pickle(directory)
        raise CheckpointError(f"{directory} is a file; pass the checkpoint directory")
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    qconfig = read_quantization_config(directory)
    files = _weight_files(directory)
    device = torch.device(device)
    model, dtype = _build_skeleton(directory, dtype, model_class)
    quantized = _quantized_modules(model, qconfig, directory / CONFIG_NAME)

    with contextlib.ExitStack() as stack:
        source = _TensorSource(files, device, stack)
        strip, add = _key_prefix_fix(model, set(source.entries), _expected_keys(model, quantized))
        source.rekey(strip, add)
        used: set[str] = set()
        for name, scheme in quantized.items():
            module = model.get_submodule(name)
            assert isinstance(module, nn.Linear)
            layer, keys = _load_quantized_linear(source, name, module, scheme, dtype, backend)
            owner, leaf = _owner(model, name)
            setattr(owner, leaf, layer)
            used |= keys
        used |= _load_plain_tensors(model, source, list(quantized))
        unexpected = sorted(set(source.entries) - used)
        if strict and unexpected:
            shown = ", ".join(repr(k) for k in unexpected[:5])
            raise CheckpointError(
                f"{source.file_of(unexpected[0])}: {len(unexpected)} stored tensor(s) have no "
                f"place in {type(model).__name__} (e.g. {shown}); pass strict=False to ignore "
                "them"
            )
        leftovers = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
        if leftovers:
            raise _missing(source, leftovers[0])
    model.to(device)
    model.eval()
    return model
