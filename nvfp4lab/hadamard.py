"""Seeded random block-Hadamard rotation along K, and its paired use on both GEMM operands.

The rotation is ``Q = D · blockdiag(H16, ..., H16)`` of size ``K × K``: ``D`` a diagonal of
random signs (±1, from ``seed``), ``H16`` the 16-point Sylvester Hadamard matrix scaled by
``1/4`` (orthonormal, symmetric, entries ±0.25, exact in every float dtype). ``Q`` is orthogonal,
so for ``x [..., K]`` and ``W [N, K]``::

    (x Q) (W Q)^T = x Q Q^T W^T = x W^T

A quantized GEMM therefore rotates BOTH operands with the same ``seed`` and quantizes the rotated
tensors; each 16-point Hadamard mixes exactly one NVFP4 block, spreading an outlier over its
block. The transform is computed in float32 and cast back to the input dtype.

A :class:`BlockRotation` is the other kind of rotation ``hadamard=`` accepts wherever a seed is
accepted: compressed-tensors' transform with ``head_dim = b``, ONE ``b x b`` matrix ``M`` (±1
entries) repeated along K, ``x -> x · blockdiag(M, ..., M) / sqrt(b)``, computed as
compressed-tensors computes it (``precision``, float32 by default). It is what a
compressed-tensors ``transform_config`` stores and vLLM runs (a seed's per-K signs are not: they
differ from block to block). :func:`ct_rotation` builds compressed-tensors' own matrices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nvfp4lab.vocab import SUPPORTED_DTYPES

__all__ = [
    "CT_DEFAULT_SEED",
    "CT_KINDS",
    "HADAMARD_SIZE",
    "BlockRotation",
    "check_seed",
    "ct_rotation",
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
    "rotation_matrix_blocks",
    "sylvester_matrix",
]

#: Points of the block-diagonal Hadamard (one NVFP4 block).
HADAMARD_SIZE: int = 16

#: The supported dtypes, and float64.
_FLOAT_DTYPES = (*SUPPORTED_DTYPES, torch.float64)


def check_seed(seed: object, what: str = "hadamard") -> int:
    """Return ``seed`` if it is a non-negative int (or a :class:`BlockRotation`, returned as it
    is), else raise ValueError naming ``what``."""
    if isinstance(seed, BlockRotation):
        return seed  # type: ignore[return-value]
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(
            f"{what} must be a non-negative integer seed or a BlockRotation (or None to "
            f"disable), got {seed!r}"
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
    if isinstance(seed, BlockRotation):
        raise ValueError(f"hadamard must be an integer seed to draw signs from, got {seed!r}")
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
    ``seed`` may be a :class:`BlockRotation` (``block`` is then its own size):
    :meth:`BlockRotation.apply`.
    """
    if isinstance(seed, BlockRotation):
        return seed.apply(x, inverse=inverse)
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
    if isinstance(seed, BlockRotation):
        block = seed.size
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0 or k % block:
        raise ValueError(f"K must be a positive multiple of {block}, got {k!r}")
    return hadamard_transform(torch.eye(k, dtype=dtype), seed, block=block)


