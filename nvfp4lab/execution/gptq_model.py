"""GPTQ of whole models: each layer's Hessian collected from calibration passes through the
model as it is being quantized, stage by stage, and the per-weight algorithm of
:mod:`nvfp4lab.execution.gptq` run on it.

Whole models (:func:`sequential_gptq`, used by ``quantize_model(method="gptq")``) are quantized
SEQUENTIALLY, as llm-compressor does: each layer's Hessian is collected with forward pre-hooks
while the calibration batches run through the model whose earlier layers are already quantized
(and run on their backend), so a layer corrects for the errors it actually receives. Only the
Hessians of one stage (a fused group such as q/k/v, which shares its input, or a single layer)
are held at once. Padding tokens (``attention_mask == 0`` in a mapping batch, for inputs
``[B, T, K]``) are left out of the Hessian.

Where the layers sit in repeated blocks (a decoder's ``model.layers``, a BERT's
``encoder.layer``) the model does not run once per stage: :mod:`nvfp4lab.execution.sequential`
captures block 0's inputs once per batch and each stage runs only its own block (ended right
after the stage's last layer; layers already final answer from memory), each block once more to
feed the next. The bits are those of the whole-model passes (tests/execution/test_gptq.py
compares them on MiniLM and a Llama), four stages a block cost about two block passes instead of
four model passes. Layers outside the blocks, and models whose blocks are not a plain chain, run
the whole model per stage. Layers fed the very same input tensor (q/k/v, gate/up) share one
Hessian (the same additions in the same order), and a fused group that also shares its global
scale runs as ONE weight stacked along N (GPTQ treats each row on its own): the same codes in one
column loop.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from nvfp4lab.constants import BLOCK_SIZE
from nvfp4lab.execution.calibrate import run_batch
from nvfp4lab.execution.gptq import (
    WORK_DTYPE,
    GPTQFallbackWarning,
    GPTQOptions,
    GPTQResult,
    Hessian,
    as_rotated,
    check_pair,
    gptq_nvfp4,
    rotated_hessian,
)
from nvfp4lab.execution.gptq_hessian import all_finite
from nvfp4lab.execution.sequential import BlockRunner, Blocks, capture_block_inputs, find_blocks
from nvfp4lab.hadamard import check_seed, hadamard_transform
from nvfp4lab.tensor import NVFP4Tensor
from nvfp4lab.vocab import OrderName

__all__ = ["collect_hessians", "sequential_gptq"]


def _token_mask(batch: Any, x: torch.Tensor) -> torch.Tensor | None:
    """The batch's ``attention_mask != 0`` when it lines up with ``x [B, T, K]``, else None."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if isinstance(mask, torch.Tensor) and x.ndim == 3 and tuple(mask.shape) == x.shape[:2]:
        return mask.to(x.device) != 0
    return None


def _accumulate(
    hessians: dict[str, Hessian], seen: Mapping[str, list[torch.Tensor]], batch: Any,
    mask_padding: bool,
) -> None:
    """Add one forward pass's inputs (``seen``: name -> the tensors the module received, in call
    order) to ``hessians`` (name -> Hessian, one object possibly shared by several names).

    Names that share a Hessian object and received the very same tensor objects keep sharing it
    (one set of additions serves all: exactly what separate Hessians would hold, as each would
    get the same additions in the same order); a name whose inputs differ from its sharers'
    gets a copy of the state before this pass. ``seen`` holds the tensors, so their ids are
    unique here."""
    signature = {name: tuple(map(id, xs)) for name, xs in seen.items()}
    groups: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for name in (*hessians, *(n for n in seen if n not in hessians)):
        owner = id(hessians[name]) if name in hessians else 0
        groups.setdefault((owner, signature.get(name, ())), []).append(name)
    kept: set[int] = set()
    plan: list[tuple[list[str], Hessian | None]] = []
    for (owner, _), names in groups.items():
        hessian = hessians.get(names[0]) if owner else None
        if hessian is not None:
            if id(hessian) in kept:
                hessian = hessian.clone()  # before any addition of this pass
            kept.add(owner)
        plan.append((names, hessian))
    for names, hessian in plan:
        xs = seen.get(names[0], [])
        for x in xs:
            if hessian is None:
                hessian = Hessian(x.shape[-1], x.device)
            hessian.add(x, _token_mask(batch, x) if mask_padding else None)
        if hessian is not None:
            for name in names:
                hessians[name] = hessian


