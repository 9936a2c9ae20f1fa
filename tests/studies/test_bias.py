"""The bias-study helpers behind notebooks/02_bias_study.ipynb."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab.studies import bias as bias_study
from tests.studies.widgets import control, text


def test_sweep_rows_and_ordering() -> None:
    layer = bias_study.make_layer(16, 32, 64, dtype=torch.bfloat16, seed=0)
    rows = bias_study.bias_sweep(layer, (0.0, 1.0, 10.0))
    assert len(rows) == 3 * (1 + 2 * 3)  # float + 2 backends x 3 modes, per scale
    by = {(r["backend"], r["mode"], r["bias_scale"]): r for r in rows}
    for backend in ("emulation", "w4a16"):
        # no bias: every epilogue gives the same result
        assert by[(backend, "dropped", 0.0)]["sqnr_db"] == by[(backend, "output", 0.0)]["sqnr_db"]
        # a large dropped bias ruins the layer; a kept bias improves the SQNR (exact signal)
        assert by[(backend, "dropped", 10.0)]["sqnr_db"] < 1.0
        assert by[(backend, "output", 10.0)]["sqnr_db"] > by[(backend, "output", 0.0)]["sqnr_db"]
        assert by[(backend, "fp32", 1.0)]["epilogue_rel_rms"] == 0.0
    assert by[("float", "float", 1.0)]["sqnr_db"] > 40


def test_dropped_bias_check() -> None:
    layer = bias_study.make_layer(16, 32, 64, dtype=torch.float16, seed=1)
    rows = bias_study.dropped_bias_check(layer, (0.0, 0.3, 3.0))
    assert all(r["output_is_dropped_plus_bias"] for r in rows)
    for r in rows:
        assert r["nmse_dropped"] == pytest.approx(r["nmse_predicted"], rel=0.05, abs=1e-3)


def test_figures() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layer = bias_study.make_layer(16, 32, 64, seed=2)
    rows = bias_study.bias_sweep(layer, (0.0, 1.0), backends=("emulation",))
    for fig in (
        bias_study.plot_sqnr_vs_bias(rows),
        bias_study.plot_epilogue_rounding({"bfloat16": rows}),
    ):
        ax = fig.axes[0]
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
        plt.close(fig)
    out = bias_study.run_layer(layer, 1.0, bias_mode="fp32")
    assert out.shape == (16, 32) and out.dtype == torch.bfloat16


# -- explorer --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layer() -> bias_study.BiasLayer:
    return bias_study.make_layer(32, 64, 128, dtype=torch.bfloat16, seed=0)  # notebook SMOKE


def test_bias_explorer_matches_the_sweep(layer: bias_study.BiasLayer) -> None:
    rows = bias_study.bias_sweep(layer, [1.0, 10.0])
    sqnr = {(r["bias_scale"], r["backend"], r["mode"]): r["sqnr_db"] for r in rows}
    box = bias_study.bias_explorer(layer)
    assert f"SQNR vs float layer: {sqnr[1.0, 'emulation', 'output']:.2f} dB" in text(box)
    assert f"(ceiling): {sqnr[1.0, 'float', 'float']:.2f} dB" in text(box)
    control(box, "bias_mode").value = "dropped"
    control(box, "bias scale").value = 10.0
    assert f"SQNR vs float layer: {sqnr[10.0, 'emulation', 'dropped']:.2f} dB" in text(box)
    assert sqnr[10.0, "emulation", "dropped"] < 1.0  # the seed bug: almost all signal lost
    control(box, "backend").value = "w4a16"
    assert text(box) == bias_study.bias_text(layer, 10.0, "dropped", "w4a16") + "\n"
    assert f"{sqnr[10.0, 'w4a16', 'dropped']:.2f} dB" in text(box)


