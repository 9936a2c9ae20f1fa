"""nvfp4lab.number_formats.base: the QuantFormat interface and BlockFormat running a format given
as data.

The block format here (E2M1 elements, an fp16 scale ``amax / 6``, 16 per block) is registered
nowhere: BlockFormat runs it from its description alone. The oracle is a slow loop written
here: nearest E2M1 magnitude by brute force with ties to the even index, ``s = fp16(amax / 6)``,
``x_hat = value · s``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nvfp4lab.constants import E2M1_VALUES
from nvfp4lab.number_formats.base import (
    BlockFormat,
    BlockFormatInfo,
    PackedBlocks,
    QuantFormat,
    checked_input,
)
from nvfp4lab.number_formats.comparators import E2M1, FP16_SCALE

INFO = BlockFormatInfo("e2m1_fp16", E2M1, FP16_SCALE, 16, "E2M1, fp16 scale amax/6 per 16")
FMT = BlockFormat(INFO)


def nearest_e2m1(v: float) -> float:
    """Signed E2M1 value nearest to ``v`` (saturating at 6), ties to the even index."""
    a = min(abs(v), 6.0)
    dist = [abs(a - g) for g in E2M1_VALUES]
    best = min(dist)
    index = [i for i, d in enumerate(dist) if d == best]
    magnitude = E2M1_VALUES[index[0] if len(index) == 1 else next(i for i in index if i % 2 == 0)]
    return -magnitude if v < 0 else magnitude


def oracle(x: torch.Tensor, block: int = 16, dtype: torch.dtype | None = None) -> torch.Tensor:
    rows = x.float().reshape(-1, x.shape[-1])
    out = torch.zeros_like(rows)
    for r in range(rows.shape[0]):
        for b in range(0, rows.shape[1], block):
            blk = rows[r, b : b + block]
            s = (blk.abs().max() / 6.0).to(torch.float16).float()  # float32 divide, fp16 store
            if float(s) == 0.0:
                continue
            for i in range(blk.shape[0]):
                v = float(blk[i] / s)  # the float32 quotient
                out[r, b + i] = torch.tensor(nearest_e2m1(v)) * s
    return out.reshape(x.shape).to(dtype or x.dtype)  # float32 products, one rounding


def sample(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g)
    # row 0: blocks whose max is 6·2^k (s = 2^k exactly) and every E2M1 tie, both signs
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -1.75, -5.0, 7.0, 0.0])
    for j, k in enumerate((-3, 0, 2, 5)):
        x[0, 16 * j : 16 * j + 16] = torch.cat([torch.tensor([6.0]), ties, torch.zeros(3)]) * 2.0**k
    x[1, :16] = 0.0  # an all-zero block
    x[2, 16:32] *= 1e-8  # fp16 scale underflows to 0: the block decodes to zeros
    x[3] *= 1e4
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_format_runs_a_format_given_as_data(dtype: torch.dtype) -> None:
    x = sample(dtype)
    want = oracle(x)
    y = FMT.fake_quantize(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, want)
    if dtype != torch.float16:  # (1e-8 is already 0 in a float16 input)
        assert bool(x[2, 16:32].any()) and not bool(y[2, 16:32].any())
    q = FMT.quantize(x)
    assert isinstance(q, PackedBlocks) and q.info is INFO
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (6, 32)
    assert q.scales.dtype == torch.float16 and q.scales.shape == (6, 4)
    assert q.nbytes == 6 * 32 + 6 * 4 * 2
    assert torch.equal(FMT.dequantize(q), want)
    assert torch.equal(q.dequantize(torch.float32), oracle(x, dtype=torch.float32))


def test_bits_and_description() -> None:
    assert INFO.bits_per_element == 4 + 16 / 16 == FMT.bits_per_element
    assert FMT.storage_bits((8, 64)) == 5.0
    assert repr(FMT) == "<format e2m1_fp16: 5 bits/element — E2M1, fp16 scale amax/6 per 16>"
    assert dict(FMT.options) == {"pad": False}


def test_pad_option() -> None:
    x = sample()[:, :40]
    with pytest.raises(ValueError, match=r"e2m1_fp16: the last dimension K=40 .* pad=True .* 48"):
        FMT.fake_quantize(x)
    y = FMT.fake_quantize(x, pad=True)
    padded = torch.nn.functional.pad(x, (0, 8))
    assert y.shape == x.shape and torch.equal(y, oracle(padded)[:, :40])
    q = FMT.quantize(x, pad=True)
    assert q.packed.shape == (6, 24) and q.shape == x.shape
    assert torch.equal(q.dequantize(), y)


def test_unknown_options_list_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown option\(s\) block, padd for format "
                                         r"'e2m1_fp16'; accepted options: pad$"):
        FMT.fake_quantize(sample(), padd=True, block=32)
    assert FMT.check_options({}) == {"pad": False}
    assert FMT.check_options({"pad": True}) == {"pad": True}


class _Sign(QuantFormat):
    """A minimal subclass: sign(x), 1 bit per element plus one fp32 scale per row."""

    name = "sign"
    bits_per_element = 1.0
    description = "sign only"

    def _fake(self, x: torch.Tensor, opts: dict[str, Any]) -> torch.Tensor:
        return torch.sign(x)

    def _bits(self, shape: tuple[int, ...], numel: int, opts: dict[str, Any]) -> float:
        return 1.0 + 32.0 * (numel // shape[-1]) / numel


def test_quant_format_interface() -> None:
    fmt = _Sign()
    assert torch.equal(fmt.fake_quantize(torch.tensor([-2.0, 0.0, 3.0])),
                       torch.tensor([-1.0, 0.0, 1.0]))
    assert fmt.storage_bits((4, 32)) == 2.0 and fmt.storage_bits(torch.Size([64])) == 1.5
    with pytest.raises(ValueError, match=r"non-empty shape, got \(4, 0\)"):
        fmt.storage_bits((4, 0))
    with pytest.raises(ValueError, match=r"unknown option\(s\) pad for format 'sign'; accepted "
                                         r"options: \(none\)"):
        fmt.fake_quantize(torch.ones(2), pad=True)
    with pytest.raises(NotImplementedError):
        fmt.quantize(torch.ones(2))  # _quantize not implemented
    with pytest.raises(NotImplementedError):
        QuantFormat().fake_quantize(torch.ones(2))
    assert QuantFormat().storage_bits((3,)) == 0.0  # the class attribute by default


def test_checked_input() -> None:
    bad = torch.tensor([[1.0, float("nan")], [float("inf"), 0.0]])
    with pytest.raises(ValueError, match=r"clean the input \(toy has no NaN/Inf policy\)"):
        checked_input(bad, "toy")
    checked_input(bad, "toy", nonfinite="propagate")  # left to the format
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor, got list"):
        checked_input([1.0], "toy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0-d tensor"):
        checked_input(torch.tensor(1.0), "toy")
    with pytest.raises(ValueError, match="NaN/Inf"):
        FMT.fake_quantize(bad.repeat(1, 8))
