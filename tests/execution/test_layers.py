"""NVFP4Linear: compressed-tensors buffer names, forward on each backend, casts, cache, rotated
layers (the weight of W·Q, inputs rotated at run time)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nvfp4lab.codec import quantize
from nvfp4lab.execution import (
    NVFP4Linear,
)
from nvfp4lab.execution.dispatch import BACKEND_ENV
from nvfp4lab.execution.gemm import linear
from nvfp4lab.hadamard import hadamard_transform, rotation_matrix
from nvfp4lab.settings import BATCH_INVARIANT_ENV
from nvfp4lab.tensor import NVFP4Tensor, RotatedNVFP4Tensor

BACKENDS = ["emulation", "w4a16"]


def _linear(k: int = 64, n: int = 32, bias: bool = True, dtype=torch.float32, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(dtype)


def test_buffers_follow_compressed_tensors_names() -> None:
    layer = NVFP4Linear(64, 32)
    sd = layer.state_dict()
    assert set(sd) == {"weight_packed", "weight_scale", "weight_global_scale", "bias"}
    assert sd["weight_packed"].dtype == torch.uint8 and sd["weight_packed"].shape == (32, 32)
    assert sd["weight_scale"].dtype == torch.float8_e4m3fn and sd["weight_scale"].shape == (32, 4)
    gs = sd["weight_global_scale"]
    assert gs.dtype == torch.float32 and gs.shape == (1,)
    assert sd["bias"].dtype == torch.bfloat16
    layer.set_input_global_scale(12.5)
    assert layer.state_dict()["input_global_scale"].dtype == torch.float32
    assert NVFP4Linear(64, 32, bias=False).bias is None


@pytest.mark.parametrize("k", [0, 8, 20, 40])
def test_k_must_be_multiple_of_16(k: int) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4Linear(k, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [True, False])
def test_from_linear_forward_is_linear(dtype, backend, bias) -> None:
    lin = _linear(bias=bias, dtype=dtype)
    layer = NVFP4Linear.from_linear(lin, backend=backend)
    assert layer.dtype == dtype
    q = quantize(lin.weight.detach())
    w = layer.weight_nvfp4()
    assert torch.equal(w.packed, q.packed) and torch.equal(w.global_scale, q.global_scale)
    assert w.packed.data_ptr() == layer.weight_packed.data_ptr()  # a view, no copy
    for shape in [(64,), (5, 64), (2, 3, 64)]:
        x = torch.randn(*shape).to(dtype)
        out = layer(x)
        assert out.shape == (*shape[:-1], 32) and out.dtype == dtype
        assert torch.equal(out, linear(x, q, lin.bias, backend=backend))


def test_static_input_scale_and_compressed_tensors_convention() -> None:
    lin = _linear(dtype=torch.bfloat16)
    layer = NVFP4Linear.from_linear(
        lin, backend="emulation", input_global_scale=100.0, convention="compressed-tensors"
    )
    q = quantize(lin.weight.detach(), convention="compressed-tensors")
    assert torch.equal(layer.weight_packed, q.packed)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    expected = linear(x, q, lin.bias, input_global_scale=100.0, backend="emulation")
    assert torch.equal(layer(x), expected)
    assert "input_global_scale=100" in repr(layer)


def test_from_quantized() -> None:
    w = torch.randn(16, 32)
    q = quantize(w)
    bias = torch.randn(16, dtype=torch.float16)
    layer = NVFP4Linear.from_quantized(q, bias, input_global_scale=torch.tensor([50.0]))
    assert layer.dtype == torch.float16 and torch.equal(layer.bias, bias)
    assert float(layer.input_global_scale) == 50.0
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4Linear.from_quantized(quantize(torch.randn(4, 40), pad=True))


def test_load_compressed_tensors_state_dict() -> None:
    """A checkpoint's per-layer tensors (same names) load with load_state_dict."""
    lin = _linear(dtype=torch.bfloat16, seed=1)
    q = quantize(lin.weight.detach(), convention="compressed-tensors")
    ckpt = {
        "weight_packed": q.packed.clone(),
        "weight_scale": q.scales.clone(),
        "weight_global_scale": q.global_scale.clone(),
        "input_global_scale": torch.tensor([321.0]),
        "bias": lin.bias.detach().clone(),
    }
    layer = NVFP4Linear(64, 32, backend="emulation")
    layer.load_state_dict(ckpt)  # strict: no missing/unexpected keys
    assert float(layer.input_global_scale) == 321.0
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    expected = linear(x, q, lin.bias, input_global_scale=321.0, backend="emulation")
    assert torch.equal(layer(x), expected)
    # a weight-only (NVFP4A16) state dict has no input_global_scale: into a calibrated layer it
    # is a missing key like any other (issue 10: it used to be dropped silently)
    del ckpt["input_global_scale"]
    with pytest.raises(RuntimeError, match=r"Missing key.*input_global_scale"):
        layer.load_state_dict(ckpt)
    # into a dynamic layer it loads, and the layer stays dynamic
    layer.set_input_global_scale(None)
    layer.load_state_dict(ckpt)
    assert layer.input_global_scale is None
    assert torch.equal(layer(x), linear(x, q, lin.bias, backend="emulation"))


