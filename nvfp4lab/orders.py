"""Arithmetic orders as data: how each :class:`~nvfp4lab.vocab.OrderName` computes NVFP4.

NVFP4's format is fixed (E2M1 codes, one E4M3 scale per 16 values, one FP32 tensor scale), but
the float32 arithmetic that picks the scales and codes is not: libraries differ in where they
divide, in which dtype, and what an all-zero block gets, so they disagree on a small fraction of
codes. One :class:`ArithmeticOrder` per convention states those choices step by step; the eager
pipeline (:mod:`nvfp4lab.scales`, :mod:`nvfp4lab.codec`), the fused graphs
(:mod:`nvfp4lab.kernels.graphs`) and GPTQ (through the codec's block functions) all read it, and
none of them names a convention. :mod:`nvfp4lab.oracles.nvfp4` keeps its own slow, independent
version of every order: the oracle the fast paths are checked against.

Notation, per block ``b`` of 16 values with maximum ``amax_b``: ``gs`` is the ENCODE tensor
scale (2688/amax), ``d`` the DECODE one (amax/2688), ``t`` the value a block's max maps to (6
for plain NVFP4), ``s`` the block scale (an E4M3 value), ``f32(·)`` a float32 rounding.

``kernel`` (ENCODE form; vLLM's float32 reference of its CUDA quantize kernel)::

    tensor scale   gs = 2688 / amax, one float32 division, capped at 2**116
    block scale    s = e4m3(clamp(gs * (amax_b * f32(1/t)), -448, 448))  (0 for a zero block)
    elements       RNE_E2M1(clamp(x * (1 / (s * (1/gs))), -6, 6))        (0 where s == 0)
    decode         value * (s / gs)

``compressed-tensors`` (ENCODE form; compressed-tensors 0.20)::

    tensor scale   gs = reciprocal(amax) * 2688, each step rounded to x.dtype
    block scale    s = e4m3(clamp(gs * f32(amax_b / t), -448, 448)), the / in x.dtype; 0 -> 0.125
    elements       RNE_E2M1(clamp(f32(x) / (s / gs), -6, 6))
    decode         value * (s / gs)

``modelopt`` (DECODE form; NVIDIA ModelOpt 0.47, ``NVFP4QTensor``)::

    tensor scale   d = amax / 2688, one float32 division
    block scale    s = e4m3(clamp(amax_b / f32(t * d), 2**-9, 448))       (1 for a zero block)
    elements       RNE_E2M1(clamp(f32(x) / f32(s * d), -6, 6))
    decode         value * f32(s * d)

``llama.cpp`` (no tensor scale; ggml's ``quantize_row_nvfp4_ref``, the quantizer of ggml type 40
and ``ggml_quantize_chunk``, imatrix or not; ggml/src/ggml-quants.c and ggml-impl.h at
ggml-org/llama.cpp@0c1e57098bba, vendored by llama-cpp-python 0.3.36; PR #19769)::

    tensor scale   none: gs = d = 1 (a given ENCODE gs pre-scales the elements, x' = f32(x * gs))
    block scale    s = ue4m3(f32(amax_b' / t))                          (amax_b' = max |x'|)
    elements       code = first i in 0..15 minimizing f32|E2M1(i) * s - x'|  (strict <)
    decode         value * (s / gs)                                      (= E2M1 * s at gs = 1)

``ue4m3`` is ``ggml_fp32_to_ue4m3``: 0 for x <= 0 or NaN, x clamped to 448; below 2**-6
``(int)(x * 512 + 0.5)`` capped at 7 (so [7.5, 8) * 2**-9 rounds down to 7 * 2**-9); otherwise
the float32 mantissa's top 3 bits plus its 4th (round half up), and an E4M3 exponent field of 15
(any x >= 248 after rounding) gives 0x7E = 448, so the scales 256..416 never occur. ggml stores
E2M1 doubled with the scale halved (``kvalues_fp4``; ``ggml_ue4m3_to_fp32`` returns half the
E4M3 value, byte 0x7F as 0): the products ``kvalues[i] * d`` equal ``E2M1(i) * s`` exactly. The
element step compares in the unscaled domain, never ``x / s``: ties keep the earlier table index
(the smaller magnitude, and +0: a small negative value gets code 0, never 8); far beyond
``6 * s`` the float32 errors of several codes round equal and the earliest wins, so a value huge
against its block scale (around 1e10 at s = 448) gets a smaller code, down to 0 (as does +-inf).
Under ``nonfinite="propagate"`` a block holding NaN gets scale 0 and codes 0 here, where ggml
(whose amax loop skips NaN) scales it by its finite values. An all-zero block, or one whose
``amax / 6`` rounds to UE4M3 0 (amax below 6 * 2**-10), gets scale 0 and codes 0.

E4M3 and E2M1 rounding are round-to-nearest, ties to even, in the first three orders.

Each step's variants are an :class:`~enum.Enum` here; the functions that carry a step out
(:mod:`nvfp4lab.scales`, :mod:`nvfp4lab.e2m1`, the graphs) dispatch on these members. A new
order is a new :data:`ORDERS` entry (and a new member of a step's enum only if one of its steps
is new); ``docs/architecture.md`` ("How to add an arithmetic order") gives the recipe.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from enum import Enum, auto

from nvfp4lab.constants import CT_ZERO_SCALE_REPLACEMENT, E4M3_MIN_SUBNORMAL
from nvfp4lab.vocab import OrderName, check_choice

__all__ = [
    "ENUM_FIELDS",
    "KERNEL_MAX_GLOBAL_SCALE",
    "ORDERS",
    "ArithmeticOrder",
    "BlockScaleRule",
    "DecodeRule",
    "E2M1Ties",
    "E4M3Rounding",
    "ElementScaling",
    "ScaleForm",
    "TensorScaleRule",
    "check_steps",
    "get",
]

#: Largest ENCODE scale the kernel order accepts: above it ``1/gs`` is so small that
#: ``1 / (s_b * (1/gs))`` overflows float32 for the smallest block scales (2**-9).
KERNEL_MAX_GLOBAL_SCALE: float = 2.0**116


class ScaleForm(Enum):
    """Which form of the tensor scale an order's block arithmetic is written in."""

    ENCODE = auto()  #: ``gs = 2688 / amax`` (compressed-tensors, vLLM's kernel)
    DECODE = auto()  #: ``d = amax / 2688`` (ModelOpt's ``weight_scale_2``, torchao)


