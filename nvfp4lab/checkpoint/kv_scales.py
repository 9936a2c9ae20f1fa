"""A quantized KV cache in a checkpoint: its kind and per-layer k / v scales, written, read,
converted and audited the way each format's engine reads them (``docs/kv_cache.md``).

What is stored: the kind, in the format's configuration (each format's ``write_checkpoint`` and
its config's ``kv_cache`` property), and per attention module ``<attn>`` the float32 DECODE scales
vLLM 0.33 uses as ``layer._k_scale`` / ``_v_scale`` (values read back as ``code * block_scale *
k_scale``), under the format's :class:`~nvfp4lab.checkpoint.records.KVCacheNames`. Both
safetensors formats store the DECODE form, so a conversion only renames and reshapes them; the
float32 values are kept. A format whose spec has no ``kv_cache_names`` (GGUF) cannot hold them
and is refused in one line with its ``kv_cache_refusal`` reason.

Format-neutral: the names, shapes, the kinds a format declares and its refusals come from the
spec (``kv_cache_names``, ``kv_cache_refusal``), looked up with ``getattr`` so that a format
registered without them is simply one that holds no KV cache.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nvfp4lab.checkpoint.records import KVCacheNames, Shard, StoredTensor, TensorInfo
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.checkpoint.rows import read_scalar
from nvfp4lab.execution.attention import (
    KVCacheLayer,
    kv_cache_rotations,
    kv_cache_settings,
    quantize_kv_cache,
)
from nvfp4lab.execution.kv_cache import kv_global_scale

__all__ = [
    "KVScaleRow",
    "checkpoint_kv_cache",
    "convert_kv_shard",
    "kv_cache_names",
    "kv_cache_refusal",
    "kv_rows",
    "kv_tensors",
    "model_kv_cache",
    "restore_kv_cache",
    "stored_kv_keys",
]

#: Per attention module name: (k_scale, v_scale), float32 DECODE values.
Scales = dict[str, tuple[float, float]]


def kv_cache_names(spec: Any) -> KVCacheNames | None:
    """Where ``spec``'s format stores KV scales, None when it holds no KV cache."""
    names = getattr(spec, "kv_cache_names", None)
    return names if isinstance(names, KVCacheNames) else None


def kv_cache_refusal(spec: Any, kind: str) -> str | None:
    """Why ``spec``'s format cannot hold a ``kind`` KV cache (None: it can)."""
    refusal = getattr(spec, "kv_cache_refusal", None)
    reason = refusal(kind) if callable(refusal) else None
    if reason is None and kv_cache_names(spec) is None:
        reason = f"a {spec.title} checkpoint has no place for a KV cache kind or k / v scales"
    return reason


def model_kv_cache(model: nn.Module) -> tuple[str, Scales] | None:
    """(kind, per-layer scales) of the KV cache :func:`~nvfp4lab.execution.quantize_kv_cache`
    set on ``model``, None when there is none; ValueError when its layers mix kinds (a
    checkpoint declares one)."""
    settings = kv_cache_settings(model)
    if not settings:
        return None
    kinds = sorted({kind for kind, _, _ in settings.values()})
    if len(kinds) > 1:
        raise ValueError(f"the model's KV cache mixes kinds ({', '.join(kinds)}); a checkpoint "
                         "declares one: quantize every attention layer's cache with one kind")
    return kinds[0], {name: (k, v) for name, (_, k, v) in settings.items()}


def checkpoint_kv_cache(model: nn.Module, spec: Any) -> tuple[str, Scales] | None:
    """:func:`model_kv_cache`, refused with ValueError (one line: the kind, the scales, the
    format's reason and the way out) when ``spec``'s format cannot hold it."""
    found = model_kv_cache(model)
    if found is None:
        return None
    kind, scales = found
    rotated = kv_cache_rotations(model)
    if rotated:
        first, block = next(iter(rotated.items()))
        raise ValueError(
            f"the model's KV cache rotates Q and K (a {block}-point block Hadamard on "
            f"{len(rotated)} attention layer(s), e.g. {first}) and no checkpoint carries that to "
            "an engine: vLLM 0.33 applies no q_attn / k_cache transform, and compressed-tensors "
            "0.20.1's k_cache hook does not fire on transformers 5 (it would rotate Q alone). "
            "Quantize the KV cache without qk_rotation to save it")
    reason = kv_cache_refusal(spec, kind)
    if reason is not None:
        first, (k, v) = next(iter(scales.items()))
        raise ValueError(
            f"the model's KV cache is quantized ({kind} on {len(scales)} attention layer(s), e.g. "
            f"{first}: k_scale={k:.6g} v_scale={v:.6g}) and {reason}. To save the weights "
            "without it, call nvfp4lab.execution.remove_kv_cache_quantization(model) first")
    return found


def kv_tensors(scales: Mapping[str, tuple[float, float]], names: KVCacheNames
               ) -> dict[str, torch.Tensor]:
    """The stored tensors of ``scales``: float32 of ``names.scalar_shape`` under the format's
    names, in attention order, k then v."""
    out: dict[str, torch.Tensor] = {}
    for attention, pair in scales.items():
        for key, value in zip(names.keys(attention), pair, strict=True):
            out[key] = torch.full(names.scalar_shape, value, dtype=torch.float32)
    return out


def stored_kv_keys(keys: Iterable[str], names: KVCacheNames
                   ) -> dict[str, tuple[str | None, str | None]]:
    """Attention module name -> (k key, v key) of the stored KV scales among ``keys`` (None
    for a side not stored), in the order first seen."""
    found: dict[str, list[str | None]] = {}
    for key in keys:
        hit = names.attention_of(key)
        if hit is not None:
            found.setdefault(hit[0], [None, None])[hit[1]] = key
    return {name: (pair[0], pair[1]) for name, pair in found.items()}


