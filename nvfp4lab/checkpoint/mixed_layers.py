"""The FP8 and MXFP4 Linears of a mixed-precision model (:mod:`nvfp4lab.execution.mixed`) in a
compressed-tensors checkpoint with several config groups.

Saving (:func:`check_mixed`, :func:`layer_tensors`, :func:`write_groups`): each
:class:`~nvfp4lab.execution.mixed.FP8Linear` is stored as compressed-tensors' ``float-quantized``
format stores an FP8_DYNAMIC layer (``<name>.weight`` float8_e4m3fn ``[N, K]``,
``<name>.weight_scale`` float32 ``[N, 1]``, ``<name>.bias``), each
:class:`~nvfp4lab.execution.mixed.MXFP4Linear` as ``mxfp4-pack-quantized`` stores an MXFP4A16
layer (``<name>.weight_packed`` uint8 ``[N, K/2]``, ``<name>.weight_scale`` uint8 E8M0
``[N, K/32]``, ``<name>.bias``), bytes as the modules hold them; the config gets one group per
kind (NVFP4, FP8, MXFP4) targeting its layers by exact name
(:func:`~nvfp4lab.checkpoint.formats.compressed_tensors.mixed_quantization_config`). What no
other format can declare, and what vLLM 0.33 cannot load (a fused q/k/v or gate/up unit split
across formats, FP8 weight scales per tensor), is refused before anything is written.

ModelOpt (``format="modelopt"``): a ``MIXED_PRECISION`` checkpoint
(:mod:`~nvfp4lab.checkpoint.formats.modelopt`): NVFP4Linear layers as ``"NVFP4"`` (W4A4) or
``"W4A16_NVFP4"``, per-channel FP8Linear layers as ``"FP8_PER_CHANNEL_PER_TOKEN"``
(``<name>.weight`` float8_e4m3fn ``[N, K]``, ``<name>.weight_scale`` float32 ``[N]``: the bytes
ModelOpt 0.47 exports for that algorithm); refused: MXFP4 layers (vLLM 0.33's ModelOpt loader has
no MXFP4 linear algorithm), per-tensor FP8 (ModelOpt's ``"FP8"`` also needs a static input
scale that FP8Linear does not hold), and a model with no NVFP4Linear.

GGUF (``format="gguf"``): each :class:`~nvfp4lab.execution.mixed_q8_0.Q8_0Linear` is written as
llama.cpp's ``Q8_0`` (ggml type 8, :mod:`~nvfp4lab.checkpoint.formats.gguf_write`); in memory
and in :class:`~nvfp4lab.checkpoint.records.Contents` its tensors are ``<name>.weight`` int8
``[N, K]`` and ``<name>.weight_d`` float16 ``[N, K/32]``. Refused: FP8 / MXFP4 layers in a GGUF
save (no llama.cpp type holds them with these scales: q8_0 is the 8-bit format of a GGUF mix),
and Q8_0 layers in any other format (none declares llama.cpp's Q8_0). llama.cpp stores q/k/v and
gate/up as separate tensors, so a fused unit may mix formats in GGUF.

Loading (:func:`load_mixed_linear`): the stored tensors become the same modules, byte for byte.
Auditing (:func:`audit_mixed_rows`): one row per FP8 / MXFP4 / Q8_0 layer beside the NVFP4 rows.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvfp4lab.checkpoint.formats.compressed_tensors import (
    ignore_entries,
    mixed_quantization_config,
    write_mixed_config,
)
from nvfp4lab.checkpoint.formats.modelopt import (
    FP8_ALGO,
    MODELOPT_FP8_KIND,
    QUANT_ALGOS,
    write_mixed_configs,
)
from nvfp4lab.checkpoint.records import TensorInfo
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.checkpoint.rows import RowReader, TensorSource, read_exact, read_like
from nvfp4lab.execution.dispatch_mixed import LayerScheme
from nvfp4lab.execution.layers import NVFP4Linear
from nvfp4lab.execution.mixed import MXFP4_BLOCK, FP8Linear, MXFP4Linear, fused_units
from nvfp4lab.execution.mixed_q8_0 import SCALE_BUFFER, Q8_0Linear
from nvfp4lab.vocab import CheckpointFormat, LayerFormat, Scheme

__all__ = [
    "MIXED_TYPES",
    "audit_mixed_rows",
    "check_mixed",
    "layer_family",
    "layer_tensors",
    "load_mixed_linear",
    "mixed_layers",
    "stored_kind",
    "write_groups",
]

#: The module types saved beside NVFP4Linear in a mixed checkpoint.
MIXED_TYPES: tuple[type[nn.Module], ...] = (FP8Linear, MXFP4Linear, Q8_0Linear)
#: Values per llama.cpp ``block_q8_0``; a Q8_0 layer's family (:func:`layer_family`).
_Q8_BLOCK, _Q8_0 = 32, str(Q8_0Linear.layer_format)
_TITLES = {"fp8": "FP8", LayerFormat.FP8_W8A16.value: "FP8 W8A16", "mxfp4": "MXFP4"}


def layer_family(module: nn.Module) -> str | None:
    """``"nvfp4"``, ``"fp8"`` (W8A8), ``"fp8-w8a16"``, ``"mxfp4"``, ``"float"`` (an
    ``nn.Linear``), else None."""
    if isinstance(module, NVFP4Linear):
        return "nvfp4"
    if isinstance(module, FP8Linear):
        return str(module.layer_format)
    if isinstance(module, MXFP4Linear):
        return "mxfp4"
    if isinstance(module, Q8_0Linear):
        return _Q8_0
    return "float" if isinstance(module, nn.Linear) else None


def mixed_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> every FP8Linear / MXFP4Linear / Q8_0Linear of ``model``, in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, MIXED_TYPES)}


def _check_fp8(name: str, module: FP8Linear) -> None:
    n, k = module.out_features, module.in_features
    scale = module.weight_scale
    if tuple(scale.shape) != (n, 1) or n == 1:
        raise ValueError(f"{name}: FP8 weight scale {list(scale.shape)} is per tensor; "
                         "compressed-tensors' FP8_DYNAMIC stores one per output channel: build "
                         "it with apply_mix(..., per_channel=True)")
    if module.weight.dtype != torch.float8_e4m3fn or tuple(module.weight.shape) != (n, k) or (
            scale.dtype != torch.float32):
        raise ValueError(f"{name}: FP8Linear holds weight {module.weight.dtype} "
                         f"{list(module.weight.shape)}, scale {scale.dtype}; expected "
                         f"float8_e4m3fn [{n}, {k}] and float32: rebuild it with FP8Linear")
    if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError(f"{name}: FP8 weight scales must be finite and > 0; rebuild the layer "
                         "with FP8Linear.from_linear")


def _check_mxfp4(name: str, module: MXFP4Linear) -> None:
    n, k = module.out_features, module.in_features
    expected = {"weight_packed": (n, k // 2), "weight_scale": (n, k // MXFP4_BLOCK)}
    for leaf, shape in expected.items():
        tensor = getattr(module, leaf)
        if k % MXFP4_BLOCK or tensor.dtype != torch.uint8 or tuple(tensor.shape) != shape:
            raise ValueError(f"{name}.{leaf}: MXFP4Linear holds {tensor.dtype} "
                             f"{list(tensor.shape)}; mxfp4-pack-quantized stores uint8 "
                             f"{list(shape)} (K a multiple of {MXFP4_BLOCK}): rebuild the layer")


def _check_q8_0(name: str, module: Q8_0Linear) -> None:
    n, k = module.out_features, module.in_features
    d = getattr(module, SCALE_BUFFER)
    if module.weight.dtype != torch.int8 or tuple(module.weight.shape) != (n, k) or (
            d.dtype != torch.float16 or tuple(d.shape) != (n, k // _Q8_BLOCK)):
        raise ValueError(f"{name}: Q8_0Linear holds {module.weight.dtype} "
                         f"{list(module.weight.shape)} codes and {d.dtype} {list(d.shape)} "
                         f"scales; expected int8 [{n}, {k}] and float16 [{n}, {k // _Q8_BLOCK}]: "
                         "rebuild it with Q8_0Linear.from_linear")
    if not bool(torch.isfinite(d).all()):
        raise ValueError(f"{name}: Q8_0 block scales must be finite; rebuild the layer with "
                         "Q8_0Linear.from_linear")


def _check_gguf(mixed: Mapping[str, nn.Module]) -> None:
    """A GGUF mix holds NVFP4Linear, Q8_0Linear and float Linears only (module docstring)."""
    for name, module in mixed.items():
        if not isinstance(module, Q8_0Linear):
            family = str(layer_family(module))
            raise ValueError(f"{name}: {_TITLES.get(family, family)} layer; GGUF has no "
                             f"llama.cpp type for it: use {_Q8_0!r} for the 8-bit layers of a "
                             "GGUF mix (apply_mix), or save as compressed-tensors")
        _check_q8_0(name, module)


def _check_modelopt(model: nn.Module, mixed: Mapping[str, nn.Module]) -> None:
    """What a ModelOpt MIXED_PRECISION checkpoint cannot hold (module docstring)."""
    for name, module in mixed.items():
        if isinstance(module, MXFP4Linear):
            raise ValueError(f"{name}: MXFP4 layer; vLLM 0.33's ModelOpt MIXED_PRECISION loader "
                             "has no MXFP4 linear algorithm: save it as compressed-tensors or give "
                             "the layer another format")
        if isinstance(module, FP8Linear) and not module.quantize_activations:
            raise ValueError(f"{name}: FP8 W8A16 layer (weights only); ModelOpt's "
                             "MIXED_PRECISION has no FP8 weight-only algorithm (vLLM 0.33 reads "
                             "FP8 as W8A8): save it as compressed-tensors, or build the layer as "
                             "'fp8' (W8A8)")
        if isinstance(module, FP8Linear) and not module.per_channel:
            raise ValueError(f"{name}: FP8 weight scale {list(module.weight_scale.shape)} is per "
                             "tensor; ModelOpt's per-tensor 'FP8' also needs a static input scale "
                             "FP8Linear (dynamic per token) does not hold: build it with "
                             "apply_mix(..., per_channel=True) (FP8_PER_CHANNEL_PER_TOKEN)")
    if not any(isinstance(m, NVFP4Linear) for m in model.modules()):
        raise ValueError("the model has FP8 layers but no NVFP4Linear; ModelOpt writes that as "
                         f"a single-algorithm {FP8_ALGO} checkpoint, which nvfp4lab does not "
                         "write: save it as compressed-tensors")


def check_mixed(model: nn.Module, mixed: Mapping[str, nn.Module], fmt: str) -> None:
    """Refuse (ValueError, one line) a mixed model a ``fmt`` checkpoint cannot hold: FP8 /
    MXFP4 layers in any format but compressed-tensors and ModelOpt (there: no MXFP4, and at
    least one NVFP4Linear), FP8 scales per tensor, malformed buffers, and a fused unit (q/k/v,
    gate/up) whose members differ in kind (vLLM 0.33 loads a fused layer with one scheme);
    Q8_0Linear layers anywhere but in GGUF, which holds no other kind (module docstring).
    Nothing to check without ``mixed`` layers."""
    if not mixed:
        return
    if fmt == CheckpointFormat.GGUF:
        _check_gguf(mixed)  # q/k/v and gate/up are separate tensors: units may mix formats
        return
    q8 = next((n for n, m in mixed.items() if isinstance(m, Q8_0Linear)), None)
    if q8 is not None:
        raise ValueError(f"the model holds Q8_0 layers (e.g. {q8!r}), which only GGUF stores "
                         "(llama.cpp's type 8); save it with format='gguf' or give them another "
                         "format")
    if fmt == CheckpointFormat.MODELOPT:
        _check_modelopt(model, mixed)
    elif fmt != CheckpointFormat.COMPRESSED_TENSORS:
        name, module = next(iter(mixed.items()))
        title = _TITLES[str(layer_family(module))]
        raise ValueError(f"the model holds {title} layers (e.g. {name!r}), which a {fmt} "
                         "checkpoint cannot declare; save it as compressed-tensors or modelopt")
    for name, module in mixed.items():
        if isinstance(module, FP8Linear):
            _check_fp8(name, module)
        else:
            assert isinstance(module, MXFP4Linear)
            _check_mxfp4(name, module)
    kinds = {n: k for n, m in model.named_modules() if n and (k := layer_family(m)) is not None}
    for unit in fused_units(list(kinds)):
        found = {kinds[n] for n in unit}
        if len(found) > 1 and found & set(_TITLES):
            detail = ", ".join(f"{n.rpartition('.')[2]}={kinds[n]}" for n in unit)
            raise ValueError(f"fused unit {unit[0].rpartition('.')[0]} mixes formats ({detail}); "
                             "vLLM 0.33 loads a fused layer in one scheme: give its members one "
                             "format")


def layer_tensors(name: str, module: nn.Module, dtype: torch.dtype | None = None,
                  fmt: str = CheckpointFormat.COMPRESSED_TENSORS) -> dict[str, torch.Tensor]:
    """The stored tensors of one FP8Linear / MXFP4Linear under ``fmt``'s names (module
    docstring), as the module holds them (ModelOpt: the FP8 weight scale as ``[N]``);
    ``dtype``: cast the bias to it."""
    if isinstance(module, FP8Linear):
        scale = module.weight_scale
        out = {"weight": module.weight,
               "weight_scale": scale.reshape(-1) if fmt == CheckpointFormat.MODELOPT else scale}
    elif isinstance(module, MXFP4Linear):
        out = {"weight_packed": module.weight_packed, "weight_scale": module.weight_scale}
    elif isinstance(module, Q8_0Linear):  # GGUF: gguf_write lays them out as type 8
        out = {"weight": module.weight, SCALE_BUFFER: getattr(module, SCALE_BUFFER)}
    else:
        raise TypeError(f"{name} is a {type(module).__name__}, not FP8Linear / MXFP4Linear / "
                        "Q8_0Linear")
    bias = getattr(module, "bias", None)
    if bias is not None:
        out["bias"] = bias if dtype is None else bias.to(dtype)
    return {f"{name}.{leaf}": t for leaf, t in out.items()}


def write_groups(folder: Path, nvfp4: Iterable[str], mixed: Mapping[str, nn.Module],
                 scheme: Scheme, ignore: Iterable[str],
                 fmt: str = CheckpointFormat.COMPRESSED_TENSORS,
                 model: nn.Module | None = None) -> None:
    """Rewrite ``folder/config.json``'s config groups as one group per kind, each targeting
    its layers by exact name (``nvfp4``: the NVFP4Linear names, preset ``scheme``), with
    ``ignore`` (module names or fnmatch wildcards, :func:`ignore_entries`). ModelOpt
    (``fmt``): write the MIXED_PRECISION configs instead, layers in ``model``'s module order
    (float ones, ``ignore``, absent from ``quantized_layers`` as ModelOpt writes them). GGUF:
    nothing (its one file declares every tensor's type)."""
    if fmt == CheckpointFormat.GGUF:
        return
    if fmt == CheckpointFormat.MODELOPT:
        nvfp4_algo = next(a for a, s in QUANT_ALGOS.items() if s == Scheme(scheme))
        algo = {**{n: nvfp4_algo for n in nvfp4}, **{n: FP8_ALGO for n in mixed}}
        order = [n for n, _ in model.named_modules()] if model is not None else list(algo)
        write_mixed_configs(folder, {n: algo[n] for n in order if n in algo})
        return
    groups: dict[str, list[str]] = {"nvfp4": list(nvfp4), **{k: [] for k in _TITLES}}
    for name, module in mixed.items():
        groups[str(layer_family(module))].append(name)
    config = mixed_quantization_config(groups, scheme=scheme, ignore=ignore_entries(ignore))
    write_mixed_config(folder, config)


def _check_fp8_scales(source: TensorSource, name: str, scale: torch.Tensor) -> None:
    if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
        raise CheckpointError(f"{source.file_of(f'{name}.weight_scale')}: "
                              f"{name}.weight_scale holds FP8 weight scales that are not "
                              "finite and > 0; the checkpoint is damaged")


def load_mixed_linear(source: TensorSource, name: str, module: nn.Linear, family: str,
                      dtype: torch.dtype) -> tuple[nn.Module, set[str]]:
    """The FP8Linear (``family`` ``"fp8"``, ``"fp8-w8a16"``: weight-only; ModelOpt's
    ``"fp8-modelopt"``: scale ``[N]``) or
    MXFP4Linear (``"mxfp4"``) of ``module``'s shape
    from its stored tensors, byte for byte; returns it and the keys it used. CheckpointError
    naming the file and tensor for a wrong dtype or shape, a missing tensor, or FP8 scales
    that are not finite and > 0."""
    n, k = module.out_features, module.in_features
    bias = None
    used: set[str] = set()
    if module.bias is not None:
        bias = read_like(source, f"{name}.bias", module.bias)
        used.add(f"{name}.bias")
    if family in ("fp8", LayerFormat.FP8_W8A16):
        weight = read_exact(source, f"{name}.weight", torch.float8_e4m3fn, (n, k))
        scale = read_exact(source, f"{name}.weight_scale", torch.float32, (n, 1))
        _check_fp8_scales(source, name, scale)
        used |= {f"{name}.weight", f"{name}.weight_scale"}
        return FP8Linear(weight, scale, bias,
                         quantize_activations=family == "fp8"), used
    if family == MODELOPT_FP8_KIND:  # FP8_PER_CHANNEL_PER_TOKEN: weight scale [N]
        weight = read_exact(source, f"{name}.weight", torch.float8_e4m3fn, (n, k))
        scale = read_exact(source, f"{name}.weight_scale", torch.float32, (n,))
        _check_fp8_scales(source, name, scale)
        used |= {f"{name}.weight", f"{name}.weight_scale"}
        return FP8Linear(weight, scale.reshape(n, 1), bias), used
    if family == _Q8_0 and not k % _Q8_BLOCK:  # GGUF's Q8_0: Q8_0Linear
        codes = read_exact(source, f"{name}.weight", torch.int8, (n, k))
        d = read_exact(source, f"{name}.{SCALE_BUFFER}", torch.float16, (n, k // _Q8_BLOCK))
        if not bool(torch.isfinite(d).all()):
            raise CheckpointError(f"{source.file_of(f'{name}.weight')}: the Q8_0 block scales "
                                  f"of {name} are not all finite; the file is damaged")
        used |= {f"{name}.weight", f"{name}.{SCALE_BUFFER}"}
        return Q8_0Linear(codes, d, bias), used
    if family != "mxfp4" or k % MXFP4_BLOCK:
        raise CheckpointError(f"{name}: cannot load a {family} layer with in_features={k} "
                              f"(FP8, Q8_0, or MXFP4 with K a multiple of {MXFP4_BLOCK})")
    packed = read_exact(source, f"{name}.weight_packed", torch.uint8, (n, k // 2))
    scales = read_exact(source, f"{name}.weight_scale", torch.uint8, (n, k // MXFP4_BLOCK))
    used |= {f"{name}.weight_packed", f"{name}.weight_scale"}
    return MXFP4Linear.from_stored(packed, scales, dtype, bias), used


# ---------------------------------------------------------------------------------------------
# audit
# ---------------------------------------------------------------------------------------------

#: Elements read at a time when an FP8 weight is scanned.
_CHUNK = 1 << 21


def _fp8_row(name: str, weight: TensorInfo, scale: TensorInfo,
             weight_only: bool = False, modelopt: bool = False) -> dict[str, Any]:
    """The audit row of one FP8 layer (``weight_only``: its group quantizes no activations;
    ``modelopt``: a ModelOpt FP8_PER_CHANNEL_PER_TOKEN layer, scale ``[N]``): scale range and
    bad-scale counts, the decoded weights' amax and NaN codes (read a few rows at a time)."""
    fmt, scheme = ((LayerFormat.FP8_W8A16.value, LayerScheme.FP8_W8A16.value) if weight_only
                   else ("fp8", FP8_ALGO if modelopt else "FP8_DYNAMIC"))
    row: dict[str, Any] = {"layer": name, "format": fmt, "scheme": scheme,
                           "shape": list(weight.shape), "scale_form": "decode"}
    issues = []
    n = weight.shape[0] if weight.shape else 0
    want = [n] if modelopt else [n, 1]
    if weight.dtype != "F8_E4M3" or scale.dtype != "F32" or len(weight.shape) != 2 or (
            list(scale.shape) != want):
        row["issues"] = (f"expected float8_e4m3fn [N, K] weight and float32 {want} weight_scale, "
                         f"found {weight.dtype} {list(weight.shape)} and {scale.dtype} "
                         f"{list(scale.shape)}")
        return row
    with RowReader(scale) as reader:
        s = reader.rows().reshape(-1)
    bad = ~torch.isfinite(s)
    row.update(scale_min=float(s.min()), scale_max=float(s.max()), nan_scales=int(bad.sum()),
               negative_scales=int((s < 0).sum()), zero_scales=int((s == 0).sum()))
    if row["nan_scales"] or row["negative_scales"] or row["zero_scales"]:
        issues.append("weight scales not finite and > 0 (load refuses them)")
    amax, nan_codes, step = 0.0, 0, max(1, _CHUNK // max(weight.shape[1], 1))
    with RowReader(weight) as reader:
        for start in range(0, weight.shape[0], step):
            w = reader.rows(start, start + step).to(torch.float32)
            nan_codes += int(torch.isnan(w).sum())
            decoded = torch.nan_to_num(w, nan=0.0) * s[start:start + step, None]
            amax = max(amax, float(decoded.abs().max())) if decoded.numel() else amax
    row["decoded_amax"] = amax
    if nan_codes:
        issues.append(f"{nan_codes} NaN FP8 weight code(s)")
    row["issues"] = "; ".join(issues)
    return row


def _q8_0_row(name: str, codes: TensorInfo, d: TensorInfo) -> dict[str, Any]:
    """The audit row of one Q8_0 layer (GGUF): shape, block-scale range, non-finite and
    negative scales (llama.cpp's quantizer writes none; load refuses non-finite ones)."""
    n, k = codes.shape if len(codes.shape) == 2 else (0, 0)
    row: dict[str, Any] = {"layer": name, "format": _Q8_0, "scheme": "Q8_0", "shape": [n, k]}
    if d.dtype != "F16" or tuple(d.shape) != (n, k // _Q8_BLOCK) or k % _Q8_BLOCK:
        row["issues"] = f"block scales {d.dtype} {list(d.shape)} do not fit codes [{n}, {k}]"
        return row
    with RowReader(d) as reader:
        s = reader.rows().to(torch.float32).reshape(-1)
    bad = int((~torch.isfinite(s)).sum())
    finite = s[torch.isfinite(s)]
    row.update(scale_min=float(finite.min()) if finite.numel() else None,
               scale_max=float(finite.max()) if finite.numel() else None, nan_scales=bad,
               negative_scales=int((s < 0).sum()))
    row["issues"] = "block scales not finite (load refuses them)" if bad else ""
    return row


def stored_kind(key: str, tensors: Mapping[str, TensorInfo]) -> str | None:
    """What the stored tensor ``key`` is the weight of, from the headers alone: ``"q8_0"`` (an
    int8 ``<name>.weight`` beside its float16 scales), ``"fp8"`` (a float8 ``<name>.weight``
    beside ``<name>.weight_scale``), ``"mxfp4"`` (``<name>.weight_packed`` with uint8
    ``weight_scale`` and no global scale), else None (NVFP4, float, or not a weight)."""
    name = key.rpartition(".")[0]
    info = tensors[key]
    scale = tensors.get(f"{name}.weight_scale")
    if key.endswith(".weight") and info.dtype == "I8" and f"{name}.{SCALE_BUFFER}" in tensors:
        return _Q8_0
    if key.endswith(".weight") and info.dtype.startswith("F8") and scale is not None:
        return LayerFormat.FP8.value
    if key.endswith(".weight_packed") and scale is not None and scale.dtype == "U8" and (
            f"{name}.weight_global_scale" not in tensors):
        return LayerFormat.MXFP4.value
    return None


def audit_mixed_rows(tensors: Mapping[str, TensorInfo], weight_only: Collection[str] = (),
                     modelopt: bool = False) -> list[dict[str, Any]]:
    """Audit rows of a compressed-tensors checkpoint's FP8 layers (``<name>.weight`` stored
    float8_e4m3fn beside ``<name>.weight_scale``: format ``fp8``, scheme ``FP8_DYNAMIC``; those
    in ``weight_only`` (their config group has no input activations): ``fp8-w8a16``,
    ``FP8_W8A16``; ``modelopt``: a ModelOpt MIXED_PRECISION checkpoint's, scheme
    ``FP8_PER_CHANNEL_PER_TOKEN``, scale ``[N]``) and
    MXFP4 layers (``weight_packed`` with uint8 ``weight_scale`` and no global scale: format
    ``mxfp4``, scheme ``MXFP4A16``, shapes checked), and a GGUF file's Q8_0 layers (int8
    ``weight`` beside float16 ``weight_d``: format and scheme ``q8_0`` / ``Q8_0``), in stored
    order."""
    rows = []
    for key, info in tensors.items():
        name, kind = key.rpartition(".")[0], stored_kind(key, tensors)
        scale = tensors.get(f"{name}.weight_scale")
        if kind == _Q8_0:
            rows.append(_q8_0_row(name, info, tensors[f"{name}.{SCALE_BUFFER}"]))
        elif kind == LayerFormat.FP8:
            assert scale is not None
            rows.append(_fp8_row(name, info, scale, name in weight_only, modelopt))
        elif kind == LayerFormat.MXFP4:
            assert scale is not None
            n, half = info.shape if len(info.shape) == 2 else (0, 0)
            ok = info.dtype == "U8" and tuple(scale.shape) == (n, 2 * half // MXFP4_BLOCK)
            rows.append({"layer": name, "format": "mxfp4", "scheme": "MXFP4A16",
                         "shape": [n, 2 * half], "issues": "" if ok else
                         f"weight_scale {list(scale.shape)} does not fit codes {list(info.shape)}"})
    return rows
