"""quantize / dequantize / fake_quantize against the slow reference, plus input validation.

Every test runs twice, on the eager pipeline and on the fused kernels (``fused_setting``).
"""

from __future__ import annotations

import itertools
import math
import re
import warnings

import pytest
import torch

from nvfp4lab.codec import (
    ScaleUnderflowWarning,
    compute_global_scale,
    dequantize,
    fake_quantize,
    quantize,
)
from nvfp4lab.e2m1 import unpack_fp4
from nvfp4lab.oracles import numbers as ref_numbers
from nvfp4lab.oracles import nvfp4 as ref_nvfp4
from nvfp4lab.tensor import NVFP4Tensor
from tests.sample_data import make

pytestmark = pytest.mark.usefixtures("fused_setting")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["normal", "student_t", "outliers", "zero_blocks"]
#: the orders whose scale the reference computes as an ENCODE ``global_scale`` (``modelopt``, in
#: the DECODE form, has its own tests below)
REFERENCE_ORDERS = ["kernel", "compressed-tensors", "llama.cpp"]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view (distinguishes -0.0 from 0.0)."""
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_matches_reference(
    x: torch.Tensor, global_scale: float | None, convention: str
) -> NVFP4Tensor:
    q = quantize(x, global_scale, convention=convention)
    gs = ref_nvfp4.global_scale(x, convention) if global_scale is None else float(global_scale)
    assert q.global_scale.dtype == torch.float32 and q.global_scale.shape == (1,)
    assert float(q.global_scale) == gs
    codes, scales = ref_nvfp4.quantize_blocks(x.contiguous(), gs, convention)
    got_codes = unpack_fp4(q.packed)
    assert got_codes.shape == codes.shape
    bad = (got_codes != codes).nonzero()
    assert bad.numel() == 0, [
        (tuple(i.tolist()), float(x[tuple(i)]), int(got_codes[tuple(i)]), int(codes[tuple(i)]))
        for i in bad[:5]
    ]
    assert q.scales.dtype == torch.float8_e4m3fn
    assert torch.equal(q.scales.view(torch.uint8), scales.to(torch.float8_e4m3fn).view(torch.uint8))
    # decode: value * f32(s / gs) in float32, then cast
    expected = ref_nvfp4.dequantize_blocks(codes, scales, gs)
    assert torch.equal(bits(dequantize(q, torch.float32)), bits(expected))
    out = dequantize(q)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert torch.equal(bits(out), bits(expected.to(x.dtype)))
    return q


# --------------------------------------------------------------------------------------------
# bit-exact agreement with the reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("convention", REFERENCE_ORDERS)
def test_auto_global_scale_matches_reference(
    dtype: torch.dtype, kind: str, convention: str
) -> None:
    x = make(kind, (8, 64), dtype, seed=10 * KINDS.index(kind) + DTYPES.index(dtype))
    assert_matches_reference(x, None, convention)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gs", [1.0, 448.0, 2688.0 / 7.3, 1e-3])
@pytest.mark.parametrize("convention", REFERENCE_ORDERS)
def test_explicit_global_scale_matches_reference(
    dtype: torch.dtype, gs: float, convention: str
) -> None:
    x = make("student_t", (4, 64), dtype, seed=11)
    gs32 = ref_numbers.round_f32(gs)
    assert_matches_reference(x, gs32, convention)
    # a one-element tensor works the same as a float
    q1 = quantize(x, torch.tensor([gs32]), convention=convention)
    q2 = quantize(x, gs32, convention=convention)
    assert torch.equal(q1.packed, q2.packed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_3d_input(dtype: torch.dtype) -> None:
    x = make("normal", (2, 3, 48), dtype, seed=3)
    q = assert_matches_reference(x, None, "kernel")
    assert q.packed.shape == (2, 3, 24) and q.scales.shape == (2, 3, 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(dtype: torch.dtype) -> None:
    base = make("outliers", (64, 16), dtype, seed=4)
    transposed = base.t()  # (16, 64), strides (1, 16)
    assert not transposed.is_contiguous()
    assert_matches_reference(transposed, None, "kernel")
    sliced = make("normal", (6, 128), dtype, seed=5)[::2, ::2]  # (3, 64)
    assert not sliced.is_contiguous()
    assert_matches_reference(sliced, None, "kernel")
    assert_matches_reference(sliced, None, "compressed-tensors")


def test_compute_global_scale_matches_reference() -> None:
    g = torch.Generator().manual_seed(6)
    amaxes = torch.cat([torch.rand(300, generator=g) * 10, torch.rand(100, generator=g) * 1e-3])
    for dtype in DTYPES:
        for a in amaxes.tolist():
            x = torch.tensor([a, -a / 2], dtype=dtype)
            for convention in REFERENCE_ORDERS:
                got = compute_global_scale(x, convention=convention)
                assert got.dtype == torch.float32 and got.shape == (1,)
                assert float(got) == ref_nvfp4.global_scale(x, convention), (dtype, a, convention)


# --------------------------------------------------------------------------------------------
# fake_quantize
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", REFERENCE_ORDERS)
def test_fake_quantize_equals_dequantize_of_quantize(dtype: torch.dtype, convention: str) -> None:
    x = make("student_t", (5, 3, 32), dtype, seed=8)
    y = fake_quantize(x, convention=convention)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(bits(y), bits(dequantize(quantize(x, convention=convention))))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_fake_quantize_is_idempotent_with_the_same_global_scale(
    dtype: torch.dtype, kind: str
) -> None:
    x = make(kind, (8, 64), dtype, seed=9)
    for convention in REFERENCE_ORDERS:
        gs = compute_global_scale(x, convention=convention)
        once = fake_quantize(x, gs, convention=convention)
        twice = fake_quantize(once, gs, convention=convention)
        # equal as values; only the sign of zero may change: code 8 decodes to -0.0, which
        # re-encodes as code 0 (the sign bit is set only for values < 0)
        assert torch.equal(once, twice)
        changed = bits(once) != bits(twice)
        assert bool((once[changed] == 0).all())


# --------------------------------------------------------------------------------------------
# padding, zeros, extreme magnitudes, empty and meta tensors
# --------------------------------------------------------------------------------------------


def test_k_not_multiple_of_16_raises_naming_the_shape() -> None:
    with pytest.raises(ValueError, match=r"\(4, 20\)"):
        quantize(torch.randn(4, 20))
    with pytest.raises(ValueError, match=r"\(4, 20\)"):
        fake_quantize(torch.randn(4, 20))


@pytest.mark.parametrize("convention", REFERENCE_ORDERS)
def test_pad_true(convention: str) -> None:
    x = make("normal", (3, 20), torch.bfloat16, seed=10)
    q = quantize(x, pad=True, convention=convention)
    assert q.packed.shape == (3, 16) and q.scales.shape == (3, 2)
    assert q.shape == (3, 20)
    out = dequantize(q)
    assert out.shape == (3, 20) and out.dtype == torch.bfloat16
    padded = torch.nn.functional.pad(x, (0, 12))
    gs = ref_nvfp4.global_scale(x, convention)
    codes, scales = ref_nvfp4.quantize_blocks(padded, gs, convention)
    assert torch.equal(unpack_fp4(q.packed), codes)
    expected = ref_nvfp4.dequantize_blocks(codes, scales, gs)[:, :20].to(torch.bfloat16)
    assert torch.equal(bits(out), bits(expected))
    y = fake_quantize(x, pad=True, convention=convention)
    assert y.shape == (3, 20) and torch.equal(bits(y), bits(out))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", REFERENCE_ORDERS)
def test_all_zero_input(dtype: torch.dtype, convention: str) -> None:
    x = torch.zeros(4, 32, dtype=dtype)
    q = quantize(x, convention=convention)
    assert float(q.global_scale) == 1.0
    assert bool((q.packed == 0).all())
    assert not bool(torch.isnan(q.scales.float()).any())
    out = dequantize(q)
    assert bool((out == 0).all()) and not bool(torch.isnan(out).any())
    assert_matches_reference(x, None, convention)


@pytest.mark.parametrize(
    ("magnitude", "dtype"),
    [
        (1e38, torch.float32),
        (1e38, torch.bfloat16),
        (6e4, torch.float16),
        (1e-40, torch.float32),
        (1e-40, torch.bfloat16),
        (1e-7, torch.float16),
        (3.4e38, torch.float32),
    ],
)
@pytest.mark.parametrize("convention", REFERENCE_ORDERS)
def test_extreme_magnitudes_stay_finite(
    magnitude: float, dtype: torch.dtype, convention: str
) -> None:
    x = (make("normal", (4, 32), torch.float32, seed=12).clamp(-1, 1) * magnitude).to(dtype)
    assert bool(torch.isfinite(x).all())
    # below the kernel order's capped scale every block underflows: that is said, not silent
    capped = convention == "kernel" and magnitude < 1e-35
    # llama.cpp has no tensor scale: blocks whose amax / 6 is below UE4M3's 2**-10 vanish
    capped |= convention == "llama.cpp" and magnitude < 6 * 2.0**-10
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = quantize(x, convention=convention)
        out = dequantize(q)
        assert bool(torch.isfinite(q.scales.float()).all())
        assert bool(torch.isfinite(out).all())
        assert bool(torch.isfinite(fake_quantize(x, convention=convention)).all())
        assert_matches_reference(x, None, convention)
    underflow = [w for w in caught if issubclass(w.category, ScaleUnderflowWarning)]
    assert len(underflow) == (3 if capped else 0), [str(w.message) for w in caught]


def test_empty_tensors() -> None:
    for shape in [(0, 32), (3, 0), (2, 0, 16)]:
        x = torch.zeros(shape)
        q = quantize(x)
        assert q.packed.shape == (*shape[:-1], shape[-1] // 2)
        assert q.scales.shape == (*shape[:-1], shape[-1] // 16)
        assert dequantize(q).shape == shape
        assert fake_quantize(x).shape == shape


def test_meta_device_gives_shapes() -> None:
    x = torch.empty(6, 4, 64, dtype=torch.bfloat16, device="meta")
    q = quantize(x)
    assert q.packed.shape == (6, 4, 32) and q.packed.device.type == "meta"
    assert q.scales.shape == (6, 4, 4) and q.scales.dtype == torch.float8_e4m3fn
    y = fake_quantize(x)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device.type == "meta"
    qp = quantize(torch.empty(2, 20, device="meta"), pad=True)
    assert qp.packed.shape == (2, 16) and qp.shape == (2, 20)


# --------------------------------------------------------------------------------------------
# bad input: each its own test, the message names the offending value
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.float64]
)
def test_unsupported_dtypes_raise_type_error(dtype: torch.dtype) -> None:
    x = torch.zeros(2, 16, dtype=dtype)
    with pytest.raises(TypeError, match=str(dtype).replace("torch.", "")):
        quantize(x)
    with pytest.raises(TypeError, match=str(dtype).replace("torch.", "")):
        fake_quantize(x)


def test_nan_and_inf_raise_with_count_and_first_index() -> None:
    x = torch.randn(4, 32)
    x[1, 3] = math.nan
    x[2, 0] = math.inf
    x[3, 31] = -math.inf
    with pytest.raises(ValueError, match=r"3 NaN/Inf.*\(1, 3\)"):
        quantize(x)
    with pytest.raises(ValueError, match=r"3 NaN/Inf.*\(1, 3\)"):
        fake_quantize(x)


def test_nonfinite_propagate_does_not_raise() -> None:
    x = torch.randn(2, 32)
    x[0, 0] = math.inf
    x[1, 20] = math.nan
    q = quantize(x, 100.0, nonfinite="propagate")
    assert q.packed.shape == (2, 16)
    finite_rows_block = dequantize(q)[0, 16:]
    assert bool(torch.isfinite(finite_rows_block).all())
    fake_quantize(x, 100.0, nonfinite="propagate")
    with pytest.raises(ValueError, match="ignore"):
        quantize(x, 100.0, nonfinite="ignore")


@pytest.mark.parametrize(
    ("gs", "pattern"),
    [(0.0, "0.0"), (-1.0, "-1.0"), (math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")],
)
def test_bad_global_scale_values(gs: float, pattern: str) -> None:
    with pytest.raises(ValueError, match=re.escape(pattern)):
        quantize(torch.randn(2, 16), gs)
    with pytest.raises(ValueError, match=re.escape(pattern)):
        fake_quantize(torch.randn(2, 16), gs)


def test_global_scale_wrong_shape() -> None:
    with pytest.raises(ValueError, match=r"\(2,\)"):
        quantize(torch.randn(2, 16), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"\(0,\)"):
        quantize(torch.randn(2, 16), torch.tensor([]))


def test_unknown_convention_lists_accepted_values() -> None:
    with pytest.raises(ValueError, match=r"'kernal'.*kernel.*compressed-tensors"):
        quantize(torch.randn(2, 16), convention="kernal")
    with pytest.raises(ValueError, match=r"'ct'.*kernel.*compressed-tensors"):
        compute_global_scale(torch.randn(2, 16), convention="ct")


def _good_parts() -> dict[str, torch.Tensor]:
    q = quantize(torch.randn(4, 32))
    return {"packed": q.packed, "scales": q.scales, "global_scale": q.global_scale}


def test_nvfp4tensor_packed_wrong_dtype() -> None:
    parts = _good_parts()
    parts["packed"] = parts["packed"].to(torch.int16)
    with pytest.raises(ValueError, match="int16"):
        NVFP4Tensor(**parts)


def test_nvfp4tensor_scales_wrong_dtype() -> None:
    parts = _good_parts()
    parts["scales"] = parts["scales"].float()
    with pytest.raises(ValueError, match="float32"):
        NVFP4Tensor(**parts)
    parts["scales"] = _good_parts()["scales"].view(torch.uint8)
    with pytest.raises(ValueError, match="uint8"):
        NVFP4Tensor(**parts)


def test_nvfp4tensor_mismatched_leading_dims() -> None:
    parts = _good_parts()
    parts["scales"] = parts["scales"][:3]
    with pytest.raises(ValueError, match=r"\(3, 2\)"):
        NVFP4Tensor(**parts)


def test_nvfp4tensor_scale_count_does_not_divide() -> None:
    parts = _good_parts()
    parts["scales"] = torch.zeros(4, 3, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"\(4, 3\)"):
        NVFP4Tensor(**parts)


def test_nvfp4tensor_shape_does_not_fit() -> None:
    with pytest.raises(ValueError, match=r"\(4, 40\)"):
        NVFP4Tensor(**_good_parts(), shape=torch.Size([4, 40]))
    with pytest.raises(ValueError, match=r"\(5, 32\)"):
        NVFP4Tensor(**_good_parts(), shape=torch.Size([5, 32]))


def test_nvfp4tensor_bad_global_scale() -> None:
    parts = _good_parts()
    parts["global_scale"] = torch.tensor([-2.0])
    with pytest.raises(ValueError, match=r"-2\.0"):
        NVFP4Tensor(**parts)
    parts["global_scale"] = torch.tensor([1.0, 1.0])
    with pytest.raises(ValueError, match=r"\(2,\)"):
        NVFP4Tensor(**parts)


def test_nvfp4tensor_properties() -> None:
    x = make("normal", (4, 64), torch.bfloat16, seed=13)
    q = quantize(x)
    assert q.block_size == 16
    assert q.nbytes == 4 * 32 + 4 * 4 + 4
    assert q.dtype == torch.bfloat16
    same = NVFP4Tensor(packed=q.packed, scales=q.scales, global_scale=q.global_scale)
    assert same.shape == (4, 64) and same.dtype == torch.float32
    assert torch.equal(same.dequantize(torch.bfloat16), q.dequantize())
    moved = q.to("cpu")
    assert torch.equal(moved.packed, q.packed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", REFERENCE_ORDERS)
@pytest.mark.parametrize("gs", [1.0, 2688.0 / 448.0 * 0.37])
def test_block_scales_at_every_e4m3_tie(dtype: torch.dtype, convention: str, gs: float) -> None:
    """Blocks whose pre-rounding scale ``gs * amax / 6`` sits on an E4M3 rounding tie, +- 3 ulps
    of the input dtype: stresses the exact order of steps 1-2 (f32(1/6) multiply vs division,
    rounding in the input dtype, ties to even) and the division / reciprocal in step 3-4."""
    gs32 = ref_numbers.round_f32(gs)
    positive = [v for v in ref_numbers.e4m3_finite_values() if v >= 0]
    ties = torch.tensor([(a + b) / 2 for a, b in itertools.pairwise(positive)])
    amax = (ties * 6 / gs32).to(dtype)
    amax = amax[torch.isfinite(amax) & (amax > 0)]
    steps = [amax]
    for direction in (0.0, math.inf):
        a = amax
        for _ in range(3):
            a = torch.nextafter(a, torch.full_like(a, direction))
            steps.append(a)
    amax = torch.cat(steps)
    amax = amax[torch.isfinite(amax) & (amax > 0)]
    g = torch.Generator().manual_seed(14)
    fill = torch.rand(amax.numel(), 16, generator=g) * 2 - 1
    x = (fill * amax.float()[:, None]).to(dtype)
    x[:, 0] = amax
    x[:, 1] = -amax
    assert_matches_reference(x, gs32, convention)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("convention", REFERENCE_ORDERS)
def test_e2m1_ties_inside_a_block(dtype: torch.dtype, convention: str) -> None:
    """gs = 1 and block amax 6 give scale 1: the elements hit the E2M1 ties exactly."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = torch.tensor([[6.0, *ties, -6.0, *[-t for t in ties]]], dtype=dtype)
    q = assert_matches_reference(x, 1.0, convention)
    assert q.scales.float().item() == 1.0
    if convention == "llama.cpp":  # the earlier table index: the smaller magnitude, and +0
        expected = [7, 0, 1, 2, 3, 4, 5, 6]
        negative = [c | 8 if c else 0 for c in expected]
    else:  # ties to even
        expected = [7, 0, 2, 2, 4, 4, 6, 6]
        negative = [c | 8 for c in expected]
    assert unpack_fp4(q.packed)[0].tolist() == expected + negative


