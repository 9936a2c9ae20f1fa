"""Scale arithmetic: encode/decode conversion, abs_max, the global scale from an amax."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab import scales


def test_encode_decode_are_reciprocals() -> None:
    enc = scales.decode_to_encode_scale(torch.tensor([1.0 / 788.0]))
    assert enc.dtype == torch.float32 and enc.shape == (1,)
    assert float(enc) == pytest.approx(788.0, rel=1e-6)
    assert torch.equal(scales.encode_to_decode_scale(4.0), torch.tensor([0.25]))
    with pytest.raises(ValueError, match="finite and > 0"):
        scales.decode_to_encode_scale(0.0)


def test_abs_max() -> None:
    x = torch.tensor([[1.0, -3.0], [-0.0, 2.0]])
    assert float(scales.abs_max(x)) == 3.0
    assert scales.abs_max(x, -1).tolist() == [3.0, 2.0]
    assert scales.abs_max(torch.empty(0, 4)).shape == ()
    assert scales.abs_max(torch.empty(3, 0), -1).tolist() == [0.0, 0.0, 0.0]
    assert str(float(scales.abs_max(torch.tensor([-0.0])))) == "0.0"  # +0.0 for zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_global_scale_from_amax(dtype: torch.dtype) -> None:
    amax = torch.tensor(3.0, dtype=dtype)
    kernel = scales.global_scale_from_amax(amax, "kernel")
    assert kernel.dtype == torch.float32 and kernel.shape == (1,)
    assert float(kernel) == float(torch.tensor(2688.0) / torch.tensor(3.0))  # a float32 division
    ct = scales.global_scale_from_amax(amax, "compressed-tensors")
    assert float(ct) == float((2688.0 / amax).float())  # torch's 2688 / t in the input dtype
    zero = torch.tensor(0.0, dtype=dtype)
    assert float(scales.global_scale_from_amax(zero, "kernel")) == 1.0
    assert float(scales.global_scale_from_amax(zero, "compressed-tensors")) == 1.0


def test_kernel_global_scale_is_capped() -> None:
    gs = scales.global_scale_from_amax(torch.tensor(1e-37), "kernel")
    assert float(gs) == scales.KERNEL_MAX_GLOBAL_SCALE
