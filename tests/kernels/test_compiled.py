"""The compiled graphs bit for bit against the eager pipeline, their arithmetic against torch's own
float8 conversion and the eager E2M1 rounding, compilation (no recompiles, scoped options), the
``NVFP4LAB_FUSED`` policy and the eager fallback without a compiler.

Every test here runs as on a CPU without nvfp4lab's native library (``graphs_only``): there, and
on CUDA, the fused calls run the graphs (the C++ kernels have their own tests).

``bits`` comparisons distinguish -0.0 from 0.0; tensors come from seeded generators.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from nvfp4lab import kernels
from nvfp4lab.codec import dequantize, fake_quantize, quantize
from nvfp4lab.e2m1 import round_to_e2m1_codes
from nvfp4lab.kernels import compiled as fused
from nvfp4lab.kernels import graphs, native
from nvfp4lab.kernels import quantize as fused_quantize
from nvfp4lab.settings import FUSED_ENV, fused_mode
from nvfp4lab.tensor import NVFP4Tensor
from nvfp4lab.vocab import FusedMode
from tests.test_e2m1 import _fp32_sample

# A string condition: evaluated when a test of this file sets up, not while every worker collects
# (the probe compiles a graph: seconds of inductor start-up).
pytestmark = pytest.mark.skipif(
    'not kernels.compiler_available("cpu")', reason="torch.compile does not work here"
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def graphs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native library made unavailable: fused calls run the compiled graphs."""
    monkeypatch.setattr(native, "available", lambda: False)
