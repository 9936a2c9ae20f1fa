"""nvfp4lab.hadamard against a dense Sylvester Hadamard built here from its closed form.

``H[i, j] = (-1)^popcount(i & j) / sqrt(n)`` is the Sylvester matrix (the module builds it by
doubling); ``Q = diag(signs) · blockdiag(H16, ...)`` is the documented rotation.
"""

from __future__ import annotations

import pytest
import torch

from nvfp4lab import hadamard as H


def sylvester(n: int) -> torch.Tensor:
    """Dense float64 orthonormal Sylvester Hadamard of order n, from the closed form."""
    idx = torch.arange(n)
    bits = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1.0 - 2.0 * parity.double()) * (1.0 / n**0.5)


def dense_rotation(k: int, seed: int) -> torch.Tensor:
    """``diag(signs) @ blockdiag(H16, ..., H16)``, float64."""
    return torch.diag(H.random_signs(k, seed).double()) @ torch.block_diag(
        *[sylvester(16)] * (k // 16))


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64])
def test_hadamard_matrix_equals_the_closed_form(n: int) -> None:
    h = H.hadamard_matrix(n, dtype=torch.float64)
    assert torch.equal(h, sylvester(n))
    assert torch.equal(H.hadamard_matrix(n), sylvester(n).float())
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-15)


def test_random_signs_are_plus_minus_one_and_seeded() -> None:
    s = H.random_signs(4096, 7)
    assert s.dtype == torch.float32 and set(s.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(s, H.random_signs(4096, 7))
    assert not torch.equal(s, H.random_signs(4096, 8))
    assert 1800 < int((s > 0).sum()) < 2300  # fair coin: 2048 ± 5.6 sigma


@pytest.mark.parametrize("k", [16, 48, 128])
def test_rotation_matrix_is_the_dense_construction(k: int) -> None:
    want = dense_rotation(k, seed=5)
    # each entry is one ±1 times one ±0.25: exact in float32 and float64
    assert torch.equal(H.rotation_matrix(k, 5, dtype=torch.float64), want)
    assert torch.equal(H.rotation_matrix(k, 5), want.float())
    q = H.rotation_matrix(k, 5, dtype=torch.float64)
    assert torch.allclose(q @ q.T, torch.eye(k, dtype=torch.float64), atol=1e-15)


def test_transform_and_inverse_against_the_dense_matrix() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, dtype=torch.float64, generator=g)
    q = dense_rotation(64, seed=9)
    fwd = H.hadamard_transform(x, 9)
    assert fwd.dtype == torch.float64 and fwd.shape == x.shape
    assert torch.allclose(fwd, x @ q, rtol=0, atol=1e-13)  # float64 work: float32 would miss this
    assert torch.allclose(H.hadamard_transform(x, 9, inverse=True), x @ q.T, rtol=0, atol=1e-13)


def test_round_trip_is_exact_on_small_integers() -> None:
    # integers in [-8, 8]: x Q is a multiple of 1/4 below 2**7, x Q Q^T sums such terms exactly
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-8, 9, (4, 128), generator=g).float()
    rotated = H.hadamard_transform(x, 3)
    assert torch.equal(rotated * 4, torch.round(rotated * 4))
    assert torch.equal(H.hadamard_transform(rotated, 3, inverse=True), x)
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        out = H.hadamard_transform(xd, 3)
        assert out.dtype == dtype
        assert torch.equal(out, rotated.to(dtype))  # float32 work, one rounding at the end


def test_rotated_gemm_matches_the_plain_product_in_float64() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 32, dtype=torch.float64, generator=g)
    w = torch.randn(10, 32, dtype=torch.float64, generator=g)
    xr, wr = H.rotate_gemm_operands(x, w, 4)
    q = dense_rotation(32, seed=4)
    assert torch.allclose(xr, x @ q, atol=1e-13) and torch.allclose(wr, w @ q, atol=1e-13)
    assert torch.allclose(H.rotated_matmul(x, w, 4), x @ w.T, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"weight must be \[N, K\].*\(2, 5, 32\)"):
        H.rotate_gemm_operands(x, w.reshape(2, 5, 32), 4)


@pytest.mark.parametrize("seed", [-1, 1.5, "3", True, None])
def test_check_seed_rejects_and_names_the_value(seed: object) -> None:
    with pytest.raises(ValueError, match=rf"rotation must be a non-negative.*got {seed!r}"):
        H.check_seed(seed, "rotation")
    with pytest.raises(ValueError, match=r"^hadamard must be"):
        H.random_signs(16, seed)  # type: ignore[arg-type]


def test_check_seed_accepts_non_negative_ints() -> None:
    assert H.check_seed(0) == 0 and H.check_seed(2**40) == 2**40


def test_bad_sizes_and_inputs() -> None:
    for n in (0, 3, 12, True, 16.0):
        with pytest.raises(ValueError, match=rf"power of two >= 1, got {n!r}"):
            H.hadamard_matrix(n)  # type: ignore[arg-type]
    for k in (0, 24, -16, True):
        with pytest.raises(ValueError, match=rf"multiple of 16, got {k!r}"):
            H.rotation_matrix(k, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"float tensor, got dtype torch\.int64"):
        H.hadamard_transform(torch.ones(2, 16, dtype=torch.int64), 0)
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor, got list"):
        H.hadamard_transform([1.0] * 16, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"shape \(\) has K"):
        H.hadamard_transform(torch.tensor(1.0), 0)
    # a custom block size acts block by block
    x = torch.randn(2, 24, dtype=torch.float64)
    q8 = torch.diag(H.random_signs(24, 0).double()) @ torch.block_diag(*[sylvester(8)] * 3)
    assert torch.allclose(H.hadamard_transform(x, 0, block=8), x @ q8, atol=1e-13)
