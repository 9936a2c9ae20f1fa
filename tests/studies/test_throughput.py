"""Modeled/measured tables behind notebooks/03_throughput.ipynb (nvfp4lab.studies.throughput)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

from nvfp4lab import gpus, roofline  # noqa: E402
from nvfp4lab.bench.store import COLUMNS, read_shards  # noqa: E402
from nvfp4lab.studies import throughput as tp  # noqa: E402
from tests.studies.widgets import control, text  # noqa: E402


def test_backend_frame_follows_the_native_flag() -> None:
    frame = tp.backend_frame()
    assert list(frame.index) == list(gpus.CATALOGUE)
    for name, row in frame.iterrows():
        native = gpus.get(name).native_fp4
        assert row["modeled_path"] == ("native" if native else "w4a16")
        # the seed's switch, under the seed's rules (vLLM 0.9.2): emulation everywhere here
        assert row[tp.SWITCH_COLUMN] == "emulation"
        assert "0.9.2" in tp.SWITCH_COLUMN and "VLLM_USE_NVFP4_CT_EMULATIONS=1" in tp.SWITCH_COLUMN
        assert row["with --linear-backend emulation"] == "emulation"  # its 0.33.0 replacement
        # vLLM 0.33.0's kernels (kernels/linear/__init__.py@0.33.0, default install)
        cap = gpus.get(name).capability
        want = ("FlashInferCuteDsl" if cap[0] == 10 else "FlashInferCutlass" if native
                else "Humming" if cap == (9, 0) else "Marlin")
        assert row["vllm_kernel"] == want + "NvFp4LinearKernel"
        assert row["reason"]


def test_efficiency_frame_shows_per_gpu_overrides() -> None:
    eff = tp.efficiency_frame()
    own = eff[eff["own_measurement"]]
    assert {(r.gpu, r.path) for r in own.itertuples()} == set(roofline.GPU_EFFICIENCY)
    b300 = eff.query("gpu == 'B300' and path == 'native'").iloc[0]
    assert b300["compute"] == pytest.approx(5100 / 13500)
    assert "Transformer Engine" in b300["compute_source"]
    h100 = eff.query("gpu == 'H100 SXM' and path == 'bf16'").iloc[0]
    assert not h100["own_measurement"]
    assert h100["compute"] == roofline.EFFICIENCY["bf16"].compute
    assert eff.query("gpu == 'H100 SXM' and path == 'native'").empty
    assert (eff["compute_source"].str.len() > 0).all()


def test_block_frame_is_modeled_and_skips_impossible_paths() -> None:
    blocks = tp.block_frame(["Llama-3-8B"], ["H100 SXM", "B200"], ms=[1, 4096])
    assert set(blocks["source"]) == {"modeled"}
    assert blocks.query("gpu == 'H100 SXM' and path == 'native'").empty
    assert not blocks.query("gpu == 'B200' and path == 'native'").empty
    assert (blocks["time_s"] > 0).all()


def test_chosen_path_is_never_slower_than_bf16() -> None:
    speedup = tp.chosen_path_speedup(tp.block_frame(["Llama-3-70B"], ms=[1, 64, 16384]))
    assert set(speedup["gpu"]) == {g.name for g in gpus.CATALOGUE.values() if g.bf16_tflops}
    assert (speedup["speedup_vs_bf16"] >= 0.99).all()
    b200 = speedup.query("gpu == 'B200' and M == 16384")["speedup_vs_bf16"].item()
    assert b200 > 3


def _shard(path: Path, rows: list[dict[str, object]]) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, restval="")
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
    measured = read_shards(tmp_path)
    assert len(measured) == 4 and set(measured["source"]) == {"measured"}
    assert set(measured["shard"]) == {"cpu", "gpu"}
    summary = tp.measured_linear_summary(measured)
    w4 = summary.query("machine == 'm' and backend == 'w4a16'")["x_matmul_time"].item()
    assert w4 == pytest.approx(4.0)
    compare = tp.measured_vs_modeled(measured)
    assert set(compare["gpu"]) == {"H100 SXM"}  # the CPU shard has no model
    assert set(compare["path"]) == {"bf16", "emulation"}
    assert (compare["modeled_s"] > 0).all()


def test_fused_linear_rows_are_their_own_backend(tmp_path: Path) -> None:
    rows = [
        _row("matmul", "torch", 1e-3),
        _row("linear", "w4a16", 8e-3, path="eager"),
        _row("linear", "w4a16", 2e-3, path="fused"),
        _row("linear", "w4a16", 1.5e-3, path="default"),
    ]
    _shard(tmp_path / "cpu.csv", rows)
    summary = tp.measured_linear_summary(read_shards(tmp_path)).set_index("backend")
    assert summary.loc["w4a16", "x_matmul_time"] == pytest.approx(8.0)
    assert summary.loc["w4a16 (fused)", "x_matmul_time"] == pytest.approx(2.0)
    assert summary.loc["w4a16 (default)", "x_matmul_time"] == pytest.approx(1.5)


def test_read_shards_of_nothing_is_empty(tmp_path: Path) -> None:
    assert read_shards(tmp_path).empty
    assert tp.measured_linear_summary(read_shards(tmp_path)).empty


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


# -- explorer --------------------------------------------------------------------------------------


def test_roofline_table() -> None:
    table = tp.roofline_table("H100 SXM", "Llama-3-8B", 4096)
    shapes = roofline.linear_shapes("Llama-3-8B")
    assert list(table.index) == [*(s.layer for s in shapes), "block total"]
    assert list(table.columns) == ["bf16", "fp8", "w4a16", "emulation"]  # no FP4 cores
    qkv = shapes[0]
    expected = roofline.predict("H100 SXM", 4096, qkv.N, qkv.K, "bf16").time_s * 1e6
    assert table.loc["qkv_proj", "bf16"] == pytest.approx(expected, rel=1e-12)
    block = roofline.predict_block("H100 SXM", "Llama-3-8B", 4096, "w4a16").time_s * 1e6
    assert table.loc["block total", "w4a16"] == pytest.approx(block, rel=1e-12)


def test_roofline_explorer_follows_its_controls() -> None:
    m_grid = [1, 16, 256, 4096]  # notebook SMOKE grid
    box = tp.roofline_explorer(["Llama-3-8B", "Llama-3-70B"], m_grid)
    assert "B200: backend 'native' → roofline path 'native'" in text(box)
    assert "M = 256" in text(box) and "native" in box.children[-1].outputs[1]["data"][
        "text/html"]
    control(box, "GPU").value = "H100 SXM"
    control(box, "model").value = "Llama-3-70B"
    control(box, "tokens M").value = 4096
    shown = text(box)
    assert "H100 SXM: backend 'w4a16' → roofline path 'w4a16'" in shown
    assert "Llama-3-70B block at M = 4096" in shown
    table = tp.roofline_table("H100 SXM", "Llama-3-70B", 4096)
    assert table.to_string(float_format="{:.4g}".format) in shown
    assert "native" not in shown.split("µs:")[1]




def test_published_frame_is_the_third_kind_of_number() -> None:
    frame = tp.published_frame()
    assert set(frame["source"]) == {"published measured"}
    assert len(frame) == len(roofline.PUBLISHED) and frame["reference"].str.len().min() > 10
    shaped = frame.dropna(subset=["modeled_tflops"])
    beats = shaped[shaped["beats_ideal"].astype(bool)]
    assert list(zip(beats["gpu"], beats["path"], strict=True)) == [("RTX 5090", "bf16")]
    b200 = shaped.query("gpu == 'B200' and path == 'native' and shape == '8192x8192x8192'")
    assert float(b200["published/modeled"].iloc[0]) == pytest.approx(1.0)  # sets the efficiency
    fig = tp.plot_published_vs_modeled(frame)
    ax = fig.axes[0]
    assert ax.get_title() and "TFLOPS" in ax.get_xlabel() and "published" in ax.get_ylabel()


# -- absent paths are said, legends off the data, a narrow published table ----------------------


def test_absent_paths_are_named_with_their_reason() -> None:
    spark, l40s = "DGX Spark (GB10)", "L40S"
    assert tp.absent_reason(spark, "native") is None
    assert "unpublished" in tp.absent_reason(spark, "bf16")
    assert "no FP4 tensor cores" in tp.absent_reason(l40s, "native")
    assert tp.absent_reason("B200", "bf16") is None
    note = tp.absent_note([spark, l40s, "B200"])
    assert "DGX Spark (GB10): no bf16, w4a16, emulation (BF16 dense peak: unpublished)" in note
    assert "L40S: no native (no FP4 tensor cores, cc 8.9)" in note and "B200" not in note
    # llama.cpp's q8_0 path runs on INT8 math: not among the paths this study models
    assert "q8_0" not in tp.MODELLED_PATHS
    assert tp.absent_reason("B200", "q8_0") == "INT8 dense peak: not in the catalogue"
    # the explorer's caption says which columns are absent and why
    caption = tp.roofline_caption(spark, "Llama-3-8B", 16)
    table = tp.roofline_table(spark, "Llama-3-8B", 16)
    assert list(table.columns) == ["native"]
    for path in ("bf16", "fp8", "w4a16", "emulation"):
        assert path in caption.split("Modeled")[0]
    assert "unpublished" in caption
    assert "no native (no FP4 tensor cores" in tp.roofline_caption(l40s, "Llama-3-8B", 16)


def test_speedup_figure_says_which_gpus_it_leaves_out() -> None:
    import matplotlib

    matplotlib.use("Agg")
    blocks = tp.block_frame(["Llama-3-8B"], ms=[1, 256])
    speedup = tp.chosen_path_speedup(blocks)
    assert "DGX Spark (GB10)" not in set(speedup["gpu"])
    caption = tp.speedup_caption(speedup, "Llama-3-8B")
    assert caption.startswith("Not shown") and "DGX Spark (GB10)" in caption
    assert "BF16 dense peak: unpublished" in caption
    fig = tp.plot_chosen_speedup(speedup, "Llama-3-8B")
    assert "DGX Spark (GB10)" in fig.get_supxlabel()
    fig = tp.plot_block_times(blocks, "Llama-3-8B", ["L40S", "B200"])
    assert "L40S: no native" in " ".join(fig.get_supxlabel().split())
    matplotlib.pyplot.close("all")


def test_legends_leave_the_data_uncovered() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    from nvfp4lab import plots
    from tests.studies.figures import legend_hits

    blocks = tp.block_frame(["Llama-3-8B"], ms=[1, 16, 256, 4096])
    summary = pd.DataFrame({
        "machine": ["cpu"] * 4, "backend": ["emulation", "emulation", "w4a16", "w4a16"],
        "shape": ["16x4096x4096", "1x4096x4096"] * 2, "x_matmul_time": [30.0, 12.0, 3.0, 2.0],
    })
    with plots.style_context():
        figures = [tp.plot_published_vs_modeled(tp.published_frame()),
                   tp.plot_chosen_speedup(tp.chosen_path_speedup(blocks), "Llama-3-8B"),
                   tp.plot_block_times(blocks, "Llama-3-8B"), tp.plot_measured(summary)]
        for fig in figures:
            assert legend_hits(fig) == [], fig.axes[0].get_title()
    matplotlib.pyplot.close("all")


def test_published_table_is_narrow() -> None:
    published = tp.published_frame()
    table, notes = tp.published_table(published)
    assert len(table) == len(published) and table.index.names == ["gpu", "path", "shape"]
    assert len(table.columns) <= 7 and "caveat" not in table.columns
    assert all(len(str(c)) <= 15 for c in table.columns)
    assert len(notes) == published["caveat"].replace("", None).dropna().nunique()
    first = next(n for n in table["note"] if n != "")
    assert notes[first - 1].startswith(f"[{first}] ")