CONVENTIONS = ("kernel", "compressed-tensors")
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def randn(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def assert_same(x: torch.Tensor, gs: torch.Tensor | float | None, convention: str) -> None:
    """quantize, fake_quantize and dequantize (both decode orders, every dtype) agree."""
    want = quantize(x, gs, convention=convention, fused=False)
    got = quantize(x, gs, convention=convention, fused=True)
    assert got == want  # packed bytes, scale bytes, global scale, shape, dtype
    fq = fake_quantize(x, gs, convention=convention, fused=True)
    assert fq.dtype == x.dtype and fq.shape == x.shape
    assert torch.equal(bits(fq), bits(fake_quantize(x, gs, convention=convention, fused=False)))
    as_vllm = NVFP4Tensor(
        want.packed, want.scales, want.global_scale, shape=want.shape,
        decode_scale=torch.reciprocal(want.global_scale),
    )
    for q in (want, as_vllm):
        for dtype in DTYPES:
            expected = dequantize(q, dtype, fused=False)
            assert torch.equal(bits(dequantize(q, dtype, fused=True)), bits(expected)), dtype


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
class TestEqualsEager:
    def test_shapes_and_magnitudes(self, dtype: torch.dtype, convention: str) -> None:
        for i, shape in enumerate([(32,), (3, 48), (2, 5, 64), (257, 512), (64, 4096)]):
            assert_same(randn(shape, dtype, seed=i) * (10.0 ** (i - 2)), None, convention)

    def test_heavy_tails_and_outliers(self, dtype: torch.dtype, convention: str) -> None:
        x = randn((128, 256), dtype, seed=7)
        x = x * torch.exp(2 * randn((128, 256), torch.float32, seed=8)).to(dtype)
        x[5, 17] = 3000.0
        assert_same(x, None, convention)

    def test_zero_blocks_and_negative_zero(self, dtype: torch.dtype, convention: str) -> None:
        x = randn((8, 64), dtype, seed=1)
        x[0] = 0.0
        x[1, :16] = -0.0
        x[2, 16:32] = torch.tensor([0.0, -0.0] * 8, dtype=dtype)
        x[3, ::2] = -0.0
        assert_same(x, None, convention)
        assert_same(torch.zeros(4, 32, dtype=dtype), None, convention)
        assert_same(torch.full((4, 32), -0.0, dtype=dtype), None, convention)

    def test_exact_ties(self, dtype: torch.dtype, convention: str) -> None:
        ties = torch.tensor(TIES)  # gs = 1 and block amax 6: scale 1, x·gs/s == x
        row = torch.cat([torch.tensor([6.0]), ties, -ties, torch.tensor([-6.0])])
        x = torch.stack([row, row.flip(0), row * 0.5, row * 2, -row]).to(dtype)
        for gs in (1.0, 2.0, 0.5):
            assert_same(x, gs, convention)
        eps = torch.tensor([0.0, 2**-10, -(2**-10)])
        near = (torch.tensor([0.25, 0.75, 1.75, 2.0, 3.5, 4.0, 5.0])[:, None] + eps).flatten()
        x = torch.cat([torch.tensor([6.0]), near[:15]]).repeat(3, 1)
        x[1, 1:], x[2, 1:] = near[6:21], -near[6:21]
        assert_same(x.to(dtype), 1.0, convention)

    def test_saturation(self, dtype: torch.dtype, convention: str) -> None:
        x = randn((16, 64), dtype, seed=3) * 1000  # scales clamp at 448, codes at +-6
        assert_same(x, 1.0, convention)
        x[0, 0] = 60000.0
        assert_same(x, 1.0, convention)

    def test_subnormal_and_zero_block_scales(self, dtype: torch.dtype, convention: str) -> None:
        x = randn((64, 64), dtype, seed=4)
        x[0] *= 1000  # sets the global scale
        for r, f in enumerate([1e-2, 1e-3, 1e-4, 1e-5, 3e-6, 1e-7], start=1):
            x[r] = (x[r].float() * f).to(dtype)
        assert_same(x, None, convention)

    @pytest.mark.filterwarnings("ignore::nvfp4lab.codec.ScaleUnderflowWarning")
    def test_global_scales(self, dtype: torch.dtype, convention: str) -> None:
        x = randn((32, 64), dtype, seed=5)
        for gs in (2.0**100, 2.0**60, 1e6, 3.7, 1e-3, 1e-20, 2.0**-100):
            assert_same(x, gs, convention)
        assert_same(x, torch.tensor([123.456]), convention)
        if dtype != torch.float16:
            assert_same(x * 1e30, None, convention)
        assert_same((x.float() * 1e-6).to(dtype), None, convention)
        assert_same(torch.full((2, 16), torch.finfo(dtype).tiny, dtype=dtype), None, convention)
        if dtype == torch.float16:  # compressed-tensors: 2688/amax overflows fp16 -> gs = 1
            assert_same(torch.full((2, 16), 0.01, dtype=dtype), None, convention)

    def test_every_scale_byte_decodes_alike(self, dtype: torch.dtype, convention: str) -> None:
        g = torch.Generator().manual_seed(11)
        packed = torch.randint(0, 256, (32, 64), generator=g, dtype=torch.uint8)
        scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(32, 8)
        for decode_scale in (None, torch.tensor([0.37])):  # divide and multiply orders
            q = NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), torch.tensor([2.7]),
                            check_scales=False, decode_scale=decode_scale)
            want = q.dequantize(dtype, fused=False)
            nan = torch.isnan(want)  # 0x7F/0xFF: NaN payload bits are not compared
            got = q.dequantize(dtype, fused=True)
            assert torch.equal(torch.isnan(got), nan)
            assert torch.equal(bits(got[~nan]), bits(want[~nan]))


def test_non_contiguous_offset_and_grad_inputs() -> None:
    base = randn((64, 96), torch.bfloat16, seed=9)
    for x in (base[:, 16:80], base.t().contiguous()[:, :64], base[3:40]):
        assert_same(x, None, "kernel")
    x = randn((8, 64), torch.float32).requires_grad_()
    y = fake_quantize(x, fused=True)  # a straight-through estimator (issue 19 case 10)
    assert y.requires_grad and torch.equal(y.detach(), fake_quantize(x.detach(), fused=True))