class TensorScaleRule(Enum):
    """How the tensor scale is computed from ``amax`` (the numerator ``n`` is 2688 = 448·6)."""

    FLOAT32_DIVISION = auto()  #: ENCODE ``n / amax`` as one true float32 division
    INPUT_DTYPE_RECIPROCAL = auto()  #: ENCODE ``reciprocal(amax) * n``, each step in x.dtype
    DECODE_FLOAT32_DIVISION = auto()  #: DECODE ``amax / n`` as one true float32 division
    UNIT = auto()  #: no tensor scale: 1.0 in both forms, whatever ``amax`` (llama.cpp)


class BlockScaleRule(Enum):
    """How a block's scale is computed before its E4M3 rounding."""

    ENCODE_TIMES_AMAX_TIMES_INVERSE_TARGET = auto()  #: ``gs * (amax_b * f32(1/t))``
    ENCODE_TIMES_AMAX_OVER_TARGET_IN_INPUT_DTYPE = auto()  #: ``gs * f32(amax_b / t)``, / in x.dtype
    AMAX_OVER_TARGET_TIMES_DECODE = auto()  #: ``amax_b / f32(t * d)``
    PRESCALED_AMAX_OVER_TARGET = auto()  #: ``f32(f32(gs * amax_b) / t)`` (gs = 1: ``amax_b / t``)


class E4M3Rounding(Enum):
    """How the block scale is rounded to E4M3."""

    NEAREST_EVEN = auto()  #: ``torch.float8_e4m3fn`` cast: nearest, ties to even
    #: ggml's ``ggml_fp32_to_ue4m3`` (module docstring): half up, subnormals capped at 7·2**-9,
    #: everything from 248 on to 448
    HALF_UP_UE4M3 = auto()