def _value(info: TensorInfo, names: KVCacheNames) -> float:
    """One stored scale as a float (its float32 value), shape and dtype checked."""
    if info.shape not in (names.scalar_shape, *names.also_read):
        raise CheckpointError(
            f"{info.file}: KV scale {info.key!r} has shape {list(info.shape)}, expected "
            f"{list(names.scalar_shape)}; vLLM 0.33 reads one scale per layer and side")
    if info.dtype not in ("F32", "BF16", "F16"):
        raise CheckpointError(f"{info.file}: KV scale {info.key!r} has dtype {info.dtype}, "
                              "expected F32")
    return read_scalar(info)


def read_kv_scales(tensors: Mapping[str, TensorInfo], names: KVCacheNames
                   ) -> dict[str, tuple[float | None, float | None]]:
    """Attention name -> (k, v) stored values (None: not stored), read from ``tensors``."""
    out: dict[str, tuple[float | None, float | None]] = {}
    for attention, pair in stored_kv_keys(tensors, names).items():
        k, v = (None if key is None else _value(tensors[key], names) for key in pair)
        out[attention] = (k, v)
    return out


def restore_kv_cache(model: nn.Module, kind: str, tensors: Mapping[str, TensorInfo],
                     names: KVCacheNames) -> list[KVCacheLayer]:
    """Give ``model`` the ``kind`` KV cache with the scales stored in ``tensors``
    (:func:`~nvfp4lab.execution.quantize_kv_cache`): each attention module with its stored
    pair, a missing side ``names.missing`` (None: vLLM's ``BaseKVCacheMethod`` rule). A scale
    matching no attention module, or one vLLM could not use, raises CheckpointError."""
    stored = read_kv_scales(tensors, names)
    specs = {attention: (names.missing if k is None else k, names.missing if v is None else v)
             for attention, (k, v) in stored.items()}
    try:
        return quantize_kv_cache(model, kind, kv_scales=specs)
    except ValueError as exc:
        raise CheckpointError(f"the checkpoint's {kind} KV cache: {exc}") from None


def convert_kv_shard(shard: Shard, src: KVCacheNames, dst: KVCacheNames) -> Shard:
    """``shard`` with its KV scales renamed from ``src``'s names to ``dst``'s and reshaped to
    ``dst.scalar_shape``, the float32 values kept (both formats store the DECODE form); every
    other tensor unchanged."""
    out: list[StoredTensor] = []
    for tensor in shard.tensors:
        info = tensor.source()
        hit = src.attention_of(tensor.name)
        if hit is None or info is None:
            out.append(tensor)
            continue
        value = _value(info, src)
        key = dst.keys(hit[0])[hit[1]]
        nbytes = 4 * math.prod(dst.scalar_shape)
        out.append(StoredTensor(key, "F32", dst.scalar_shape, nbytes, struct.pack("<f", value)))
    return Shard(shard.name, tuple(out), shard.metadata)


@dataclass(frozen=True)
class KVScaleRow:
    """One attention layer of a checkpoint's KV cache as ``audit`` reports it."""

    layer: str
    kind: str | None
    k_scale: float | None
    v_scale: float | None
    issues: tuple[str, ...]

    def row(self) -> dict[str, Any]:
        return {"layer": self.layer, "kv_cache": self.kind, "k_scale": self.k_scale,
                "v_scale": self.v_scale, "issues": "; ".join(self.issues)}


def _attention_modules(keys: Iterable[str]) -> list[str]:
    """Attention modules seen in tensor names: parents of a ``k_proj`` or ``qkv_proj``."""
    found: dict[str, None] = {}
    for key in keys:
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            if part in ("k_proj", "qkv_proj"):
                found[".".join(parts[:i])] = None
                break
    return list(found)


def kv_rows(config: Any, tensors: Mapping[str, TensorInfo], names: KVCacheNames | None
            ) -> list[KVScaleRow]:
    """The KV cache rows of ``audit``: one per attention layer with stored scales or a
    ``k_proj`` / ``qkv_proj``, when the configuration declares a KV cache or scales are stored.
    Issues: a kind vLLM 0.33 does not run (the config's ``kv_cache`` refusal), a layer without
    scales, a scale that is not finite, not > 0, or has no usable reciprocal for the kind
    (:func:`~nvfp4lab.execution.kv_cache.kv_global_scale`'s checks)."""
    kind: str | None = None
    problem: str | None = None
    try:
        kind = getattr(config, "kv_cache", None)
    except CheckpointError as exc:
        problem = str(exc)
    stored = stored_kv_keys(tensors, names) if names is not None else {}
    if kind is None and problem is None and not stored:
        return []
    layers = list(dict.fromkeys([*_attention_modules(tensors), *stored]))
    rows = []
    for layer in layers:
        issues = [problem] if problem else []
        if kind is None and problem is None:
            issues.append("k / v scales stored but the configuration declares no KV cache")
        k_key, v_key = stored.get(layer, (None, None))
        values: list[float | None] = []
        for side, key in (("k_scale", k_key), ("v_scale", v_key)):
            try:
                values.append(None if key is None or names is None
                              else _value(tensors[key], names))
            except CheckpointError as exc:
                values.append(None)
                issues.append(str(exc))
            if key is None:
                issues.append(f"no {side} stored for this attention layer")
        if kind is not None and any(v is not None for v in values):
            try:
                kv_global_scale(*values, kind)
            except ValueError as exc:
                issues.append(str(exc))
        rows.append(KVScaleRow(layer, kind, values[0], values[1], tuple(issues)))
    return rows
