"""studies.llm_llama_cpp on a seeded tiny Llama: each configuration is its quantize_model call,
and every layer's dequantized weight and NMSE equal an independent computation with the slow
reference (ggml's quantizer transcribed, ModelOpt's order) and the tensor scales written out."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from nvfp4lab.execution import NVFP4Linear, quantize_model
from nvfp4lab.oracles import numbers as ref_numbers
from nvfp4lab.oracles import nvfp4 as ref_nvfp4
from nvfp4lab.studies import llm
from nvfp4lab.studies import llm_llama_cpp as llc
from nvfp4lab.studies.llm_configs import build
from nvfp4lab.vocab import Backend
from tests.execution.test_attention import IDS, tiny_llama

#: The layers quantize_model gives one shared tensor scale ("llama" preset).
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, use_cache=False).logits


def _group(name: str) -> list[str]:
    """The names sharing ``name``'s tensor scale (itself alone outside the groups)."""
    parent, leaf = name.rsplit(".", 1)
    for group in GROUPS:
        if leaf in group:
            return [f"{parent}.{member}" for member in group]
    return [name]


def _oracle(weights: dict[str, torch.Tensor], name: str, label: str) -> torch.Tensor:
    """The dequantized float32 weight ``name`` as the configuration ``label`` makes it, from
    reference.py alone: llama.cpp's order at tensor scale 1; at gs = min over the group of
    f32(2688/amax); ModelOpt's order at d = f32(amax/2688) alone, or in a group at the float32
    reciprocal of the smallest f32(1/d_i) (the ENCODE scale quantize_model shares)."""
    w = weights[name]
    members = [weights[m] for m in _group(name)]
    if label == llc.NAIVE:
        convention, scale = "llama.cpp", 1.0
    elif label == llc.PRESCALED:
        convention = "llama.cpp"
        scale = min(ref_nvfp4.global_scale(m, "kernel") for m in members)
    else:
        convention = "modelopt"
        scale = ref_nvfp4.modelopt_decode_scale(w)
        if len(members) > 1:
            encode = min(
                ref_numbers.round_f32(1.0 / ref_nvfp4.modelopt_decode_scale(m)) for m in members
            )
            scale = ref_numbers.round_f32(1.0 / encode)
    codes, scales = ref_nvfp4.quantize_blocks(w, scale, convention)
    return ref_nvfp4.dequantize_blocks(codes, scales, scale, convention)


@pytest.mark.parametrize("config", llc.configurations(), ids=lambda c: c.label)
def test_each_configuration_is_its_quantize_model_call(config: object) -> None:
    ref = tiny_llama()
    built, _ = build(ref, config)  # type: ignore[arg-type]
    direct = tiny_llama()
    quantize_model(direct, backend=Backend.W4A16, convention=config.convention)  # type: ignore[attr-defined]
    assert torch.equal(_logits(built), _logits(direct))
    assert not torch.equal(_logits(built), _logits(ref))


def test_weight_rows_equal_the_reference_oracle() -> None:
    ref = tiny_llama()
    weights = {
        n: m.weight.detach()
        for n, m in ref.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    }
    rows = llc.weight_rows(ref)
    assert [r["label"] for r in rows[:: len(weights)]] == [c.label for c in llc.configurations()]
    for config in llc.configurations():
        model, _ = build(ref, config)
        layers = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
        assert set(layers) == set(weights)
        for name, layer in layers.items():
            want = _oracle(weights, name, config.label)
            got = layer.weight_nvfp4().dequantize(torch.float32)
            assert torch.equal(got, want), (config.label, name)
            row = next(r for r in rows if r["label"] == config.label and r["layer"] == name)
            w = weights[name].double()
            noise, signal = float((want.double() - w).square().sum()), float(w.square().sum())
            assert row["noise"] == noise and row["signal"] == signal
            assert row["nmse"] == noise / signal


def test_block_scale_census() -> None:
    """vanished / subnormal / saturated count the stored scale bytes against the float blocks."""
    ref = tiny_llama()
    with torch.no_grad():
        ref.model.layers[0].mlp.down_proj.weight[:, :16] *= 1e-3  # blocks below 6 * 2**-10
        ref.model.layers[0].mlp.down_proj.weight[0, 16] = 3000.0  # a block scale of 448
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the census counts vanished blocks: no warning per layer
        census = llc.weight_rows(ref, llc.configurations()[:1])
    rows = {(r["label"], r["short"]): r for r in census}
    row = rows[(llc.NAIVE, "0.down_proj")]
    model, _ = build(ref, llc.configurations()[0])
    raw = dict(model.named_modules())["model.layers.0.mlp.down_proj"].weight_scale.view(torch.uint8)
    w = ref.model.layers[0].mlp.down_proj.weight.detach().reshape(raw.shape[0], -1, 16)
    blocks = raw.numel()
    assert row["vanished"] == int(((raw == 0) & (w.abs().amax(-1) > 0)).sum()) / blocks
    assert row["vanished"] >= raw.shape[0] / blocks  # the first block of every row
    assert row["saturated"] == 1 / blocks and int(raw[0, 1]) == 0x7E
    assert row["subnormal"] == int(((raw > 0) & (raw < 8)).sum()) / blocks