# --------------------------------------------------------------------------------------------
# review follow-ups: NaN under "propagate", explicit block size, field validation
# --------------------------------------------------------------------------------------------


def test_propagate_nan_does_not_set_the_global_scale() -> None:
    """A NaN/Inf must not replace the global scale of the finite values by 1.0."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3)) * 1e4
    clean = x.clone()
    x[0, 0] = float("nan")
    x[1, 5] = float("inf")
    gs = compute_global_scale(x)
    finite = torch.where(torch.isfinite(x), x, 0)
    assert torch.equal(gs, compute_global_scale(finite))
    q = quantize(x, nonfinite="propagate")
    assert torch.equal(q.global_scale, gs)
    # rows 2 and 3 hold only finite values: decoded as without the NaN/Inf
    assert torch.equal(q.dequantize()[2:], quantize(clean, gs).dequantize()[2:])
    assert bool(torch.isnan(q.dequantize()[0, :16]).all())  # the NaN block is poisoned


def test_nvfp4tensor_shapes_must_match_the_block_size() -> None:
    q = quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match="cover 4 blocks of 16"):
        NVFP4Tensor(packed=q.codes(), scales=q.scales, global_scale=q.global_scale)
    with pytest.raises(ValueError, match="cover 8 blocks of 16"):
        NVFP4Tensor(
            packed=q.packed, scales=torch.cat([q.scales] * 2, -1), global_scale=q.global_scale
        )
    other = quantize(torch.randn(8, 64), block_size=32)
    assert other.block_size == 32 and other.scales.shape == (8, 2)
    assert torch.equal(other.to("cpu").dequantize(), other.dequantize())
    with pytest.raises(ValueError, match="cover 2 blocks of 16"):
        NVFP4Tensor(packed=other.packed, scales=other.scales, global_scale=other.global_scale)


def test_global_scale_forms() -> None:
    import numpy as np

    x = torch.randn(2, 16)
    assert torch.equal(quantize(x, np.float32(448.0)).packed, quantize(x, 448.0).packed)
    with pytest.raises(ValueError, match=r"shape \[1\] or \[\]"):
        quantize(x, torch.ones(1, 1))


def test_dequantize_needs_a_float_dtype() -> None:
    with pytest.raises(TypeError, match="int32"):
        quantize(torch.randn(2, 16)).dequantize(torch.int32)


def test_inputs_that_require_grad_are_detached_quietly() -> None:
    import warnings

    x = torch.randn(2, 32, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = quantize(x)  # integer codes: not differentiable, x detached quietly
        y = fake_quantize(x)  # a straight-through estimator (issue 19 case 10)
    assert not q.packed.requires_grad and not q.global_scale.requires_grad
    assert y.requires_grad
    assert torch.equal(y.detach(), q.dequantize())


# --------------------------------------------------------------------------------------------
# the modelopt order (ModelOpt 0.47's NVFP4QTensor.quantize; the installed package is the oracle
# of tests/peers, the slow reference is the oracle here)


def _modelopt_matches_reference(x: torch.Tensor, q: NVFP4Tensor, decode: float) -> None:
    assert q.decode_scale is not None and float(q.decode_scale) == decode
    assert float(q.global_scale) == ref_numbers.round_f32(1.0 / decode)  # its float32 reciprocal
    codes, scales = ref_nvfp4.quantize_blocks(x, decode, "modelopt")
    assert torch.equal(unpack_fp4(q.packed), codes)
    assert torch.equal(q.scales.view(torch.uint8), scales.to(torch.float8_e4m3fn).view(torch.uint8))
    expected = ref_nvfp4.dequantize_blocks(codes, scales, decode, "modelopt")
    assert torch.equal(bits(q.dequantize(torch.float32)), bits(expected))
    assert torch.equal(bits(fake_quantize(x, decode_scale=decode, convention="modelopt")),
                       bits(expected.to(x.dtype)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", [*KINDS, "tiny_blocks"])
def test_modelopt_order_matches_reference(dtype: torch.dtype, kind: str) -> None:
    if kind == "tiny_blocks":  # blocks far below the tensor's amax: ModelOpt clamps to 2**-9
        x = make("normal", (8, 64), dtype, seed=3)
        x[:, :16] *= 1e-6
    else:
        x = make(kind, (8, 64), dtype, seed=7 * KINDS.index(kind) + DTYPES.index(dtype))
    q = quantize(x, convention="modelopt")
    _modelopt_matches_reference(x, q, ref_nvfp4.modelopt_decode_scale(x))
    raw = q.scales.view(torch.uint8)
    if kind == "zero_blocks":
        assert (raw == 0x38).any()  # an all-zero block gets scale 1.0, never 0
    if kind == "tiny_blocks":
        assert (raw[:, 0] == 0x01).all()  # clamped to E4M3's smallest, 2**-9
    assert not (raw == 0).any()


def test_modelopt_explicit_scales() -> None:
    x = make("student_t", (4, 64), torch.bfloat16, seed=5)
    decode = ref_numbers.round_f32(float(x.abs().max()) / 2688.0 * 1.25)
    _modelopt_matches_reference(x, quantize(x, decode_scale=decode, convention="modelopt"), decode)
    gs = 2688.0 / 3.0  # an ENCODE scale: its float32 reciprocal becomes the decode scale
    q = quantize(x, gs, convention="modelopt")
    assert float(q.decode_scale) == ref_numbers.round_f32(1.0 / ref_numbers.round_f32(gs))
    with pytest.raises(ValueError, match=r"either global_scale .* or decode_scale"):
        quantize(x, 1.0, decode_scale=1.0)
    kernel = quantize(x, decode_scale=decode)  # other orders take its reciprocal
    assert kernel.decode_scale is None
    assert float(kernel.global_scale) == float(torch.reciprocal(torch.tensor([decode])))
    assert float(compute_global_scale(x, convention="modelopt")) == float(
        torch.reciprocal(torch.tensor([ref_nvfp4.modelopt_decode_scale(x)]))
    )


# --------------------------------------------------------------------------------------------
# issue 19 case 10: fake_quantize is a straight-through estimator (plain STE: the gradient
# passes unchanged everywhere, clamped elements included); quantize stays non-differentiable


@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_quantize_straight_through_gradient(fused_setting: str, dtype: torch.dtype) -> None:
    fused = fused_setting == "on"
    gen = torch.Generator().manual_seed(19)
    base = torch.randn(4, 32, generator=gen).to(dtype)
    base[0, :16] *= 8.0  # beyond the range of the explicit scale below: clamped to +-6·448/gs
    base[1, 3] = -50.0
    gs = 2688.0 / 2.0  # an amax of 2: everything above 2 in magnitude saturates
    x = base.clone().requires_grad_()
    y = fake_quantize(x, gs, fused=fused)
    plain = fake_quantize(base, gs, fused=fused)
    assert y.requires_grad and y.dtype == dtype
    assert torch.equal(y.detach(), plain)  # the forward pass: the no-grad bits exactly
    clamped = base.abs() > 2.0
    assert int(clamped.sum()) >= 10  # the crafted values really lie beyond the range
    n = int(clamped.sum())
    assert torch.equal(y.detach()[clamped].abs(), torch.full((n,), 2.0, dtype=dtype))
    grad = torch.arange(1, 129, dtype=torch.float32).reshape(4, 32).to(dtype) / 8
    y.backward(grad)
    assert x.grad is not None and torch.equal(x.grad, grad)  # unchanged, clamped ones too
    with torch.no_grad():
        assert not fake_quantize(x, gs, fused=fused).requires_grad
    assert not quantize(x, fused=fused).packed.requires_grad  # integer codes: no gradient


def test_fake_quantize_straight_through_with_computed_scale_and_padding(fused_setting: str) -> None:
    fused = fused_setting == "on"
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)).requires_grad_()
    w = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    loss = (fake_quantize(x, fused=fused) * w).sum()
    loss.backward()
    assert x.grad is not None and torch.equal(x.grad, w)
    for k, opts in ((20, {"pad": True}), (32, {"hadamard": 3})):  # eager: padding, a rotation
        xp = torch.randn(2, k, generator=torch.Generator().manual_seed(7)).requires_grad_()
        yp = fake_quantize(xp, **opts)
        assert torch.equal(yp.detach(), fake_quantize(xp.detach(), **opts))
        yp.sum().backward()
        assert xp.grad is not None and torch.equal(xp.grad, torch.ones(2, k))


# --------------------------------------------------------------------------------------------
# issue 19 case 9: a COMPUTED global scale that falls short of 2688/amax (the kernel order's
# cap 2**116) warns when non-zero blocks underflow to zero, and only then


def test_capped_computed_scale_that_zeroes_blocks_warns(fused_setting: str) -> None:
    from nvfp4lab.codec import ScaleUnderflowWarning

    fused = fused_setting == "on"
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 1e-38
    with pytest.warns(ScaleUnderflowWarning, match=r"caps it at 2\*\*116.*256 of 256 non-zero"):
        q = quantize(x, fused=fused)
    assert float(q.global_scale) == 2.0**116 and not q.dequantize().any()  # all zeros, as warned
    with pytest.warns(ScaleUnderflowWarning, match=r"Rescale the input by a power of two"):
        assert not fake_quantize(x, fused=fused).any()
    # the remedy the message names works: rescaled by 2**124, the tensor quantizes to non-zeros
    k = re.search(r"2\*\*(\d+) and divide", str(_underflow_message(x, fused))).group(1)  # type: ignore[union-attr]
    assert k == "124"
    y = fake_quantize(x * 2.0**124, fused=fused) / 2.0**124
    assert int((y != 0).sum()) > 3000


def _underflow_message(x: torch.Tensor, fused: bool) -> str:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantize(x, fused=fused)
    assert len(caught) == 1
    return str(caught[0].message)


def test_capped_scale_warns_only_for_blocks_that_underflow(fused_setting: str) -> None:
    import warnings

    fused = fused_setting == "on"
    x = torch.zeros(2, 32)
    x[0, 0] = 1e-33  # block 0: amax 1e-33, the cap binds (2688/1e-33 = 2.7e36 > 2**116)
    x[0, 16] = 1e-38  # block 1: 2**116 · 1e-38 / 6 = 1.4e-4 < 2**-10: a zero scale
    x[1, 5] = -3e-34  # block 2: 2**116 · 3e-34 / 6 = 4.2 (fine)
    message = _underflow_message(x, fused)
    assert "1 of 3 non-zero blocks" in message and "'compressed-tensors'" in message
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = quantize(x, fused=fused)
    assert q.scales.float().reshape(2, 2).tolist()[0][1] == 0.0
    # with the uncapped compressed-tensors scale block 1 survives: no warning, non-zero codes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qc = quantize(x, convention="compressed-tensors", fused=fused)
        capped_but_fine = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)) * 1e-33
        assert float(quantize(capped_but_fine, fused=fused).global_scale) == 2.0**116
        fake_quantize(capped_but_fine, fused=fused)
    assert float(qc.dequantize()[0, 16]) != 0.0


# --------------------------------------------------------------------------------------------
# the llama.cpp order (ggml's quantize_row_nvfp4_ref): its edges, its tensor-scale rule
# --------------------------------------------------------------------------------------------


def _llama_cpp_edges(kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Data at the llama.cpp order's edges: subnormal UE4M3 scales (small_amax, tiny_blocks) and
    blocks beyond 6 * 448 = 2688 (saturated scale 448; in float32 / bf16 up to 1e12, where the
    float32 errors of several codes round equal and a smaller code wins)."""
    if kind != "saturating":
        return make(kind, (8, 64), dtype, seed=21)
    x = make("normal", (8, 64), torch.float32, seed=22)
    top = 6e4 if dtype == torch.float16 else 1e12
    x[:, ::16] = torch.logspace(3.3, math.log10(top), 8)[:, None] * torch.tensor([1.0, -1.0, 1, -1])
    x[:, 1::16] *= 1e3
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["small_amax", "tiny_blocks", "saturating"])
def test_llama_cpp_edges_match_reference(dtype: torch.dtype, kind: str) -> None:
    x = _llama_cpp_edges(kind, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ScaleUnderflowWarning)  # blocks below 6 * 2**-10
        q = assert_matches_reference(x, None, "llama.cpp")
    raw = q.scales.view(torch.uint8)
    if kind == "tiny_blocks":
        assert bool(((raw > 0) & (raw < 0x08)).any())  # subnormal UE4M3 scales
        assert bool((raw == 0).any())  # and vanished blocks
    if kind == "saturating":
        assert bool((raw[:, 0] == 0x7E).all())  # 448
        if dtype != torch.float16:  # 1e12 at scale 448: every |k s - x| rounds alike -> code 0
            assert int(unpack_fp4(q.packed)[-1, 0]) == 0


