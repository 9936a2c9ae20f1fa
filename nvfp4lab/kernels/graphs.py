"""The fused NVFP4 graphs: plain tensor code that ``torch.compile`` lowers to one kernel each.

Everything here is traced by dynamo and compiled by inductor (C++/OpenMP with ``at::vec`` on the
CPU, Triton on CUDA); nothing inspects tensor data in Python. Inputs are block-shaped so that
every size is ``NB``, ``8·NB`` or ``16·NB`` of one symbol ``NB`` (the number of 16-element
blocks): no floor divisions in index math and no tail loops (:func:`pin_widths`).

========  =======================================  =========================================
graph     inputs                                   outputs (``*``: written into a given buffer)
========  =======================================  =========================================
stats     x [NB, 16], divisor 6 [1] (x.dtype)      block statistic [NB] (x.dtype), amax 0-d
codes     x, statistic, gs [1], 1/gs [1]           codes* [NB, 16] u8, scale bytes* [NB] u8
pack      codes [NB, 16]                           packed* [NB, 2] int32 (8 bytes a block)
fake      x, statistic, gs, 1/gs                   x_hat* [NB, 16] (x.dtype)
decode    packed [NB, 8], scale bytes [NB], t [1]  x_hat* [NB, 16] (any float dtype)
========  =======================================  =========================================

The graphs take an :class:`~nvfp4lab.orders.ArithmeticOrder` as their static argument and read
its steps (never a convention's name); :func:`supports` says which orders they implement: the
ENCODE-form orders with RNE rounding and no lower clamp (today ``kernel`` and
``compressed-tensors``); any other order runs the eager pipeline. The block statistic is the
block amax, or ``amax_b / 6`` rounded to x.dtype where the order divides in the input dtype.
Being a graph *output* it is really stored in x.dtype: inside one graph inductor would keep it in
float32 (it elides a downcast feeding another op unless the compiled function has
``emulate_precision_casts``), which changes 0.3-1.7 % of bf16/fp16 scales.

Arithmetic, the eager operations of :mod:`nvfp4lab.scales` / :mod:`nvfp4lab.e2m1` in the eager
order, in float32, with three exact rewrites:

* E4M3 rounding without a float8 cast: round-to-nearest-even on the float32 bits in the normal
  range, ``round(p·512)/512`` below 2**-6 (equal to ``.to(float8_e4m3fn)`` for every float32 in
  [0, 448]); decode by assembling float32 bits. No scalar float8 conversion per block, and
  portable to GPUs without FP8 conversion instructions.
* E2M1 rounding with one ``round``: ``a = min(|v|, 6)``, ``g2 = a >= 2``, ``g4 = a >= 4``,
  ``q = round(a·(2 - g2 - g4/2))`` (half to even; the scaling is an exact power of two),
  ``index = q + 2(g2 + g4)``, ``value = q·(1/2 + g2/2 + g4)`` (every float32 in [0, 6] checked).
* Packing: one code per byte, then each int64 word (8 codes) folds into 4 bytes in three
  shift/or/mask steps; unpacking is the inverse. E2M1 decode: ``2|v|`` is nibble ``index`` of the
  int32 constant 0xC8643210, the sign a multiply by ``1/2 - (code >> 3)``.

Float constants are literals on purpose: a Python float reaching a graph through a variable
becomes a float64 graph input (dynamo's ``specialize_float=False``), a scalar double load in the
hot loop. They are the values of :mod:`nvfp4lab.constants` (6 = E2M1_MAX, 448 = E4M3_MAX,
0.125 = CT_ZERO_SCALE_REPLACEMENT). Divisors that eager takes from a tensor are runtime tensors
here too: inductor rewrites a division by a constant into a reciprocal multiply on GPUs.
"""

from __future__ import annotations

import torch

from nvfp4lab.kernels.steps import StepTable, implements
from nvfp4lab.orders import (
    ArithmeticOrder,
    BlockScaleRule,
    DecodeRule,
    E2M1Ties,
    E4M3Rounding,
    ElementScaling,
    ScaleForm,
    TensorScaleRule,
)

