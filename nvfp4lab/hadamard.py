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
    "hadamard_transform",
    "random_signs",
    "rotate_gemm_operands",
    "rotated_matmul",
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
