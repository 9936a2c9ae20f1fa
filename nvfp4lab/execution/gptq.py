"""GPTQ for NVFP4 (and the other scaled block formats): rounding errors fed forward, column by
column, through the curvature of the layer's calibration inputs.

A Linear layer ``y = x Wᵀ`` with weight ``W [N, K]`` is quantized to minimise
``‖X Wᵀ − X Ŵᵀ‖²`` over its calibration inputs ``X [tokens, K]``, i.e. ``tr(ΔW H ΔWᵀ)`` with the
Hessian ``H = (2/n) Σ x xᵀ`` (float64 ``[K, K]``; the factor does not change the result). The
columns are quantized in order; after column ``i`` its error ``e = (w_i − q_i) / U[i, i]`` is
subtracted, weighted by row ``i`` of ``U``, from every column not yet quantized, where ``U`` is
the upper Cholesky factor of ``(H + λI)⁻¹``. That is the algorithm of Frantar et al. (GPTQ,
arXiv 2210.17323) as llm-compressor and GPTQModel run it; this module is written from that
description (no code copied), with these choices:

==================  ==========================================================================
step                what this module does
==================  ==========================================================================
damping             ``λ = damp · mean(diag H)``, ``damp = 0.01`` (llm-compressor's default;
                    GPTQModel 7.7 uses 0.05). With few calibration tokens per input width
                    GPTQ over-fits: on MiniLM (894 tokens, K = 384/1536) one layer ends worse
                    than RTN held out at 0.01 and none at 0.1 (``studies.model_gptq``)
dead columns        inputs that are always zero (``H[j, j] == 0``): ``H[j, j] = 1`` and column
                    ``j`` of W is zeroed BEFORE the block scales are chosen, so an input that
                    never fires does not widen its group's scale
lazy batches        columns in blocks of ``block_size`` (128): a column's error is applied at
                    once inside its 16-column step, to the rest of the block after each step
                    and to the later columns in one matrix product per block; equal to the
                    column-by-column algorithm up to float64 summation order
act order           ``act_order=True``: columns processed by descending ``diag H`` (stable
                    sort) with STATIC groups: every group keeps its 16 contiguous original
                    columns and its scale, only the processing order changes, so the result
                    is plain NVFP4 (llm-compressor's default "static" act-order)
block scales        ``scales="original"`` (default): every group's E4M3 scale is fixed up front
                    from the original weights, exactly what :func:`nvfp4lab.quantize` would
                    choose (llm-compressor ≥ 0.4); ``"updated"``: a group's scale is chosen
                    when its first column is reached, from the error-updated weights (all
                    earlier feedback included; llm-compressor < 0.4 and GPTQModel without
                    static groups, which read the block-start state instead). Not combinable
                    with act order (a group's columns are then scattered over the order).
global scale        ``2688 / amax`` of the ORIGINAL weights (or the fused group's shared one,
                    as :func:`~nvfp4lab.execution.whole_model.quantize_model` shares it), never
                    changed by GPTQ
Cholesky failure    (a singular ``H`` with ``damp = 0``): the layer falls back to RTN with a
                    :class:`GPTQFallbackWarning`, as llm-compressor does
all-zero Hessian    (every input zero: zero trace, every column dead): RTN with a
                    :class:`GPTQFallbackWarning` and the reason in the result, instead of
                    the zero weight the dead-column rule would give
precision           H, W and the factors in float64; each column is rounded with the codec's
                    block functions (:mod:`nvfp4lab.blocks`) in the chosen arithmetic
                    order
==================  ==========================================================================

With ``H = I`` no error is fed forward and GPTQ is exactly RTN (the tests check bit equality with
:func:`nvfp4lab.quantize`). The codes and E4M3 scales are what :func:`nvfp4lab.quantize` stores
for the same scales, so the result is an ordinary :class:`~nvfp4lab.execution.layers.NVFP4Linear`
that saves into compressed-tensors checkpoints.

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

MR-GPTQ (``quantize_model(method="mr-gptq")``, :func:`gptq_quantize` ``hadamard=seed``): GPTQ of
``W Q`` with ``Qᵀ H Q``, Q the seeded 16-point block Hadamard of :mod:`nvfp4lab.hadamard`
(arXiv 2509.23202 style: the rotation block matches the NVFP4 group); the layer
(:class:`~nvfp4lab.execution.layers.NVFP4Linear` ``hadamard=seed``) rotates its inputs at run
time. With ``H = I`` it is RTN of ``W Q`` (:func:`nvfp4lab.quantize` with ``hadamard``).

Sources read for the facts (no code taken): llm-compressor 0.14 (scales up front since 0.4,
damp 0.01, static act order, fp32 Hessian, global scale from the original weights shared across
fused layers, RTN fallback on a failed Cholesky), GPTQModel 7.7 (damp 0.05, a group's scale at
its first column from the block-start weights unless ``static_groups``), FP-Quant / MR-GPTQ
(block Hadamard matched to the format's group, scales fixed up front). This module accumulates
H in float64 instead of float32.

Study-only: :func:`gptq_fake_quantize` runs the same loop for MXFP4 and INT4-g128 (any
:class:`~nvfp4lab.formats.base.BlockFormatInfo`) and, with ``hadamard=seed``, on weights rotated
by the block Hadamard whose block matches the format's group (MR-GPTQ style, arXiv 2509.23202:
``W' = W Q``, ``H' = Qᵀ H Q``); it returns the dequantized weight rotated back (the weight
rotated in float32 here; the layer path rotates in the weight's dtype, as the codec does).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn

from nvfp4lab import formats
from nvfp4lab.blocks import block_scales_of, fixed_scale_codec, multiply_factors
from nvfp4lab.codec import finite_amax
from nvfp4lab.constants import BLOCK_SIZE
from nvfp4lab.e2m1 import pack_fp4
from nvfp4lab.execution.calibrate import calibration_batches, run_batch
from nvfp4lab.execution.sequential import BlockRunner, Blocks, capture_block_inputs, find_blocks
from nvfp4lab.formats.base import BlockFormat, BlockFormatInfo
from nvfp4lab.hadamard import check_seed, hadamard_transform, rotation_matrix
from nvfp4lab.kernels import native as native_lib
from nvfp4lab.kernels.gptq_columns import run_group
from nvfp4lab.orders import ArithmeticOrder
from nvfp4lab.orders import get as get_order
from nvfp4lab.scales import TensorScale, abs_max, as_global_scale, tensor_scale_from_amax
from nvfp4lab.tensor import NVFP4Tensor, RotatedNVFP4Tensor
from nvfp4lab.vocab import Convention, NonFinite, ScaleTiming, check_choice, check_dtype

__all__ = [
    "GPTQFallbackWarning",
    "GPTQOptions",
    "GPTQResult",
    "Hessian",
    "calibration_batches",
    "collect_hessians",
    "gptq_fake_quantize",
    "gptq_quantize",
    "run_batch",
    "sequential_gptq",
]

_WORK = torch.float64  # dtype of H, W and the Cholesky factors


class GPTQFallbackWarning(UserWarning):
    """A layer was quantized with RTN instead (no calibration input, an all-zero Hessian, or a
    singular one)."""


@dataclass(frozen=True)
class GPTQOptions:
    """GPTQ settings (see the module docstring for each).

    ``damp``: relative dampening ``λ = damp · mean(diag H)``, finite and ≥ 0. ``block_size``:
    columns per lazy batch, a positive multiple of the group size (16). ``act_order``: process
    columns by descending ``diag H`` (static groups). ``scales``: "original" | "updated".
    ``mask_padding``: leave ``attention_mask == 0`` tokens out of the Hessian.
    """

    damp: float = 0.01
    block_size: int = 128
    act_order: bool = False
    scales: str = ScaleTiming.ORIGINAL
    mask_padding: bool = True

    def __post_init__(self) -> None:
        damp = self.damp
        if isinstance(damp, bool) or not isinstance(damp, int | float) or not 0 <= damp < 1e6:
            raise ValueError(f"GPTQ damp must be a finite number >= 0 (e.g. 0.01), got {damp!r}")
        size = self.block_size
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or size % BLOCK_SIZE:
            raise ValueError(
                f"GPTQ block_size must be a positive multiple of {BLOCK_SIZE} (e.g. 128), "
                f"got {size!r}"
            )
        for name in ("act_order", "mask_padding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTQ {name} must be True or False, got {getattr(self, name)!r}")
        timing = check_choice("GPTQ scales", self.scales, ScaleTiming)
        if self.act_order and timing == ScaleTiming.UPDATED:
            raise ValueError(
                "GPTQ act_order=True needs scales='original': with act order a group's columns "
                "are scattered over the processing order, so its scale must be fixed up front"
            )


@dataclass
class GPTQResult:
    """One quantized weight. ``weight``: the NVFP4 tensor (None for other formats);
    ``dequantized``: float32 ``[N, K]`` Ŵ; ``dead_columns``: inputs never seen non-zero;
    ``fallback``: True when the layer was rounded with RTN instead (and why, in ``reason``)."""

    weight: NVFP4Tensor | None
    dequantized: torch.Tensor
    dead_columns: int = 0
    fallback: bool = False
    reason: str = ""


# --------------------------------------------------------------------------------------------
# the Hessian
# --------------------------------------------------------------------------------------------


class Hessian:
    """Running ``H = (2/n) Σ x xᵀ`` over ``n`` tokens, float64 ``[K, K]`` on ``device``."""

    def __init__(self, k: int, device: torch.device | str | None = None) -> None:
        self.sum = torch.zeros(k, k, dtype=_WORK, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Accumulate the rows of ``x [..., K]``; ``mask`` (bool, ``x.shape[:-1]``) keeps rows."""
        rows = x.detach()[mask] if mask is not None else x.detach().reshape(-1, x.shape[-1])
        rows = rows.to(device=self.sum.device, dtype=_WORK)
        self.sum.addmm_(rows.T, rows)
        self.tokens += rows.shape[0]

    def matrix(self) -> torch.Tensor:
        """float64 ``[K, K]``; ValueError when no token was added."""
        if not self.tokens:
            raise ValueError("the Hessian has no tokens: no calibration input reached the layer")
        return self.sum * (2.0 / self.tokens)

    def clone(self) -> Hessian:
        """An independent copy (the running sum and the token count)."""
        copy = Hessian.__new__(Hessian)
        copy.sum, copy.tokens = self.sum.clone(), self.tokens
        return copy


