"""The primitive helpers of nvfp4lab.kernels.graphs, run eagerly (no torch.compile).

Oracles: torch's own ``float8_e4m3fn`` casts (all 256 bytes; every E4M3 value and every midpoint
between neighbours, ± a few ulps; float32 bit patterns across [0, 448] at a fixed stride) and
brute-force nearest-neighbour search on the E2M1 grid of nvfp4lab.constants. The compiled
versions are checked in tests/kernels/test_compiled.py; the ``*_graph`` functions are not
tested here.
"""

from __future__ import annotations

import torch

from nvfp4lab.constants import E2M1_SIGN_BIT, E2M1_VALUES, E4M3_MAX
from nvfp4lab.kernels.graphs import decode_e2m1, decode_e4m3, e2m1_round, round_e4m3

E4M3 = torch.float8_e4m3fn


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def e4m3_grid() -> torch.Tensor:
    """Every non-negative finite E4M3 value, increasing (bytes 0x00..0x7E)."""
    return torch.arange(0x7F, dtype=torch.int32).to(torch.uint8).view(E4M3).float()


def e4m3_sample() -> torch.Tensor:
    grid = e4m3_grid()
    anchors = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])  # midpoints are exact in float32
    around = (bits(anchors)[:, None] + torch.arange(-4, 5, dtype=torch.int32)).clamp(min=0)
    stride = torch.arange(0, int(bits(torch.tensor(E4M3_MAX))) + 1, 997, dtype=torch.int32)
    p = torch.cat([around.flatten(), stride]).view(torch.float32)
    return p[(p >= 0) & (p <= E4M3_MAX)]


def test_round_e4m3_equals_the_float8_cast() -> None:
    p = e4m3_sample()
    assert p.numel() > 1_000_000
    value, byte = round_e4m3(p)
    want = p.to(E4M3)
    assert value.dtype == torch.float32 and byte.dtype == torch.int32
    assert torch.equal(byte, want.view(torch.uint8).to(torch.int32))
    assert torch.equal(bits(value), bits(want.float()))


def test_round_e4m3_midpoints_go_to_the_even_byte() -> None:
    grid = e4m3_grid()
    mid = (grid[1:] + grid[:-1]) / 2
    value, byte = round_e4m3(mid)
    lower = torch.arange(0x7E, dtype=torch.int32)  # byte of grid[:-1]
    even = torch.where(lower % 2 == 0, lower, lower + 1)
    assert torch.equal(byte, even)
    assert torch.equal(value, grid[even.long()])
    # every grid value is its own rounding
    value, byte = round_e4m3(grid)
    assert torch.equal(value, grid) and torch.equal(byte, torch.arange(0x7F, dtype=torch.int32))


def test_decode_e4m3_all_256_bytes() -> None:
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = decode_e4m3(every)
    want = every.view(E4M3).float()
    nan = torch.isnan(want)
    assert nan.nonzero().flatten().tolist() == [0x7F, 0xFF]
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(bits(got[~nan]), bits(want[~nan]))  # includes -0.0 for 0x80
    assert int(bits(got[0x80])) == int(bits(torch.tensor(-0.0)))


def nearest_index(a: float) -> int:
    """Index of the E2M1 magnitude nearest to ``a`` in [0, 6], ties to the even index."""
    dist = [abs(a - g) for g in E2M1_VALUES]
    ties = [i for i, d in enumerate(dist) if d == min(dist)]
    return ties[0] if len(ties) == 1 else next(i for i in ties if i % 2 == 0)


def test_e2m1_round_against_brute_force() -> None:
    grid = torch.tensor(E2M1_VALUES)
    mids = (grid[1:] + grid[:-1]) / 2
    anchors = torch.cat([grid, mids])
    around = (bits(anchors)[:, None] + torch.arange(-3, 4, dtype=torch.int32)).clamp(min=0)
    dense = torch.linspace(0, 6, 20001)
    a = torch.cat([around.flatten().view(torch.float32), dense]).clamp(0, 6)
    index, value = e2m1_round(a)
    want = torch.tensor([nearest_index(float(v)) for v in a.tolist()])
    assert index.dtype == torch.float32 and value.dtype == torch.float32
    assert torch.equal(index.long(), want)
    assert torch.equal(value, grid[want])
    # the ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to the even index of their two neighbours
    tie_index, _ = e2m1_round(mids)
    assert tie_index.tolist() == [0.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0]


def test_decode_e2m1_all_16_codes() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    got = decode_e2m1(codes)
    want = torch.tensor([(-1.0 if c & E2M1_SIGN_BIT else 1.0) * E2M1_VALUES[c & 7]
                         for c in range(16)])
    assert got.dtype == torch.float32
    assert torch.equal(bits(got), bits(want))  # code 8 is -0.0
    # a [NB, 16] block shape decodes elementwise
    block = codes.flip(0).repeat(3, 1)
    assert torch.equal(decode_e2m1(block), want.flip(0).repeat(3, 1))
