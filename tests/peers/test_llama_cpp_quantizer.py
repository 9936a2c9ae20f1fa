"""llama.cpp's own NVFP4 quantizer (ggml type 40) as the oracle of ``convention="llama.cpp"``.

llama-cpp-python 0.3.36 (built from source by ``make test-peers`` into its ``--target`` dir; it
vendors ggml-org/llama.cpp@0c1e57098bba) ships ``libggml-base.so`` under ``llama_cpp/lib/``. The
library is loaded with ctypes from the package's directory (found without importing the package)
and called as a C caller would: ``ggml_quantize_init(GGML_TYPE_NVFP4)`` then
``ggml_quantize_chunk(GGML_TYPE_NVFP4, src, dst, 0, nrows, n_per_row, imatrix)``, the function
``llama-quantize`` and the GGUF writers go through. nvfp4lab's codes and block scales, laid out by
``nvfp4lab.ggml_blocks.to_ggml_nvfp4``, must equal ggml's bytes exactly. ggml takes float32 rows:
bf16 / fp16 inputs are upcast to float32 (exact) for it, while nvfp4lab quantizes them in their
own dtype. The GGUF decoder of gguf-py reads ggml's bytes as nvfp4lab decodes its own.

One documented difference, asserted exactly: under ``nonfinite="propagate"`` a block holding NaN
gets scale 0 and codes 0 in nvfp4lab, while ggml (whose amax loop skips NaN) scales it by its
finite values; both give the NaN element code 0.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import nvfp4lab
from nvfp4lab.codec import ScaleUnderflowWarning
from nvfp4lab.ggml_blocks import from_ggml_nvfp4, to_ggml_nvfp4
from tests.peers.ggml_ctypes import declare_quantize_chunk
from tests.sample_data import make

pytestmark = pytest.mark.peers

#: ggml/include/ggml.h: ``GGML_TYPE_NVFP4 = 40``.
GGML_TYPE_NVFP4 = 40


def _load_ggml() -> ctypes.CDLL:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        pytest.skip(
            "llama-cpp-python is not importable (run `make test-peers`, which builds it into "
            "~/.cache/nvfp4lab/peers/llama-cpp-python-0.3.36 and puts it on PYTHONPATH)",
            allow_module_level=True,
        )
    path = Path(spec.origin).parent / "lib" / "libggml-base.so"
    if not path.is_file():
        pytest.skip(f"llama-cpp-python has no {path}", allow_module_level=True)
    lib = ctypes.CDLL(str(path))
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_quantize_init.restype = None
    declare_quantize_chunk(lib)
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_type_name.argtypes = [ctypes.c_int]
    lib.ggml_type_name.restype = ctypes.c_char_p
    lib.ggml_quantize_init(GGML_TYPE_NVFP4)
    return lib


GGML = _load_ggml()


def ggml_quantize(x: torch.Tensor, imatrix: torch.Tensor | None = None) -> torch.Tensor:
    """ggml's NVFP4 bytes uint8 ``[rows, K/64*36]`` of float32 rows ``x [rows, K]``."""
    src = np.ascontiguousarray(x.to(torch.float32).numpy())
    rows, k = src.shape
    row_size = GGML.ggml_row_size(GGML_TYPE_NVFP4, k)
    dst = np.zeros((rows, row_size), dtype=np.uint8)
    weights = None if imatrix is None else np.ascontiguousarray(imatrix.numpy(), dtype=np.float32)
    written = GGML.ggml_quantize_chunk(
        GGML_TYPE_NVFP4,
        src.ctypes.data,
        dst.ctypes.data,
        0,
        rows,
        k,
        None if weights is None else weights.ctypes.data,
    )
    assert written == rows * row_size
    return torch.from_numpy(dst)


def _ties(dtype: torch.dtype) -> torch.Tensor:
    """Blocks with amax 6 s and elements exactly on the E2M1 midpoints times s (both signs), for
    scales s across E4M3 (subnormal to 448) that the dtype holds exactly."""
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    rows = []
    for s in (2.0**-9 * 3, 2.0**-7, 0.375, 1.0, 1.125, 13.0, 96.0, 240.0, 448.0):
        rows.append([6 * s, *[m * s for m in mids], -6 * s, *[-m * s for m in mids]] * 4)
    return torch.tensor(rows, dtype=torch.float32).to(dtype)


