"""The GGUF / ggml NVFP4 block layout (``nvfp4lab.ggml_blocks``): round trips, the bytes spelled
out, gguf-py's own decoder as the oracle, and the scale bytes ggml and E4M3 read differently."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab import NVFP4Tensor, dequantize
from nvfp4lab.e2m1 import pack_fp4, unpack_fp4
from nvfp4lab.ggml_blocks import from_ggml_nvfp4, to_ggml_nvfp4


def _ggml_operands(
    lead: tuple[int, ...], k: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random nvfp4lab operands: every code 0..15 (8 = -0) and every valid scale byte 0..0x7E."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (*lead, k), generator=g, dtype=torch.int32).to(torch.uint8)
    raw = torch.randint(0, 0x7F, (*lead, k // 16), generator=g, dtype=torch.int32)
    return pack_fp4(codes), raw.to(torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.parametrize(("lead", "k"), [((1,), 64), ((3,), 128), ((2, 5), 192), ((), 64)])
def test_ggml_round_trip(lead: tuple[int, ...], k: int) -> None:
    packed, scales = _ggml_operands(lead, k, seed=k)
    blocks = to_ggml_nvfp4(packed, scales)
    assert blocks.dtype == torch.uint8 and blocks.shape == (*lead, k // 64 * 36)
    codes_back, scales_back = from_ggml_nvfp4(blocks)
    assert torch.equal(codes_back, packed)
    assert scales_back.dtype == torch.float8_e4m3fn
    assert torch.equal(scales_back.view(torch.uint8), scales.view(torch.uint8))


def test_ggml_bytes_spelled_out() -> None:
    """Byte by byte against the layout as ggml-common.h block_nvfp4 spells it."""
    packed, scales = _ggml_operands((2,), 128, seed=7)
    codes, raw = unpack_fp4(packed), scales.view(torch.uint8)
    blocks = to_ggml_nvfp4(packed, scales)
    for r in range(2):
        for b in range(2):
            block = blocks[r, b * 36 : (b + 1) * 36]
            for s in range(4):
                assert int(block[s]) == int(raw[r, b * 4 + s])
                for j in range(8):
                    e = b * 64 + s * 16
                    byte = int(block[4 + s * 8 + j])
                    assert byte & 0xF == int(codes[r, e + j])
                    assert byte >> 4 == int(codes[r, e + j + 8])


@pytest.mark.parametrize("k", [64, 256])
def test_ggml_against_gguf_dequantize(k: int) -> None:
    """gguf-py's NVFP4 decoder (an independent implementation) reads what nvfp4lab decodes."""
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    packed, scales = _ggml_operands((6,), k, seed=k + 1)
    codes = unpack_fp4(packed)
    assert bool((codes == 8).any())  # negative zero codes are in the data
    blocks = to_ggml_nvfp4(packed, scales)
    theirs = quants.dequantize(blocks.numpy(), GGMLQuantizationType.NVFP4)
    ours = dequantize(NVFP4Tensor(packed=packed, scales=scales, global_scale=1.0), torch.float32)
    assert torch.equal(torch.from_numpy(theirs), ours)
    # -0 codes decode to zero on both sides (ggml's kvalues[8] is 0)
    assert bool((torch.from_numpy(theirs)[codes == 8] == 0).all())


def test_ggml_negative_zero_scale_kept() -> None:
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    packed, scales = _ggml_operands((1,), 64, seed=3)
    raw = scales.view(torch.uint8).clone()
    raw[0, 1] = 0x80  # E4M3 -0.0: zero on both sides, kept as it is
    blocks = to_ggml_nvfp4(packed, raw.view(torch.float8_e4m3fn))
    assert int(blocks[0, 1]) == 0x80
    assert torch.equal(from_ggml_nvfp4(blocks)[1].view(torch.uint8), raw)
    theirs = quants.dequantize(blocks.numpy(), GGMLQuantizationType.NVFP4)
    assert bool((theirs[0, 16:32] == 0).all())


@pytest.mark.parametrize("byte", [0x7F, 0xFF, 0x81, 0xB8])
def test_ggml_scale_bytes_that_differ_are_refused(byte: int) -> None:
    packed, scales = _ggml_operands((2,), 64, seed=4)
    raw = scales.view(torch.uint8).clone()
    raw[1, 2] = byte
    with pytest.raises(ValueError, match=f"0x{byte:02x}"):
        to_ggml_nvfp4(packed, raw.view(torch.float8_e4m3fn))
    blocks = to_ggml_nvfp4(packed, scales)
    blocks[1, 2] = byte
    with pytest.raises(ValueError, match=f"0x{byte:02x}"):
        from_ggml_nvfp4(blocks)


def test_ggml_k_not_multiple_of_64() -> None:
    packed, scales = _ggml_operands((2,), 64)
    with pytest.raises(ValueError, match="K = 32, not a multiple of 64"):
        to_ggml_nvfp4(packed[:, :16], scales[:, :2])
    with pytest.raises(ValueError, match="not a multiple of 36"):
        from_ggml_nvfp4(torch.zeros(2, 40, dtype=torch.uint8))
    with pytest.raises(ValueError, match="shapes do not match"):
        to_ggml_nvfp4(packed, scales[:, :2])
