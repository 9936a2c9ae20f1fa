"""The GEMM of a linear layer with an NVFP4 weight, the weight decoded tile by tile.

``tiled_matmul(a, w)`` returns what ``torch.matmul(a, W.T)`` returns for the decoded weight
``W = decode(w)`` [N, K] (in ``a.dtype``), without ever holding W whole: ``tile_rows`` rows of W at
a time are decoded into one reused buffer and multiplied by torch, ``out[:, n0:n1] = a @
W_tile.T``. The decode (:func:`decode`, :func:`row_decoder`) is the C++ LUT kernel on a CPU where
it is built (:mod:`nvfp4lab.kernels.lut_decode`: tiles of :data:`LUT_TILE_BYTES` per thread
and at least :data:`LUT_MIN_ROWS` rows), else the compiled graph
(:func:`nvfp4lab.kernels.compiled.decode`, CUDA or a CPU without the LUT kernel: tiles of
:data:`TILE_BYTES`). ``fp32=True`` multiplies float32 copies of ``a`` and of the decoded tile, as
the linear's ``bias_mode="fp32"`` does.

Exactness. Every output element is the same dot product of the same operands as in the single
GEMM, but a BLAS library may split the K reduction differently for a ``[M, tile]`` problem than
for ``[M, N]`` (oneDNN and MKL choose their partition from the shape and thread count; measured
here: bf16 M=256, N=6144, K=4096 differs in ~250 elements with 256-1024-row tiles, float32 M=16,
N=2048, K=1024 in ~30 000 with 512-row tiles; M=16, K=N=4096 is identical). So the first call of
each GEMM shape class (device, dtype, fp32, M, N, K, tile size, threads) computes the single
GEMM, returns it, and tries tiles of the default rows, then twice, four times ... as many up to
N/2, keeping the first that reproduces it bit for bit (:func:`tiled_verdicts`). A shape class
where none does always runs one GEMM on the whole weight (decoded into one temporary). Either
way the result is bit for bit ``torch.matmul(a, W.T)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from nvfp4lab.kernels import compiled, lut_decode, native
from nvfp4lab.kernels.compiled import balanced
from nvfp4lab.orders import DecodeRule

__all__ = [
    "LUT_MIN_ROWS",
    "LUT_TILE_BYTES",
    "TILE_BYTES",
    "EncodedWeight",
    "decode",
    "row_decoder",
    "tiled_matmul",
    "tiled_verdicts",
]

#: Bytes of decoded weight per tile with the compiled decode: below glibc's 32 MiB mmap threshold
#: (the buffer comes back from the heap on later calls, no page faults) and L3-resident while its
#: GEMM reads it. 16 MiB (2048 rows of bf16 at K=4096) measured fastest on the 2-core CPU at M=16.
TILE_BYTES: int = 16 << 20
#: Bytes of decoded weight per tile and thread with the C++ LUT decode (the CPU), and its fewest
#: rows (each tile costs a library call and a GEMM call, ~10-30 us together). Measured on the
#: 2-core CPU (bf16, W4A16, M = 1 and 16, interleaved with F.linear, best of 11, one thread's CPU
#: time and two threads' wall time), as a multiple of F.linear at K = N = 4096: 4 MiB 1.8-2.1x
#: against 1 MiB's 2.2-2.7x (in either order of the two, so not a cache left warm by the other);
#: at N = 4096, K = 14336 the two are within noise (0.8-1.2x at M = 1, 1.8-2.2x at M = 16);
#: 8 MiB scattered around 4 MiB's figures and 16 MiB was slower (up to 3.8x). (An earlier build,
#: without the decode's prefetch, measured 1 MiB ahead of 2 MiB.)
LUT_TILE_BYTES: int = 4 << 20
LUT_MIN_ROWS: int = 128

_VERDICTS: dict[tuple[object, ...], int] = {}


class EncodedWeight(NamedTuple):
    """An NVFP4 weight [N, K] as the decode kernel reads it (16-element blocks, K % 16 == 0)."""

    packed: torch.Tensor  #: uint8 [N, K/2]
    scales: torch.Tensor  #: float8_e4m3fn [N, K/16]
    tensor_scale: torch.Tensor  #: float32 [1]: ENCODE gs or DECODE d, as ``rule`` says
    rule: DecodeRule  #: value·(s/gs) or value·(s·d) (vLLM's and ModelOpt's)


def decode(
    packed: torch.Tensor,
    scales: torch.Tensor,
    tensor_scale: torch.Tensor,
    dtype: torch.dtype,
    *,
    rule: DecodeRule,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of the weight decoded to ``dtype`` (into ``out``): by the C++ LUT kernel on a CPU
    where it is built (:func:`nvfp4lab.kernels.native.usable`), else by the compiled graph
    (:func:`nvfp4lab.kernels.compiled.decode`; CUDA, or a CPU without the LUT kernel). Either is
    bit for bit the eager decode."""
    if native.usable(packed.device):
        if out is None:  # a large result in huge pages (compiled.fresh), as the graphs do
            out = compiled.fresh((*packed.shape[:-1], 2 * packed.shape[-1]), dtype,
                                 packed.device)
        return lut_decode.decode(packed, scales, tensor_scale, dtype, rule=rule, out=out)
    return compiled.decode(packed, scales, tensor_scale, dtype, rule=rule, out=out)