@pytest.mark.parametrize("backend", ["w4a16", "emulation"])
def test_cache_dequantized(backend: str) -> None:
    """The cache holds the weight exactly as the uncached path decodes it (vLLM's order; in
    float32 ``weight.dequantize`` differs by an ulp in some blocks and the outputs would too)."""
    lin = _linear(seed=2)
    cached = NVFP4Linear.from_linear(lin, backend=backend, cache_dequantized=True)
    plain = NVFP4Linear.from_linear(lin, backend=backend)
    x = torch.randn(4, 64)
    assert torch.equal(cached(x), plain(x))
    assert len(cached._dq_cache) == 1
    cached(x)
    assert len(cached._dq_cache) == 1
    # a weight change invalidates the cache
    other = NVFP4Linear.from_linear(_linear(seed=3), backend=backend)
    cached.load_state_dict(other.state_dict())
    assert torch.equal(cached(x), other(x))
    assert "_dq_cache" not in str(list(cached.state_dict()))


def test_auto_backend_resolved_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    lin = _linear(seed=4)
    layer = NVFP4Linear.from_linear(lin)
    x = torch.randn(4, 64)
    q = layer.weight_nvfp4()
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.delenv(BATCH_INVARIANT_ENV, raising=False)
    assert torch.equal(layer(x), linear(x, q, lin.bias, backend="w4a16"))
    assert "w4a16" in repr(layer) and "no FP4 tensor cores" in repr(layer)
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")  # vLLM 0.33.0 forces Emulation
    assert torch.equal(layer(x), linear(x, q, lin.bias, backend="emulation"))
    assert "emulation" in repr(layer)
    choice = layer.backend_choice(env={})
    assert choice is not None and choice.name == "w4a16"
    pinned = NVFP4Linear.from_linear(lin, backend="w4a16")
    assert pinned.backend_choice() is None
    assert torch.equal(pinned(x), linear(x, q, lin.bias, backend="w4a16"))  # env ignored
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "yes")
    assert "cannot resolve" in repr(layer)


def test_dtype_casts_keep_quantized_buffers() -> None:
    lin = _linear(seed=5)
    layer = NVFP4Linear.from_linear(lin, backend="emulation", input_global_scale=1234.5678)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    nn.Sequential(layer).to(torch.bfloat16)  # as model.to(dtype) after quantize_model
    after = layer.state_dict()
    assert list(after) == list(before)
    for name in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"):
        assert after[name].dtype == before[name].dtype
        assert torch.equal(after[name].view(torch.uint8), before[name].view(torch.uint8))
    assert layer.dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    assert layer.weight_nvfp4().dtype == torch.bfloat16
    layer.half()
    assert layer.dtype == torch.float16 and layer.weight_global_scale.dtype == torch.float32
    no_bias = NVFP4Linear(32, 16, bias=False).float()
    assert no_bias.dtype == torch.float32 and no_bias.input_global_scale is None
    x = torch.randn(3, 64, dtype=torch.float16)
    expected = linear(x, layer.weight_nvfp4(), layer.bias, input_global_scale=1234.5678,
                      backend="emulation")
    assert torch.equal(layer(x), expected)


def test_native_layer_raises_on_cpu() -> None:
    layer = NVFP4Linear.from_linear(_linear(), backend="native")
    with pytest.raises(RuntimeError, match="cpu"):
        layer(torch.randn(2, 64))


def test_bias_mode_dropped_layer_warns() -> None:
    layer = NVFP4Linear.from_linear(_linear(), backend="w4a16", bias_mode="dropped")
    with pytest.warns(UserWarning, match="dropped"):
        layer(torch.randn(2, 64))


# -- rotated layers (MR-GPTQ) ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rotated_layer_is_the_dense_oracle(dtype: torch.dtype, backend: str) -> None:
    """A layer holding NVFP4(W Q) multiplies x Q by it: equal to linear() on the rotated input,
    and (w4a16) to the dense oracle ``x @ (dequant(NVFP4(W Q)) Qᵀ)ᵀ + b`` up to float rounding."""
    lin = _linear(dtype=dtype)
    layer = NVFP4Linear.from_linear(lin, backend=backend, hadamard=3)
    q = quantize(lin.weight.detach(), hadamard=3)
    assert isinstance(q, RotatedNVFP4Tensor) and layer.hadamard == 3
    assert torch.equal(layer.weight_packed, q.packed)
    assert torch.equal(layer.weight_scale.view(torch.uint8), q.scales.view(torch.uint8))
    assert torch.equal(layer.weight_global_scale, q.global_scale)
    assert isinstance(layer.weight_nvfp4(), RotatedNVFP4Tensor)
    assert layer.weight_nvfp4() == q and "hadamard=3" in repr(layer)
    plain = NVFP4Tensor(q.packed, q.scales, q.global_scale, shape=q.shape, dtype=q.dtype)
    x = torch.randn(2, 5, 64).to(dtype)
    out = layer(x)
    assert torch.equal(out, linear(hadamard_transform(x, 3), plain, lin.bias, backend=backend))
    assert torch.equal(layer.rotate_input(x), hadamard_transform(x, 3))
    if backend == "w4a16":
        rot = rotation_matrix(64, 3, dtype=torch.float64)
        w_hat = q.dequantize_rotated(torch.float32).double() @ rot.T  # ≈ W
        dense = x.double() @ w_hat.T + lin.bias.double()
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.02,
                                                                           "atol": 0.02}
        torch.testing.assert_close(out.double(), dense, **tol)


def test_rotated_layer_from_quantized_and_bad_seed() -> None:
    w = torch.randn(16, 32)
    layer = NVFP4Linear.from_quantized(quantize(w, hadamard=0))
    assert layer.hadamard == 0 and layer.weight_nvfp4().hadamard == 0
    assert NVFP4Linear.from_quantized(quantize(w)).hadamard is None
    with pytest.raises(ValueError, match="non-negative integer seed"):
        NVFP4Linear(32, 16, hadamard=-1)
    with pytest.raises(ValueError, match="non-negative integer seed"):
        NVFP4Linear.from_linear(nn.Linear(32, 16), hadamard=1.5)  # type: ignore[arg-type]
