"""Read a compressed-tensors NVFP4 checkpoint into a transformers model with NVFP4Linear layers.

The model is built from its config with every parameter moved to the meta device as it is
created (no float weight is ever materialized for a quantized layer), then tensors are streamed
from the safetensors files one module at a time; quantized Linears become
:class:`nvfp4lab.execution.layers.NVFP4Linear` holding the stored bytes and scales unchanged.
transformers is imported inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nvfp4lab.checkpoint.config import QUANTIZED_TENSOR_NAMES, read_quantization_config
from nvfp4lab.checkpoint.files import (
    CONFIG_NAME,
    PICKLE_SUFFIXES,
    CheckpointError,
    TensorSource,
    missing_tensor,
    read_exact,
    read_like,
    refuse_pickle,
    weight_files,
)
from nvfp4lab.constants import BLOCK_SIZE
from nvfp4lab.execution.layers import NVFP4Linear
from nvfp4lab.tensor import NVFP4Tensor, invalid_block_scales

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

__all__ = ["load"]

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


def _check_global_scale(source: TensorSource, key: str, value: torch.Tensor) -> torch.Tensor:
    flat = value.reshape(-1).to(torch.float64)
    if not (math.isfinite(float(flat)) and float(flat) > 0):
        raise CheckpointError(
            f"{source.file_of(key)}: tensor {key!r} must be finite and > 0 (ENCODE convention, "
            f"2688/amax), got {float(flat)}"
        )
    return value.reshape(1)


def _check_block_scales(source: TensorSource, key: str, scales: torch.Tensor) -> torch.Tensor:
    """Block scales are unsigned in hardware (UE4M3): refuse NaN codes and negative values."""
    nan, negative, first = invalid_block_scales(scales)
    if first is not None:
        byte = int(scales.view(torch.uint8)[first])
        raise CheckpointError(
            f"{source.file_of(key)}: tensor {key!r} holds {nan} NaN and {negative} negative "
            f"E4M3 block scale(s) (first at {first}, byte 0x{byte:02x}); NVFP4 block scales are "
            "non-negative and finite, so this checkpoint is corrupt or not NVFP4"
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
    source: TensorSource,
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
    packed = read_exact(source, keys["weight_packed"], torch.uint8, (n, k // 2))
    scales = read_exact(
        source, keys["weight_scale"], torch.float8_e4m3fn, (n, k // BLOCK_SIZE)
    )
    scales = _check_block_scales(source, keys["weight_scale"], scales)
    gs = read_exact(source, keys["weight_global_scale"], torch.float32, (1,))
    gs = _check_global_scale(source, keys["weight_global_scale"], gs)
    used = {keys["weight_packed"], keys["weight_scale"], keys["weight_global_scale"]}
    input_gs = None
    acts = scheme.input_activations
    if acts is not None and acts.dynamic is not True:
        input_gs = read_exact(source, keys["input_global_scale"], torch.float32, (1,))
        input_gs = _check_global_scale(source, keys["input_global_scale"], input_gs)
        used.add(keys["input_global_scale"])
    bias = None
    if module.bias is not None:
        bias = read_like(source, keys["bias"], module.bias)
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
    model: nn.Module, source: TensorSource, skip: Sequence[str]
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
        value = read_like(source, present[0], param)
        new = nn.Parameter(value, requires_grad=param.requires_grad)
        for name in names:
            owner, leaf = _owner(model, name)
            owner._parameters[leaf] = new
        used.update(present)
    for name, buffer in list(model.named_buffers(remove_duplicate=False)):
        if name.startswith(prefixes) or source.file_of(name) is None:
            continue
        owner, leaf = _owner(model, name)
        owner._buffers[leaf] = read_like(source, name, buffer)
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
    :class:`nvfp4lab.NVFP4Linear` (``backend`` passed on) holding the stored
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
            raise refuse_pickle(directory)
        raise CheckpointError(f"{directory} is a file; pass the checkpoint directory")
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    qconfig = read_quantization_config(directory)
    files = weight_files(directory)
    device = torch.device(device)
    model, dtype = _build_skeleton(directory, dtype, model_class)
    quantized = _quantized_modules(model, qconfig, directory / CONFIG_NAME)

    with contextlib.ExitStack() as stack:
        source = TensorSource(files, device, stack)
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
            raise missing_tensor(source, leftovers[0])
    model.to(device)
    model.eval()
    return model
