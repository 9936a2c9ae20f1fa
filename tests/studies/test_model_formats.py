"""nvfp4lab.studies.model_formats: MiniLM through every path, format and option (notebook 05)."""

from __future__ import annotations

import warnings

import pytest
import torch

from nvfp4lab import fake_quantize, formats, metrics, models
from nvfp4lab.execution import DroppedBiasWarning
from nvfp4lab.studies import model_fidelity as study
from nvfp4lab.studies import model_formats as mf
from nvfp4lab.studies.number_formats import StudyConfig
from tests.conftest import needs_minilm

NAMES = {
    "encoder.layer.3.attention.self.query": "3.query",
    "encoder.layer.3.attention.output.dense": "3.attn_out",
    "encoder.layer.3.intermediate.dense": "3.ffn_in",
    "encoder.layer.3.output.dense": "3.ffn_out",
    "pooler.dense": "pooler",
    "lm_head": "lm_head",
}


def test_short_names() -> None:
    assert {n: mf.short_name(n) for n in NAMES} == NAMES


def test_configs() -> None:
    paths = mf.path_configs()
    assert [c.bias_mode for c in paths] == ["output", "output", "fp32", "dropped"]
    assert [c.backend for c in paths] == ["w4a16"] + ["emulation"] * 3
    labels = [c.label for c in mf.layer_formats(0)]
    assert "nvfp4 mse_search" in labels and "nvfp4 mse_search" not in [
        c.label for c in mf.layer_formats(0, fast=True)]
    configs = mf.format_configs(0, formats=mf.layer_formats(0)[4:6])  # 16×16 tiles, mxfp4
    assert [c.label for c in configs] == ["nvfp4 16×16 blocks W", "nvfp4 16×16 blocks W+A",
                                          "mxfp4 W", "mxfp4 W+A"]
    tiles = configs[1]
    assert tiles.weights is not None and tiles.weights.options == {"block_size": (16, 16)}
    assert tiles.activations is not None and tiles.activations.options == {}  # 1-D for tokens
    assert configs[0].activations is None and configs[0].kind == "format"


@needs_minilm
def test_format_config_build(encoder: models.SentenceEncoder) -> None:
    name = "encoder.layer.1.intermediate.dense"
    cfg = mf.ModelConfig("nvfp4 W+A", StudyConfig("nvfp4", "nvfp4"), StudyConfig("nvfp4", "nvfp4"))
    before = encoder.model.get_submodule(name).weight.detach().clone()
    built = cfg.build(encoder)
    assert torch.equal(encoder.model.get_submodule(name).weight, before)  # float untouched
    layer = built.model.get_submodule(name)
    assert torch.equal(layer.weight, fake_quantize(before))
    x = torch.randn(3, 5, 384, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = torch.nn.functional.linear(fake_quantize(x), layer.weight, layer.bias)
        torch.testing.assert_close(layer(x), want, rtol=0, atol=0)


@needs_minilm
def test_config_rows(encoder: models.SentenceEncoder) -> None:
    configs = [*mf.path_configs(), mf.ModelConfig("bf16 W", StudyConfig("bf16", "bf16"))]
    keep: dict[str, models.SentenceEncoder] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DroppedBiasWarning)  # silenced inside the study
        rows = {r["label"]: r for r in mf.config_rows(encoder, configs, keep=keep)}
    assert set(keep) == set(rows)
    w4a16 = rows["nvfp4 w4a16"]
    assert 0.97 < w4a16["cosine_mean"] < 0.985 and w4a16["recall"] >= 0.9  # measured 0.9767
    assert w4a16["cosine_gap"] == pytest.approx(1 - w4a16["cosine_mean"])
    emulated = rows["nvfp4 W4A4 emulation, bias output"]
    assert 0.95 < emulated["cosine_mean"] < w4a16["cosine_mean"]  # measured 0.9667
    assert emulated["activations"] == "quantized" and w4a16["activations"] == "float"
    fp32 = rows["nvfp4 W4A4 emulation, bias fp32"]
    assert fp32["cosine_mean"] == pytest.approx(emulated["cosine_mean"], abs=1e-4)
    assert rows["nvfp4 W4A4 emulation, bias dropped"]["cosine_mean"] < 0.8  # measured 0.703
    assert rows["bf16 W"]["cosine_mean"] > 0.9999 and rows["bf16 W"]["weight_bits"] == 16.0

    bias = mf.bias_rows(encoder, study.SENTENCES[:8], built=keep)
    by = {(r["short"], r["bias_mode"]): r["sqnr_db"] for r in bias}
    assert len(bias) == 3 * 37
    for short in ("0.attn_out", "3.ffn_out", "pooler"):
        assert by[(short, "output")] == pytest.approx(by[(short, "fp32")], abs=0.2)
        assert by[(short, "dropped")] < by[(short, "output")] - 5.0  # measured 6-11 dB lower


