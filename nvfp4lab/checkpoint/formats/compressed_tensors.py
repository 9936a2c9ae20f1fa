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

**Mixed precision** (:func:`mixed_quantization_config`): one config group per scheme, each
targeting its layers by exact name with its own ``format``, the top-level ``format``
``"mixed-precision"`` when the groups' formats differ (compressed-tensors' own rule): NVFP4
groups as above; FP8 groups are compressed-tensors' preset "FP8_DYNAMIC" (format
``float-quantized``: ``<name>.weight`` float8_e4m3fn ``[N, K]``, ``<name>.weight_scale`` float32
``[N, 1]``, DECODE ``amax/448`` per output channel, activations quantized per token at run time;
vLLM 0.33 holds these scales in float32 as stored, compressed-tensors 0.20 in transformers
rounds them to the model's dtype, whatever ``scale_dtype`` says);
MXFP4 groups are "MXFP4A16" (format ``mxfp4-pack-quantized``: ``<name>.weight_packed`` uint8
``[N, K/2]`` low nibble first, ``<name>.weight_scale`` uint8 E8M0 ``[N, K/32]``, no global scale).
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
from nvfp4lab.vocab import TENSOR_SCALE_STORAGE, CheckpointFormat, LayerFormat, Scheme, check_choice

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

__all__ = [
    "CT_FORMAT",
    "FP8_FORMAT",
    "GROUP_PRESETS",
    "KV_CACHE_NAMES",
    "MIXED_FORMAT",
    "MXFP4_FORMAT",
    "QUANTIZED_TENSOR_NAMES",
    "QUANT_METHOD",
    "SCHEMES",
    "SPEC",
    "CompressedTensors",
    "CompressedTensorsConfig",
    "check_scheme",
    "group_kind",
    "ignore_entries",
    "kv_cache_scheme",
    "mixed_quantization_config",
    "quantization_config",
    "read_quantization_config",
    "write_mixed_config",
]

#: The compressed-tensors presets nvfp4lab writes and reads (:class:`nvfp4lab.vocab.Scheme`).
SCHEMES: tuple[str, ...] = tuple(s.value for s in Scheme)
CT_FORMAT = "nvfp4-pack-quantized"
#: compressed-tensors' format of FP8 weights (``weight`` float8_e4m3fn, ``weight_scale`` float32).
FP8_FORMAT = "float-quantized"
#: compressed-tensors' format of MXFP4 weights (``weight_packed``, E8M0 ``weight_scale``).
MXFP4_FORMAT = "mxfp4-pack-quantized"
#: The top-level ``format`` of a config whose groups have different formats.
MIXED_FORMAT = "mixed-precision"
#: Layer kind of a mixed checkpoint -> (compressed-tensors preset, the group's format); the
#: NVFP4 kind's preset is the checkpoint's :class:`~nvfp4lab.vocab.Scheme`.
GROUP_PRESETS: dict[str, tuple[str, str]] = {
    "fp8": ("FP8_DYNAMIC", FP8_FORMAT),
    # no preset: FP8_DYNAMIC's weights with input_activations null (vLLM 0.33:
    # CompressedTensorsW8A16Fp8, the Marlin FP8 kernel)
    LayerFormat.FP8_W8A16.value: ("FP8_DYNAMIC", FP8_FORMAT),
    "mxfp4": ("MXFP4A16", MXFP4_FORMAT),
}
_GROUP_FORMATS = {"nvfp4": CT_FORMAT, **{k: f for k, (_, f) in GROUP_PRESETS.items()}}
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


def mixed_quantization_config(
    groups: Mapping[str, Sequence[str]], *, scheme: Scheme | str = Scheme.NVFP4A16,
    ignore: Sequence[str] = (),
) -> QuantizationConfig:
    """compressed-tensors ``QuantizationConfig`` of a mixed-precision checkpoint: ``groups``
    maps a layer kind (``"nvfp4"``, ``"fp8"``, ``"fp8-w8a16"``, ``"mxfp4"``) to its layers' exact
    module names, one config group each (in that order, kinds without layers left out); the
    NVFP4 group is the preset ``scheme``, the others :data:`GROUP_PRESETS` (``fp8-w8a16``:
    FP8_DYNAMIC without input activations); each group carries its format, the
    top-level ``format`` is the one format or ``"mixed-precision"``; ``ignore``: modules left
    float."""
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        preset_name_to_scheme,
    )

    config_groups = {}
    for kind, targets in groups.items():
        if kind not in _GROUP_FORMATS:
            raise ValueError(f"unknown layer kind {kind!r}; accepted: {sorted(_GROUP_FORMATS)}")
        if not targets:
            continue
        preset = check_scheme(scheme).value if kind == "nvfp4" else GROUP_PRESETS[kind][0]
        group = preset_name_to_scheme(preset, list(targets))
        if kind == LayerFormat.FP8_W8A16:
            group.input_activations = None
        group.format = _GROUP_FORMATS[kind]
        config_groups[f"group_{len(config_groups)}"] = group
    formats = {g.format for g in config_groups.values()}
    if not formats:
        raise ValueError("mixed_quantization_config needs at least one layer in groups")
    return QuantizationConfig(
        config_groups=config_groups,
        ignore=list(ignore),
        format=_value(next(iter(formats))) if len(formats) == 1 else MIXED_FORMAT,
        quantization_status=QuantizationStatus.COMPRESSED,
    )


