"""studies.llm_configs on a seeded tiny Llama: each configuration equals the direct
quantize_model call it stands for; anchors, headlines and plots from given rows."""

from __future__ import annotations

import copy
import time

import matplotlib.pyplot as plt
import pytest
import torch

from nvfp4lab import number_formats
from nvfp4lab.execution import KVCacheOptions, quantize_model
from nvfp4lab.execution.calibrate import calibration
from nvfp4lab.execution.kv_calibration import calibrate_kv_scales
from nvfp4lab.studies import llm, llm_layers
from nvfp4lab.studies import llm_configs as lc
from nvfp4lab.vocab import Backend, KVCacheKind, QuantMethod
from tests.execution.test_attention import IDS, tiny_llama

BATCHES = [{"input_ids": IDS[:, :12], "attention_mask": torch.ones_like(IDS[:, :12])}]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, use_cache=False).logits


def _direct(reference: torch.nn.Module, config: lc.LLMConfig) -> torch.nn.Module:
    """The quantize_model call the configuration stands for, written out."""
    model = copy.deepcopy(reference)
    gptq = config.method == QuantMethod.GPTQ
    if config.backend is None and config.kv_scales is not None:  # calibrated KV scales
        kv = KVCacheOptions(config.kv_cache, scales=calibrate_kv_scales(
            model, BATCHES, config.kv_cache))
        quantize_model(model, backend=None, kv_cache=kv)
    elif config.backend is None:
        kv = config.kv_cache if config.kv_rotation is None else KVCacheOptions(
            config.kv_cache, qk_rotation=config.kv_rotation)
        quantize_model(model, backend=None, kv_cache=kv)
    elif config.weight_format is not None:  # tests/studies/test_format_rows.py: hand oracles
        fmt = number_formats.get(config.weight_format)
        with torch.no_grad():
            for name, linear in model.named_modules():
                if isinstance(linear, torch.nn.Linear) and name != "lm_head":
                    linear.weight.copy_(fmt.fake_quantize(linear.weight, pad=True))
    else:
        method = QuantMethod.MR_GPTQ if config.rotation else config.method
        smooth = config.w4a4 is not None and config.w4a4.needs_calibration
        quantize_model(model, backend=config.backend, method=method,
                       calibration=BATCHES if gptq or smooth else None,
                       kv_cache=config.kv_cache, w4a4=config.w4a4)
    if config.input_scales == lc.CALIBRATED:
        with torch.no_grad(), calibration(model):
            for batch in BATCHES:
                model(**batch)
    return model


@pytest.mark.parametrize("config", lc.configurations(),
                         ids=lambda c: c.label)
def test_each_configuration_is_its_quantize_model_call(config: lc.LLMConfig) -> None:
    reference = tiny_llama()
    before = _logits(reference)
    built, seconds = lc.build(reference, config, BATCHES)
    assert seconds > 0 and torch.equal(_logits(reference), before)  # the reference untouched
    assert torch.equal(_logits(built), _logits(_direct(reference, config)))
    assert not torch.equal(_logits(built), before)


def test_smoothing_configurations_share_one_statistics_pass() -> None:
    """With build's ``shared`` dict (config_results passes one), the statistics of the float
    model are computed once for both SmoothQuant configurations and counted in each one's
    seconds; every model equals its own quantize_model call."""
    reference = tiny_llama()
    smoothing = [c for c in lc.configurations() if c.w4a4 is not None and c.w4a4.smooths]
    assert len(smoothing) == 2
    shared: dict[str, object] = {}
    for config in smoothing:
        built, seconds = lc.build(reference, config, BATCHES, shared=shared)
        assert torch.equal(_logits(built), _logits(_direct(reference, config))), config.label
        assert seconds >= shared["smooth_statistics:0"][1] > 0
    assert list(shared) == ["smooth_statistics:0"]


def test_one_float_pass_serves_kv_scales_and_smoothing() -> None:
    """config_results' shared dict for KV-calibrated and smoothing configurations: one pass
    records both, equal to calibrate_kv_scales' and smooth_statistics' own passes."""
    from nvfp4lab.execution.w4a4_smooth import smooth_statistics

    reference = tiny_llama()
    configs = lc.configurations()
    shared = lc.shared_calibration(reference, configs, BATCHES)
    (scales, seconds), (stats, same) = shared["kv_scales"], shared["smooth_statistics:0"]
    assert seconds == same > 0
    assert scales == calibrate_kv_scales(reference, BATCHES, KVCacheKind.NVFP4)
    alone = smooth_statistics(reference, BATCHES)
    assert stats.by_group.keys() == alone.by_group.keys() and not stats.rows
    for key, st in alone.by_group.items():
        assert torch.equal(stats.by_group[key].amax, st.amax)
        assert stats.by_group[key].fed == st.fed
    assert lc.shared_calibration(reference, configs[:5], BATCHES) == {}  # neither is needed


