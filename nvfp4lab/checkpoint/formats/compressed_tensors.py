"""The compressed-tensors ``nvfp4-pack-quantized`` checkpoint format (:data:`SPEC`).

Built and validated with compressed-tensors' own classes, never by hand. On disk, per quantized
Linear ``<name>``: ``<name>.weight_packed`` uint8 ``[N, K/2]`` (element ``2i`` in the low
nibble), ``<name>.weight_scale`` float8_e4m3fn ``[N, K/16]`` (plain row-major layout),
``<name>.weight_global_scale`` float32 ``[1]`` (ENCODE form, 2688/amax, as nvfp4lab holds
it in memory), ``<name>.input_global_scale`` float32 ``[1]`` (scheme "NVFP4", W4A4 only) and
``<name>.bias``. ``config.json`` carries ``quantization_config`` with ``quant_method:
"compressed-tensors"``, ``format: "nvfp4-pack-quantized"``, ``quantization_status:
"compressed"`` and config groups of 4-bit float weights in ``tensor_group`` blocks of 16
(compressed-tensors' presets "NVFP4", "NVFP4A16"). Which Linears are quantized follows
compressed-tensors' own target / ignore matching. compressed-tensors is imported inside the
functions that need it.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nvfp4lab.checkpoint.formats.tensor_scales import TensorScaleForm
from nvfp4lab.checkpoint.records import (
    Contents,
    KVCacheNames,
    LayerNames,
    TaskRunner,
    Unquantized,
)
from nvfp4lab.checkpoint.refusals import CheckpointError, read_json
from nvfp4lab.checkpoint.safetensors_files import (
    CONFIG_NAME,
    SafetensorsContainer,
    quantization_block,
)
from nvfp4lab.constants import BLOCK_SIZE
from nvfp4lab.vocab import TENSOR_SCALE_STORAGE, CheckpointFormat, Scheme, check_choice

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

__all__ = [
    "CT_FORMAT",
    "KV_CACHE_NAMES",
    "QUANTIZED_TENSOR_NAMES",
    "QUANT_METHOD",
    "SCHEMES",
    "SPEC",
    "CompressedTensors",
    "CompressedTensorsConfig",
    "check_scheme",
    "ignore_entries",
    "kv_cache_scheme",
    "quantization_config",
    "read_quantization_config",
]

#: The compressed-tensors presets nvfp4lab writes and reads (:class:`nvfp4lab.vocab.Scheme`).
SCHEMES: tuple[str, ...] = tuple(s.value for s in Scheme)
CT_FORMAT = "nvfp4-pack-quantized"
#: ``quantization_config.quant_method`` of a compressed-tensors checkpoint.
QUANT_METHOD = "compressed-tensors"
#: The tensor names of one quantized Linear (ENCODE tensor scales, float32 ``[1]``).
NAMES = LayerNames(
    "weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", (1,),
    TENSOR_SCALE_STORAGE[CheckpointFormat.COMPRESSED_TENSORS].decode,
)
#: Per-module tensors of a quantized Linear, as compressed-tensors names them.
QUANTIZED_TENSOR_NAMES: tuple[str, ...] = (
    NAMES.packed, NAMES.block_scale, NAMES.tensor_scale, NAMES.input_scale
)


def check_scheme(scheme: object) -> Scheme:
    """``scheme`` as a :class:`~nvfp4lab.vocab.Scheme` (ValueError in the one wording)."""
    return check_choice("scheme", scheme, Scheme)  # type: ignore[return-value]


def quantization_config(
    scheme: Scheme | str = Scheme.NVFP4, *, ignore: Sequence[str] = (),
    targets: Sequence[str] = ("Linear",),
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

    group = preset_name_to_scheme(check_scheme(scheme).value, list(targets))
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
    if method != QUANT_METHOD:
        raise _config_error(
            file, f"quantization_config.quant_method is {method!r}, not {QUANT_METHOD!r}"
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
    if qdata is not None and not isinstance(qdata, dict):
        raise CheckpointError(f"{file}: quantization_config is a {type(qdata).__name__}, "
                              "expected a JSON object")
    if not isinstance(qdata, dict):
        raise CheckpointError(
            f"{file} has no quantization_config: not a compressed-tensors checkpoint (load a "
            "float model with transformers instead)"
        )
    return _validate_config(file, qdata)


def ignore_entries(patterns: Iterable[str]) -> list[str]:
    """Module names and fnmatch wildcards as compressed-tensors ``ignore`` entries: plain names
    stay, wildcards become ``re:`` patterns (``fnmatch.translate``)."""
    return [
        f"re:{fnmatch.translate(p)}" if any(c in p for c in "*?[") else p for p in patterns
    ]


def _static_input(group: QuantizationScheme) -> bool:
    """Whether the group stores a static activation scale (W4A4 with a calibrated scale)."""
    acts = group.input_activations
    return acts is not None and acts.dynamic is not True


@dataclass(frozen=True)
class CompressedTensorsConfig:
    """A validated compressed-tensors ``quantization_config`` (``file``: where it was read)."""

    config: QuantizationConfig
    file: Path

    @property
    def unquantized(self) -> tuple[str, ...]:
        """The config's ``ignore`` entries (names or ``re:`` patterns)."""
        return tuple(self.config.ignore or ())

    @property
    def kv_cache(self) -> str | None:
        """The KV cache kind ``kv_cache_scheme`` declares (``"fp8"``), None without one;
        CheckpointError naming the file for a scheme vLLM 0.33 or nvfp4lab cannot run
        (:func:`kv_cache_kind`)."""
        return kv_cache_kind(self.config.kv_cache_scheme, self.file)

    def checkpoint_scheme(self) -> Scheme:
        """The one scheme of every config group; CheckpointError when they mix."""
        static = [_static_input(g) for g in self.config.config_groups.values()]
        if any(static) and not all(static):
            raise CheckpointError(f"{self.file}: config groups mix W4A4 and weight-only layers; "
                                  "nvfp4lab reads one scheme per checkpoint (as a ModelOpt "
                                  "NVFP4 checkpoint holds one)")
        return Scheme.NVFP4 if all(static) else Scheme.NVFP4A16

    def quantized_modules(self, model: nn.Module) -> dict[str, bool]:
        """Module name -> whether it stores a static input scale, matched with
        compressed-tensors' own target / ignore rules."""
        from compressed_tensors.utils.match import match_named_modules, match_targets

        config = self.config
        target_to_scheme: dict[str, QuantizationScheme] = {}
        for group in config.config_groups.values():
            for target in group.targets:
                target_to_scheme[target] = group
        out: dict[str, bool] = {}
        for name, module in match_named_modules(model, list(target_to_scheme),
                                                config.ignore or []):
            if not isinstance(module, nn.Linear):
                raise CheckpointError(
                    f"{self.file}: module {name!r} ({type(module).__name__}) is targeted for "
                    "quantization; nvfp4lab loads quantized nn.Linear layers only"
                )
            group = target_to_scheme[match_targets(name, module, target_to_scheme)[0]]
            out[name] = _static_input(group)
        if not out:
            raise CheckpointError(
                f"{self.file}: the quantization_config targets no module of the model "
                f"(targets {list(target_to_scheme)}, ignore {config.ignore})"
            )
        return out


