"""torchao 0.18's NVFP4 (``torchao.prototype.mx_formats``) as an oracle for nvfp4lab.

torchao is imported from the directory ``make test-peers`` installs it into (``--no-deps``; it
imports with the project's CPU torch 2.13, its CUDA extensions fail to load and are not needed).
Compared bit for bit: the 128x4 scale swizzle (``utils.to_blocked``), the nibble packing
(``kernels.pack_uint4``), the E2M1 element codec (``kernels.f32_to_f4_unpacked``) and
``NVFP4Tensor.to_nvfp4`` codes and scales. torchao takes the DECODE per-tensor scale
(``per_tensor_scale = amax/2688``); nvfp4lab is given its reciprocal. Two documented
differences, asserted exactly:

* torchao clamps every block scale to at least ``finfo(float8_e4m3fn).tiny`` = 2**-6
  (nvfp4_tensor.py@0.18.0 ``nvfp4_quantize``), where nvfp4lab (and vLLM) keep E4M3 subnormal
  and zero scales;
* torchao keeps the sign of -0.0 (code 8); nvfp4lab encodes an input -0.0 as +0 (code 0).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import nvfp4lab
from nvfp4lab.e2m1 import encode_e2m1, pack_fp4, unpack_fp4
from nvfp4lab.layout import swizzle_scales
from tests.sample_data import make

try:
    nvfp4_tensor = importlib.import_module("torchao.prototype.mx_formats.nvfp4_tensor")
    kernels = importlib.import_module("torchao.prototype.mx_formats.kernels")
    utils = importlib.import_module("torchao.prototype.mx_formats.utils")
    TORCHAO_VERSION = importlib.import_module("torchao").__version__
except Exception as exc:  # pragma: no cover - depends on the peer install
    pytest.skip(
        f"torchao's mx_formats do not import with torch {torch.__version__} "
        f"({type(exc).__name__}: {exc}); run `make test-peers`",
        allow_module_level=True,
    )

pytestmark = pytest.mark.peers

TINY = torch.finfo(torch.float8_e4m3fn).tiny  # 2**-6, torchao's E4M3_EPS


def test_torchao_version() -> None:
    assert TORCHAO_VERSION.startswith("0.18")


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (7, 3), (128, 4), (130, 9), (256, 64)])
def test_swizzle_matches_to_blocked(rows: int, cols: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    raw = torch.randint(0, 127, (rows, cols), generator=g, dtype=torch.uint8)
    scales = raw.view(torch.float8_e4m3fn)
    ours = swizzle_scales(scales).view(torch.uint8).reshape(-1)
    assert torch.equal(ours, utils.to_blocked(raw).reshape(-1))


def test_packing_matches_pack_uint4() -> None:
    codes = torch.randint(0, 16, (33, 64), generator=torch.Generator().manual_seed(1),
                          dtype=torch.uint8)
    assert torch.equal(pack_fp4(codes), kernels.pack_uint4(codes))


def test_element_codec_matches_f32_to_f4_unpacked() -> None:
    """Every float32 value on a fine grid over [-7, 7] plus the ties and signed zeros."""
    grid = torch.linspace(-7.0, 7.0, 200_001)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    values = torch.cat([grid, ties, -ties, torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    ours, theirs = encode_e2m1(values), kernels.f32_to_f4_unpacked(values)
    negative_zero = (values == 0) & torch.signbit(values)
    assert torch.equal(ours[~negative_zero], theirs[~negative_zero])
    assert set(ours[negative_zero].tolist()) == {0} and set(theirs[negative_zero].tolist()) == {8}


def _pair(kind: str, dtype: torch.dtype, seed: int):
    x = make(kind, (64, 512), dtype, seed)
    pts = nvfp4_tensor.per_tensor_amax_to_scale(x.abs().max().float())  # DECODE: amax/2688
    t = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, block_size=16, per_tensor_scale=pts)
    q = nvfp4lab.quantize(x, 1.0 / pts.reshape(1), convention="kernel")
    return t, q


@pytest.mark.parametrize("kind", ["normal", "student_t", "outliers", "zero_blocks", "tiny_blocks"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_to_nvfp4_codes_and_scales_fp32(kind: str, seed: int) -> None:
    t, q = _pair(kind, torch.float32, seed)
    theirs = t.scale.view(torch.uint8).reshape(q.scales.shape)
    ours = q.scales.view(torch.uint8)
    clamped = q.scales.float() < TINY  # torchao raises these block scales to 2**-6
    assert torch.equal(theirs[~clamped], ours[~clamped])
    assert bool((t.scale.float().reshape(q.scales.shape)[clamped] == TINY).all())
    codes_t = unpack_fp4(t.qdata.view(torch.uint8)).reshape(*q.scales.shape, 16)
    codes_q = unpack_fp4(q.packed).reshape(*q.scales.shape, 16)
    assert torch.equal(codes_t[~clamped], codes_q[~clamped])
    assert int(clamped.sum()) == 0 or kind in ("zero_blocks", "tiny_blocks")


@pytest.mark.parametrize("kind", ["normal", "student_t", "outliers"])
def test_to_nvfp4_bf16_differs_only_by_arithmetic_order(kind: str) -> None:
    """bf16 input: torchao computes ``(amax/6)/pts`` and ``(1/pts)/s``, nvfp4lab (as vLLM)
    ``gs*(amax*(1/6))`` and ``1/(s*(1/gs))``; with 8-bit-mantissa inputs the two orders land on
    different sides of an E4M3/E2M1 rounding boundary now and then: one step, rarely."""
    total = scale_diffs = code_diffs = 0
    for seed in range(3):
        t, q = _pair(kind, torch.bfloat16, seed)
        theirs = t.scale.view(torch.uint8).reshape(q.scales.shape).int()
        ours = q.scales.view(torch.uint8).int()
        assert int((theirs - ours).abs().max()) <= 1  # one E4M3 step at most
        scale_diffs += int((theirs != ours).sum())
        same = theirs == ours
        codes_t = unpack_fp4(t.qdata.view(torch.uint8)).reshape(*q.scales.shape, 16)
        codes_q = unpack_fp4(q.packed).reshape(*q.scales.shape, 16)
        step = (codes_t.int() - codes_q.int())[same]
        assert int(step.abs().max()) <= 1  # neighbouring codes of one sign
        code_diffs += int((step != 0).sum())
        total += codes_q.numel()
    assert scale_diffs <= total // 16 // 100 and code_diffs <= total // 1000
