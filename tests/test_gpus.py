"""GPU catalogue sanity, lookup, and the roofline model (nvfp4lab.gpus)."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab import gpus
from nvfp4lab.gpus import CATALOGUE, FIGURES

DATASHEET_GPUS = (
    "A100 SXM 80GB",
    "L40S",
    "L4",
    "RTX 4090",
    "H100 SXM",
    "H100 PCIe",
    "H200 SXM",
    "B200",
    "GB200",
    "B300",
    "GB300",
    "RTX 5090",
    "RTX PRO 6000 Blackwell WS",
    "DGX Spark (GB10)",
)
ALL = list(CATALOGUE.values())

#: The datasheet table (docs/gpus.md), transcribed by hand from the vendors' datasheets:
#: name: (cc, BF16 TF, FP8 TF, NVFP4 TF, mem GB, TB/s). "—" and "unpublished" are None;
#: "~1008" is 1008; "165.2 (fp32 acc)" is 165.2; "288 (270 usable)" is 288; "128 (unified)" 128.
DATASHEET: dict[str, tuple[str, float | None, float | None, float | None, float, float]] = {
    "A100 SXM 80GB": ("8.0", 312, None, None, 80, 2.039),
    "L40S": ("8.9", 362, 733, None, 48, 0.864),
    "L4": ("8.9", 121, 242, None, 24, 0.300),
    "RTX 4090": ("8.9", 165.2, 330.3, None, 24, 1.008),
    "H100 SXM": ("9.0", 989, 1979, None, 80, 3.35),
    "H100 PCIe": ("9.0", 756, 1513, None, 80, 2.0),
    "H200 SXM": ("9.0", 989, 1979, None, 141, 4.8),
    "B200": ("10.0", 2250, 4500, 9000, 180, 7.7),
    "GB200": ("10.0", 2500, 5000, 10000, 186, 8.0),
    "B300": ("10.3", 2250, 4500, 13500, 288, 8.0),
    "GB300": ("10.3", 2500, 5000, 15000, 279, 8.0),
    "RTX 5090": ("12.0", 209.5, 419, 1676, 32, 1.792),
    "RTX PRO 6000 Blackwell WS": ("12.0", 503.8, 1008, 2015, 96, 1.792),
    "DGX Spark (GB10)": ("12.1", None, None, 500, 128, 0.273),
}


# -- table sanity ----------------------------------------------------------------------------


def test_every_datasheet_gpu_is_catalogued() -> None:
    assert set(DATASHEET_GPUS) <= set(CATALOGUE)
    assert set(DATASHEET) == set(DATASHEET_GPUS)
    assert gpus.names() == list(CATALOGUE)


@pytest.mark.parametrize("name", list(DATASHEET))
def test_catalogue_equals_the_datasheet_table(name: str) -> None:
    g = CATALOGUE[name]
    cc, bf16, fp8, fp4, mem, bw = DATASHEET[name]
    got = (g.capability_str, g.bf16_tflops, g.fp8_tflops, g.nvfp4_tflops, g.memory_gb)
    assert got == (cc, bf16, fp8, fp4, mem)
    assert g.bandwidth_tb_s == bw
    assert g.as_dict()["capability"] == cc


@pytest.mark.parametrize("g", ALL, ids=lambda g: g.name)
def test_every_figure_has_a_source(g: gpus.GPU) -> None:
    assert set(g.sources) == set(FIGURES)
    for fig, src in g.sources.items():
        assert isinstance(src, str) and len(src.strip()) > 8, (g.name, fig)


@pytest.mark.parametrize("g", ALL, ids=lambda g: g.name)
def test_units_are_plausible(g: gpus.GPU) -> None:
    # TB/s: every catalogued part is between LPDDR (0.27) and HBM3e (8); a 1000x slip fails
    assert 0.1 <= g.bandwidth_tb_s <= 20, g.bandwidth_tb_s
    assert 8 <= g.memory_gb <= 512, g.memory_gb
    for fig in ("bf16_tflops", "fp8_tflops", "nvfp4_tflops"):
        v = getattr(g, fig)
        assert v is None or 50 <= v <= 30000, (fig, v)
    # a dense GEMM peak of a GPU this generation: between 50 and 2000 FLOP per byte of DRAM
    peak = g.nvfp4_tflops or g.fp8_tflops or g.bf16_tflops
    assert peak is not None
    assert 50 <= peak / g.bandwidth_tb_s <= 2000


@pytest.mark.parametrize("g", ALL, ids=lambda g: g.name)
def test_precision_ordering(g: gpus.GPU) -> None:
    bf16, fp8, fp4 = g.bf16_tflops, g.fp8_tflops, g.nvfp4_tflops
    if bf16 is not None and fp8 is not None:
        assert fp8 >= bf16
    if g.native_fp4:
        assert fp4 is not None
        assert fp8 is None or fp4 >= fp8
        assert bf16 is None or fp4 >= bf16
    else:
        assert fp4 is None


@pytest.mark.parametrize("g", ALL, ids=lambda g: g.name)
def test_capability_consistent_with_native_flag(g: gpus.GPU) -> None:
    assert g.native_fp4 == gpus.has_native_fp4(g.capability) == (g.capability >= (10, 0))
    if g.native_fp4:  # tcgen05 on 10.x/11.0, mma.sync with block scales on 12.x
        assert g.capability in {(10, 0), (10, 3), (11, 0), (12, 0), (12, 1)}


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="torch lacks FP4 dtype")
@pytest.mark.parametrize("g", ALL, ids=lambda g: g.name)
def test_capability_consistent_with_select_backend(g: gpus.GPU) -> None:
    from nvfp4lab.execution.dispatch import select_backend

    choice = select_backend(capability=g.capability, env={})
    assert choice.name == ("native" if g.native_fp4 else "w4a16"), choice.reason


def test_sparse_figures_were_halved() -> None:
    assert gpus.get("H100 SXM").bf16_tflops == 989.0  # 1979 sparse
    assert gpus.get("A100").bf16_tflops == 312.0  # 624 sparse
    assert gpus.get("RTX 5090").nvfp4_tflops == 1676.0  # 3352 sparse
    assert gpus.get("B300").nvfp4_tflops == 13500.0  # Blackwell Ultra: dense as published


# -- lookup ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("h100", "H100 SXM"),
        ("H100", "H100 SXM"),
        ("h100-pcie", "H100 PCIe"),
        ("H100_PCIe", "H100 PCIe"),
        ("RTX 5090", "RTX 5090"),
        ("rtx5090", "RTX 5090"),
        ("  b200 ", "B200"),
        ("B200 (HGX)", "B200"),
        ("h200", "H200 SXM"),
        ("a100", "A100 SXM 80GB"),
        ("dgx spark", "DGX Spark (GB10)"),
        ("gb10", "DGX Spark (GB10)"),
        ("rtx pro 6000", "RTX PRO 6000 Blackwell WS"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA B200", "B200"),
    ],
)
def test_get_is_forgiving(query: str, name: str) -> None:
    assert gpus.get(query).name == name


def test_get_accepts_an_entry() -> None:
    g = gpus.get("L4")
    assert gpus.get(g) is g


@pytest.mark.parametrize("bad", ["h300", "", "TPU v5", "l5"])
def test_unknown_name_lists_known_ones(bad: str) -> None:
    with pytest.raises(KeyError) as info:
        gpus.get(bad)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "H100 SXM" in msg and "RTX 5090" in msg


def test_by_capability() -> None:
    assert {g.name for g in gpus.by_capability((9, 0))} == {"H100 SXM", "H100 PCIe", "H200 SXM"}
    assert {g.name for g in gpus.by_capability("8.9")} == {"L40S", "L4", "RTX 4090"}
    assert {g.name for g in gpus.by_capability(" 12.1 ")} == {"DGX Spark (GB10)"}
    assert gpus.by_capability("9") == gpus.by_capability((9, 0))
    assert gpus.by_capability((7, 5)) == []


@pytest.mark.parametrize("bad", ["abc", "", "9.x", "9.0.1", "-1.0", (9,), (9, 0, 1), ("a", 0), 9])
def test_by_capability_rejects_clearly(bad: object) -> None:
    with pytest.raises(ValueError, match=r"\(major, minor\).*\"major\.minor\""):
        gpus.by_capability(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("device_name", "cc", "expected"),
    [
        ("NVIDIA L4", (8, 9), "L4"),
        ("NVIDIA L40S", (8, 9), "L40S"),
        ("NVIDIA H100 PCIe", (9, 0), "H100 PCIe"),
        ("NVIDIA H200", (9, 0), "H200 SXM"),
        ("NVIDIA A100-SXM4-80GB", (8, 0), "A100 SXM 80GB"),
        ("NVIDIA GB200", (10, 0), "GB200"),
        ("NVIDIA GB10", (12, 1), "DGX Spark (GB10)"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", (12, 0), "RTX PRO 6000 Blackwell WS"),
        ("NVIDIA H100 NVL", (9, 0), None),  # not catalogued
        ("NVIDIA A100-PCIE-40GB", (8, 0), None),
        ("NVIDIA H100 80GB HBM3", (10, 0), None),  # capability disagrees
        ("NVIDIA GH200 480GB", (9, 0), None),
    ],
)
def test_match_device_name(device_name: str, cc: tuple[int, int], expected: str | None) -> None:
    g = gpus.match_device_name(device_name, cc)
    assert (g.name if g else None) == expected


def test_current_without_cuda_is_none() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert gpus.current() is None


def test_sources_table() -> None:
    rows = gpus.sources_table(["B200"])
    assert len(rows) == len(FIGURES)
    assert all(r["source"] for r in rows)
