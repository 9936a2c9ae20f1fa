"""Tests of nvfp4lab.number_formats: the registry, every comparator format, and the published
anchors."""

from __future__ import annotations

import math

import pytest
import torch

import nvfp4lab
from nvfp4lab import metrics, number_formats
from nvfp4lab.codec import quantize as nvfp4_quantize
from nvfp4lab.studies.number_formats import default_configs, error_rows, rank_table, sample

NAMES = ("nvfp4", "mxfp4", "int4_g128", "fp8_e4m3", "bf16")


@pytest.fixture(scope="module")
def normal() -> torch.Tensor:
    """The anchor tensor: seeded 2048×2048 float32 N(0,1)."""
    return sample("normal", (2048, 2048), seed=0)


@pytest.fixture(scope="module")
def small() -> torch.Tensor:
    return sample("normal", (8, 256), seed=1) * 3.0


# --------------------------------------------------------------------------------------------
# registry


def test_available_lists_every_format_with_bits() -> None:
    assert number_formats.available() == {
        "nvfp4": 4.5,
        "mxfp4": 4.25,
        "int4_g128": 4.125,
        "fp8_e4m3": 8.0,
        "bf16": 16.0,
    }
    for name in NAMES:
        fmt = number_formats.get(name)
        assert fmt.name == name
        assert name in repr(fmt)


def test_lazy_submodule_access() -> None:
    assert nvfp4lab.number_formats is number_formats


def test_unknown_format_lists_available() -> None:
    with pytest.raises(ValueError, match=r"unknown format 'nvfp8'.*nvfp4, mxfp4, int4_g128"):
        number_formats.get("nvfp8")


@pytest.mark.parametrize("name", NAMES)
def test_unknown_option_lists_accepted(name: str, small: torch.Tensor) -> None:
    fmt = number_formats.get(name)
    with pytest.raises(ValueError, match="unknown option") as info:
        fmt.fake_quantize(small, no_such_option=1)
    for option in fmt.options:
        assert option in str(info.value)


def test_register_refuses_duplicates() -> None:
    with pytest.raises(ValueError, match="already registered"):
        number_formats.register(number_formats.BlockFormat(number_formats.get("mxfp4").info))
    with pytest.raises(ValueError, match="named QuantFormat"):
        number_formats.register("mxfp4")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# anchors (fp32, seeded 2048×2048 N(0,1))


@pytest.mark.parametrize(
    ("name", "options", "anchor_nmse", "rel", "anchor_db"),
    [
        ("nvfp4", {}, 9.0e-3, 0.02, 20.4),
        ("nvfp4", {"convention": "compressed-tensors"}, 9.0e-3, 0.02, 20.4),
        ("mxfp4", {}, 1.32e-2, 0.02, 18.8),
        ("int4_g128", {}, 1.38e-2, 0.02, None),
        ("fp8_e4m3", {}, 7.0e-4, 0.03, None),
    ],
)
def test_published_anchors(
    normal: torch.Tensor,
    name: str,
    options: dict,
    anchor_nmse: float,
    rel: float,
    anchor_db: float | None,
) -> None:
    y = number_formats.get(name).fake_quantize(normal, **options)
    assert y.dtype == normal.dtype and y.shape == normal.shape
    assert metrics.nmse(normal, y) == pytest.approx(anchor_nmse, rel=rel)
    if anchor_db is not None:
        assert metrics.sqnr_db(normal, y) == pytest.approx(anchor_db, abs=0.2)


def test_bf16_and_per_channel_fp8_on_normal(normal: torch.Tensor) -> None:
    assert metrics.nmse(normal, number_formats.get("bf16").fake_quantize(normal)) < 1e-5
    per_channel = number_formats.get("fp8_e4m3").fake_quantize(normal, granularity="channel")
    assert metrics.nmse(normal, per_channel) == pytest.approx(7.0e-4, rel=0.03)


def test_student_t_changes_the_ranking() -> None:
    """Measured (docstring of nvfp4lab.format_study): with heavy tails INT4-g128 and 16×16-block
    NVFP4 fall behind MXFP4, NVFP4's own NMSE does not get worse."""
    configs = [
        c for c in default_configs(0, fast=True)
        if c.label in ("nvfp4", "nvfp4 16×16 blocks", "mxfp4", "int4_g128")
    ]
    x_n = sample("normal", (1024, 1024), seed=0)
    x_t = sample("student_t", (1024, 1024), seed=0)
    rows = error_rows(x_n, configs, "normal") + error_rows(x_t, configs, "t3")
    ranks = rank_table(rows)
    assert [ranks[c.label]["normal"] for c in configs] == [1, 2, 3, 4]
    assert ranks["nvfp4"]["t3"] == 1
    assert ranks["mxfp4"]["t3"] == 2  # overtakes 16×16 blocks
    assert ranks["int4_g128"]["t3"] == 4
    nmse = {(r["label"], r["distribution"]): r["nmse"] for r in rows}
    assert nmse["nvfp4", "t3"] < nmse["nvfp4", "normal"]
    assert nmse["int4_g128", "t3"] > 2.5 * nmse["int4_g128", "normal"]