def test_nonfinite_raises_the_eager_error() -> None:
    x = randn((4, 32), torch.float32)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"1 NaN/Inf value\(s\), first at index \(1, 3\)"):
        quantize(x, fused=True)
    x[1, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN/Inf"):
        fake_quantize(x, 1.0, fused=True)
    with pytest.raises(ValueError, match="2\\*\\*116"):
        quantize(randn((4, 32), torch.float32), 2.0**117, fused=True)


def test_e4m3_rounding_equals_float8_cast() -> None:
    """round_e4m3 (compiled) equals ``.to(float8_e4m3fn)`` on every E4M3 midpoint and grid
    point +- 64 ulps and 2**20 random floats in [0, 448]; decode_e4m3 on all 256 bytes."""
    grid = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    grid = grid.float()
    anchors = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    offsets = torch.arange(-64, 65, dtype=torch.int32)
    around = (anchors.view(torch.int32)[:, None] + offsets).clamp(min=0).view(torch.float32)
    g = torch.Generator().manual_seed(3)
    p = torch.cat([around.flatten(), torch.rand(1 << 20, generator=g) * 448]).clamp(0, 448)
    value, byte = torch.compile(graphs.round_e4m3, dynamic=True, fullgraph=True)(p)
    want = p.to(torch.float8_e4m3fn)
    assert torch.equal(byte.to(torch.uint8), want.view(torch.uint8))
    assert torch.equal(bits(value), bits(want.float()))
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = torch.compile(graphs.decode_e4m3, dynamic=True, fullgraph=True)(every)
    expected = every.view(torch.float8_e4m3fn).float()
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan) and torch.equal(bits(got[~nan]), bits(expected[~nan]))


def test_e2m1_rounding_equals_eager() -> None:
    """e2m1_round (compiled) equals round_to_e2m1_codes and the value table on the float32
    sample of tests/test_e2m1.py (random bits, the rounding range, every tie +- 300 ulps)."""
    a = _fp32_sample().abs().clamp(max=6.0)
    index, value = torch.compile(graphs.e2m1_round, dynamic=True, fullgraph=True)(a)
    want = round_to_e2m1_codes(a)
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert torch.equal(index.to(torch.uint8), want)
    assert torch.equal(value, table[want.long()])


def test_new_shapes_do_not_recompile() -> None:
    from torch._dynamo.utils import counters

    x = randn((8, 64), torch.bfloat16)
    q = quantize(x, fused=True)
    fake_quantize(x, fused=True)
    q.dequantize(fused=True)
    before = counters["stats"]["unique_graphs"]
    for shape in [(3, 32), (17, 160), (5, 7, 48), (1000, 64), (2, 4096), (1, 32)]:
        x = randn(shape, torch.bfloat16)
        quantize(x, fused=True).dequantize(fused=True)
        fake_quantize(x, fused=True)
    assert counters["stats"]["unique_graphs"] == before, "a new shape compiled a new graph"


def test_chunks_are_balanced_and_never_single_blocks() -> None:
    for total, most in [(2**20 + 1, 2**20), (7, 3), (10, 3), (5, 5), (2, 100)]:
        parts = list(fused.balanced(total, most))
        assert parts[0].start == 0 and parts[-1].stop == total
        assert all(a.stop == b.start for a, b in itertools.pairwise(parts))
        assert all(2 <= p.stop - p.start <= most for p in parts)


def test_inductor_options_stay_scoped() -> None:
    """Options go to each compiled function; the global inductor config is untouched."""
    import torch._inductor.config as inductor_config

    before = (inductor_config.cpp.simdlen, inductor_config.emulate_precision_casts)
    quantize(randn((4, 64), torch.float16), fused=True)
    assert (inductor_config.cpp.simdlen, inductor_config.emulate_precision_casts) == before


def test_one_block_and_other_options_stay_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(fused_quantize, "first_pass", lambda *a: calls.append(1))  # not called
    x = randn((1, 16), torch.float32)
    assert quantize(x, fused=True) == quantize(x, fused=False)
    y = randn((16, 32), torch.float32)
    quantize(y, fused=True, convention="modelopt")
    quantize(y, fused=True, scale_selection="four_over_six")
    quantize(y, fused=True, rounding="stochastic", generator=1)
    quantize(y, fused=True, nonfinite="propagate")
    fake_quantize(y, fused=True, hadamard=3)
    fake_quantize(y, fused=True, block_size=(16, 16))
    quantize(y, fused=True, decode_scale=0.5)
    quantize(y[:, :24], fused=True, pad=True)
    quantize(y.to(torch.float64).to(torch.float32).to("meta"), fused=True)
    assert calls == []


