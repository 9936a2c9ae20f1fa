"""The C++ Hessian products (``kernels/hessian_products.cpp``) bit for bit against slow torch
references that spell out the order: the Gram sum (``for row: total += outer(row, row)`` in
float64, rows in order) and the block rotation ``Qᵀ H Q`` (each element a sum from 0.0 of its
``b`` products in index order), on every vector path this CPU has and 1-3 threads; shapes that
leave partial tiles (K = 1, 5, 17, 100), a running sum that is not zero, strided rows, bfloat16
and float16 rows, the lower-triangle contract and :func:`mirror_lower`; the Hessian built on it
(``execution.gptq_hessian.Hessian``) and MR-GPTQ's ``rotated_hessian``; the refusals."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab.execution.gptq import rotated_hessian
from nvfp4lab.execution.gptq_hessian import Hessian
from nvfp4lab.hadamard import ct_rotation, rotation_matrix, rotation_matrix_blocks
from nvfp4lab.kernels import hessian_products as hp
from nvfp4lab.kernels import native

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the native C++ library cannot be built here"
)

#: Every vector path this CPU runs for this kernel (each check runs them all).
PATHS = list(native.ISAS[: native.ISAS.index(hp.isa()) + 1]) if native.available() else []


def gram_reference(total: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``total`` plus the products of each row, one row after the other, in float64."""
    out = total.clone()
    for row in rows.to(torch.float32).double():
        out += torch.outer(row, row)
    return out