# --------------------------------------------------------------------------------------------
# every format: shapes, dtypes, packed round trip


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shape_dtype_and_packed_round_trip(
    name: str, dtype: torch.dtype, small: torch.Tensor
) -> None:
    fmt = number_formats.get(name)
    x = small.to(dtype).reshape(2, 4, 256)
    y = fmt.fake_quantize(x)
    assert y.shape == x.shape and y.dtype == dtype
    q = fmt.quantize(x)
    assert torch.equal(fmt.dequantize(q), y)
    assert fmt.dequantize(q, torch.float32).dtype == torch.float32
    assert q.nbytes * 8 / x.numel() <= fmt.bits_per_element + 32 / x.numel() + 1e-9


@pytest.mark.parametrize("name", NAMES)
def test_zero_tensor_quantizes_to_zero(name: str) -> None:
    x = torch.zeros(4, 256)
    assert torch.equal(number_formats.get(name).fake_quantize(x), x)


@pytest.mark.parametrize("name", NAMES)
def test_empty_tensor(name: str) -> None:
    fmt = number_formats.get(name)
    x = torch.zeros(0, 256)
    assert fmt.fake_quantize(x).shape == x.shape
    assert fmt.dequantize(fmt.quantize(x)).shape == x.shape


@pytest.mark.parametrize("name", ["mxfp4", "int4_g128", "fp8_e4m3"])
def test_nonfinite_input_raises(name: str) -> None:
    x = torch.ones(2, 256)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        number_formats.get(name).fake_quantize(x)


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_types(name: str) -> None:
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        number_formats.get(name).fake_quantize(torch.ones(2, 256, dtype=torch.int32))


def test_storage_bits() -> None:
    n = 2048 * 2048
    assert number_formats.get("nvfp4").storage_bits((2048, 2048)) == 4.5 + 32 / n
    assert number_formats.get("nvfp4").storage_bits((2048, 2048), block_size=(16, 16)) == (
        4 + 8 / 256 + 32 / n
    )
    assert number_formats.get("nvfp4").storage_bits((2048, 2048), global_scale=None) == 4.5 + 32 / n
    assert number_formats.get("nvfp4").storage_bits((2048, 2048), global_scale=1.0) == 4.5  # none
    assert number_formats.get("mxfp4").storage_bits((64, 64)) == 4.25
    fp8 = number_formats.get("fp8_e4m3")
    assert fp8.storage_bits((64, 128), granularity="channel") == 8 + 32 / 128
    with pytest.raises(ValueError, match="non-empty"):
        number_formats.get("bf16").storage_bits((0, 4))


# --------------------------------------------------------------------------------------------
# nvfp4: the foundation's implementation


