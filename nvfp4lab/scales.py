"""NVFP4 scale arithmetic: the FP32 tensor (global) scale and the E4M3 block scales.

Global scale, two conventions (a mix-up is a classic bug):

* ENCODE, ``gs = 2688 / amax`` (2688 = 448 · 6): what compressed-tensors and vLLM checkpoints
  store (``weight_global_scale``, ``input_global_scale``) and what every nvfp4lab function
  takes and returns.
* DECODE, ``amax / 2688``: torchao's ``per_tensor_scale``, ModelOpt's ``weight_scale_2`` and
  ``input_scale``. Convert with :func:`encode_to_decode_scale` / :func:`decode_to_encode_scale`.

Block scales, per block ``b`` of a tensor with encode scale ``gs``, in two arithmetic orders:

* ``kernel`` (vLLM's float32 reference of its CUDA kernel)::

      s_b = e4m3(clamp(gs * (amax_b * f32(1/t)), -448, 448))      t = 6 for plain NVFP4
      scaled = x * (1 / (s_b * (1/gs))),  0 where s_b == 0

* ``compressed-tensors`` (compressed-tensors 0.20)::

      s_b = e4m3(clamp(gs * f32(amax_b / t in x.dtype), -448, 448)); 0 -> 0.125
      scaled = f32(x) / (s_b / gs)

* ``modelopt`` (NVIDIA ModelOpt 0.47, ``NVFP4QTensor.quantize``), written in the DECODE scale
  ``d = amax / 2688`` (ModelOpt's ``weight_scale_2``; the functions below take ``d`` in place of
  ``gs`` for this order)::

      s_b = e4m3(clamp(amax_b / f32(t * d), 2^-9, 448))      (1 for an all-zero block)
      scaled = f32(x) / f32(s_b * d)
      decode: value * f32(s_b * d)

``torch.float8_e4m3fn`` casts do not saturate, hence the explicit clamp to ±448.
"""

from __future__ import annotations

import math
import numbers

import torch

from nvfp4lab.constants import (
    CT_ZERO_SCALE_REPLACEMENT,
    E2M1_MAX,
    E4M3_MAX,
    GLOBAL_SCALE_NUMERATOR,
)
from nvfp4lab.vocab import Convention

__all__ = [
    "KERNEL_MAX_GLOBAL_SCALE",
    "MODELOPT_MIN_BLOCK_SCALE",
    "abs_max",
    "as_global_scale",
    "block_scales",
    "decode_scale_from_amax",
    "decode_to_encode_scale",
    "encode_to_decode_scale",
    "global_scale_from_amax",
    "scale_elements",
]

#: ModelOpt clamps every block scale to at least E4M3's smallest subnormal.
MODELOPT_MIN_BLOCK_SCALE: float = 2.0**-9

