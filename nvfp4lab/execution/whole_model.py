"""Whole-model quantization: replace ``nn.Linear`` layers by :class:`NVFP4Linear`, optionally
quantize the KV cache (:mod:`nvfp4lab.execution.attention`), and report
(:mod:`nvfp4lab.execution.quantize_report` holds the report's records).

Fused groups: inference engines fuse sibling Linears (q/k/v into one ``qkv_proj``, gate/up into
``gate_up_proj``) into one GEMM and decode all shards with ONE weight global scale (vLLM takes
the max over the shards' encode scales). :data:`SHARE_PRESETS` names those groups per model
family; :data:`FUSED_GROUPS` is all of them, the one list both quantization and checkpoints use.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from nvfp4lab import vocab
from nvfp4lab.codec import compute_global_scale
from nvfp4lab.constants import BLOCK_SIZE
from nvfp4lab.execution.attention import (
    KVCacheOptions,
    KVScales,
    quantize_kv_cache,
    remove_kv_cache_quantization,
)
from nvfp4lab.execution.calibrate import calibration_batches
from nvfp4lab.execution.gptq import GPTQOptions
from nvfp4lab.execution.gptq_model import sequential_gptq
from nvfp4lab.execution.kv_cache import kv_cache_kind
from nvfp4lab.execution.kv_calibration import calibrated_kv_options
from nvfp4lab.execution.layers import NVFP4Linear
from nvfp4lab.execution.quantize_report import (
    IgnoreSpec,
    QuantizeReport,
    ReplacedLayer,
    SkippedLayer,
)
from nvfp4lab.execution.w4a4_recipes import W4A4Options, w4a4_layers
from nvfp4lab.execution.w4a4_smooth import SmoothStatistics, smooth_model
from nvfp4lab.hadamard import BlockRotation, check_seed, ct_rotation, hadamard_transform
from nvfp4lab.options import order_argument
from nvfp4lab.orders import ArithmeticOrder
from nvfp4lab.orders import get as get_order
from nvfp4lab.vocab import AUTO, BiasMode, QuantMethod

__all__ = [
    "DEFAULT_IGNORE",
    "FUSED_GROUPS",
    "MR_GPTQ_ROTATION",
    "SHARE_PRESETS",
    "QuantizeReport",
    "ReplacedLayer",
    "SkippedLayer",
    "UnmatchedIgnoreWarning",
    "quantize_model",
]

#: Fused groups whose shards must share one weight global scale to load in vLLM.
SHARE_PRESETS: dict[str, tuple[tuple[str, ...], ...]] = {
    "llama": (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
    "bert": (("query", "key", "value"),),
}
#: Every preset's groups, once each.
FUSED_GROUPS: tuple[tuple[str, ...], ...] = tuple(
    dict.fromkeys(group for groups in SHARE_PRESETS.values() for group in groups)
)


#: The rotation ``quantize_model(method="mr-gptq")`` uses unless ``hadamard=`` is given:
#: compressed-tensors' "random-hadamard" 16 with its default seed (:func:`ct_rotation`), one
#: 16x16 matrix repeated along K, which ``save_pretrained`` writes as a compressed-tensors
#: ``transform_config`` that vLLM 0.33 loads. ``hadamard=<int>`` gives nvfp4lab's seeded
#: rotation (per-K signs, not savable), ``hadamard=0`` the default before this one.
MR_GPTQ_ROTATION: BlockRotation = ct_rotation()

#: What ``quantize_model(ignore=None)`` leaves unquantized (where present).
DEFAULT_IGNORE: tuple[str, ...] = ("lm_head",)


class UnmatchedIgnoreWarning(UserWarning):
    """An ``ignore`` entry of :func:`quantize_model` matched no Linear layer (a typo?)."""


def _ignored_by(name: str, ignore: Iterable[IgnoreSpec]) -> IgnoreSpec | None:
    """``"re:<pattern>"`` -> ``re.match`` (compressed-tensors' syntax); a compiled pattern ->
    ``search``; a plain string -> the exact name or a dotted suffix ("lm_head" matches
    "model.lm_head")."""
    for spec in ignore:
        if isinstance(spec, re.Pattern):
            if spec.search(name):
                return spec
        elif spec.startswith("re:"):
            if re.match(spec[3:], name):
                return spec
        elif name == spec or name.endswith("." + spec):
            return spec
    return None


def _share_groups(
    names: Sequence[str], share: str | Sequence[Sequence[str]] | None
) -> list[tuple[str, ...]]:
    """Groups of layer names (from ``names``) sharing one weight global scale."""
    if share is None:
        return []
    if share == AUTO:
        return _share_groups(names, FUSED_GROUPS)
    if isinstance(share, str):
        if share not in SHARE_PRESETS:
            raise ValueError(
                f"unknown share_global_scale preset {share!r}; presets: 'auto', "
                f"{', '.join(repr(p) for p in sorted(SHARE_PRESETS))}, None "
                "or a sequence of groups of layer names/suffixes"
            )
        specs: Sequence[Sequence[str]] = SHARE_PRESETS[share]
    else:
        specs = share
    present = set(names)
    groups: list[tuple[str, ...]] = []
    taken: set[str] = set()
    for spec in specs:
        if isinstance(spec, str):
            raise ValueError(
                f"share_global_scale groups must be sequences of names, got the string {spec!r}"
            )
        by_parent: dict[str, list[str]] = {}
        for member in spec:
            for name in names:
                if name == member or name.endswith("." + member):
                    parent = name[: len(name) - len(member)]
                    by_parent.setdefault(parent, []).append(name)
        for members in by_parent.values():
            group = tuple(dict.fromkeys(m for m in members if m in present and m not in taken))
            if len(group) > 1:
                groups.append(group)
                taken.update(group)
    return groups


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _skip_reason(module: nn.Linear) -> str | None:
    """Why a (non-ignored) Linear cannot become an NVFP4Linear, or None."""
    if type(module) is not nn.Linear:
        return "subclass of nn.Linear: its owner may read .weight"
    if module.in_features % BLOCK_SIZE:
        return f"K={module.in_features} is not a multiple of {BLOCK_SIZE}"
    if module.weight.dtype not in vocab.SUPPORTED_DTYPES:
        return f"weight dtype {module.weight.dtype} is not fp32/bf16/fp16"
    return None


def _candidates(
    model: nn.Module, ignore: Sequence[IgnoreSpec], report: QuantizeReport
) -> dict[str, nn.Linear]:
    """The Linear layers to replace; every other module with parameters goes to the report."""
    candidates: dict[str, nn.Linear] = {}
    matched: set[int] = set()
    for name, module in model.named_modules():
        if not name or isinstance(module, NVFP4Linear):
            continue
        kind = type(module).__name__
        if not isinstance(module, nn.Linear):
            if any(True for _ in module.parameters(recurse=False)):
                report.skipped.append(SkippedLayer(name, kind, "not nn.Linear"))
            continue
        spec = _ignored_by(name, ignore)
        if spec is not None:
            matched.add(ignore.index(spec))
            report.skipped.append(SkippedLayer(name, kind, f"ignored (matches {spec!r})"))
        elif (reason := _skip_reason(module)) is not None:
            report.skipped.append(SkippedLayer(name, kind, reason))
        else:
            candidates[name] = module
    report.unmatched_ignore = [spec for i, spec in enumerate(ignore) if i not in matched]
    return candidates


def _shared_scales(
    candidates: Mapping[str, nn.Linear],
    groups: Sequence[tuple[str, ...]],
    convention: str | ArithmeticOrder,
    hadamard: int | BlockRotation | None = None,
) -> dict[str, torch.Tensor]:
    """Member name -> the group's weight global scale ``min_i 2688/amax(W_i)`` (of ``W_i Q``
    with ``hadamard``: the tensors the layers quantize)."""

    def quantized(weight: torch.Tensor) -> torch.Tensor:
        return weight if hadamard is None else hadamard_transform(weight, hadamard)

    shared: dict[str, torch.Tensor] = {}
    for group in groups:
        scales = [
            compute_global_scale(quantized(candidates[m].weight.detach()), convention=convention)
            for m in group
        ]
        gs = torch.stack([s.to(scales[0].device) for s in scales]).min(dim=0).values
        shared.update(dict.fromkeys(group, gs))
    return shared


def _ignore_specs(ignore: str | re.Pattern[str] | Iterable[IgnoreSpec]) -> tuple[IgnoreSpec, ...]:
    """A single string or pattern is ONE spec (never iterated character by character)."""
    if isinstance(ignore, str | re.Pattern):
        return (ignore,)
    specs = tuple(ignore)
    for spec in specs:
        if not isinstance(spec, str | re.Pattern):
            raise TypeError(
                f"ignore entries must be layer names, 're:<regex>' strings or compiled patterns, "
                f"got {spec!r} ({type(spec).__name__})"
            )
    return specs


def _check_state(model: nn.Module, candidates: Mapping[str, nn.Linear], method: str) -> None:
    """ValueError for weights on the meta device (no data to quantize); a warning naming the
    layers that are NVFP4Linear already (a second call leaves them as they are)."""
    meta = [name for name, module in candidates.items() if module.weight.is_meta]
    if meta:
        raise ValueError(
            f"quantize_model: {len(meta)} Linear layer(s) of {type(model).__name__} have their "
            f"weights on the meta device (no data), e.g. {meta[0]!r}: materialize the model "
            "first (load it without a meta/empty-weights context, or model.to_empty(device=...) "
            "and then load the weights)"
        )
    done = [name for name, module in model.named_modules() if isinstance(module, NVFP4Linear)]
    if done:
        shown = ", ".join(repr(n) for n in done[:5]) + (", ..." if len(done) > 5 else "")
        warnings.warn(
            f"quantize_model(method={str(method)!r}): {len(done)} layer(s) of "
            f"{type(model).__name__} are NVFP4Linear already ({shown}) and stay as they are "
            f"(not re-quantized); {len(candidates)} Linear layer(s) left to quantize. To quantize "
            "with another method, start again from the unquantized model",
            UserWarning,
            stacklevel=4,  # quantize_model's caller (via _select_layers)
        )


def _method_inputs(
    method: str, calibration: Iterable[Any] | None, gptq: GPTQOptions | None,
    w4a4: W4A4Options | None = None,
) -> list[Any]:
    """The checked calibration batches (empty for RTN, which takes none unless the W4A4
    options smooth)."""
    if w4a4 is not None and w4a4.needs_calibration:
        if calibration is None:
            raise ValueError("W4A4Options smooth_alpha / awq read activation statistics: pass "
                             "calibration= (model inputs from a calibration text)")
        if method == QuantMethod.RTN and gptq is not None:
            raise ValueError("gptq= is only used by method='gptq': drop it or pass "
                             "method='gptq'")
        return calibration_batches(calibration)
    if method == QuantMethod.RTN:
        if calibration is not None or gptq is not None:
            raise ValueError(
                "calibration= and gptq= are only used by method='gptq' (and 'mr-gptq'); pass "
                "method='gptq' or drop them (method='rtn' needs no data)"
            )
        return []
    if gptq is not None and not isinstance(gptq, GPTQOptions):
        raise TypeError(f"gptq must be a GPTQOptions, got {type(gptq).__name__}")
    return calibration_batches(calibration)


def _gptq_layers(
    model: nn.Module,
    candidates: Mapping[str, nn.Linear],
    groups: Sequence[tuple[str, ...]],
    shared_gs: Mapping[str, torch.Tensor],
    batches: Sequence[Any],
    convention: str | ArithmeticOrder,
    gptq: GPTQOptions | None,
    options: Mapping[str, Any],
    hadamard: int | BlockRotation | None,
) -> Iterator[tuple[str, NVFP4Linear, str]]:
    """(name, NVFP4Linear, method) per candidate, by sequential GPTQ (MR-GPTQ with
    ``hadamard``); the caller installs each layer before the next is computed (the next stage
    calibrates on the model as it is)."""
    results = sequential_gptq(model, candidates, batches, groups=groups, global_scales=shared_gs,
                              convention=convention, options=gptq, hadamard=hadamard)
    done = QuantMethod.GPTQ if hadamard is None else QuantMethod.MR_GPTQ
    installed: list[NVFP4Linear] = []
    try:
        for name, result in results:
            assert result.weight is not None
            bias = candidates[name].bias
            layer = NVFP4Linear.from_quantized(
                result.weight, bias.detach() if bias is not None else None,
                **{**options, "cache_dequantized": True},  # later stages run it once per batch
            )
            how = f"rtn (gptq fallback: {result.reason})" if result.fallback else done
            yield name, layer, how
            installed.append(layer)
    finally:  # on any exit (an error here or in the caller too): calibration hooks removed
        results.close()
    for layer in installed:  # calibration is over: the caller's cache setting, cache freed
        layer.cache_dequantized = bool(options["cache_dequantized"])
        layer.clear_dequantized_cache()


def quantize_model(
    model: nn.Module,
    *,
    backend: str | None = AUTO,
    ignore: str | re.Pattern[str] | Iterable[IgnoreSpec] | None = None,
    share_global_scale: str | Sequence[Sequence[str]] | None = AUTO,
    order: str | ArithmeticOrder | None = None,
    cache_dequantized: bool = False,
    bias_mode: str = BiasMode.OUTPUT,
    method: str = QuantMethod.RTN,
    calibration: Iterable[Any] | None = None,
    gptq: GPTQOptions | None = None,
    kv_cache: str | KVCacheOptions | None = None,
    kv_scales: KVScales | None = None,
    hadamard: int | BlockRotation | None = None,
    convention: str | ArithmeticOrder | None = None,
    w4a4: W4A4Options | None = None,
    smooth_statistics: SmoothStatistics | None = None,
) -> QuantizeReport:
    """Replace ``nn.Linear`` layers of ``model`` in place by :class:`NVFP4Linear`, and with
    ``kv_cache`` make its attention read K and V back from a quantized KV cache.

    Skipped, with the reason in the report: names matched by ``ignore`` (a name or a sequence of
    them: exact names, dotted suffixes, ``"re:<regex>"`` or compiled patterns), Linear layers
    with K not a multiple of 16, subclasses of nn.Linear (e.g.
    ``nn.MultiheadAttention.out_proj``, whose parent reads ``.weight`` directly), and other
    modules holding parameters (not nn.Linear). ``ignore=None`` (default) ignores ``lm_head``
    where there is one; given entries that match no Linear are listed in
    ``report.unmatched_ignore`` and warned about (:class:`UnmatchedIgnoreWarning`).

    ``share_global_scale``: ``"auto"`` (default: every preset's groups, where present), a preset
    ("llama": q/k/v_proj and gate/up_proj; "bert": query/key/value), groups of names/suffixes,
    or None (every layer its own scale); the members found under one parent share the weight
    global scale ``min_i 2688/amax(W_i)`` (= 2688 / the group's max amax), as fused shards in
    vLLM-loadable checkpoints must (vLLM decodes all shards with one scale). Activation scales
    start dynamic (None); use :func:`~nvfp4lab.execution.calibrate.calibration` to set them.

    ``method``: "rtn" (default; round to nearest, no data), "gptq"
    (:mod:`nvfp4lab.execution.gptq_model`: sequential GPTQ, layer by layer in module order, each
    layer's Hessian collected while ``calibration`` runs through the model whose earlier layers
    are already quantized; block by block where the layers sit in repeated blocks,
    :mod:`nvfp4lab.execution.sequential`) or "mr-gptq" (GPTQ on rotated weights, see
    ``hadamard``; :data:`MR_GPTQ_ROTATION`, compressed-tensors' random-hadamard 16 and so
    savable, unless ``hadamard`` says otherwise). ``calibration``: an iterable of
    model inputs (tokenizer outputs as dicts of tensors -> ``model(**b)``, tuples ->
    ``model(*b)``, tensors -> ``model(b)``); GPTQ methods only. ``gptq``: :class:`GPTQOptions`
    (damping, act order, block-scale timing). The global scales (shared ones included) are the
    same for every method. ``order`` (old keyword: ``convention``): the weights' arithmetic order, a
    :class:`~nvfp4lab.vocab.OrderName` name or an :class:`~nvfp4lab.orders.ArithmeticOrder` (e.g.
    one with a step changed by ``dataclasses.replace``).

    ``hadamard``: None, a seed or a :class:`~nvfp4lab.hadamard.BlockRotation`: every replaced
    layer holds the NVFP4 weight of ``W Q`` (Q the seeded 16-point block Hadamard, or the
    rotation's ``blockdiag(M, ..., M) / sqrt(b)``, :mod:`nvfp4lab.hadamard`) and rotates its
    inputs at run time (:class:`NVFP4Linear` ``hadamard``); global scales are those of ``W Q``.
    With "rtn" that is rotated RTN; with "gptq" it is MR-GPTQ (arXiv 2509.23202 style: GPTQ of
    ``W Q`` with ``Qᵀ H Q``), reported as "mr-gptq". "mr-gptq" without ``hadamard`` rotates by
    :data:`MR_GPTQ_ROTATION`. Layers rotated by a BlockRotation are saved as a
    compressed-tensors ``transform_config`` (``save_pretrained``); a seed's rotation has no
    checkpoint form (``save_pretrained`` refuses it).

    ``kv_cache``: None (default: attention unchanged), a
    :class:`~nvfp4lab.execution.attention.KVCacheOptions` (kind and per-layer DECODE scales), or
    a kind alone with its scales in ``kv_scales`` (the older form, same meaning): attention then
    sees K (after RoPE) and V as vLLM 0.33 writes them to that cache and reads them back, per KV
    head and token, in 16-value blocks along head_dim
    (:func:`~nvfp4lab.execution.attention.quantize_kv_cache`: transformers decoders whose
    attention calls ``AttentionInterface``, ``sdpa`` or ``eager``; other models raise). The kind
    and scales of each layer are in ``report.kv_cache``;
    ``KVCacheOptions(kind, scales="calibrated")`` computes them from ``calibration`` first
    (amax / 448 per layer and side,
    :func:`~nvfp4lab.execution.kv_calibration.calibrate_kv_scales`, also with "rtn" and
    ``backend=None``). The query stays unquantized (vLLM's FP8 query on SM100 paths is not
    modelled). The KV cache is set before the Linear layers are replaced, so GPTQ calibrates on
    the model with its KV cache quantized, as it will run. ``backend=None``: quantize only the
    KV cache and leave every Linear layer as it is (the "FP8 KV" / "NVFP4 KV" alone
    configurations); ``kv_cache`` is then required and ``method``, ``calibration``, ``gptq``
    and ``ignore`` do not apply.

    ``w4a4``: a :class:`~nvfp4lab.execution.w4a4_recipes.W4A4Options`, the W4A4 recipes, alone
    or combined: an online rotation of any block (``rotation=16/32/64/128/"full"``),
    SmoothQuant (``smooth_alpha``) or AWQ-searched (``awq=True``) scales folded into the float
    weights first (:mod:`~nvfp4lab.execution.w4a4_smooth`; these need ``calibration=``, also
    with "rtn"), Four Over Six block scales for weights and activations; with "gptq" the
    Hessians are those of the rotated, quantized inputs. Not with ``hadamard`` / "mr-gptq" (use
    ``rotation=16`` and "gptq"). ``smooth_statistics``: the smoothing's calibration pass, made
    once on the float model by :func:`~nvfp4lab.execution.w4a4_smooth.smooth_statistics` with
    the same ``calibration``, for several smoothed quantizations of copies of it.

    All or nothing: if anything fails, every replaced Linear is put back and the KV cache
    quantization removed (and smoothing undone).
    """
    quant_method = vocab.check_choice("method", method, QuantMethod)
    if smooth_statistics is not None and (backend is None or not isinstance(w4a4, W4A4Options)
                                          or not w4a4.smooths):
        raise ValueError("smooth_statistics= is read only by w4a4=W4A4Options(smooth_alpha=...) "
                         "or W4A4Options(awq=True) with a backend: drop it, or pass such options")
    kv = _kv_cache_options(kv_cache, kv_scales)
    kv, calibration = calibrated_kv_options(  # scales="calibrated": from the model as it is
        model, kv, calibration, keep=quant_method != QuantMethod.RTN or w4a4 is not None)
    if backend is None:
        return _kv_cache_only(model, kv, quant_method, calibration, gptq, ignore)
    vocab.check_choice("backend", backend, vocab.Backend, extra=(AUTO,))
    convention = order_argument(order, convention)
    get_order(convention)  # an OrderName name (the vocabulary's error otherwise) or an order
    hadamard = _rotation_seed(quant_method, hadamard)
    _check_w4a4(w4a4, quant_method, hadamard)
    batches = _method_inputs(quant_method, calibration, gptq, w4a4)
    report = QuantizeReport()
    candidates = _select_layers(model, ignore, quant_method, report)
    report.shared_groups = _share_groups(list(candidates), share_global_scale)
    shared_gs = _shared_scales(candidates, report.shared_groups, convention, hadamard)
    options = dict(backend=backend, cache_dequantized=cache_dequantized, bias_mode=bias_mode)
    smoothed = None
    try:
        if w4a4 is not None:
            w4a4.check_call(candidates, quant_method, backend)
            if w4a4.smooths:
                smoothed = smooth_model(model, candidates, batches, w4a4, convention,
                                        quantize_inputs=backend != vocab.Backend.W4A16,
                                        statistics=smooth_statistics)
            layers = w4a4_layers(model, candidates, report.shared_groups, batches, convention,
                                 quant_method, gptq, w4a4, options)
        elif quant_method != QuantMethod.RTN:
            layers = _gptq_layers(model, candidates, report.shared_groups, shared_gs, batches,
                                  convention, gptq, options, hadamard)
        else:
            layers = _rtn_layers(candidates, shared_gs, convention, hadamard, options)
        if kv is not None:  # checked and set before any Linear changes (or nothing is set)
            report.kv_cache = quantize_kv_cache(
                model, kv.kind, kv_scales=kv.scales, qk_rotation=kv.qk_rotation)
        _install(model, candidates, layers, report)
    except BaseException:
        if smoothed is not None:  # the float weights as they were
            smoothed.undo()
        raise
    return report


def _check_w4a4(
    w4a4: W4A4Options | None, method: str, hadamard: int | BlockRotation | None
) -> None:
    """TypeError / ValueError for W4A4 options that do not fit the call."""
    if w4a4 is None:
        return
    if not isinstance(w4a4, W4A4Options):
        raise TypeError(f"w4a4 must be a W4A4Options, got {type(w4a4).__name__}")
    if hadamard is not None:
        raise ValueError("w4a4= rotates by its own options: drop hadamard= / method='mr-gptq' "
                         "and use W4A4Options(rotation=16, seed=...) with method='gptq'")


def _kv_cache_options(
    kv_cache: str | KVCacheOptions | None, kv_scales: KVScales | None
) -> KVCacheOptions | None:
    """The KV cache job's one value: ``kv_cache`` as given, or built from the older
    ``kv_cache=<kind>, kv_scales=...`` keywords (errors name the keyword)."""
    if isinstance(kv_cache, KVCacheOptions):
        if kv_scales is not None:
            raise ValueError(
                "kv_scales= beside kv_cache=KVCacheOptions(...): give the scales once, as "
                "KVCacheOptions(kind, scales=...)"
            )
        return kv_cache
    if kv_cache is None:
        if kv_scales is not None:
            raise ValueError("kv_scales= sets the KV cache scales: pass kv_cache= too (or drop it)")
        return None
    return KVCacheOptions(kv_cache_kind(kv_cache, "kv_cache"), kv_scales)


def _rotation_seed(
    method: str, hadamard: int | BlockRotation | None
) -> int | BlockRotation | None:
    """The arithmetic job's rotation: ``hadamard`` checked, MR-GPTQ's default rotation
    (:data:`MR_GPTQ_ROTATION`) otherwise."""
    if hadamard is not None:
        check_seed(hadamard)
        return hadamard
    return MR_GPTQ_ROTATION if method == QuantMethod.MR_GPTQ else None


def _select_layers(
    model: nn.Module,
    ignore: str | re.Pattern[str] | Iterable[IgnoreSpec] | None,
    method: str,
    report: QuantizeReport,
) -> dict[str, nn.Linear]:
    """The layers job: the Linear layers to replace (every other module, and why, in
    ``report``), their state checked, unmatched ``ignore`` entries warned about."""
    specs = _ignore_specs(DEFAULT_IGNORE if ignore is None else ignore)
    candidates = _candidates(model, specs, report)
    _check_state(model, candidates, method)
    if ignore is None:
        report.unmatched_ignore = []
    elif report.unmatched_ignore:
        shown = ", ".join(repr(s) for s in report.unmatched_ignore)
        warnings.warn(
            f"quantize_model: ignore entries {shown} match no Linear layer of "
            f"{type(model).__name__}; check the names (exact, dotted suffix or 're:<regex>')",
            UnmatchedIgnoreWarning,
            stacklevel=3,
        )
    return candidates


def _rtn_layers(
    candidates: Mapping[str, nn.Linear],
    shared_gs: Mapping[str, torch.Tensor],
    convention: str | ArithmeticOrder,
    hadamard: int | BlockRotation | None,
    options: Mapping[str, Any],
) -> Iterator[tuple[str, NVFP4Linear, str]]:
    """(name, NVFP4Linear, method) per candidate, rounded to nearest, one at a time."""
    for name, module in candidates.items():
        layer = NVFP4Linear.from_linear(module, weight_global_scale=shared_gs.get(name),
                                        convention=convention, hadamard=hadamard, **options)
        yield name, layer, QuantMethod.RTN


def _install(
    model: nn.Module,
    candidates: Mapping[str, nn.Linear],
    layers: Iterator[tuple[str, NVFP4Linear, str]],
    report: QuantizeReport,
) -> None:
    """Put each new layer in place and in ``report``; all or nothing: on any error every
    replaced Linear is put back and the KV cache quantization removed, and the error says so."""
    partners = {m: tuple(o for o in g if o != m) for g in report.shared_groups for m in g}
    try:
        for name, layer, how in layers:
            _set_submodule(model, name, layer)
            report.replaced.append(ReplacedLayer(
                name=name, in_features=layer.in_features, out_features=layer.out_features,
                bias=layer.bias is not None, weight_global_scale=float(layer.weight_global_scale),
                shared_with=partners.get(name, ()), method=how, hadamard=layer.hadamard,
            ))
    except BaseException as exc:  # all or nothing: put every replaced Linear back
        close = getattr(layers, "close", None)
        if callable(close):  # GPTQ's calibration hooks and remembered forwards go now, not
            close()  # when the traceback holding the generator is freed
        for name, original in candidates.items():
            if model.get_submodule(name) is not original:
                _set_submodule(model, name, original)
        if report.kv_cache:
            remove_kv_cache_quantization(model)
        names = ", ".join(map(repr, report.replaced_names))
        kv = " and removed the KV cache quantization" if report.kv_cache else ""
        exc.add_note(
            f"quantize_model put back the {len(report.replaced)} layer(s) it had already "
            f"replaced{f' ({names})' if names else ''}{kv}: the model is as it was before the "
            "call"
        )
        raise


def _kv_cache_only(
    model: nn.Module, kv: KVCacheOptions | None, method: str,
    calibration: Iterable[Any] | None, gptq: GPTQOptions | None, ignore: object,
) -> QuantizeReport:
    """``quantize_model(backend=None)``: the KV cache only, every Linear left as it is."""
    if kv is None:
        raise ValueError(
            "quantize_model(backend=None) quantizes only the KV cache and leaves every Linear "
            "layer as it is: pass kv_cache= (or a backend to quantize the Linear layers)"
        )
    if method != QuantMethod.RTN or any(v is not None for v in (calibration, gptq, ignore)):
        raise ValueError(
            "quantize_model(backend=None) quantizes no Linear layer: method=, calibration=, "
            "gptq= and ignore= do not apply; drop them or pass a backend"
        )
    return QuantizeReport(kv_cache=quantize_kv_cache(
        model, kv.kind, kv_scales=kv.scales, qk_rotation=kv.qk_rotation))
