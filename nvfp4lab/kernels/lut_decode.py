"""The table-lookup (LUT) decode: a small C++ kernel that decodes NVFP4 weights on the CPU.

``decode(packed, scales, t, dtype, rule=...)`` returns what the eager decode
(:func:`nvfp4lab.tensor.decode_blocks`, the arithmetic of every
:class:`~nvfp4lab.orders.DecodeRule`) returns, bit for bit: ``value(code)·(s / t)`` or
``value(code)·(s·t)`` in float32, one round-to-nearest-even to float32 / bfloat16 / float16.
The result depends only on the (scale byte, code) pair, so each call first computes the 256 x 16
results with exactly that float32 arithmetic (one IEEE operation per step, no fast-math, no FMA
contraction), and decoding is a gather: per 16-element block, the row of its scale byte indexed
by the 16 codes (AVX-512 ``vpermw`` / ``vpermps``, AVX2 ``pshufb`` / ``vpermps``, a scalar loop;
the path is picked at run time from the CPU's flags). The source is ``lut_decode.cpp`` beside
this module, part of nvfp4lab's native library (:mod:`nvfp4lab.kernels.native`: built once per
machine; where it cannot be, one WARNING line, and callers decode with the compiled graph or
eagerly, as :func:`nvfp4lab.kernels.fused_route` decides).
"""

from __future__ import annotations

import torch

from nvfp4lab.kernels.native import DTYPE_CODES, ISAS, library, required, vector_path
from nvfp4lab.kernels.steps import CODEC_BLOCK_SCALES, CODEC_TENSOR_SCALES, StepTable, implements
from nvfp4lab.orders import (
    ArithmeticOrder,
    DecodeRule,
    E2M1Ties,
    E4M3Rounding,
    ElementScaling,
    ScaleForm,
)

__all__ = ["ISAS", "STEPS", "RowDecoder", "decode", "isa", "supports"]

#: The decode rules by the number the library uses.
_RULES = {DecodeRule.SCALE_OVER_ENCODE: 0, DecodeRule.SCALE_TIMES_DECODE: 1}
#: Below this many blocks (64 K elements) one thread decodes (the library's own threshold too).
_PARALLEL_BLOCKS = 4096

#: The steps the decode implements (:mod:`nvfp4lab.kernels.steps`: any other member declines):
#: its own is the decode rule; the others made the codes and scale bytes it reads (E2M1 codes,
#: E4M3 bytes), listed as the members whose results it is known to read.
STEPS: StepTable = {
    "scale_form": frozenset({ScaleForm.ENCODE, ScaleForm.DECODE}),
    "tensor_scale": CODEC_TENSOR_SCALES,
    "block_scale": CODEC_BLOCK_SCALES,
    "e4m3_rounding": frozenset({E4M3Rounding.NEAREST_EVEN, E4M3Rounding.HALF_UP_UE4M3}),
    "element_scaling": frozenset({
        ElementScaling.MULTIPLY_BY_INVERSE,
        ElementScaling.DIVIDE_BY_SCALE_OVER_ENCODE,
        ElementScaling.DIVIDE_BY_SCALE_TIMES_DECODE,
        ElementScaling.PRESCALE_ONLY,
    }),
    "e2m1_ties": frozenset({E2M1Ties.EVEN, E2M1Ties.FIRST_NEAREST_SCALED_TABLE}),
    "decode": frozenset(_RULES),
}


def supports(order: ArithmeticOrder) -> bool:
    """Whether the decode implements every step of ``order`` (:data:`STEPS`: today all four
    orders). No route asks it: an NVFP4Tensor keeps its decode rule, not its order, and
    :func:`decode` / :class:`RowDecoder` refuse a rule they lack (ValueError)."""
    return implements(STEPS, order)


def _rule_number(rule: DecodeRule) -> int:
    """The library's number of ``rule``; ValueError for a rule it does not implement."""
    if rule not in _RULES:
        raise ValueError(f"the LUT decode does not implement the decode rule {rule!r}; decode "
                         "eagerly (nvfp4lab.tensor.decode_blocks)")
    return _RULES[rule]


def isa() -> str:
    """The gather path decodes run here (an entry of :data:`nvfp4lab.kernels.native.ISAS`: the
    best this CPU has, AVX-512 needing F + BW, capped by ``NVFP4LAB_NATIVE_ISA``); "" when
    unavailable."""
    lib = library()
    return "" if lib is None else ISAS[min(lib.nvfp4lab_lut_isa(), vector_path())]


