"""Block-level NVFP4 arithmetic in any arithmetic order: the functions every NVFP4 path calls.

The codec's pipeline (:mod:`nvfp4lab.codec`) cuts a tensor into blocks and hands them here; GPTQ
(:mod:`nvfp4lab.execution.gptq`) calls the same functions one column at a time. Each takes the
:class:`~nvfp4lab.orders.ArithmeticOrder` (or its convention's name) and the tensor scale in the
order's form (:attr:`nvfp4lab.scales.TensorScale.arithmetic`: ENCODE ``2688/amax`` for the
kernel and compressed-tensors orders, DECODE ``amax/2688`` for the modelopt order) and reads
the order's steps; none names a convention.

=================================  =================================================================
function                           computes
=================================  =================================================================
:func:`block_scales_from_blocks`   float32 E4M3 block scales of ``blocks [..., nb, B]``
:func:`encode_blocks`              uint8 E2M1 codes of blocks at given block scales
:func:`decode_codes`               float32 values of codes at given block scales (order's decode)
:func:`quantize_blocks`            both, with optional scale search over several targets
:func:`fixed_scale_codec`          encode and decode at fixed block scales, their arithmetic
                                   done once (:func:`encode_blocks`, :func:`decode_codes`, bit for
                                   bit)
=================================  =================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from nvfp4lab.constants import E2M1_MAX, E2M1_SIGN_BIT, E2M1_VALUES
from nvfp4lab.e2m1 import (
    E2M1_MIDPOINTS,
    e2m1_table,
    round_to_e2m1_codes,
    stochastic_round_to_e2m1_codes,
)
from nvfp4lab.orders import ArithmeticOrder, DecodeRule, E2M1Ties, ElementScaling
from nvfp4lab.orders import get as get_order
from nvfp4lab.scales import (
    abs_max,
    block_scales_from_amax,
    element_multiplier,
    element_scaler,
    scale_elements,
)
from nvfp4lab.tensor import block_decode_factor, decode_blocks
from nvfp4lab.vocab import OrderName, Rounding

__all__ = [
    "block_scales_from_blocks",
    "block_scales_of",
    "check_stochastic",
    "decode_codes",
    "encode_blocks",
    "fixed_scale_codec",
    "multiply_factors",
    "quantize_blocks",
]




def _first_smallest_error(magnitudes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 index 0..7 of the first E2M1 magnitude ``m`` minimizing float32 ``|m * s - a|`` for
    float32 ``magnitudes`` ``a`` and ``scales`` ``s`` of the same shape: ggml's loop itself, one
    pass per magnitude with its strict ``<`` (the slow, literal form)."""
    best = magnitudes.clone()  # magnitude 0: |0 * s - a| = a
    index = torch.zeros(magnitudes.shape, dtype=torch.uint8, device=magnitudes.device)
    for j, m in enumerate(E2M1_VALUES[1:], start=1):
        error = (scales * m - magnitudes).abs_()
        index.masked_fill_(error < best, j)
        torch.minimum(best, error, out=best)
    return index


