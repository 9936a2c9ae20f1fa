"""linear(): emulation / w4a16 against independent computations, bias epilogues, native contract."""

from __future__ import annotations

import warnings

import pytest
import torch

from nvfp4lab.codec import quantize
from nvfp4lab.e2m1 import unpack_fp4
from nvfp4lab.execution import gemm as linear_mod
from nvfp4lab.execution.dispatch import BACKEND_ENV
from nvfp4lab.execution.gemm import (
    DroppedBiasWarning,
    linear,
    native_scaled_mm_args,
    reference_scaled_mm,
)
from nvfp4lab.layout import unswizzle_scales
from nvfp4lab.oracles import numbers as ref_numbers
from nvfp4lab.oracles import nvfp4 as ref_nvfp4
from nvfp4lab.settings import BATCH_INVARIANT_ENV
from nvfp4lab.tensor import NVFP4Tensor

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
N, K = 24, 64


def _data(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, K, generator=g) * 2).to(dtype)
    w = (torch.randn(N, K, generator=g) * 0.05).to(dtype)
    b = (torch.randn(N, generator=g) * 0.5).to(dtype)
    return x, quantize(w), b


def _vllm_weight(weight: NVFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Independent weight decode in vLLM's order (dequantize_to_dtype@0.33.0 with the CT
    loader's decode scale): value * (scale * (1/gs)) in float32, from a table of E2M1 values."""
    codes = unpack_fp4(weight.packed).long()
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    values = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    decode = torch.tensor([1.0], dtype=torch.float32) / weight.global_scale
    factor = weight.scales.float() * decode
    out = values.reshape(*factor.shape, -1) * factor.unsqueeze(-1)
    return out.reshape(values.shape)[..., : weight.shape[-1]].to(dtype)


def _manual_emulation(x, weight, bias, gs=None):
    """vLLM's run_nvfp4_emulations + bias, with the slow reference for the quantization."""
    x2d = x.reshape(-1, x.shape[-1])
    gs_x = ref_nvfp4.global_scale(x2d) if gs is None else gs
    codes, scales = ref_nvfp4.quantize_blocks(x2d, gs_x, "kernel")
    x_dq = ref_nvfp4.dequantize_blocks(codes, scales, gs_x).to(x.dtype)
    out = torch.matmul(x_dq, _vllm_weight(weight, x.dtype).T)
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (5,), (2, 3)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_emulation_matches_manual(dtype, shape, with_bias) -> None:
    x, w, b = _data(dtype, shape)
    bias = b if with_bias else None
    out = linear(x, w, bias, backend="emulation")
    assert out.shape == (*shape, N) and out.dtype == dtype
    assert torch.equal(out, _manual_emulation(x, w, bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulation_static_input_scale(dtype) -> None:
    x, w, b = _data(dtype, (4,), seed=1)
    gs = 2688.0 / 3.0  # calibrated on a smaller amax: some activations saturate at ±6·s
    out = linear(x, w, b, input_global_scale=torch.tensor([gs]), backend="emulation")
    assert torch.equal(out, _manual_emulation(x, w, b, gs=ref_numbers.round_f32(gs)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (5,), (2, 3)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_w4a16_matches_manual(dtype, shape, with_bias) -> None:
    x, w, b = _data(dtype, shape, seed=2)
    bias = b if with_bias else None
    out = linear(x, w, bias, backend="w4a16")
    expected = torch.matmul(x.reshape(-1, K), _vllm_weight(w, dtype).T)
    if bias is not None:
        expected = expected + bias
    assert out.dtype == dtype
    assert torch.equal(out, expected.reshape(*shape, N))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["emulation", "w4a16"])
def test_dropped_differs_by_exactly_the_bias(dtype, backend) -> None:
    x, w, b = _data(dtype, (2, 3), seed=3)
    good = linear(x, w, b, backend=backend)
    with pytest.warns(DroppedBiasWarning, match="dropped"):
        dropped = linear(x, w, b, backend=backend, bias_mode="dropped")
    assert torch.equal(good, dropped + b)  # "output" is the dropped result plus bias, in dtype
    assert torch.equal(dropped, linear(x, w, None, backend=backend))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear(x, w, None, backend=backend, bias_mode="dropped")  # no bias, no warning


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["emulation", "w4a16"])
def test_fp32_bias_mode(dtype, backend) -> None:
    x, w, b = _data(dtype, (6,), seed=4)
    out = linear(x, w, b, backend=backend, bias_mode="fp32")
    if backend == "emulation":
        gs = ref_nvfp4.global_scale(x)
        codes, scales = ref_nvfp4.quantize_blocks(x, gs, "kernel")
        a = ref_nvfp4.dequantize_blocks(codes, scales, gs).to(dtype)
        w_dq = _vllm_weight(w, dtype)
    else:
        a = x
        w_dq = _vllm_weight(w, dtype)
    expected = (torch.matmul(a.float(), w_dq.float().T) + b.float()).to(dtype)
    assert torch.equal(out, expected)
    if dtype == torch.float32:  # one rounding either way in fp32
        assert torch.equal(out, linear(x, w, b, backend=backend))


def test_bias_in_output_dtype_is_not_fp32() -> None:
    """In bf16, adding the bias after rounding differs from a fused fp32 epilogue somewhere."""
    x, w, b = _data(torch.bfloat16, (64,), seed=5)
    out = linear(x, w, b * 37, backend="w4a16")
    fused = linear(x, w, b * 37, backend="w4a16", bias_mode="fp32")
    assert not torch.equal(out, fused)


def test_auto_follows_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, b = _data(torch.float32, (4,), seed=6)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.delenv(BATCH_INVARIANT_ENV, raising=False)
    assert torch.equal(linear(x, w, b), linear(x, w, b, backend="w4a16"))  # CPU: no FP4
    # vLLM 0.33.0 (the default rules) forces its Emulation kernel under VLLM_BATCH_INVARIANT
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    assert torch.equal(linear(x, w, b), linear(x, w, b, backend="emulation"))
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "true")
    with pytest.raises(ValueError, match=BATCH_INVARIANT_ENV):
        linear(x, w, b)


def test_native_raises_off_fp4_devices() -> None:
    x, w, b = _data(torch.bfloat16, (4,))
    with pytest.raises(RuntimeError, match="cpu") as err:
        linear(x, w, b, backend="native")
    assert "capability" in str(err.value)


def test_padded_weight_emulation() -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(8, 40, generator=g)
    x = torch.randn(3, 40, generator=g)
    q = quantize(w, pad=True)
    out = linear(x, q, backend="emulation")
    from nvfp4lab.codec import fake_quantize

    expected = torch.matmul(fake_quantize(x, pad=True), _vllm_weight(q, torch.float32).T)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"backend": "gpu"}, ValueError, "backend"),
        ({"bias_mode": "late"}, ValueError, "bias_mode"),
    ],
)
def test_bad_arguments(kwargs, error, match) -> None:
    x, w, b = _data(torch.float32, (2,))
    with pytest.raises(error, match=match):
        linear(x, w, b, **kwargs)


