"""The block encode: a C++ kernel that quantizes (and quantize-dequantizes) on the CPU.

Bit for bit the eager codec (:mod:`nvfp4lab.scales`, :mod:`nvfp4lab.e2m1`,
:mod:`nvfp4lab.blocks`) in every arithmetic order whose steps it implements (:func:`supports`:
``kernel``, ``compressed-tensors``, ``modelopt`` and ``llama.cpp`` today; ``block_encode.cpp``
states each step), in two passes over ``x`` (fp32 / bf16 / fp16, ``[..., K]``, K a multiple of
16):

1. :func:`abs_max`: ``max |x|`` as a 0-d tensor in x.dtype (exact: an integer max of magnitude
   bits; NaN when x holds one). The caller checks it and computes the tensor scale, as eager does.
2. :func:`encode` (packed codes and E4M3 scales) or :func:`fake_quantize` (the decoded values in
   x.dtype) with the tensor scale in the order's form (:attr:`nvfp4lab.scales.TensorScale.
   arithmetic`: the ENCODE ``gs`` for ``kernel``, ``compressed-tensors`` and ``llama.cpp``, the
   DECODE ``d`` for ``modelopt``): per tile of 16 blocks the scale chain across the blocks, then
   each block's 16 elements. Every order runs intrinsics: AVX-512 (a block per vector; the
   compiled graphs' orders on their own specialized body) or AVX2 (a block in two vectors),
   CPUs without AVX2 a portable body (the path is picked at run time). At 8192² bf16 on the
   2-core Xeon every order's encode measured 0.8-0.9 ns per element on AVX-512 and 1.0-1.1 on
   AVX2 (docs/throughput.md).

It reads 2 bytes (bf16) and writes 0.56 per element in pass 2, after pass 1's 2: on the 2-core
Xeon, 8192² bf16 quantize measured 2.9-3.5x ``copy_`` of the same tensor, against 9.5x for the
compiled graphs and 85-110x eagerly. Part of nvfp4lab's native library
(:mod:`nvfp4lab.kernels.native`); without it, callers run the compiled graphs or the eager
codec (:mod:`nvfp4lab.kernels.quantize` and :func:`nvfp4lab.kernels.fused_route` decide).
"""

from __future__ import annotations

import torch

from nvfp4lab.constants import BLOCK_SIZE, CT_ZERO_SCALE_REPLACEMENT, E4M3_MIN_SUBNORMAL
from nvfp4lab.kernels.compiled import fresh
from nvfp4lab.kernels.native import DTYPE_CODES, ISAS, library, required, vector_path
from nvfp4lab.kernels.steps import CODEC_TENSOR_SCALES, StepTable, implements
from nvfp4lab.orders import (
    ArithmeticOrder,
    BlockScaleRule,
    DecodeRule,
    E2M1Ties,
    E4M3Rounding,
    ElementScaling,
    ScaleForm,
)

__all__ = ["ISAS", "STEPS", "abs_max", "encode", "fake_quantize", "isa", "order_flags", "supports"]

_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def isa() -> str:
    """The vector path encodes run here (an entry of :data:`nvfp4lab.kernels.native.ISAS`: the
    best this CPU has, AVX2 needing F16C here, AVX-512 F, BW, VL and F16C, capped by
    ``NVFP4LAB_NATIVE_ISA``); "" when unavailable."""
    lib = library()
    return "" if lib is None else ISAS[min(lib.nvfp4lab_encode_isa(), vector_path())]


# Each step's members as block_encode.cpp's bits (its flag constants).
_BLOCK_RULES = {
    BlockScaleRule.ENCODE_TIMES_AMAX_TIMES_INVERSE_TARGET: 0,
    BlockScaleRule.ENCODE_TIMES_AMAX_OVER_TARGET_IN_INPUT_DTYPE: 1,
    BlockScaleRule.AMAX_OVER_TARGET_TIMES_DECODE: 2,
    BlockScaleRule.PRESCALED_AMAX_OVER_TARGET: 3,
}
_ELEMENT_RULES = {
    ElementScaling.MULTIPLY_BY_INVERSE: 0 << 2,
    ElementScaling.DIVIDE_BY_SCALE_OVER_ENCODE: 1 << 2,
    ElementScaling.DIVIDE_BY_SCALE_TIMES_DECODE: 2 << 2,
    ElementScaling.PRESCALE_ONLY: 3 << 2,
}
_E4M3_ROUNDINGS = {E4M3Rounding.NEAREST_EVEN: 0, E4M3Rounding.HALF_UP_UE4M3: 1 << 4}
_E2M1_TIES = {E2M1Ties.EVEN: 0, E2M1Ties.FIRST_NEAREST_SCALED_TABLE: 1 << 5}
_DECODE_RULES = {DecodeRule.SCALE_OVER_ENCODE: 0, DecodeRule.SCALE_TIMES_DECODE: 1 << 6}
_ZERO_BLOCK_ONE, _MIN_SUBNORMAL, _ZERO_TO_EIGHTH = 1 << 7, 1 << 8, 1 << 9
#: The element rules that divide by the block's scale: the kernel runs them where no scale is 0.
_DIVIDING = (
    ElementScaling.DIVIDE_BY_SCALE_OVER_ENCODE, ElementScaling.DIVIDE_BY_SCALE_TIMES_DECODE)