class ElementScaling(Enum):
    """How an element is brought into the E2M1 range ``x * gs / s`` (clamped to ±6 after)."""

    MULTIPLY_BY_INVERSE = auto()  #: ``f32(x) * (1 / (s * (1/gs)))``, 0 where ``s == 0``
    DIVIDE_BY_SCALE_OVER_ENCODE = auto()  #: ``f32(x) / (s / gs)``
    DIVIDE_BY_SCALE_TIMES_DECODE = auto()  #: ``f32(x) / f32(s * d)``
    #: ``f32(x * gs)``, no division and no clamp: the elements stay in the block's domain and the
    #: E2M1 step scales the table instead (:attr:`E2M1Ties.FIRST_NEAREST_SCALED_TABLE`)
    PRESCALE_ONLY = auto()


class E2M1Ties(Enum):
    """How a scaled element halfway between two E2M1 values is rounded."""

    EVEN = auto()  #: nearest, ties to the even code (IEEE round-half-even)
    #: the first code ``i`` in 0..15 minimizing float32 ``|E2M1(i) * s - x|`` (ggml's
    #: ``best_index_mxfp4``, strict ``<``): ties to the earlier index, i.e. the smaller magnitude
    #: and +0; needs :attr:`ElementScaling.PRESCALE_ONLY` (elements in the block's domain)
    FIRST_NEAREST_SCALED_TABLE = auto()


class DecodeRule(Enum):
    """How codes and block scales decode (float32, then one rounding to the wanted dtype)."""

    SCALE_OVER_ENCODE = auto()  #: ``value * (s / gs)``
    SCALE_TIMES_DECODE = auto()  #: ``value * f32(s * d)`` (exact ``d`` kept by the tensor)


@dataclass(frozen=True)
class ArithmeticOrder:
    """One convention's arithmetic, step by step (see the module docstring).

    ``zero_block_scale``: the scale a block gets before E4M3 rounding where its rule gives 0 (an
    all-zero block; None: it stays 0). ``zero_scale_replacement``: what an E4M3 scale of 0
    becomes after rounding (None: it stays 0 and its block's codes are 0).
    ``min_block_scale``: the lower clamp (0: clamp to -448 only). ``max_global_scale``: largest
    ENCODE scale the order accepts (None: any finite one). ``source``: where the order comes from.
    """

    convention: OrderName
    scale_form: ScaleForm
    tensor_scale: TensorScaleRule
    block_scale: BlockScaleRule
    e4m3_rounding: E4M3Rounding
    element_scaling: ElementScaling
    e2m1_ties: E2M1Ties
    decode: DecodeRule
    zero_block_scale: float | None = None
    zero_scale_replacement: float | None = None
    min_block_scale: float = 0.0
    max_global_scale: float | None = None
    source: str = ""

    @property
    def name(self) -> str:
        """The convention's name (``"kernel"``, ...)."""
        return self.convention.value


def _enum_fields() -> dict[str, type[Enum]]:
    hints = typing.get_type_hints(ArithmeticOrder)
    return {
        f.name: hints[f.name] for f in dataclasses.fields(ArithmeticOrder)
        if isinstance(hints[f.name], type) and issubclass(hints[f.name], Enum)
    }


#: Each field of :class:`ArithmeticOrder` that holds an enum member (the convention and every
#: step), with its enum: read from the class once (its type hints take ~0.1 ms to evaluate).
ENUM_FIELDS: dict[str, type[Enum]] = _enum_fields()

