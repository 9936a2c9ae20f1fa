"""GPU catalogue sanity, lookup, and the roofline model (nvfp4lab.gpus)."""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4lab import gpus
from nvfp4lab.gpus import CATALOGUE, EFFICIENCY, FIGURES, PATHS

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

#: The table of ../shared/design/gpu-datasheets.md, transcribed by hand:
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
LLAMA8_QKV = (6144, 4096)


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
    if g.native_fp4:
        assert g.capability in gpus.NATIVE_FP4_CAPABILITIES


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="torch lacks FP4 dtype")
@pytest.mark.parametrize("g", ALL, ids=lambda g: g.name)
def test_capability_consistent_with_select_backend(g: gpus.GPU) -> None:
    from nvfp4lab.dispatch import select_backend

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


# -- roofline --------------------------------------------------------------------------------


def test_efficiency_defaults_cite_measurements() -> None:
    assert EFFICIENCY["nvfp4_native"].compute == pytest.approx(5370 / 9000)
    assert EFFICIENCY["bf16"].compute == pytest.approx(1420 / 2250)
    for path in PATHS:
        e = EFFICIENCY[path]
        assert 0 < e.compute <= 1 and 0 < e.memory <= 1
        assert e.compute_source and e.memory_source


#: Published measurements (gpu-datasheets.md notes) -> (GPU, path, TFLOPS, shape M, N, K).
#: B200's were taken at 8192^3; B300's on "5B-model GEMMs" and RTX 5090's in an mma loop, for
#: which the large compute-bound 16384 x 4096 x 4096 stands in. All are kernel-only figures.
PUBLISHED = [
    ("B200", "nvfp4_native", 5370.0, (8192, 8192, 8192)),
    ("B200", "bf16", 1420.0, (8192, 8192, 8192)),
    ("B300", "nvfp4_native", 5100.0, (16384, 4096, 4096)),
    ("B300", "bf16", 1500.0, (16384, 4096, 4096)),
    ("RTX 5090", "nvfp4_native", 1464.0, (16384, 4096, 4096)),
]


@pytest.mark.parametrize(("name", "path", "tflops", "shape"), PUBLISHED)
def test_published_measurements_are_reproduced(
    name: str, path: str, tflops: float, shape: tuple[int, int, int]
) -> None:
    for quantize_activations in (False, True):
        p = gpus.predict(name, *shape, path, quantize_activations=quantize_activations)
        assert p.bound == "compute"
        assert p.tflops == pytest.approx(tflops, rel=0.10)
        assert p.efficiency_source == gpus.efficiency_for(name, path).compute_source
        assert p.efficiency_source and name in p.efficiency_source


def test_every_measurement_has_an_override_with_its_source() -> None:
    for m in gpus.MEASUREMENTS:
        e = gpus.GPU_EFFICIENCY[(m.gpu, m.path)]
        assert e.compute == pytest.approx(m.tflops / m.peak_tflops)
        assert e.compute_source == m.source and m.gpu in m.source
        assert m.peak_tflops == CATALOGUE[m.gpu].peak_tflops(m.path)
    # a BF16 measurement also sets the 16-bit-math paths of that GPU
    assert gpus.efficiency_for("B300", "w4a16").compute == pytest.approx(1500 / 2250)
    assert gpus.efficiency_for("B300", "emulation").compute == pytest.approx(1500 / 2250)


def test_efficiency_falls_back_to_the_path_default() -> None:
    assert gpus.efficiency_for("H100", "bf16") is EFFICIENCY["bf16"]
    assert gpus.efficiency_for("GB300", "nvfp4_native") is EFFICIENCY["nvfp4_native"]
    assert gpus.efficiency_for("RTX 5090", "bf16") is EFFICIENCY["bf16"]
    assert gpus.efficiency_for("B300", "fp8") is EFFICIENCY["fp8"]
    with pytest.raises(ValueError):
        gpus.efficiency_for("B300", "int4")


def test_efficiency_argument_overrides_the_gpu_measurement() -> None:
    p = gpus.predict("B300", 16384, 16384, 16384, "nvfp4_native", efficiency=1.0)
    assert p.bound == "compute"
    assert p.efficiency == 1.0 and p.tflops == pytest.approx(13500)
    assert "given" in p.efficiency_source


def test_peak_tflops_override() -> None:
    with pytest.raises(gpus.NotSupportedError, match="peak_tflops="):
        gpus.predict("DGX Spark", 16384, 4096, 4096, "bf16")
    for path in ("bf16", "fp8", "w4a16", "emulation"):
        p = gpus.predict("DGX Spark", 16384, 4096, 4096, path, peak_tflops=125.0)
        assert p.peak_tflops == 125.0 and math.isfinite(p.time_s) and p.time_s > 0
    p = gpus.predict("DGX Spark", 16384, 4096, 4096, "bf16", peak_tflops=125.0, efficiency=1.0)
    assert p.bound == "compute" and p.tflops == pytest.approx(125.0)
    # it replaces a published peak too, and cannot create FP4 tensor cores
    assert gpus.predict("H100", 8192, 8192, 8192, "bf16", peak_tflops=500.0).peak_tflops == 500.0
    with pytest.raises(gpus.NotSupportedError, match="no FP4 tensor cores"):
        gpus.predict("H100", 16, 64, 64, "nvfp4_native", peak_tflops=5000.0)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="peak_tflops"):
            gpus.predict("DGX Spark", 16, 64, 64, "bf16", peak_tflops=bad)
    block = gpus.predict_block("DGX Spark", "Llama-3-8B", 1, "w4a16", peak_tflops=125.0)
    assert block.peak_tflops == 125.0 and block.bound == "memory"