__all__ = [
    "GRAPHS",
    "STEPS",
    "codes_graph",
    "decode_e2m1",
    "decode_e4m3",
    "decode_graph",
    "e2m1_round",
    "fake_graph",
    "pack_graph",
    "pin_widths",
    "round_e4m3",
    "stats_graph",
    "supports",
]

#: The steps the graphs implement (:mod:`nvfp4lab.kernels.steps`: any other member declines).
#: The tensor scale is the caller's (eager, before the graphs run): its ENCODE rules of the
#: orders the graphs serve.
STEPS: StepTable = {
    "scale_form": frozenset({ScaleForm.ENCODE}),
    "tensor_scale": frozenset(
        {TensorScaleRule.FLOAT32_DIVISION, TensorScaleRule.INPUT_DTYPE_RECIPROCAL}),
    "block_scale": frozenset({
        BlockScaleRule.ENCODE_TIMES_AMAX_TIMES_INVERSE_TARGET,
        BlockScaleRule.ENCODE_TIMES_AMAX_OVER_TARGET_IN_INPUT_DTYPE,
    }),
    "e4m3_rounding": frozenset({E4M3Rounding.NEAREST_EVEN}),
    "element_scaling": frozenset(
        {ElementScaling.MULTIPLY_BY_INVERSE, ElementScaling.DIVIDE_BY_SCALE_OVER_ENCODE}),
    "e2m1_ties": frozenset({E2M1Ties.EVEN}),
    "decode": frozenset({DecodeRule.SCALE_OVER_ENCODE}),
}


def supports(order: ArithmeticOrder) -> bool:
    """Whether the graphs implement ``order`` (its steps, not its name): every step in
    :data:`STEPS` (ENCODE form, a block rule and element scaling listed there, E4M3 and E2M1
    nearest-even, decode ``value * (s / gs)``), no lower clamp, no zero-block scale, a zero
    scale kept or replaced by 0.125."""
    return (
        implements(STEPS, order)
        and order.zero_block_scale is None
        and order.min_block_scale == 0
        and order.zero_scale_replacement in (None, 0.125)
    )


def pin_widths(*pairs: tuple[torch.Tensor, int]) -> None:
    """Specialize dim 1 of each ``(tensor, width)``: ``dynamic=True`` makes every dimension
    symbolic, and a symbolic 16 turns the per-block loops into generic loops with tails."""
    for t, width in pairs:
        torch._check(t.shape[1] == width)


def _min_gt(t: torch.Tensor, bound: float) -> torch.Tensor:
    """``min(t, bound)`` as one compare and select (NaN passes through, as with ``clamp``)."""
    return torch.where(t > bound, bound, t)


