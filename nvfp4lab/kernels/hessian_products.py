"""GPTQ's Hessian products in C++, each sum in a defined order: the float64 Gram matrix
``Σ_t x_tᵀ x_t`` of float32 rows (the Hessian sum) and the block rotation ``Qᵀ H Q`` (MR-GPTQ).

:func:`gram_add` adds to ``total[i, j]`` the products ``x[t, i] · x[t, j]`` one row ``t`` after
the other (each element: the running sum, then row 0's product, then row 1's, ..., every
addition rounded to float64). A product of two float32 values is exact in float64 (24 + 24
significant bits fit in 53; no overflow, no subnormal), so the result is the same on every
vector path, tiling and thread count, and equals the slow reference
``for row in x.double(): total += torch.outer(row, row)`` bit for bit (tests). BLAS's ``addmm``
sums in an order its blocking chooses, which differs between libraries and CPUs.

Only the lower triangle (``j <= i``) is computed (half the work of the full product): elements
above the diagonal are left stale; :func:`mirror_lower` copies the lower triangle onto them.

:func:`block_congruence` overwrites ``H`` with ``Qᵀ H Q`` for a block-diagonal ``Q``, ``b x b``
blocks (MR-GPTQ's Hadamard rotation: signs times a 16-point Hadamard matrix over 4): ``T = Qᵀ H``,
then ``T Q``, each element a sum of ``b`` products that starts at 0.0 and adds them in index order,
every product and addition rounded to float64 (no FMA; with entries ±1/4 the products are exact).
Row block ``i // b`` of the result needs only row block ``i // b`` of ``H``: in place,
``4·b·K²`` multiply-adds against the dense product's ``4·K³`` (7 ms against 86 ms at K = 1,536 on
two cores).

``hessian_products.cpp`` is part of nvfp4lab's native library (:mod:`nvfp4lab.kernels.native`):
AVX-512 (8 x 24 Gram tiles), AVX2 (6 x 8) or scalar (4 x 4), picked at run time, OpenMP
threads splitting the tiles (the rotation's loops are the compiler's, vectorized per path).
"""

from __future__ import annotations

import torch

from nvfp4lab.kernels.native import ISAS, library, required, vector_path
from nvfp4lab.vocab import SUPPORTED_DTYPES

__all__ = ["available", "block_congruence", "gram_add", "isa", "mirror_lower", "usable"]

#: rows per chunk of :func:`mirror_lower` (a chunk's temporary is TILE x K)
_TILE = 512


def available() -> bool:
    """Whether the native library (with this kernel) works here."""
    return library() is not None


def isa() -> str:
    """The vector path the kernel runs here (an entry of :data:`ISAS`, capped by
    ``NVFP4LAB_NATIVE_ISA``); "" when the library is unavailable."""
    lib = library()
    return "" if lib is None else ISAS[min(lib.nvfp4lab_gram_isa(), vector_path())]


def usable(total: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether :func:`gram_add` takes ``total`` and ``rows`` as they are: both on the CPU,
    ``total`` float64 contiguous, ``rows`` float32, bfloat16 or float16 (exact products), and the
    library available."""
    return (total.device.type == "cpu" and rows.device.type == "cpu"
            and total.dtype == torch.float64 and total.is_contiguous()
            and rows.dtype in SUPPORTED_DTYPES and available())


def gram_add(total: torch.Tensor, rows: torch.Tensor, *, path: str | None = None,
             threads: int | None = None) -> None:
    """``total[i, j] += Σ_t rows[t, i] · rows[t, j]`` for ``j <= i`` (module docstring: rows in
    order, exact products), in place.

    ``total``: float64 ``[K, K]``, contiguous, CPU. ``rows``: ``[T, K]`` float32 (bfloat16 and
    float16 are widened to float32 first, exactly), CPU. ``path``: a narrower vector path
    (tests; clamped to the CPU and ``NVFP4LAB_NATIVE_ISA``); ``threads``: OpenMP threads
    (default torch's intra-op threads). ValueError for other dtypes, shapes or devices."""
    if (rows.ndim != 2 or total.ndim != 2 or tuple(total.shape) != (rows.shape[1],) * 2
            or total.dtype != torch.float64 or not total.is_contiguous()
            or rows.dtype not in SUPPORTED_DTYPES
            or total.device.type != "cpu" or rows.device.type != "cpu"):
        raise ValueError(
            "gram_add needs total float64 [K, K] contiguous and rows [T, K] float32 / bfloat16 / "
            f"float16, both on the CPU; got total {total.dtype} {tuple(total.shape)} on "
            f"{total.device}, rows {rows.dtype} {tuple(rows.shape)} on {rows.device}")
    x = rows.to(torch.float32)
    if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
        x = x.contiguous()
    required().nvfp4lab_gram_add(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0) if x.shape[0] > 1 else x.shape[1],
        vector_path(path), torch.get_num_threads() if threads is None else threads,
        total.data_ptr())


def mirror_lower(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix [K, K]`` with its strict upper triangle overwritten by its lower triangle's
    transpose, in place (a block row at a time: temporaries of ``_TILE x K``); returned."""
    k = matrix.shape[0]
    for r0 in range(0, k, _TILE):
        r1 = min(r0 + _TILE, k)
        matrix[r0:r1, r1:].copy_(matrix[r1:, r0:r1].T)
        square = matrix[r0:r1, r0:r1]
        lower = torch.ones(r1 - r0, r1 - r0, dtype=torch.bool, device=matrix.device).tril_()
        square.copy_(torch.where(lower, square, square.T))
    return matrix


def block_congruence(matrix: torch.Tensor, blocks: torch.Tensor, *, path: str | None = None,
                     threads: int | None = None) -> torch.Tensor:
    """``matrix := Qᵀ · matrix · Q`` in place and returned, ``Q = diag(blocks[0], blocks[1],
    ...)`` (module docstring: each sum from 0.0 in index order, no FMA).

    ``matrix``: float64 ``[K, K]`` contiguous, CPU; ``blocks``: float64 ``[K / b, b, b]``, CPU,
    the diagonal blocks of ``Q`` in order. ``path``, ``threads``: as :func:`gram_add`.
    ValueError otherwise."""
    k = matrix.shape[0] if matrix.ndim == 2 else 0
    b = blocks.shape[-1] if blocks.ndim == 3 else 0
    if (not k or matrix.shape[1] != k or matrix.dtype != torch.float64
            or not matrix.is_contiguous() or matrix.device.type != "cpu" or not b
            or k % b or tuple(blocks.shape) != (k // b, b, b) or blocks.dtype != torch.float64
            or blocks.device.type != "cpu"):
        raise ValueError(
            "block_congruence needs matrix float64 [K, K] contiguous and blocks float64 "
            f"[K / b, b, b], both on the CPU; got matrix {matrix.dtype} {tuple(matrix.shape)} on "
            f"{matrix.device}, blocks {blocks.dtype} {tuple(blocks.shape)} on {blocks.device}")
    r = blocks.contiguous()
    required().nvfp4lab_block_congruence(
        matrix.data_ptr(), k, r.data_ptr(), b, vector_path(path),
        torch.get_num_threads() if threads is None else threads)
    return matrix