#: Every arithmetic order nvfp4lab runs, by convention.
ORDERS: dict[OrderName, ArithmeticOrder] = {
    OrderName.VLLM_KERNEL: ArithmeticOrder(
        OrderName.VLLM_KERNEL,
        scale_form=ScaleForm.ENCODE,
        tensor_scale=TensorScaleRule.FLOAT32_DIVISION,
        block_scale=BlockScaleRule.ENCODE_TIMES_AMAX_TIMES_INVERSE_TARGET,
        e4m3_rounding=E4M3Rounding.NEAREST_EVEN,
        element_scaling=ElementScaling.MULTIPLY_BY_INVERSE,
        e2m1_ties=E2M1Ties.EVEN,
        decode=DecodeRule.SCALE_OVER_ENCODE,
        max_global_scale=KERNEL_MAX_GLOBAL_SCALE,
        source="vLLM 0.33: the float32 reference of its CUDA NVFP4 quantize kernel",
    ),
    OrderName.COMPRESSED_TENSORS: ArithmeticOrder(
        OrderName.COMPRESSED_TENSORS,
        scale_form=ScaleForm.ENCODE,
        tensor_scale=TensorScaleRule.INPUT_DTYPE_RECIPROCAL,
        block_scale=BlockScaleRule.ENCODE_TIMES_AMAX_OVER_TARGET_IN_INPUT_DTYPE,
        e4m3_rounding=E4M3Rounding.NEAREST_EVEN,
        element_scaling=ElementScaling.DIVIDE_BY_SCALE_OVER_ENCODE,
        e2m1_ties=E2M1Ties.EVEN,
        decode=DecodeRule.SCALE_OVER_ENCODE,
        zero_scale_replacement=CT_ZERO_SCALE_REPLACEMENT,
        source="compressed-tensors 0.20: its NVFP4 quantize and global-scale helpers",
    ),
    OrderName.MODELOPT: ArithmeticOrder(
        OrderName.MODELOPT,
        scale_form=ScaleForm.DECODE,
        tensor_scale=TensorScaleRule.DECODE_FLOAT32_DIVISION,
        block_scale=BlockScaleRule.AMAX_OVER_TARGET_TIMES_DECODE,
        e4m3_rounding=E4M3Rounding.NEAREST_EVEN,
        element_scaling=ElementScaling.DIVIDE_BY_SCALE_TIMES_DECODE,
        e2m1_ties=E2M1Ties.EVEN,
        decode=DecodeRule.SCALE_TIMES_DECODE,
        zero_block_scale=1.0,
        min_block_scale=E4M3_MIN_SUBNORMAL,
        source="NVIDIA ModelOpt 0.47: NVFP4QTensor.quantize and its dequantize",
    ),
    OrderName.LLAMA_CPP: ArithmeticOrder(
        OrderName.LLAMA_CPP,
        scale_form=ScaleForm.ENCODE,
        tensor_scale=TensorScaleRule.UNIT,
        block_scale=BlockScaleRule.PRESCALED_AMAX_OVER_TARGET,
        e4m3_rounding=E4M3Rounding.HALF_UP_UE4M3,
        element_scaling=ElementScaling.PRESCALE_ONLY,
        e2m1_ties=E2M1Ties.FIRST_NEAREST_SCALED_TABLE,
        decode=DecodeRule.SCALE_OVER_ENCODE,
        source=(
            "llama.cpp ggml/src/ggml-quants.c quantize_row_nvfp4_ref / best_index_mxfp4 and "
            "ggml/src/ggml-impl.h ggml_fp32_to_ue4m3 / ggml_ue4m3_to_fp32 at "
            "ggml-org/llama.cpp@0c1e57098bba (llama-cpp-python 0.3.36); PR #19769"
        ),
    ),
}


def check_steps(order: ArithmeticOrder) -> ArithmeticOrder:
    """``order`` when each of its steps is a member of the step's enum (a custom order built
    with ``dataclasses.replace`` may carry anything); ValueError naming the step otherwise, so no
    function runs an order whose step it cannot read as one it knows. Runs on every call given
    an order object (:data:`ENUM_FIELDS`: no type hints evaluated here)."""
    for name, kind in ENUM_FIELDS.items():
        value = getattr(order, name)
        if not isinstance(value, kind):
            owner = getattr(order.convention, "value", repr(order.convention))
            raise ValueError(
                f"the {owner} order's {name} step is {value!r}, not a member of "
                f"{kind.__name__} ({', '.join(m.name for m in kind)}); add the member to "
                f"{kind.__name__} and its arithmetic beside the others (docs/architecture.md)"
            )
    return order


def get(order: str | ArithmeticOrder) -> ArithmeticOrder:
    """The :class:`ArithmeticOrder` of a convention name (or the order itself); a bad name raises
    the vocabulary's one error, ``unknown convention …; accepted values: …``."""
    if isinstance(order, ArithmeticOrder):
        return order
    return ORDERS[check_choice("convention", order, OrderName)]  # type: ignore[index]
