"""nvfp4lab.widgets: the notebook explorers, built without a kernel and driven by their controls."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nvfp4lab import bias_study, gpus, widgets
from nvfp4lab import format_study as fs

pytest.importorskip("ipywidgets")
pytest.importorskip("pandas")


def _control(box: Any, description: str) -> Any:
    (found,) = [c for c in box.children if getattr(c, "description", None) == description]
    return found


def _text(box: Any) -> str:
    """Everything the explorer's Output (the last child) holds, as plain text."""
    out = box.children[-1]
    return "".join(
        o["text"] if o["output_type"] == "stream" else o["data"]["text/plain"] for o in out.outputs
    )


# -- 01: rounding -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "code", "element", "lower", "upper", "tie"),
    [
        (1.25, 2, 1.0, 1.0, 1.5, True),  # tie between 1 and 1.5 -> even code
        (-0.1, 8, -0.0, -0.5, 0.0, False),  # negative zero
        (-0.25, 8, -0.0, -0.5, 0.0, True),
        (2.5, 4, 2.0, 2.0, 3.0, True),
        (2.6, 5, 3.0, 2.0, 3.0, False),
        (1.0, 2, 1.0, 1.0, 1.0, False),  # on the grid
        (6.9, 7, 6.0, 6.0, 6.0, False),  # saturates
        (-7.0, 15, -6.0, -6.0, -6.0, False),
    ],
)
def test_rounding_info(
    x: float, code: int, element: float, lower: float, upper: float, tie: bool
) -> None:
    r = widgets._rounding_info(x)
    assert (r.code, r.element, r.lower, r.upper, r.tie) == (code, element, lower, upper, tie)
    assert str(r.element) == str(element)  # the sign of zero too
    assert r.saturated == (abs(x) > 6)


def test_rounding_with_block_scale() -> None:
    r = widgets._rounding_info(2.5, block_scale=0.5)  # x/s = 5: tie between 4 and 6 -> 4
    assert (r.scaled, r.code, r.element, r.dequantized, r.tie) == (5.0, 6, 4.0, 2.0, True)
    with pytest.raises(ValueError, match="block_scale > 0"):
        widgets._rounding_info(1.0, block_scale=0.0)


def test_rounding_text() -> None:
    text = widgets._rounding_text(-0.1)
    assert "code 8 = 0b1000" in text and "negative zero" in text
    assert "between grid points -0.5 and +0" in text
    assert "neighbours +0.5 and +1.5" in widgets._rounding_text(1.0)
    assert "saturates to +6" in widgets._rounding_text(6.9)


def test_rounding_explorer_follows_its_sliders() -> None:
    box = widgets.rounding_explorer()
    assert "E2M1 +1  →  code 2 " in _text(box)  # default 1.25
    _control(box, "x").value = -0.1
    assert _text(box) == widgets._rounding_text(-0.1, 1.0) + "\n"
    assert "code 8" in _text(box)
    scale = _control(box, "block scale s")
    assert scale.value == 1.0 and 448.0 in scale.options[-1]
    _control(box, "x").value = 3.0
    scale.value = 0.5
    assert "x/s = +6" in _text(box) and "x̂ = E2M1·s = +3" in _text(box)


# -- 02: bias ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layer() -> bias_study.BiasLayer:
    return bias_study.make_layer(32, 64, 128, dtype=torch.bfloat16, seed=0)  # notebook SMOKE


def test_bias_explorer_matches_the_sweep(layer: bias_study.BiasLayer) -> None:
    rows = bias_study.bias_sweep(layer, [1.0, 10.0])
    sqnr = {(r["bias_scale"], r["backend"], r["mode"]): r["sqnr_db"] for r in rows}
    box = widgets.bias_explorer(layer)
    assert f"SQNR vs float layer: {sqnr[1.0, 'emulation', 'output']:.2f} dB" in _text(box)
    assert f"(ceiling): {sqnr[1.0, 'float', 'float']:.2f} dB" in _text(box)
    _control(box, "bias_mode").value = "dropped"
    _control(box, "bias scale").value = 10.0
    assert f"SQNR vs float layer: {sqnr[10.0, 'emulation', 'dropped']:.2f} dB" in _text(box)
    assert sqnr[10.0, "emulation", "dropped"] < 1.0  # the seed bug: almost all signal lost
    _control(box, "backend").value = "w4a16"
    assert _text(box) == widgets._bias_text(layer, 10.0, "dropped", "w4a16") + "\n"
    assert f"{sqnr[10.0, 'w4a16', 'dropped']:.2f} dB" in _text(box)