def test_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert fused_mode({}) == FusedMode.AUTO and fused_mode({FUSED_ENV: " ON "}) == FusedMode.ON
    with pytest.raises(ValueError, match=r"NVFP4LAB_FUSED value 'yes'.*'auto', 'on', 'off'"):
        fused_mode({FUSED_ENV: "yes"})
    assert kernels.use_fused(1 << 30, cpu, env={FUSED_ENV: "on"})
    assert not kernels.use_fused(1 << 30, cpu, env={FUSED_ENV: "off"})
    assert not kernels.use_fused(1 << 30, cpu, fused=False, env={FUSED_ENV: "on"})
    assert kernels.use_fused(64, cpu, fused=True, env={FUSED_ENV: "off"})
    assert not kernels.use_fused(1 << 30, meta, fused=True)
    monkeypatch.setattr(kernels, "_EAGER_WORK", {})
    monkeypatch.setattr(kernels.cache, "_STARTED", set())  # a process that has not compiled
    monkeypatch.setattr(kernels.cache, "warm", lambda device_type, dtype=None: False)  # cold
    auto = {FUSED_ENV: "auto"}
    assert not kernels.use_fused(kernels.AUTO_MIN_ELEMENTS - 1, cpu, env=auto)
    assert kernels.eager_work("cpu") == 0  # too small to count
    big = kernels.AUTO_WORK_ELEMENTS // 2
    assert not kernels.use_fused(big, cpu, env=auto)
    assert not kernels.use_fused(big, cpu, env=auto)
    assert kernels.eager_work("cpu") == 2 * big
    assert kernels.use_fused(kernels.AUTO_MIN_ELEMENTS, cpu, env=auto)  # paid for: fused now
    assert not kernels.use_fused(kernels.AUTO_MIN_ELEMENTS - 1, cpu, env=auto)


def test_without_a_compiler_the_eager_path_runs_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kernels, "_probe", lambda device_type: "CppCompileError: no g++")
    kernels.compiler_available.cache_clear()
    try:
        x = randn((64, 64), torch.bfloat16)
        with caplog.at_level(logging.WARNING, logger="nvfp4lab.kernels"):
            for _ in range(3):
                assert quantize(x, fused=True) == quantize(x, fused=False)
                assert not kernels.use_fused(1 << 30, torch.device("cpu"), fused=True)
        lines = [r.getMessage() for r in caplog.records if r.name == "nvfp4lab.kernels"]
        assert lines == [
            "nvfp4lab: fused kernels unavailable on cpu (CppCompileError: no g++); "
            "running the eager path"
        ]
    finally:
        kernels.compiler_available.cache_clear()


def test_the_probe_reports_a_failing_compiler_without_raising(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch._inductor.cpp_builder as builder

    def no_compiler() -> str:
        raise RuntimeError("Failed to find a working C++ compiler\ndetails...")

    monkeypatch.setattr(builder, "get_cpp_compiler", no_compiler)
    assert kernels._probe("cpu") == "RuntimeError: Failed to find a working C++ compiler"


def test_grad_modes_do_not_exhaust_the_recompile_limit() -> None:
    """The three dtypes, each with grad on, under no_grad and under inference_mode: nine calls
    that used to be nine dynamo variants of one graph, the ninth raising FailOnRecompileLimitHit;
    each result equals the eager bits."""
    import contextlib

    modes = (contextlib.nullcontext, torch.no_grad, torch.inference_mode)
    for mode in modes:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            with mode():
                x = torch.randn(8, 64, generator=torch.Generator().manual_seed(7)).to(dtype)
                q = quantize(x, fused=True)
                e = quantize(x, fused=False)
                assert torch.equal(q.packed, e.packed), (mode, dtype)
                assert torch.equal(q.scales.view(torch.uint8), e.scales.view(torch.uint8))
