"""Error metrics between a reference tensor and its approximation.

Every function takes ``(reference, approx)`` of equal shape (any float dtype, any device) and
computes in float64, returning a Python float. ``nmse = ||approx - ref||^2 / ||ref||^2`` and
``sqnr_db = -10 log10(nmse)``.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "block_error_summary",
    "cosine_similarity",
    "max_abs_error",
    "mse",
    "nmse",
    "per_block_nmse",
    "sqnr_db",
]


def _pair(reference: torch.Tensor, approx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if reference.shape != approx.shape:
        raise ValueError(
            f"metrics need tensors of equal shape, got {tuple(reference.shape)} and "
            f"{tuple(approx.shape)}"
        )
    if reference.numel() == 0:
        raise ValueError("metrics of empty tensors are undefined (numel == 0)")
    return reference.to(torch.float64), approx.to(torch.float64)


def mse(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Mean squared error."""
    ref, app = _pair(reference, approx)
    return float(torch.mean((app - ref) ** 2))


def nmse(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Normalized MSE ``sum (approx-ref)^2 / sum ref^2`` (inf for an all-zero reference)."""
    ref, app = _pair(reference, approx)
    signal = float(torch.sum(ref**2))
    noise = float(torch.sum((app - ref) ** 2))
    if signal == 0:
        return 0.0 if noise == 0 else math.inf
    return noise / signal


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB, ``-10 log10(nmse)`` (inf when exact)."""
    value = nmse(reference, approx)
    return math.inf if value == 0 else -10.0 * math.log10(value)


def max_abs_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Largest absolute elementwise difference."""
    ref, app = _pair(reference, approx)
    return float(torch.max(torch.abs(app - ref)))


def cosine_similarity(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Cosine of the angle between the flattened tensors (1.0 when both are zero)."""
    ref, app = _pair(reference, approx)
    ref, app = ref.flatten(), app.flatten()
    norms = float(torch.linalg.vector_norm(ref)) * float(torch.linalg.vector_norm(app))
    if norms == 0:
        return 1.0 if torch.equal(ref, app) else 0.0
    return float(torch.dot(ref, app)) / norms


def _block_energies(
    reference: torch.Tensor, approx: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (signal, noise) energies of each ``block_size`` run along the last dim."""
    ref, app = _pair(reference, approx)
    if ref.shape[-1] % block_size:
        raise ValueError(
            f"last dimension {ref.shape[-1]} is not a multiple of block_size {block_size}"
        )
    ref_b = ref.reshape(*ref.shape[:-1], -1, block_size)
    err_b = app.reshape(ref_b.shape) - ref_b
    return (ref_b**2).sum(-1), (err_b**2).sum(-1)


def per_block_nmse(
    reference: torch.Tensor, approx: torch.Tensor, block_size: int = 16
) -> torch.Tensor:
    """float64 NMSE of each ``block_size`` run along the last dim, shape ``[..., K/block]``.

    Blocks whose reference is all zero get inf when their error is nonzero, else 0 (as
    :func:`nmse` does for a whole tensor).
    """
    signal, noise = _block_energies(reference, approx, block_size)
    return torch.where(signal == 0, torch.where(noise == 0, 0.0, math.inf), noise / signal)


def block_error_summary(
    reference: torch.Tensor, approx: torch.Tensor, block_size: int = 16
) -> dict[str, float]:
    """Distribution of per-block NMSE over the blocks whose reference is not all zero.

    Keys: ``blocks`` (all), ``zero_reference_blocks``, ``mean_nmse``, ``median_nmse``,
    ``p90_nmse``, ``p99_nmse``, ``max_nmse``, ``worst_block`` (flat index of the largest NMSE
    among them) and ``exact_blocks`` (of them, reproduced without error).
    """
    signal, noise = _block_energies(reference, approx, block_size)
    signal, noise = signal.flatten(), noise.flatten()
    nonzero = signal > 0
    values = noise[nonzero] / signal[nonzero]
    if values.numel() == 0:
        raise ValueError("no block with a nonzero reference to summarize")
    sample = values if values.numel() <= 16_000_000 else values[:: values.numel() // 8_000_000]
    quantiles = torch.quantile(sample, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    worst = torch.nonzero(nonzero).flatten()[torch.argmax(values)]
    return {
        "blocks": float(signal.numel()),
        "zero_reference_blocks": float((~nonzero).sum()),
        "mean_nmse": float(values.mean()),
        "median_nmse": float(quantiles[0]),
        "p90_nmse": float(quantiles[1]),
        "p99_nmse": float(quantiles[2]),
        "max_nmse": float(values.max()),
        "worst_block": float(worst),
        "exact_blocks": float((values == 0).sum()),
    }