def tiled_verdicts() -> dict[tuple[object, ...], int]:
    """The per-shape-class verdicts so far: the tile rows that reproduce the single GEMM, 0 where
    none does (the whole weight is decoded); a copy."""
    return dict(_VERDICTS)


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit-for-bit equality (-0.0 differs from 0.0; NaNs compare by their bits)."""
    as_int = {4: torch.int32, 2: torch.int16}[x.element_size()]
    return torch.equal(x.view(as_int), y.view(as_int))


def _product(a: torch.Tensor, w: torch.Tensor, fp32: bool) -> torch.Tensor:
    """``a @ w.T`` as the linear computes it (float32 operands when ``fp32``)."""
    if fp32:
        return torch.matmul(a.to(torch.float32), w.to(torch.float32).T)
    return torch.matmul(a, w.T)


def _whole(a: torch.Tensor, w: EncodedWeight, fp32: bool) -> torch.Tensor:
    full = decode(w.packed, w.scales, w.tensor_scale, a.dtype, rule=w.rule)
    return _product(a, full, fp32)


def row_decoder(w: EncodedWeight, dtype: torch.dtype) -> Callable[[int, int, torch.Tensor], None]:
    """``decoder(start, stop, out)``: rows ``start:stop`` of ``w`` decoded to ``dtype`` into
    ``out``, by the C++ LUT kernel bound to the weight once (a CPU where it is built) or by
    the compiled graph (:func:`nvfp4lab.kernels.compiled.decode`)."""
    if native.usable(w.packed.device):
        return lut_decode.RowDecoder(w.packed, w.scales, w.tensor_scale, dtype, rule=w.rule)

    def rows(start: int, stop: int, out: torch.Tensor) -> None:
        compiled.decode(
            w.packed[start:stop], w.scales[start:stop], w.tensor_scale, dtype, rule=w.rule, out=out
        )

    return rows


def _tiled(a: torch.Tensor, w: EncodedWeight, fp32: bool, rows: int) -> torch.Tensor:
    n, k = w.packed.shape[0], w.packed.shape[1] * 2
    out = torch.empty((a.shape[0], n), dtype=torch.float32 if fp32 else a.dtype, device=a.device)
    buf = torch.empty((rows, k), dtype=a.dtype, device=a.device)
    decoder = row_decoder(w, a.dtype)
    for part in balanced(n, rows):
        tile = buf[: part.stop - part.start]
        decoder(part.start, part.stop, tile)
        if fp32:
            out[:, part] = _product(a, tile, fp32)
        else:  # straight into the output's columns: no temporary, no copy
            torch.matmul(a, tile.T, out=out[:, part])
    return out


def tiled_matmul(
    a: torch.Tensor, w: EncodedWeight, *, fp32: bool = False, tile_bytes: int | None = None
) -> torch.Tensor:
    """``torch.matmul(a, decode(w).T)`` for ``a`` [M, K] (fp32/bf16/fp16) and the weight ``w``
    [N, K] decoded to ``a.dtype``: [M, N] in ``a.dtype`` (float32 when ``fp32``), with the weight
    decoded ``tile_bytes`` (default :data:`LUT_TILE_BYTES` per torch thread, at least
    :data:`LUT_MIN_ROWS` rows, with the LUT decode, else :data:`TILE_BYTES`) at a time (see the
    module docstring for the exactness check)."""
    n, k = w.packed.shape[0], w.packed.shape[1] * 2
    row_bytes = max(1, k * a.element_size())
    if tile_bytes is not None:
        rows = max(3, tile_bytes // row_bytes)
    elif native.usable(w.packed.device):
        per_tile = LUT_TILE_BYTES * torch.get_num_threads()
        rows = max(3, LUT_MIN_ROWS, per_tile // row_bytes)
    else:
        rows = max(3, TILE_BYTES // row_bytes)
    if n <= rows:
        return _whole(a, w, fp32)  # one tile: exactly the single GEMM
    key = (a.device.type, a.dtype, fp32, a.shape[0], n, k, rows, torch.get_num_threads())
    verdict = _VERDICTS.get(key)
    if verdict is None:
        whole = _whole(a, w, fp32)
        _VERDICTS[key] = _exact_rows(a, w, fp32, rows, whole)
        return whole
    return _tiled(a, w, fp32, verdict) if verdict else _whole(a, w, fp32)


def _exact_rows(
    a: torch.Tensor, w: EncodedWeight, fp32: bool, rows: int, whole: torch.Tensor
) -> int:
    """The first tile height of ``rows``, ``2·rows``, ... (below N) whose tiled product is
    ``whole`` bit for bit; 0 when none is."""
    n = w.packed.shape[0]
    while rows < n:
        if _same_bits(_tiled(a, w, fp32, rows), whole):
            return rows
        rows *= 2
    return 0