def test_shared_kv_scales_do_not_hide_the_rotation_refusal() -> None:
    """Calibrated K / V scales with a Q / K rotation are refused (they would be calibrated on
    K unrotated), with build's shared dict as without it: the rotation is never dropped."""
    config = lc.LLMConfig("KV nvfp4 + Q/K rotation 16, calibrated", None,
                          kv_cache=KVCacheKind.NVFP4, kv_scales=lc.CALIBRATED, kv_rotation=16)
    for shared in (None, {}):
        with pytest.raises(ValueError, match="calibrated on K unrotated"):
            lc.build(tiny_llama(), config, BATCHES, shared=shared)


def test_one_pass_is_counted_once_in_a_configuration_using_both() -> None:
    """A configuration that calibrates K / V and smooths counts the shared pass once."""
    from nvfp4lab.execution.w4a4_recipes import W4A4Options

    reference = tiny_llama()
    both = lc.LLMConfig("W4A4 RTN + SmoothQuant 0.5 + KV nvfp4, calibrated", Backend.EMULATION,
                        kv_cache=KVCacheKind.NVFP4, kv_scales=lc.CALIBRATED,
                        w4a4=W4A4Options(smooth_alpha=0.5))
    shared = lc.shared_calibration(reference, [both], BATCHES)
    pass_seconds = shared["kv_scales"][1]
    built, seconds = lc.build(reference, both, BATCHES, shared=shared)
    assert pass_seconds <= seconds < 2 * pass_seconds + 5.0  # not twice the pass
    direct = copy.deepcopy(reference)
    quantize_model(direct, backend=Backend.EMULATION, calibration=BATCHES, w4a4=both.w4a4,
                   kv_cache=KVCacheOptions(KVCacheKind.NVFP4, scales="calibrated"))
    assert torch.equal(_logits(built), _logits(direct))


def test_settings_and_checks() -> None:
    configs = {c.label: c for c in lc.configurations()}
    assert configs["KV fp8"].weights == "float" and configs["KV fp8"].kv_cache == KVCacheKind.FP8
    assert configs["W4A4 RTN, calibrated"].activations == "nvfp4 (calibrated)"
    assert configs["W4A16 GPTQ"].needs_calibration and not configs["W4A16 RTN"].needs_calibration
    assert {c.label for c in lc.configurations(smoke=True)} < set(configs)
    assert all(c.method == QuantMethod.RTN for c in lc.configurations(smoke=True))
    with pytest.raises(ValueError, match="needs calibration_batches"):
        lc.build(tiny_llama(), configs["W4A16 GPTQ"])


def test_config_rows_score_each_model_against_the_run() -> None:
    reference = tiny_llama()
    run = llm.reference_run(reference, IDS[0], context=8, progress=False)
    configs = [lc.LLMConfig("W4A16 RTN", Backend.W4A16), lc.LLMConfig("KV fp8", None,
                                                                      kv_cache="fp8")]
    rows = lc.config_rows(reference, run, configs, progress=False)
    for config, row in zip(configs, rows, strict=True):
        model, _ = lc.build(reference, config)
        expected = llm.token_fidelity(run, model, progress=False)
        assert row["kld_mean"] == expected.kld_mean and row["label"] == config.label
        assert row["perplexity"] == expected.perplexity
    assert rows[1]["method"] == "-" and rows[0]["kv_cache"] == "float"
    assert "mean KLD" in lc.config_text(rows[0])


def _row(label: str, kld: float, ratio: float = 1.2) -> dict[str, object]:
    return {"label": label, "kld_mean": kld, "perplexity_ratio": ratio, "kld_lo": kld * 0.9,
            "kld_hi": kld * 1.1, "top1_agreement": 0.8, "weights": "nvfp4",
            "activations": "float"}


def test_anchors_compare_directions() -> None:
    rows = [_row("W4A16 RTN", 0.2), _row("W4A16 GPTQ", 0.25), _row("W4A4 RTN, dynamic", 0.4, 1.5),
            _row("KV nvfp4", 0.11), _row("KV nvfp4_4over6", 0.09)]
    anchors = {a["anchor"].split(":")[0]: a for a in lc.anchor_rows(rows)}
    assert len(lc.published_anchors()) == 3 and len(anchors) == 3
    assert anchors["Llama-3.1-8B"]["agrees"]  # both worsen perplexity
    assert not anchors["Llama-3.1-8B-Instruct"]["agrees"]  # GPTQ worse here: disagrees
    assert anchors["Qwen3-8B"]["agrees"]  # 4over6 better in both
    assert lc.anchor_rows(rows[:1]) == []  # nothing comparable run
    heads = {h["name"]: h["value"] for h in lc.headline_numbers(rows)}
    assert heads["SmolLM2 W4A16: GPTQ's cut of RTN's mean KLD"] == -25.0


