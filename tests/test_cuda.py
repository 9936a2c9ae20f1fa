"""CUDA checks: skipped on machines without a GPU (CI), run on a lent device.

The CPU results are the oracle: quantization is elementwise IEEE float32 arithmetic plus exact
reductions, so CUDA must agree bit for bit. The fused kernels compiled to Triton (division with
IEEE rounding and no flush to zero, :data:`nvfp4lab.kernels.compiled.GPU_OPTIONS`) must equal the
CPU's eager bits too; the fused linear must equal the eager linear on the same GPU (the same
cuBLAS products). The native FP4 GEMM is checked on FP4 GPUs only.
"""

from __future__ import annotations

import pytest
import torch

from nvfp4lab import kernels
from nvfp4lab.codec import fake_quantize, quantize
from nvfp4lab.execution.dispatch import native_fp4_status, select_backend
from nvfp4lab.execution.gemm import linear, native_scaled_mm_args, reference_scaled_mm
from nvfp4lab.tensor import NVFP4Tensor
from tests.sample_data import KINDS, make

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CONVENTIONS = ["kernel", "compressed-tensors"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("kind", ["normal", "student_t", "outliers", "zero_blocks"])
def test_cuda_quantize_equals_cpu(dtype: torch.dtype, convention: str, kind: str) -> None:
    x = make(kind, (96, 512), dtype, seed=7)
    cpu = quantize(x, convention=convention)
    gpu = quantize(x.cuda(), convention=convention)
    assert torch.equal(gpu.global_scale.cpu(), cpu.global_scale)
    assert torch.equal(gpu.packed.cpu(), cpu.packed)
    assert torch.equal(gpu.scales.cpu().view(torch.uint8), cpu.scales.view(torch.uint8))
    assert torch.equal(gpu.dequantize().cpu(), cpu.dequantize())
    assert torch.equal(fake_quantize(x.cuda(), convention=convention).cpu(), cpu.dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_emulation_operands_equal_cpu(dtype: torch.dtype) -> None:
    """The emulated GEMM's operands are bit-identical; the GEMM itself is cuBLAS vs CPU BLAS."""
    w = quantize(make("normal", (64, 256), torch.float32, seed=1))
    x = make("student_t", (8, 256), dtype, seed=2)
    bias = torch.randn(64).to(dtype)
    cpu = linear(x, w, bias, backend="emulation")
    gpu = linear(x.cuda(), w.to("cuda"), bias.cuda(), backend="emulation")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=tol, atol=tol)


def test_backend_selection_on_this_gpu() -> None:
    choice = select_backend("cuda", env={})
    native, why = native_fp4_status("cuda")
    assert choice.name == ("native" if native else "w4a16"), (choice, why)
    assert choice.reason


@pytest.mark.skipif(
    not torch.cuda.is_available() or not native_fp4_status("cuda")[0],
    reason="needs a GPU with native FP4 (capability >= 10.0)",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_matches_reference_and_emulation(dtype: torch.dtype) -> None:
    w = quantize(make("normal", (96, 256), torch.float32, seed=3)).to("cuda")
    x = make("normal", (40, 256), dtype, seed=4).cuda()
    bias = torch.randn(96, device="cuda").to(dtype)
    args = native_scaled_mm_args(x, w, bias)
    raw = torch._scaled_mm(args.mat_a, args.mat_b, **args.scaled_mm_kwargs())
    expected = reference_scaled_mm(args)
    # fp32 tensor-core accumulation vs the exact sum rounded once
    atol = 1e-5 * float(expected.abs().max())
    torch.testing.assert_close(raw.float(), expected, rtol=1e-5, atol=atol)
    native = linear(x, w, bias, backend="native")
    emulated = linear(x, w, bias, backend="emulation")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(native, emulated, rtol=tol, atol=tol)


# -- fused kernels (Triton) --------------------------------------------------------------------

needs_fused = pytest.mark.skipif(
    not torch.cuda.is_available() or not kernels.compiler_available("cuda"),
    reason="needs torch.compile with Triton on CUDA",
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@needs_fused
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("gs", [None, 1.2345678, 0.01])  # auto, calibrated, E4M3-subnormal scales
@pytest.mark.filterwarnings("ignore::nvfp4lab.codec.ScaleUnderflowWarning")
def test_fused_cuda_equals_cpu_eager(
    dtype: torch.dtype, convention: str, kind: str, gs: float | None
) -> None:
    x = make(kind, (96, 512), dtype, seed=11)
    cpu = quantize(x, gs, convention=convention, fused=False)
    gpu = quantize(x.cuda(), gs, convention=convention, fused=True)
    assert gpu.to("cpu") == cpu  # packed bytes, scale bytes, global scale
    fq = fake_quantize(x.cuda(), gs, convention=convention, fused=True)
    assert torch.equal(_bits(fq), _bits(fake_quantize(x, gs, convention=convention, fused=False)))
    vllm = NVFP4Tensor(cpu.packed, cpu.scales, cpu.global_scale, shape=cpu.shape,
                       decode_scale=torch.reciprocal(cpu.global_scale))
    for q in (cpu, vllm):  # both decode orders, every output dtype
        for out in DTYPES:
            got = q.to("cuda").dequantize(out, fused=True)
            assert torch.equal(_bits(got), _bits(q.dequantize(out, fused=False))), out


@needs_fused
@pytest.mark.parametrize("backend", ["emulation", "w4a16"])
@pytest.mark.parametrize("bias_mode", ["output", "fp32"])
@pytest.mark.parametrize(("m", "n", "k"), [(16, 4096, 4096), (256, 6144, 1024), (3, 100, 48)])
def test_fused_linear_equals_eager_on_cuda(
    backend: str, bias_mode: str, m: int, n: int, k: int
) -> None:
    w = quantize(make("normal", (n, k), torch.bfloat16, seed=5)).to("cuda")
    x = make("student_t", (m, k), torch.bfloat16, seed=6).cuda()
    bias = torch.randn(n).to(torch.bfloat16).cuda()
    want = linear(x, w, bias, backend=backend, bias_mode=bias_mode, fused=False)
    for _ in range(2):  # the first call checks the tiles, the second uses the verdict
        got = linear(x, w, bias, backend=backend, bias_mode=bias_mode, fused=True)
        assert torch.equal(_bits(got), _bits(want))
