"""The benchmark runner: shapes and seeded inputs."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab.bench import runner


def test_parse_shapes() -> None:
    assert runner.parse_shapes(["16x4096x4096", "1,64,32"]) == [(16, 4096, 4096), (1, 64, 32)]
    with pytest.raises(ValueError):
        runner.parse_shapes(["16x4096"])
    with pytest.raises(ValueError, match="K % 16"):
        runner.parse_shapes(["1x16x17"])


def test_seeded_inputs_are_reproducible_and_nonzero() -> None:
    a = runner.seeded_randn((64, 64), torch.bfloat16, 3)
    b = runner.seeded_randn((64, 64), torch.bfloat16, 3)
    c = runner.seeded_randn((64, 64), torch.bfloat16, 4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (a != 0).all()


def test_logical_bytes_and_bounds() -> None:
    nk = 1 << 20
    # bf16: read 2 B, write 0.5 B of codes + 1/16 B of scales per element; copy_ moves 2 + 2
    assert runner.logical_bytes("copy", nk, 2) == 4 * nk
    assert runner.logical_bytes("quantize", nk, 2) == runner.logical_bytes("dequantize", nk, 2)
    assert runner.logical_bytes("quantize", nk, 2) == nk * (2 + 0.5 + 0.0625)
    assert runner.bound_ratio("quantize", 2) == 0.640625
    assert runner.bound_ratio("dequantize", 4) == (4 + 0.5625) / 8
    assert runner.bound_ratio("fake_quantize", 2) == 1.0
    # amax first: quantize and fake_quantize read x a second time; dequantize does not
    assert runner.bound_ratio("quantize", 2, amax_pass=True) == 1.140625
    assert runner.bound_ratio("fake_quantize", 2, amax_pass=True) == 1.5
    assert runner.bound_ratio("dequantize", 2, amax_pass=True) == 0.640625