def test_plots_have_titles_and_labels() -> None:
    rows = [_row("W4A16 RTN", 0.2), {**_row("KV fp8", 0.01), "weights": "float"}]
    fig = lc.plot_configs(rows)
    assert fig.axes[0].get_title() and fig.axes[0].get_xlabel()
    model = tiny_llama()
    linear = llm_layers.linear_rows(model, IDS[:1])
    fig2 = llm_layers.plot_linear(linear)
    labels = [t.get_text() for t in fig2.axes[0].get_legend().get_texts()]
    assert "q_proj/k_proj/v_proj input" in labels and "gate_proj/up_proj input" in labels
    fig3 = llm_layers.plot_kv(llm_layers.kv_rows(model, IDS[:1]), "k_nmse")
    assert [a.get_title() for a in fig3.axes[:3]] == ["nvfp4", "nvfp4_4over6", "fp8"]
    for f in (fig, fig2, fig3):
        plt.close(f)


def test_explorer_starts_from_the_setup_cell() -> None:
    from tests.studies.widgets import control, text

    reference = tiny_llama()
    run = llm.reference_run(reference, IDS[0], context=8, progress=False)
    configs = [lc.LLMConfig("W4A16 RTN", Backend.W4A16), lc.LLMConfig("KV fp8", None,
                                                                      kv_cache="fp8")]
    box = lc.llm_explorer(reference, IDS[:1], run, configs)  # nothing computed before
    shown = text(box)
    layer0 = [r for r in llm_layers.linear_rows(reference, IDS[:1]) if r["short"] == "0.q_proj"]
    assert f"{layer0[0]['weight_nmse']:.3g}" in shown and "W4A16 RTN" in shown
    control(box, "configuration").value = "KV fp8"
    (row,) = lc.config_rows(reference, run, configs[1:], progress=False)
    assert lc.config_text(row) in text(box)
    control(box, "decoder layer").value = 1
    assert "1.q_proj" in text(box)
    # K and V per KV head (the notebook promises both), each output titled with what it shows
    kv = [r for r in llm_layers.kv_rows(reference, IDS[:1]) if r["layer"] == 1]
    lin_out, kv_out, config_out = box.children[-1].outputs
    for r in kv:
        for key in ("k_nmse", "v_nmse"):
            assert f"{r[key]:.3g}" in kv_out["data"]["text/plain"]
    assert "v_nmse" in kv_out["data"]["text/plain"]
    titles = [o["data"]["text/html"].split("</strong>")[0] for o in (lin_out, kv_out, config_out)]
    assert titles == ['<p class="nvfp4lab-output-title"><strong>Decoder layer 1: NVFP4 error of '
                      "each Linear (weights RTN, inputs dynamic) and its loudest input channel",
                      '<p class="nvfp4lab-output-title"><strong>Decoder layer 1: K and V NMSE '
                      "and the attention KL per KV head, per cache kind",
                      '<p class="nvfp4lab-output-title"><strong>Configuration KV fp8: '
                      "next-token fidelity"]
    with pytest.raises(ValueError, match="at least one configuration"):
        lc.llm_explorer(reference, IDS[:1], run, [])


def test_config_result_is_config_row_with_per_token_values() -> None:
    reference = tiny_llama()
    run = llm.reference_run(reference, IDS[0], context=8, progress=False)
    config = lc.LLMConfig("W4A16 RTN", Backend.W4A16)
    result = lc.config_result(reference, run, config)
    row = lc.config_row(reference, run, config)
    timing = ("build_seconds", "peak_rss_mb")  # measured anew each time
    assert {k: v for k, v in result.row().items() if k not in timing} == \
        {k: v for k, v in row.items() if k not in timing}
    assert set(row) == set(result.row()) and result.label == "W4A16 RTN"
    old_keys = {"label", "weights", "activations", "kv_cache", "method", "build_seconds",
                *result.fidelity.row()}
    assert old_keys <= set(row) and {"top1_lo", "top1_hi", "peak_rss_mb"} <= set(row)
    model, seconds = lc.build(reference, config)
    scored = lc.scored_row(model, seconds, run, config)
    assert set(scored) == set(row) - {"peak_rss_mb"}
    assert torch.equal(result.fidelity.kld, llm.token_fidelity(run, model, progress=False).kld)
    assert result.peak_rss_mb is not None and result.peak_rss_mb > 10  # a Python with torch
    (again,) = lc.config_results(reference, run, [config], progress=False)
    assert again.fidelity == result.fidelity and "[" in lc.config_text(row)