@needs_minilm
def test_weight_bits_count_each_formats_scales(encoder: models.SentenceEncoder) -> None:
    # by hand: 4-bit codes, one E4M3 per 16 (or per 16×16 = 256) values, one FP32 per tensor
    sizes = [encoder.model.get_submodule(n).weight.numel() for n in mf.linear_names(encoder.model)]
    tensor = 32 * len(sizes) / sum(sizes)
    tiles = mf.ModelConfig("t", StudyConfig("16×16", "nvfp4", {"block_size": (16, 16)}))
    assert mf.weight_bits(encoder, tiles) == pytest.approx(4 + 8 / 256 + tensor, rel=1e-12)
    assert mf.weight_bits(encoder, mf.path_configs()[0]) == pytest.approx(4.5 + tensor, rel=1e-12)
    mx = mf.ModelConfig("m", StudyConfig("mxfp4", "mxfp4"))
    assert mf.weight_bits(encoder, mx) == pytest.approx(4.25, rel=1e-12)  # E8M0 per 32, no FP32


@needs_minilm
def test_layer_error_rows_against_direct_computation(encoder: models.SentenceEncoder) -> None:
    configs = [StudyConfig("nvfp4", "nvfp4"),
               StudyConfig("tiles", "nvfp4", {"block_size": (16, 16)}),
               StudyConfig("int4_g128", "int4_g128")]
    acts = study.capture_inputs(encoder)
    layers = ["encoder.layer.0.attention.self.query", "encoder.layer.0.output.dense"]
    rows = mf.layer_error_rows(encoder, configs, acts=acts, layers=layers)
    assert [(r["short"], r["format"]) for r in rows] == [
        (s, c.label) for s in ("0.query", "0.ffn_out") for c in configs]
    by = {(r["short"], r["format"]): r for r in rows}
    w = encoder.model.get_submodule(layers[1]).weight.detach()
    x = acts[layers[1]]
    assert by[("0.ffn_out", "nvfp4")]["weight_nmse"] == metrics.nmse(w, fake_quantize(w))
    assert by[("0.ffn_out", "nvfp4")]["activation_nmse"] == metrics.nmse(x, fake_quantize(x))
    int4 = formats.get("int4_g128").fake_quantize
    assert by[("0.ffn_out", "int4_g128")]["activation_nmse"] == metrics.nmse(x, int4(x))
    tiles = by[("0.ffn_out", "tiles")]
    assert tiles["activation_nmse"] == by[("0.ffn_out", "nvfp4")]["activation_nmse"]
    assert tiles["weight_nmse"] == metrics.nmse(w, fake_quantize(w, block_size=(16, 16)))
    # the FFN output's inputs (after GELU) are outlier-heavy: INT4-g128 loses ~9x to NVFP4 there
    assert by[("0.ffn_out", "int4_g128")]["activation_nmse"] > 5 * by[("0.ffn_out", "nvfp4")][
        "activation_nmse"]


@needs_minilm
def test_outlier_rows(encoder: models.SentenceEncoder) -> None:
    acts = study.capture_inputs(encoder)
    rows = {r["short"]: r for r in mf.outlier_rows(encoder, acts=acts)}
    x = acts["encoder.layer.0.output.dense"].double()
    row = rows["0.ffn_out"]
    assert row["activation_crest"] == pytest.approx(float(x.abs().max() / x.square().mean().sqrt()))
    rms = x.square().mean(0).sqrt()
    assert row["top_channel"] == int(rms.argmax())
    assert row["channel_ratio"] == pytest.approx(float(rms.max() / rms.median()))
    assert row["activation_crest"] > 3 * rows["0.query"]["activation_crest"]  # measured 82 vs 13


