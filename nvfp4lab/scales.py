"""NVFP4 scale arithmetic: the FP32 tensor (global) scale and the E4M3 block scales.

Tensor scale (one float32 per tensor), two forms (a mix-up is a classic bug; the glossary of
``docs/architecture.md`` keeps "global scale" for the ENCODE form only):

* ENCODE, ``gs = 2688 / amax`` (2688 = 448 · 6): what compressed-tensors and vLLM checkpoints
  store (``weight_global_scale``, ``input_global_scale``) and what every nvfp4lab function
  takes and returns.
* DECODE, ``amax / 2688``: torchao's ``per_tensor_scale``, ModelOpt's ``weight_scale_2`` and
  ``input_scale``. Convert with :func:`encode_to_decode_scale` / :func:`decode_to_encode_scale`.

Block scales and element scaling follow an :class:`~nvfp4lab.orders.ArithmeticOrder` (the
``convention`` arguments below take one or its convention's name); its table in
:mod:`nvfp4lab.orders` states each order's steps. An order whose ``scale_form`` is DECODE (the
``modelopt`` order) is written in ``d = amax / 2688``: the functions below then take ``d`` where
the ENCODE orders take ``gs`` (:attr:`TensorScale.arithmetic` hands each order its form).

``torch.float8_e4m3fn`` casts do not saturate, hence the explicit clamp to ±448.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nvfp4lab.constants import E2M1_MAX, E4M3_MAX, GLOBAL_SCALE_NUMERATOR
from nvfp4lab.orders import (
    KERNEL_MAX_GLOBAL_SCALE,
    ORDERS,
    ArithmeticOrder,
    BlockScaleRule,
    E4M3Rounding,
    ElementScaling,
    ScaleForm,
    TensorScaleRule,
)
from nvfp4lab.orders import get as get_order
from nvfp4lab.vocab import OrderName

__all__ = [
    "KERNEL_MAX_GLOBAL_SCALE",
    "MODELOPT_MIN_BLOCK_SCALE",
    "TensorScale",
    "abs_max",
    "as_global_scale",
    "block_scales",
    "block_scales_from_amax",
    "decode_scale_from_amax",
    "decode_to_encode_scale",
    "element_multiplier",
    "element_scaler",
    "encode_to_decode_scale",
    "global_scale_from_amax",
    "scale_elements",
    "tensor_scale_from_amax",
]

#: ModelOpt clamps every block scale to at least E4M3's smallest subnormal (the modelopt order's
#: ``min_block_scale``, stated once in :mod:`nvfp4lab.orders`).
MODELOPT_MIN_BLOCK_SCALE: float = ORDERS[OrderName.MODELOPT].min_block_scale


def abs_max(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``max |x|`` over all elements (0-d) or along ``dim``, exact, in ``x.dtype``; 0 when empty.

    Computed as ``max(max(x), -min(x))`` with ``torch.aminmax`` (no ``|x|`` temporary; several
    times faster than ``vector_norm(ord=inf)``), always ``+0.0`` for zeros; NaN propagates.
    """
    if x.numel() == 0 or (dim is not None and x.shape[dim] == 0):
        shape = [] if dim is None else [s for i, s in enumerate(x.shape) if i != dim % x.ndim]
        return x.new_zeros(shape)
    low, high = torch.aminmax(x) if dim is None else torch.aminmax(x, dim=dim)
    return torch.maximum(high, -low).abs()


def as_global_scale(
    global_scale: torch.Tensor | float, device: torch.device | str | None = None
) -> torch.Tensor:
    """Validate an ENCODE-form global scale and return it as float32 ``[1]`` on ``device``.

    Raises ValueError for a wrong element count, or (off the meta device) a value that is not
    finite and > 0.
    """
    if isinstance(global_scale, bool) or not isinstance(global_scale, torch.Tensor | numbers.Real):
        raise ValueError(
            f"global_scale must be a real number or a one-element tensor, got {type(global_scale)}"
        )
    if isinstance(global_scale, torch.Tensor):
        gs = global_scale.detach()
    else:
        gs = torch.as_tensor(float(global_scale))
    if gs.numel() != 1 or gs.ndim > 1:
        raise ValueError(
            f"global_scale must hold exactly one element (shape [1] or []), got shape "
            f"{tuple(gs.shape)}; NVFP4 has one tensor scale per tensor"
        )
    if not (gs.is_floating_point() or gs.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"global_scale must be a real number, got dtype {gs.dtype}")
    gs = gs.reshape(1).to(device=device if device is not None else gs.device, dtype=torch.float32)
    if not gs.is_meta:
        value = float(gs)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"global_scale must be finite and > 0 (ENCODE form, 2688/amax), got {value}. "
                "A DECODE-form scale (amax/2688, e.g. ModelOpt weight_scale_2 or torchao "
                "per_tensor_scale) must be inverted first: pass 1/scale."
            )
    return gs


