"""The fused linear (weight decoded tile by tile) bit for bit against the eager ``linear`` on
both backends and every bias epilogue, with each tile decoder (the C++ LUT kernel, and the
compiled graph it falls back to), the per-shape exactness check, and the tile bound."""

from __future__ import annotations

import warnings

import pytest
import torch

from nvfp4lab import kernels
from nvfp4lab.codec import quantize
from nvfp4lab.execution.gemm import linear, vllm_dequantize
from nvfp4lab.kernels import linear as klinear
from nvfp4lab.kernels import native
from nvfp4lab.tensor import NVFP4Tensor

pytestmark = pytest.mark.skipif(  # a string: evaluated at setup, not by every collecting worker
    'not native.available() and not kernels.compiler_available("cpu")',
    reason="neither torch.compile nor the C++ LUT decode works here",
)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def randn(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def assert_linear_equal(x: torch.Tensor, w: NVFP4Tensor, bias: torch.Tensor | None,
                        **kwargs: object) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DroppedBiasWarning
        want = linear(x, w, bias, fused=False, **kwargs)  # type: ignore[arg-type]
        for _ in range(2):  # the first call checks the tiles, the second uses the verdict
            got = linear(x, w, bias, fused=True, **kwargs)  # type: ignore[arg-type]
            assert got.shape == want.shape and torch.equal(bits(got), bits(want)), kwargs


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of a few rows, so small weights are decoded in several tiles."""
    monkeypatch.setattr(klinear, "TILE_BYTES", 96 * 2 * 4)
    monkeypatch.setattr(klinear, "LUT_TILE_BYTES", 1)  # 3 rows (the fewest) at any thread count
    monkeypatch.setattr(klinear, "LUT_MIN_ROWS", 3)


@pytest.fixture(params=["lut", "compiled"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The tile decoder: the C++ LUT kernel, or the compiled graph (the LUT kernel made
    unavailable, as on a machine where it cannot be built); skipped where it cannot run."""
    if request.param == "lut" and not native.available():
        pytest.skip("the C++ LUT decode cannot be built here")
    if request.param == "compiled":
        if not kernels.compiler_available("cpu"):
            pytest.skip("torch.compile does not work here")
        monkeypatch.setattr(native, "available", lambda: False)
    return str(request.param)


@pytest.mark.usefixtures("small_tiles", "decoder")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", ["emulation", "w4a16"])
@pytest.mark.parametrize("bias_mode", ["output", "fp32", "dropped"])
def test_fused_linear_equals_eager(dtype: torch.dtype, backend: str, bias_mode: str) -> None:
    w = quantize(randn((200, 96), dtype, 1))
    bias = randn((200,), dtype, 2)
    for shape in [(16, 96), (3, 5, 96), (1, 96), (64, 96)]:
        x = randn(shape, dtype, 3) * 4
        assert_linear_equal(x, w, bias, backend=backend, bias_mode=bias_mode)
    assert_linear_equal(x, w, None, backend=backend, bias_mode=bias_mode,
                        input_global_scale=17.5)


@pytest.mark.usefixtures("small_tiles", "decoder")
def test_decode_orders_follow_the_backend() -> None:
    """emulation decodes value·(s·(1/gs)) (vLLM), w4a16 value·(s/gs) unless the weight carries a
    DECODE scale (then value·(s·d) on both): the fused path picks the same order as eager."""
    x = randn((16, 64), torch.float32, 4)
    base = quantize(randn((150, 64), torch.float32, 5) * 3.3)
    with_decode = NVFP4Tensor(base.packed, base.scales, base.global_scale,
                              decode_scale=torch.reciprocal(base.global_scale) * 1.0000001)
    for w in (base, with_decode):
        for backend in ("emulation", "w4a16"):
            assert_linear_equal(x, w, None, backend=backend)


def test_large_layer_equals_eager() -> None:
    """M = 16, K = N = 4096 in bf16 with the default tiles (the LUT decode's 4 MiB per thread:
    eight tiles at one thread, four at two; the compiled decode's 16 MiB: two)."""
    w = quantize(randn((4096, 4096), torch.bfloat16, 6))
    x = randn((16, 4096), torch.bfloat16, 7)
    assert_linear_equal(x, w, randn((4096,), torch.bfloat16, 8), backend="w4a16")


@pytest.mark.usefixtures("small_tiles")
def test_shape_classes_whose_tiles_differ_run_one_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the tiled product is not the single GEMM's bit for bit (a BLAS that splits K by
    shape), that shape class keeps one GEMM on the whole decoded weight: still exact."""
    monkeypatch.setattr(klinear, "_VERDICTS", {})
    monkeypatch.setattr(klinear, "_same_bits", lambda a, b: False)
    w = quantize(randn((200, 96), torch.bfloat16, 9))
    x = randn((5, 96), torch.bfloat16, 10)
    assert_linear_equal(x, w, None, backend="w4a16")
    assert list(klinear.tiled_verdicts().values()) == [0]


def _spy_decoded_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every decode the linear asks for (whole weights and tiles), in order."""
    decoded_rows: list[int] = []
    real, real_rows = klinear.decode, klinear.row_decoder

    def spy(packed: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        decoded_rows.append(packed.shape[0])
        return real(packed, *args, **kwargs)  # type: ignore[arg-type]

    def spy_rows(w: klinear.EncodedWeight, dtype: torch.dtype) -> object:
        inner = real_rows(w, dtype)

        def rows(start: int, stop: int, out: torch.Tensor) -> None:
            decoded_rows.append(stop - start)
            inner(start, stop, out)

        return rows

    monkeypatch.setattr(klinear, "decode", spy)
    monkeypatch.setattr(klinear, "row_decoder", spy_rows)
    return decoded_rows


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.usefixtures("decoder")
def test_no_full_size_weight_after_the_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the tiles declared exact (which tile height reproduces one GEMM bit for bit is this
    CPU's BLAS's business: the next test takes whatever it finds), the first call decodes the
    whole weight once and checks 3-row tiles; later calls decode 3 rows at a time, nothing more."""
    monkeypatch.setattr(klinear, "_VERDICTS", {})
    monkeypatch.setattr(klinear, "_same_bits", lambda a, b: True)
    decoded_rows = _spy_decoded_rows(monkeypatch)
    w = quantize(randn((200, 96), torch.float32, 11))
    x = randn((4, 96), torch.float32, 12)
    linear(x, w, backend="w4a16", fused=True)  # verifies: one whole decode, then the tiles
    rows = 3  # max(3, TILE_BYTES // (K * 4 bytes)) = max(3, 2)
    assert decoded_rows[0] == 200 and max(decoded_rows[1:]) <= rows
    decoded_rows.clear()
    linear(x, w, backend="w4a16", fused=True)
    assert max(decoded_rows) <= rows and sum(decoded_rows) == 200
    assert list(klinear.tiled_verdicts().values()) == [rows]


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.usefixtures("decoder")
def test_later_calls_decode_at_most_the_verdicts_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """On this CPU's own BLAS: whatever tile height the exactness check settles on (3, 6, 12, ...
    rows, or 0 = none reproduces the single GEMM), later calls decode tiles of at most that
    height, or the whole weight once when it is 0, and the result is the eager linear's bits."""
    monkeypatch.setattr(klinear, "_VERDICTS", {})
    decoded_rows = _spy_decoded_rows(monkeypatch)
    w = quantize(randn((200, 96), torch.float32, 11))
    x = randn((4, 96), torch.float32, 12)
    want = linear(x, w, backend="w4a16", fused=False)
    decoded_rows.clear()
    first = linear(x, w, backend="w4a16", fused=True)
    (verdict,) = klinear.tiled_verdicts().values()
    tried = [3 * 2**i for i in range(7) if 3 * 2**i < 200]
    assert verdict == 0 or verdict in tried
    assert decoded_rows[0] == 200 and max(decoded_rows[1:]) <= (verdict or tried[-1])
    decoded_rows.clear()
    second = linear(x, w, backend="w4a16", fused=True)
    assert sum(decoded_rows) == 200
    assert max(decoded_rows) <= verdict if verdict else decoded_rows == [200]
    assert torch.equal(bits(first), bits(want)) and torch.equal(bits(second), bits(want))


