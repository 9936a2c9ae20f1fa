"""convention="compressed-tensors" is bit-identical to the INSTALLED compressed-tensors 0.20.

compressed-tensors is called through its public helpers, exactly as it builds an
"nvfp4-pack-quantized" checkpoint: ``generate_gparam`` for the global scale,
``calculate_qparams`` with the "NVFP4" preset's weight args for the block scales, and
``quantize_and_pack_fp4`` for the packed bytes. Nothing of it is re-implemented here.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import (
    calculate_qparams,
    generate_gparam,
)

from nvfp4lab.codec import compute_global_scale, fake_quantize, quantize
from nvfp4lab.e2m1 import unpack_fp4
from nvfp4lab.oracles import nvfp4 as ref_nvfp4
from tests.sample_data import KINDS as ALL_KINDS
from tests.sample_data import make

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WEIGHT_ARGS = preset_name_to_scheme("NVFP4", ["Linear"]).weights


def ct_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors' own result for a 2-D ``x``: (packed uint8, scale bytes uint8, gs)."""
    gs = generate_gparam(x.amin(), x.amax())
    groups = x.unflatten(-1, (x.shape[-1] // 16, 16))
    scales, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), WEIGHT_ARGS, global_scale=gs)
    packed = quantize_and_pack_fp4(x, scales, gs)
    return packed, scales.to(torch.float8_e4m3fn).view(torch.uint8), gs