def test_plots_are_titled() -> None:
    pytest.importorskip("matplotlib")
    layer_rows = [{"index": i, "short": f"{i}.q", "format": f, "weight_nmse": 1e-2 * (i + 1),
                   "activation_nmse": 2e-2} for i in range(3) for f in ("nvfp4", "mxfp4")]
    outliers = [{"index": i, "short": f"{i}.q", "weight_crest": 5.0, "activation_crest": 9.0,
                 "channel_ratio": 3.0} for i in range(3)]
    configs = [{"label": "a", "kind": "format", "cosine_gap": 0.02, "recall": 1.0},
               {"label": "b", "kind": "nvfp4 path", "cosine_gap": 0.0, "recall": 0.9}]
    bias = [{"index": i, "short": f"{i}.q", "bias_mode": m, "sqnr_db": 10.0}
            for i in range(3) for m in ("output", "dropped")]
    figures = [mf.plot_layer_errors(layer_rows),
               mf.plot_layer_errors(layer_rows, "activation_nmse"),
               mf.plot_outliers(outliers), mf.plot_configs(configs), mf.plot_bias_modes(bias)]
    for fig in figures:
        ax = fig.axes[0]
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    assert "input activations" in figures[1].axes[0].get_title()


def test_every_format_has_its_own_colour() -> None:
    # the style cycle holds 8 colours: the 9th format (bf16) used to share nvfp4's
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex

    from nvfp4lab import plots

    names = [f.label if hasattr(f, "label") else str(f) for f in mf.layer_formats(0)]
    assert len(names) > 8 and "bf16" in names
    layer_rows = [{"index": i, "short": f"{i}.q", "format": f, "weight_nmse": 1e-2 * (i + 1),
                   "activation_nmse": 2e-2} for i in range(3) for f in names]
    with plots.style_context():
        fig = mf.plot_layer_errors(layer_rows)
    lines = fig.axes[0].get_lines()
    assert [ln.get_label() for ln in lines] == names
    colours = [to_hex(ln.get_color()) for ln in lines]
    assert len(set(colours)) == len(colours)
    __import__("matplotlib.pyplot").pyplot.close(fig)


def test_model_explorer_starts_from_the_setup_cell(encoder) -> None:
    """Only what notebook 05's setup cell makes: picks are computed on first use and equal the
    study functions' rows; rows computed earlier are shown as given, not recomputed."""
    from tests.studies.widgets import control, text

    formats = [c for c in mf.layer_formats(0, fast=True) if c.label in ("nvfp4", "mxfp4")]
    configs = mf.path_configs()[:1] + mf.format_configs(formats=formats[1:])[:1]
    given = [{"short": "0.query", "format": "nvfp4", "weight_nmse": 1.25e-7,
              "activation_nmse": 2.5e-7}]
    box = mf.model_explorer(encoder, formats, configs, layer_rows=given)
    assert "1.250e-07" in text(box)  # the given row, not a recomputation
    control(box, "layer").value = "0.ffn_out"
    (name,) = [n for n in mf.linear_names(encoder.model) if mf.short_name(n) == "0.ffn_out"]
    expected = mf.layer_error_rows(encoder, formats, layers=[name])
    shown = text(box)
    for row in expected:
        assert f"{row['weight_nmse']:.3e}" in shown and f"{row['activation_nmse']:.3e}" in shown
    control(box, "config").value = configs[1].label
    (row,) = mf.config_rows(encoder, configs[1:])
    assert mf.config_text(row) in text(box)
    layer_out, config_out = box.children[-1].outputs  # each names what it shows
    assert "<strong>Layer 0.ffn_out (encoder.layer.0.output.dense): every format" in layer_out[
        "data"]["text/html"]
    assert f"<strong>Configuration {configs[1].label}: embedding fidelity" in config_out[
        "data"]["text/html"]
    with pytest.raises(ValueError, match="needs formats"):
        mf.model_explorer(encoder, [], configs)
    with pytest.raises(ValueError, match="no rows for layer 'x'"):
        mf.layer_table(given, "x")
