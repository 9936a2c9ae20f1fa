"""execution/mixed.py: FP8 W8A8 against a slow scalar oracle, MXFP4 layers, the bits rule, fused
units, and whole mixes against quantize_model (bit for bit where the mix is one NVFP4 method)."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest
import torch
from torch import nn

from nvfp4lab import number_formats
from nvfp4lab.execution import NVFP4Linear, quantize_model
from nvfp4lab.execution.mixed import (
    FP8Linear,
    MXFP4Linear,
    apply_mix,
    effective_bits,
    fused_units,
    layer_bits,
    quantizable_linears,
    quantize_layer,
    shared_global_scale,
)
from nvfp4lab.oracles.numbers import narrow, round_e4m3, round_f32
from nvfp4lab.vocab import LayerFormat
from tests.tiny_decoders import tiny_model

F32_EPS = 2.0**-23


def _fp8_oracle(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                per_channel: bool, quantize_activations: bool = True) -> torch.Tensor:
    """vLLM 0.33's FP8 W8A8 (compressed-tensors weights, dynamic per-token activations), or
    W8A16 (the activations as they are, no activation scale), one scalar at a time: every
    float32 operation rounded once (``round_f32`` of the double result, exact for one +, *, / of
    float32 operands), E4M3 by nearest-even over its value table, the dot product summed exactly
    (fractions) and rounded once."""
    n, k = w.shape
    wv = [[float(v) for v in row] for row in w.float().tolist()]
    if per_channel:
        amaxes = [max(abs(v) for v in row) for row in wv]
    else:
        amaxes = [max(abs(v) for row in wv for v in row)] * n
    w_scales = [round_f32(a / 448.0) or F32_EPS for a in amaxes]
    wq = [[round_e4m3(max(-448.0, min(448.0, round_f32(v / s)))) for v in row]
          for row, s in zip(wv, w_scales, strict=True)]
    rows = x.reshape(-1, k)
    out = []
    min_scale = round_f32(1.0 / (448.0 * 512.0))
    for row in rows.tolist():
        if quantize_activations:
            s_x = max(round_f32(max(abs(v) for v in row) / 448.0), min_scale)
            recip = round_f32(1.0 / s_x)
            xq = [round_e4m3(max(-448.0, min(448.0, round_f32(v * recip)))) for v in row]
        else:
            s_x, xq = 1.0, row
        values = []
        for j in range(n):
            exact = sum((Fraction(a) * Fraction(b) for a, b in zip(xq, wq[j], strict=True)),
                        Fraction(0))
            acc = round_f32(float(exact))
            assert Fraction(float(exact)) == exact  # the sum is exact in a double
            if quantize_activations:
                acc = round_f32(acc * s_x)
            value = round_f32(acc * w_scales[j])
            if bias is not None:
                value = round_f32(value + float(bias.detach()[j]))
            values.append(narrow(value, x.dtype))
        out.append(values)
    return torch.tensor(out, dtype=x.dtype).reshape(*x.shape[:-1], n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_linear_matches_the_scalar_oracle(dtype: torch.dtype, per_channel: bool) -> None:
    g = torch.Generator().manual_seed(3)
    linear = nn.Linear(48, 5, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(5, 48, generator=g) * 0.05)
        linear.weight[1, 7] = 0.9  # an outlier: this channel's scale differs from the others
        linear.weight[3] = 0.0  # a zero channel: scale eps, outputs the bias alone
        linear.bias.copy_(torch.randn(5, generator=g))
    linear = linear.to(dtype)
    x = (torch.randn(2, 3, 48, generator=g) * torch.logspace(-3, 1, 48)).to(dtype)
    x[0, 1] = 0.0  # a zero token: the smallest scale
    layer = FP8Linear.from_linear(linear, per_channel=per_channel)
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.shape == ((5, 1) if per_channel else (1, 1))
    got = layer(x)
    assert got.dtype == dtype and got.shape == (2, 3, 5)
    assert torch.equal(got, _fp8_oracle(x, linear.weight, linear.bias, per_channel))
    w8a16 = quantize_layer(linear, "fp8-w8a16", per_channel=per_channel)
    assert isinstance(w8a16, FP8Linear) and w8a16.layer_format == LayerFormat.FP8_W8A16
    assert torch.equal(w8a16.weight.view(torch.uint8), layer.weight.view(torch.uint8))
    assert torch.equal(w8a16.weight_scale, layer.weight_scale)
    got16 = w8a16(x)
    assert torch.equal(got16, _fp8_oracle(x, linear.weight, linear.bias, per_channel, False))
    assert not torch.equal(got16, got)  # the activations' FP8 error is gone


def test_fp8_is_close_to_the_float_layer_and_not_equal() -> None:
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 32)
    x = torch.randn(4, 64, generator=g)
    ref = linear(x)
    got = FP8Linear.from_linear(linear)(x)
    rel = float((got - ref).norm() / ref.norm())
    assert 1e-4 < rel < 0.05


def test_mxfp4_linear_runs_the_mxfp4_weight() -> None:
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(64, 8).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    layer = MXFP4Linear.from_linear(linear)
    w = number_formats.get("mxfp4").fake_quantize(linear.weight.detach())
    assert torch.equal(layer.dequantized_weight(torch.bfloat16), w)
    assert torch.equal(layer(x), nn.functional.linear(x, w, linear.bias))
    assert layer.weight_packed.shape == (8, 32) and layer.weight_scale.shape == (8, 2)
    with pytest.raises(ValueError, match="multiple of 32"):
        MXFP4Linear.from_linear(nn.Linear(48, 4))


def test_bits_rule() -> None:
    assert layer_bits(LayerFormat.NVFP4_RTN, 4, 16) == 4.5 + 32 / 64
    assert layer_bits("nvfp4-gptq", 10, 32) == 4.5 + 32 / 320
    assert layer_bits("fp8", 10, 32) == 8 + 1
    assert layer_bits("fp8-w8a16", 10, 32) == 8 + 1
    assert layer_bits("fp8", 10, 32, per_channel=False) == 8 + 32 / 320
    assert layer_bits("mxfp4", 10, 32) == 4.25 and layer_bits("bf16", 1, 16) == 16
    with pytest.raises(ValueError, match="unknown layer format 'int3'"):
        layer_bits("int3", 1, 16)
    model = tiny_model("llama")
    linears = quantizable_linears(model)
    assert len(linears) == 14 and "lm_head" not in linears
    sizes = {n: m.weight.numel() for n, m in linears.items()}
    total = sum(sizes.values())
    uniform = {n: LayerFormat.NVFP4_RTN for n in linears}
    assert effective_bits(model, uniform) == pytest.approx(4.5 + 32 * 14 / total, rel=1e-12)
    down = "model.layers.1.mlp.down_proj"
    mix = {**uniform, down: LayerFormat.FP8}
    mix.pop("model.layers.0.self_attn.o_proj")  # left out: counted as bf16
    want = (sum((4.5 * s + 32) for n, s in sizes.items() if n in mix and n != down)
            + (8 + 32 / 128) * sizes[down] + 16 * sizes["model.layers.0.self_attn.o_proj"]) / total
    assert effective_bits(model, mix) == pytest.approx(want, rel=1e-12)


def test_fused_units_keep_qkv_and_gate_up_together() -> None:
    names = list(quantizable_linears(tiny_model("llama")))
    units = fused_units(names)
    assert units[:4] == [
        tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv"),
        ("model.layers.0.self_attn.o_proj",),
        ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"),
        ("model.layers.0.mlp.down_proj",),
    ]
    assert len(units) == 8 and sorted(n for u in units for n in u) == sorted(names)


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, 200, (4, 24), generator=g)
    return [{"input_ids": ids[:2], "attention_mask": torch.ones_like(ids[:2])},
            {"input_ids": ids[2:], "attention_mask": torch.ones_like(ids[2:])}]


METHODS = {LayerFormat.NVFP4_RTN: "rtn", LayerFormat.NVFP4_GPTQ: "gptq",
           LayerFormat.NVFP4_MR_GPTQ: "mr-gptq"}


@pytest.mark.parametrize("fmt", list(METHODS))
def test_a_uniform_mix_is_quantize_model_bit_for_bit(fmt: LayerFormat) -> None:
    model = tiny_model("llama", seed=4)
    ids = torch.randint(4, 200, (2, 16), generator=torch.Generator().manual_seed(9))
    gptq = fmt != LayerFormat.NVFP4_RTN
    theirs = tiny_model("llama", seed=4)
    quantize_model(theirs, backend="w4a16", method=METHODS[fmt],
                   calibration=_batches() if gptq else None)
    report = apply_mix(model, dict.fromkeys(quantizable_linears(model), fmt),
                       calibration=_batches() if gptq else None)
    assert report.counts() == {str(fmt): 14}
    for name, module in theirs.named_modules():
        if isinstance(module, NVFP4Linear):
            mine = model.get_submodule(name)
            assert isinstance(mine, NVFP4Linear)
            assert (mine.hadamard is None) == (fmt != LayerFormat.NVFP4_MR_GPTQ)
            assert torch.equal(mine.weight_packed, module.weight_packed)
            assert torch.equal(mine.weight_scale.view(torch.uint8),
                               module.weight_scale.view(torch.uint8))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, theirs(input_ids=ids).logits)


def test_a_mixed_model() -> None:
    model = tiny_model("qwen3", seed=1)
    linears = quantizable_linears(model)
    names = list(linears)
    mix = {names[0]: "fp8", names[1]: "fp8", names[2]: "fp8", names[3]: "mxfp4",
           names[4]: "nvfp4-rtn", names[5]: "nvfp4-rtn", names[6]: "bf16",
           **{n: "nvfp4-gptq" for n in names[7:]}}
    before = {n: linears[n].weight.detach().clone() for n in names}
    report = apply_mix(model, mix, calibration=_batches())
    kinds = {n: type(model.get_submodule(n)) for n in names}
    assert [kinds[n] for n in names[:7]] == [FP8Linear] * 3 + [MXFP4Linear, NVFP4Linear,
                                                             NVFP4Linear, nn.Linear]
    assert all(kinds[n] is NVFP4Linear for n in names[7:])
    assert model.get_submodule(names[6]) is linears[names[6]]
    assert report.bits == pytest.approx(effective_bits(tiny_model("qwen3"), mix), rel=1e-12)
    # gate and up (names[4], names[5]) share their global scale as quantize_model shares it
    gs = shared_global_scale(linears, names[4])
    assert torch.equal(model.get_submodule(names[4]).weight_global_scale, gs)
    assert torch.equal(model.get_submodule(names[5]).weight_global_scale, gs)
    # the FP8 layers are the layer-alone quantization of the float weights
    alone = quantize_layer(nn.Linear(64, 64), "fp8")
    assert isinstance(alone, FP8Linear)
    w = FP8Linear.from_linear(linears[names[0]]).weight
    assert torch.equal(model.get_submodule(names[0]).weight.view(torch.uint8),
                       w.view(torch.uint8))
    assert all(torch.equal(before[n], linears[n].weight) for n in names)  # floats untouched
    with torch.no_grad():
        logits = model(input_ids=_batches()[0]["input_ids"]).logits
    assert bool(torch.isfinite(logits).all())


def test_one_mr_gptq_layer_alone_is_quantize_models_layer() -> None:
    """quantize_layer's nvfp4-mr-gptq (the sensitivity's layer alone) is the layer quantize_model
    makes when it is the only one replaced: same rotation, global scale of W Q, codes."""
    from nvfp4lab.execution.gptq_model import collect_hessians

    model, theirs = tiny_model("llama", seed=4), tiny_model("llama", seed=4)
    linears = quantizable_linears(model)
    name = next(n for n in linears if n.endswith("o_proj"))
    hessian = collect_hessians(model, [name], _batches())[name].matrix()
    scale = shared_global_scale(linears, name, "nvfp4-mr-gptq")
    mine = quantize_layer(linears[name], "nvfp4-mr-gptq", hessian=hessian, global_scale=scale)
    quantize_model(theirs, backend="w4a16", method="mr-gptq", calibration=_batches(),
                   ignore=[re.compile("^(?!" + re.escape(name) + "$)")])
    ref = theirs.get_submodule(name)
    assert isinstance(mine, NVFP4Linear) and mine.hadamard is not None
    assert torch.equal(mine.weight_global_scale, ref.weight_global_scale)
    assert torch.equal(mine.weight_packed, ref.weight_packed)
    assert not torch.equal(scale, shared_global_scale(linears, name))  # of W Q, not of W
    x = torch.randn(3, mine.in_features, generator=torch.Generator().manual_seed(2))
    assert torch.equal(mine(x), ref(x))


def test_a_w8a16_mix_keeps_the_fp8_bytes_and_runs_float_activations() -> None:
    model = tiny_model("qwen3", seed=1)
    names = list(quantizable_linears(model))
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4))
    mix = {names[0]: "fp8-w8a16", names[1]: "fp8-w8a16", names[2]: "fp8-w8a16",
           names[3]: "fp8"}
    float_q = model.get_submodule(names[0])
    report = apply_mix(model, mix)
    assert report.counts() == {"fp8-w8a16": 3, "fp8": 1, "bf16": len(names) - 4}
    layer = model.get_submodule(names[0])
    assert isinstance(layer, FP8Linear) and not layer.quantize_activations
    assert "W8A16" in repr(layer)
    assert torch.equal(layer.weight.view(torch.uint8),
                       FP8Linear.from_linear(float_q).weight.view(torch.uint8))
    assert torch.equal(layer(x), _fp8_oracle(x, float_q.weight, float_q.bias, True, False))
    assert model.get_submodule(names[3]).quantize_activations


def test_refusals_and_all_or_nothing() -> None:
    model = tiny_model("llama")
    name = next(iter(quantizable_linears(model)))
    with pytest.raises(ValueError, match=r"mix names 'lm_head', which is not a quantizable"):
        apply_mix(model, {"lm_head": "fp8"})
    with pytest.raises(ValueError, match=r"unknown format of '.*q_proj' 'fp4'; accepted values"):
        apply_mix(model, {name: "fp4"})
    with pytest.raises(ValueError, match="pass calibration="):
        apply_mix(model, {name: "nvfp4-gptq"})
    with pytest.raises(TypeError, match="mapping of layer name -> format"):
        apply_mix(model, [name])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hessian"):
        quantize_layer(quantizable_linears(model)[name], "nvfp4-gptq")
    original = dict(model.named_modules())
    with pytest.raises(Exception, match=re.escape("calibration")):
        apply_mix(model, {name: "fp8", "model.layers.1.mlp.down_proj": "nvfp4-gptq"},
                  calibration=[object()])
    assert dict(model.named_modules()) == original
    assert math.isfinite(effective_bits(model, {}))
