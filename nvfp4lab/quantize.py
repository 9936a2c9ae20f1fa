"""NVFP4 quantize / dequantize / fake_quantize in two exact arithmetic orders.

``convention="kernel"`` (default) follows vLLM's float32 reference of its CUDA quantization kernel,
per 16-block ``b`` with ENCODE global scale ``gs``::

    amax_b = max |x|                                    (float32)
    s_b    = e4m3(clamp(gs * (amax_b * f32(1/6)), -448, 448))
    m_b    = 1 / (s_b * (1/gs)),  0 where s_b == 0
    code   = RNE_E2M1(clamp(x * m_b, -6, 6))

``convention="compressed-tensors"`` reproduces compressed-tensors 0.20 bit for bit
(``generate_gparam`` + ``calculate_qparams`` + ``quantize_and_pack_fp4``)::

    gs     = 2688 / amax              (in x.dtype, then float32; 1.0 if not finite)
    s_b    = e4m3(clamp(gs * f32(amax_b / 6 in x.dtype), -448, 448)); 0 -> 0.125
    code   = RNE_E2M1(clamp(f32(x) / (s_b / gs), -6, 6))

Both decode as ``value(code) * (s_b / gs)`` in float32, cast to the wanted dtype. The two orders
disagree on a small fraction of codes (mostly bf16/fp16 inputs); both are legitimate.

Input policy: fp32/bf16/fp16 tensors ``[..., K]`` (any strides, any device, meta gives shapes);
``K`` must be a multiple of the block size unless ``pad=True`` (zero padding, removed again on
dequantize). NaN/Inf raise by default (``nonfinite="raise"``, naming the count and first index);
``nonfinite="propagate"`` runs the arithmetic as is (a NaN makes its block's scale NaN, an Inf
saturates to ±6 under an explicit global scale). An all-zero tensor, or one whose amax is so small
that ``2688/amax`` is not finite, gets ``global_scale = 1.0`` (compressed-tensors' rule) and
quantizes to zeros: NVFP4 cannot represent tensors with amax below about 1e-32.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from nvfp4lab.constants import (
    BLOCK_SIZE,
    CT_ZERO_SCALE_REPLACEMENT,
    E2M1_MAX,
    E4M3_MAX,
    GLOBAL_SCALE_NUMERATOR,
)
from nvfp4lab.e2m1 import pack_fp4, round_to_e2m1_codes
from nvfp4lab.tensor import NVFP4Tensor, as_global_scale, block_chunks, decode_blocks

__all__ = [
    "CONVENTIONS",
    "KERNEL_MAX_GLOBAL_SCALE",
    "abs_max",
    "block_scales",
    "compute_global_scale",
    "decode_to_encode_scale",
    "dequantize",
    "encode_to_decode_scale",
    "fake_quantize",
    "quantize",
    "quantize_blocks",
    "scale_elements",
    "split_blocks",
]

Convention = Literal["kernel", "compressed-tensors"]
NonFinitePolicy = Literal["raise", "propagate"]
CONVENTIONS: tuple[str, ...] = ("kernel", "compressed-tensors")
NONFINITE_POLICIES: tuple[str, ...] = ("raise", "propagate")
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

#: Largest global scale the kernel order accepts: above it ``1/gs`` is so small that
#: ``1 / (s_b * (1/gs))`` overflows float32 for the smallest block scales (2**-9).
KERNEL_MAX_GLOBAL_SCALE: float = 2.0**116


def _check_choice(name: str, value: object, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(f"unknown {name} {value!r}; accepted values: {', '.join(accepted)}")


def _check_input(x: torch.Tensor, what: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        hint = " (convert with .float())" if x.is_floating_point() or x.is_complex() else ""
        raise TypeError(
            f"NVFP4 quantization takes float32, bfloat16 or float16 input; {what} has dtype "
            f"{x.dtype}{hint}"
        )
    if x.ndim == 0:
        raise ValueError(f"{what} must have at least one dimension (the K axis), got a 0-d tensor")


def _finite_amax(x: torch.Tensor, policy: str) -> torch.Tensor:
    """``abs_max(x)`` of the finite values; raises under ``policy="raise"`` if there are others.

    One ``aminmax`` pass in the common all-finite case (NaN and Inf propagate into it).
    """
    _check_choice("nonfinite policy", policy, NONFINITE_POLICIES)
    amax = abs_max(x)
    if x.is_meta or bool(torch.isfinite(amax)):
        return amax
    finite = torch.isfinite(x)
    if policy == "raise":
        bad = ~finite
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"input of shape {tuple(x.shape)} holds {int(bad.sum())} NaN/Inf value(s), first at "
            f"index {first} (value {x[first].item()}); clean the input, or pass "
            "nonfinite='propagate' to quantize it anyway (NaN blocks get NaN scales)"
        )
    # "propagate": NaN/Inf must not set the scale of the finite values.
    return abs_max(torch.where(finite, x, 0))


def split_blocks(
    x: torch.Tensor, block_size: int, pad: bool = False, what: str = "NVFP4"
) -> torch.Tensor:
    """View ``x [..., K]`` as ``[..., K/block, block]``, zero-padding K when ``pad``.

    A K that is not a multiple of ``block_size`` without ``pad`` raises ValueError naming the
    shape, the format ``what`` and the fix.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 or (
        block_size % 2
    ):
        raise ValueError(f"block_size must be a positive even integer, got {block_size!r}")
    if not isinstance(pad, bool):
        raise ValueError(f"pad must be True or False, got {pad!r}")
    k = x.shape[-1]
    if k % block_size:
        if not pad:
            raise ValueError(
                f"{what}: the last dimension K={k} of shape {tuple(x.shape)} is not a multiple "
                f"of {block_size}; pass pad=True to zero-pad K to "
                f"{-(-k // block_size) * block_size}"
            )
        x = F.pad(x, (0, -k % block_size))
    return x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


