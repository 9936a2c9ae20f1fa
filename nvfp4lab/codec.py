"""NVFP4 quantize / dequantize / fake_quantize: ONE block pipeline, plain NVFP4 by default.

Every call runs the same steps: check the input once, pad/rotate it, choose the tensor scale,
cut it into blocks, then per block pick an E4M3 scale and round the elements to E2M1 codes.
Plain NVFP4 is the default of every option; the research options change one step each.

Arithmetic (``convention``, the order of operations): a :class:`~nvfp4lab.vocab.OrderName` name
or an :class:`~nvfp4lab.orders.ArithmeticOrder`; :mod:`nvfp4lab.orders` states each order step by
step and this module only reads those steps. ``"kernel"`` (default) is vLLM's float32 reference
of its CUDA kernel, ``"compressed-tensors"`` compressed-tensors 0.20 bit for bit, ``"modelopt"``
ModelOpt 0.47's ``NVFP4QTensor`` (written in the DECODE scale, which its tensors keep),
``"llama.cpp"`` ggml's NVFP4 quantizer (no tensor scale: ``global_scale`` 1.0; a given
``global_scale`` multiplies the elements first, so ``quantize(x, gs, convention="llama.cpp")``
is ggml's quantizer run on ``f32(x * gs)``, decoded as ``value * s / gs``). The
first three disagree on a small fraction of codes (mostly bf16/fp16 inputs); llama.cpp's, without
a tensor scale, on many more (its block scales alone span E4M3's range). The block-level functions
(:mod:`nvfp4lab.blocks`, re-exported here) are the arithmetic every NVFP4 path calls, GPTQ
included; the input check, the NaN/Inf-aware amax and the cut into blocks are
:mod:`nvfp4lab.inputs`' (``check_input``, ``finite_amax``, ``split_blocks`` re-exported here).

Tensor scale (``global_scale``, ENCODE form ``2688 / amax``)
    ``None`` (default) computes it from ``amax(|x|)`` (:func:`compute_global_scale`; with a
    non-default ``scale_selection`` the numerator is 1536 = 256·6, see below); a float or a
    one-element tensor is used as given; ``1.0`` means "no tensor scale" (the block scales alone
    must then cover the data's range, E4M3 spanning 2^-9..448). A DECODE-form scale
    (ModelOpt ``weight_scale_2``, torchao ``per_tensor_scale``) must be inverted first.

Blocks (``block_size``)
    ``16`` (default) or any positive even int: one scale per that many elements along K.
    ``(rows, cols)``: one scale per ``rows × cols`` tile of a 2-D ``[M, K]`` tensor, e.g.
    ``(16, 16)``; the packed form repeats each tile's scale on its rows, so any NVFP4 kernel
    reads it. ``pad=True`` zero-pads K to a whole number of blocks (1-D blocks only).

Research options (defaults reproduce plain NVFP4 bit for bit)
    ``rounding``: ``"rne"`` | ``"stochastic"`` (round up with probability equal to the fractional
    distance, so ``E[q] = v`` inside ±6; needs ``generator=``, a ``torch.Generator`` or an int
    seed for a new generator on the input's device).
    ``scale_selection``: ``"amax"`` (block max → 6) | ``"four_over_six"`` (try max → 6 and max → 4,
    keep the lower block squared error; "Four Over Six", arXiv 2512.02010) | ``"mse_search"``
    (try each of ``search_targets``, default :data:`DEFAULT_SEARCH_TARGETS`). The non-default
    selections compute the tensor scale with 256 in place of E4M3's 448 (the paper's choice), so
    a 1.5× larger block scale still fits E4M3.
    ``hadamard``: ``None`` | int seed: rotate along K by the seeded 16-point block Hadamard of
    :mod:`nvfp4lab.hadamard` first. :func:`fake_quantize` rotates back (float32, one rounding);
    :func:`quantize` returns a :class:`~nvfp4lab.tensor.RotatedNVFP4Tensor`.

Fused kernels (``fused=``, default None = the ``NVFP4LAB_FUSED`` setting): plain options (16-element
blocks, ``rounding="rne"``, ``scale_selection="amax"``, no ``hadamard``, ``nonfinite="raise"``,
no ``decode_scale``) on a CPU/CUDA tensor with K a multiple of 16 run the fused kernels of
:mod:`nvfp4lab.kernels` when it allows (bit for bit the same results; see there for the ``auto``
rule): on a CPU the C++ block encode from the first call, in every order
(:mod:`nvfp4lab.kernels.block_encode`), elsewhere the compiled graphs (the kernel and
compressed-tensors orders); everything else runs the eager pipeline.

Input policy: fp32/bf16/fp16 tensors ``[..., K]`` (any strides, any device; meta gives shapes).
NaN/Inf raise by default (``nonfinite="raise"``, naming the count and first index);
``"propagate"`` runs the arithmetic as is (a NaN makes its block's scale NaN). An all-zero tensor,
or one whose amax is so small that ``2688/amax`` is not finite, gets ``global_scale = 1.0``
(compressed-tensors' rule) and quantizes to zeros. A computed scale below ``2688/amax`` (the
kernel order's cap 2**116, or that 1.0) under which non-zero blocks underflow to zero warns
(:class:`ScaleUnderflowWarning`, with the remedy: rescale the input by a power of two).

Gradients: :func:`quantize` returns integer codes and is not differentiable (its input is
detached). :func:`fake_quantize` is a straight-through estimator (STE) for quantization-aware
training: the forward pass is the quantize-dequantize result bit for bit, the backward pass hands
the output gradient to ``x`` unchanged EVERYWHERE, values clamped to the largest representable
magnitude (``6 · 448 / global_scale``, reachable only with an explicit ``global_scale``) included:
plain STE, as torchao's NVFP4 fake quantizer and ModelOpt's block quantizer (its default
``pass_through_bwd=True``) do. Scales get no gradient.

Measured on seeded 2048×2048 float32 tensors (NMSE; tests/formats/test_nvfp4.py pins them):
defaults 9.04e-3 on N(0,1) (20.44 dB) and 8.22e-3 on Student-t(ν=3); four_over_six 7.56e-3 /
7.57e-3; mse_search 6.77e-3 / 7.08e-3; stochastic 2.08e-2 / 2.03e-2; 16×16 tiles 1.24e-2 /
3.29e-2; hadamard 9.04e-3 / 9.69e-3 (with 16-element blocks an outlier only costs its own block;
rotating makes heavy-tailed blocks Gaussian, whose NMSE is higher).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from nvfp4lab import kernels
from nvfp4lab.blocks import (  # block_scales_of: the deprecated alias, re-exported
    block_scales_from_blocks,
    block_scales_of,
    decode_codes,
    encode_blocks,
    quantize_blocks,
)
from nvfp4lab.constants import BLOCK_SIZE, E2M1_MAX, GLOBAL_SCALE_NUMERATOR
from nvfp4lab.e2m1 import pack_fp4
from nvfp4lab.hadamard import check_seed, hadamard_transform
from nvfp4lab.inputs import (
    check_geometry,
    check_input,
    finite_amax,
    from_blocks,
    split_blocks,
    to_blocks,
)
from nvfp4lab.kernels import quantize as fused_kernels
from nvfp4lab.options import NVFP4Options, nvfp4_options, order_argument
from nvfp4lab.orders import KERNEL_MAX_GLOBAL_SCALE, ArithmeticOrder, TensorScaleRule
from nvfp4lab.orders import get as get_order
from nvfp4lab.scales import (
    TensorScale,
    abs_max,
    as_global_scale,
    global_scale_from_amax,
    tensor_scale_from_amax,
)
from nvfp4lab.tensor import NVFP4Tensor, RotatedNVFP4Tensor, block_chunks, decode_blocks
from nvfp4lab.vocab import NonFinite, OrderName

__all__ = [
    "KERNEL_MAX_GLOBAL_SCALE",
    "ScaleUnderflowWarning",
    "TensorScale",
    "block_scales_from_blocks",
    "block_scales_of",
    "check_input",
    "compute_global_scale",
    "decode_codes",
    "dequantize",
    "encode_blocks",
    "fake_quantize",
    "finite_amax",
    "quantize",
    "quantize_blocks",
    "split_blocks",
]


class ScaleUnderflowWarning(UserWarning):
    """A global scale so small that blocks underflow E4M3 to a zero scale: an explicit one under
    which every block does, or a computed one that fell short of ``2688/amax`` (the kernel
    order's cap, 1.0 where ``2688/amax`` is not finite, or the 1.0 of an order without a tensor
    scale, llama.cpp's) under which some non-zero block does."""


def _warn_if_everything_underflows(gs: float, amax: float) -> None:
    """Every block scale is at most ``gs * amax / 6``; at or below 2**-10 (half of E4M3's
    smallest subnormal) all of them round to zero and the whole tensor quantizes to zeros: the
    classic sign of a DECODE-form scale passed where the ENCODE one is expected."""
    if amax > 0 and gs * amax / E2M1_MAX <= 2.0**-10:
        warnings.warn(
            f"global_scale {gs:.6g} maps this tensor's amax {amax:.6g} to block scales below "
            f"E4M3's smallest (2**-9): every block quantizes to zero. nvfp4lab takes the ENCODE "
            f"form, 2688/amax = {GLOBAL_SCALE_NUMERATOR / amax:.6g} here; a DECODE scale "
            "(amax/2688: torchao per_tensor_scale, ModelOpt weight_scale_2 / input_scale) must be "
            "converted with nvfp4lab.decode_to_encode_scale",
            ScaleUnderflowWarning,
            stacklevel=4,
        )


def _warn_if_blocks_vanish(
    blocks: torch.Tensor, amax: torch.Tensor, scale: TensorScale, opts: NVFP4Options
) -> None:
    """A COMPUTED tensor scale can fall below ``2688/amax``: the kernel order caps it at 2**116
    (amax < 3.2e-32) and every order takes 1.0 where ``2688/amax`` is not finite in its
    arithmetic. Warn (:class:`ScaleUnderflowWarning`) when non-zero blocks then get a zero E4M3
    scale and quantize to zeros; ``blocks [..., B]`` as the pipeline cuts them. Costs a block-max
    pass when the scale fell short (in the UNIT order, whose scale is 1: whenever amax < 1344),
    and a block-scale pass only when some block is small enough to lose its scale."""
    a, gs = float(amax), float(scale.encode)
    if not (0 < a < math.inf) or gs * a >= GLOBAL_SCALE_NUMERATOR / 2:
        return
    block_max = abs_max(blocks, -1)
    nonzero = block_max > 0
    # A zero E4M3 block scale needs the scale, about block_max · gs / 6, below half of E4M3's
    # smallest subnormal, 2**-10, in every rounding rule (orders that clamp or replace a zero
    # scale never get one); the filter keeps every block under 4 · 2**-9 (8x that threshold),
    # so ordinary data (the UNIT order, gs = 1: checked whenever amax < 1344) skips the pass.
    if not bool((nonzero & (block_max.float() * gs < 6.0 * 2.0**-7)).any()):
        return
    zero = block_scales_from_blocks(blocks, scale.arithmetic, opts.order) == 0
    lost = int((nonzero & zero).sum())
    if not lost:
        return
    order, k = opts.order, round(-math.log2(a))
    if order.tensor_scale is TensorScaleRule.UNIT:
        warnings.warn(
            f"the {order.name} order has no tensor scale (1.0): {lost} of {int(nonzero.sum())} "
            f"non-zero blocks of this tensor (amax {a:.6g}) have a block max below 6 * 2**-10 and "
            "quantize to zeros. Pass global_scale=2688/amax to pre-scale the elements as a "
            "tensor scale would",
            ScaleUnderflowWarning,
            stacklevel=_caller_level(),
        )
        return
    why = (
        f"the {order.name} order caps it at 2**{math.log2(order.max_global_scale):g}"
        if order.max_global_scale is not None and gs == order.max_global_scale
        else f"2688/amax is not finite in the {order.name} order's arithmetic, so it takes 1.0"
    )
    other = (
        f", or convention={OrderName.COMPRESSED_TENSORS.value!r} (no cap; float32 inputs)"
        if order.max_global_scale is not None and GLOBAL_SCALE_NUMERATOR / a < 3.4e38 else ""
    )
    warnings.warn(
        f"the computed global scale {gs:.6g} is below 2688/amax = {GLOBAL_SCALE_NUMERATOR / a:.6g}"
        f" for this tensor's amax {a:.6g} ({why}): {lost} of {int(nonzero.sum())} non-zero "
        f"blocks underflow E4M3 to a zero scale and quantize to zeros. Rescale the input by a "
        f"power of two (quantize x * 2**{k} and divide the dequantized result by 2**{k}){other}",
        ScaleUnderflowWarning,
        stacklevel=_caller_level(),
    )


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside this module (and torch's autograd, which
    :func:`fake_quantize` runs through when ``x`` requires grad), for the caller of
    ``_caller_level``'s caller."""
    frame, level = sys._getframe(2), 2
    while frame is not None and (
        frame.f_code.co_filename == __file__ or frame.f_globals.get("__name__", "").startswith(
            "torch.autograd")
    ):
        frame, level = frame.f_back, level + 1
    return level


def _tensor_scale(
    amax: torch.Tensor,
    global_scale: torch.Tensor | float | None,
    decode_scale: torch.Tensor | float | None,
    opts: NVFP4Options,
    device: torch.device,
) -> TensorScale:
    """Resolve the tensor scale from an ENCODE ``global_scale``, a DECODE ``decode_scale`` or
    (both None) the amax, in the form the order needs; validated, with the order's cap and the
    underflow warning."""
    order = opts.order
    if decode_scale is not None:
        return TensorScale.of(order, decode=as_global_scale(decode_scale, device))
    if global_scale is None:
        return tensor_scale_from_amax(amax, order, opts.global_scale_numerator)
    gs = as_global_scale(global_scale, device)
    _warn_if_everything_underflows(float(gs), float(amax))
    if order.max_global_scale is not None and float(gs) > order.max_global_scale:
        raise ValueError(
            f"global_scale {float(gs):.4g} exceeds {order.max_global_scale:.4g} "
            f"(2**{math.log2(order.max_global_scale):g}), the largest the {order.name} order "
            "accepts (its float32 arithmetic overflows above it); use a smaller global scale "
            "(any value <= 2688/amax is valid) or convention='compressed-tensors'"
        )
    return TensorScale.of(order, encode=gs)


def _prepare(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None,
    opts: NVFP4Options,
    decode_scale: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, TensorScale]:
    """The one input check; returns (x padded and rotated as the options say, its scale)."""
    check_input(x)
    check_geometry(x, opts)
    if global_scale is not None and decode_scale is not None:
        raise ValueError(
            "pass either global_scale (ENCODE, 2688/amax) or decode_scale (DECODE, amax/2688), "
            "not both"
        )
    x = x.detach()  # quantization is a non-differentiable rounding
    cols = opts.block_shape[1]
    if x.shape[-1] % cols:
        x = F.pad(x, (0, -x.shape[-1] % cols))
    if x.is_meta:
        gs = global_scale if global_scale is not None else torch.empty(1, device="meta")
        return x, TensorScale(as_global_scale(gs, "meta"))
    amax = finite_amax(x, opts.nonfinite)
    if opts.hadamard is not None:
        x = hadamard_transform(x, opts.hadamard)
        amax = finite_amax(x, NonFinite.PROPAGATE)
    scale = _tensor_scale(amax, global_scale, decode_scale, opts, x.device)
    if global_scale is None and decode_scale is None:
        _warn_if_blocks_vanish(to_blocks(x, opts.block_shape), amax, scale, opts)
    return x, scale


def _fused_route(
    x: object, opts: NVFP4Options, decode_scale: object, fused: bool | None
) -> bool:
    """Whether a quantize/fake_quantize call runs the fused kernels: the one rule of
    :func:`nvfp4lab.kernels.fused_route`, asked with this call's options."""
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        return False
    return kernels.fused_route(
        x.numel(), x.shape[-1], x.dtype, x.device, fused,
        block_size=opts.block_shape[1], order=opts.order,
        plain=opts.plain and decode_scale is None, native=True,
    )


def _fused_prepare(
    x: torch.Tensor, global_scale: torch.Tensor | float | None, opts: NVFP4Options
) -> tuple[fused_kernels.FirstPass, TensorScale]:
    """:func:`_prepare` for the fused path: the first pass (``max |x|``), then the same NaN/Inf
    error and tensor-scale rules as eager (from the amax that pass returns)."""
    first = fused_kernels.first_pass(x, opts.order)
    if not bool(torch.isfinite(first.amax)):
        finite_amax(x.detach(), opts.nonfinite)  # raises, naming the count and first index
    scale = _tensor_scale(first.amax, global_scale, None, opts, x.device)
    if global_scale is None:
        _warn_if_blocks_vanish(first.x.reshape(-1, BLOCK_SIZE), first.amax, scale, opts)
    return first, scale


def _generator(opts: NVFP4Options, device: torch.device) -> torch.Generator | None:
    gen = opts.generator
    if gen is None or isinstance(gen, torch.Generator):
        return gen
    return torch.Generator(device=device if device.type != "meta" else "cpu").manual_seed(gen)


def _encode_blocks(
    blocks: torch.Tensor,
    gs: torch.Tensor,
    opts: NVFP4Options,
    sink: Callable[[slice, torch.Tensor, torch.Tensor], None],
) -> None:
    """Quantize ``blocks [nb, B]`` chunk by chunk (cache-sized on CPU); ``sink(part, codes,
    scales)`` consumes each chunk's uint8 codes ``[n, B]`` and e4m3 scales ``[n]``."""
    generator = _generator(opts, blocks.device)
    for part in block_chunks(blocks.shape[0], blocks.shape[1], blocks.device):
        codes, scales = quantize_blocks(
            blocks[part], gs, opts.order,
            targets=opts.targets, rounding=opts.rounding, generator=generator,
        )
        sink(part, codes, scales)


# --------------------------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------------------------


def compute_global_scale(
    x: torch.Tensor,
    *,
    order: str | ArithmeticOrder | None = None,
    numerator: float = GLOBAL_SCALE_NUMERATOR,
    convention: str | ArithmeticOrder | None = None,
) -> torch.Tensor:
    """ENCODE-form global scale ``numerator / amax(|x|)`` as float32 ``[1]``.

    ``order`` (old keyword: ``convention``) names the arithmetic order.
    ``numerator``: 2688 = 448·6 for NVFP4 (Four Over Six uses 1536 = 256·6). ``kernel``: the
    division in float32 (NOT torch's ``2688 / t``, which is ``reciprocal(t) * 2688`` and differs
    by one ulp for about a quarter of amax values); ``compressed-tensors``: in ``x.dtype`` (a
    bf16 model gets a bf16-rounded scale; fp16 overflows for amax < 2688/65504 ≈ 0.041);
    ``modelopt``: the float32 reciprocal of ModelOpt's DECODE scale ``amax / 2688``. NaN/Inf
    entries are ignored; a non-finite or non-positive result becomes 1.0; the kernel order caps
    the scale at 2**116 (amax < 3.2e-32) so its reciprocal arithmetic cannot overflow.
    """
    check_input(x)
    order = get_order(order_argument(order, convention))
    if x.is_meta:
        return torch.empty(1, dtype=torch.float32, device="meta")
    amax = finite_amax(x.detach(), NonFinite.PROPAGATE)
    return global_scale_from_amax(amax, order, numerator)


def quantize(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    *,
    block_size: int | tuple[int, int] = BLOCK_SIZE,
    order: str | ArithmeticOrder | None = None,
    convention: str | ArithmeticOrder | None = None,
    pad: bool = False,
    nonfinite: str = NonFinite.RAISE,
    decode_scale: torch.Tensor | float | None = None,
    fused: bool | None = None,
    **options: Any,
) -> NVFP4Tensor:
    """Quantize ``x`` (fp32/bf16/fp16, ``[..., K]``) to an :class:`NVFP4Tensor`.

    ``order``: the arithmetic order, an :class:`~nvfp4lab.vocab.OrderName` name or an
    :class:`~nvfp4lab.orders.ArithmeticOrder` (``convention``: its old keyword, still accepted).
    ``global_scale``: ENCODE form (2688/amax); None computes it. ``decode_scale``: instead
    of it, the DECODE scale (amax/2688, e.g. ModelOpt's ``weight_scale_2``), used exactly by
    ``convention="modelopt"`` (whose arithmetic is written in it) and kept by the result
    (``NVFP4Tensor.decode_scale``); other conventions use its reciprocal. ``options``: the research
    options ``rounding``, ``generator``, ``scale_selection``, ``search_targets``, ``hadamard``.
    With ``hadamard`` the result is a :class:`RotatedNVFP4Tensor` holding ``x Q`` that
    dequantizes back to ``x``; with 2-D tiles each tile scale is repeated on its rows. See the
    module docstring for the arithmetic, padding, the NaN/Inf policy and ``fused``. Not
    differentiable: the result holds integer codes (``x`` is detached); for a gradient use
    :func:`fake_quantize`, a straight-through estimator.
    """
    opts = nvfp4_options(
        block_size=block_size, order=order, convention=convention, pad=pad,
        nonfinite=nonfinite, **options,
    )
    if _fused_route(x, opts, decode_scale, fused):
        first, scale = _fused_prepare(x, global_scale, opts)
        packed, scales = fused_kernels.encode(first, scale.arithmetic, opts.order)
        return NVFP4Tensor(
            packed, scales, scale.encode, shape=x.shape, dtype=x.dtype, check_scales=False,
            decode_scale=scale.decode,
        )
    xp, scale = _prepare(x, global_scale, opts, decode_scale)
    rows, cols = opts.block_shape
    lead, kp = xp.shape[:-1], xp.shape[-1]
    packed = torch.empty((*lead, kp // 2), dtype=torch.uint8, device=xp.device)
    scales = torch.empty((*lead, kp // cols), dtype=torch.float8_e4m3fn, device=xp.device)
    if not xp.is_meta:
        blocks = to_blocks(xp, opts.block_shape)
        flat = blocks.reshape(-1, blocks.shape[-1])
        if rows == 1:
            packed_rows, scale_rows = packed.view(-1, cols // 2), scales.view(-1)

            def sink(part: slice, codes: torch.Tensor, s: torch.Tensor) -> None:
                packed_rows[part] = pack_fp4(codes)
                scale_rows[part] = s

            _encode_blocks(flat, scale.arithmetic, opts, sink)
        else:
            packed, scales = _quantize_tiles(flat, blocks.shape, xp.shape, scale.arithmetic, opts)
    # Finite input gives finite non-negative scales; NaN scales only come from an explicit
    # nonfinite="propagate", which asked for them: no validation pass here.
    q = NVFP4Tensor(
        packed, scales, scale.encode, shape=x.shape, dtype=x.dtype, block_size=cols,
        check_scales=False, decode_scale=scale.decode,
    )
    return q if opts.hadamard is None else RotatedNVFP4Tensor(**vars(q), hadamard=opts.hadamard)


def _quantize_tiles(
    flat: torch.Tensor,
    tiles_shape: torch.Size,
    like: torch.Size,
    gs: torch.Tensor,
    opts: NVFP4Options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes ``[M, K/2]`` and per-row scales ``[M, K/cols]`` of 2-D tiles."""
    codes = torch.empty(flat.shape, dtype=torch.uint8, device=flat.device)
    scales = torch.empty(flat.shape[0], dtype=torch.float8_e4m3fn, device=flat.device)

    def sink(part: slice, c: torch.Tensor, s: torch.Tensor) -> None:
        codes[part], scales[part] = c, s

    _encode_blocks(flat, gs, opts, sink)
    packed = pack_fp4(from_blocks(codes.reshape(tiles_shape), like, opts.block_shape))
    per_tile = scales.reshape(tiles_shape[:-1])
    return packed, per_tile.repeat_interleave(opts.block_shape[0], dim=0)


class _StraightThrough(torch.autograd.Function):
    """Forward: ``run(x)`` (the no-grad quantize-dequantize); backward: the gradient unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        return run(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def fake_quantize(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    *,
    decode_scale: torch.Tensor | float | None = None,
    fused: bool | None = None,
    **options: Any,
) -> torch.Tensor:
    """Quantize then dequantize, returning ``x.dtype`` and ``x.shape`` (no packing round trip).

    Equal bit for bit to ``dequantize(quantize(x, ...), x.dtype)``; a Hadamard rotation is undone
    in float32 before the one rounding to ``x.dtype``. ``decode_scale``, ``fused`` and
    ``options``: as in :func:`quantize` (``block_size``, ``convention``, ``pad``, ``nonfinite``
    and the research options).

    Differentiable as a straight-through estimator: when ``x`` requires grad (and grad mode is
    on), the result does too, and its backward passes the output gradient to ``x`` unchanged at
    every element, clamped ones included (plain STE, like torchao's and ModelOpt's NVFP4 fake
    quantizers; see the module docstring). The forward values are the same bits either way.
    """
    opts = nvfp4_options(**options)
    if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
        def run(t: torch.Tensor) -> torch.Tensor:
            return _fake_quantize(t, global_scale, decode_scale, fused, opts)

        return _StraightThrough.apply(x, run)  # type: ignore[no-any-return]
    return _fake_quantize(x, global_scale, decode_scale, fused, opts)


def _fake_quantize(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None,
    decode_scale: torch.Tensor | float | None,
    fused: bool | None,
    opts: NVFP4Options,
) -> torch.Tensor:
    """:func:`fake_quantize` without autograd."""
    if _fused_route(x, opts, decode_scale, fused):
        first, scale = _fused_prepare(x, global_scale, opts)
        return fused_kernels.fake_quantize(first, scale.arithmetic, opts.order)
    xp, scale = _prepare(x, global_scale, opts, decode_scale)
    if xp.is_meta:
        return torch.empty_like(x)
    blocks = to_blocks(xp, opts.block_shape)
    flat = blocks.reshape(-1, blocks.shape[-1])
    rotated = opts.hadamard is not None
    out = torch.empty(flat.shape, dtype=torch.float32 if rotated else x.dtype, device=x.device)

    def sink(part: slice, codes: torch.Tensor, scales: torch.Tensor) -> None:
        out[part] = decode_blocks(codes, scales, scale.encode, scale.decode)

    _encode_blocks(flat, scale.arithmetic, opts, sink)
    values = from_blocks(out.reshape(blocks.shape), xp.shape, opts.block_shape)
    if rotated:
        values = hadamard_transform(values, opts.hadamard, inverse=True).to(x.dtype)  # type: ignore[arg-type]
    return values if values.shape[-1] == x.shape[-1] else values[..., : x.shape[-1]]


def dequantize(
    q: NVFP4Tensor,
    dtype: torch.dtype | None = None,
    *,
    hadamard: int | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """Decode ``q`` to ``dtype`` (default: its original dtype), shape ``q.shape``.

    A :class:`RotatedNVFP4Tensor` knows its seed and rotates back by itself (a different
    ``hadamard=`` is an error); ``hadamard=seed`` also undoes a rotation of a plain tensor's codes.
    ``fused``: as in :meth:`NVFP4Tensor.dequantize`.
    """
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"dequantize expects an NVFP4Tensor, got {type(q).__name__}")
    if isinstance(q, RotatedNVFP4Tensor):
        if hadamard not in (None, q.hadamard):
            raise ValueError(
                f"q was rotated with hadamard={q.hadamard}, not {hadamard}; omit hadamard="
            )
        return q.dequantize(dtype, fused=fused)
    if hadamard is None:
        return q.dequantize(dtype, fused=fused)
    check_seed(hadamard, "hadamard")
    values = hadamard_transform(q.dequantize(torch.float32, fused=fused), hadamard, inverse=True)
    return values.to(dtype or q.dtype)