def test_study_rows_and_kinds() -> None:
    ref = tiny_llama()
    run = llm.reference_run(ref, IDS[0], context=8, progress=False)
    configs = llc.configurations()
    rows, layers = llc.study_rows(ref, run, configs, progress=False)
    assert [r["label"] for r in rows] == [c.label for c in configs]
    for config, row in zip(configs, rows, strict=True):
        model, _ = build(ref, config)
        fidelity = llm.token_fidelity(run, model, progress=False)
        assert row["kld_mean"] == fidelity.kld_mean and row["perplexity"] == fidelity.perplexity
        mine = [r for r in layers if r["label"] == config.label]
        assert row["weight_nmse"] == sum(r["noise"] for r in mine) / sum(r["signal"] for r in mine)
        assert row["weight_nmse_max"] == max(r["nmse"] for r in mine)
    kinds = llc.layer_kind_rows(layers)
    assert {k["kind"] for k in kinds} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    q = next(k for k in kinds if k["label"] == llc.NAIVE and k["kind"] == "q_proj")
    group = [r for r in layers if r["label"] == llc.NAIVE and r["kind"] == "q_proj"]
    assert q["layers"] == 2 and q["weight_nmse"] == (
        sum(r["noise"] for r in group) / sum(r["signal"] for r in group)
    )
    records = {h["name"]: h for h in llc.headline_numbers(rows)}
    heads = {n: h["value"] for n, h in records.items()}
    ratio = heads["SmolLM2: llama.cpp naive NVFP4's mean KLD / the converter's"]
    assert math.isclose(ratio, round(rows[0]["kld_mean"] / rows[2]["kld_mean"], 2))
    first = rows[0]
    kld_unit = records[f"SmolLM2 W4A16 RTN, {first['label']}: mean KLD"]["unit"]
    assert kld_unit == (f"nats/token (95 % interval {first['kld_lo']:.4f} to "
                        f"{first['kld_hi']:.4f}, {first['windows']} windows)")
    assert records["SmolLM2: llama.cpp naive NVFP4's mean KLD / the converter's"]["unit"] \
        .startswith("× (a ratio of means; their 95 % intervals ")


def test_plot_has_one_line_per_configuration() -> None:
    import matplotlib.pyplot as plt

    from tests.studies.figures import legend_hits

    rows = [
        {"label": label, "short": f"{layer}.{kind}", "nmse": 0.01 * (i + 1) * (layer + 1)}
        for i, label in enumerate((llc.NAIVE, llc.CONVERTER))
        for layer in range(3)
        for kind in ("q_proj", "down_proj")
    ]
    fig = llc.plot_weight_nmse(rows)
    ax = fig.axes[0]
    assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    assert [line.get_label() for line in ax.lines] == [llc.NAIVE, llc.CONVERTER]
    assert list(ax.lines[1].get_ydata()) == [r["nmse"] for r in rows[6::2]]  # two equal kinds
    assert legend_hits(fig) == []
    assert "zoomed" not in ax.get_ylabel()  # 0.01 to 0.06: not a narrow range
    plt.close(fig)
    narrow = [{**r, "nmse": 0.009 + 0.0001 * i} for i, r in enumerate(rows)]  # 0.0090-0.0101
    fig = llc.plot_weight_nmse(narrow)
    ys = [float(y) for line in fig.axes[0].lines for y in line.get_ydata()]
    spread = 100.0 * (max(ys) / min(ys) - 1.0)  # of the plotted per-layer means
    assert 5.0 < spread < 20.0
    assert fig.axes[0].get_ylabel().endswith(f"(axis zoomed: the lines span {spread:.1f} %)")
    plt.close(fig)


def test_magnitude_rows_against_the_reference() -> None:
    """NVFP4 of c W, decoded and divided by c, from the slow reference; the converter's error does
    not depend on c (its tensor scale absorbs it), the naive order's grows."""
    ref = tiny_llama()
    with torch.no_grad():
        for layer in ref.model.layers:
            for p in layer.parameters():
                if p.ndim == 2:  # SmolLM2's weight spread: block maxima in E4M3's normal range
                    p.mul_(0.2 / p.std())
    weights = [
        m.weight.detach()
        for n, m in ref.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    ]
    configs = [llc.configurations()[0], llc.configurations()[2]]
    factors = (1.0, 1 / 64)
    rows = llc.magnitude_rows(ref, factors, configs)
    assert [(r["label"], r["factor"]) for r in rows] == [
        (c.label, f) for c in configs for f in factors
    ]
    for row in rows:
        c = row["factor"]
        noise = signal = 0.0
        for w in weights:
            if row["label"] == llc.NAIVE:
                convention, scale = "llama.cpp", 1.0
            else:
                convention, scale = "modelopt", ref_nvfp4.modelopt_decode_scale(w * c)
            codes, scales = ref_nvfp4.quantize_blocks(w * c, scale, convention)
            got = ref_nvfp4.dequantize_blocks(codes, scales, scale, convention).double() / c
            noise += float((got - w.double()).square().sum())
            signal += float(w.double().square().sum())
        assert row["weight_nmse"] == noise / signal and row["layers"] == len(weights)
    by = {(r["label"], r["factor"]): r for r in rows}
    assert by[(llc.CONVERTER, 1.0)]["weight_nmse"] == by[(llc.CONVERTER, 1 / 64)]["weight_nmse"]
    assert by[(llc.NAIVE, 1 / 64)]["weight_nmse"] > 1.5 * by[(llc.NAIVE, 1.0)]["weight_nmse"]
    assert by[(llc.NAIVE, 1 / 64)]["subnormal"] > by[(llc.NAIVE, 1.0)]["subnormal"]
    assert len(llc.magnitude_rows(ref, (1.0,), configs[:1], block_stride=2)) == 1
