"""quantize_model: what is replaced and skipped, shared fused-group scales, accuracy."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from nvfp4lab.codec import compute_global_scale
from nvfp4lab.execution import (
    NVFP4Linear,
    QuantizeReport,
    calibrate_inputs,
    quantize_model,
)
from nvfp4lab.metrics import sqnr_db
from nvfp4lab.orders import ORDERS
from nvfp4lab.vocab import OrderName
from tests.execution.tiny_models import tiny_model, token_batches

SQNR_BOUNDS_DB = {"w4a16": 23.5, "emulation-static": 21.0, "emulation-dynamic": 21.0}


def test_quantize_model_report() -> None:
    model = tiny_model()
    report = quantize_model(model, backend="emulation", share_global_scale="llama")
    assert isinstance(report, QuantizeReport)
    replaced = set(report.replaced_names)
    for i in range(2):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "gate_proj",
                     "up_proj", "down_proj"):
            assert f"blocks.{i}.{name}" in replaced
            assert isinstance(model.get_submodule(f"blocks.{i}.{name}"), NVFP4Linear)
    assert "odd" in replaced
    reasons = {s.name: s.reason for s in report.skipped}
    assert "multiple of 16" in reasons["odd_out"] and "K=20" in reasons["odd_out"]
    assert "ignored" in reasons["lm_head"]
    assert "subclass" in reasons["mha.out_proj"]
    assert reasons["embed"] == "not nn.Linear" and reasons["norm"] == "not nn.Linear"
    assert isinstance(model.lm_head, nn.Linear) and not isinstance(model.lm_head, NVFP4Linear)
    assert "replaced" in str(report) and len(report.rows()) == len(replaced) + len(reasons)


def test_shared_global_scales() -> None:
    model = tiny_model()
    float_weights = {n: m.weight.detach().clone() for n, m in model.named_modules()
                     if isinstance(m, nn.Linear)}
    report = quantize_model(model, share_global_scale="llama")
    assert ("blocks.0.attn.q_proj", "blocks.0.attn.k_proj", "blocks.0.attn.v_proj") in (
        report.shared_groups
    )
    assert ("blocks.1.gate_proj", "blocks.1.up_proj") in report.shared_groups
    for i in range(2):
        qkv = [f"blocks.{i}.attn.{p}_proj" for p in "qkv"]
        expected = 2688.0 / max(float(float_weights[n].abs().max()) for n in qkv)
        got = {float(model.get_submodule(n).weight_global_scale) for n in qkv}
        assert len(got) == 1
        assert got.pop() == pytest.approx(expected, rel=1e-6)
        assert float(model.get_submodule(f"blocks.{i}.attn.o_proj").weight_global_scale) == (
            float(compute_global_scale(float_weights[f"blocks.{i}.attn.o_proj"]))
        )
    # without sharing, q/k/v scales differ
    unshared = tiny_model()
    quantize_model(unshared, share_global_scale=None)
    gs = {float(unshared.get_submodule(f"blocks.0.attn.{p}_proj").weight_global_scale)
          for p in "qkv"}
    assert len(gs) == 3
    # the default, "auto", shares every preset's groups found in the model
    auto = tiny_model()
    report = quantize_model(auto)
    assert sorted(report.shared_groups) == sorted(
        quantize_model(tiny_model(), share_global_scale="llama").shared_groups
    )
    for i in range(2):
        gs = {float(auto.get_submodule(f"blocks.{i}.attn.{p}_proj").weight_global_scale)
              for p in "qkv"}
        assert len(gs) == 1
    with pytest.raises(ValueError, match="'auto'"):
        quantize_model(tiny_model(), share_global_scale="gpt")


def test_share_explicit_groups_and_ignore_patterns() -> None:
    model = tiny_model()
    report = quantize_model(
        model,
        ignore=("re:blocks\\.1\\..*", "lm_head"),
        share_global_scale=[("gate_proj", "up_proj", "down_proj")],
    )
    assert all(not n.startswith("blocks.1.") for n in report.replaced_names)
    assert report.shared_groups == [("blocks.0.gate_proj", "blocks.0.up_proj",
                                     "blocks.0.down_proj")]
    with pytest.raises(ValueError, match="preset"):
        quantize_model(tiny_model(), share_global_scale="gpt")


@pytest.mark.parametrize("mode", sorted(SQNR_BOUNDS_DB))
def test_quantized_model_close_to_float(mode: str) -> None:
    reference_model = tiny_model()
    model = tiny_model()
    backend = "w4a16" if mode == "w4a16" else "emulation"
    quantize_model(model, backend=backend, share_global_scale="llama")
    if mode == "emulation-static":
        calibrate_inputs(model, token_batches(4, seed=2))
    ids = torch.cat(token_batches(4, seed=3))
    with torch.no_grad():
        ref = reference_model(ids)
        out = model(ids)
    assert sqnr_db(ref, out) >= SQNR_BOUNDS_DB[mode]


def test_quantized_bf16_model_runs_3d() -> None:
    model = tiny_model().to(torch.bfloat16)
    quantize_model(model, backend="emulation")
    with torch.no_grad():
        out = model(token_batches(1)[0])
    assert out.shape == (2, 12, 100) and out.dtype == torch.bfloat16
    assert bool(torch.isfinite(out).all())


# -- issue 19: a meta-device model, and a second call on a quantized model ----------------------


def test_meta_device_model_raises_a_clear_error() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    with pytest.raises(ValueError, match=r"meta device.*'0'.*materialize the model.*to_empty"):
        quantize_model(model)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]


def test_second_quantize_model_warns_naming_the_nvfp4_layers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    quantize_model(model)
    with pytest.warns(UserWarning, match=r"2 layer\(s\) of Sequential are NVFP4Linear already "
                      r"\('0', '2'\).*0 Linear layer\(s\) left"):
        report = quantize_model(model, method="gptq", calibration=[torch.randn(8, 64)])
    assert report.replaced == []


def test_the_convention_may_be_an_order_given_as_data() -> None:
    """convention= takes a registered order's name or an ArithmeticOrder; the same order either
    way gives the same layers, and a bad name raises the vocabulary's error."""
    named, data = tiny_model(), tiny_model()
    quantize_model(named, convention="llama.cpp")
    order = dataclasses.replace(ORDERS[OrderName.LLAMA_CPP], source="a copy")
    quantize_model(data, convention=order)
    for (name, a), (_, b) in zip(named.named_modules(), data.named_modules(), strict=True):
        if isinstance(a, NVFP4Linear):
            assert torch.equal(a.weight_packed, b.weight_packed), name
            assert float(a.weight_global_scale) == 1.0  # llama.cpp: no tensor scale
    with pytest.raises(ValueError, match="unknown convention 'llama'; accepted values"):
        quantize_model(tiny_model(), convention="llama")