def test_peak_memory_sees_an_allocation_inside_the_block() -> None:
    before = lc._rss_bytes() / 2**20
    with lc._PeakRSS() as peak:
        big = torch.ones(64 * 2**20)  # 256 MiB of float32, every page written
        time.sleep(0.1)  # ten sampling intervals, for when the kernel's high-water mark is higher
        del big
    assert peak.mb is not None and peak.mb >= before + 250
    with lc._PeakRSS() as quiet:
        pass
    assert quiet.mb is not None and quiet.mb < peak.mb


def test_headlines_carry_intervals_and_mr_gptq() -> None:
    rows = [{**_row("W4A16 RTN", 0.2), "windows": 8}, {**_row("W4A16 GPTQ", 0.1), "windows": 8},
            {**_row("W4A16 MR-GPTQ", 0.05), "windows": 8}]
    heads = {h["name"]: h for h in lc.headline_numbers(rows)}
    mr = heads["SmolLM2 W4A16 MR-GPTQ: mean KLD vs Q4_1-dequantized reference"]
    assert mr["value"] == 0.05
    assert mr["unit"] == "nats/token (95 % interval 0.0450 to 0.0550, 8 windows)"
    assert heads["SmolLM2 W4A16: MR-GPTQ's cut of RTN's mean KLD"]["value"] == 75.0
    assert heads["SmolLM2 W4A16: GPTQ's cut of RTN's mean KLD"]["value"] == 50.0


def test_the_cut_headlines_carry_the_paired_difference() -> None:
    """With the results, GPTQ's / MR-GPTQ's cut of RTN's KLD carries the paired KLD difference
    and its 95 % interval (llm_statistics.paired_difference, the oracle); without, it says it
    is a point estimate."""
    from nvfp4lab.studies.llm_statistics import paired_difference

    reference = tiny_llama()
    run = llm.reference_run(reference, IDS[0], context=8, progress=False)
    rtn = lc.config_result(reference, run, lc.LLMConfig("W4A16 RTN", Backend.W4A16))
    w4a4 = lc.config_result(reference, run, lc.LLMConfig("W4A4 RTN, dynamic", Backend.EMULATION))
    gptq = lc.ConfigResult(lc.LLMConfig("W4A16 GPTQ", Backend.W4A16), w4a4.fidelity, 0.0)
    rows = [rtn.row(), gptq.row()]
    name = "SmolLM2 W4A16: GPTQ's cut of RTN's mean KLD"
    unit = {h["name"]: h["unit"] for h in lc.headline_numbers(rows, [rtn, gptq])}[name]
    d = paired_difference(w4a4.fidelity, rtn.fidelity, "kld")
    assert unit == (f"% (paired KLD difference {d.difference:.4f} nats/token, 95 % interval "
                    f"{d.ci95[0]:.4f} to {d.ci95[1]:.4f}, {d.windows} windows)")
    assert {h["name"]: h["unit"] for h in lc.headline_numbers(rows)}[name] == "% (point estimate)"


def test_the_llama_cpp_cpu_configuration_is_its_quantize_model_call() -> None:
    """``W4A8 Q8_0, llama.cpp CPU`` (run when named) is ``quantize_model(backend="q8_0",
    convention="llama.cpp")``: ggml's own quantizer and its NVFP4 × Q8_0 arithmetic; its row
    says the activations are Q8_0 and the verdict puts it with the W4A4 family."""
    from nvfp4lab.studies import llm_verdict
    from nvfp4lab.studies.llm_config_names import config_names
    from nvfp4lab.vocab import OrderName

    config = config_names()["w4a8-q8_0-llama.cpp-cpu"]
    assert config not in lc.configurations() and config.backend == Backend.Q8_0
    reference = tiny_llama()
    built, _ = lc.build(reference, config, BATCHES)
    direct = copy.deepcopy(reference)
    quantize_model(direct, backend=Backend.Q8_0, convention=OrderName.LLAMA_CPP)
    assert torch.equal(_logits(built), _logits(direct))
    rtn, _ = lc.build(reference, lc.configurations()[0], BATCHES)  # W4A16 RTN, kernel order
    assert not torch.equal(_logits(built), _logits(rtn))
    assert config.activations.startswith("q8_0") and config.weights == "nvfp4"
    assert llm_verdict.family(config) == llm_verdict.WEIGHTS_ACTIVATIONS