# --------------------------------------------------------------------------------------------
# column quantizers: a group's scale, one column's rounding
# --------------------------------------------------------------------------------------------


class _Columns(Protocol):
    group: int

    def scales(self, w: torch.Tensor) -> torch.Tensor:
        """float32 scale values ``[N, K/group]`` for the groups of ``w [N, K]``."""

    def rounder(self, scale: torch.Tensor) -> _Rounder:
        """The rounding of one column ``col [N]`` at the group scales ``scale [N]`` (float32):
        ``rounder(scale)(col)`` is (dequantized float32 ``[N]``, uint8 codes ``[N]``)."""

    def native_factors(self, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The same rounding as numbers for the C++ column loop
        (:func:`nvfp4lab.kernels.gptq_columns.run_group`): (element multiplier, decode factor),
        float32 ``[N]``; None where that loop does not implement it."""


#: one column ``[N]`` -> (dequantized float32 ``[N]``, uint8 codes ``[N]``)
_Rounder = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class _NVFP4Columns:
    """NVFP4 in one arithmetic order, through the codec's block functions."""

    group = BLOCK_SIZE

    def __init__(self, scale: TensorScale, order: ArithmeticOrder) -> None:
        self.scale = scale
        self.order = order

    def scales(self, w: torch.Tensor) -> torch.Tensor:
        blocks = w.reshape(w.shape[0], -1, self.group)
        return block_scales_of(blocks, self.scale.arithmetic, self.order)

    def native_factors(self, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        return multiply_factors(scale, self.scale.arithmetic, self.order)

    def rounder(self, scale: torch.Tensor) -> _Rounder:
        n = scale.shape[0]
        encode, decode = fixed_scale_codec(scale.view(n, 1), self.scale.arithmetic, self.order)

        def round_column(col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            codes = encode(col.to(torch.float32).view(n, 1, 1))
            return decode(codes).view(n), codes.view(n)

        return round_column


def _tensor_scale(
    w: torch.Tensor, global_scale: torch.Tensor | float | None, order: ArithmeticOrder
) -> TensorScale:
    """The tensor scale :func:`nvfp4lab.quantize` would use for ``w`` in ``order`` (from its amax,
    or the given ENCODE ``global_scale``)."""
    if global_scale is None:
        return tensor_scale_from_amax(finite_amax(w, NonFinite.PROPAGATE), order)
    return TensorScale.of(order, encode=as_global_scale(global_scale, w.device))


class _BlockColumns:
    """A comparator block format (MXFP4, INT4-g128) as :class:`BlockFormat` computes it."""

    def __init__(self, info: BlockFormatInfo) -> None:
        self.info = info
        self.group = info.block_size

    def scales(self, w: torch.Tensor) -> torch.Tensor:
        amax = abs_max(w.to(torch.float32).reshape(w.shape[0], -1, self.group), -1)
        return self.info.scale.value(self.info.scale.encode(amax, self.info.element))

    def native_factors(self, scale: torch.Tensor) -> None:
        return None  # a comparator's rounding runs eagerly

    def rounder(self, scale: torch.Tensor) -> _Rounder:
        def round_column(col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = col.to(torch.float32)
            scaled = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1.0), 0.0)
            codes = self.info.element.encode(scaled)
            return self.info.element.decode(codes) * scale, codes

        return round_column


# --------------------------------------------------------------------------------------------
# the algorithm
# --------------------------------------------------------------------------------------------


def _inverse_factor(h: torch.Tensor, damp: float) -> torch.Tensor | None:
    """Upper Cholesky factor of ``(H + damp·mean(diag H)·I)⁻¹``; None if not positive definite."""
    damped = h.clone()
    damped.diagonal().add_(damp * float(h.diagonal().mean()))
    lower, info = torch.linalg.cholesky_ex(damped)
    if int(info):
        return None
    upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
    return None if int(info) else upper


def _gptq_loop(
    wt: torch.Tensor,
    u: torch.Tensor,
    cols: _Columns,
    groups: list[int],
    scales: torch.Tensor,
    options: GPTQOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the columns of W, held TRANSPOSED as ``wt [K, N]`` (float64, processing order,
    modified in place; a column is then a contiguous row).

    Errors are applied lazily at two levels: eagerly inside each 16-column step, to the rest of
    the ``block_size`` block after each step, to the later columns after each block (small
    updates stay single-threaded). ``groups[j]``: the group of processed column ``j``;
    ``scales [N, K/group]`` float32 (refilled at each group's first column when
    ``options.scales == "updated"``). Returns (float32 Ŵ, uint8 codes), ``[N, K]``.

    On the CPU, with the native library and the kernel order's rounding, each 16-column step
    runs in one C++ call (:func:`_native_step`), bit for bit the per-column torch loop below.
    """
    k, n = wt.shape
    q = torch.empty(k, n, dtype=torch.float32, device=wt.device)
    codes = torch.empty(k, n, dtype=torch.uint8, device=wt.device)
    step = cols.group
    rounders: dict[int, _Rounder] = {}  # per group, built at its first column
    # The C++ loop where it runs the columns' rounding (a group's factors, at its first column).
    native = (native_lib.usable(wt.device) and wt.dtype == _WORK
              and cols.native_factors(scales[:1, 0]) is not None)
    factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for b0 in range(0, k, options.block_size):
        b1 = min(b0 + options.block_size, k)
        block = wt[b0:b1].clone()
        errors = torch.empty_like(block)
        ub = u[b0:b1, b0:b1]
        diagonal = ub.diagonal().tolist()
        for s0 in range(0, b1 - b0, step):
            s1 = min(s0 + step, b1 - b0)
            if options.scales == ScaleTiming.UPDATED:  # no act order: step s0 is one group
                fresh = cols.scales(block[s0:s1].T.to(torch.float32))
                scales[:, groups[b0 + s0]] = fresh[:, 0]
            if native:
                _native_step(block, ub, cols, groups, scales, factors, q, codes, errors, b0,
                             s0, s1)
                block[s1:].addmm_(ub[s0:s1, s1:].T, errors[s0:s1], alpha=-1.0)
                continue
            for i in range(s0, s1):
                j = b0 + i
                group = groups[j]
                rounder = rounders.get(group)
                if rounder is None:
                    rounder = rounders[group] = cols.rounder(scales[:, group])
                q[j], codes[j] = rounder(block[i])
                errors[i] = (block[i] - q[j].to(_WORK)) / diagonal[i]
                block[i + 1 : s1].sub_(ub[i, i + 1 : s1, None] * errors[i])
            block[s1:].addmm_(ub[s0:s1, s1:].T, errors[s0:s1], alpha=-1.0)
        wt[b1:].addmm_(u[b0:b1, b1:].T, errors, alpha=-1.0)
    return q.T, codes.T


def _native_step(
    block: torch.Tensor, ub: torch.Tensor, cols: _Columns, groups: list[int],
    scales: torch.Tensor, factors: dict[int, tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor, codes: torch.Tensor, errors: torch.Tensor, b0: int, s0: int, s1: int,
) -> None:
    """Columns ``s0:s1`` of the block at ``b0`` in one C++ call, bit for bit the eager loop's
    steps (:func:`nvfp4lab.kernels.gptq_columns.run_group`); each group's factors are made at
    its first column, as the eager loop makes its rounder."""
    ids = groups[b0 + s0 : b0 + s1]
    for group in ids:
        if group not in factors:
            found = cols.native_factors(scales[:, group])
            assert found is not None  # _gptq_loop asked before choosing this path
            factors[group] = found
    if len(set(ids)) == 1:
        multipliers, decode = factors[ids[0]]
    else:  # act order: the step's columns belong to several groups
        multipliers = torch.stack([factors[g][0] for g in ids])
        decode = torch.stack([factors[g][1] for g in ids])
    j0, j1 = b0 + s0, b0 + s1
    run_group(block[s0:s1], ub[s0:s1, s0:s1], multipliers, decode, q[j0:j1], codes[j0:j1],
              errors[s0:s1])


def _run(
    weight: torch.Tensor, hessian: torch.Tensor, cols: _Columns, options: GPTQOptions
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, str]:
    """GPTQ of ``weight [N, K]``: (float32 Ŵ, uint8 codes, float32 scales, dead, fallback why)."""
    k = weight.shape[1]
    h = hessian.to(device=weight.device, dtype=_WORK).clone()
    dead = h.diagonal() == 0
    if bool(dead.all()):  # zero trace: no input ever fired, GPTQ would zero the whole weight
        return (*_run(weight, torch.eye(k, dtype=_WORK, device=weight.device), cols, options)[:3],
                0, _DEGENERATE)
    h.diagonal()[dead] = 1.0
    w_orig = weight.detach().clone()
    w_orig[:, dead] = 0
    scales = cols.scales(w_orig)
    order = torch.arange(k, device=weight.device)
    if options.act_order:
        order = torch.argsort(h.diagonal(), descending=True, stable=True)
        h = h[order][:, order]
    u = _inverse_factor(h, options.damp)
    reason = "" if u is not None else (
        f"the damped Hessian is not positive definite (damp={options.damp}); raise damp"
    )
    if u is None:
        u = torch.eye(k, dtype=_WORK, device=weight.device)
    wt = w_orig.to(_WORK).T[order].contiguous()
    q, codes = _gptq_loop(wt, u, cols, (order // cols.group).tolist(), scales, options)
    inverse = torch.argsort(order)
    return q[:, inverse], codes[:, inverse], scales, int(dead.sum()), reason


#: why an all-zero Hessian falls back to RTN
_DEGENERATE = (
    "the Hessian is all zero (every calibration input of the layer is zero), which would zero "
    "the whole weight; calibrate with inputs that reach the layer non-zero"
)


def _check_pair(weight: torch.Tensor, hessian: torch.Tensor, group: int) -> None:
    if not isinstance(weight, torch.Tensor) or not isinstance(hessian, torch.Tensor):
        raise TypeError(
            f"weight and hessian must be torch.Tensors, got {type(weight).__name__} and "
            f"{type(hessian).__name__}"
        )
    check_dtype(weight.dtype, "GPTQ weight (dtype)")
    if weight.ndim != 2 or weight.shape[1] % group:
        raise ValueError(
            f"GPTQ weight must be [N, K] with K a multiple of {group}, got {tuple(weight.shape)}"
        )
    k = weight.shape[1]
    if hessian.shape != (k, k) or not hessian.is_floating_point():
        raise ValueError(
            f"GPTQ hessian must be a float [K, K] = [{k}, {k}] matrix (Σ x xᵀ of the layer "
            f"inputs), got {hessian.dtype} {tuple(hessian.shape)}"
        )
    if not bool(torch.isfinite(hessian).all()):
        raise ValueError("GPTQ hessian holds NaN/Inf: check the calibration inputs")


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    *,
    global_scale: torch.Tensor | float | None = None,
    convention: str = Convention.KERNEL,
    options: GPTQOptions | None = None,
    hadamard: int | None = None,
) -> GPTQResult:
    """GPTQ of a Linear weight ``[N, K]`` (fp32/bf16/fp16, K a multiple of 16) to NVFP4.

    ``hessian``: float ``[K, K]``, proportional to ``Σ x xᵀ`` of the layer's inputs (a
    :class:`Hessian`'s ``matrix()``). ``global_scale``: ENCODE convention; None computes
    ``2688/amax(weight)``. Returns a :class:`GPTQResult` whose ``weight`` is an
    :class:`NVFP4Tensor` (packed codes, E4M3 scales, the global scale) in ``weight.dtype``.

    ``hadamard=seed`` (MR-GPTQ): GPTQ of ``W Q`` (:func:`~nvfp4lab.hadamard.hadamard_transform`
    in the weight's dtype, as :func:`nvfp4lab.quantize` rotates) with ``Qᵀ H Q`` (float64), Q
    the seeded 16-point block Hadamard; ``global_scale`` (None: ``2688/amax(W Q)``) then scales
    ``W Q``. The ``weight`` is a :class:`~nvfp4lab.tensor.RotatedNVFP4Tensor` and
    ``dequantized`` is rotated back (``≈ W``).
    """
    result = _gptq_nvfp4(weight, hessian, global_scale, convention, options or GPTQOptions(),
                         hadamard)
    if result.fallback:
        warnings.warn(f"GPTQ fell back to RTN: {result.reason}", GPTQFallbackWarning,
                      stacklevel=2)
    return result


def _rotated_hessian(h: torch.Tensor, seed: int, block: int = BLOCK_SIZE) -> torch.Tensor:
    """``Qᵀ H Q`` in float64 ``[K, K]`` (Q: :func:`~nvfp4lab.hadamard.rotation_matrix`)."""
    rot = rotation_matrix(h.shape[0], seed, block=block, dtype=_WORK).to(h.device)
    return rot.T @ h.to(dtype=_WORK) @ rot


def _as_rotated(result: GPTQResult, seed: int) -> GPTQResult:
    """The result of GPTQ on ``W Q`` as a rotated one: a RotatedNVFP4Tensor, and the
    dequantized weight rotated back."""
    assert result.weight is not None
    weight = RotatedNVFP4Tensor(**vars(result.weight), hadamard=seed)
    back = hadamard_transform(result.dequantized, seed, inverse=True)
    return GPTQResult(weight, back, result.dead_columns, result.fallback, result.reason)


def _gptq_nvfp4(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    global_scale: torch.Tensor | float | None,
    convention: str,
    options: GPTQOptions,
    hadamard: int | None = None,
) -> GPTQResult:
    """:func:`gptq_quantize` without the fallback warning (its callers word it)."""
    _check_pair(weight, hessian, BLOCK_SIZE)
    w = weight.detach()
    if hadamard is not None:
        check_seed(hadamard)
        w, hessian = hadamard_transform(w, hadamard), _rotated_hessian(hessian, hadamard)
    order = get_order(convention)
    scale = _tensor_scale(w, global_scale, order)
    q, codes, scales, dead, reason = _run(w, hessian, _NVFP4Columns(scale, order), options)
    tensor = NVFP4Tensor(
        pack_fp4(codes), scales.to(torch.float8_e4m3fn), scale.encode, shape=w.shape,
        dtype=w.dtype, decode_scale=scale.decode,
    )
    result = GPTQResult(tensor, q, dead, bool(reason), reason)
    return result if hadamard is None else _as_rotated(result, hadamard)


def gptq_fake_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    format: str = "nvfp4",
    *,
    hadamard: int | None = None,
    options: GPTQOptions | None = None,
) -> torch.Tensor:
    """Study function: GPTQ-quantized-then-dequantized ``weight [N, K]`` in ``weight.dtype``.

    ``format``: "nvfp4" or a scaled block format of :mod:`nvfp4lab.formats` ("mxfp4",
    "int4_g128"). ``hadamard=seed``: run GPTQ on ``W Q`` with ``Qᵀ H Q`` (Q the seeded block
    Hadamard, block = the format's group size, MR-GPTQ style) and rotate the result back, so the
    return value is comparable with ``weight``.
    """
    options = options or GPTQOptions()
    fmt = formats.get(format)
    if format == "nvfp4":
        cols: _Columns | None = None
    elif isinstance(fmt, BlockFormat):
        cols = _BlockColumns(fmt.info)
    else:
        raise ValueError(
            f"GPTQ needs a scaled block format, got {format!r}; use 'nvfp4', 'mxfp4' or "
            "'int4_g128'"
        )
    group = BLOCK_SIZE if cols is None else cols.group
    _check_pair(weight, hessian, group)
    w, h = weight.detach(), hessian
    if hadamard is not None:
        check_seed(hadamard)
        w = hadamard_transform(w.to(torch.float32), hadamard, block=group)
        h = _rotated_hessian(h.to(device=w.device), hadamard, block=group)
    if cols is None:
        order = get_order(Convention.KERNEL)
        cols = _NVFP4Columns(_tensor_scale(w, None, order), order)
    q, _, _, _, reason = _run(w, h, cols, options)
    if reason:
        warnings.warn(f"GPTQ fell back to RTN: {reason}", GPTQFallbackWarning, stacklevel=2)
    if hadamard is not None:
        q = hadamard_transform(q, hadamard, inverse=True, block=group)
    return q.to(weight.dtype)


# --------------------------------------------------------------------------------------------
# calibration data and whole models
# --------------------------------------------------------------------------------------------


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
            h = by_hessian[id(hessian)] = hessian.matrix()
        if not bool(torch.isfinite(h).all()):
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
    for names in runs.values():
        weights = [layers[n].weight.detach() for n in names]
        h = matrices[names[0]]
        if h is None:
            h = torch.eye(weights[0].shape[1], dtype=_WORK, device=weights[0].device)
        if hadamard is not None:
            check_seed(hadamard)
            _check_pair(weights[0], h, BLOCK_SIZE)
            weights = [hadamard_transform(w, hadamard) for w in weights]
            if id(h) not in rotated:
                rotated[id(h)] = _rotated_hessian(h, hadamard)
            h = rotated[id(h)]
        stacked = weights[0] if len(weights) == 1 else torch.cat(weights)
        result = _gptq_nvfp4(stacked, h, global_scales.get(names[0]), convention, options)
        parts = [result] if len(names) == 1 else _split(result, [w.shape[0] for w in weights])
        if hadamard is not None:
            parts = [_as_rotated(part, hadamard) for part in parts]
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
    convention: str = Convention.KERNEL,
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
    with torch.no_grad():
        calls = capture_block_inputs(model, plan.blocks, batches)
    if calls is None:
        yield from whole_model([s for stages_i in plan.inside for s in stages_i] + plan.after)
        return
    last = max(i for i, stages_i in enumerate(plan.inside) if stages_i)
    for index, block in enumerate(plan.blocks.modules[: last + 1]):
        names = [n for stage in plan.inside[index] for n in stage]
        with BlockRunner(block, calls, {n: model.get_submodule(n) for n in names}) as runner:
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