def _hessians(
    modules: Mapping[str, nn.Module],
    passes: Iterable[tuple[Any, Callable[[], bool]]],
    mask_padding: bool,
) -> dict[str, Hessian]:
    """One :class:`Hessian` per module of ``modules`` (name -> module, called as
    ``module(x [..., K])``) from forward pre-hooks while each ``run()`` of ``passes``
    (``(batch, run)``, the batch giving the padding mask; ``run()`` returns False to have its
    pass dropped and run again) executes. Modules fed the same
    tensors in every pass (q/k/v, gate/up) share one Hessian object (:func:`_accumulate`).
    The hooks are registered before ``passes`` is first iterated (a generator that adds its own
    pre-hooks to these modules when it starts gets them called after these)."""
    seen: dict[str, list[torch.Tensor]] = {}

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.numel():
                seen.setdefault(name, []).append(x)  # the object itself: its id is compared

        return hook

    hessians: dict[str, Hessian] = {}
    handles = [m.register_forward_pre_hook(hook_for(n)) for n, m in modules.items()]
    try:
        for batch, run in passes:
            seen.clear()
            while not run():  # the pass asks to be repeated: drop what it recorded
                seen.clear()
            _accumulate(hessians, seen, batch, mask_padding)
    finally:
        seen.clear()
        for handle in handles:
            handle.remove()
    return hessians


def _model_passes(
    model: nn.Module, batches: Sequence[Any]
) -> Iterator[tuple[Any, Callable[[], bool]]]:
    """``(batch, run)``: each batch through the whole model (no grad)."""
    for batch in batches:
        def run(batch: Any = batch) -> bool:
            with torch.no_grad():
                run_batch(model, batch)
            return True

        yield batch, run


@torch.no_grad()
def collect_hessians(
    model: nn.Module, names: Sequence[str], batches: Sequence[Any], *, mask_padding: bool = True
) -> dict[str, Hessian]:
    """One :class:`Hessian` per module in ``names`` (each called as ``module(x [..., K])``),
    from forward pre-hooks while ``batches`` run through ``model`` (padding tokens left out
    when ``mask_padding``). Modules fed the same tensors (q/k/v) may share one Hessian object:
    treat the values as read-only."""
    modules = {n: model.get_submodule(n) for n in names}
    return _hessians(modules, _model_passes(model, batches), mask_padding)