def rotation_matrix_blocks(
    k: int, seed: int, *, block: int = HADAMARD_SIZE, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The diagonal blocks ``[K / b, b, b]`` of :func:`rotation_matrix` (``b``: ``block``, or a
    :class:`BlockRotation`'s own size), the only nonzero part of ``Q``: ``Q = diag(blocks[0],
    blocks[1], ...)``. Built without the dense ``[K, K]`` matrix: row ``s`` of the input holds a
    one at position ``s`` of every block, so ``x Q`` lays block ``a``'s row ``s`` at block ``a``
    (each entry one product, the same values as the dense matrix's)."""
    if isinstance(seed, BlockRotation):
        block = seed.size
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0 or k % block:
        raise ValueError(f"K must be a positive multiple of {block}, got {k!r}")
    ones = torch.eye(block, dtype=dtype).repeat(1, k // block)
    rows = hadamard_transform(ones, seed, block=block)
    return rows.reshape(block, k // block, block).permute(1, 0, 2).contiguous()


def rotate_gemm_operands(
    x: torch.Tensor, weight: torch.Tensor, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate both GEMM operands with the same ``Q``: returns ``(x Q, W Q)``.

    ``x``: ``[..., K]``; ``weight``: ``[N, K]`` (nn.Linear layout). ``(xQ)(WQ)^T == x W^T``
    up to float rounding.
    """
    block = seed.size if isinstance(seed, BlockRotation) else HADAMARD_SIZE
    _check_k(x, block)
    _check_k(weight, block)
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
    small products. Computed in float32 (float64 stays float64); same shape and dtype.
    A :class:`BlockRotation` ``seed`` is applied by itself (its own block; ``block`` unused)."""
    if isinstance(seed, BlockRotation):
        return seed.apply(x, inverse=inverse)
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


# -- compressed-tensors' block transforms ---------------------------------------------------------

#: The seed of a fresh ``torch.Generator()``: compressed-tensors' ``apply_transform_config``
#: builds its factories without a seed, so a "random-hadamard" scheme draws its signs from it.
CT_DEFAULT_SEED: int = 67280421310721
#: compressed-tensors' transform types nvfp4lab runs (``TransformScheme.type``).
CT_KINDS: tuple[str, ...] = ("hadamard", "random-hadamard")
_PRECISIONS = (*SUPPORTED_DTYPES, torch.float64)


def sylvester_matrix(n: int) -> torch.Tensor:
    """The ±1 Sylvester Hadamard matrix int64 ``[n, n]`` (``n`` a power of two), unnormalized."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two >= 1, got {n!r}")
    h = torch.ones(1, 1, dtype=torch.int64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@dataclass(frozen=True)
class BlockRotation:
    """compressed-tensors' Hadamard transform with ``head_dim = size``: ``x -> x · R`` along K,
    ``R = blockdiag(M, ..., M) / sqrt(size)``, ``M`` a ``size x size`` ±1 Hadamard matrix
    (``M Mᵀ = size·I``, so ``R`` is orthogonal).

    ``kind``: the ``TransformScheme.type`` ("hadamard": ``M`` is Sylvester's; "random-hadamard":
    any ±1 Hadamard matrix, compressed-tensors' ``diag(signs) · H``); ``entries``: ``M``
    row-major as int8 bytes (what a checkpoint stores as ``<layer>.<group>_input.weight``);
    ``precision``: the dtype the online transform computes in (``TransformScheme.precision``).
    Hashable and compared by value, so it serves wherever a Hadamard seed is accepted
    (``hadamard=`` of :func:`nvfp4lab.quantize`, ``NVFP4Linear``, ``quantize_model``).
    """

    kind: str
    size: int
    entries: bytes
    precision: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.kind not in CT_KINDS:
            raise ValueError(f"BlockRotation kind must be one of {CT_KINDS}, got {self.kind!r}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"BlockRotation size must be a positive int, got {self.size!r}")
        if self.precision not in _PRECISIONS:
            raise ValueError(f"BlockRotation precision must be one of {_PRECISIONS}, got "
                             f"{self.precision!r}")
        if not isinstance(self.entries, bytes) or len(self.entries) != self.size**2:
            raise ValueError(f"BlockRotation entries must be {self.size**2} bytes (an int8 "
                             f"{self.size}x{self.size} matrix)")
        m = self.matrix(torch.int64)
        if not bool(((m == 1) | (m == -1)).all()):
            raise ValueError(f"a {self.kind} matrix holds only ±1 entries; this one does not")
        if not torch.equal(m @ m.T, self.size * torch.eye(self.size, dtype=torch.int64)):
            raise ValueError(f"the {self.size}x{self.size} matrix is not a Hadamard matrix "
                             "(M Mᵀ != size·I): the rotation would not be orthogonal")
        if self.kind == "hadamard" and not (
            self.size & (self.size - 1) == 0 and torch.equal(m, sylvester_matrix(self.size))
        ):
            raise ValueError("a 'hadamard' transform is Sylvester's matrix (vLLM runs it with "
                             "hadacore, whatever is stored); this matrix is not: use kind "
                             "'random-hadamard'")

    @classmethod
    def from_matrix(cls, kind: str, matrix: torch.Tensor,
                    precision: torch.dtype = torch.float32) -> BlockRotation:
        """From a stored ``[b, b]`` matrix of exact ±1 values (any dtype)."""
        if not isinstance(matrix, torch.Tensor) or matrix.ndim != 2 or (
            matrix.shape[0] != matrix.shape[1]
        ):
            shape = tuple(matrix.shape) if isinstance(matrix, torch.Tensor) else type(matrix)
            raise ValueError(f"a transform matrix must be square [b, b], got {shape}")
        values = matrix.detach().to("cpu", torch.float64)
        if not bool(((values == 1) | (values == -1)).all()):
            raise ValueError(f"a {kind} matrix holds only ±1 entries; this one does not (a "
                             "normalized matrix? compressed-tensors stores it unnormalized)")
        data = values.to(torch.int8).contiguous().numpy().tobytes()
        return cls(kind, int(matrix.shape[0]), data, precision)

    def matrix(self, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
        """``M``, ``[size, size]`` of ±1 in ``dtype`` (unnormalized, as checkpoints store it)."""
        m = torch.frombuffer(bytearray(self.entries), dtype=torch.int8)
        return m.reshape(self.size, self.size).to(dtype=dtype, device=device)

    def apply(self, x: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
        """``x R`` (``x Rᵀ`` with ``inverse``) along the last dim, in compressed-tensors' order:
        ``(x.to(p) @ M) / sqrt(size)`` per block of ``size``, ``p`` the precision (float64 input
        stays float64), then cast back to ``x.dtype``. ``x``: float ``[..., K]``, K a multiple
        of ``size``."""
        _check_k(x, self.size)
        work = torch.float64 if x.dtype == torch.float64 else self.precision
        m = self.matrix(work, x.device)
        if inverse:
            m = m.T
        v = x.to(work)
        if v.shape[-1] == self.size:
            v = v @ m
        else:
            v = (v.unflatten(-1, (-1, self.size)) @ m).flatten(-2, -1)
        scale = torch.tensor(self.size, dtype=torch.float64).sqrt()
        return (v / scale).to(x.dtype)

    def dense(self, k: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The ``[K, K]`` matrix ``R`` (normalized), K a multiple of ``size``."""
        return self.apply(torch.eye(k, dtype=dtype))

    def __repr__(self) -> str:
        digest = sum(b * 31**i for i, b in enumerate(self.entries)) % 16**8
        precision = str(self.precision).removeprefix("torch.")
        return (f"BlockRotation({self.kind!r}, size={self.size}, precision={precision}, "
                f"matrix={digest:08x})")


def ct_rotation(
    kind: str = "random-hadamard",
    size: int = HADAMARD_SIZE,
    *,
    seed: int | None = None,
    precision: torch.dtype = torch.float32,
) -> BlockRotation:
    """compressed-tensors' own transform matrix for a scheme ``TransformScheme(type=kind,
    head_dim=size, precision=precision)``, built from its definition.

    "hadamard": Sylvester's ±1 matrix. "random-hadamard": ``diag(s) · H`` with ``H`` Sylvester's
    matrix and ``s = 2·randint(0, 2, [size]) - 1`` drawn first from a ``torch.Generator`` seeded
    with ``seed`` (None: a fresh generator, :data:`CT_DEFAULT_SEED`, as
    ``apply_transform_config`` builds it). Sizes are powers of two; compressed-tensors builds a
    random-hadamard of size 32 (and of non-powers of two) from a tabulated, non-Sylvester
    matrix, which nvfp4lab reads from a checkpoint (:meth:`BlockRotation.from_matrix`) but does
    not build.
    """
    if kind not in CT_KINDS:
        raise ValueError(f"kind must be one of {CT_KINDS}, got {kind!r}")
    h = sylvester_matrix(size)
    if kind == "random-hadamard":
        if size == 32:
            raise ValueError("compressed-tensors builds a random-hadamard of size 32 from a "
                             "tabulated (non-Sylvester) matrix that nvfp4lab does not build; "
                             "use size 16, 64 or 128")
        gen = torch.Generator()
        if seed is not None:
            gen.manual_seed(check_seed(seed, "seed"))
        bits = torch.randint(0, 2, (size,), generator=gen, dtype=torch.float64)
        h = (bits * 2 - 1).to(torch.int64)[:, None] * h
    elif seed is not None:
        raise ValueError("seed applies to kind 'random-hadamard' only (a 'hadamard' transform "
                         "has no random part)")
    return BlockRotation.from_matrix(kind, h, precision)