#: Where a compressed-tensors checkpoint stores the KV cache's DECODE scales: ``<attn>.k_scale`` /
#: ``<attn>.v_scale`` on the attention module, float32 ``[1]`` (compressed-tensors'
#: ``initialize_qparams`` of a ``tensor`` strategy; ``[]`` also read); a missing one is 1.0, the
#: ``torch.ones`` vLLM 0.33's ``CompressedTensorsKVCacheMethod.create_weights`` starts from.
KV_CACHE_NAMES = KVCacheNames("k_scale", "v_scale", (1,), ((),), missing=1.0)


def kv_cache_scheme(kind: str) -> dict[str, Any]:
    """The ``kv_cache_scheme`` of a ``kind`` KV cache as compressed-tensors' ``QuantizationArgs``
    dumps it: FP8 E4M3, one static symmetric scale per tensor (what llm-compressor writes and
    vLLM 0.33 reads). ValueError for the NVFP4 kinds (:func:`kv_cache_refusal`)."""
    from compressed_tensors.quantization import QuantizationArgs

    problem = kv_cache_refusal(kind)
    if problem is not None:
        raise ValueError(problem)
    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False,
                            symmetric=True)
    return dict(args.model_dump(mode="json"))


def kv_cache_refusal(kind: str) -> str | None:
    """Why a compressed-tensors checkpoint cannot declare a ``kind`` KV cache (None: it can)."""
    if kind == "fp8":
        return None
    return (f"a compressed-tensors checkpoint cannot declare an {kind} KV cache that vLLM 0.33 "
            "loads: its CompressedTensorsKVCacheMethod.validate_kv_cache_scheme accepts "
            "num_bits 8, type float only (an NVFP4 kv_cache_scheme fails at load); save with "
            "format='modelopt' (kv_cache_quant_algo NVFP4)")