def congruence_reference(h: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``Qᵀ H Q`` for ``Q = diag(blocks)``: ``T = Qᵀ H`` then ``T Q``, every element a sum
    starting at 0.0 over its ``b`` products in index order."""
    a, b, _ = blocks.shape
    k = a * b
    rows = h.reshape(a, b, k)
    t = torch.zeros(a, b, k, dtype=torch.float64)
    for s in range(b):
        t = t + blocks[:, s, :].reshape(a, b, 1) * rows[:, s : s + 1, :]
    cols = t.reshape(k, a, b)
    out = torch.zeros(k, a, b, dtype=torch.float64)
    for s in range(b):
        out = out + cols[:, :, s : s + 1] * blocks[:, s, :].reshape(1, a, b)
    return out.reshape(k, k)


def rows_of(n: int, k: int, seed: int) -> torch.Tensor:
    """float32 ``[n, k]`` spread over many binades (sums round at every step), a zero row and
    column, one subnormal."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g) * 4)
    x[n // 2] = 0.0
    x[:, k // 2] = 0.0
    x[0, 0] = 1e-40
    return x


def lower(m: torch.Tensor) -> torch.Tensor:
    return torch.tril(m)


@pytest.mark.parametrize(("n", "k"), [(1, 1), (7, 5), (33, 17), (129, 100), (300, 576)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_gram_equals_the_row_by_row_sum(n: int, k: int, threads: int) -> None:
    x = rows_of(n, k, seed=n + k)
    start = gram_reference(torch.zeros(k, k, dtype=torch.float64), rows_of(5, k, seed=1))
    expected = gram_reference(start, x)
    for path in PATHS:
        total = start.clone()
        hp.gram_add(total, x, path=path, threads=threads)
        assert torch.equal(lower(total), lower(expected)), (path, threads)
        assert torch.equal(hp.mirror_lower(total), expected), (path, threads)


def test_gram_large_matrix_every_path_the_same() -> None:
    """K = 1,536 and 2,048 rows (the kernel's row packs and tile bands several times over):
    every path and thread count gives the reference's bits."""
    x = rows_of(300, 1536, seed=3)
    expected = gram_reference(torch.zeros(1536, 1536, dtype=torch.float64), x)
    for path in PATHS:
        for threads in (1, 2):
            total = torch.zeros(1536, 1536, dtype=torch.float64)
            hp.gram_add(total, x, path=path, threads=threads)
            assert torch.equal(hp.mirror_lower(total), expected), (path, threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gram_half_precision_rows_and_strides(dtype: torch.dtype) -> None:
    """Rows 48 apart holding 32 columns (float32: handed to the kernel as they are, row stride
    48; the half types are widened to a contiguous copy), and float32 rows that are columns of
    a matrix (not unit stride: copied)."""
    wide = rows_of(65, 48, seed=4).to(dtype)
    for x in (wide[:, 8:40], wide.T.contiguous().T[:, 8:40]):
        expected = gram_reference(torch.zeros(32, 32, dtype=torch.float64), x)
        for path in PATHS:
            total = torch.zeros(32, 32, dtype=torch.float64)
            hp.gram_add(total, x, path=path, threads=2)
            assert torch.equal(hp.mirror_lower(total), expected), path


def test_mirror_lower_over_several_row_chunks() -> None:
    g = torch.Generator().manual_seed(5)
    m = torch.randn(1100, 1100, generator=g, dtype=torch.float64)
    expected = torch.tril(m) + torch.tril(m, -1).T
    assert torch.equal(hp.mirror_lower(m.clone()), expected)


@pytest.mark.parametrize(("k", "block"), [(16, 16), (48, 16), (576, 16), (128, 64)])
@pytest.mark.parametrize("seed", [0, 7, "ct"])
def test_block_congruence_equals_the_reference(k: int, block: int, seed: object) -> None:
    rotation = ct_rotation(seed=3, size=block) if seed == "ct" else seed
    g = torch.Generator().manual_seed(k)
    x = torch.randn(3 * k, k, generator=g, dtype=torch.float64)
    h = x.T @ x
    blocks = rotation_matrix_blocks(k, rotation, block=block, dtype=torch.float64)
    expected = congruence_reference(h, blocks)
    for path in PATHS:
        for threads in (1, 2):
            out = hp.block_congruence(h.clone(), blocks, path=path, threads=threads)
            assert torch.equal(out, expected), (path, threads)


def test_block_congruence_any_blocks_products_rounded() -> None:
    """Blocks of arbitrary values (products rounded, each block its own): still the
    reference's order, multiply then add (no FMA)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(100, 40, generator=g, dtype=torch.float64)
    h = x.T @ x
    blocks = torch.randn(5, 8, 8, generator=g, dtype=torch.float64)
    expected = congruence_reference(h, blocks)
    for path in PATHS:
        assert torch.equal(hp.block_congruence(h.clone(), blocks, path=path), expected), path


@pytest.mark.parametrize("seed", [0, 11, "ct"])
def test_rotation_matrix_blocks_are_the_dense_matrix_diagonal(seed: object) -> None:
    rotation = ct_rotation(seed=5) if seed == "ct" else seed
    dense = rotation_matrix(96, rotation, block=16, dtype=torch.float64)
    blocks = rotation_matrix_blocks(96, rotation, block=16, dtype=torch.float64)
    assert torch.equal(torch.block_diag(*blocks), dense)


def test_rotated_hessian_is_the_block_product_and_leaves_h() -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(200, 64, generator=g, dtype=torch.float64)
    h = x.T @ x
    before = h.clone()
    blocks = rotation_matrix_blocks(64, 9, dtype=torch.float64)
    assert torch.equal(rotated_hessian(h, 9), congruence_reference(h, blocks))
    assert torch.equal(h, before)
    dense = rotation_matrix(64, 9, dtype=torch.float64)
    assert torch.allclose(rotated_hessian(h, 9), dense.T @ h @ dense, rtol=1e-12, atol=1e-9)


def test_hessian_sums_rows_in_order_and_mixes_with_the_blas_path() -> None:
    """Native adds (float32, masked), then a float64 input (BLAS's addmm, after the lower
    triangle is mirrored): the matrix is the reference's for the native part."""
    x = rows_of(3, 50, seed=8).reshape(3, 50)[None].expand(2, 3, 50).clone()  # [B, T, K]
    mask = torch.tensor([[True, False, True], [True, True, True]])
    hessian = Hessian(50)
    hessian.add(x, mask)
    assert hessian.upper_stale and hessian.tokens == 5
    expected = gram_reference(torch.zeros(50, 50, dtype=torch.float64), x[mask])
    assert torch.equal(hessian.clone().matrix(), expected * (2.0 / 5))
    extra = torch.randn(4, 50, dtype=torch.float64)
    hessian.add(extra)
    assert not hessian.upper_stale and hessian.tokens == 9
    assert torch.equal(hessian.matrix(), torch.addmm(expected, extra.T, extra) * (2.0 / 9))


def test_hessian_mask_that_keeps_every_row() -> None:
    """An all-True mask adds the same rows in the same order as none (the view, no copy)."""
    x = rows_of(6, 24, seed=9).reshape(2, 3, 24)
    masked, plain = Hessian(24), Hessian(24)
    masked.add(x, torch.ones(2, 3, dtype=torch.bool))
    plain.add(x)
    expected = gram_reference(torch.zeros(24, 24, dtype=torch.float64), x.reshape(6, 24))
    assert masked.tokens == plain.tokens == 6
    assert torch.equal(masked.matrix(), expected * (2.0 / 6))
    assert torch.equal(plain.matrix(), expected * (2.0 / 6))


def test_refusals() -> None:
    good = torch.zeros(4, 4, dtype=torch.float64)
    for total, rows in [
        (good, torch.zeros(3, 5)),
        (good.float(), torch.zeros(3, 4)),
        (good.T.contiguous()[:, :4].t(), torch.zeros(3, 4)),
        (good, torch.zeros(3, 4, dtype=torch.float64)),
        (good, torch.zeros(3, 4, dtype=torch.int32)),
    ]:
        with pytest.raises(ValueError, match="gram_add needs"):
            hp.gram_add(total, rows)
    assert not hp.usable(good, torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="block_congruence needs"):
        hp.block_congruence(torch.zeros(20, 20, dtype=torch.float64),
                            torch.zeros(1, 16, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="block_congruence needs"):
        hp.block_congruence(torch.zeros(32, 32), torch.zeros(2, 16, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="block must be a positive int"):
        rotation_matrix_blocks(32, 0, block=0)