def write_mixed_config(folder: Path, config: QuantizationConfig) -> None:
    """Replace the config groups, ``ignore`` and ``format`` of ``folder/config.json``'s
    ``quantization_config`` with ``config``'s (the rest, a ``kv_cache_scheme`` included,
    kept), checked by compressed-tensors' own ``QuantizationConfig.model_validate``."""
    from compressed_tensors.quantization import QuantizationConfig

    file = folder / CONFIG_NAME
    data = read_json(file)
    block = data["quantization_config"]
    dumped = config.model_dump(mode="json")
    for key in ("config_groups", "ignore", "format"):
        block[key] = dumped[key]
    fields = set(QuantizationConfig.model_fields)
    QuantizationConfig.model_validate({k: v for k, v in block.items() if k in fields})
    file.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")


def _config_error(file: Path, message: str) -> CheckpointError:
    return CheckpointError(f"{file}: {message}")


def _value(x: object) -> object:
    """An enum member's value (compressed-tensors' str enums), anything else unchanged."""
    return getattr(x, "value", x)


def group_kind(group: QuantizationScheme) -> str:
    """The layer kind a config group's weights describe: ``"fp8"`` (8-bit float weights with
    input activations), ``"fp8-w8a16"`` (8-bit float weights alone), ``"mxfp4"`` (4-bit float,
    ``group`` strategy, blocks of 32), else ``"nvfp4"`` (checked by :func:`_check_group`)."""
    w = group.weights
    if w is not None and (w.num_bits, _value(w.type)) == (8, "float"):
        return "fp8" if group.input_activations is not None else LayerFormat.FP8_W8A16.value
    if w is not None and (w.num_bits, _value(w.type), _value(w.strategy), w.group_size) == (
            4, "float", "group", 32):
        return "mxfp4"
    return "nvfp4"


def _check_fp8_group(file: Path, name: str, group: QuantizationScheme) -> None:
    """Accept only what FP8Linear runs: compressed-tensors' FP8_DYNAMIC (E4M3 weights, one
    scale per output channel, activations dynamic per token), or its weights alone (W8A16)."""
    w, a = group.weights, group.input_activations
    found = (_value(w.strategy), w.symmetric, w.dynamic)
    if found != ("channel", True, False) or w.scale_dtype not in (None, torch.float32):
        raise _config_error(
            file, f"config group {name!r} has FP8 weights strategy={w.strategy}, symmetric="
            f"{w.symmetric}, dynamic={w.dynamic}, scale_dtype={w.scale_dtype}; nvfp4lab reads "
            "FP8_DYNAMIC (static symmetric per-channel float32 weight scales) only")
    if a is not None and (a.num_bits, _value(a.type), _value(a.strategy), a.dynamic) != (
            8, "float", "token", True):
        raise _config_error(
            file, f"config group {name!r} has FP8 weights with input activations {a}; nvfp4lab "
            "runs FP8 layers as FP8_DYNAMIC (8-bit float, per token, dynamic) or weight-only "
            "(input_activations null) only")


def _check_mxfp4_group(file: Path, name: str, group: QuantizationScheme) -> None:
    """Accept only what MXFP4Linear holds: compressed-tensors' MXFP4A16."""
    w = group.weights
    if not w.symmetric or w.scale_dtype not in (None, torch.uint8) or (
            group.input_activations is not None):
        raise _config_error(
            file, f"config group {name!r} has MXFP4 weights symmetric={w.symmetric}, "
            f"scale_dtype={w.scale_dtype}, input_activations={group.input_activations}; "
            "nvfp4lab reads MXFP4A16 (symmetric, E8M0 uint8 scales, weight-only) only")


def _check_group(file: Path, name: str, group: QuantizationScheme) -> str:
    """The group's layer kind (:func:`group_kind`), refusing what nvfp4lab cannot hold: NVFP4
    groups need FP4 weights in tensor_group blocks of 16, FP8 and MXFP4 groups their preset;
    a group's ``format`` must be its kind's."""
    w = group.weights
    if w is None:
        raise _config_error(file, f"config group {name!r} quantizes no weights; not NVFP4")
    kind = group_kind(group)
    fmt = getattr(group, "format", None)
    if fmt is not None and _value(fmt) != _GROUP_FORMATS[kind]:
        raise _config_error(
            file, f"config group {name!r} has format {fmt!r}; nvfp4lab reads {kind} weights "
            f"only as {_GROUP_FORMATS[kind]!r}"
        )
    if group.output_activations is not None:
        raise _config_error(file, f"config group {name!r} quantizes outputs; not supported")
    if kind in ("fp8", LayerFormat.FP8_W8A16):
        _check_fp8_group(file, name, group)
        return kind
    if kind == "mxfp4":
        _check_mxfp4_group(file, name, group)
        return kind
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
    return kind