@pytest.mark.usefixtures("small_tiles")
def test_taller_tiles_are_tried_when_the_first_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of 3 rows 'differ' here and 6 rows reproduce the single GEMM (made so: a tile
    product of 6 rows or more IS the single GEMM here, whatever this CPU's BLAS does): 6 is
    kept."""
    monkeypatch.setattr(klinear, "_VERDICTS", {})
    real_tiled, real_whole = klinear._tiled, klinear._whole

    def tiled(a: torch.Tensor, w: klinear.EncodedWeight, fp32: bool, rows: int) -> torch.Tensor:
        if rows == 3:  # a BLAS that splits 3-row problems differently
            return real_tiled(a, w, fp32, rows) + 1
        return real_whole(a, w, fp32)

    monkeypatch.setattr(klinear, "_tiled", tiled)
    w = quantize(randn((200, 96), torch.float32, 15))
    assert_linear_equal(randn((4, 96), torch.float32, 16), w, None, backend="w4a16")
    assert list(klinear.tiled_verdicts().values()) == [6]


def test_cached_dequantized_weight_stays_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    from nvfp4lab.execution import gemm

    monkeypatch.setattr(gemm, "tiled_matmul", lambda *a, **k: pytest.fail("tiled"))
    w = quantize(randn((64, 64), torch.float32, 13))
    x = randn((4, 64), torch.float32, 14)
    cached = vllm_dequantize(w, torch.float32)
    got = linear(x, w, backend="w4a16", dequantized_weight=cached, fused=True)
    assert torch.equal(got, linear(x, w, backend="w4a16", fused=False))


def test_fused_false_keeps_every_step_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """``linear(..., fused=False)`` decodes and fake-quantizes eagerly even where the setting
    says on (the bench's eager rows rely on it)."""
    from nvfp4lab.kernels import compiled as fused_kernels

    monkeypatch.setenv("NVFP4LAB_FUSED", "on")
    w = quantize(randn((64, 64), torch.bfloat16, 17))
    x = randn((8, 64), torch.bfloat16, 18)
    monkeypatch.setattr(fused_kernels, "decode", lambda *a, **k: pytest.fail("fused decode"))
    monkeypatch.setattr(fused_kernels, "block_stats", lambda *a, **k: pytest.fail("fused stats"))
    for backend in ("emulation", "w4a16"):
        linear(x, w, backend=backend, fused=False)