@pytest.mark.parametrize("convention", ["kernel", "compressed-tensors"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_is_the_foundation(convention: str, dtype: torch.dtype, small: torch.Tensor) -> None:
    x = small.to(dtype)
    fmt = number_formats.get("nvfp4")
    expected = nvfp4lab.fake_quantize(x, convention=convention)
    assert torch.equal(fmt.fake_quantize(x, convention=convention), expected)
    q, ref = fmt.quantize(x, convention=convention), nvfp4_quantize(x, convention=convention)
    assert torch.equal(q.packed, ref.packed)
    assert torch.equal(q.scales.view(torch.uint8), ref.scales.view(torch.uint8))
    assert torch.equal(q.global_scale, ref.global_scale)


# --------------------------------------------------------------------------------------------
# mxfp4


def test_mxfp4_scale_is_the_ocp_floor_rule() -> None:
    fmt = number_formats.get("mxfp4")
    blocks = torch.zeros(5, 32)
    blocks[0, 0] = 6.0  # floor(log2 6) - 2 = 0 -> scale 1, exact
    blocks[1, :3] = torch.tensor([7.9, -3.0, 0.5])  # scale 1: 7.9 clips to 6 (floor rule)
    blocks[2, 0] = 0.75  # floor(log2 0.75) - 2 = -3 -> scale 1/8, 0.75 -> 6
    blocks[3, 0] = 2.0**-130  # exponent clamps at -127 (E8M0 minimum)
    q = fmt.quantize(blocks.reshape(1, -1))
    assert q.scales.tolist() == [[127, 127, 124, 0, 0]]
    assert torch.equal(q.scales.view(torch.float8_e8m0fnu)[0, :3].float(),
                       torch.tensor([1.0, 1.0, 0.125]))
    y = fmt.dequantize(q).reshape(5, 32)
    assert y[0, 0] == 6.0 and y[1, 0] == 6.0 and y[1, 1] == -3.0 and y[1, 2] == 0.5
    assert y[2, 0] == 0.75
    assert torch.equal(y[4], torch.zeros(32))


def test_mxfp4_matches_a_slow_reference() -> None:
    x = sample("student_t", (4, 64), seed=3)
    y = number_formats.get("mxfp4").fake_quantize(x)
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for row in range(4):
        for b in range(2):
            block = x[row, 32 * b: 32 * (b + 1)].tolist()
            scale = 2.0 ** (math.floor(math.log2(max(abs(v) for v in block))) - 2)
            for j, v in enumerate(block):
                t = min(abs(v) / scale, 6.0)
                nearest = min(grid, key=lambda g, t=t: (abs(g - t), grid.index(g) % 2))
                assert y[row, 32 * b + j].item() == math.copysign(nearest * scale, v)


def test_mxfp4_pad() -> None:
    fmt = number_formats.get("mxfp4")
    x = torch.randn(3, 40)
    with pytest.raises(ValueError, match=r"multiple of 32.*pad=True"):
        fmt.fake_quantize(x)
    y = fmt.fake_quantize(x, pad=True)
    assert y.shape == x.shape
    assert torch.equal(fmt.dequantize(fmt.quantize(x, pad=True)), y)
    with pytest.raises(ValueError, match="pad must be True or False"):
        fmt.fake_quantize(x, pad="yes")


# --------------------------------------------------------------------------------------------
# int4_g128


def test_int4_symmetric_grid_and_rounding() -> None:
    fmt = number_formats.get("int4_g128")
    x = torch.zeros(1, 128)
    x[0, :6] = torch.tensor([7.0, 2.5, 3.5, -0.5, -7.0, -6.6])  # scale = 7/7 = 1 (exact in fp16)
    q = fmt.quantize(x)
    assert q.scales.dtype == torch.float16 and q.scales.tolist() == [[1.0]]
    y = fmt.dequantize(q)
    assert y[0, :6].tolist() == [7.0, 2.0, 4.0, -0.0, -7.0, -7.0]  # half to even; -8 unused
    z = sample("normal", (16, 1024), seed=2)
    qz = fmt.quantize(z)
    nibbles = nvfp4lab.unpack_fp4(qz.packed)
    assert not bool((nibbles == 8).any())  # the code -8 never appears
    ratio = fmt.dequantize(qz).reshape(16, 8, 128) / qz.scales.float().unsqueeze(-1)
    assert torch.equal(ratio, ratio.round()) and float(ratio.abs().max()) == 7.0


def test_int4_group_size_and_pad() -> None:
    fmt = number_formats.get("int4_g128")
    with pytest.raises(ValueError, match="multiple of 128"):
        fmt.fake_quantize(torch.randn(2, 100))
    assert fmt.fake_quantize(torch.randn(2, 100), pad=True).shape == (2, 100)


# --------------------------------------------------------------------------------------------
# fp8_e4m3


def test_fp8_per_tensor_and_per_channel() -> None:
    fmt = number_formats.get("fp8_e4m3")
    x = torch.randn(4, 64) * torch.tensor([[1.0], [10.0], [0.1], [1e3]])
    q = fmt.quantize(x)
    assert q.scale.shape == (1,)
    assert q.scale.item() == pytest.approx(float(x.abs().max()) / 448, rel=1e-6)
    assert q.data.dtype == torch.float8_e4m3fn
    qc = fmt.quantize(x, granularity="channel")
    assert qc.scale.shape == (4, 1)
    yc = fmt.dequantize(qc)
    # every row's max maps to 448 exactly, so it survives
    assert torch.allclose(yc.abs().amax(-1), x.abs().amax(-1), rtol=1e-6)
    assert metrics.nmse(x[2], yc[2]) < metrics.nmse(x[2], fmt.dequantize(q)[2])
    with pytest.raises(ValueError, match=r"unknown granularity 'row'.*'tensor', 'channel'"):
        fmt.fake_quantize(x, granularity="row")


def test_bf16_is_a_cast() -> None:
    x = torch.randn(3, 32, dtype=torch.float32)
    assert torch.equal(number_formats.get("bf16").fake_quantize(x), x.bfloat16().float())
    xb = x.bfloat16()
    assert torch.equal(number_formats.get("bf16").fake_quantize(xb), xb)


def test_get_is_forgiving_about_case_and_separators() -> None:
    assert number_formats.get("NVFP4") is number_formats.get("nvfp4")
    assert number_formats.get("INT4-G128") is number_formats.get("int4_g128")
    with pytest.raises(ValueError, match=r"available formats: .*mxfp4"):
        number_formats.get("nvfp8")