def _validate_config(file: Path, data: Mapping[str, Any]) -> QuantizationConfig:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    method = data.get("quant_method")
    if method != QUANT_METHOD:
        raise _config_error(
            file, f"quantization_config.quant_method is {method!r}, not {QUANT_METHOD!r}"
        )
    fmt = data.get("format")
    if fmt not in (*_GROUP_FORMATS.values(), MIXED_FORMAT):
        raise _config_error(
            file, f"quantization_config.format is {fmt!r}; nvfp4lab reads only {CT_FORMAT!r} "
            f"({MIXED_FORMAT!r} with {FP8_FORMAT!r} / {MXFP4_FORMAT!r} groups beside it)"
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
    kinds = {_check_group(file, name, group) for name, group in config.config_groups.items()}
    expected = _GROUP_FORMATS[next(iter(kinds))] if len(kinds) == 1 else MIXED_FORMAT
    if fmt != expected:
        raise _config_error(
            file, f"quantization_config.format is {fmt!r} but its config groups hold "
            f"{'/'.join(sorted(kinds))} weights ({expected!r}); fix the format")
    return config


def read_quantization_config(path: str | os.PathLike[str]) -> QuantizationConfig:
    """Read and validate ``<path>/config.json``'s ``quantization_config`` (compressed-tensors).

    Raises :class:`CheckpointError` naming the file for anything but a compressed
    "nvfp4-pack-quantized" config with 4-bit float weights in blocks of 16, or a
    "mixed-precision" one whose other groups are FP8_DYNAMIC / MXFP4A16 (module docstring).
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
        """The config's ``ignore`` entries (names or ``re:`` patterns), which another format's
        config records on ``convert``; CheckpointError for a config with FP8 / MXFP4 groups,
        whose layers no other format declares."""
        for name, group in self.config.config_groups.items():
            if (kind := group_kind(group)) != "nvfp4":
                raise CheckpointError(
                    f"{self.file}: config group {name!r} holds {kind} layers, which only "
                    "compressed-tensors declares; a mixed checkpoint cannot be converted (load "
                    "it with nvfp4lab.checkpoint.load)")
        return tuple(self.config.ignore or ())

    @property
    def kv_cache(self) -> str | None:
        """The KV cache kind ``kv_cache_scheme`` declares (``"fp8"``), None without one;
        CheckpointError naming the file for a scheme vLLM 0.33 or nvfp4lab cannot run
        (:func:`kv_cache_kind`)."""
        return kv_cache_kind(self.config.kv_cache_scheme, self.file)

    def checkpoint_scheme(self) -> Scheme:
        """The one scheme of every NVFP4 config group (FP8 / MXFP4 groups aside; none:
        NVFP4A16); CheckpointError when they mix."""
        static = [_static_input(g) for g in self.config.config_groups.values()
                  if group_kind(g) == "nvfp4"]
        if any(static) and not all(static):
            raise CheckpointError(f"{self.file}: config groups mix W4A4 and weight-only layers; "
                                  "nvfp4lab reads one scheme per checkpoint (as a ModelOpt "
                                  "NVFP4 checkpoint holds one)")
        return Scheme.NVFP4 if all(static) else Scheme.NVFP4A16

    def quantized_modules(self, model: nn.Module) -> dict[str, bool]:
        """The NVFP4 modules: name -> whether it stores a static input scale, matched with
        compressed-tensors' own target / ignore rules (:meth:`mixed_modules`: the others)."""
        return {name: _static_input(group) for name, group in self._matched(model).items()
                if group_kind(group) == "nvfp4"}

    def mixed_modules(self, model: nn.Module) -> dict[str, str]:
        """The modules of FP8 and MXFP4 groups: name -> ``"fp8"`` / ``"fp8-w8a16"`` /
        ``"mxfp4"``."""
        return {name: kind for name, group in self._matched(model).items()
                if (kind := group_kind(group)) != "nvfp4"}

    def _matched(self, model: nn.Module) -> dict[str, QuantizationScheme]:
        """Module name -> its config group, by compressed-tensors' own matching (an exact name
        before a regex before a class name)."""
        from compressed_tensors.utils.match import match_named_modules, match_targets

        config = self.config
        target_to_scheme: dict[str, QuantizationScheme] = {}
        for group in config.config_groups.values():
            for target in group.targets:
                target_to_scheme[target] = group
        out: dict[str, QuantizationScheme] = {}
        for name, module in match_named_modules(model, list(target_to_scheme),
                                                config.ignore or []):
            if not isinstance(module, nn.Linear):
                raise CheckpointError(
                    f"{self.file}: module {name!r} ({type(module).__name__}) is targeted for "
                    "quantization; nvfp4lab loads quantized nn.Linear layers only"
                )
            out[name] = target_to_scheme[match_targets(name, module, target_to_scheme)[0]]
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
