"""nvfp4lab.tensor: NVFP4Tensor built from raw fields and decoded, against an exhaustive oracle.

The oracle is written here from nvfp4lab.constants only: a code's value is ``±E2M1_VALUES[code &
7]`` (sign bit 8), a byte holds element ``2i`` in its low nibble, and the decode is ``value ·
(scale / global_scale)`` in float32 (or ``value · (scale · decode_scale)``). Construction-error
cases already in tests/test_codec.py (dtypes, leading dims, scale counts, global scale) are not
repeated.
"""

from __future__ import annotations

import pytest
import torch

from nvfp4lab.constants import BLOCK_SIZE, E2M1_SIGN_BIT, E2M1_VALUES, GLOBAL_SCALE_NUMERATOR
from nvfp4lab.hadamard import hadamard_transform, rotation_matrix
from nvfp4lab.tensor import (
    CPU_CHUNK_ELEMENTS,
    NVFP4Tensor,
    RotatedNVFP4Tensor,
    block_chunks,
    decode_blocks,
    invalid_block_scales,
)

E4M3 = torch.float8_e4m3fn


def code_value(code: int) -> float:
    magnitude = E2M1_VALUES[code & ~E2M1_SIGN_BIT]
    return -magnitude if code & E2M1_SIGN_BIT else magnitude


