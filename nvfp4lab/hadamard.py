"""Seeded random block-Hadamard rotation along K, and its paired use on both GEMM operands.

The rotation is ``Q = D · blockdiag(H16, ..., H16)`` of size ``K × K``: ``D`` a diagonal of
random signs (±1, from ``seed``), ``H16`` the 16-point Sylvester Hadamard matrix scaled by
``1/4`` (orthonormal, symmetric, entries ±0.25, exact in every float dtype). ``Q`` is orthogonal,
so for ``x [..., K]`` and ``W [N, K]``::

    (x Q) (W Q)^T = x Q Q^T W^T = x W^T

A quantized GEMM therefore rotates BOTH operands with the same ``seed`` and quantizes the rotated
tensors; each 16-point Hadamard mixes exactly one NVFP4 block, spreading an outlier over its
block. The transform is computed in float32 and cast back to the input dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nvfp4lab.vocab import SUPPORTED_DTYPES

__all__ = [
    "HADAMARD_SIZE",
    "check_seed",
    "hadamard_matrix",
    "hadamard_of_order",
    "hadamard_transform",
    "paley_hadamard",
    "random_signs",
    "rotate",
    "rotate_gemm_operands",
    "rotated_matmul",
    "rotation_blocks",
    "rotation_matrix",
]

#: Points of the block-diagonal Hadamard (one NVFP4 block).
HADAMARD_SIZE: int = 16

#: The supported dtypes, and float64.
_FLOAT_DTYPES = (*SUPPORTED_DTYPES, torch.float64)


def check_seed(seed: object, what: str = "hadamard") -> int:
    """Return ``seed`` if it is a non-negative int, else raise ValueError naming ``what``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(
            f"{what} must be a non-negative integer seed (or None to disable), got {seed!r}"
        )
    return seed


def hadamard_matrix(
    n: int = HADAMARD_SIZE,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix ``[n, n]`` (``n`` a power of two), ``H = H^T``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two >= 1, got {n!r}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / n**0.5).to(dtype=dtype, device=device)