# -- 03: roofline -----------------------------------------------------------------------------


def test_roofline_table() -> None:
    table = widgets._roofline_table("H100 SXM", "Llama-3-8B", 4096)
    shapes = gpus.linear_shapes("Llama-3-8B")
    assert list(table.index) == [*(s.layer for s in shapes), "block total"]
    assert list(table.columns) == ["bf16", "fp8", "w4a16", "emulation"]  # no FP4 cores
    qkv = shapes[0]
    expected = gpus.predict("H100 SXM", 4096, qkv.N, qkv.K, "bf16").time_s * 1e6
    assert table.loc["qkv_proj", "bf16"] == pytest.approx(expected, rel=1e-12)
    block = gpus.predict_block("H100 SXM", "Llama-3-8B", 4096, "w4a16").time_s * 1e6
    assert table.loc["block total", "w4a16"] == pytest.approx(block, rel=1e-12)


def test_roofline_explorer_follows_its_controls() -> None:
    m_grid = [1, 16, 256, 4096]  # notebook SMOKE grid
    box = widgets.roofline_explorer(["Llama-3-8B", "Llama-3-70B"], m_grid)
    assert "B200: backend 'native' → path 'nvfp4_native'" in _text(box)
    assert "M = 256" in _text(box) and "nvfp4_native" in box.children[-1].outputs[1]["data"][
        "text/html"]
    _control(box, "GPU").value = "H100 SXM"
    _control(box, "model").value = "Llama-3-70B"
    _control(box, "tokens M").value = 4096
    text = _text(box)
    assert "H100 SXM: backend 'w4a16' → path 'w4a16'" in text
    assert "Llama-3-70B block at M = 4096" in text
    table = widgets._roofline_table("H100 SXM", "Llama-3-70B", 4096)
    assert table.to_string(float_format="{:.4g}".format) in text
    assert "nvfp4_native" not in text.split("µs:")[1]


# -- 04: formats ------------------------------------------------------------------------------

SHAPE = (32, 256)


def test_format_explorer_matches_error_rows() -> None:
    configs = fs.default_configs(0, fast=True)
    box = widgets.format_explorer(configs, seed=0, df=3, shape=SHAPE)
    assert list(_control(box, "config").options) == [c.label for c in configs]
    assert _text(box).startswith("nvfp4 on normal × 10^0 (32×256): NMSE")

    _control(box, "config").value = "mxfp4"
    _control(box, "distribution").value = "student_t"
    _control(box, "log10 |x| scale").value = 2.0
    x = fs.sample("student_t", SHAPE, seed=0, df=3) * 100.0
    (row,) = fs.error_rows(x, [c for c in configs if c.label == "mxfp4"], "student_t")
    assert row["bits"] == 4.25
    assert _text(box) == (
        f"mxfp4 on student_t(ν=3) × 10^2 (32×256): NMSE {row['nmse']:.3e} | "
        f"SQNR {row['sqnr_db']:.2f} dB | 4.250 bits/element\n"
    )


def test_format_text_shows_tensor_scale_underflow() -> None:
    (no_gs,) = [c for c in fs.default_configs(0, fast=True) if c.label == "nvfp4 no tensor scale"]
    row = widgets._format_row(no_gs, "normal", -5.0, seed=0, df=3, shape=SHAPE)
    assert row["nmse"] > 0.5  # E4M3 block scales alone underflow at 1e-5
    assert f"NMSE {row['nmse']:.3e}" in widgets._format_text(
        no_gs, "normal", -5.0, seed=0, df=3, shape=SHAPE
    )


def test_errors_are_shown_in_the_output() -> None:
    box = widgets.format_explorer(fs.default_configs(0, fast=True), seed=0, df=0, shape=SHAPE)
    (out,) = box.children[-1].outputs
    assert out["name"] == "stderr" and "df must be a positive integer" in out["text"]
    with pytest.raises(ValueError, match="at least one config"):
        widgets.format_explorer([], seed=0, df=3)
