"""Attention that reads K and V back from a quantized KV cache, as vLLM 0.33 would.

:func:`quantize_kv_cache` makes a transformers model's attention see K and V exactly as vLLM
0.33 writes them to a ``--kv-cache-dtype nvfp4 | nvfp4_4over6 | fp8`` cache and reads them back
(:func:`~nvfp4lab.execution.kv_cache.fake_quantize_kv`): K after RoPE, per KV head (grouped-query
attention: before the KV heads are repeated for the query heads), per token, in 16-value blocks
along ``head_dim``. :func:`remove_kv_cache_quantization` undoes it.

**How.** transformers (5.x) decoders' attention modules apply RoPE (where the layer has it),
update the generation cache, then call the function ``AttentionInterface`` holds under
``config._attn_implementation`` with ``(module, query, key, value, attention_mask, ...)``,
query ``[batch, heads, q_len, head_dim]``, key / value ``[batch, kv_heads, kv_len, head_dim]``.
:mod:`nvfp4lab.execution.attention_modules` finds those modules in any model by a stated rule
checked by a one-token probe forward (not by a list of model types), and registers one function
per wrapped implementation, ``"nvfp4lab_kv:<inner>"`` (``inner``: ``sdpa`` or ``eager``, the
implementation the model had), with the inner implementation's mask function; this module
switches the model's config to it. The function fake-quantizes key and value with the settings
stored on the attention module (kind, ``k_scale``, ``v_scale``) and calls the inner
implementation with every keyword unchanged (Gemma's ``softcap`` and ``sliding_window``,
``scaling``, ``s_aux``, ...). A module without settings passes through unchanged. Whatever a
model does before that call (Gemma 3's and OLMo 2's Q / K norms, Phi-3's fused ``qkv_proj``,
SmolLM3's layers without RoPE) is part of the K it hands over. Nothing of transformers is copied
or patched. Tested model types: :data:`SUPPORTED_MODEL_TYPES`; any other type that passes the
rule and the probe is accepted, others are refused in one line.

**Scales.** One DECODE scale per side (K, V) and layer (vLLM's ``layer._k_scale`` /
``_v_scale``: values are read back as ``code * block_scale * k_scale``; the NVFP4 write
multiplies by the ENCODE scale ``f32(1 / k_scale)``). vLLM 0.33 takes them from the checkpoint
or uses 1.0 (``docs/kv_cache.md``); nothing is computed from the data. Default here: 1.0.
``kv_scales`` gives them per layer (see :func:`quantize_kv_cache`).

**Q / K rotation** (``qk_rotation=b``, ``KVCacheOptions(kind, qk_rotation=b)``): query and
key are rotated per head, after RoPE, by compressed-tensors' ``hadamard`` transform of
``head_dim = b`` (its ``q_attn`` / ``k_cache`` locations; SGLang's ``--qkrot-block b``), and the
rotated K is what the cache quantizes; attention runs on the rotated query and the read-back
rotated K. Orthogonal, so the float attention is unchanged and only K's quantization error
moves. Nothing saves it to a checkpoint yet (``kv_cache_settings`` does not report it).

**The generation cache.** transformers' caches (``DynamicCache``, ``StaticCache``) store the
unquantized K / V and hand attention the whole cache each step; this module quantizes all of it
again each step. That equals quantizing each token once when it is written, because the write is
row-wise (one head of one token) with a fixed, data-independent scale: the rows of earlier tokens
come out the same at every step. It does NOT rely on ``fake_quantize_kv`` being idempotent, and
it is not: the NVFP4 kinds change some blocks whose E4M3 block scale is subnormal (< 2**-6) on
a second pass (FP8 was idempotent on every tested input). So a cache that stores already-lossy
values (transformers' ``QuantizedCache``) would be quantized twice: use it with ``use_cache=False``
or a plain cache.

**Not modelled.** The FP8 query that vLLM uses with these caches on some paths (SM100
trtllm-gen / XQA; ``docs/kv_cache.md``, "The query"): the query stays in the model's dtype.
Attention runs in the model's dtype on transformers' kernels, not FlashInfer's. ROCm's fnuz
scale doubling. Implementations other than ``sdpa`` / ``eager`` (flash, flex) are refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nvfp4lab.execution.attention_modules import (
    KV_ATTENTION_PREFIX,
    OBSERVER_ATTR,
    SETTINGS_ATTR,
    SUPPORTED_MODEL_TYPES,
    WRAPPED_IMPLEMENTATIONS,
    AttentionModule,
    KVSettings,
    find_attention_modules,
    kv_attention_name,
    register,
)
from nvfp4lab.execution.kv_cache import KV_BLOCK_SIZE, kv_cache_kind, kv_global_scale
from nvfp4lab.hadamard import BlockRotation, ct_rotation
from nvfp4lab.vocab import KVCacheKind

__all__ = [
    "CALIBRATED",
    "KV_ATTENTION_PREFIX",
    "QK_ROTATION_BLOCKS",
    "SUPPORTED_MODEL_TYPES",
    "WRAPPED_IMPLEMENTATIONS",
    "AttentionObserver",
    "KVCacheLayer",
    "KVCacheOptions",
    "KVScales",
    "check_qk_rotation",
    "kv_attention_name",
    "kv_cache_rotations",
    "kv_cache_settings",
    "observe_attention",
    "qk_rotation_matrix",
    "quantize_kv_cache",
    "remove_kv_cache_quantization",
]

#: ``KVCacheOptions(kind, scales=CALIBRATED)``: k / v scales calibrated from the calibration
#: batches (:mod:`nvfp4lab.execution.kv_calibration`).
CALIBRATED = "calibrated"

#: The Q / K rotation blocks ``qk_rotation`` accepts (SGLang's ``--qkrot-block``; the
#: ``head_dim`` of a compressed-tensors ``q_attn`` / ``k_cache`` transform).
QK_ROTATION_BLOCKS: tuple[int, ...] = (16, 32, 64, 128)

#: Called by :func:`observe_attention` with ``(module, query, key, value)`` at every attention
#: call, key / value as the cache gives them back (after the KV quantization, if any).
AttentionObserver = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], None]

#: A DECODE scale for both sides (a checkpoint's single ``kv_scale``), a (k_scale, v_scale)
#: pair (a None in it: absent, vLLM's rules, :func:`kv_global_scale`), or None (1.0 for both).
ScaleSpec = float | torch.Tensor | tuple[float | torch.Tensor | None, float | torch.Tensor | None]
#: Per-layer scales: a mapping from the attention module's name or its ``layer_idx`` to a
#: :data:`ScaleSpec`, or a callable ``(name, module) -> ScaleSpec | None``.
KVScales = Mapping[str | int, ScaleSpec | None] | Callable[[str, nn.Module], ScaleSpec | None]


@dataclass(frozen=True)
class KVCacheOptions:
    """The KV cache :func:`~nvfp4lab.execution.whole_model.quantize_model` sets, as one value
    (``kv_cache=KVCacheOptions(...)``, beside ``gptq=GPTQOptions(...)``; the older
    ``kv_cache=<kind>, kv_scales=...`` keywords mean the same).

    ``kind``: a :class:`~nvfp4lab.vocab.KVCacheKind` value (``nvfp4``, ``nvfp4_4over6``,
    ``fp8``) or vLLM's alias ``fp8_e4m3``, checked here and held as a ``KVCacheKind``.
    ``scales``: the per-layer DECODE scales ``k_scale`` / ``v_scale`` as
    :func:`quantize_kv_cache`'s ``kv_scales`` takes them (:data:`KVScales`, checked against the
    model there); None: 1.0 for every layer, vLLM 0.33's value without checkpoint scales;
    :data:`CALIBRATED` (``"calibrated"``): computed from ``quantize_model``'s ``calibration=``
    batches by :func:`~nvfp4lab.execution.kv_calibration.calibrate_kv_scales` (amax / 448 per
    layer and side, as llm-compressor and ModelOpt compute them).
    ``qk_rotation``: None, or a block ``b`` of :data:`QK_ROTATION_BLOCKS` (16, 32, 64, 128;
    it must divide the model's ``head_dim``, checked by :func:`quantize_kv_cache`): query and
    key are rotated per head after RoPE by ``blockdiag(H_b, ...) / sqrt(b)`` (``H_b``
    Sylvester's, compressed-tensors' ``hadamard`` ``q_attn`` / ``k_cache`` transforms; SGLang's
    ``--qkrot-block b``) and the rotated K is quantized. Not with calibrated scales (they are
    calibrated on K unrotated).
    """

    kind: str
    scales: KVScales | str | None = None
    qk_rotation: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", kv_cache_kind(self.kind, "KVCacheOptions kind"))
        if isinstance(self.scales, str) and self.scales != CALIBRATED:
            raise ValueError(f"KVCacheOptions scales {self.scales!r}: pass {CALIBRATED!r}, a "
                             "mapping {layer_idx or name: (k_scale, v_scale)}, a callable or None")
        check_qk_rotation(self.qk_rotation, "KVCacheOptions qk_rotation")
        if self.qk_rotation is not None and self.calibrated:
            raise ValueError(
                f"KVCacheOptions qk_rotation={self.qk_rotation} with scales='calibrated': the "
                "scales would be calibrated on K unrotated; pass explicit scales or None")

    @property
    def calibrated(self) -> bool:
        """Whether the scales are to be calibrated (``scales="calibrated"``)."""
        return self.scales == CALIBRATED


@dataclass(frozen=True)
class KVCacheLayer:
    """One attention layer that reads K and V back from a quantized KV cache.

    ``k_scale`` / ``v_scale``: the float32 DECODE scales (vLLM's ``k_scale`` / ``v_scale``; the
    NVFP4 write multiplies by ``1 / k_scale``). ``scales_from``: ``"default"`` (1.0, vLLM's
    value without checkpoint scales) or ``"kv_scales"``. ``attention``: the wrapped
    implementation (``sdpa`` / ``eager``). ``qk_rotation``: the Q / K Hadamard block applied
    before K is quantized (None: none).
    """

    name: str
    layer_idx: int | None
    kind: str
    k_scale: float
    v_scale: float
    kv_heads: int
    head_dim: int
    attention: str
    scales_from: str = "default"
    qk_rotation: int | None = None

    def __str__(self) -> str:
        rotation = "" if self.qk_rotation is None else f", Q/K Hadamard {self.qk_rotation}"
        return (
            f"{self.name}: {self.kind} KV cache, k_scale={self.k_scale:.6g} "
            f"v_scale={self.v_scale:.6g} (DECODE, {self.scales_from}), {self.kv_heads} KV "
            f"head(s) x {self.head_dim}, {self.attention}{rotation}"
        )


def check_qk_rotation(block: object, what: str = "qk_rotation",
                      head_dim: int | None = None, name: str = "") -> int | None:
    """``block`` checked as a Q / K rotation block: None, or one of :data:`QK_ROTATION_BLOCKS`
    dividing ``head_dim`` (when given; ``name``: the attention module, for the message).
    ValueError in one line naming the value (and the head_dim) and what to pass."""
    if block is None:
        return None
    if isinstance(block, bool) or not isinstance(block, int) or block not in QK_ROTATION_BLOCKS:
        raise ValueError(f"{what}={block!r}: pass None or a Hadamard block of "
                         f"{', '.join(map(str, QK_ROTATION_BLOCKS))}")
    if head_dim is not None and head_dim % block:
        raise ValueError(f"{what}={block} does not divide {name} head_dim {head_dim}: pass a "
                         f"block of {', '.join(map(str, QK_ROTATION_BLOCKS))} that divides "
                         f"{head_dim}, or None")
    return block


def qk_rotation_matrix(block: int) -> BlockRotation:
    """The Q / K rotation of block ``block``: compressed-tensors' ``hadamard`` transform with
    ``head_dim = block`` (Sylvester's ±1 matrix ``M``, ``x -> (x.float32 @ M) / sqrt(block)``
    per block along head_dim, cast back to ``x``'s dtype)."""
    size = check_qk_rotation(block)
    if size is None:
        raise ValueError("qk_rotation_matrix(None): pass a block of "
                         f"{', '.join(map(str, QK_ROTATION_BLOCKS))}")
    return ct_rotation("hadamard", size)


def _resolve_scales(
    modules: list[tuple[str, nn.Module]], kv_scales: KVScales | None, kind: KVCacheKind
) -> dict[str, tuple[float, float, str]]:
    """Attention name -> (k_scale, v_scale, source), by vLLM's rules (:func:`kv_global_scale`),
    each checked up front for a ``kind`` cache (ValueError naming the layer and the value)."""
    out: dict[str, tuple[float, float, str]] = {}
    if kv_scales == CALIBRATED:
        raise ValueError(
            "kv_scales='calibrated' is computed from calibration batches: pass "
            "calibrate_kv_scales(model, batches, kind) here, or quantize_model(..., kv_cache="
            "KVCacheOptions(kind, scales='calibrated'), calibration=batches)")
    if kv_scales is not None and not (callable(kv_scales) or isinstance(kv_scales, Mapping)):
        raise TypeError(
            "kv_scales must be a mapping {attention name or layer_idx: scale or (k_scale, "
            f"v_scale)}} or a callable (name, module) -> scale, got {type(kv_scales).__name__}"
        )
    used: set[str | int] = set()
    for name, module in modules:
        spec: ScaleSpec | None = None
        if isinstance(kv_scales, Mapping):
            idx = getattr(module, "layer_idx", None)
            keys = [key for key in (name, idx) if key is not None and key in kv_scales]
            if len(keys) > 1:
                raise ValueError(f"kv_scales gives {name} twice: by name and by layer_idx {idx}")
            spec = kv_scales[keys[0]] if keys else None
            used.update(keys)
        elif kv_scales is not None:
            spec = kv_scales(name, module)
        if spec is None:
            out[name] = (*kv_global_scale(), "default")
            continue
        if isinstance(spec, tuple | list) and len(spec) != 2:
            raise ValueError(f"kv_scales for {name}: a (k_scale, v_scale) pair, got {spec!r}")
        k, v = spec if isinstance(spec, tuple | list) else (spec, spec)
        try:
            out[name] = (*kv_global_scale(k, v, kind), "kv_scales")
        except ValueError as err:
            idx = getattr(module, "layer_idx", None)
            raise ValueError(f"kv_scales for {name} (layer_idx {idx}): {err}") from None
    if isinstance(kv_scales, Mapping) and (unused := [k for k in kv_scales if k not in used]):
        names = ", ".join(repr(k) for k in unused)
        raise ValueError(
            f"kv_scales keys {names} match no attention layer; keys are attention module names "
            f"(e.g. {modules[0][0]!r}) or layer_idx values"
        )
    return out


def quantize_kv_cache(
    model: nn.Module, kind: str, *, kv_scales: KVScales | None = None,
    qk_rotation: int | None = None,
) -> list[KVCacheLayer]:
    """Make ``model``'s attention see K and V as vLLM 0.33's ``kind`` KV cache gives them back.

    ``model``: a transformers decoder whose attention modules call the ``AttentionInterface``
    (the rule and the one-token probe of :mod:`~nvfp4lab.execution.attention_modules`; tested:
    :data:`SUPPORTED_MODEL_TYPES`: Llama / SmolLM2, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3
    text, Phi-3, OLMo 2, SmolLM3, Granite), with ``attn_implementation`` ``sdpa`` or ``eager``;
    any other model (GPT-2, BERT, encoder-decoders, custom attention) raises ValueError in one
    line naming its type, why, and the tested types. ``kind``: a
    :class:`~nvfp4lab.vocab.KVCacheKind` value (``nvfp4``, ``nvfp4_4over6``, ``fp8``, or
    vLLM's ``fp8_e4m3`` for ``fp8``); the NVFP4 kinds need K's and V's head dims multiples of 16.

    Each attention call then sees ``fake_quantize_kv(key, kind, k_scale)`` and likewise value:
    key / value ``[batch, kv_heads, kv_len, head_dim]`` in the model's dtype (float32 / bfloat16
    / float16), K as the model hands it to attention (after RoPE where the layer has RoPE, after
    any K norm), one block per 16 values of one KV head of one token. The query is not quantized
    (vLLM's FP8 query on SM100 paths is not modelled).

    ``kv_scales``: the DECODE scales (vLLM's ``k_scale`` / ``v_scale``, as a checkpoint stores
    them; values read back as ``code * block_scale * k_scale``), per layer: a mapping from the
    attention module's name (``"model.layers.0.self_attn"``) or its ``layer_idx`` to a number
    (both sides, like a checkpoint's single ``kv_scale``), a ``(k_scale, v_scale)`` pair or
    None; or a callable ``(name, module)`` returning one of those. A layer without an entry uses
    1.0 for both, as vLLM 0.33 does without checkpoint scales (the default for every layer).
    A mapping key matching no layer raises ValueError, and so does a scale that is not finite,
    not > 0, whose float32 reciprocal overflows, or (NVFP4 kinds) whose ENCODE scale exceeds
    2**116, naming the layer and the value (it used to fail at the first forward, unnamed).

    ``qk_rotation``: None (default), or a Hadamard block ``b`` (16, 32, 64 or 128) dividing
    every layer's ``head_dim`` (ValueError naming the value and the head_dim otherwise): each
    attention call then rotates query ``[batch, heads, q_len, head_dim]`` and key per head by
    ``R = blockdiag(H_b, ...) / sqrt(b)`` (:func:`qk_rotation_matrix`, compressed-tensors'
    ``hadamard`` ``q_attn`` / ``k_cache`` transforms, SGLang's ``--qkrot-block b``; computed
    in float32, cast back to the model's dtype), quantizes the ROTATED key (V as without
    rotation, unrotated) and runs attention on the rotated query. ``(q R)(k R)ᵀ = q kᵀ``, so
    only K's quantization error changes (an outlier along head_dim is spread over its block).
    An observer (:func:`observe_attention`) then sees the rotated query and key.

    All or nothing: on any error the model is left as it was. A model whose KV cache is
    quantized already raises (call :func:`remove_kv_cache_quantization` first). Runs one
    one-token forward (the probe). Returns one :class:`KVCacheLayer` per attention module, in
    module order.
    """
    k = kv_cache_kind(kind)
    check_qk_rotation(qk_rotation, "quantize_kv_cache qk_rotation")
    found = find_attention_modules(model, "quantize_kv_cache")
    done = {f.module.__dict__[SETTINGS_ATTR].kind.value for f in found
            if SETTINGS_ATTR in f.module.__dict__}
    if done:
        raise ValueError(
            f"quantize_kv_cache: {type(model).__name__} has a quantized KV cache already "
            f"({', '.join(sorted(done))}); call remove_kv_cache_quantization(model) first"
        )
    for f in found:
        for side, dim in (("head_dim", f.head_dim), ("V head_dim", f.value_dim)):
            if k is not KVCacheKind.FP8 and dim % KV_BLOCK_SIZE:
                raise ValueError(
                    f"quantize_kv_cache: an {k.value} KV cache needs {side} a multiple of "
                    f"{KV_BLOCK_SIZE}, {f.name} has {dim}"
                )
        check_qk_rotation(qk_rotation, "quantize_kv_cache qk_rotation", f.head_dim, f.name)
    rotation = None if qk_rotation is None else qk_rotation_matrix(qk_rotation)
    scales = _resolve_scales([(f.name, f.module) for f in found], kv_scales, k)
    layers = [
        KVCacheLayer(
            name=f.name, layer_idx=getattr(f.module, "layer_idx", None), kind=k.value,
            k_scale=scales[f.name][0], v_scale=scales[f.name][1], kv_heads=f.kv_heads,
            head_dim=f.head_dim, attention=f.implementation, scales_from=scales[f.name][2],
            qk_rotation=qk_rotation,
        )
        for f in found
    ]
    try:
        for f, layer in zip(found, layers, strict=True):
            setattr(f.module, SETTINGS_ATTR,
                    KVSettings(k, layer.k_scale, layer.v_scale, rotation))
        _switch(found)
    except BaseException:
        remove_kv_cache_quantization(model)
        raise
    return layers


def _switch(found: list[AttentionModule]) -> list[tuple[Any, str]]:
    """Switch the configs of ``found`` to the KV attention around their implementation; returns
    (config, implementation before) of those switched (a config switched already is left)."""
    switched: list[tuple[Any, str]] = []
    done: set[int] = set()
    for f in found:
        config = f.module.config  # type: ignore[union-attr]
        if id(config) in done or config._attn_implementation.startswith(KV_ATTENTION_PREFIX):
            continue
        done.add(id(config))
        switched.append((config, config._attn_implementation))
        config._attn_implementation = register(f.implementation)
    return switched


def kv_cache_settings(model: nn.Module) -> dict[str, tuple[str, float, float]]:
    """The quantized KV cache :func:`quantize_kv_cache` set on ``model``: attention module name
    -> (kind, k_scale, v_scale), the scales float32 DECODE values; empty when there is none.
    A Q / K rotation is not in it (:func:`kv_cache_rotations`)."""
    return {name: (m.__dict__[SETTINGS_ATTR].kind.value, m.__dict__[SETTINGS_ATTR].k_scale,
                   m.__dict__[SETTINGS_ATTR].v_scale)
            for name, m in model.named_modules() if SETTINGS_ATTR in m.__dict__}


def kv_cache_rotations(model: nn.Module) -> dict[str, int]:
    """Attention module name -> the Q / K rotation block :func:`quantize_kv_cache` set on it
    (only the modules that have one)."""
    out: dict[str, int] = {}
    for name, module in model.named_modules():
        settings = module.__dict__.get(SETTINGS_ATTR)
        if settings is not None and settings.qk_rotation is not None:
            out[name] = settings.qk_rotation.size
    return out


def remove_kv_cache_quantization(model: nn.Module) -> list[str]:
    """Undo :func:`quantize_kv_cache`: the attention modules lose their KV settings and every
    config switched to the KV attention gets its implementation back (``sdpa`` / ``eager``).
    Returns the names of the attention modules that had settings; a model without any is left
    as it is (empty list)."""
    removed: list[str] = []
    for name, module in model.named_modules():
        if SETTINGS_ATTR in module.__dict__:
            delattr(module, SETTINGS_ATTR)
            removed.append(name)
        config = getattr(module, "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if isinstance(impl, str) and impl.startswith(KV_ATTENTION_PREFIX):
            config._attn_implementation = impl.removeprefix(KV_ATTENTION_PREFIX)  # type: ignore[union-attr]
    return removed


@contextlib.contextmanager
def observe_attention(model: nn.Module, observer: AttentionObserver) -> Iterator[None]:
    """Inside the block, every attention call of ``model`` (a model :func:`quantize_kv_cache`
    accepts; same rule and probe) first calls ``observer(module, query, key, value)``: query
    ``[batch, heads, q_len, head_dim]`` after RoPE, key / value ``[batch, kv_heads, kv_len,
    head_dim]`` as the model hands them to attention and as the KV cache gives them back (float
    when the KV cache is not quantized; query and key rotated when it has a Q / K rotation).
    The model computes exactly what it computes outside; on exit the observers go and a config
    switched for them gets its implementation back (a quantized KV cache stays).
    """
    found = find_attention_modules(model, "observe_attention")
    switched: list[tuple[Any, str]] = []
    try:
        switched = _switch(found)
        for f in found:
            setattr(f.module, OBSERVER_ATTR, observer)
        yield
    finally:
        for f in found:
            f.module.__dict__.pop(OBSERVER_ATTR, None)
        for config, impl in switched:
            config._attn_implementation = impl
