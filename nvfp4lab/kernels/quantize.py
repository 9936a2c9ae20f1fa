"""The fused quantize and quantize-dequantize: which kernel runs a call the fused rule let in.

On a CPU where nvfp4lab's native library is built (:mod:`nvfp4lab.kernels.native`) the C++
block encode runs (:mod:`nvfp4lab.kernels.block_encode`, every order it supports); elsewhere
(CUDA, or a CPU without the library) the compiled graphs (:mod:`nvfp4lab.kernels.compiled`,
ENCODE-form nearest-even orders only: :func:`nvfp4lab.kernels.fused_route` lets no other order
here). Both are bit for bit the eager codec. A call is two steps, with the caller's checks and
tensor-scale rules between them::

    first = first_pass(x, order)              # first.amax: max |x|, 0-d, x.dtype
    (caller)  amax -> NaN/Inf check, the tensor scale t in the order's form
    encode(first, t, order)                   -> packed uint8 [..., K/2], scales e4m3 [..., K/16]
    fake_quantize(first, t, order)            -> x_hat, x.dtype [..., K]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nvfp4lab.kernels import block_encode, compiled, native
from nvfp4lab.orders import ArithmeticOrder

__all__ = ["FirstPass", "encode", "fake_quantize", "first_pass"]


class FirstPass(NamedTuple):
    """What the first pass over ``x`` found."""

    x: torch.Tensor  #: the input [..., K], detached
    amax: torch.Tensor  #: 0-d, x.dtype: max |x| (NaN/Inf propagate)
    stats: compiled.BlockStats | None  #: the graphs' block statistics (None: the C++ kernel runs)


def first_pass(x: torch.Tensor, order: ArithmeticOrder) -> FirstPass:
    """``max |x|`` of ``x`` [..., K] (fp32/bf16/fp16, K % 16 == 0, two blocks or more), and for
    the compiled graphs their block statistics."""
    x = x.detach()
    if native.usable(x.device) and block_encode.supports(order):
        return FirstPass(x, block_encode.abs_max(x), None)
    stats = compiled.block_stats(x, order)
    return FirstPass(x, stats.amax, stats)


def encode(
    first: FirstPass, global_scale: torch.Tensor, order: ArithmeticOrder
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., K/2], float8_e4m3fn scales [..., K/16]) with the float32 [1] tensor
    scale ``global_scale`` in the order's form (ENCODE for every order the graphs run)."""
    if first.stats is None:
        return block_encode.encode(first.x, global_scale, order)
    return compiled.encode(first.stats, global_scale, order)


def fake_quantize(
    first: FirstPass, global_scale: torch.Tensor, order: ArithmeticOrder
) -> torch.Tensor:
    """``dequantize(quantize(x))`` in x.dtype and x.shape."""
    if first.stats is None:
        return block_encode.fake_quantize(first.x, global_scale, order)
    return compiled.fake_quantize(first.stats, global_scale, order)