def abs_max(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``max |x|`` over all elements (0-d) or along ``dim``, exact, in ``x.dtype``; 0 when empty.

    Computed as ``max(max(x), -min(x))`` with ``torch.aminmax`` (no ``|x|`` temporary; several
    times faster than ``vector_norm(ord=inf)``), always ``+0.0`` for zeros; NaN propagates.
    """
    if dim is None:
        if x.numel() == 0:
            return x.new_zeros(())
        low, high = torch.aminmax(x)
    else:
        if x.numel() == 0 or x.shape[dim] == 0:
            shape = list(x.shape)
            del shape[dim]
            return x.new_zeros(shape)
        low, high = torch.aminmax(x, dim=dim)
    return torch.maximum(high, -low).abs()


def compute_global_scale(
    x: torch.Tensor,
    *,
    convention: Convention = "kernel",
    numerator: float = GLOBAL_SCALE_NUMERATOR,
) -> torch.Tensor:
    """ENCODE-convention global scale ``2688 / amax(|x|)`` as float32 ``[1]``.

    ``numerator``: 2688 = 448·6 for NVFP4 (research variants use others, e.g. Four Over Six's
    1536 = 256·6).

    ``kernel``: the division in float32. ``compressed-tensors``: amax clamped below at
    ``finfo(x.dtype).tiny`` and the division done in ``x.dtype`` (a bf16 model gets a
    bf16-rounded scale; fp16 overflows for amax < 2688/65504 ≈ 0.041), then cast to float32.
    NaN/Inf entries are ignored (they only reach here under ``nonfinite="propagate"``).
    Either way a non-finite or non-positive result becomes 1.0 (compressed-tensors' rule); the
    kernel order also caps the scale at ``KERNEL_MAX_GLOBAL_SCALE`` (2**116, reached only for
    amax < 3.2e-32) so that its reciprocal-multiply arithmetic cannot overflow.
    """
    _check_input(x)
    _check_choice("convention", convention, CONVENTIONS)
    if x.is_meta:
        return torch.empty(1, dtype=torch.float32, device="meta")
    return _global_scale_from_amax(_finite_amax(x.detach(), "propagate"), convention, numerator)


def _global_scale_from_amax(
    amax: torch.Tensor, convention: str, numerator: float = GLOBAL_SCALE_NUMERATOR
) -> torch.Tensor:
    """float32 ``[1]`` encode scale from a finite 0-d ``amax`` in the input dtype."""
    if convention == "kernel":
        # A true float32 division (``2688 / tensor`` would be reciprocal-then-multiply in torch).
        gs = torch.full_like(amax, numerator, dtype=torch.float32) / amax.float()
        gs = torch.where(amax > 0, gs.clamp(max=KERNEL_MAX_GLOBAL_SCALE), 1.0)
    else:
        # Exactly compressed-tensors' expression: torch evaluates ``2688 / t`` as
        # ``reciprocal(t) * 2688``, each step rounded to the input dtype.
        tiny = torch.finfo(amax.dtype).tiny
        gs = (numerator / amax.clamp(min=tiny)).to(torch.float32)
    gs = torch.where(torch.isfinite(gs) & (gs > 0), gs, torch.ones_like(gs))
    return gs.reshape(1)


def encode_to_decode_scale(global_scale: torch.Tensor | float) -> torch.Tensor:
    """ENCODE (2688/amax, compressed-tensors) -> DECODE (amax/2688, torchao/ModelOpt): ``1/x``."""
    return torch.reciprocal(as_global_scale(global_scale))


def decode_to_encode_scale(decode_scale: torch.Tensor | float) -> torch.Tensor:
    """DECODE (amax/2688) -> ENCODE (2688/amax) convention: ``1/x``."""
    return torch.reciprocal(as_global_scale(decode_scale))


def block_scales(
    amax: torch.Tensor,
    global_scale: torch.Tensor,
    convention: Convention = "kernel",
    target: float = E2M1_MAX,
) -> torch.Tensor:
    """float32 block scales (E4M3 values) mapping each block max ``amax [..., nb]`` to ``target``.

    ``amax`` is in the input dtype (the compressed-tensors order divides in it); ``target`` is 6
    for plain NVFP4 (other values serve the scale-selection variants). Zero scales stay zero in
    the kernel order and become 0.125 in the compressed-tensors order.
    """
    if convention == "kernel":
        pre = global_scale * (amax.to(torch.float32) * (1.0 / target))
        return pre.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
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
    convention: Convention = "kernel",
) -> torch.Tensor:
    """float32 ``x * gs / s`` clamped to ±6 for ``blocks [..., nb, B]`` and float32 ``scales``.

    Kernel order: a multiply by ``m = 1 / (s * (1/gs))`` (0 where ``s == 0``); compressed-tensors
    order: a division by ``s / gs``.
    """
    if convention == "kernel":
        multiplier = torch.reciprocal(scales * torch.reciprocal(global_scale))
        multiplier = torch.where(scales == 0, 0.0, multiplier)
        scaled = blocks.to(torch.float32) * multiplier.unsqueeze(-1)
    else:
        scaled = blocks.to(torch.float32) / (scales / global_scale).unsqueeze(-1)
    return scaled.clamp_(-E2M1_MAX, E2M1_MAX)


def quantize_blocks(
    blocks: torch.Tensor, global_scale: torch.Tensor, convention: Convention = "kernel"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Core arithmetic on ``blocks [..., nb, block]``.

    Returns (codes uint8 of the blocks' shape, scales float8_e4m3fn ``[..., nb]``).
    ``global_scale`` is float32 ``[1]`` (encode convention) on the blocks' device. No checks.
    """
    scales = block_scales(abs_max(blocks, -1), global_scale, convention)
    codes = round_to_e2m1_codes(scale_elements(blocks, scales, global_scale, convention))
    return codes, scales.to(torch.float8_e4m3fn)


def _prepare(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None,
    block_size: int,
    convention: str,
    pad: bool,
    nonfinite: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate; return (blocks [..., nb, block], global scale float32 [1] on x.device)."""
    _check_input(x)
    _check_choice("convention", convention, CONVENTIONS)
    x = x.detach()  # quantization is a non-differentiable rounding
    blocks = split_blocks(x, block_size, pad)
    if x.is_meta:
        gs_meta = global_scale if global_scale is not None else torch.empty(1, device="meta")
        return blocks, as_global_scale(gs_meta, "meta")
    amax = _finite_amax(x, nonfinite)
    if global_scale is None:
        return blocks, _global_scale_from_amax(amax, convention)
    gs = as_global_scale(global_scale, x.device)
    if convention == "kernel" and not gs.is_meta and float(gs) > KERNEL_MAX_GLOBAL_SCALE:
        raise ValueError(
            f"global_scale {float(gs):.4g} exceeds {KERNEL_MAX_GLOBAL_SCALE:.4g} (2**116): the "
            "kernel order's 1/(s * (1/gs)) overflows float32 there; use a smaller global scale "
            "(any value <= 2688/amax is valid) or convention='compressed-tensors'"
        )
    return blocks, gs


def quantize(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    *,
    block_size: int = BLOCK_SIZE,
    convention: Convention = "kernel",
    pad: bool = False,
    nonfinite: NonFinitePolicy = "raise",
) -> NVFP4Tensor:
    """Quantize ``x`` (fp32/bf16/fp16, ``[..., K]``) to an :class:`NVFP4Tensor`.

    ``global_scale``: ENCODE convention (2688/amax), float or one-element tensor; ``None``
    computes it from ``amax(|x|)`` with :func:`compute_global_scale`: in the kernel convention
    a true float32 division ``f32(2688) / f32(amax)`` (NOT torch's ``2688 / t``, which is
    ``reciprocal(t) * 2688`` and differs by one ulp for about a quarter of amax values); pass
    the scale explicitly to reproduce another implementation's choice. Not differentiable.
    See the module docstring for the arithmetic, padding and the NaN/Inf policy.
    """
    blocks, gs = _prepare(x, global_scale, block_size, convention, pad, nonfinite)
    lead, nb = blocks.shape[:-2], blocks.shape[-2]
    if x.is_meta:
        packed = torch.empty((*lead, nb * block_size // 2), dtype=torch.uint8, device="meta")
        scales = torch.empty((*lead, nb), dtype=torch.float8_e4m3fn, device="meta")
    else:
        flat = blocks.reshape(-1, block_size)
        packed = torch.empty((flat.shape[0], block_size // 2), dtype=torch.uint8, device=x.device)
        scales = torch.empty(flat.shape[0], dtype=torch.float8_e4m3fn, device=x.device)
        for part in block_chunks(flat.shape[0], block_size, x.device):
            codes, scales[part] = quantize_blocks(flat[part], gs, convention)
            packed[part] = pack_fp4(codes)
        packed = packed.reshape(*lead, nb * block_size // 2)
        scales = scales.reshape(*lead, nb)
    return NVFP4Tensor(
        packed=packed,
        scales=scales,
        global_scale=gs,
        shape=x.shape,
        dtype=x.dtype,
        block_size=block_size,
    )


def dequantize(q: NVFP4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Decode ``q`` to ``dtype`` (default: its original dtype), shape ``q.shape``."""
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"dequantize expects an NVFP4Tensor, got {type(q).__name__}")
    return q.dequantize(dtype)


def fake_quantize(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    *,
    block_size: int = BLOCK_SIZE,
    convention: Convention = "kernel",
    pad: bool = False,
    nonfinite: NonFinitePolicy = "raise",
) -> torch.Tensor:
    """Quantize then dequantize, returning ``x.dtype`` and ``x.shape`` (no packing round trip).

    Equal bit for bit to ``dequantize(quantize(x, ...), x.dtype)``.
    """
    blocks, gs = _prepare(x, global_scale, block_size, convention, pad, nonfinite)
    if x.is_meta:
        return torch.empty_like(x)
    flat = blocks.reshape(-1, block_size)
    out = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
    for part in block_chunks(flat.shape[0], block_size, x.device):
        codes, scales = quantize_blocks(flat[part], gs, convention)
        out[part] = decode_blocks(codes, scales, gs)
    out = out.reshape(*blocks.shape[:-2], blocks.shape[-2] * block_size)
    return out if out.shape[-1] == x.shape[-1] else out[..., : x.shape[-1]]
