"""Which arithmetic steps a kernel implements: one table per kernel, one rule to read it.

An :class:`~nvfp4lab.orders.ArithmeticOrder` is a step enum member per step (its
:data:`STEP_FIELDS`: the scale form, the tensor-scale rule, the block-scale rule, the E4M3
rounding, the element scaling, the E2M1 ties, the decode rule). Each kernel (the compiled graphs,
the C++ block encode, GPTQ's C++ column loop, the C++ LUT decode) holds a :data:`StepTable`: per
step field, the members it implements (or, for a step its caller computes before the kernel runs,
the members whose results it is known to take), each member written out by name. Never "every
member of the enum": a member added later (an order added by the recipe of
``docs/architecture.md``) is declined until a kernel is taught it and its table lists it, so that
order runs the eager pipeline instead of being mapped silently onto another order's arithmetic.
:func:`implements` is the one reading: True only when every step of the order is in the table,
and False for a step field the table lacks (a field added to ``ArithmeticOrder`` later).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from nvfp4lab import orders
from nvfp4lab.orders import ENUM_FIELDS, ArithmeticOrder, BlockScaleRule, TensorScaleRule

__all__ = [
    "CODEC_BLOCK_SCALES",
    "CODEC_TENSOR_SCALES",
    "STEP_FIELDS",
    "StepTable",
    "implements",
    "missing",
]

#: Per step field of :class:`~nvfp4lab.orders.ArithmeticOrder`, the members a kernel implements.
StepTable = Mapping[str, frozenset[Enum]]

#: The tensor-scale rules whose scale the codec computes and hands to a kernel as a number in the
#: order's form (every kernel takes the tensor scale so; each member written out by name).
CODEC_TENSOR_SCALES: frozenset[Enum] = frozenset({
    TensorScaleRule.FLOAT32_DIVISION,
    TensorScaleRule.INPUT_DTYPE_RECIPROCAL,
    TensorScaleRule.DECODE_FLOAT32_DIVISION,
    TensorScaleRule.UNIT,
})
#: The block-scale rules whose E4M3 scales the codec computes eagerly for a kernel that reads
#: them (GPTQ's column loop, the LUT decode).
CODEC_BLOCK_SCALES: frozenset[Enum] = frozenset({
    BlockScaleRule.ENCODE_TIMES_AMAX_TIMES_INVERSE_TARGET,
    BlockScaleRule.ENCODE_TIMES_AMAX_OVER_TARGET_IN_INPUT_DTYPE,
    BlockScaleRule.AMAX_OVER_TARGET_TIMES_DECODE,
    BlockScaleRule.PRESCALED_AMAX_OVER_TARGET,
})


#: The fields of :class:`~nvfp4lab.orders.ArithmeticOrder` that hold a step enum's member
#: (:data:`~nvfp4lab.orders.ENUM_FIELDS` but the convention: a new step field is one more entry
#: here, which no table lists yet).
STEP_FIELDS: tuple[str, ...] = tuple(
    name for name, kind in ENUM_FIELDS.items() if kind.__module__ == orders.__name__
)


def missing(table: StepTable, order: ArithmeticOrder) -> list[str]:
    """The step fields of ``order`` whose member ``table`` does not list (empty: implemented)."""
    return [
        name for name in STEP_FIELDS
        if getattr(order, name, None) not in table.get(name, frozenset())
    ]


def implements(table: StepTable, order: ArithmeticOrder) -> bool:
    """Whether ``table`` lists every step of ``order``."""
    return not missing(table, order)