def test_bad_shapes_and_types() -> None:
    x, w, b = _data(torch.float32, (2,))
    with pytest.raises(ValueError, match="K=32"):
        linear(x[:, :32], w)
    with pytest.raises(ValueError, match="bias"):
        linear(x, w, b[:5])
    with pytest.raises(TypeError, match="float32"):
        linear(x.double(), w)
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        linear(x, torch.zeros(N, K))


# ---------------------------------------------------------------------------------------------
# Native path, by contract (no FP4 GPU here)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "n", "k"), [(5, 24, 64), (130, 32, 48), (1, 16, 32)])
def test_native_args_contract(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(8)
    x = torch.randn(m, k, generator=g)
    w = quantize(torch.randn(n, k, generator=g) * 0.1)
    args = native_scaled_mm_args(x, w)
    kp, np_ = -(-k // 32) * 32, -(-n // 16) * 16
    fp4 = torch.float4_e2m1fn_x2
    assert args.mat_a.dtype == fp4 and args.mat_b.dtype == fp4
    assert args.mat_a.shape == (m, kp // 2) and args.mat_a.stride() == (kp // 2, 1)  # row-major
    assert args.mat_b.shape == (kp // 2, np_) and args.mat_b.stride() == (1, kp // 2)  # col-major
    assert args.scale_a.dtype == args.scale_b.dtype == torch.float8_e4m3fn
    cols = -(-(kp // 16) // 4) * 4
    assert args.scale_a.shape == (-(-m // 128) * 128, cols) and args.scale_a.is_contiguous()
    assert args.scale_b.shape == (-(-np_ // 128) * 128, cols) and args.scale_b.is_contiguous()
    assert args.out_dtype == torch.float32 and args.output_dtype == torch.float32
    # the operands hold exactly the quantized activations and the weight, zero padded
    xq = quantize(x)
    assert torch.equal(args.mat_a.view(torch.uint8)[:, : k // 2], xq.packed)
    assert not args.mat_a.view(torch.uint8)[:, k // 2 :].any()
    w_bytes = args.mat_b.t().view(torch.uint8)
    assert torch.equal(w_bytes[:n, : k // 2], w.packed) and not w_bytes[n:].any()
    plain_a = unswizzle_scales(args.scale_a, m, kp // 16)
    assert torch.equal(plain_a[:, : k // 16].view(torch.uint8), xq.scales.view(torch.uint8))
    plain_b = unswizzle_scales(args.scale_b, np_, kp // 16)
    assert torch.equal(plain_b[:n, : k // 16].view(torch.uint8), w.scales.view(torch.uint8))
    expected_alpha = 1.0 / (xq.global_scale * w.global_scale)
    assert torch.equal(args.alpha, expected_alpha)
    # torch's own size checks for _scaled_mm accept these arguments
    meta = pytest.importorskip("torch._meta_registrations")
    check = getattr(meta, "_check_scaled_mm_sizes", None)
    if check is not None:
        out = check(args.mat_a, args.mat_b, args.scale_a, args.scale_b, out_dtype=torch.float32)
        assert out.shape == (m, np_)


@pytest.mark.parametrize("bias_mode", ["output", "fp32", "dropped"])
@pytest.mark.parametrize("shape", [(7,), (2, 3)])
def test_native_reference_reproduces_emulation(bias_mode: str, shape) -> None:
    """The blockwise-scaled GEMM model on the native arguments equals the emulation result to
    fp32 accumulation tolerance: |native - emulation| <= 1e-5 * (|x_dq| @ |w_dq|^T) + 1e-6.
    (Differences come only from fp32 rounding of s/gs in the emulation's dequantization and the
    summation order; measured: max ratio 3.0e-7 over 60 random cases.)"""
    x, w, b = _data(torch.float32, shape, seed=9)
    args = native_scaled_mm_args(x, w, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedBiasWarning)
        native = linear_mod._finish_native(reference_scaled_mm(args), args, bias_mode)
        emu = linear(x, w, b, backend="emulation", bias_mode=bias_mode).reshape(-1, N)
    from nvfp4lab.codec import fake_quantize

    x_dq = fake_quantize(x.reshape(-1, K))
    bound = 1e-5 * torch.matmul(x_dq.abs(), w.dequantize().abs().T) + 1e-6
    assert native.shape == emu.shape
    assert bool(((native - emu).abs() <= bound).all())


def test_native_wiring_with_a_fake_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the device has FP4: linear(backend="native") must call torch._scaled_mm with the
    contract arguments and apply alpha, the rounding and the bias after it."""
    calls = []

    def fake_scaled_mm(mat_a, mat_b, scale_a, scale_b, *, out_dtype):
        calls.append((mat_a, mat_b, scale_a, scale_b, out_dtype))
        args = linear_mod.ScaledMMArgs(
            mat_a, mat_b, scale_a, scale_b, torch.ones(1), None, 0, 0, 0, out_dtype
        )
        return reference_scaled_mm(args)

    monkeypatch.setattr(linear_mod, "native_fp4_status", lambda device: (True, "fake FP4"))
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    x, w, b = _data(torch.bfloat16, (2, 3), seed=10)
    out = linear(x, w, b, backend="native")
    assert len(calls) == 1 and calls[0][4] == torch.float32
    assert out.shape == (2, 3, N) and out.dtype == torch.bfloat16
    args = native_scaled_mm_args(x, w, b)
    raw = reference_scaled_mm(args)
    expected = ((raw * args.alpha)[:, :N].to(torch.bfloat16) + b).reshape(2, 3, N)
    assert torch.equal(out, expected)
    # bf16 activations: native and emulation agree to bf16 rounding of the operands
    emu = linear(x, w, b, backend="emulation")
    scale = torch.matmul(x.float().abs().reshape(-1, K), w.dequantize(torch.float32).abs().T)
    scale = scale.reshape(2, 3, N)
    assert bool(((out.float() - emu.float()).abs() <= 2e-2 * scale + 1e-2).all())


def test_bad_input_global_scale_is_refused_on_every_backend() -> None:
    w = quantize(torch.randn(16, 32))
    x = torch.randn(2, 32)
    for backend in ("emulation", "w4a16"):
        with pytest.raises(ValueError, match="finite and > 0"):
            linear_mod.linear(x, w, input_global_scale=-5.0, backend=backend)


def test_vllm_dequantize_uses_an_exact_decode_scale() -> None:
    """A weight carrying its DECODE scale (ModelOpt's weight_scale_2) is decoded with it, as
    vLLM does for ModelOpt checkpoints; without one, with the reciprocal of the ENCODE scale."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=g, dtype=torch.bfloat16)
    mo = quantize(w, convention="modelopt")
    assert mo.decode_scale is not None
    assert torch.equal(linear_mod.vllm_dequantize(mo, torch.float32), mo.dequantize(torch.float32))
    ct = quantize(w)
    decode = torch.reciprocal(ct.global_scale)
    codes = unpack_fp4(ct.packed).reshape(N, K // 16, 16)
    expected = ref_numbers.decode_e2m1_code  # value * (s * decode) element by element
    manual = torch.tensor(
        [[expected(int(c)) for c in row] for row in codes.reshape(N, K)], dtype=torch.float32
    ).reshape(N, K // 16, 16) * (ct.scales.float() * decode).unsqueeze(-1)
    assert torch.equal(linear_mod.vllm_dequantize(ct, torch.float32), manual.reshape(N, K))


def test_native_forced_by_the_environment_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """issue 19: NVFP4LAB_BACKEND=native off an FP4 GPU: the error names the variable, its value
    and how to undo it, not only backend='auto' (which the variable overrides)."""
    from nvfp4lab.execution import NVFP4Linear
    from nvfp4lab.execution.dispatch import native_fp4_status

    if native_fp4_status(torch.device("cpu"))[0]:  # pragma: no cover - never on a CPU
        pytest.skip("native FP4 works here")
    monkeypatch.setenv("NVFP4LAB_BACKEND", "native")
    layer = NVFP4Linear.from_linear(torch.nn.Linear(64, 32))
    with pytest.raises(RuntimeError, match=r"environment variable NVFP4LAB_BACKEND='native' "
                       r"forces it.*unset NVFP4LAB_BACKEND or set it to auto"):
        layer(torch.randn(4, 64))
