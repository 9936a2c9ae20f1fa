"""GPTQ's Hessian and its inverse factor, the K x K float64 part of :mod:`~nvfp4lab.execution.
gptq`: the running ``H = (2/n) Σ x xᵀ`` (:class:`Hessian`, summed by the native Gram kernel on
the CPU, :mod:`nvfp4lab.kernels.hessian_products`), the upper Cholesky factor of the damped
inverse (:func:`_inverse_factor`, made in the matrix's own storage on the CPU:
:func:`_factor_in_place`) and the row-chunked NaN check (:func:`all_finite`). Memory: one K x K
float64 matrix per layer at a time (254 MB for a 5,632-wide down_proj)."""

from __future__ import annotations

import torch

from nvfp4lab.kernels import hessian_products

WORK_DTYPE = torch.float64  # dtype of H, W and the Cholesky factors


class Hessian:
    """Running ``H = (2/n) Σ x xᵀ`` over ``n`` tokens, float64 ``[K, K]`` on ``device``.

    On the CPU, float32 / bfloat16 / float16 inputs are summed by the native Gram kernel
    (:mod:`nvfp4lab.kernels.hessian_products`): every product exact, the tokens added one
    after the other, so the sum is the same on every CPU, vector path and thread count (the
    reference: ``for x in rows: sum += outer(x, x)`` in float64), and only the lower triangle
    is computed (half BLAS's work); :meth:`matrix` mirrors it. Elsewhere (a GPU, float64
    inputs, no native library) BLAS's ``addmm`` sums, in the order its blocking picks: the last
    bits may differ from the native sum's."""

    def __init__(self, k: int, device: torch.device | str | None = None) -> None:
        self.sum = torch.zeros(k, k, dtype=WORK_DTYPE, device=device)
        self.tokens = 0
        #: only the lower triangle of ``sum`` is current (the native kernel's adds)
        self.upper_stale = False

    def add(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Accumulate the rows of ``x [..., K]``; ``mask`` (bool, ``x.shape[:-1]``) keeps rows
        (one that keeps every row is not applied: the same rows in the same order, no copy)."""
        if (mask is not None and mask.dtype == torch.bool and mask.shape == x.shape[:-1]
                and bool(mask.all())):
            mask = None
        rows = x.detach()[mask] if mask is not None else x.detach().reshape(-1, x.shape[-1])
        if not rows.shape[0]:
            return
        if hessian_products.usable(self.sum, rows):
            hessian_products.gram_add(self.sum, rows)
            self.upper_stale = True
        else:
            self._mirrored()
            rows = rows.to(device=self.sum.device, dtype=WORK_DTYPE)
            self.sum.addmm_(rows.T, rows)
        self.tokens += rows.shape[0]

    def _mirrored(self) -> torch.Tensor:
        """``sum``, its strict upper triangle made current (the lower one's transpose)."""
        if self.upper_stale:
            hessian_products.mirror_lower(self.sum)
            self.upper_stale = False
        return self.sum

    def matrix(self) -> torch.Tensor:
        """float64 ``[K, K]``; ValueError when no token was added."""
        if not self.tokens:
            raise ValueError("the Hessian has no tokens: no calibration input reached the layer")
        return self._mirrored() * (2.0 / self.tokens)

    def take_matrix(self) -> torch.Tensor:
        """:meth:`matrix`, made in place of the running sum and handed over (the caller may
        overwrite it; no second K×K copy). The Hessian is left empty and must not be used
        again."""
        if not self.tokens:
            raise ValueError("the Hessian has no tokens: no calibration input reached the layer")
        matrix = self._mirrored().mul_(2.0 / self.tokens)
        self.sum, self.tokens = matrix.new_empty(0, 0), 0
        return matrix

    def clone(self) -> Hessian:
        """An independent copy (the running sum and the token count)."""
        copy = Hessian.__new__(Hessian)
        copy.sum, copy.tokens, copy.upper_stale = self.sum.clone(), self.tokens, self.upper_stale
        return copy


def _inverse_factor(h: torch.Tensor | list[torch.Tensor], damp: float) -> torch.Tensor | None:
    """Upper Cholesky factor of ``(H + damp·mean(diag H)·I)⁻¹``; None if not positive definite.

    ``h``: ``H`` ``[K, K]`` float64 (left as it is), or a one-element list holding it, handed
    over: then it is overwritten and returned as the factor. Either way the factors are the
    ones ``torch.linalg.cholesky`` → ``cholesky_inverse`` → ``cholesky(upper=True)`` give (like
    ``torch.linalg.cholesky``, only H's lower triangle is read). On the CPU the three LAPACK
    steps run in place in one K×K buffer (:func:`_factor_in_place`): the Hessian of a
    5,632-wide down_proj is 254 MB in float64, and each step out of place held two."""
    damped = h.pop() if isinstance(h, list) else h.clone()
    if damped.device.type == "cpu" and damped.is_contiguous():
        return _factor_in_place(damped, damp)
    damped.diagonal().add_(damp * float(damped.diagonal().mean()))
    lower, info = torch.linalg.cholesky_ex(damped)
    del damped
    if int(info):
        return None
    inverse = torch.cholesky_inverse(lower)
    del lower
    upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
    del inverse
    return None if int(info) else upper


#: rows per chunk of the in-place triangle copies (a chunk's temporary is TILE × K)
_TILE = 512


def _factor_in_place(h: torch.Tensor, damp: float) -> torch.Tensor | None:
    """:func:`_inverse_factor` of the row-major ``h`` [K, K], computed in ``h``'s storage.

    LAPACK works on column-major matrices, and ``torch.linalg`` runs in place when ``out=`` is
    a column-major view: ``h.mT``. That view's lower triangle is ``h``'s upper one, so ``h``'s
    lower triangle is first mirrored into its upper one (the Hessian sum need not be exactly
    symmetric in floating point; the out-of-place path reads the lower triangle). The factor is
    then ``U`` in the view, i.e. ``Uᵀ`` row-major in ``h``, and is transposed back in place,
    tile by tile. Bit for bit the out-of-place steps (tested)."""
    k = h.shape[0]
    for r0 in range(0, k, _TILE):  # upper := lower transposed, a block row at a time
        r1 = min(r0 + _TILE, k)
        h[r0:r1, r0:].copy_(h[r0:, r0:r1].T.clone())
    h.diagonal().add_(damp * float(h.diagonal().mean()))
    view = h.mT
    info = torch.empty((), dtype=torch.int32)
    torch.linalg.cholesky_ex(view, out=(view, info))
    if int(info):
        return None
    torch.cholesky_inverse(view, out=view)
    torch.linalg.cholesky_ex(view, upper=True, out=(view, info))
    if int(info):
        return None
    for r0 in range(0, k, _TILE):  # h holds Uᵀ (lower): h := its transpose
        r1 = min(r0 + _TILE, k)
        h[r0:r1, r0:].copy_(h[r0:, r0:r1].T.clone())
        h[r1:, r0:r1].zero_()
    return h


def all_finite(matrix: torch.Tensor, rows: int = 256) -> bool:
    """Whether every element of ``matrix [R, C]`` is finite.

    First the sum of all elements, one pass and no temporary: a NaN or an infinity anywhere
    makes the sum NaN or infinite in any summation order, so a finite sum proves every element
    finite. Only a non-finite sum (a bad element, or finite elements whose sum overflows) is
    checked element by element, ``rows`` rows at a time (``torch.isfinite`` of the whole float64
    K×K Hessian made a K×K temporary: 254 MB at K = 5,632; the chunked check alone cost about 25×
    the sum on a 1536² Hessian)."""
    if matrix.numel() and bool(torch.isfinite(matrix.sum())):
        return True
    return all(bool(torch.isfinite(matrix[r : r + rows]).all())
               for r in range(0, matrix.shape[0], rows))