def oracle_decode(packed: torch.Tensor, scales: torch.Tensor, block: int, factor) -> torch.Tensor:
    """Slow decode, element by element; ``factor(scale_float) -> float32 tensor``."""
    rows = packed.reshape(-1, packed.shape[-1]).tolist()
    svals = scales.float().reshape(-1, scales.shape[-1])
    out = torch.empty(len(rows), 2 * packed.shape[-1], dtype=torch.float32)
    for r, row in enumerate(rows):
        for i, byte in enumerate(row):
            for j, code in enumerate((byte & 15, byte >> 4)):
                k = 2 * i + j
                f = factor(svals[r, k // block])
                out[r, k] = torch.tensor(code_value(code), dtype=torch.float32) * f
    return out.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def test_decode_against_the_exhaustive_oracle() -> None:
    # 2 rows x 256 bytes = every byte value in each row; 32 blocks per row, one scale each
    packed = torch.arange(512).remainder(256).to(torch.uint8).reshape(2, 256)
    packed[1] = packed[1].flip(0)
    # scales: subnormals, normals, the max, zero; all distinct E4M3 bytes
    raw = torch.tensor([0x00, 0x01, 0x07, 0x08, 0x20, 0x38, 0x3F, 0x55, 0x66, 0x7E] * 7)[:64]
    scales = raw.to(torch.uint8).view(E4M3).reshape(2, 32)
    gs = torch.tensor([3.0])
    q = NVFP4Tensor(packed=packed, scales=scales, global_scale=gs)
    assert q.shape == (2, 512) and q.dtype == torch.float32 and q.block_size == 16
    want = oracle_decode(packed, scales, 16, lambda s: s / gs[0])
    got = q.dequantize(fused=False)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # -0.0 from code 8 survives (bit-exact, not only ==)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        assert torch.equal(q.dequantize(dtype, fused=False), want.to(dtype))
    # the whole thing also as decode_blocks on [..., nb, block] codes
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(2, 32, 16)
    assert torch.equal(decode_blocks(codes, scales, gs), want.reshape(2, 32, 16))


def test_decode_scale_multiplies_instead_of_dividing() -> None:
    packed = torch.arange(256).to(torch.uint8).reshape(4, 64)
    scales = torch.tensor([0x31, 0x4A, 0x7E, 0x09] * 8).to(torch.uint8).view(E4M3).reshape(4, 8)
    d = torch.tensor([1.0 / 3.0])  # not a power of two: s*d and s/(1/d) round differently
    q = NVFP4Tensor(packed=packed, scales=scales, global_scale=1.0 / d, decode_scale=d)
    want = oracle_decode(packed, scales, 16, lambda s: s * d[0])
    assert torch.equal(q.dequantize(fused=False), want)
    divided = oracle_decode(packed, scales, 16, lambda s: s / (1.0 / d)[0])
    assert not torch.equal(want, divided)  # the order matters for some scales
    assert torch.equal(NVFP4Tensor(packed=packed, scales=scales, global_scale=1.0 / d)
                       .dequantize(fused=False), divided)


def test_padded_k_and_other_block_sizes() -> None:
    packed = torch.arange(48).to(torch.uint8).reshape(3, 16)  # Kp = 32
    scales = torch.tensor([0x38, 0x40] * 3).to(torch.uint8).view(E4M3).reshape(3, 2)
    full = NVFP4Tensor(packed=packed, scales=scales, global_scale=1.0).dequantize(fused=False)
    for k in (17, 25, 32):
        q = NVFP4Tensor(packed=packed, scales=scales, global_scale=1.0, shape=torch.Size([3, k]))
        assert torch.equal(q.dequantize(fused=False), full[:, :k])
    with pytest.raises(ValueError, match=r"NVFP4Tensor.shape \(3, 16\) does not fit.*within one "
                                         r"block \(16\) of 32"):
        NVFP4Tensor(packed=packed, scales=scales, global_scale=1.0, shape=torch.Size([3, 16]))
    # block_size 8: four scales per row of 32 codes
    s8 = torch.tensor([0x38, 0x40, 0x30, 0x48] * 3).to(torch.uint8).view(E4M3).reshape(3, 4)
    q8 = NVFP4Tensor(packed=packed, scales=s8, global_scale=2.0, block_size=8)
    assert torch.equal(q8.dequantize(), oracle_decode(packed, s8, 8, lambda s: s / 2.0))


@pytest.mark.parametrize("block", [0, 7, -16, True, 16.0])
def test_bad_block_size_is_named(block: object) -> None:
    with pytest.raises(ValueError, match=rf"block_size must be a positive even int, got {block!r}"):
        NVFP4Tensor(packed=torch.zeros(1, 8, dtype=torch.uint8),
                    scales=torch.zeros(1, 1, dtype=E4M3), global_scale=1.0, block_size=block)


def test_other_construction_errors() -> None:
    ok = {"packed": torch.zeros(2, 8, dtype=torch.uint8), "scales": torch.zeros(2, 1, dtype=E4M3),
          "global_scale": 1.0}
    with pytest.raises(ValueError, match=r"dtype must be a floating torch.dtype, got torch.int32"):
        NVFP4Tensor(**ok, dtype=torch.int32)
    with pytest.raises(ValueError, match="different devices: packed on meta, scales on cpu"):
        NVFP4Tensor(**{**ok, "packed": ok["packed"].to("meta")})
    with pytest.raises(ValueError, match=r"packed \(\) must be"):
        NVFP4Tensor(**{**ok, "packed": torch.tensor(0, dtype=torch.uint8)})
    with pytest.raises(TypeError, match=r"does not convert it to torch.float16.*"
                                        r"q.dequantize\(torch.float16\)"):
        NVFP4Tensor(**ok).to(torch.float16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"needs a floating dtype, got torch\.int8"):
        NVFP4Tensor(**ok).dequantize(torch.int8)


def test_properties_equality_and_meta() -> None:
    packed = torch.arange(64).to(torch.uint8).reshape(2, 32)
    scales = torch.full((2, 4), 0x38, dtype=torch.uint8).view(E4M3)
    q = NVFP4Tensor(packed=packed, scales=scales, global_scale=4.0, dtype=torch.bfloat16)
    assert q.amax == GLOBAL_SCALE_NUMERATOR / 4.0 == 672.0
    assert q.nbytes == 64 + 8 + 4 and q.transform is None and q.device == torch.device("cpu")
    assert torch.equal(q.codes(), torch.stack([packed & 15, packed >> 4], -1).reshape(2, 64))
    assert q.swizzled_scales().shape == (128, 4)
    assert q == NVFP4Tensor(packed=packed.clone(), scales=scales.clone(), global_scale=4.0,
                            dtype=torch.bfloat16)
    assert q != NVFP4Tensor(packed=packed, scales=scales, global_scale=4.0)  # dtype differs
    assert q != NVFP4Tensor(packed=packed, scales=scales, global_scale=2.0, dtype=torch.bfloat16)
    assert q.__eq__("q") is NotImplemented
    with pytest.raises(TypeError, match="unhashable"):
        hash(q)
    meta = NVFP4Tensor(packed=packed.to("meta"), scales=scales.to("meta"),
                       global_scale=torch.tensor([4.0], device="meta"), dtype=torch.bfloat16)
    out = meta.dequantize()
    assert out.is_meta and out.shape == (2, 64) and out.dtype == torch.bfloat16
    assert "global_scale=meta" in repr(meta)


def test_block_chunks_cover_every_block_once() -> None:
    per = CPU_CHUNK_ELEMENTS // 16
    blocks = 2 * per + 5
    parts = list(block_chunks(blocks, 16, torch.device("cpu")))
    assert [(p.start, p.stop) for p in parts] == [(0, per), (per, 2 * per), (2 * per, blocks)]
    assert list(block_chunks(0, 16, torch.device("cpu"))) == []
    assert [(p.start, p.stop) for p in block_chunks(blocks, 16, torch.device("meta"))] == [
        (0, blocks)]  # off the CPU: one chunk


def test_invalid_block_scales_over_all_256_bytes() -> None:
    every = torch.arange(256).to(torch.uint8).view(E4M3).reshape(16, 16)
    nan, negative, first = invalid_block_scales(every)
    # NaN: magnitude 0x7F; negative: sign set on a nonzero magnitude (0x81..0xFF, NaN included)
    want_nan = sum(1 for b in range(256) if b & 0x7F == 0x7F)
    want_negative = sum(1 for b in range(256) if b & 0x80 and b & 0x7F)
    assert (nan, negative, first) == (want_nan, want_negative, (7, 15)) == (2, 127, (7, 15))
    ok = every.view(torch.uint8).clone()
    ok[ok >= 0x7F] = 0x80  # -0.0 is accepted as zero
    assert invalid_block_scales(ok.view(E4M3)) == (0, 0, None)


def test_rotated_tensor_undoes_the_rotation() -> None:
    packed = torch.arange(256).to(torch.uint8).reshape(4, 64)
    scales = torch.full((4, 8), 0x38, dtype=torch.uint8).view(E4M3)  # 1.0
    q = RotatedNVFP4Tensor(packed=packed, scales=scales, global_scale=1.0, hadamard=6)
    plain = NVFP4Tensor(packed=packed, scales=scales, global_scale=1.0)
    rotated = q.dequantize_rotated(fused=False)
    assert torch.equal(rotated, plain.dequantize(fused=False))
    # values are multiples of 1/2 up to 6: the float64 product with the dense Q^T is exact
    q64 = rotation_matrix(128, 6, dtype=torch.float64)
    want = (rotated.double() @ q64.T).float()
    assert torch.equal(q.dequantize(fused=False), want)
    assert torch.equal(q.dequantize(torch.bfloat16, fused=False), want.to(torch.bfloat16))
    assert torch.equal(hadamard_transform(q.dequantize(fused=False), 6), rotated)
    assert q.transform == "Hadamard-rotated along K (seed 6)"
    assert repr(q).endswith(", hadamard=6)")
    moved = q.to("cpu")
    assert isinstance(moved, RotatedNVFP4Tensor) and moved == q and moved.hadamard == 6
    assert q != RotatedNVFP4Tensor(packed=packed, scales=scales, global_scale=1.0, hadamard=7)
    assert q.__eq__(plain) is NotImplemented and plain.__eq__(q) is NotImplemented
    assert q.block_size == BLOCK_SIZE