def global_scale_from_amax(
    amax: torch.Tensor,
    convention: str | ArithmeticOrder,
    numerator: float = GLOBAL_SCALE_NUMERATOR,
) -> torch.Tensor:
    """float32 ``[1]`` ENCODE scale ``numerator / amax`` from a finite 0-d ``amax`` (input dtype),
    by the order's :class:`~nvfp4lab.orders.TensorScaleRule`.

    ``FLOAT32_DIVISION`` (kernel): a true float32 division (``2688 / tensor`` would be
    reciprocal-then-multiply in torch), capped at the order's ``max_global_scale``.
    ``INPUT_DTYPE_RECIPROCAL`` (compressed-tensors): torch's ``2688 / t`` = ``reciprocal(t) *
    2688`` with each step rounded to the input dtype, amax clamped below at ``finfo(dtype).tiny``.
    ``DECODE_FLOAT32_DIVISION`` (modelopt): the float32 reciprocal of
    :func:`decode_scale_from_amax`. ``UNIT`` (llama.cpp): 1.0, whatever ``amax``.
    Either way a non-finite or non-positive result becomes 1.0 (compressed-tensors' rule).
    """
    order = get_order(convention)
    rule = order.tensor_scale
    if rule is TensorScaleRule.DECODE_FLOAT32_DIVISION:
        return torch.reciprocal(decode_scale_from_amax(amax, numerator))
    if rule is TensorScaleRule.UNIT:
        return torch.ones(1, dtype=torch.float32, device=amax.device)
    if rule is TensorScaleRule.FLOAT32_DIVISION:
        gs = torch.full_like(amax, numerator, dtype=torch.float32) / amax.float()
        if order.max_global_scale is not None:
            gs = gs.clamp(max=order.max_global_scale)
        gs = torch.where(amax > 0, gs, 1.0)
    elif rule is TensorScaleRule.INPUT_DTYPE_RECIPROCAL:
        tiny = torch.finfo(amax.dtype).tiny
        gs = (numerator / amax.clamp(min=tiny)).to(torch.float32)
    else:  # pragma: no cover - a new rule must be taught here
        raise NotImplementedError(f"tensor-scale rule {rule} of the {order.name} order")
    gs = torch.where(torch.isfinite(gs) & (gs > 0), gs, torch.ones_like(gs))
    return gs.reshape(1)


def decode_scale_from_amax(
    amax: torch.Tensor, numerator: float = GLOBAL_SCALE_NUMERATOR
) -> torch.Tensor:
    """float32 ``[1]`` DECODE scale ``amax / numerator`` as ModelOpt computes it on the CPU: one
    true float32 division (tensor by tensor, so a GPU divides too rather than multiplying by a
    rounded reciprocal). A zero, tiny or non-finite result becomes 1.0 (ModelOpt itself would
    produce NaN block scales for an all-zero tensor)."""
    d = amax.float() / torch.full_like(amax, numerator, dtype=torch.float32)
    d = torch.where(torch.isfinite(d) & (d > 0), d, torch.ones_like(d))
    return d.reshape(1)


@dataclass(frozen=True)
class TensorScale:
    """The tensor scale of one quantization: ``encode`` (2688/amax, float32 ``[1]``, what an
    NVFP4Tensor stores as ``global_scale``) and, for an order written in the DECODE form (the
    modelopt order), the exact ``decode`` scale (amax/2688) its arithmetic uses and its tensor
    keeps (the float32 reciprocal does not round-trip)."""

    encode: torch.Tensor
    decode: torch.Tensor | None = None

    @property
    def arithmetic(self) -> torch.Tensor:
        """The form the order's block arithmetic takes (``decode`` when there is one)."""
        return self.encode if self.decode is None else self.decode

    @classmethod
    def of(
        cls,
        order: ArithmeticOrder,
        encode: torch.Tensor | None = None,
        decode: torch.Tensor | None = None,
    ) -> TensorScale:
        """The scale ``order`` works with, given either form (float32 ``[1]``): a DECODE-form
        order keeps ``decode`` exactly (or the reciprocal of ``encode``), an ENCODE-form order
        keeps only ``encode`` (or the reciprocal of ``decode``)."""
        if encode is None and decode is None:
            raise ValueError("TensorScale.of needs encode= or decode=")
        if encode is None:
            encode = torch.reciprocal(decode)  # type: ignore[arg-type]
        if order.scale_form is ScaleForm.DECODE:
            return cls(encode, decode if decode is not None else torch.reciprocal(encode))
        return cls(encode)