def round_e4m3(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round float32 ``p`` in [0, 448] to E4M3, nearest even: (value float32, byte int32), equal to
    ``p.to(torch.float8_e4m3fn)`` in value and bits. Callers clamp to 448."""
    bits = p.view(torch.int32)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # keep 3 mantissa bits, RNE
    normal_byte = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)
    q = torch.round(p * 512.0)  # the subnormal grid 2**-9; q == 8 is the smallest normal (0x08)
    subnormal = p < 2.0**-6
    value = torch.where(subnormal, q * (1.0 / 512.0), rounded.view(torch.float32))
    return value, torch.where(subnormal, q.to(torch.int32), normal_byte)


def decode_e4m3(byte: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8) -> float32, as ``byte.view(float8_e4m3fn).float()``: 0x7F/0xFF are NaN,
    the sign bit is honoured (0x80 is -0.0)."""
    b = byte.to(torch.int32)
    mag = b & 0x7F
    normal = ((((mag >> 3) + 120) << 23) | ((mag & 7) << 20)).view(torch.float32)
    value = torch.where(mag < 8, mag.to(torch.float32) * (1.0 / 512.0), normal)
    value = torch.where(mag == 0x7F, float("nan"), value)
    return torch.where(b >= 0x80, -value, value)


def e2m1_round(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round float32 ``a`` in [0, 6] to the E2M1 grid, nearest even: (index, value), float32.

    The grid step is 1/2, 1, 2 on [0, 2), [2, 4), [4, 6]; ties at the step boundaries (1.75,
    3.5) round up to the even index, as :func:`nvfp4lab.e2m1.round_to_e2m1_codes` does.
    """
    g2 = (a >= 2.0).float()
    g4 = (a >= 4.0).float()
    q = torch.round(a * (2.0 - g2 - 0.5 * g4))
    return q + 2.0 * (g2 + g4), q * (0.5 + 0.5 * g2 + g4)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes -> float32 values (code 8 -> -0.0): a 4-bit lookup in one int32."""
    c = codes.to(torch.int32)
    twice = ((0xC8643210 - (1 << 32)) >> ((c & 7) << 2)) & 15
    return twice.float() * (0.5 - (c >> 3).float())


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [NB, 16] -> packed words int32 [NB, 2], whose little-endian bytes are the
    packed bytes [NB, 8] (element 2i in the low nibble)."""
    w = codes.view(torch.int64)  # [NB, 2]: eight codes per word, byte k = code k
    w = (w | (w >> 4)) & 0x00FF00FF00FF00FF
    w = (w | (w >> 8)) & 0x0000FFFF0000FFFF
    w = (w | (w >> 16)) & 0x00000000FFFFFFFF
    return w.to(torch.int32)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """packed bytes [NB, 8] -> uint8 codes [NB, 16] (the inverse of :func:`_pack`)."""
    w = packed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [NB, 2]
    w = (w | (w << 16)) & 0x0000FFFF0000FFFF
    w = (w | (w << 8)) & 0x00FF00FF00FF00FF
    w = (w | (w << 4)) & 0x0F0F0F0F0F0F0F0F
    return w.view(torch.uint8)


def _divides_in_input_dtype(order: ArithmeticOrder) -> bool:
    return order.block_scale is BlockScaleRule.ENCODE_TIMES_AMAX_OVER_TARGET_IN_INPUT_DTYPE


def _multiplies(order: ArithmeticOrder) -> bool:
    return order.element_scaling is ElementScaling.MULTIPLY_BY_INVERSE


def _block_scales(
    stat: torch.Tensor, gs: torch.Tensor, order: ArithmeticOrder
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 block scale as float32, its byte as int32) from the block statistic [NB];
    ``gs * stat >= 0``, so eager's clamp to [-448, 448] is a clamp to 448."""
    # where the order divides in x.dtype, the statistic is already amax_b / 6
    divided = _divides_in_input_dtype(order)
    pre = gs * stat.float() if divided else gs * (stat.float() * (1.0 / 6.0))
    value, byte = round_e4m3(_min_gt(pre, 448.0))
    if order.zero_scale_replacement is not None:  # 0.125 (see supports)
        zero = value == 0
        value = torch.where(zero, 0.125, value)
        byte = torch.where(zero, 0x20, byte)  # 0.125 = 2**-3: biased exponent 4, mantissa 0
    return value, byte


def _block_factor(
    scale: torch.Tensor, gs: torch.Tensor, rgs: torch.Tensor, order: ArithmeticOrder
) -> torch.Tensor:
    """The element step's per-block factor: the multiplier ``1/(s·(1/gs))`` (0 where s == 0)
    when the order multiplies by the inverse, else the divisor ``s/gs``; ``rgs = 1/gs``."""
    if _multiplies(order):
        return torch.where(scale == 0, 0.0, torch.reciprocal(scale * rgs))
    return scale / gs


def _scaled(
    xb: torch.Tensor, factor: torch.Tensor, order: ArithmeticOrder
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``min(|x·gs/s|, 6)``, ``x·gs/s < 0``) for x [NB, 16] and the block factor [NB, 1]."""
    v = xb.float() * factor if _multiplies(order) else xb.float() / factor
    return _min_gt(v.abs(), 6.0), v < 0


def stats_graph(
    xb: torch.Tensor, divisor: torch.Tensor, order: ArithmeticOrder
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [NB, 16] -> (block statistic [NB] in x.dtype, amax(|x|) 0-d in x.dtype). ``divisor`` is
    6 in x.dtype (a tensor: eager divides by a same-device tensor)."""
    pin_widths((xb, 16))
    amax_b = xb.abs().amax(dim=-1)
    amax = amax_b.amax()
    if _divides_in_input_dtype(order):
        return amax_b / divisor, amax
    return amax_b, amax


def codes_graph(
    xb: torch.Tensor,
    stat: torch.Tensor,
    gs: torch.Tensor,
    rgs: torch.Tensor,
    codes_out: torch.Tensor,
    bytes_out: torch.Tensor,
    order: ArithmeticOrder,
) -> torch.Tensor:
    """E2M1 codes, one per byte, into ``codes_out`` [NB, 16]; scale bytes into ``bytes_out``.
    Returns the block factor [NB] (see :data:`GRAPHS` on why per-block values are outputs)."""
    pin_widths((xb, 16), (codes_out, 16))
    scale, byte = _block_scales(stat, gs, order)
    factor = _block_factor(scale, gs, rgs, order)
    a, negative = _scaled(xb, factor.unsqueeze(-1), order)
    index, _ = e2m1_round(a)
    codes_out.copy_(index + 8.0 * negative.float())
    bytes_out.copy_(byte)
    return factor


def pack_graph(codes: torch.Tensor, packed_out: torch.Tensor) -> None:
    """codes [NB, 16] -> ``packed_out`` int32 [NB, 2] (the packed bytes [NB, 8] viewed as words:
    a uint8 result would be a dtype view of the words, which inductor does not fuse: an extra
    buffer and copy pass). A graph of its own: on the CPU the integer folding vectorizes best at
    512 bits, the float code computation at 256 (see ``compiled.CPU_OPTIONS``)."""
    pin_widths((codes, 16), (packed_out, 2))
    packed_out.copy_(_pack(codes))


def fake_graph(
    xb: torch.Tensor,
    stat: torch.Tensor,
    gs: torch.Tensor,
    rgs: torch.Tensor,
    out: torch.Tensor,
    order: ArithmeticOrder,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dequantize(quantize(x))`` into ``out`` [NB, 16] (x.dtype): ``value·(s/gs)`` in float32,
    one rounding to ``out.dtype``. Returns the block factor and decode factor [NB]."""
    pin_widths((xb, 16), (out, 16))
    scale, _ = _block_scales(stat, gs, order)
    factor = _block_factor(scale, gs, rgs, order)
    decode = scale / gs if _multiplies(order) else factor  # the divisor s/gs is the decode
    a, negative = _scaled(xb, factor.unsqueeze(-1), order)
    _, magnitude = e2m1_round(a)
    out.copy_(torch.where(negative, -magnitude, magnitude) * decode.unsqueeze(-1))
    return factor, decode


def decode_graph(
    packed: torch.Tensor,
    scale_bytes: torch.Tensor,
    tensor_scale: torch.Tensor,
    out: torch.Tensor,
    rule: DecodeRule,
) -> torch.Tensor:
    """``value(code)·f`` in float32 into ``out`` [NB, 16] (any float dtype), with the block factor
    ``f = s / tensor_scale`` (``SCALE_OVER_ENCODE``: the ENCODE global scale) or ``f = s ·
    tensor_scale`` (``SCALE_TIMES_DECODE``: a DECODE scale, ModelOpt's and vLLM's order).
    Returns ``f`` [NB]."""
    pin_widths((packed, 8), (out, 16))
    s = decode_e4m3(scale_bytes)
    over = rule is DecodeRule.SCALE_OVER_ENCODE
    factor = s / tensor_scale if over else s * tensor_scale
    out.copy_(decode_e2m1(_unpack(packed)) * factor.unsqueeze(-1))
    return factor


#: The graphs by kind; their trailing static argument (an ArithmeticOrder, or the DecodeRule of
#: ``decode``) follows the tensors.
#: Per-block values (scale, multiplier, decode factor) are returned on purpose: a graph output is
#: realized in a loop vectorized across blocks, and the element loop then loads one float per
#: block; left inline, the scalar chain (E4M3 rounding, divisions) ran once per block inside the
#: element loop and cost as much as the 16 elements.
GRAPHS = {
    "stats": stats_graph,
    "codes": codes_graph,
    "pack": pack_graph,
    "fake": fake_graph,
    "decode": decode_graph,
}
