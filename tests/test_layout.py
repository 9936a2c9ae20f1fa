"""The 128x4 blocked ("swizzled") scale layout against the reference offset formula."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab import swizzle_scales, unswizzle_scales
from nvfp4lab.layout import swizzled_offset
from nvfp4lab.oracles import nvfp4 as ref_nvfp4

SHAPES = [(1, 1), (3, 5), (129, 7), (128, 4), (300, 33), (256, 8), (130, 1)]


def _padded(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // 128) * 128, -(-cols // 4) * 4


def _e4m3_scales(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(1, 0x7F, (rows, cols), generator=g, dtype=torch.int32).to(torch.uint8)
    return raw.view(torch.float8_e4m3fn)


@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_offsets_entry_by_entry(rows: int, cols: int) -> None:
    """Entry (i, j) of the plain matrix lands at ref_nvfp4.swizzle_offset(i, j, cols)."""
    plain = torch.arange(1, rows * cols + 1, dtype=torch.float32).reshape(rows, cols)
    blocked = swizzle_scales(plain)
    assert blocked.shape == _padded(rows, cols) and blocked.dtype == torch.float32
    flat = blocked.flatten()
    i = torch.arange(rows).repeat_interleave(cols)
    j = torch.arange(cols).repeat(rows)
    offsets = torch.tensor(
        [ref_nvfp4.swizzle_offset(a, b, cols) for a, b in zip(i.tolist(), j.tolist(), strict=True)]
    )
    assert torch.equal(flat[offsets], plain.flatten())
    # everything else is zero padding
    mask = torch.ones(flat.numel(), dtype=torch.bool)
    mask[offsets] = False
    assert bool((flat[mask] == 0).all())
    # the module's own formula agrees with the reference
    for a, b in [(0, 0), (rows - 1, cols - 1), (rows // 2, cols // 2)]:
        assert swizzled_offset(a, b, cols) == ref_nvfp4.swizzle_offset(a, b, cols)


@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_round_trip_e4m3(rows: int, cols: int) -> None:
    plain = _e4m3_scales(rows, cols)
    blocked = swizzle_scales(plain)
    assert blocked.dtype == torch.float8_e4m3fn
    assert blocked.shape == _padded(rows, cols)
    back = unswizzle_scales(blocked, rows, cols)
    assert back.dtype == torch.float8_e4m3fn and back.shape == (rows, cols)
    assert torch.equal(back.view(torch.uint8), plain.view(torch.uint8))
    # 1-D blocked input of the right size works too
    back_flat = unswizzle_scales(blocked.flatten(), rows, cols)
    assert torch.equal(back_flat.view(torch.uint8), plain.view(torch.uint8))


def test_byte_order_matches_formula_for_e4m3() -> None:
    rows, cols = 129, 7
    plain = _e4m3_scales(rows, cols, seed=3)
    blocked_bytes = swizzle_scales(plain).view(torch.uint8).flatten()
    plain_bytes = plain.view(torch.uint8)
    for i in range(rows):
        for j in range(cols):
            assert blocked_bytes[ref_nvfp4.swizzle_offset(i, j, cols)] == plain_bytes[i, j]


def test_zero_padding_e4m3() -> None:
    plain = torch.full((3, 5), 448.0).to(torch.float8_e4m3fn)
    blocked = swizzle_scales(plain).view(torch.uint8)
    assert int((blocked != 0).sum()) == 15
    assert int(blocked.sum()) == 15 * 0x7E


def test_uint8_and_leading_dims() -> None:
    g = torch.Generator().manual_seed(1)
    scales = torch.randint(0, 256, (2, 3, 6), generator=g, dtype=torch.int32).to(torch.uint8)
    blocked = swizzle_scales(scales)
    assert blocked.dtype == torch.uint8 and blocked.shape == (128, 8)
    assert torch.equal(unswizzle_scales(blocked, 6, 6), scales.reshape(6, 6))
    assert torch.equal(blocked, swizzle_scales(scales.reshape(6, 6)))


def test_non_contiguous_input() -> None:
    plain = _e4m3_scales(7, 130)
    t = plain.t()  # (130, 7), non-contiguous
    assert torch.equal(
        swizzle_scales(t).view(torch.uint8), swizzle_scales(t.contiguous()).view(torch.uint8)
    )


def test_unswizzle_wrong_size_raises() -> None:
    with pytest.raises(ValueError, match=r"\(128, 4\)"):
        unswizzle_scales(torch.zeros(128, 4), 129, 4)


def test_ggml_block_names_still_import_from_layout() -> None:
    """``layout.to_ggml_nvfp4`` / ``from_ggml_nvfp4`` are deprecated aliases of the functions of
    :mod:`nvfp4lab.ggml_blocks` (tested in tests/test_ggml_blocks.py), kept for one release."""
    from nvfp4lab import ggml_blocks, layout

    assert layout.to_ggml_nvfp4 is ggml_blocks.to_ggml_nvfp4
    assert layout.from_ggml_nvfp4 is ggml_blocks.from_ggml_nvfp4
