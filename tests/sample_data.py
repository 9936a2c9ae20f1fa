"""Seeded test matrices shared by the numerics tests (imported as ``from tests.sample_data import``;
pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch

#: Every kind :func:`make` knows.
KINDS = ("normal", "student_t", "outliers", "zero_blocks", "small_amax", "tiny_blocks")


def make(kind: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A seeded ``shape`` tensor of ``dtype`` (last dim a multiple of 16) of one ``kind``:

    normal N(0,1); student_t (df=3, heavy tails); outliers (1% scaled x1000); zero_blocks (30%
    of the 16-blocks all zero); small_amax (amax 0.03: 2688/amax overflows float16);
    tiny_blocks (block magnitudes spanning decades: E4M3-subnormal and underflowing scales).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "student_t":
        chi2 = (torch.randn((*shape, 3), generator=g) ** 2).sum(-1)
        x = x / torch.sqrt(chi2 / 3)
    elif kind == "outliers":
        x = torch.where(torch.rand(shape, generator=g) < 0.01, x * 1000, x)
    elif kind == "zero_blocks":
        blocks = x.reshape(*shape[:-1], -1, 16)
        blocks[torch.rand(blocks.shape[:-1], generator=g) < 0.3] = 0.0
        x = blocks.reshape(shape)
    elif kind == "small_amax":
        x = x / x.abs().max() * 0.03
    elif kind == "tiny_blocks":
        x = x * torch.pow(10.0, -torch.arange(shape[-1] // 16).repeat_interleave(16).float())
    elif kind != "normal":
        raise AssertionError(kind)
    return x.to(dtype)
