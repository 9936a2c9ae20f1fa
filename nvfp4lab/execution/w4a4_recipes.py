"""W4A4 recipes of ``quantize_model(w4a4=W4A4Options(...))``: online rotations, GPTQ on the
rotated, quantized activations, SmoothQuant / AWQ scale migration, and 4over6 block scales.

Each option works alone or with the others (:class:`W4A4Options`):

``rotation`` (QuaRot / FP-Quant style online rotation)
    Every replaced layer holds the NVFP4 weight of ``W Q`` and rotates its input at run time:
    ``y = q(x Q) · dequant(NVFP4(W Q))ᵀ + b`` (:class:`~nvfp4lab.execution.layers.NVFP4Linear`
    ``hadamard`` / ``hadamard_block``), ``Q = D · blockdiag(H_b, ...)`` with ``D`` seeded ±1
    signs (``seed``) and ``H_b`` the orthonormal Hadamard matrix of the block ``b``: 16, 32, 64,
    128 (Sylvester; where the block does not divide K, the largest power of two dividing both),
    any divisor of K that is a power of two times a Paley order, or ``"full"``
    (``b = K``; SmolLM2's 576 = 36·16 and 1536 = 12·128), :func:`nvfp4lab.hadamard.rotate`.
``method="gptq"`` with W4A4 options
    GPTQ of ``W Q`` against the Hessian of the inputs as the quantized layer sees them:
    ``H = Σ q(x Q) q(x Q)ᵀ`` (``q``: the activation quantizer, dynamic per call as the layer
    runs; none for ``backend="w4a16"``), collected layer by layer through the model whose earlier
    layers are already quantized (:func:`~nvfp4lab.execution.gptq_model.sequential_gptq` on
    plain Linears holding ``W Q``, each fed ``q(x Q)`` by a forward pre-hook).
``smooth_alpha`` / ``awq`` (:mod:`nvfp4lab.execution.w4a4_smooth`)
    Per-input-channel scales ``s`` folded into the float model before quantization (SmoothQuant
    strength ``alpha``, or AWQ's per-group grid search over ``alpha``): only stored weights
    change, so the result loads wherever the unsmoothed one would.
``weight_scales`` / ``input_scales`` = ``"four_over_six"``
    Block scales chosen by Four Over Six (max → 6 or max → 4, the lower block error; tensor scale
    numerator 1536). A 4over6 weight is an ordinary NVFP4 weight (every engine runs it); 4over6
    activations need an engine that quantizes them so (:class:`W4A4Linear`, the emulation only).

Where an engine stands: weights and folded scales change only stored tensors; an online rotation
needs the engine to rotate activations (compressed-tensors ``transform_config`` input
transforms, which vLLM 0.33 applies: another part of issue 35 writes them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nvfp4lab.codec import compute_global_scale, fake_quantize, quantize
from nvfp4lab.constants import BLOCK_SIZE, GLOBAL_SCALE_NUMERATOR
from nvfp4lab.execution.gemm import linear
from nvfp4lab.execution.gptq import GPTQOptions
from nvfp4lab.execution.gptq_model import sequential_gptq
from nvfp4lab.execution.layers import BlockRotatedNVFP4Tensor, NVFP4Linear
from nvfp4lab.hadamard import check_seed, rotate, rotation_blocks
from nvfp4lab.options import FOUR_OVER_SIX_SCALE_MAX
from nvfp4lab.orders import ArithmeticOrder
from nvfp4lab.tensor import NVFP4Tensor
from nvfp4lab.vocab import Backend, OrderName, QuantMethod, ScaleSelection

__all__ = [
    "FULL",
    "W4A4Linear",
    "W4A4Options",
    "activation_quantizer",
    "global_scale_numerator",
    "w4a4_layers",
]

#: ``W4A4Options(rotation=FULL)``: one rotation of the whole K.
FULL = "full"
_SELECTIONS = (ScaleSelection.AMAX, ScaleSelection.FOUR_OVER_SIX)
#: AWQ's default grid of SmoothQuant strengths.
AWQ_GRID: tuple[float, ...] = tuple(i / 10 for i in range(11))


@dataclass(frozen=True)
class W4A4Options:
    """The W4A4 recipes of :func:`~nvfp4lab.execution.quantize_model` (module docstring).

    ``rotation``: None, a block size (int) or ``"full"``; ``seed``: its random signs.
    ``smooth_alpha``: SmoothQuant strength in [0, 1] (None: no migration); ``awq``: search the
    strength per layer group over ``awq_grid`` on ``awq_tokens`` calibration tokens (the group's
    output error), exclusive with ``smooth_alpha``. ``weight_scales`` / ``input_scales``:
    ``"amax"`` or ``"four_over_six"``. Smoothing and AWQ need ``calibration=``.
    """

    rotation: int | str | None = None
    seed: int = 0
    smooth_alpha: float | None = None
    awq: bool = False
    awq_grid: tuple[float, ...] = AWQ_GRID
    awq_tokens: int = 512
    weight_scales: str = ScaleSelection.AMAX
    input_scales: str = ScaleSelection.AMAX

    def __post_init__(self) -> None:
        rot = self.rotation
        if rot is not None and rot != FULL and (
                isinstance(rot, bool) or not isinstance(rot, int) or rot < 1):
            raise ValueError(f"W4A4Options rotation must be None, a block size (16, 32, 64, 128) "
                             f"or 'full', got {rot!r}")
        check_seed(self.seed, "W4A4Options seed")
        alpha = self.smooth_alpha
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, int | float)
                                  or not 0.0 <= alpha <= 1.0):
            raise ValueError(f"W4A4Options smooth_alpha must be a number in [0, 1] (e.g. 0.5) or "
                             f"None, got {alpha!r}")
        if not isinstance(self.awq, bool):
            raise ValueError(f"W4A4Options awq must be True or False, got {self.awq!r}")
        if self.awq and alpha is not None:
            raise ValueError("W4A4Options: awq=True searches the strength itself; drop "
                             "smooth_alpha (or set awq=False to use that one strength)")
        grid = tuple(self.awq_grid)
        if not grid or any(isinstance(a, bool) or not isinstance(a, int | float)
                           or not 0.0 <= a <= 1.0 for a in grid):
            raise ValueError(f"W4A4Options awq_grid must be strengths in [0, 1], got {grid!r}")
        object.__setattr__(self, "awq_grid", grid)
        tokens = self.awq_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"W4A4Options awq_tokens must be a positive int, got {tokens!r}")
        for name in ("weight_scales", "input_scales"):
            if getattr(self, name) not in _SELECTIONS:
                raise ValueError(f"W4A4Options {name} must be 'amax' or 'four_over_six', got "
                                 f"{getattr(self, name)!r}")

    @property
    def block(self) -> int | None:
        """The rotation block asked for (None: full size)."""
        return None if self.rotation == FULL else self.rotation  # type: ignore[return-value]

    def block_for(self, k: int) -> int | None:
        """The block of a layer with ``K = k``: ``block`` where it divides K, else the largest
        power of two dividing both (SmolLM2's K = 576 takes 64 for ``rotation=128``); None for
        a full-size rotation. ValueError when that is not a multiple of 16 or has no Hadamard
        matrix."""
        block = self.block
        if block is not None and k % block:
            block = math.gcd(block, k & -k)
            if block % BLOCK_SIZE:
                raise ValueError(f"rotation block {self.rotation} shares only {block} with K={k}, "
                                 f"less than an NVFP4 block of {BLOCK_SIZE}")
        rotation_blocks(k, block)
        return block

    @property
    def smooths(self) -> bool:
        return self.smooth_alpha is not None or self.awq

    @property
    def needs_calibration(self) -> bool:
        """SmoothQuant and AWQ read activation statistics from the calibration batches."""
        return self.smooths

    def label(self) -> str:
        """A short description, e.g. ``"rotation 64, AWQ, 4over6 weights"``."""
        parts = []
        if self.rotation is not None:
            parts.append(f"rotation {self.rotation}")
        if self.smooth_alpha is not None:
            parts.append(f"SmoothQuant {self.smooth_alpha:g}")
        if self.awq:
            parts.append("AWQ")
        for what, sel in (("weights", self.weight_scales), ("inputs", self.input_scales)):
            if sel != ScaleSelection.AMAX:
                parts.append(f"4over6 {what}")
        return ", ".join(parts) or "plain"

    def check_call(self, candidates: Mapping[str, nn.Linear], method: str, backend: str) -> None:
        """ValueError for a ``quantize_model`` call these options do not fit: GPTQ with 4over6
        weights, the ``q8_0`` backend, a layer whose K the rotation does not fit."""
        if method != QuantMethod.RTN and self.weight_scales != ScaleSelection.AMAX:
            raise ValueError("W4A4Options(weight_scales='four_over_six') works with method='rtn' "
                             "only (GPTQ rounds with amax block scales); drop one of them")
        if backend == Backend.Q8_0:
            raise ValueError("W4A4Options needs an NVFP4 activation path (backend 'emulation', "
                             "'native', 'auto' or 'w4a16'), not 'q8_0'")
        if self.rotation is None:
            return
        for name, module in candidates.items():
            try:
                self.block_for(module.in_features)
            except ValueError as err:
                raise ValueError(f"W4A4Options(rotation={self.rotation!r}) cannot rotate layer "
                                 f"{name!r} (K={module.in_features}): {err}") from None


def global_scale_numerator(selection: str) -> float:
    """2688 (= 448·6) for amax block scales, 1536 (= 256·6) for Four Over Six."""
    return GLOBAL_SCALE_NUMERATOR if selection == ScaleSelection.AMAX else (
        FOUR_OVER_SIX_SCALE_MAX * 6.0)


def _selection(selection: str) -> dict[str, str]:
    return {} if selection == ScaleSelection.AMAX else {"scale_selection": selection}


def activation_quantizer(options: W4A4Options, order: str | ArithmeticOrder = OrderName.VLLM_KERNEL
                         ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> q(x)``: NVFP4 fake quantization of an activation with a dynamic tensor scale (of
    this ``x``) and the options' block-scale selection, in ``x.dtype``."""
    extra = _selection(options.input_scales)
    numerator = global_scale_numerator(options.input_scales)

    def q(x: torch.Tensor) -> torch.Tensor:
        gs = compute_global_scale(x, order=order, numerator=numerator)
        return fake_quantize(x, gs, order=order, **extra)

    return q


class W4A4Linear(NVFP4Linear):
    """An :class:`NVFP4Linear` whose activations take Four Over Six block scales
    (``input_scales="four_over_six"``): on the emulation path ``y = q46(x Q) · dequant(W)ᵀ + b``
    (tensor scale ``1536/amax`` of this call, or the layer's ``input_global_scale``); other
    backends as NVFP4Linear. No engine quantizes activations so: an emulation study only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = self._resolve_backend(x)
        if backend != Backend.EMULATION:
            return super().forward(x)
        xr = self.rotate_input(x)
        gs = self.input_global_scale
        if gs is None:
            gs = compute_global_scale(xr, order=OrderName.VLLM_KERNEL,
                                      numerator=global_scale_numerator(
                                          ScaleSelection.FOUR_OVER_SIX))
        x_dq = fake_quantize(xr, gs, order=OrderName.VLLM_KERNEL,
                             scale_selection=ScaleSelection.FOUR_OVER_SIX)
        return linear(x_dq, self._gemm_weight(), self.bias, backend=Backend.W4A16,
                      bias_mode=self.bias_mode, dequantized_weight=self._cached_weight(x.dtype))


# --------------------------------------------------------------------------------------------
# rotated weights, shared scales, layers
# --------------------------------------------------------------------------------------------


def rotated_weight(module: nn.Linear, options: W4A4Options) -> torch.Tensor:
    """``W Q`` ``[N, K]`` in the weight's dtype (float32 arithmetic), or ``W`` unrotated."""
    w = module.weight.detach()
    if options.rotation is None:
        return w
    return rotate(w, options.seed, block=options.block_for(w.shape[1]))


def shared_scales(weights: Mapping[str, torch.Tensor], groups: Sequence[tuple[str, ...]],
                  order: str | ArithmeticOrder, options: W4A4Options) -> dict[str, torch.Tensor]:
    """Each layer's weight global scale: ``numerator / amax`` of its (rotated) weight, the
    group's minimum for fused groups (one scale per fused GEMM, as vLLM loads it)."""
    numerator = global_scale_numerator(options.weight_scales)
    scales = {n: compute_global_scale(w, order=order, numerator=numerator)
              for n, w in weights.items()}
    for group in groups:
        gs = torch.stack([scales[m] for m in group]).min(dim=0).values
        scales.update(dict.fromkeys(group, gs))
    return scales


def _layer(weight: NVFP4Tensor, bias: torch.Tensor | None, options: W4A4Options,
           layer_options: Mapping[str, Any]) -> NVFP4Linear:
    """The installed layer: rotated when the options rotate, a :class:`W4A4Linear` for 4over6
    activations."""
    if options.rotation is not None:
        weight = BlockRotatedNVFP4Tensor(**vars(weight), hadamard=options.seed,
                                         rotation_block=options.block_for(weight.shape[1]))
    cls = W4A4Linear if options.input_scales != ScaleSelection.AMAX else NVFP4Linear
    return cls.from_quantized(weight, None if bias is None else bias.detach(), **layer_options)


def _method(options: W4A4Options, gptq: bool) -> str:
    base = QuantMethod.GPTQ if gptq else QuantMethod.RTN
    return f"{base} (w4a4: {options.label()})"


def _rtn(candidates: Mapping[str, nn.Linear], weights: Mapping[str, torch.Tensor],
         scales: Mapping[str, torch.Tensor], order: str | ArithmeticOrder, options: W4A4Options,
         layer_options: Mapping[str, Any]) -> Iterator[tuple[str, NVFP4Linear, str]]:
    extra = _selection(options.weight_scales)
    for name, module in candidates.items():
        q = quantize(weights[name], scales[name], order=order, **extra)
        yield name, _layer(q, module.bias, options, layer_options), _method(options, False)


class _InputTransform:
    """Forward pre-hook ``x -> q(x Q)`` on the rotated float Linears while GPTQ collects their
    Hessians; consecutive calls with the very same ``x`` (q/k/v, gate/up) get the very same
    result tensor, so their Hessians stay shared."""

    def __init__(self, options: W4A4Options, quantize_inputs: bool,
                 order: str | ArithmeticOrder) -> None:
        self.options = options
        self.q = activation_quantizer(options, order) if quantize_inputs else None
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not x.numel():
            return None
        if self.last is not None and self.last[0] is x:
            return (self.last[1], *args[1:])
        out = x if self.options.rotation is None else rotate(
            x, self.options.seed, block=self.options.block_for(x.shape[-1]))
        if self.q is not None:
            out = self.q(out)
        self.last = (x, out)
        return (out, *args[1:])


def _gptq(model: nn.Module, candidates: Mapping[str, nn.Linear],
          weights: Mapping[str, torch.Tensor], scales: Mapping[str, torch.Tensor],
          groups: Sequence[tuple[str, ...]], batches: Sequence[Any],
          order: str | ArithmeticOrder, gptq: GPTQOptions | None, options: W4A4Options,
          layer_options: Mapping[str, Any]) -> Iterator[tuple[str, NVFP4Linear, str]]:
    """Sequential GPTQ of the rotated weights on the rotated, quantized inputs: each candidate
    is swapped for a plain Linear holding ``W Q`` behind an :class:`_InputTransform` pre-hook
    (until the caller installs its quantized layer), and GPTQ runs unrotated on those."""
    transform = _InputTransform(options, layer_options["backend"] != Backend.W4A16, order)
    rotated: dict[str, nn.Linear] = {}
    for name, module in candidates.items():
        lin = nn.Linear(module.in_features, module.out_features, module.bias is not None,
                        device=module.weight.device, dtype=module.weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(weights[name])
            if module.bias is not None:
                lin.bias.copy_(module.bias.detach())
        lin.register_forward_pre_hook(transform)
        rotated[name] = lin
    parents = {}
    for name, lin in rotated.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        parents[name] = (parent, child)
        setattr(parent, child, lin)
    results = sequential_gptq(model, rotated, batches, groups=groups, global_scales=scales,
                              convention=order, options=gptq)  # type: ignore[arg-type]
    installed: list[NVFP4Linear] = []
    run_options = {**layer_options, "cache_dequantized": True}  # later stages rerun it
    try:
        for name, result in results:
            assert result.weight is not None
            layer = _layer(result.weight, candidates[name].bias, options, run_options)
            how = (f"rtn (gptq fallback: {result.reason})" if result.fallback
                   else _method(options, True))
            yield name, layer, how
            installed.append(layer)
    finally:
        results.close()
        transform.last = None
        for name, (parent, child) in parents.items():  # any rotated Linear left: the original
            if getattr(parent, child) is rotated[name]:
                setattr(parent, child, candidates[name])
    for layer in installed:
        layer.cache_dequantized = bool(layer_options.get("cache_dequantized", False))
        layer.clear_dequantized_cache()


def w4a4_layers(model: nn.Module, candidates: Mapping[str, nn.Linear],
                groups: Sequence[tuple[str, ...]], batches: Sequence[Any],
                order: str | ArithmeticOrder, method: str, gptq: GPTQOptions | None,
                options: W4A4Options, layer_options: Mapping[str, Any]
                ) -> Iterator[tuple[str, NVFP4Linear, str]]:
    """``(name, layer, method)`` per candidate, for :func:`quantize_model`'s installer: RTN or
    GPTQ (``method``) of the (rotated) weights with the options' block scales; fused
    ``groups`` share one weight global scale. ``layer_options``: NVFP4Linear's ``backend``,
    ``cache_dequantized``, ``bias_mode``. The model must already be smoothed (if asked)."""
    weights = {n: rotated_weight(m, options) for n, m in candidates.items()}
    scales = shared_scales(weights, groups, order, options)
    if method == QuantMethod.GPTQ:
        return _gptq(model, candidates, weights, scales, groups, batches, order, gptq, options,
                     layer_options)
    return _rtn(candidates, weights, scales, order, options, layer_options)
