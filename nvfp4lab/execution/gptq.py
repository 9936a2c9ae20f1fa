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

Whole models: :mod:`nvfp4lab.execution.gptq_model` (``sequential_gptq``, used by
``quantize_model(method="gptq")``) collects each layer's Hessian and calls this module's
per-weight algorithm stage by stage.

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
:class:`~nvfp4lab.number_formats.base.BlockFormatInfo`) and, with ``hadamard=seed``, on weights
rotated by the block Hadamard whose block matches the format's group (MR-GPTQ style, arXiv
2509.23202: ``W' = W Q``, ``H' = Qᵀ H Q``); it returns the dequantized weight rotated back (the
weight rotated in float32 here; the layer path rotates in the weight's dtype, as the codec does).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from nvfp4lab import number_formats
from nvfp4lab.blocks import block_scales_from_blocks, fixed_scale_codec, multiply_factors
from nvfp4lab.codec import finite_amax
from nvfp4lab.constants import BLOCK_SIZE
from nvfp4lab.e2m1 import pack_fp4
from nvfp4lab.execution.gptq_hessian import (
    WORK_DTYPE,
    Hessian,
    _inverse_factor,
    all_finite,
)
from nvfp4lab.hadamard import (
    check_seed,
    hadamard_transform,
    rotation_matrix,
    rotation_matrix_blocks,
)
from nvfp4lab.kernels import hessian_products
from nvfp4lab.kernels import native as native_lib
from nvfp4lab.kernels.gptq_columns import run_group
from nvfp4lab.kernels.gptq_columns import supports as native_columns_support
from nvfp4lab.number_formats.base import BlockFormat, BlockFormatInfo
from nvfp4lab.orders import ArithmeticOrder
from nvfp4lab.orders import get as get_order
from nvfp4lab.scales import TensorScale, abs_max, as_global_scale, tensor_scale_from_amax
from nvfp4lab.tensor import NVFP4Tensor, RotatedNVFP4Tensor
from nvfp4lab.vocab import NonFinite, OrderName, ScaleTiming, check_choice, check_dtype

__all__ = [
    "GPTQFallbackWarning",
    "GPTQOptions",
    "GPTQResult",
    "Hessian",
    "gptq_fake_quantize",
    "gptq_quantize",
]


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
        return block_scales_from_blocks(blocks, self.scale.arithmetic, self.order)

    def native_factors(self, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not native_columns_support(self.order):  # a step the C++ loop does not implement
            return None
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
    native = (native_lib.usable(wt.device) and wt.dtype == WORK_DTYPE
              and cols.native_factors(scales[:1, 0]) is not None)
    layer = _LayerState(cols, groups, scales, q, codes)
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
                _native_step(layer, _Block(b0, block, ub, errors), s0, s1)
                block[s1:].addmm_(ub[s0:s1, s1:].T, errors[s0:s1], alpha=-1.0)
                continue
            for i in range(s0, s1):
                j = b0 + i
                group = groups[j]
                rounder = rounders.get(group)
                if rounder is None:
                    rounder = rounders[group] = cols.rounder(scales[:, group])
                q[j], codes[j] = rounder(block[i])
                errors[i] = (block[i] - q[j].to(WORK_DTYPE)) / diagonal[i]
                block[i + 1 : s1].sub_(ub[i, i + 1 : s1, None] * errors[i])
            block[s1:].addmm_(ub[s0:s1, s1:].T, errors[s0:s1], alpha=-1.0)
        wt[b1:].addmm_(u[b0:b1, b1:].T, errors, alpha=-1.0)
    return q.T, codes.T


@dataclass
class _LayerState:
    """What :func:`_gptq_loop` carries across one weight's blocks for :func:`_native_step`:
    the column quantizer, ``groups[j]`` (the group of processed column ``j``), the group scales
    ``[N, K/group]`` float32, the outputs ``q`` (float32) / ``codes`` (uint8) ``[K, N]`` in
    processing order, and each group's C++ factors, made at its first column."""

    cols: _Columns
    groups: list[int]
    scales: torch.Tensor
    q: torch.Tensor
    codes: torch.Tensor
    factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class _Block(NamedTuple):
    """One lazy batch of :func:`_gptq_loop`: its first processed column ``start``, its columns
    ``weights`` (float64 ``[B, N]``, updated in place), the factor's block ``u`` ``[B, B]`` and
    the scaled errors ``errors`` ``[B, N]`` (written)."""

    start: int
    weights: torch.Tensor
    u: torch.Tensor
    errors: torch.Tensor


def _native_step(layer: _LayerState, block: _Block, s0: int, s1: int) -> None:
    """Columns ``s0:s1`` of ``block`` in one C++ call, bit for bit the eager loop's steps
    (:func:`nvfp4lab.kernels.gptq_columns.run_group`); each group's factors are made at its
    first column, as the eager loop makes its rounder."""
    ids = layer.groups[block.start + s0 : block.start + s1]
    for group in ids:
        if group not in layer.factors:
            found = layer.cols.native_factors(layer.scales[:, group])
            assert found is not None  # _gptq_loop asked before choosing this path
            layer.factors[group] = found
    if len(set(ids)) == 1:
        multipliers, decode = layer.factors[ids[0]]
    else:  # act order: the step's columns belong to several groups
        multipliers = torch.stack([layer.factors[g][0] for g in ids])
        decode = torch.stack([layer.factors[g][1] for g in ids])
    j0, j1 = block.start + s0, block.start + s1
    run_group(block.weights[s0:s1], block.u[s0:s1, s0:s1], multipliers, decode,
              layer.q[j0:j1], layer.codes[j0:j1], block.errors[s0:s1])


def _run(
    weight: torch.Tensor, hessian: torch.Tensor, cols: _Columns, options: GPTQOptions,
    owned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, str]:
    """GPTQ of ``weight [N, K]``: (float32 Ŵ, uint8 codes, float32 scales, dead, fallback why).
    ``owned``: ``hessian`` is handed over and may be overwritten (no K×K copy is made)."""
    k = weight.shape[1]
    h = hessian.to(device=weight.device, dtype=WORK_DTYPE)
    if (h.data_ptr() == hessian.data_ptr() and not owned) or not h.is_contiguous():
        h = h.clone(memory_format=torch.contiguous_format)  # the caller's H stays as it is
    dead = h.diagonal() == 0
    if bool(dead.all()):  # zero trace: no input ever fired, GPTQ would zero the whole weight
        identity = torch.eye(k, dtype=WORK_DTYPE, device=weight.device)
        return (*_run(weight, identity, cols, options)[:3], 0, _DEGENERATE)
    h.diagonal()[dead] = 1.0
    w_orig = weight.detach().clone()
    w_orig[:, dead] = 0
    scales = cols.scales(w_orig)
    order = torch.arange(k, device=weight.device)
    if options.act_order:
        order = torch.argsort(h.diagonal(), descending=True, stable=True)
        h = h[order][:, order]
    owned = [h]
    del h  # _inverse_factor overwrites it
    u = _inverse_factor(owned, options.damp)
    reason = "" if u is not None else (
        f"the damped Hessian is not positive definite (damp={options.damp}); raise damp"
    )
    if u is None:
        u = torch.eye(k, dtype=WORK_DTYPE, device=weight.device)
    wt = torch.empty(k, weight.shape[0], dtype=WORK_DTYPE, device=weight.device)
    wt.copy_(w_orig.T[order] if options.act_order else w_orig.T)  # one [K, N] float64 copy
    del w_orig
    q, codes = _gptq_loop(wt, u, cols, (order // cols.group).tolist(), scales, options)
    inverse = torch.argsort(order)
    return q[:, inverse], codes[:, inverse], scales, int(dead.sum()), reason


#: why an all-zero Hessian falls back to RTN
_DEGENERATE = (
    "the Hessian is all zero (every calibration input of the layer is zero), which would zero "
    "the whole weight; calibrate with inputs that reach the layer non-zero"
)


def check_pair(weight: torch.Tensor, hessian: torch.Tensor, group: int) -> None:
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
    if not all_finite(hessian):
        raise ValueError("GPTQ hessian holds NaN/Inf: check the calibration inputs")


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    *,
    global_scale: torch.Tensor | float | None = None,
    convention: str = OrderName.VLLM_KERNEL,
    options: GPTQOptions | None = None,
    hadamard: int | None = None,
) -> GPTQResult:
    """GPTQ of a Linear weight ``[N, K]`` (fp32/bf16/fp16, K a multiple of 16) to NVFP4.

    ``hessian``: float ``[K, K]``, proportional to ``Σ x xᵀ`` of the layer's inputs (a
    :class:`Hessian`'s ``matrix()``). ``global_scale``: ENCODE form; None computes
    ``2688/amax(weight)``. Returns a :class:`GPTQResult` whose ``weight`` is an
    :class:`NVFP4Tensor` (packed codes, E4M3 scales, the global scale) in ``weight.dtype``.

    ``hadamard=seed`` (MR-GPTQ): GPTQ of ``W Q`` (:func:`~nvfp4lab.hadamard.hadamard_transform`
    in the weight's dtype, as :func:`nvfp4lab.quantize` rotates) with ``Qᵀ H Q`` (float64), Q
    the seeded 16-point block Hadamard; ``global_scale`` (None: ``2688/amax(W Q)``) then scales
    ``W Q``. The ``weight`` is a :class:`~nvfp4lab.tensor.RotatedNVFP4Tensor` and
    ``dequantized`` is rotated back (``≈ W``).
    """
    result = gptq_nvfp4(weight, hessian, global_scale, convention, options or GPTQOptions(),
                         hadamard)
    if result.fallback:
        warnings.warn(f"GPTQ fell back to RTN: {result.reason}", GPTQFallbackWarning,
                      stacklevel=2)
    return result


def rotated_hessian(h: torch.Tensor, seed: int, block: int = BLOCK_SIZE) -> torch.Tensor:
    """``Qᵀ H Q`` in float64 ``[K, K]`` (Q: :func:`~nvfp4lab.hadamard.rotation_matrix`), a new
    tensor (``h`` is left as it is).

    Q is block diagonal. On the CPU (native library) each row block of ``H`` is rotated by its
    blocks of Q alone (:func:`~nvfp4lab.kernels.hessian_products.block_congruence`: each element a
    sum of 16 products in index order, the same on every CPU; 7 ms against 86 ms for the dense
    products at K = 1,536). Elsewhere the dense products, summed as the BLAS sums them."""
    out = h.to(dtype=WORK_DTYPE, memory_format=torch.contiguous_format, copy=True)
    if out.device.type == "cpu" and hessian_products.available():
        blocks = rotation_matrix_blocks(h.shape[0], seed, block=block, dtype=WORK_DTYPE)
        return hessian_products.block_congruence(out, blocks)
    rot = rotation_matrix(h.shape[0], seed, block=block, dtype=WORK_DTYPE).to(h.device)
    return rot.T @ out @ rot


def as_rotated(result: GPTQResult, seed: int) -> GPTQResult:
    """The result of GPTQ on ``W Q`` as a rotated one: a RotatedNVFP4Tensor, and the
    dequantized weight rotated back."""
    assert result.weight is not None
    weight = RotatedNVFP4Tensor(**vars(result.weight), hadamard=seed)
    back = hadamard_transform(result.dequantized, seed, inverse=True)
    return GPTQResult(weight, back, result.dead_columns, result.fallback, result.reason)


def gptq_nvfp4(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    global_scale: torch.Tensor | float | None,
    convention: str,
    options: GPTQOptions,
    hadamard: int | None = None,
    owned: bool = False,
) -> GPTQResult:
    """:func:`gptq_quantize` without the fallback warning (its callers word it). ``owned``:
    ``hessian`` is handed over and may be overwritten (the caller's last use of it)."""
    check_pair(weight, hessian, BLOCK_SIZE)
    w = weight.detach()
    if hadamard is not None:
        check_seed(hadamard)
        w, hessian = hadamard_transform(w, hadamard), rotated_hessian(hessian, hadamard)
    order = get_order(convention)
    scale = _tensor_scale(w, global_scale, order)
    q, codes, scales, dead, reason = _run(w, hessian, _NVFP4Columns(scale, order), options,
                                          owned=owned or hadamard is not None)  # QᵀHQ: ours
    tensor = NVFP4Tensor(
        pack_fp4(codes), scales.to(torch.float8_e4m3fn), scale.encode, shape=w.shape,
        dtype=w.dtype, decode_scale=scale.decode,
    )
    result = GPTQResult(tensor, q, dead, bool(reason), reason)
    return result if hadamard is None else as_rotated(result, hadamard)


def gptq_fake_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    format: str = "nvfp4",
    *,
    hadamard: int | None = None,
    options: GPTQOptions | None = None,
) -> torch.Tensor:
    """Study function: GPTQ-quantized-then-dequantized ``weight [N, K]`` in ``weight.dtype``.

    ``format``: "nvfp4" or a scaled block format of :mod:`nvfp4lab.number_formats` ("mxfp4",
    "int4_g128"). ``hadamard=seed``: run GPTQ on ``W Q`` with ``Qᵀ H Q`` (Q the seeded block
    Hadamard, block = the format's group size, MR-GPTQ style) and rotate the result back, so the
    return value is comparable with ``weight``.
    """
    options = options or GPTQOptions()
    fmt = number_formats.get(format)
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
    check_pair(weight, hessian, group)
    w, h = weight.detach(), hessian
    if hadamard is not None:
        check_seed(hadamard)
        w = hadamard_transform(w.to(torch.float32), hadamard, block=group)
        h = rotated_hessian(h.to(device=w.device), hadamard, block=group)
    if cols is None:
        order = get_order(OrderName.VLLM_KERNEL)
        cols = _NVFP4Columns(_tensor_scale(w, None, order), order)
    q, _, _, _, reason = _run(w, h, cols, options)
    if reason:
        warnings.warn(f"GPTQ fell back to RTN: {reason}", GPTQFallbackWarning, stacklevel=2)
    if hadamard is not None:
        q = hadamard_transform(q, hadamard, inverse=True, block=group)
    return q.to(weight.dtype)
