"""The timeline study: rows against facts read in vLLM's wheels, figures, the merge demo, the
explorer."""

from __future__ import annotations

import math

import pytest

from nvfp4lab.settings import EMULATION_ENV
from nvfp4lab.studies import timeline as tl

RELEASES = ["0.9.1", "0.9.2", "0.16.0", "0.23.0", "0.24.0", "0.33.0"]
GPUS = ["A100 SXM 80GB", "H100 SXM", "B200"]


@pytest.fixture(scope="module")
def rows() -> list[dict[str, object]]:
    return tl.timeline_rows(RELEASES, GPUS)


def _kernel(rows, release: str, gpu: str, scenario: str = "default") -> str:
    (row,) = [r for r in rows if (r["release"], r["gpu"], r["scenario"]) == (release, gpu,
                                                                            scenario)]
    return str(row["kernel"]).replace("NvFp4LinearKernel", "")


def test_rows_follow_the_released_code(rows) -> None:
    assert len(rows) == len(RELEASES) * len(GPUS) * len(tl.SCENARIOS)
    switch = f"{EMULATION_ENV}=1"
    # compressed_tensors_w4a4_nvfp4.py@0.9.1: automatic emulation below cc 10.0, bias dropped
    assert _kernel(rows, "0.9.1", "H100 SXM") == "Emulation"
    assert _kernel(rows, "0.9.1", "B200") == "Cutlass"
    # compressed_tensors.py@0.9.2: Marlin fallback unless the switch is on
    assert _kernel(rows, "0.9.2", "H100 SXM") == "Marlin"
    assert _kernel(rows, "0.9.2", "H100 SXM", switch) == "Emulation"
    # the switch is read through 0.23.0 and ignored from 0.24.0 (envs.py@0.24.0)
    assert _kernel(rows, "0.23.0", "B200", switch) == "Emulation"
    assert _kernel(rows, "0.24.0", "B200", switch) == _kernel(rows, "0.24.0", "B200")
    # kernels/linear/__init__.py@0.33.0 with humming installed: Humming on sm_90
    assert _kernel(rows, "0.33.0", "H100 SXM") == "Humming"
    assert _kernel(rows, "0.33.0", "A100 SXM 80GB", "NVFP4A16 checkpoint") == "Marlin"
    # --linear-backend exists from 0.22.0 only: before, the scenario is the default launch
    flag = "--linear-backend emulation"
    assert _kernel(rows, "0.16.0", "B200", flag) == _kernel(rows, "0.16.0", "B200")
    assert _kernel(rows, "0.33.0", "B200", flag) == "Emulation"
    ignored = [r for r in rows if r["release"] == "0.33.0" and r["scenario"] == switch]
    assert all("not read it since 0.24.0" in str(r["ignored"]) for r in ignored)


def test_windows_and_variables(rows) -> None:
    windows = tl.bias_windows(rows)
    assert windows == {"bias dropped": ["0.9.1"], "wrong weights": ["0.16.0"]}
    table = {r["variable"]: r for r in tl.variable_table()}
    assert table[EMULATION_ENV]["ignored from"] == "0.24.0"
    assert table[EMULATION_ENV]["instead"] == "--linear-backend emulation"
    assert table["VLLM_BATCH_INVARIANT"]["last read"].startswith("still read")


def test_platform_rows() -> None:
    plat = tl.platform_rows(["0.19.1", "0.33.0"], ["default", "VLLM_BATCH_INVARIANT=1"])
    by = {(r["target"], r["release"], r["scenario"]): r for r in plat}
    assert by["rocm", "0.33.0", "default"]["kernel"] == "EmulationNvFp4LinearKernel"
    for target in ("xpu", "cpu"):
        default = by[target, "0.33.0", "default"]
        assert default["kernel"] == "none" and default["error"].startswith("Failed to find")
        assert default["nvfp4lab"] == "w4a16"
        forced = by[target, "0.33.0", "VLLM_BATCH_INVARIANT=1"]
        assert forced["kernel"] == "EmulationNvFp4LinearKernel"