def tensor_scale_from_amax(
    amax: torch.Tensor,
    convention: str | ArithmeticOrder,
    numerator: float = GLOBAL_SCALE_NUMERATOR,
) -> TensorScale:
    """The :class:`TensorScale` an order computes from a finite 0-d ``amax`` (input dtype): the
    DECODE-form order divides ``amax / numerator`` and keeps that exactly; the ENCODE-form orders
    compute :func:`global_scale_from_amax`."""
    order = get_order(convention)
    if order.scale_form is ScaleForm.DECODE:
        d = decode_scale_from_amax(amax, numerator)
        return TensorScale(torch.reciprocal(d), d)
    return TensorScale(global_scale_from_amax(amax, order, numerator))


def encode_to_decode_scale(global_scale: torch.Tensor | float) -> torch.Tensor:
    """ENCODE (2688/amax, compressed-tensors) -> DECODE (amax/2688, torchao/ModelOpt): ``1/x``."""
    return torch.reciprocal(as_global_scale(global_scale))


def decode_to_encode_scale(decode_scale: torch.Tensor | float) -> torch.Tensor:
    """DECODE (amax/2688) -> ENCODE (2688/amax) convention: ``1/x``."""
    return torch.reciprocal(as_global_scale(decode_scale))


def _round_e4m3(pre: torch.Tensor, rounding: E4M3Rounding) -> torch.Tensor:
    """float32 E4M3 values of float32 ``pre`` (already clamped to E4M3's range).

    ``NEAREST_EVEN``: torch's cast. ``HALF_UP_UE4M3``: ggml's ``ggml_fp32_to_ue4m3``
    (ggml/src/ggml-impl.h @0c1e57098bba) on the float32 bits: 0 for ``pre <= 0`` or NaN; below
    2**-6 ``(int)(pre * 512 + 0.5)`` capped at 7 (in units of 2**-9); otherwise the mantissa's top
    3 bits plus its 4th (half up, a carry raising the exponent), an exponent field of 15 giving
    0x7E (448).
    """
    if rounding is E4M3Rounding.NEAREST_EVEN:
        return pre.to(torch.float8_e4m3fn).to(torch.float32)
    if rounding is E4M3Rounding.HALF_UP_UE4M3:
        x = pre.to(torch.float32).clamp(max=E4M3_MAX)
        bits = x.view(torch.int32)
        exponent = ((bits >> 23) & 0xFF) - 127 + 7  # the E4M3 exponent field (bias 7)
        mantissa = ((bits >> 20) & 0x7) + ((bits >> 19) & 0x1)  # half up
        carry = mantissa > 7
        exponent = exponent + carry.to(torch.int32)
        normal = (exponent << 3) | torch.where(carry, 0, mantissa)
        normal = torch.where(exponent >= 15, 0x7E, normal)
        sub = (x * 512.0 + 0.5).to(torch.int32).clamp_(max=7)  # float32 ops, truncation
        code = torch.where(((bits >> 23) & 0xFF) - 127 + 7 <= 0, sub, normal)
        code = torch.where(x > 0, code, 0)  # also NaN
        return code.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    raise NotImplementedError(f"E4M3 rounding {rounding}")  # pragma: no cover


def block_scales_from_amax(
    amax: torch.Tensor,
    global_scale: torch.Tensor,
    convention: str | ArithmeticOrder = OrderName.VLLM_KERNEL,
    target: float = E2M1_MAX,
) -> torch.Tensor:
    """float32 block scales (E4M3 values) mapping each block max ``amax [..., nb]`` to ``target``.

    ``amax`` is in the input dtype (the compressed-tensors order divides in it); ``target`` is 6
    for plain NVFP4 (other values serve the scale-selection options); ``global_scale`` is the
    tensor scale in the order's form (:attr:`TensorScale.arithmetic`: the DECODE scale ``d`` for
    the modelopt order). The order's ``block_scale`` rule, clamp, ``zero_block_scale`` and
    ``zero_scale_replacement`` apply (see :mod:`nvfp4lab.orders`).
    """
    order = get_order(convention)
    rule = order.block_scale
    if rule is BlockScaleRule.ENCODE_TIMES_AMAX_TIMES_INVERSE_TARGET:
        pre = global_scale * (amax.to(torch.float32) * (1.0 / target))
    elif rule is BlockScaleRule.ENCODE_TIMES_AMAX_OVER_TARGET_IN_INPUT_DTYPE:
        # Division in the input dtype by a same-device tensor, as compressed-tensors does (a
        # Python-number divisor would become a reciprocal multiply on CUDA).
        divisor = torch.tensor(target, dtype=amax.dtype, device=amax.device)
        pre = global_scale * (amax / divisor).to(torch.float32)
    elif rule is BlockScaleRule.AMAX_OVER_TARGET_TIMES_DECODE:
        pre = amax.to(torch.float32) / (target * global_scale)
    elif rule is BlockScaleRule.PRESCALED_AMAX_OVER_TARGET:
        # the max of the pre-scaled elements f32(gs * x) is f32(gs * amax_b); then a true float32
        # division by a same-device tensor (llama.cpp's amax / 6.0f)
        divisor = torch.tensor(target, dtype=torch.float32, device=amax.device)
        pre = (global_scale * amax.to(torch.float32)) / divisor
    else:  # pragma: no cover - a new rule must be taught here
        raise NotImplementedError(f"block-scale rule {rule} of the {order.name} order")
    if order.zero_block_scale is not None:
        pre = torch.where(pre == 0, order.zero_block_scale, pre)
    low = order.min_block_scale if order.min_block_scale > 0 else -E4M3_MAX
    scales = _round_e4m3(pre.clamp_(low, E4M3_MAX), order.e4m3_rounding)
    if order.zero_scale_replacement is not None:
        scales = torch.where(scales == 0, order.zero_scale_replacement, scales)
    return scales