def _nearest_scaled_table(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 codes of float32 ``values [..., nb, B]`` (the block's domain) at float32 E4M3
    ``scales [..., nb]``: the first code ``i`` in 0..15 minimizing float32 ``|E2M1(i) * s - v|``,
    as ggml's ``best_index_mxfp4`` loops with a strict ``<`` (ggml/src/ggml-quants.c
    @0c1e57098bba). For ``v >= 0`` (and NaN) no code of 8..15 can win (their errors are never
    smaller than code 0's), for ``v < 0`` no code of 1..7, and code 8's error equals code 0's: so
    the first minimum over the 8 magnitudes ``|E2M1(j) * s - |v||`` gives the index, with the
    sign bit where ``v < 0`` and the index is not 0.

    Where ``a = |v| <= 6 s`` that first minimum is the count of midpoints ``mid * s`` below
    ``a``, exactly: ``E2M1(j) * s`` and ``mid * s`` are exact in float32 (at most 7 significant
    bits), and for ``a`` between two neighbours both differences are exact (Sterbenz: each
    neighbour is at least half the next), so float32 compares as the reals do, and a tie at a
    midpoint keeps the smaller magnitude as the strict ``<`` does. Beyond ``6 s`` (a scale that
    rounded down, saturated at 448 or flushed to 0; infinities) the rounded differences can
    coincide, and :func:`_first_smallest_error` runs the loop itself on those elements.
    """
    s = scales.to(torch.float32)[..., None]
    a = values.abs()
    index = (a > s * E2M1_MIDPOINTS[0]).to(torch.uint8)
    for midpoint in E2M1_MIDPOINTS[1:]:
        index += a > s * midpoint
    beyond = a > s * E2M1_VALUES[-1]
    if beyond.any():
        index[beyond] = _first_smallest_error(a[beyond], s.expand_as(a)[beyond])
    index.masked_fill_(torch.isnan(values), 0)
    return index | ((values < 0) & (index > 0)).to(torch.uint8) * E2M1_SIGN_BIT


def check_stochastic(order: ArithmeticOrder) -> None:
    """ValueError unless stochastic rounding applies to ``order``: an order that picks codes in
    the block's domain (``E2M1Ties.FIRST_NEAREST_SCALED_TABLE``, llama.cpp's) has no scaled value
    to round up or down."""
    if order.e2m1_ties is E2M1Ties.FIRST_NEAREST_SCALED_TABLE:
        raise ValueError(
            f"rounding='stochastic' does not apply to the {order.name} order (it picks the nearest "
            "of E2M1 * scale in the unscaled domain, with no scaled value to round); use "
            "rounding='rne' or another convention"
        )


def _round_codes(
    scaled: torch.Tensor, scales: torch.Tensor, order: ArithmeticOrder
) -> torch.Tensor:
    """The order's E2M1 rounding (:class:`~nvfp4lab.orders.E2M1Ties`) of its scaled elements."""
    if order.e2m1_ties is E2M1Ties.EVEN:
        return round_to_e2m1_codes(scaled)
    if order.e2m1_ties is E2M1Ties.FIRST_NEAREST_SCALED_TABLE:
        return _nearest_scaled_table(scaled, scales)
    raise NotImplementedError(  # pragma: no cover - a new tie rule goes here
        f"E2M1 ties {order.e2m1_ties} of the {order.name} order"
    )


def block_scales_from_blocks(
    blocks: torch.Tensor,
    scale: torch.Tensor,
    convention: str | ArithmeticOrder = OrderName.VLLM_KERNEL,
    *,
    target: float = E2M1_MAX,
) -> torch.Tensor:
    """float32 E4M3 block scales ``[..., nb]`` of ``blocks [..., nb, B]`` (input dtype) mapping
    each block's max to ``target``; ``scale``: float32 ``[1]`` tensor scale in the order's form
    (:attr:`~nvfp4lab.scales.TensorScale.arithmetic`)."""
    return block_scales_from_amax(abs_max(blocks, -1), scale, convention, target)


#: Deprecated alias of :func:`block_scales_from_blocks` (the same function), kept for one
#: release: beside :func:`nvfp4lab.scales.block_scales` (now ``block_scales_from_amax``) the
#: name did not say which takes the blocks and which their maxima.
block_scales_of = block_scales_from_blocks


def encode_blocks(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    scale: torch.Tensor,
    convention: str | ArithmeticOrder = OrderName.VLLM_KERNEL,
    *,
    rounding: str = Rounding.RNE,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """uint8 E2M1 codes of ``blocks [..., nb, B]`` at float32 block ``scales [..., nb]`` and
    tensor ``scale`` (the order's form): the order's element scaling, then its E2M1 rounding
    (``rounding="stochastic"`` draws from ``generator`` instead; not for an order that picks codes
    in the block's domain, ``E2M1Ties.FIRST_NEAREST_SCALED_TABLE``: ValueError)."""
    order = get_order(convention)
    scaled = scale_elements(blocks, scales, scale, order)
    if rounding == Rounding.STOCHASTIC:
        check_stochastic(order)
        if generator is None:
            raise ValueError("stochastic rounding needs a torch.Generator")
        return stochastic_round_to_e2m1_codes(scaled, generator)
    return _round_codes(scaled, scales, order)


def decode_codes(
    codes: torch.Tensor,
    scales: torch.Tensor,
    scale: torch.Tensor,
    convention: str | ArithmeticOrder = OrderName.VLLM_KERNEL,
) -> torch.Tensor:
    """float32 values of ``codes [..., nb, B]`` at block ``scales [..., nb]`` and tensor ``scale``
    (the order's form), by the order's :class:`~nvfp4lab.orders.DecodeRule`."""
    exact = _exact_decode_scale(get_order(convention), scale)
    if exact is not None:
        return decode_blocks(codes, scales, scale, decode_scale=exact)
    return decode_blocks(codes, scales, scale)


def _exact_decode_scale(order: ArithmeticOrder, scale: torch.Tensor) -> torch.Tensor | None:
    """The exact DECODE scale the order's decode multiplies by (``value * f32(s * d)``), or None
    for ``value * (s / gs)``; NotImplementedError for a decode rule written nowhere here (a new
    member of :class:`~nvfp4lab.orders.DecodeRule` is refused, never decoded as another)."""
    if order.decode is DecodeRule.SCALE_TIMES_DECODE:
        return scale
    if order.decode is DecodeRule.SCALE_OVER_ENCODE:
        return None
    raise NotImplementedError(f"decode rule {order.decode} of the {order.name} order")


def fixed_scale_codec(
    scales: torch.Tensor,
    scale: torch.Tensor,
    convention: str | ArithmeticOrder = OrderName.VLLM_KERNEL,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """``(encode, decode)`` at fixed float32 block ``scales [..., nb]`` and tensor ``scale`` (the
    order's form): ``encode(blocks [..., nb, B])`` is :func:`encode_blocks` (the order's
    deterministic rounding) and
    ``decode(codes)`` :func:`decode_codes`, bit for bit, with the per-block factors computed once
    instead of at every call (GPTQ rounds the 16 columns of a group one at a time at one scale).
    """
    order = get_order(convention)
    scaled = element_scaler(scales, scale, order)
    exact = _exact_decode_scale(order, scale)
    factor = block_decode_factor(scales, scale, exact).unsqueeze(-1)
    table = e2m1_table(torch.float32, scales.device)

    def encode(blocks: torch.Tensor) -> torch.Tensor:
        return _round_codes(scaled(blocks), scales, order)

    def decode(codes: torch.Tensor) -> torch.Tensor:
        values = table[codes.long()]
        values *= factor
        return values

    return encode, decode


def multiply_factors(
    scales: torch.Tensor,
    scale: torch.Tensor,
    convention: str | ArithmeticOrder = OrderName.VLLM_KERNEL,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What :func:`fixed_scale_codec` computes once per block, as numbers, for an order that
    scales its elements by a multiply (``ElementScaling.MULTIPLY_BY_INVERSE``) and rounds them
    ties-to-even: ``(multiplier, factor)``, float32 of ``scales``' shape ``[..., nb]`` (the
    element multiplier, :func:`nvfp4lab.scales.element_multiplier`, and the decode factor). The
    block's codes are the E2M1 codes of ``clamp(f32(x) * multiplier, -6, 6)`` and its values
    ``E2M1(code) * factor`` (GPTQ's native column loop). None for any other order."""
    order = get_order(convention)
    if (order.element_scaling is not ElementScaling.MULTIPLY_BY_INVERSE
            or order.e2m1_ties is not E2M1Ties.EVEN):
        return None
    exact = _exact_decode_scale(order, scale)
    return element_multiplier(scales, scale), block_decode_factor(scales, scale, exact)


def quantize_blocks(
    blocks: torch.Tensor,
    global_scale: torch.Tensor,
    convention: str | ArithmeticOrder = OrderName.VLLM_KERNEL,
    *,
    targets: Sequence[float] = (E2M1_MAX,),
    rounding: str = Rounding.RNE,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Core arithmetic on ``blocks [..., nb, B]`` (any B) with float32 ``global_scale [1]`` in the
    order's form (the DECODE scale for the modelopt order: see :mod:`nvfp4lab.orders`).

    Returns (codes uint8 of the blocks' shape, scales float8_e4m3fn ``[..., nb]``). For each
    block and each target ``t`` the scale maps the block max to ``t``; with several targets the
    candidate with the lowest squared error (RNE codes) wins, earlier targets winning ties, and
    stochastic rounding then encodes with the chosen scale. No checks.
    """
    order = get_order(convention)
    codes: torch.Tensor | None = None
    if len(targets) > 1:
        scales, codes = _best_scales(blocks, global_scale, order, targets)
    else:
        scales = block_scales_from_blocks(blocks, global_scale, order, target=targets[0])
    if rounding == Rounding.STOCHASTIC or codes is None:
        codes = encode_blocks(
            blocks, scales, global_scale, order, rounding=rounding, generator=generator
        )
    return codes, scales.to(torch.float8_e4m3fn)


def _best_scales(
    blocks: torch.Tensor,
    global_scale: torch.Tensor,
    order: ArithmeticOrder,
    targets: Sequence[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 scales, RNE codes) of the lowest-squared-error target per block."""
    reference = blocks.to(torch.float32)
    amax = abs_max(blocks, -1)
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    for target in targets:
        scales = block_scales_from_amax(amax, global_scale, order, target)
        codes = encode_blocks(blocks, scales, global_scale, order)
        err = (decode_codes(codes, scales, global_scale, order) - reference).square_().sum(-1)
        if best is None:
            best = (scales, codes, err)
            continue
        better = err < best[2]
        best = (
            torch.where(better, scales, best[0]),
            torch.where(better.unsqueeze(-1), codes, best[1]),
            torch.where(better, err, best[2]),
        )
    assert best is not None
    return best[0], best[1]