def _rows(kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Seeded rows ``[12, 256]`` of one kind, in ``dtype``."""
    shape = (12, 256)
    if kind == "ties":
        return _ties(dtype)
    if kind == "zeros":
        x = make("zero_blocks", shape, torch.float32, seed=3)
        x[0] = 0.0
        x[1, :64] = -0.0
        return x.to(dtype)
    if kind == "tiny":  # E4M3-subnormal block scales, and blocks that vanish (amax < 6 * 2**-10)
        x = make("normal", shape, torch.float32, seed=4)
        x *= torch.logspace(-1, -5, shape[0])[:, None]
        return x.to(dtype)
    if kind == "saturating":  # block maxima above 6 * 448 = 2688, in fp16 up to its 65504
        x = make("normal", shape, torch.float32, seed=5) * 300
        top = 6.0e4 if dtype == torch.float16 else 1e12
        x[:, ::16] = torch.logspace(math.log10(1500.0), math.log10(top), shape[0])[:, None]
        x[:, 8::32] *= -1
        return x.to(dtype)
    scale = {"normal": 0.05, "student_t": 0.05, "outliers": 0.02}[kind]
    return (make(kind, shape, torch.float32, seed=6) * scale).to(dtype)


KINDS = ["normal", "student_t", "outliers", "tiny", "zeros", "ties", "saturating"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_the_library_is_the_vendored_ggml() -> None:
    assert GGML.ggml_type_name(GGML_TYPE_NVFP4) == b"nvfp4"
    assert GGML.ggml_row_size(GGML_TYPE_NVFP4, 64) == 36  # 64 elements in 36 bytes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_quantize_is_ggml_byte_for_byte(kind: str, dtype: torch.dtype) -> None:
    x = _rows(kind, dtype)
    assert bool(torch.isfinite(x).all())
    theirs = ggml_quantize(x)  # float32 rows: the exact upcast of bf16 / fp16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ScaleUnderflowWarning)  # "tiny": blocks that vanish
        q = nvfp4lab.quantize(x, convention="llama.cpp")
    assert float(q.global_scale) == 1.0
    ours = to_ggml_nvfp4(q.packed, q.scales)
    bad = (ours != theirs).nonzero()
    assert bad.numel() == 0, [
        (tuple(i.tolist()), int(ours[tuple(i)]), int(theirs[tuple(i)])) for i in bad[:5]
    ]
    codes, scales = from_ggml_nvfp4(theirs)
    assert torch.equal(codes, q.packed)
    assert torch.equal(scales.view(torch.uint8), q.scales.view(torch.uint8))
    if kind == "saturating":
        assert bool((q.scales.view(torch.uint8)[:, 0] == 0x7E).all())  # 448
    if kind == "tiny":
        raw = q.scales.view(torch.uint8)
        assert bool(((raw > 0) & (raw < 0x08)).any()) and bool((raw == 0).any())


@pytest.mark.parametrize("kind", ["normal", "outliers", "saturating"])
def test_fake_quantize_and_gguf_decode_agree_with_ggml(kind: str) -> None:
    """gguf-py decodes ggml's bytes to nvfp4lab's dequantize (float32) and fake_quantize."""
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    x = _rows(kind, torch.float32)
    theirs = ggml_quantize(x)
    decoded = torch.from_numpy(quants.dequantize(theirs.numpy(), GGMLQuantizationType.NVFP4))
    q = nvfp4lab.quantize(x, convention="llama.cpp")
    assert torch.equal(nvfp4lab.dequantize(q, torch.float32), decoded)
    assert torch.equal(nvfp4lab.fake_quantize(x, convention="llama.cpp"), decoded)


def test_an_importance_matrix_changes_nothing() -> None:
    """ggml's quantize_nvfp4 ignores quant_weights (GGML_UNUSED): same bytes with an imatrix."""
    x = _rows("student_t", torch.float32)
    imatrix = torch.rand(x.shape[1], generator=torch.Generator().manual_seed(7)) + 0.01
    assert torch.equal(ggml_quantize(x, imatrix), ggml_quantize(x))


def test_a_global_scale_is_ggml_on_the_prescaled_rows() -> None:
    """quantize(x, gs, convention="llama.cpp") = ggml's quantizer on f32(x * gs)."""
    x = _rows("student_t", torch.bfloat16)
    gs = 2688.0 / float(x.float().abs().max())
    q = nvfp4lab.quantize(x, gs, convention="llama.cpp")
    prescaled = x.float() * torch.tensor([gs], dtype=torch.float32)
    assert torch.equal(to_ggml_nvfp4(q.packed, q.scales), ggml_quantize(prescaled))


def test_inf_and_nan_under_propagate() -> None:
    """+-inf: the block scale saturates to 448 and the element gets code 0, as in ggml. NaN: the
    documented difference (module docstring)."""
    x = _rows("normal", torch.float32)[:2].clone()
    x[0, 3] = math.inf
    x[0, 40] = -math.inf
    x[1, 70] = math.nan
    theirs = ggml_quantize(x)
    q = nvfp4lab.quantize(x, convention="llama.cpp", nonfinite="propagate")
    ours = to_ggml_nvfp4(q.packed, q.scales)
    nan_block = (1, slice(36, 72))  # row 1, GGUF block 1 (elements 64..127): sub-block 0 at 70
    same = torch.ones_like(ours, dtype=torch.bool)
    same[nan_block] = False
    assert torch.equal(ours[same], theirs[same])
    assert int(theirs[0, 0]) == 0x7E and int(theirs[0, 4 + 3]) & 0xF == 0  # inf: 448, code 0
    ours_block, theirs_block = ours[nan_block], theirs[nan_block]
    assert int(ours_block[0]) == 0 and bool((ours_block[4:12] == 0).all())  # scale 0, codes 0
    assert int(theirs_block[0]) != 0  # ggml: scaled by the sub-block's finite values
    assert int(theirs_block[4 + 6]) & 0xF == 0  # element 70: sub-block 0, j = 6 (low): code 0
    assert torch.equal(ours_block[1:4], theirs_block[1:4])  # the other sub-blocks' scales
    assert torch.equal(ours_block[12:], theirs_block[12:])


def test_ggml_stores_every_scale_from_248_on_as_448() -> None:
    """ggml_fp32_to_ue4m3 treats an E4M3 exponent field of 15 as overflow: amax / 6 of 240 is
    stored as 240 (0x77), but 248, 256, 300 and 416 (all representable from 256 on) as 448."""
    wanted = [240.0, 247.0, 248.0, 256.0, 300.0, 416.0, 448.0]
    x = torch.zeros(len(wanted), 64)
    x[:, 0] = torch.tensor(wanted) * 6
    theirs = ggml_quantize(x)
    assert theirs[:, 0].tolist() == [0x77, 0x77, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E]
    q = nvfp4lab.quantize(x, convention="llama.cpp")
    assert torch.equal(to_ggml_nvfp4(q.packed, q.scales), theirs)