#: The decode rule that reads the tensor scale in each form (``s / gs`` ENCODE, ``s * d`` DECODE).
_FORM_DECODE = {
    ScaleForm.ENCODE: DecodeRule.SCALE_OVER_ENCODE,
    ScaleForm.DECODE: DecodeRule.SCALE_TIMES_DECODE,
}

#: The steps the block encode implements (:mod:`nvfp4lab.kernels.steps`: any other member
#: declines): the members with bits above, and the tensor scale (computed by the caller, passed
#: in the order's form) in every rule and form of the four orders.
STEPS: StepTable = {
    "scale_form": frozenset({ScaleForm.ENCODE, ScaleForm.DECODE}),
    "tensor_scale": CODEC_TENSOR_SCALES,
    "block_scale": frozenset(_BLOCK_RULES),
    "e4m3_rounding": frozenset(_E4M3_ROUNDINGS),
    "element_scaling": frozenset(_ELEMENT_RULES),
    "e2m1_ties": frozenset(_E2M1_TIES),
    "decode": frozenset(_DECODE_RULES),
}


#: :func:`_flags` by order object (the object kept, so its id is never reused while cached):
#: asked three times per quantize, each reading the order's every step (~2 us).
_FLAGS_SEEN: dict[int, tuple[ArithmeticOrder, int | None]] = {}
#: Distinct order objects remembered at most (then forgotten all at once).
_FLAGS_SEEN_MAX = 64


def _flags(order: ArithmeticOrder) -> int | None:
    """``block_encode.cpp``'s bits for ``order``'s steps; None where a step has none there.
    Remembered per order object (an order is frozen)."""
    seen = _FLAGS_SEEN.get(id(order))
    if seen is not None and seen[0] is order:
        return seen[1]
    flags = _order_bits(order)
    if len(_FLAGS_SEEN) >= _FLAGS_SEEN_MAX:
        _FLAGS_SEEN.clear()
    _FLAGS_SEEN[id(order)] = (order, flags)
    return flags


def _order_bits(order: ArithmeticOrder) -> int | None:
    if not implements(STEPS, order):
        return None
    if order.zero_block_scale not in (None, 1.0):
        return None
    if order.min_block_scale not in (0.0, E4M3_MIN_SUBNORMAL):
        return None
    if order.zero_scale_replacement not in (None, CT_ZERO_SCALE_REPLACEMENT):
        return None
    prescaled = order.element_scaling is ElementScaling.PRESCALE_ONLY
    if prescaled != (order.e2m1_ties is E2M1Ties.FIRST_NEAREST_SCALED_TABLE):
        return None  # codes in the block's domain need the pre-scaled elements, and only they
    if order.decode is not _FORM_DECODE[order.scale_form]:
        return None  # the kernel decodes with the one tensor scale it is given, in the order's form
    if order.element_scaling in _DIVIDING and not (
        order.zero_scale_replacement is not None or order.min_block_scale > 0
    ):
        return None  # a division by a zero scale (0/0 = NaN) has no code in the kernel
    flags = _BLOCK_RULES[order.block_scale] | _ELEMENT_RULES[order.element_scaling]
    flags |= _E4M3_ROUNDINGS[order.e4m3_rounding] | _E2M1_TIES[order.e2m1_ties]
    flags |= _DECODE_RULES[order.decode]
    flags |= _ZERO_BLOCK_ONE if order.zero_block_scale == 1.0 else 0
    flags |= _MIN_SUBNORMAL if order.min_block_scale == E4M3_MIN_SUBNORMAL else 0
    flags |= _ZERO_TO_EIGHTH if order.zero_scale_replacement is not None else 0
    return flags


def supports(order: ArithmeticOrder) -> bool:
    """Whether the block encode implements every step of ``order`` (:data:`STEPS`, and the
    zero-block, lower-clamp and zero-scale values it has bits for): today all four orders,
    kernel, compressed-tensors, modelopt and llama.cpp; any other member of a step declines."""
    return _flags(order) is not None


def order_flags(order: ArithmeticOrder) -> int:
    """The kernel's flags for ``order``; ValueError where it lacks one of its steps."""
    flags = _flags(order)
    if flags is None:
        raise ValueError(
            f"the block encode does not implement every step of the {order.name} order; use "
            "the eager codec"
        )
    return flags