def kv_cache_kind(scheme: Any, file: Path) -> str | None:
    """The KV cache kind of a validated ``kv_cache_scheme`` (``QuantizationArgs`` or None):
    ``"fp8"`` for 8-bit float, ``tensor`` strategy, symmetric; CheckpointError naming ``file``
    for what vLLM 0.33 refuses (another type or size, asymmetric) or nvfp4lab does not model
    (per-head ``attn_head`` scales, which vLLM 0.33 reduces to their max)."""
    if scheme is None:
        return None
    found = (scheme.num_bits, _value(scheme.type), _value(scheme.strategy), scheme.symmetric)
    if found[:2] != (8, "float") or not scheme.symmetric:
        raise _config_error(
            file, f"kv_cache_scheme is num_bits={found[0]}, type={found[1]}, symmetric="
            f"{found[3]}; vLLM 0.33 loads an FP8 (num_bits 8, float, symmetric) scheme only")
    if found[2] != "tensor":
        raise _config_error(
            file, f"kv_cache_scheme strategy is {found[2]!r}; nvfp4lab models one k / v scale "
            "per layer (strategy 'tensor') only")
    return "fp8"


def _add_kv_cache_scheme(folder: Path, kind: str) -> None:
    """Add ``quantization_config.kv_cache_scheme`` of a ``kind`` cache to ``folder/config.json``,
    checked by compressed-tensors' own ``QuantizationConfig.model_validate``."""
    from compressed_tensors.quantization import QuantizationConfig

    file = folder / CONFIG_NAME
    data = read_json(file)
    block = data["quantization_config"]
    block["kv_cache_scheme"] = kv_cache_scheme(kind)
    fields = set(QuantizationConfig.model_fields)
    QuantizationConfig.model_validate({k: v for k, v in block.items() if k in fields})
    file.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")


class CompressedTensors(TensorScaleForm, SafetensorsContainer):
    """The compressed-tensors ``nvfp4-pack-quantized`` format (see the module docstring)."""

    format = CheckpointFormat.COMPRESSED_TENSORS
    title = "compressed-tensors"
    description = f"{QUANT_METHOD!r} ({CT_FORMAT})"
    names = NAMES
    weight_files: tuple[str, ...] = ()
    optional_tensor_scale: str | None = None
    shares_fused_scales = TENSOR_SCALE_STORAGE[format].shared_in_fused_groups
    writes_in_tasks = True
    config_files: tuple[str, ...] = ()
    #: compressed-tensors 0.20 decompresses NVFP4 weights to bfloat16 in transformers.
    transformers_needs_bfloat16 = True

    def detect(self, directory: Path) -> bool:
        """``config.json`` ``quantization_config.quant_method == "compressed-tensors"``."""
        block = quantization_block(directory)
        return block is not None and block.get("quant_method") == QUANT_METHOD

    def read_config(self, directory: Path) -> CompressedTensorsConfig:
        return CompressedTensorsConfig(read_quantization_config(directory),
                                       directory / CONFIG_NAME)

    kv_cache_names = KV_CACHE_NAMES

    def kv_cache_refusal(self, kind: str) -> str | None:
        """Why this format cannot hold a ``kind`` KV cache (None: it can: FP8)."""
        return kv_cache_refusal(kind)

    def write_checkpoint(self, folder: Path, contents: Contents,
                         run: TaskRunner | None = None) -> list[str]:
        """The safetensors checkpoint, then ``kv_cache_scheme`` when ``contents.kv_cache``."""
        written = SafetensorsContainer.write_checkpoint(self, folder, contents, run)
        if contents.kv_cache is not None:
            _add_kv_cache_scheme(folder, contents.kv_cache)
        return written

    def write_config(self, folder: Path, scheme: Scheme, unquantized: Unquantized) -> None:
        """Add the ``quantization_config`` to ``folder/config.json`` (compressed-tensors'
        ``ModelCompressor.update_config``; ``ignore``: ``unquantized.listed``)."""
        from compressed_tensors.compressors import ModelCompressor

        config = quantization_config(scheme, ignore=ignore_entries(unquantized.listed))
        ModelCompressor(quantization_config=config).update_config(str(folder))


SPEC = CompressedTensors()
