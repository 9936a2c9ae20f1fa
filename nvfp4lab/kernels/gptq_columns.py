"""GPTQ's column loop within one group, in C++: the same arithmetic as the eager loop, bit for bit.

GPTQ (:mod:`nvfp4lab.execution.gptq`) quantizes a weight one column at a time and spreads each
column's error over the columns after it. Within a group of 16 columns, the eager loop makes about
thirty small torch calls per column; MiniLM's 21,120 columns took 3.0 s that way, nearly all of
it call overhead, and take 0.5 s here. :func:`run_group` runs one group's columns in one call of
``gptq_columns.cpp`` (part of nvfp4lab's native library, :mod:`nvfp4lab.kernels.native`), for the
kernel order's element scaling (a multiply by ``1 / (s * (1/gs))`` per block, E2M1 ties to even).
Each step is the IEEE operation the eager loop's torch call makes, in the same order (no
fast-math, no FMA contraction), and its E2M1 rounding is :func:`nvfp4lab.e2m1.round_to_e2m1_codes`'s
(its round-down limits; a NaN gets code 0 there and here); the tests compare codes, scales and
the float64 work rows with ``torch.equal``.
"""

from __future__ import annotations

import torch

from nvfp4lab.kernels.native import required
from nvfp4lab.kernels.steps import CODEC_BLOCK_SCALES, CODEC_TENSOR_SCALES, StepTable, implements
from nvfp4lab.orders import (
    ArithmeticOrder,
    DecodeRule,
    E2M1Ties,
    E4M3Rounding,
    ElementScaling,
    ScaleForm,
)

__all__ = ["STEPS", "run_group", "supports"]

#: The steps the column loop implements (:mod:`nvfp4lab.kernels.steps`: any other member
#: declines): its own are the element scaling (a multiply by the block's multiplier) and the E2M1
#: rounding (ties to even); the block scales, the multipliers and the decode factors it takes
#: from the codec (``blocks.multiply_factors``, computed eagerly in the order's rules), so those
#: steps list the members the codec computes them for.
STEPS: StepTable = {
    "scale_form": frozenset({ScaleForm.ENCODE, ScaleForm.DECODE}),
    "tensor_scale": CODEC_TENSOR_SCALES,
    "block_scale": CODEC_BLOCK_SCALES,
    "e4m3_rounding": frozenset({E4M3Rounding.NEAREST_EVEN, E4M3Rounding.HALF_UP_UE4M3}),
    "element_scaling": frozenset({ElementScaling.MULTIPLY_BY_INVERSE}),
    "e2m1_ties": frozenset({E2M1Ties.EVEN}),
    "decode": frozenset({DecodeRule.SCALE_OVER_ENCODE, DecodeRule.SCALE_TIMES_DECODE}),
}


def supports(order: ArithmeticOrder) -> bool:
    """Whether the column loop implements every step of ``order`` (:data:`STEPS`; today the
    kernel order alone); GPTQ runs the eager loop for any other."""
    return implements(STEPS, order)


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or tuple(t.shape) != shape or not (
        t.is_contiguous()
    ):
        raise ValueError(
            f"{name} must be a contiguous CPU {dtype} tensor of shape {shape}, got {t.dtype} "
            f"{tuple(t.shape)} on {t.device}"
        )


def run_group(
    block: torch.Tensor,
    u: torch.Tensor,
    multipliers: torch.Tensor,
    factors: torch.Tensor,
    q: torch.Tensor,
    codes: torch.Tensor,
    errors: torch.Tensor,
) -> None:
    """Quantize the ``m`` columns of one group, rows of ``block`` (float64 ``[m, N]``, the
    transposed weight's rows in processing order, updated in place as the eager loop updates them).

    ``u``: float64 ``[m, m]`` (any strides), the upper inverse Cholesky factor's square at the
    group (``u[i, i]`` divides column i's error, ``u[i, r]`` carries it to column ``r > i``).
    ``multipliers`` / ``factors``: float32 ``[m, N]`` or ``[N]`` (one row for every column): each
    output row's element multiplier ``1 / (s * (1/gs))`` (0 where ``s == 0``) and decode factor
    at column i's block. Writes the dequantized columns into ``q`` (float32 ``[m, N]``), their
    E2M1 codes into ``codes`` (uint8 ``[m, N]``) and the scaled errors ``(w - q) / u[i, i]`` into
    ``errors`` (float64 ``[m, N]``).
    """
    m, n = block.shape
    _check("block", block, torch.float64, (m, n))
    if u.dtype != torch.float64 or u.device.type != "cpu" or tuple(u.shape) != (m, m):
        raise ValueError(f"u must be a CPU float64 [{m}, {m}] tensor, got {u.dtype} "
                         f"{tuple(u.shape)} on {u.device}")
    per_column = multipliers.dim() == 2
    rows = (m, n) if per_column else (n,)
    _check("multipliers", multipliers, torch.float32, rows)
    _check("factors", factors, torch.float32, rows)
    _check("q", q, torch.float32, (m, n))
    _check("codes", codes, torch.uint8, (m, n))
    _check("errors", errors, torch.float64, (m, n))
    required().nvfp4lab_gptq_columns(
        block.data_ptr(), u.data_ptr(), u.stride(0), u.stride(1), m, n,
        multipliers.data_ptr(), factors.data_ptr(), n if per_column else 0,
        q.data_ptr(), codes.data_ptr(), errors.data_ptr(),
    )