def _checked(x: torch.Tensor, *, blocks: bool) -> torch.Tensor:
    """``x`` detached and contiguous; ValueError for what the kernel cannot read (a non-CPU
    tensor, another dtype, K not a multiple of 16 where it encodes blocks)."""
    if x.device.type != "cpu" or x.dtype not in DTYPE_CODES:
        raise ValueError(
            f"the block encode reads CPU float32 / bfloat16 / float16 tensors, got a {x.dtype} "
            f"tensor on {x.device}; move it to the CPU or use nvfp4lab.quantize"
        )
    if blocks and (x.ndim == 0 or x.shape[-1] % BLOCK_SIZE):
        raise ValueError(
            f"the block encode needs a last dimension that is a multiple of {BLOCK_SIZE}, got "
            f"shape {tuple(x.shape)}; use nvfp4lab.quantize(..., pad=True)"
        )
    return x.detach().contiguous()


def _threads(threads: int | None) -> int:
    return torch.get_num_threads() if threads is None else threads


def abs_max(
    x: torch.Tensor, *, path: str | None = None, threads: int | None = None
) -> torch.Tensor:
    """``max |x|`` of a contiguous CPU tensor (fp32/bf16/fp16) as a 0-d tensor in x.dtype: exact
    (+0.0 for zeros and for an empty tensor), a NaN when x holds one. ``path``: force a vector
    path of :data:`ISAS` (tests; clamped to what the CPU has and to ``NVFP4LAB_NATIVE_ISA``).
    ``threads``: OpenMP threads (default: torch's intra-op threads)."""
    x = _checked(x, blocks=False)
    bits = required().nvfp4lab_abs_max(
        x.data_ptr(), x.numel(), DTYPE_CODES[x.dtype], vector_path(path), _threads(threads))
    as_int = _BITS[x.dtype]
    signed = bits - (1 << 32) if as_int is torch.int32 and bits >= 1 << 31 else bits
    return torch.tensor(signed, dtype=as_int).view(x.dtype)


def _call(
    x: torch.Tensor, gs: torch.Tensor, order: ArithmeticOrder, *, fake: bool,
    packed: torch.Tensor | None, scales: torch.Tensor | None, out: torch.Tensor | None,
    path: str | None, threads: int | None,
) -> None:
    g = gs.detach().to(torch.float32).reshape(1)
    rgs = torch.reciprocal(g)  # the multiply-by-inverse rule's 1/gs: torch's float32 reciprocal
    required().nvfp4lab_encode(
        x.data_ptr(), x.numel() // BLOCK_SIZE, DTYPE_CODES[x.dtype], int(fake), g.item(),
        rgs.item(), order_flags(order), vector_path(path), _threads(threads),
        None if packed is None else packed.data_ptr(),
        None if scales is None else scales.data_ptr(),
        None if out is None else out.data_ptr(),
    )


def encode(
    x: torch.Tensor, global_scale: torch.Tensor, order: ArithmeticOrder, *,
    path: str | None = None, threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., K/2], float8_e4m3fn scales [..., K/16]) of CPU ``x`` [..., K] with the
    float32 [1] tensor scale ``global_scale`` in ``order``'s form (ENCODE ``gs``, or DECODE ``d``
    for a DECODE-form order), bit for bit the eager codec's. ``path``, ``threads``: as
    in :func:`abs_max`. ValueError for a non-CPU tensor, another dtype, or K % 16 != 0."""
    x = _checked(x, blocks=True)
    lead, k = x.shape[:-1], x.shape[-1]
    # Plain allocations: with the huge-page hint (compiled.fresh) the 32 MiB packed output of
    # 8192² took 6-7x copy_ from the second call on at two threads (2.6-3.1x without it).
    packed = torch.empty((*lead, k // 2), dtype=torch.uint8)
    scales = torch.empty((*lead, k // BLOCK_SIZE), dtype=torch.uint8)
    _call(x, global_scale, order, fake=False, packed=packed, scales=scales, out=None, path=path,
          threads=threads)
    return packed, scales.view(torch.float8_e4m3fn)


def fake_quantize(
    x: torch.Tensor, global_scale: torch.Tensor, order: ArithmeticOrder, *,
    out: torch.Tensor | None = None, path: str | None = None, threads: int | None = None,
) -> torch.Tensor:
    """``dequantize(quantize(x))`` of CPU ``x`` [..., K] in x.dtype (into ``out``, a contiguous
    tensor of x's shape and dtype, when given), bit for bit the eager codec's; ``global_scale``
    as in :func:`encode`."""
    x = _checked(x, blocks=True)
    if out is None:
        out = fresh(tuple(x.shape), x.dtype, x.device)
    elif out.dtype != x.dtype or not out.is_contiguous() or out.shape != x.shape:
        raise ValueError(
            f"out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)}, got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    _call(x, global_scale, order, fake=True, packed=None, scales=None, out=out, path=path,
          threads=threads)
    return out
