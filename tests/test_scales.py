"""Scale arithmetic: encode/decode conversion, abs_max, the global scale from an amax."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab import scales
from nvfp4lab.orders import E4M3Rounding


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


# -- llama.cpp's UE4M3 rounding (ggml_fp32_to_ue4m3) --------------------------------------------


def _ue4m3_sweep() -> torch.Tensor:
    """float32 values across UE4M3's whole range: every 4096th float32 from 2**-14
    to 512 (so every rounding boundary's neighbourhood at the 4th mantissa bit), each E4M3 value
    and each midpoint between neighbours +- 2 ulps, 0, -1 and +inf."""
    low = int(torch.tensor(2.0**-14).view(torch.int32))
    high = int(torch.tensor(512.0).view(torch.int32))
    strided = torch.arange(low, high, 1 << 12, dtype=torch.int32).view(torch.float32)
    e4m3 = torch.arange(0, 0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    points = e4m3.float()
    points = torch.cat([points, (points[1:] + points[:-1]) / 2])
    near = [points]
    for direction in (0.0, 1e9):
        a = points
        for _ in range(2):
            a = torch.nextafter(a, torch.full_like(a, direction))
            near.append(a)
    extra = torch.tensor([0.0, -1.0, float("inf"), 7.5 / 512, 7.99 / 512, 0.5 / 512, 0.49 / 512])
    return torch.cat([strided, *near, extra])


def test_half_up_ue4m3_matches_reference_and_gguf_py() -> None:
    """scales._round_e4m3(HALF_UP_UE4M3) = the reference's transcription of ggml's C, value for
    value, and = gguf-py's vectorized NVFP4.fp32_to_ue4m3 (an independent third implementation)
    byte for byte; NaN gives 0 (the C's ``!(x > 0)``)."""
    from nvfp4lab.oracles import numbers as ref_numbers
    from nvfp4lab.oracles import nvfp4 as ref_nvfp4

    x = _ue4m3_sweep()
    got = scales._round_e4m3(x.clamp(max=448.0), E4M3Rounding.HALF_UP_UE4M3)
    want = torch.tensor(
        [ref_numbers.decode_e4m3(ref_nvfp4.ggml_fp32_to_ue4m3(v)) for v in x.tolist()]
    )
    assert torch.equal(got, want)
    nan = scales._round_e4m3(torch.tensor([float("nan")]), E4M3Rounding.HALF_UP_UE4M3)
    assert float(nan) == 0.0 and ref_nvfp4.ggml_fp32_to_ue4m3(float("nan")) == 0
    # the documented quirks
    at = {v: float(g) for v, g in zip(x.tolist(), got, strict=True)}
    assert at[448.0] == 448.0 and at[256.0] == 448.0 and at[240.0] == 240.0
    f32 = ref_numbers.round_f32
    assert at[f32(7.5 / 512)] == 7 / 512 and at[f32(0.5 / 512)] == 1 / 512
    assert at[f32(0.49 / 512)] == 0.0
    quants = pytest.importorskip("gguf.quants")
    theirs = quants.NVFP4.fp32_to_ue4m3(x.numpy())
    assert torch.equal(got.to(torch.float8_e4m3fn).view(torch.uint8), torch.from_numpy(theirs))


def test_half_up_differs_from_nearest_even() -> None:
    """Round half up (ggml) vs ties to even (torch's cast): at 2.125 (a tie between 2 and 2.25)
    ggml goes up, the cast to the even 2; from 248 on ggml gives 448 where the cast gives
    256..448."""
    x = torch.tensor([2.125, 2.375, 250.0, 300.0, 448.0])
    ggml = scales._round_e4m3(x, E4M3Rounding.HALF_UP_UE4M3)
    rne = scales._round_e4m3(x, E4M3Rounding.NEAREST_EVEN)
    assert ggml.tolist() == [2.25, 2.5, 448.0, 448.0, 448.0]
    assert rne.tolist() == [2.0, 2.5, 256.0, 288.0, 448.0]
