"""Modeled/measured tables behind notebooks/03_throughput.ipynb (nvfp4lab.throughput)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

from nvfp4lab import bench, gpus  # noqa: E402
from nvfp4lab import throughput as tp  # noqa: E402


def test_backend_frame_follows_the_native_flag() -> None:
    frame = tp.backend_frame()
    assert list(frame.index) == list(gpus.CATALOGUE)
    for name, row in frame.iterrows():
        native = gpus.get(name).native_fp4
        assert row["modeled_path"] == ("nvfp4_native" if native else "w4a16")
        assert row["with VLLM_USE_NVFP4_CT_EMULATIONS=1"] == "emulation"
        assert row["reason"]


def test_efficiency_frame_shows_per_gpu_overrides() -> None:
    eff = tp.efficiency_frame()
    own = eff[eff["own_measurement"]]
    assert {(r.gpu, r.path) for r in own.itertuples()} == set(gpus.GPU_EFFICIENCY)
    b300 = eff.query("gpu == 'B300' and path == 'nvfp4_native'").iloc[0]
    assert b300["compute"] == pytest.approx(5100 / 13500)
    assert "Transformer Engine" in b300["compute_source"]
    h100 = eff.query("gpu == 'H100 SXM' and path == 'bf16'").iloc[0]
    assert not h100["own_measurement"]
    assert h100["compute"] == gpus.EFFICIENCY["bf16"].compute
    assert eff.query("gpu == 'H100 SXM' and path == 'nvfp4_native'").empty
    assert (eff["compute_source"].str.len() > 0).all()


def test_block_frame_is_modeled_and_skips_impossible_paths() -> None:
    blocks = tp.block_frame(["Llama-3-8B"], ["H100 SXM", "B200"], ms=[1, 4096])
    assert set(blocks["source"]) == {"modeled"}
    assert blocks.query("gpu == 'H100 SXM' and path == 'nvfp4_native'").empty
    assert not blocks.query("gpu == 'B200' and path == 'nvfp4_native'").empty
    assert (blocks["time_s"] > 0).all()


def test_chosen_path_is_never_slower_than_bf16() -> None:
    speedup = tp.chosen_path_speedup(tp.block_frame(["Llama-3-70B"], ms=[1, 64, 16384]))
    assert set(speedup["gpu"]) == {g.name for g in gpus.CATALOGUE.values() if g.bf16_tflops}
    assert (speedup["speedup_vs_bf16"] >= 0.99).all()
    b200 = speedup.query("gpu == 'B200' and M == 16384")["speedup_vs_bf16"].item()
    assert b200 > 3


def _shard(path: Path, rows: list[dict[str, object]]) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=bench.COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(rows)


def _row(op: str, backend: str, median: float, **kw: object) -> dict[str, object]:
    base = {
        "op": op,
        "backend": backend,
        "shape": "16x4096x4096",
        "M": 16,
        "N": 4096,
        "K": 4096,
        "dtype": "bfloat16",
        "median_s": median,
        "tflop_s": 1.0,
        "machine": "m",
        "device_name": "AMD EPYC",
        "capability": "",
    }
    return base | kw


def test_load_and_summarise_measured_shards(tmp_path: Path) -> None:
    _shard(tmp_path / "cpu.csv", [_row("matmul", "torch", 1e-3), _row("linear", "w4a16", 4e-3)])
    gpu = {"machine": "g", "device_name": "NVIDIA H100 80GB HBM3", "capability": "9.0"}
    _shard(
        tmp_path / "gpu.csv",
        [_row("matmul", "torch", 1e-4, **gpu), _row("linear", "emulation", 5e-4, **gpu)],
    )
    measured = tp.load_measured(tmp_path)
    assert len(measured) == 4 and set(measured["source"]) == {"measured"}
    assert set(measured["shard"]) == {"cpu", "gpu"}
    summary = tp.measured_linear_summary(measured)
    w4 = summary.query("machine == 'm' and backend == 'w4a16'")["x_matmul_time"].item()
    assert w4 == pytest.approx(4.0)
    compare = tp.measured_vs_modeled(measured)
    assert set(compare["gpu"]) == {"H100 SXM"}  # the CPU shard has no model
    assert set(compare["path"]) == {"bf16", "emulation"}
    assert (compare["modeled_s"] > 0).all()


def test_load_measured_of_nothing_is_empty(tmp_path: Path) -> None:
    assert tp.load_measured(tmp_path).empty
    assert tp.measured_linear_summary(tp.load_measured(tmp_path)).empty


def test_figures_have_titles_and_labels() -> None:
    import matplotlib

    matplotlib.use("Agg")
    blocks = tp.block_frame(["Llama-3-8B"], ms=[1, 256, 4096])
    fig = tp.plot_block_times(blocks, "Llama-3-8B", ["H100 SXM", "B200"])
    assert "Modeled" in fig._suptitle.get_text()
    assert all(ax.get_xlabel() and ax.get_ylabel() for ax in fig.axes if ax.get_visible())
    fig2 = tp.plot_chosen_speedup(tp.chosen_path_speedup(blocks), "Llama-3-8B")
    ax = fig2.axes[0]
    assert ax.get_title() and "modeled" in ax.get_ylabel()
