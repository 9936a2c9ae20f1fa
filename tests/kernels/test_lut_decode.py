"""The C++ LUT decode bit for bit against the eager decode (``tensor.decode_blocks``): every code
byte with every E4M3 scale byte, every output dtype, both decode rules, every gather path this
CPU has; threads, tails and row ranges; and the one-line fallback when it cannot be built."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from nvfp4lab import kernels
from nvfp4lab.codec import quantize
from nvfp4lab.e2m1 import unpack_fp4
from nvfp4lab.kernels import lut_decode, native
from nvfp4lab.orders import DecodeRule
from nvfp4lab.tensor import decode_blocks
from nvfp4lab.vocab import SUPPORTED_DTYPES

needs_lut = pytest.mark.skipif(
    not native.available(), reason="the native C++ library cannot be built here"
)

#: Tensor scales: plain, a real weight's, tiny and huge ones (products that underflow to
#: subnormals / zero and overflow bf16 / fp16 / fp32), and 1/448.
TENSOR_SCALES = (1.0, 0.37, 2688 / 4.2, 3.1e-5, 1e-30, 1e30, 7.0e4, 1 / 448)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def eager(
    packed: torch.Tensor,
    scales: torch.Tensor,
    t: torch.Tensor,
    rule: DecodeRule,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The eager decode, as ``NVFP4Tensor.dequantize`` runs it (float32, then ``dtype``)."""
    codes = unpack_fp4(packed).reshape(*scales.shape, 16)
    exact = t if rule is DecodeRule.SCALE_TIMES_DECODE else None
    values = decode_blocks(codes, scales.view(torch.float8_e4m3fn), t, exact)
    return values.to(dtype).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit; NaN payloads (scale bytes 0x7F / 0xFF) are not compared, their places are."""
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(bits(got[~nan]), bits(want[~nan]))


def gather_paths() -> list[str]:
    """The gather paths this CPU runs (the library clamps a wider one to its best)."""
    best = lut_decode.ISAS.index(lut_decode.isa()) if native.available() else 0
    return list(lut_decode.ISAS[: best + 1])


@needs_lut
@pytest.mark.parametrize("rule", list(DecodeRule), ids=lambda r: r.name.lower())
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_every_byte_with_every_scale(dtype: torch.dtype, rule: DecodeRule) -> None:
    """Row s holds the 256 code bytes (both nibbles of every code) in blocks of scale byte s."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # [256, 256]: K = 512
    scales = torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, 32)
    for value in TENSOR_SCALES:
        t = torch.tensor([value], dtype=torch.float32)
        want = eager(packed, scales, t, rule, dtype)
        for path in gather_paths():
            got = lut_decode.decode(
                packed, scales.view(torch.float8_e4m3fn), t, dtype, rule=rule, path=path, threads=1
            )
            assert_same(got, want)


@needs_lut
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_mixed_scales_threads_and_tails(dtype: torch.dtype) -> None:
    """Random bytes and scales per block (neighbouring blocks differ, as the vector loops read
    two at a time), odd block counts (tails), 1-3 threads over the parallel threshold."""
    g = torch.Generator().manual_seed(0)
    for blocks in (1, 3, 4097, 8195):
        packed = torch.randint(0, 256, (blocks, 8), dtype=torch.uint8, generator=g)
        scales = torch.randint(0, 256, (blocks, 1), dtype=torch.uint8, generator=g)
        t = torch.tensor([0.013], dtype=torch.float32)
        for rule in DecodeRule:
            want = eager(packed, scales, t, rule, dtype)
            for threads in (1, 2, 3):
                for path in gather_paths():
                    got = lut_decode.decode(
                        packed, scales, t, dtype, rule=rule, path=path, threads=threads
                    )
                    assert_same(got, want)


@needs_lut
def test_row_decoder_rows_and_views() -> None:
    """``RowDecoder`` decodes any row range into a buffer; non-contiguous inputs and a given
    ``out`` work with ``decode``; an empty tensor decodes to an empty one."""
    w = quantize(torch.randn(40, 96, generator=torch.Generator().manual_seed(1)))
    t = torch.reciprocal(w.global_scale)
    rule = DecodeRule.SCALE_TIMES_DECODE
    whole = eager(w.packed, w.scales.view(torch.uint8), t, rule, torch.bfloat16)
    rows = lut_decode.RowDecoder(w.packed, w.scales, t, torch.bfloat16, rule=rule)
    buf = torch.full((16, 96), float("nan"), dtype=torch.bfloat16)
    for start, stop in ((0, 16), (16, 29), (29, 40), (7, 8)):
        rows(start, stop, buf)
        assert_same(buf[: stop - start], whole[start:stop])
    wide = torch.cat([w.packed, w.packed], dim=1)[:, ::2]  # a non-contiguous view
    out = torch.empty(40, 96, dtype=torch.float16)
    got = lut_decode.decode(wide, w.scales, t, torch.float16, rule=rule, out=out)
    assert got is out
    assert_same(got, eager(wide.contiguous(), w.scales.view(torch.uint8), t, rule, torch.float16))
    empty = lut_decode.decode(w.packed[:0], w.scales[:0], t, torch.float32, rule=rule)
    assert empty.shape == (0, 96)
    for bad in (torch.empty(40, 96), torch.empty(96, 40, dtype=torch.float16).T):
        with pytest.raises(ValueError, match=r"out must be a contiguous torch\.float16"):
            lut_decode.decode(w.packed, w.scales, t, torch.float16, rule=rule, out=bad)