def test_llama_cpp_global_scale_is_a_prescale() -> None:
    """A given ENCODE global scale multiplies the elements first: the codes and scales of
    ggml's quantizer on f32(x * gs), decoded divided by gs; no scale means 1.0."""
    x = make("student_t", (6, 64), torch.bfloat16, seed=23)
    assert float(compute_global_scale(x, convention="llama.cpp")) == 1.0
    assert float(quantize(x, convention="llama.cpp").global_scale) == 1.0
    gs = ref_numbers.round_f32(2688.0 / float(x.float().abs().max()))
    q = quantize(x, gs, convention="llama.cpp")
    plain = quantize(x.float() * gs, convention="llama.cpp")
    assert torch.equal(q.packed, plain.packed)
    assert torch.equal(q.scales.view(torch.uint8), plain.scales.view(torch.uint8))
    assert float(q.global_scale) == gs
    codes, scales = ref_nvfp4.quantize_blocks(x, gs, "llama.cpp")
    want = ref_nvfp4.dequantize_blocks(codes, scales, gs)
    assert torch.equal(bits(dequantize(q, torch.float32)), bits(want))
    # a DECODE scale works as its float32 reciprocal, as for the other ENCODE-form orders
    q2 = quantize(x, decode_scale=1.0 / gs, convention="llama.cpp")
    assert float(q2.global_scale) == float(torch.reciprocal(torch.tensor([1.0 / gs])))