def test_llama_cpp_rows_sit_beside_vllm() -> None:
    rows = tl.llama_cpp_rows(["H100 SXM", "B200", "RTX 5090"])
    by = {r["target"]: r for r in rows}
    assert list(by) == ["H100 SXM", "B200", "RTX 5090", "cpu"]
    # B200: vLLM's FP4 kernel, llama.cpp's MMQ with Q8_1 activations (its FP4 MMA is sm_120's)
    assert by["B200"]["vLLM numerics"] == "native" and by["B200"]["llama.cpp numerics"] == "q8_1"
    assert by["B200"]["llama.cpp path"] == "CUDA MMQ NVFP4xQ8_1"
    assert by["B200"]["nvfp4lab for llama.cpp"] == "q8_0"
    assert by["RTX 5090"]["llama.cpp path"] == "Blackwell native FP4 MMA"
    assert by["H100 SXM"]["vLLM kernel"] == "Humming"
    cpu = by["cpu"]
    assert cpu["vLLM kernel"] == "none" and cpu["llama.cpp path"] == "CPU NVFP4xQ8_0"
    assert cpu["nvfp4lab for llama.cpp"] == "q8_0" and cpu["capability"] == ""


def test_merge_demo_is_exact() -> None:
    rows = tl.merge_demo(seed=1, k=64)
    by = {(r["format"], r["shard"]): r for r in rows}
    # CT keeps 1/max(encode) = q_proj's scale; ModelOpt max(decode) = v_proj's (amax 1, 2, 4)
    assert math.isinf(by["compressed-tensors", "q_proj"]["weight_sqnr_db"])
    assert math.isinf(by["modelopt", "v_proj"]["weight_sqnr_db"])
    assert by["compressed-tensors", "v_proj"]["factor"] == pytest.approx(0.25, rel=1e-6)
    assert by["modelopt", "q_proj"]["factor"] == pytest.approx(4.0, rel=1e-6)
    # a uniform scale error f gives NMSE (f - 1)^2 exactly, up to float32 rounding
    assert by["modelopt", "q_proj"]["weight_nmse"] == pytest.approx(9.0, rel=1e-5)


def test_figures(rows) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for fig in (tl.plot_timeline(rows, f"{EMULATION_ENV}=1"),
                tl.plot_merge_error(tl.merge_demo(k=32))):
        ax = fig.axes[0]
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
        plt.close(fig)


def test_explorer() -> None:
    from tests.studies.widgets import control, text

    box = tl.timeline_explorer(RELEASES)
    # the slider starts at the first release, so dragging right walks forward
    assert control(box, "vLLM").value == RELEASES[0] and "vLLM 0.9.1" in text(box)
    control(box, "vLLM").value = "0.33.0"
    assert "HummingNvFp4LinearKernel" in text(box) and "vLLM 0.33.0" in text(box)
    control(box, "vLLM").value = "0.9.2"
    control(box, "scenario").value = f"{EMULATION_ENV}=1"
    assert text(box).startswith(tl.choice_text("0.9.2", "H100 SXM", f"{EMULATION_ENV}=1"))
    assert "EmulationNvFp4LinearKernel" in text(box)
    control(box, "target").value = "xpu"
    assert text(box).startswith(tl.choice_text("0.9.2", "xpu", f"{EMULATION_ENV}=1"))


@pytest.mark.parametrize("target", ["xpu", "cpu"])
def test_choice_text_names_the_platform_and_wraps(target: str) -> None:
    shown = tl.choice_text("0.33.0", target, "default")
    assert f"{target} is not a CUDA device" in shown
    if target == "xpu":
        assert "cpu is not a CUDA device" not in shown
    # the empty reason list of vLLM's error is said, never left dangling
    assert "Reasons: (none listed" in " ".join(shown.split())
    long = tl.choice_text("0.33.0", "H100 SXM", "default")
    assert len(long) > 900 and max(len(line) for line in long.splitlines()) <= 100


def test_kernel_tables_are_narrow_and_cover_every_release(rows) -> None:
    table = tl.kernel_table(rows, "gpu")
    assert list(table.columns) == GPUS  # a few columns, not (scenario × gpu)
    assert list(table.index.names) == ["scenario", "releases"]
    for scenario in tl.SCENARIOS:
        spans = list(table.loc[scenario].index)
        assert spans[0].startswith(RELEASES[0]) and spans[-1].endswith(RELEASES[-1])
    assert table.loc["default"].iloc[-1]["H100 SXM"] == "Humming"  # the suffix is dropped
    plat = tl.kernel_table(tl.platform_rows(RELEASES), "target")
    assert list(plat.columns) == ["rocm", "xpu", "cpu"]


def test_timeline_figure_emits_no_layout_warning(rows) -> None:
    pytest.importorskip("matplotlib")
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nvfp4lab import plots

    with plots.style_context(), warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = tl.plot_timeline(rows, "default")
        fig.canvas.draw()
    assert fig.get_layout_engine().__class__.__name__ == "ConstrainedLayoutEngine"
    plt.close(fig)