class RowDecoder:
    """One weight bound for decoding row ranges into buffers with one library call each (no
    per-call tensor bookkeeping: the tiles of :func:`nvfp4lab.kernels.linear.tiled_matmul`).
    ``decoder(start, stop, out)`` decodes rows ``start:stop`` into ``out`` (contiguous, at
    least that many rows, ``dtype``); the arguments are as in :func:`decode`."""

    def __init__(
        self,
        packed: torch.Tensor,
        scales: torch.Tensor,
        tensor_scale: torch.Tensor,
        dtype: torch.dtype,
        *,
        rule: DecodeRule = DecodeRule.SCALE_OVER_ENCODE,
        threads: int | None = None,
    ) -> None:
        lib = required()
        self._packed = packed.reshape(-1, packed.shape[-1]).contiguous()
        self._scales = scales.view(torch.uint8).reshape(self._packed.shape[0], -1).contiguous()
        self._call = lib.nvfp4lab_lut_decode
        self._packed_ptr = self._packed.data_ptr()
        self._scales_ptr = self._scales.data_ptr()
        self._row_bytes = self._packed.shape[1]
        self._row_blocks = self._scales.shape[1]
        self._t = (
            tensor_scale.item() if tensor_scale.dtype == torch.float32 else float(tensor_scale)
        )
        self._rule = _rule_number(rule)
        self._dtype = DTYPE_CODES[dtype]
        self._threads = torch.get_num_threads() if threads is None else threads
        self._path = vector_path()

    def __call__(self, start: int, stop: int, out: torch.Tensor) -> None:
        nblocks = (stop - start) * self._row_blocks
        self._call(
            self._packed_ptr + start * self._row_bytes,
            self._scales_ptr + start * self._row_blocks,
            nblocks,
            self._t,
            self._rule,
            self._dtype,
            self._path,
            self._threads if nblocks >= _PARALLEL_BLOCKS else 1,
            out.data_ptr(),
        )


def decode(
    packed: torch.Tensor,
    scales: torch.Tensor,
    tensor_scale: torch.Tensor,
    dtype: torch.dtype,
    *,
    rule: DecodeRule = DecodeRule.SCALE_OVER_ENCODE,
    out: torch.Tensor | None = None,
    path: str | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Decode ``packed`` uint8 [..., K/2] with E4M3 ``scales`` [..., K/16] (float8_e4m3fn or its
    uint8 bytes) and the float32 [1] ``tensor_scale`` (ENCODE ``gs`` for ``SCALE_OVER_ENCODE``,
    DECODE ``d`` for ``SCALE_TIMES_DECODE``) to ``dtype`` (fp32/bf16/fp16) [..., K], on the CPU,
    bit for bit the eager decode. ``out``: a contiguous result buffer of that shape and dtype.
    ``path``: force a gather path of :data:`ISAS` (tests; clamped to what the CPU has and to
    ``NVFP4LAB_NATIVE_ISA``; default: the best). ``threads``: OpenMP threads (default: torch's
    intra-op threads). Raises RuntimeError when the library is unavailable (ask
    :func:`nvfp4lab.kernels.native.available` first)."""
    lib = required()
    packed = packed.contiguous()
    raw = scales.view(torch.uint8).contiguous()
    nblocks = raw.numel()
    shape = (*packed.shape[:-1], packed.shape[-1] * 2)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    elif out.dtype != dtype or not out.is_contiguous() or out.numel() != 2 * packed.numel():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of {2 * packed.numel()} elements (shape "
            f"{shape}), got {out.dtype} {tuple(out.shape)}"
        )
    if nblocks == 0:
        return out
    t = tensor_scale.item() if tensor_scale.dtype == torch.float32 else float(tensor_scale)
    wanted = vector_path(path)
    workers = torch.get_num_threads() if threads is None else threads
    lib.nvfp4lab_lut_decode(
        packed.data_ptr(),
        raw.data_ptr(),
        nblocks,
        t,
        _rule_number(rule),
        DTYPE_CODES[dtype],
        wanted,
        workers if nblocks >= _PARALLEL_BLOCKS else 1,
        out.data_ptr(),
    )
    return out