def test_hand_computed_memory_bound_case() -> None:
    p = gpus.predict("H100 SXM", 1, 4096, 4096, "bf16")
    nbytes = 2 * (4096 + 4096 * 4096 + 4096)
    assert p.bound == "memory"
    assert p.bytes_moved == nbytes
    assert p.time_s == pytest.approx(nbytes / (3.35e12 * EFFICIENCY["bf16"].memory))
    assert p.flops == 2 * 4096 * 4096


def test_hand_computed_compute_bound_case() -> None:
    p = gpus.predict("B200", 8192, 8192, 8192, "nvfp4_native")
    assert p.bound == "compute"
    assert p.tflops == pytest.approx(5370, rel=1e-6)  # the measurement the default came from


@pytest.mark.parametrize("name", ["H100 SXM", "B200", "L4", "RTX 5090", "A100"])
def test_bounds_move_from_memory_to_compute(name: str) -> None:
    N, K = LLAMA8_QKV
    assert gpus.predict(name, 1, N, K, "bf16").bound == "memory"
    assert gpus.predict(name, 16384, N, K, "bf16").bound == "compute"


@pytest.mark.parametrize("g", ALL, ids=lambda g: g.name)
@pytest.mark.parametrize("M", [1, 16, 256, 4096, 16384])
def test_path_orderings(g: gpus.GPU, M: int) -> None:
    if g.bf16_tflops is None:
        pytest.skip("no published BF16 peak")
    N, K = LLAMA8_QKV
    bf16 = gpus.predict(g, M, N, K, "bf16")
    emu = gpus.predict(g, M, N, K, "emulation")
    w4 = gpus.predict(g, M, N, K, "w4a16")
    assert emu.time_s > bf16.time_s  # emulation is never faster than the 16-bit GEMM
    assert w4.time_s <= bf16.time_s  # fewer weight bytes, same math
    for p in (bf16, emu, w4):
        assert p.time_s >= max(p.compute_time_s, p.memory_time_s - p.passes_time_s)
        assert p.tflops <= p.peak_tflops * p.efficiency * (1 + 1e-9)
        assert math.isfinite(p.time_s) and p.time_s > 0
    if g.native_fp4:
        fp4 = gpus.predict(g, M, N, K, "nvfp4_native")
        # at decode sizes both stream 0.5625 B/weight (native also quantizes x): about equal
        assert fp4.time_s <= w4.time_s * 1.01
        if M >= 4096:
            assert fp4.time_s < w4.time_s / 2


def test_native_fp4_raises_clearly_without_fp4_cores() -> None:
    with pytest.raises(gpus.NotSupportedError, match=r"H100 SXM.*no FP4 tensor cores.*w4a16"):
        gpus.predict("h100", 16, 4096, 4096, "nvfp4_native")
    with pytest.raises(ValueError):
        gpus.predict("L4", 16, 4096, 4096, "nvfp4_native")
    with pytest.raises(gpus.NotSupportedError, match="fp8"):
        gpus.predict("A100", 16, 4096, 4096, "fp8")


def test_time_grows_with_m() -> None:
    times = [gpus.predict("B200", m, 4096, 4096, "w4a16").time_s for m in gpus.default_m_grid()]
    assert times == sorted(times)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"path": "int4"},
        {"M": 0},
        {"K": 1.5},
        {"efficiency": 1.5},
        {"mem_efficiency": 0.0},
    ],
)
def test_predict_rejects_bad_arguments(kwargs: dict) -> None:
    args = {"gpu": "B200", "M": 16, "N": 64, "K": 64, "path": "bf16"} | kwargs
    with pytest.raises(ValueError):
        gpus.predict(**args)


def test_supported_paths() -> None:
    assert gpus.supported_paths("A100") == ["bf16", "w4a16", "emulation"]
    assert gpus.supported_paths("B200") == list(PATHS)
    assert gpus.supported_paths("DGX Spark") == ["nvfp4_native"]


# -- model shapes ----------------------------------------------------------------------------


def test_llama_shapes() -> None:
    l8 = {s.layer: (s.N, s.K) for s in gpus.linear_shapes("llama-3-8b")}
    assert l8 == {
        "qkv_proj": (6144, 4096),
        "o_proj": (4096, 4096),
        "gate_up_proj": (28672, 4096),
        "down_proj": (4096, 14336),
    }
    l70 = {s.layer: (s.N, s.K) for s in gpus.linear_shapes("Llama 3 70B")}
    assert l70["qkv_proj"] == (10240, 8192)
    assert l70["gate_up_proj"] == (57344, 8192)
    assert l70["down_proj"] == (8192, 28672)
    with pytest.raises(ValueError, match="Llama-3-8B"):
        gpus.linear_shapes("gpt-5")


def test_m_grid() -> None:
    grid = gpus.default_m_grid()
    assert grid[0] == 1 and grid[-1] == 16384 and len(grid) == 15
    assert gpus.default_m_grid(16, 64) == [16, 32, 64]


def test_predict_block_sums_layers() -> None:
    block = gpus.predict_block("H200", "Llama-3-8B", 1, "w4a16")
    parts = [gpus.predict("H200", 1, s.N, s.K, "w4a16") for s in gpus.linear_shapes("Llama-3-8B")]
    assert block.time_s == pytest.approx(sum(p.time_s for p in parts))
    assert block.flops == pytest.approx(sum(p.flops for p in parts))
    assert block.bound == "memory"


def test_sources_table() -> None:
    rows = gpus.sources_table(["B200"])
    assert len(rows) == len(FIGURES)
    assert all(r["source"] for r in rows)