def test_other_cpus_say_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native.platform, "machine", lambda: "aarch64")
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="nvfp4lab.kernels"):
            assert not native.available()
        assert "x86-64 kernels, this CPU is aarch64" in caplog.records[0].getMessage()
    finally:
        native.library.cache_clear()


def test_build_dir_is_under_the_cache_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setenv("NVFP4LAB_CACHE", str(tmp_path))
    folder = native.build_dir()
    assert folder.parent == tmp_path / "cpp"  # type: ignore[operator]
    assert folder.name.startswith("native-") and len(folder.name) == len("native-") + 16


@pytest.fixture
def broken_build(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The library cannot be built or found (a fresh cache folder, a failing compiler)."""

    def fail(folder: object) -> object:
        raise RuntimeError("Error building extension 'nvfp4lab_native'\nc++: not found")

    monkeypatch.setattr(native, "build_dir", lambda: native.cache_dir() / "nowhere")
    monkeypatch.setattr(native, "_build", fail)
    native.library.cache_clear()
    yield
    native.library.cache_clear()  # the next use loads the real library again


def _cold_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``auto`` rule as in a fresh process with a cold kernel cache (no fused call has run,
    nothing cached), whatever the tests before this one compiled in this process."""
    monkeypatch.setattr(kernels, "_EAGER_WORK", {})
    monkeypatch.setattr(
        kernels, "auto_state",
        lambda device_type, dtype=None: kernels.AutoState(
            kernels.eager_work(device_type), started=False, warm=False),
    )


@pytest.mark.usefixtures("broken_build")
def test_without_the_library_one_warning_and_the_fallback(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    """No library: one WARNING line naming the error, ``available()`` False, ``fused_route``
    for a decode falls back to the compiled graphs' rule (``auto``: eager for a first call), and
    the linear still gives the eager bits."""
    from nvfp4lab.execution.gemm import linear

    monkeypatch.setenv("NVFP4LAB_CACHE", str(tmp_path))
    monkeypatch.setenv("NVFP4LAB_FUSED", "auto")
    _cold_process(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="nvfp4lab.kernels"):
        assert not native.available()
        assert not native.available()
        assert lut_decode.isa() == ""
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert ("(LUT decode, block encode, GPTQ column loop, q8_0 dot) are unavailable "
            "(RuntimeError: Error building extension") in lines[0]
    cpu = torch.device("cpu")
    assert not kernels.fused_route(1 << 20, 1024, torch.bfloat16, cpu, native=True)
    with pytest.raises(RuntimeError, match="unavailable"):
        lut_decode.decode(
            torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1), torch.ones(1), torch.float32
        )
    w = quantize(torch.randn(64, 64, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(linear(x, w, backend="w4a16"), linear(x, w, backend="w4a16", fused=False))


@needs_lut
def test_route_takes_the_lut_from_the_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` runs the LUT decode at once (no eager work to pay back first), ``on`` and
    ``fused=True`` too; ``off``, ``fused=False`` and non-CPU tensors never; without ``lut`` the
    compiled graphs' rule is unchanged."""
    _cold_process(monkeypatch)
    cpu = torch.device("cpu")
    for mode in ("auto", "on"):
        monkeypatch.setenv("NVFP4LAB_FUSED", mode)
        assert kernels.fused_route(1 << 20, 1024, torch.bfloat16, cpu, native=True)
        assert not kernels.fused_route(1 << 20, 1024, torch.bfloat16, cpu, False, native=True)
    monkeypatch.setenv("NVFP4LAB_FUSED", "auto")
    assert not kernels.fused_route(1 << 20, 1024, torch.bfloat16, cpu)  # the ledger's rule
    assert not kernels.fused_route(1 << 20, 1000, torch.bfloat16, cpu, native=True)  # K % 16
    assert not kernels.native_allows(torch.device("meta"))
    monkeypatch.setenv("NVFP4LAB_FUSED", "off")
    assert not kernels.fused_route(1 << 20, 1024, torch.bfloat16, cpu, native=True)
    assert kernels.fused_route(1 << 20, 1024, torch.bfloat16, cpu, True, native=True)


def test_source_is_package_data() -> None:
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    pyproject = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    data = pyproject["tool"]["setuptools"]["package-data"]["nvfp4lab"]
    assert "kernels/*.cpp" in data and "kernels/*.h" in data
    assert [header.name for header in native.HEADERS] == ["native.h"]
    assert native.HEADERS[0].is_file()
    assert [source.name for source in native.SOURCES] == [
        "lut_decode.cpp", "block_encode.cpp", "gptq_columns.cpp", "ggml_dot.cpp",
        "hessian_products.cpp"]
    assert all(source.is_file() and source.parent.name == "kernels" for source in native.SOURCES)