#: Largest global scale the kernel order accepts: above it ``1/gs`` is so small that
#: ``1 / (s_b * (1/gs))`` overflows float32 for the smallest block scales (2**-9).
KERNEL_MAX_GLOBAL_SCALE: float = 2.0**116


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
    """Validate an ENCODE-convention global scale and return it as float32 ``[1]`` on ``device``.

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
                f"global_scale must be finite and > 0 (ENCODE convention, 2688/amax), got {value}. "
                "A DECODE-convention scale (amax/2688, e.g. ModelOpt weight_scale_2 or torchao "
                "per_tensor_scale) must be inverted first: pass 1/scale."
            )
    return gs


def global_scale_from_amax(
    amax: torch.Tensor, convention: str, numerator: float = GLOBAL_SCALE_NUMERATOR
) -> torch.Tensor:
    """float32 ``[1]`` ENCODE scale ``numerator / amax`` from a finite 0-d ``amax`` (input dtype).

    ``kernel``: a true float32 division (``2688 / tensor`` would be reciprocal-then-multiply in
    torch), capped at :data:`KERNEL_MAX_GLOBAL_SCALE`. ``compressed-tensors``: exactly
    compressed-tensors' expression, torch's ``2688 / t`` = ``reciprocal(t) * 2688`` with each
    step rounded to the input dtype, amax clamped below at ``finfo(dtype).tiny``. Either way a
    non-finite or non-positive result becomes 1.0 (compressed-tensors' rule).
    """
    if convention == Convention.KERNEL:
        gs = torch.full_like(amax, numerator, dtype=torch.float32) / amax.float()
        gs = torch.where(amax > 0, gs.clamp(max=KERNEL_MAX_GLOBAL_SCALE), 1.0)
    else:
        tiny = torch.finfo(amax.dtype).tiny
        gs = (numerator / amax.clamp(min=tiny)).to(torch.float32)
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


def encode_to_decode_scale(global_scale: torch.Tensor | float) -> torch.Tensor:
    """ENCODE (2688/amax, compressed-tensors) -> DECODE (amax/2688, torchao/ModelOpt): ``1/x``."""
    return torch.reciprocal(as_global_scale(global_scale))


def decode_to_encode_scale(decode_scale: torch.Tensor | float) -> torch.Tensor:
    """DECODE (amax/2688) -> ENCODE (2688/amax) convention: ``1/x``."""
    return torch.reciprocal(as_global_scale(decode_scale))


def block_scales(
    amax: torch.Tensor,
    global_scale: torch.Tensor,
    convention: str = Convention.KERNEL,
    target: float = E2M1_MAX,
) -> torch.Tensor:
    """float32 block scales (E4M3 values) mapping each block max ``amax [..., nb]`` to ``target``.

    ``amax`` is in the input dtype (the compressed-tensors order divides in it); ``target`` is 6
    for plain NVFP4 (other values serve the scale-selection options). Zero scales stay zero in
    the kernel order and become 0.125 in the compressed-tensors order; the modelopt order
    (``global_scale`` = the DECODE scale d) divides by ``t * d`` and clamps to [2^-9, 448].
    """
    if convention == Convention.KERNEL:
        pre = global_scale * (amax.to(torch.float32) * (1.0 / target))
        return pre.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    if convention == Convention.MODELOPT:  # ``global_scale`` is the DECODE scale here
        pre = amax.to(torch.float32) / (target * global_scale)
        pre = torch.where(pre == 0, 1.0, pre).clamp_(MODELOPT_MIN_BLOCK_SCALE, E4M3_MAX)
        return pre.to(torch.float8_e4m3fn).to(torch.float32)
    # Division in the input dtype by a same-device tensor, as compressed-tensors does (a
    # Python-number divisor would become a reciprocal multiply on CUDA).
    divisor = torch.tensor(target, dtype=amax.dtype, device=amax.device)
    pre = global_scale * (amax / divisor).to(torch.float32)
    scales = pre.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return torch.where(scales == 0, CT_ZERO_SCALE_REPLACEMENT, scales)


def scale_elements(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    convention: str = Convention.KERNEL,
) -> torch.Tensor:
    """float32 ``x * gs / s`` clamped to ±6 for ``blocks [..., nb, B]`` and float32 ``scales``.

    Kernel order: a multiply by ``m = 1 / (s * (1/gs))`` (0 where ``s == 0``); compressed-tensors
    order: a division by ``s / gs``; modelopt: a division by ``s * d`` (``global_scale`` = d).
    """
    if convention == Convention.KERNEL:
        multiplier = torch.reciprocal(scales * torch.reciprocal(global_scale))
        multiplier = torch.where(scales == 0, 0.0, multiplier)
        scaled = blocks.to(torch.float32) * multiplier.unsqueeze(-1)
    elif convention == Convention.MODELOPT:  # ``global_scale`` is the DECODE scale here
        scaled = blocks.to(torch.float32) / (scales * global_scale).unsqueeze(-1)
    else:
        scaled = blocks.to(torch.float32) / (scales / global_scale).unsqueeze(-1)
    return scaled.clamp_(-E2M1_MAX, E2M1_MAX)
