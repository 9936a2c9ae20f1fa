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