def test_llama_cpp_refuses_stochastic_rounding() -> None:
    with pytest.raises(ValueError, match=r"stochastic.*llama\.cpp order"):
        quantize(torch.randn(2, 16), convention="llama.cpp", rounding="stochastic", generator=1)


def test_llama_cpp_vanishing_blocks_warn() -> None:
    x = make("normal", (2, 64), torch.float32, seed=24)
    x[0, :16] *= 1e-4  # block max ~3e-4 < 6 * 2**-10: scale 0, codes 0
    with pytest.warns(ScaleUnderflowWarning, match=r"no tensor scale \(1.0\): 1 of 8"):
        q = quantize(x, convention="llama.cpp")
    assert float(q.scales[0, 0].float()) == 0.0 and bool((dequantize(q)[0, :16] == 0).all())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScaleUnderflowWarning)
        quantize(x, 2688.0 / float(x.abs().max()), convention="llama.cpp")  # pre-scaled: none


def test_llama_cpp_code_choice_at_every_scale_and_edge() -> None:
    """The fast code choice (midpoint counts, ggml's loop only beyond 6 s) against ggml's loop in
    Python, at all 127 E4M3 scales, on every table value and midpoint and one float32 ulp either
    side, and beyond 6 s where float32 absorbs (1e10, 3e38, inf), NaN and both signs."""
    from nvfp4lab.blocks import _nearest_scaled_table

    scales = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    points = [ref_nvfp4.GGML_KVALUES[i] / 2 for i in range(8)]  # kvalues are doubled E2M1
    points += [(a + b) / 2 for a, b in itertools.pairwise(points)] + [6.5, 7.0]
    unit = torch.tensor(points, dtype=torch.float32)[None, :] * scales[:, None]
    near = torch.cat([torch.nextafter(unit, torch.tensor(-math.inf)), unit,
                      torch.nextafter(unit, torch.tensor(math.inf))], dim=1)
    extra = torch.tensor([1e-30, 1e10, 3e38, math.inf, math.nan]).expand(127, 5)
    values = torch.cat([near, -near, extra, -extra], dim=1)  # [127, 106]
    width = values.shape[1]
    values = torch.nn.functional.pad(values, (0, -width % 16))
    blocks = values.reshape(127, -1, 16)
    got = _nearest_scaled_table(blocks, scales[:, None].expand(127, blocks.shape[1]))

    def ggml_best(v: float, d: float) -> int:  # best_index_mxfp4, literally
        best, best_err = 0, abs(ref_numbers.round_f32(ref_numbers.round_f32(0.0 * d) - v))
        for i in range(1, 16):
            kvalue = ref_nvfp4.GGML_KVALUES[i]
            err = abs(ref_numbers.round_f32(ref_numbers.round_f32(kvalue * d) - v))
            if err < best_err:
                best, best_err = i, err
        return best

    want = [[ggml_best(float(v), ref_nvfp4.ggml_ue4m3_to_fp32(r)) for v in blocks[r].flatten()]
            for r in range(127)]  # byte r decodes to half of scales[r]
    assert torch.equal(got.reshape(127, -1), torch.tensor(want, dtype=torch.uint8))