def random_signs(
    k: int, seed: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """float32 ``[k]`` of ±1 drawn from a CPU ``torch.Generator`` seeded with ``seed``.

    The same ``(k, seed)`` gives the same vector on every device and platform.
    """
    check_seed(seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    bits = torch.randint(0, 2, (k,), generator=gen, dtype=torch.int64)
    return (1.0 - 2.0 * bits.to(torch.float32)).to(device)


def _check_k(x: torch.Tensor, block: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"the Hadamard transform needs a float tensor, got dtype {x.dtype}")
    if x.ndim == 0 or x.shape[-1] % block:
        raise ValueError(
            f"the Hadamard transform acts on the last dimension K in blocks of {block}; "
            f"shape {tuple(x.shape)} has K not a multiple of {block}"
        )


def hadamard_transform(
    x: torch.Tensor, seed: int, *, inverse: bool = False, block: int = HADAMARD_SIZE
) -> torch.Tensor:
    """``x Q`` (or ``x Q^T`` with ``inverse=True``) along the last dim; same shape and dtype.

    ``x``: float ``[..., K]`` with ``K % block == 0``. Computed in float32 (float64 stays
    float64). ``hadamard_transform(hadamard_transform(x, s), s, inverse=True) ≈ x``.
    """
    _check_k(x, block)
    check_seed(seed)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    k = x.shape[-1]
    signs = random_signs(k, seed, device=x.device).to(work)
    h = hadamard_matrix(block, dtype=work, device=x.device)
    v = x.to(work)
    if not inverse:
        v = v * signs
    v = (v.reshape(*x.shape[:-1], k // block, block) @ h).reshape(x.shape)
    if inverse:
        v = v * signs
    return v.to(x.dtype)


def rotation_matrix(
    k: int, seed: int, *, block: int = HADAMARD_SIZE, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The dense ``[K, K]`` matrix ``Q`` of :func:`hadamard_transform` (for tests and figures)."""
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0 or k % block:
        raise ValueError(f"K must be a positive multiple of {block}, got {k!r}")
    return hadamard_transform(torch.eye(k, dtype=dtype), seed, block=block)


def rotate_gemm_operands(
    x: torch.Tensor, weight: torch.Tensor, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate both GEMM operands with the same ``Q``: returns ``(x Q, W Q)``.

    ``x``: ``[..., K]``; ``weight``: ``[N, K]`` (nn.Linear layout). ``(xQ)(WQ)^T == x W^T``
    up to float rounding.
    """
    _check_k(x, HADAMARD_SIZE)
    _check_k(weight, HADAMARD_SIZE)
    if weight.ndim != 2 or weight.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"weight must be [N, K] with K = x.shape[-1] = {x.shape[-1]}, got "
            f"{tuple(weight.shape)}"
        )
    return hadamard_transform(x, seed), hadamard_transform(weight, seed)


def rotated_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    seed: int,
    *,
    quantize_input: Callable[[torch.Tensor], torch.Tensor] | None = None,
    quantize_weight: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``q_x(x Q) · q_w(W Q)^T`` in ``x.dtype``: a GEMM on rotated, optionally fake-quantized
    operands (e.g. ``quantize_input=nvfp4lab.fake_quantize``). Without quantizers it equals
    ``x @ W.T`` up to float rounding. ``x``: ``[..., K]``; ``weight``: ``[N, K]`` → ``[..., N]``.
    """
    xr, wr = rotate_gemm_operands(x, weight, seed)
    if quantize_input is not None:
        xr = quantize_input(xr)
    if quantize_weight is not None:
        wr = quantize_weight(wr)
    return torch.matmul(xr, wr.to(xr.dtype).T)


# --------------------------------------------------------------------------------------------
# Rotations of any block size: Sylvester powers of two times a Paley Hadamard matrix
# --------------------------------------------------------------------------------------------


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def paley_hadamard(n: int) -> torch.Tensor:
    """Unnormalised ±1 Hadamard matrix ``[n, n]`` (float64, ``H Hᵀ = n I``) by Paley's
    constructions: I for ``n = q + 1`` (``q`` a prime ≡ 3 mod 4), II for ``n = 2 (q + 1)``
    (``q`` a prime ≡ 1 mod 4). ValueError when neither applies."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 4:
        raise ValueError(f"a Paley Hadamard order is an int >= 4, got {n!r}")
    for q, kind in ((n - 1, 1), (n // 2 - 1, 2)):
        if not _is_prime(q) or q % 4 != (3 if kind == 1 else 1) or (kind == 2 and n % 2):
            continue
        squares = {(i * i) % q for i in range(1, q)}
        chi = torch.tensor([0.0] + [1.0 if i in squares else -1.0 for i in range(1, q)],
                           dtype=torch.float64)
        idx = torch.arange(q)
        jac = chi[(idx[None, :] - idx[:, None]) % q]  # Jacobsthal matrix, Q[i, j] = chi(j - i)
        core = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        core[0, 1:] = 1.0
        core[1:, 0] = -1.0 if kind == 1 else 1.0
        core[1:, 1:] = jac
        if kind == 1:  # skew conference matrix S: H = I + S
            h = torch.eye(q + 1, dtype=torch.float64) + core
        else:  # symmetric conference matrix C: H = C ⊗ [[1, 1], [1, -1]] + I ⊗ [[1, -1], [-1, -1]]
            a = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
            b = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
            h = torch.kron(core, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)
        assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
        return h
    raise ValueError(
        f"no Paley construction gives a Hadamard matrix of order {n}: it needs n - 1 a prime "
        "≡ 3 (mod 4) or n/2 - 1 a prime ≡ 1 (mod 4)"
    )


def _factor(n: int) -> tuple[int, int]:
    """``n = m · p``: ``p`` the largest power of two with ``m`` 1 or a Paley order."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"a Hadamard order is a positive int, got {n!r}")
    p = n & -n
    while p >= 1:
        m = n // p
        if m == 1:
            return 1, p
        try:
            paley_hadamard(m)
            return m, p
        except ValueError:
            p //= 2
    raise ValueError(
        f"no Hadamard matrix of order {n} is known here: it must be a power of two times a "
        "Paley order (12, 20, 28, 36, 44, 60, ...); use a block size that divides it (16, 32, "
        "64, 128)"
    )


def hadamard_of_order(
    n: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """Orthonormal Hadamard matrix ``[n, n]`` for ``n = m · 2^a`` (``m`` 1 or a Paley order):
    ``H_m ⊗ H_{2^a} / sqrt(n)`` (the Sylvester matrix of :func:`hadamard_matrix` when ``n`` is
    a power of two). Exact ±1/sqrt(n) entries up to the rounding of 1/sqrt(n)."""
    m, p = _factor(n)
    if m == 1:
        return hadamard_matrix(p, dtype=dtype, device=device)
    h = torch.kron(paley_hadamard(m), hadamard_matrix(p, dtype=torch.float64) * p**0.5)
    return (h / n**0.5).to(dtype=dtype, device=device)


def rotation_blocks(k: int, block: int | None) -> int:
    """The block of a rotation along ``K = k``: ``block`` (None: ``k`` itself, a full-size
    rotation), checked to divide ``k`` and to have a Hadamard matrix (:func:`hadamard_of_order`)."""
    size = k if block is None else block
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or k % size:
        raise ValueError(f"rotation block {block!r} must be a positive divisor of K={k}")
    _factor(size)
    return size


def rotate(
    x: torch.Tensor, seed: int, *, block: int | None = HADAMARD_SIZE, inverse: bool = False
) -> torch.Tensor:
    """``x Q`` (``x Qᵀ`` with ``inverse``) along the last dim, ``Q = D · blockdiag(H_b, ...)``,
    ``D`` the seeded signs of :func:`random_signs` and ``H_b`` :func:`hadamard_of_order` of
    ``b = block`` (None: ``b = K``, a full-size rotation). For a power-of-two block it is
    :func:`hadamard_transform` itself (same bits); otherwise ``H_m ⊗ H_p`` is applied as two
    small products. Computed in float32 (float64 stays float64); same shape and dtype."""
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        raise TypeError(f"expected a torch.Tensor with a last dimension K, got {type(x).__name__}")
    size = rotation_blocks(x.shape[-1], block)
    m, p = _factor(size)
    if m == 1:
        return hadamard_transform(x, seed, inverse=inverse, block=size)
    _check_k(x, size)
    check_seed(seed)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    k = x.shape[-1]
    signs = random_signs(k, seed, device=x.device).to(work)
    hm = (paley_hadamard(m) / m**0.5).to(dtype=work, device=x.device)
    hp = hadamard_matrix(p, dtype=work, device=x.device)
    v = x.to(work)
    if not inverse:
        v = v * signs
    v = v.reshape(*x.shape[:-1], k // size, m, p)
    # row vector u (A ⊗ B) is, on u as an [m, p] matrix U, Aᵀ U B; its inverse A U Bᵀ
    v = hm.T @ v @ hp if not inverse else hm @ v @ hp.T
    v = v.reshape(x.shape)
    if inverse:
        v = v * signs
    return v.to(x.dtype)