KINDS = list(ALL_KINDS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_bit_identical_to_compressed_tensors(dtype: torch.dtype, kind: str) -> None:
    x = make(kind, (64, 256), dtype, seed=KINDS.index(kind) * 10 + DTYPES.index(dtype))
    packed, scale_bytes, gs = ct_quantize(x)
    q = quantize(x, convention="compressed-tensors")
    assert torch.equal(q.global_scale, gs)
    assert torch.equal(q.scales.view(torch.uint8), scale_bytes)
    mismatch = (q.packed != packed).nonzero()
    assert mismatch.numel() == 0, mismatch[:5].tolist()
    # and with the global scale passed explicitly
    q2 = quantize(x, gs, convention="compressed-tensors")
    assert torch.equal(q2.packed, packed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["student_t", "zero_blocks", "small_amax", "tiny_blocks"])
def test_reference_is_bit_identical_to_compressed_tensors(dtype: torch.dtype, kind: str) -> None:
    """The slow oracle's compressed-tensors order agrees with the library too."""
    x = make(kind, (8, 128), dtype, seed=99)
    packed, scale_bytes, gs = ct_quantize(x)
    assert ref_nvfp4.global_scale(x, "compressed-tensors") == float(gs)
    codes, scales = ref_nvfp4.quantize_blocks(x, float(gs), "compressed-tensors")
    assert torch.equal(codes, unpack_fp4(packed))
    assert torch.equal(scales.to(torch.float8_e4m3fn).view(torch.uint8), scale_bytes)


def test_fp16_near_max_decodes_to_inf_like_compressed_tensors() -> None:
    """Pinned quirk: fp16 amax 65504 -> CT's fp16-rounded gs 0.041015625 (exact 0.0410357)
    -> the max decodes to 6 * 448 / gs = 65536 in float32, which is inf in float16. CT's own
    decode gives the same; the kernel convention (float32 gs) decodes to 65504."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    x = torch.zeros(1, 16, dtype=torch.float16)
    x[0, 3] = 65504.0
    packed, scale_bytes, gs = ct_quantize(x)
    ct_value = unpack_fp4_from_uint8(packed, 1, 16, torch.float32)[0, 3] * (
        scale_bytes.view(torch.float8_e4m3fn).float()[0, 0] / gs
    )
    q = quantize(x, convention="compressed-tensors")
    assert float(q.global_scale) == 0.041015625
    assert float(q.dequantize(torch.float32)[0, 3]) == float(ct_value) == 65536.0
    assert q.dequantize()[0, 3].isinf()
    assert float(quantize(x, convention="kernel").dequantize()[0, 3]) == 65504.0


def test_fp16_small_amax_global_scale_falls_back_to_one() -> None:
    """A real compressed-tensors quirk: 2688/amax is computed in float16, overflows to inf for
    amax < 2688/65504 ~ 0.041, and the inf is replaced by 1.0. The kernel order (float32) does
    not overflow."""
    x = make("small_amax", (4, 64), torch.float16, seed=1)
    _, _, gs = ct_quantize(x)
    assert float(gs) == 1.0
    assert float(compute_global_scale(x, convention="compressed-tensors")) == 1.0
    assert float(compute_global_scale(x, convention="kernel")) == pytest.approx(2688 / 0.03, 1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_global_scale_sweep_matches_generate_gparam(dtype: torch.dtype) -> None:
    """Note: CT's ``2688 / amax`` is ``Tensor.__rtruediv__``, i.e. ``reciprocal(amax) * 2688``
    with a rounding to the dtype after each op; nvfp4lab and the reference reproduce that."""
    g = torch.Generator().manual_seed(3)
    amax = torch.cat(
        [
            torch.rand(300, generator=g) * 10,
            torch.exp(torch.empty(300).uniform_(-12, 12, generator=g)),
            torch.linspace(0.0405, 0.0415, 50),  # the float16 overflow edge
            torch.tensor([0.0, 1e-30, 65504.0]),
        ]
    )
    amax = amax.clamp(max=torch.finfo(dtype).max).to(dtype)  # finite inputs only
    for a in amax:
        x = torch.stack([a, -a / 3])
        expected = generate_gparam(x.amin(), x.amax())
        got = compute_global_scale(x, convention="compressed-tensors")
        assert torch.equal(got, expected), (float(a), float(got), float(expected))
        assert ref_nvfp4.global_scale(x, "compressed-tensors") == float(expected)


def test_3d_input_matches_flattened_compressed_tensors() -> None:
    x = make("normal", (12, 64), torch.bfloat16, seed=5)
    packed, scale_bytes, _ = ct_quantize(x)
    q = quantize(x.reshape(3, 4, 64), convention="compressed-tensors")
    assert torch.equal(q.packed.reshape(12, 32), packed)
    assert torch.equal(q.scales.view(torch.uint8).reshape(12, 4), scale_bytes)


def test_fake_quantize_matches_compressed_tensors_decompressor() -> None:
    """Decoded values: compressed-tensors' own NVFP4 decompressor (what transformers runs when
    loading a checkpoint; it always decodes to bfloat16) equals nvfp4lab's dequantize."""
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    x = make("student_t", (16, 128), torch.bfloat16, seed=6)
    packed, scale_bytes, gs = ct_quantize(x)
    state = {
        "weight_packed": packed,
        "weight_scale": scale_bytes.view(torch.float8_e4m3fn),
        "weight_global_scale": gs,
    }
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    ct_values = NVFP4PackedCompressor.decompress(state, scheme)["weight"]
    assert ct_values.dtype == torch.bfloat16
    ours = quantize(x, convention="compressed-tensors")
    assert torch.equal(ours.dequantize(torch.bfloat16), ct_values)
    assert torch.equal(fake_quantize(x, convention="compressed-tensors"), ct_values)


def test_kernel_and_ct_disagree_on_a_small_fraction_for_bf16() -> None:
    """Both orders are legitimate; they differ on a small fraction of bf16 codes.

    Measured on this 256x1024 N(0,1) matrix (torch 2.13 CPU): with one shared global scale the
    codes differ in 0.283% of elements (block scales in 1.29% of blocks: amax/6 rounded to
    bf16 moves the E4M3 scale); with each convention's own global scale (CT's is bf16-rounded:
    576.0 vs 577.29) 1.12%. float16: 0.062% / 0.21%. float32: 0 (only exact ties can differ).
    """
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    ct = quantize(x.bfloat16(), convention="compressed-tensors")
    kernel_same_gs = quantize(x.bfloat16(), ct.global_scale, convention="kernel")
    kernel_own_gs = quantize(x.bfloat16(), convention="kernel")
    same = (unpack_fp4(kernel_same_gs.packed) != unpack_fp4(ct.packed)).float().mean().item()
    own = (unpack_fp4(kernel_own_gs.packed) != unpack_fp4(ct.packed)).float().mean().item()
    assert 0.0005 < same < 0.01
    assert 0.002 < own < 0.03
    fp32_kernel = quantize(x, convention="kernel")
    fp32_ct = quantize(x, convention="compressed-tensors")
    assert torch.equal(fp32_kernel.packed, fp32_ct.packed)