#: Deprecated alias of :func:`block_scales_from_amax` (the same function), kept for one
#: release: the name did not say that it takes the blocks' maxima, not the blocks
#: (:func:`nvfp4lab.blocks.block_scales_from_blocks` takes the blocks).
block_scales = block_scales_from_amax


def element_multiplier(scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The multiply-by-inverse rule's per-block multiplier ``m = 1 / (s * (1/gs))``, float32 of
    ``scales``' shape (0 where ``s == 0``), for float32 block ``scales`` and the ENCODE tensor
    scale ``gs`` (float32 ``[1]``): the elements scale as ``x * m`` (:func:`element_scaler`)."""
    multiplier = torch.reciprocal(scales * torch.reciprocal(global_scale))
    return torch.where(scales == 0, 0.0, multiplier)


def element_scaler(
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    convention: str | ArithmeticOrder = OrderName.VLLM_KERNEL,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The order's element scaling at fixed float32 block ``scales [..., nb]``, its per-block
    factor computed once: a function of ``blocks [..., nb, B]`` returning float32
    ``x * gs / s`` clamped to ±6. ``scale_elements(b, s, gs, order)`` is
    ``element_scaler(s, gs, order)(b)`` (GPTQ rounds the 16 columns of a group at one scale).

    ``MULTIPLY_BY_INVERSE`` (kernel): a multiply by ``m = 1 / (s * (1/gs))`` (0 where ``s == 0``);
    ``DIVIDE_BY_SCALE_OVER_ENCODE`` (compressed-tensors): a division by ``s / gs``;
    ``DIVIDE_BY_SCALE_TIMES_DECODE`` (modelopt): a division by ``s * d``.
    ``PRESCALE_ONLY`` (llama.cpp): ``f32(x * gs)`` only, neither divided by ``s`` nor clamped (the
    E2M1 step, :func:`nvfp4lab.blocks.encode_blocks`, scales the table by ``s`` instead).
    """
    order = get_order(convention)
    rule = order.element_scaling
    if rule is ElementScaling.MULTIPLY_BY_INVERSE:
        multiplier = element_multiplier(scales, global_scale).unsqueeze(-1)

        def scaled(blocks: torch.Tensor) -> torch.Tensor:
            return (blocks.to(torch.float32) * multiplier).clamp_(-E2M1_MAX, E2M1_MAX)

        return scaled
    if rule is ElementScaling.PRESCALE_ONLY:

        def prescaled(blocks: torch.Tensor) -> torch.Tensor:
            return blocks.to(torch.float32) * global_scale

        return prescaled
    if rule is ElementScaling.DIVIDE_BY_SCALE_OVER_ENCODE:
        divisor = (scales / global_scale).unsqueeze(-1)
    elif rule is ElementScaling.DIVIDE_BY_SCALE_TIMES_DECODE:
        divisor = (scales * global_scale).unsqueeze(-1)
    else:  # pragma: no cover - a new rule must be taught here
        raise NotImplementedError(f"element scaling {rule} of the {order.name} order")

    def divided(blocks: torch.Tensor) -> torch.Tensor:
        return (blocks.to(torch.float32) / divisor).clamp_(-E2M1_MAX, E2M1_MAX)

    return divided


def scale_elements(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    convention: str | ArithmeticOrder = OrderName.VLLM_KERNEL,
) -> torch.Tensor:
    """float32 ``x * gs / s`` clamped to ±6 for ``blocks [..., nb, B]`` and float32 ``scales``,
    by the order's :class:`~nvfp4lab.orders.ElementScaling` (``global_scale`` in the order's form;
    the rules: :func:`element_scaler`).
    """
    return element_scaler(scales, global_scale, convention)(blocks)