def _stages(names: Sequence[str], groups: Sequence[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Layers in module order; a fused group (same input) is one stage at its first member."""
    group_of = {m: g for g in groups for m in g}
    stages: list[tuple[str, ...]] = []
    for name in names:
        stage = group_of.get(name, (name,))
        if stage not in stages:
            stages.append(stage)
    return stages


def _split(result: GPTQResult, rows: Sequence[int]) -> list[GPTQResult]:
    """The results of layers stacked along N (``rows``: each layer's N), cut back apart."""
    weight = result.weight
    assert weight is not None
    out, start = [], 0
    for n in rows:
        part = slice(start, start + n)
        start += n
        tensor = NVFP4Tensor(
            weight.packed[part].clone(), weight.scales[part].clone(), weight.global_scale,
            shape=torch.Size((n, weight.shape[1])), dtype=weight.dtype, check_scales=False,
            decode_scale=weight.decode_scale,
        )
        out.append(GPTQResult(tensor, result.dequantized[part].clone(), result.dead_columns,
                              result.fallback, result.reason))
    return out


def _quantize_stage(
    stage: Sequence[str],
    hessians: Mapping[str, Hessian],
    layers: Mapping[str, nn.Linear],
    global_scales: Mapping[str, torch.Tensor],
    convention: str,
    options: GPTQOptions,
    hadamard: int | None = None,
) -> list[tuple[str, GPTQResult]]:
    """GPTQ of the layers of one stage, in order, from their Hessians (``hadamard``: each
    weight rotated on its own, the shared Hessian once, as :func:`gptq_quantize` does).

    Layers that share one Hessian object AND one global-scale tensor (a fused group: q/k/v,
    gate/up) are quantized as one weight stacked along N: GPTQ treats every row of W on its own
    (each row's errors only move that row's later columns), so the stack gives each layer's
    codes and scales unchanged, in one column loop instead of one per layer."""
    matrices: dict[str, torch.Tensor | None] = {}
    by_hessian: dict[int, torch.Tensor] = {}
    for name in stage:
        weight = layers[name].weight.detach()
        hessian = hessians.get(name)
        if hessian is None:
            warnings.warn(
                f"GPTQ: no calibration input reached layer {name!r}; it is rounded with RTN",
                GPTQFallbackWarning,
                stacklevel=3,
            )
            matrices[name] = None
            continue
        h = by_hessian.get(id(hessian))
        if h is None:
            h = by_hessian[id(hessian)] = hessian.take_matrix()  # ours: collected here
        if not all_finite(h):
            raise ValueError(
                f"GPTQ: the Hessian of layer {name!r} holds NaN/Inf: its calibration inputs "
                f"overflow or hold NaN (layer weight dtype {weight.dtype}; an fp16 model "
                "overflows easily: calibrate it in bfloat16 or float32) or the calibration "
                "batches hold NaN/Inf"
            )
        matrices[name] = h
    runs: dict[tuple[Any, ...], list[str]] = {}
    for name in stage:
        weight, h, gs = layers[name].weight, matrices[name], global_scales.get(name)
        key: tuple[Any, ...] = (name,)
        if h is not None and gs is not None:
            key = (id(h), id(gs), weight.dtype, weight.device, weight.shape[1])
        runs.setdefault(key, []).append(name)
    results: dict[str, GPTQResult] = {}
    rotated: dict[int, torch.Tensor] = {}
    # Each matrix is handed to GPTQ, which overwrites it, at its last use: no K×K copy.
    uses = Counter(id(matrices[names[0]]) for names in runs.values())
    for names in runs.values():
        weights = [layers[n].weight.detach() for n in names]
        h = matrices[names[0]]
        uses[id(h)] -= 1
        last = uses[id(h)] == 0
        if h is None:
            h = torch.eye(weights[0].shape[1], dtype=WORK_DTYPE, device=weights[0].device)
        if hadamard is not None:
            check_seed(hadamard)
            check_pair(weights[0], h, BLOCK_SIZE)
            weights = [hadamard_transform(w, hadamard) for w in weights]
            if id(h) not in rotated:
                rotated[id(h)] = rotated_hessian(h, hadamard)
            h = rotated.pop(id(h)) if last else rotated[id(h)]
        stacked = weights[0] if len(weights) == 1 else torch.cat(weights)
        result = gptq_nvfp4(stacked, h, global_scales.get(names[0]), convention, options,
                            owned=last)
        parts = [result] if len(names) == 1 else _split(result, [w.shape[0] for w in weights])
        if hadamard is not None:
            parts = [as_rotated(part, hadamard) for part in parts]
        results.update(zip(names, parts, strict=True))
    out = []
    for name in stage:
        result = results[name]
        if matrices[name] is None:
            result.fallback, result.reason = True, "no calibration input reached the layer"
        elif result.fallback:
            warnings.warn(
                f"GPTQ: layer {name!r} is rounded with RTN: {result.reason}",
                GPTQFallbackWarning,
                stacklevel=3,
            )
        out.append((name, result))
    return out


@dataclass
class _Plan:
    """Where each stage runs: ``before`` / ``after`` the blocks (whole-model passes) or in a
    block (``inside[i]``: the stages of block i, in order)."""

    blocks: Blocks
    before: list[tuple[str, ...]]
    inside: list[list[tuple[str, ...]]]
    after: list[tuple[str, ...]]


def _plan(model: nn.Module, stages: Sequence[tuple[str, ...]]) -> _Plan | None:
    """The block plan, or None (no blocks; a stage spread over several blocks, or over a block
    and the rest of the model; a stage outside the blocks between two inside)."""
    blocks = find_blocks(model, [n for stage in stages for n in stage])
    if blocks is None:
        return None
    plan = _Plan(blocks, [], [[] for _ in blocks.modules], [])
    for stage in stages:
        where = {blocks.index(n) for n in stage}
        if len(where) != 1:
            return None
        (index,) = where
        if index is not None:
            if plan.after:
                return None
            plan.inside[index].append(stage)
        elif any(plan.inside):
            plan.after.append(stage)
        else:
            plan.before.append(stage)
    return plan


def _release_caches(modules: Iterable[nn.Module]) -> None:
    """Free what finished layers cache for repeated runs (``clear_dequantized_cache``)."""
    for module in modules:
        clear = getattr(module, "clear_dequantized_cache", None)
        if callable(clear):
            clear()


def sequential_gptq(
    model: nn.Module,
    layers: Mapping[str, nn.Linear],
    batches: Sequence[Any],
    *,
    groups: Sequence[tuple[str, ...]] = (),
    global_scales: Mapping[str, torch.Tensor] | None = None,
    convention: str = OrderName.VLLM_KERNEL,
    options: GPTQOptions | None = None,
    hadamard: int | None = None,
) -> Iterator[tuple[str, GPTQResult]]:
    """Yield ``(name, GPTQResult)`` for each Linear of ``layers`` (in their order), stage by stage.

    The caller must put each yielded layer into ``model`` before asking for the next one: the
    next stage's Hessians are collected by running ``batches`` through ``model`` as it is then.
    ``groups``: fused groups (one stage each); ``global_scales``: name -> shared ENCODE scale
    (of the rotated weights with ``hadamard``). ``hadamard=seed``: MR-GPTQ, each layer as
    :func:`gptq_quantize` with ``hadamard`` (the caller installs layers that rotate their
    inputs). A layer no batch reaches is rounded with RTN (:class:`GPTQFallbackWarning`).

    Where the layers live in repeated blocks (:mod:`nvfp4lab.execution.sequential`), each stage
    runs only its block over the block's captured inputs, and each block once more, quantized,
    to give the next block its inputs; stages outside the blocks, and models whose blocks do not
    form a chain, run the whole model per stage. Both give the same bits (the block inputs ARE
    what the whole model feeds the block). Memory: the hidden states of every batch at one
    block (twice while a block's outputs are built) and, per layer already quantized in the
    current block, its inputs and outputs for every batch.
    """
    options = options or GPTQOptions()
    global_scales = global_scales or {}
    stages = _stages(list(layers), groups)
    quantize = partial(_quantize_stage, layers=layers, global_scales=global_scales,
                       convention=convention, options=options, hadamard=hadamard)

    def whole_model(todo: Sequence[tuple[str, ...]]) -> Iterator[tuple[str, GPTQResult]]:
        for stage in todo:
            hessians = collect_hessians(model, stage, batches, mask_padding=options.mask_padding)
            yield from quantize(stage, hessians)

    plan = _plan(model, stages)
    if plan is None:
        yield from whole_model(stages)
        return
    yield from whole_model(plan.before)
    inside = {n: model.get_submodule(n) for stages_i in plan.inside for s in stages_i for n in s}
    orders: dict[int, list[str]] = {}
    with torch.no_grad():
        calls = capture_block_inputs(model, plan.blocks, batches, orders=orders, watched=inside)
    if calls is None:
        yield from whole_model([s for stages_i in plan.inside for s in stages_i] + plan.after)
        return
    last = max(i for i, stages_i in enumerate(plan.inside) if stages_i)
    for index, block in enumerate(plan.blocks.modules[: last + 1]):
        names = [n for stage in plan.inside[index] for n in stage]
        with BlockRunner(block, calls, {n: model.get_submodule(n) for n in names},
                         order=orders.get(index)) as runner:
            for stage in plan.inside[index]:
                modules = {n: model.get_submodule(n) for n in stage}
                hessians = _hessians(modules, runner.collect(stage), options.mask_padding)
                yield from quantize(stage, hessians)
                for name in stage:  # installed by the caller by now
                    runner.freeze(name, model.get_submodule(name))
            if index < last:
                calls = runner.outputs()
        _release_caches(model.get_submodule(n) for n in names)
    del calls
    yield from whole_model(plan.after)
