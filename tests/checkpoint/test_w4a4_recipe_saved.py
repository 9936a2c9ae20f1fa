"""The W4A4 recipe of issue 35 (SmoothQuant folded into the stored weights, GPTQ on the quantized
inputs' Hessian, static input scales calibrated on the same text) saved as a compressed-tensors
checkpoint: compressed-tensors validates its config and reads its weights, and nvfp4lab reloads
it bit for bit (codes, block scales, global scales, input scales, the smoothed norms, logits)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig
from transformers import AutoModelForCausalLM

from nvfp4lab import checkpoint, metrics
from nvfp4lab.execution import W4A4Options, calibrate_inputs, quantize_model
from nvfp4lab.execution.layers import NVFP4Linear
from tests.checkpoint.builders import raw, tiny_llama, token_batches

NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    model = tiny_llama()
    batches = token_batches()
    report = quantize_model(model, backend="emulation", method="gptq", calibration=batches,
                            share_global_scale="llama", w4a4=W4A4Options(smooth_alpha=0.5))
    assert {r.method for r in report.replaced} == {"gptq (w4a4: SmoothQuant 0.5)"}
    calibrate_inputs(model, batches)
    path = checkpoint.save_pretrained(model, tmp_path_factory.mktemp("w4a4") / "recipe",
                                      dtype=torch.bfloat16)
    return model, path


def test_the_recipe_changed_the_stored_weights() -> None:
    """SmoothQuant moved scale into the norms (what makes the checkpoint the recipe, not plain
    W4A4): every smoothed norm differs from the float model's."""
    float_model, model = tiny_llama(), tiny_llama()
    quantize_model(model, backend="emulation", method="gptq", calibration=token_batches(),
                   share_global_scale="llama", w4a4=W4A4Options(smooth_alpha=0.5))
    before, after = float_model.state_dict(), model.state_dict()
    smoothed = [k for k in after if k.endswith(NORMS)]
    assert smoothed and all(not torch.equal(before[k], after[k]) for k in smoothed)


def test_compressed_tensors_validates_and_reads_it(recipe: tuple[torch.nn.Module, Path]) -> None:
    model, path = recipe
    block = json.loads((path / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(
        {k: v for k, v in block.items() if k in set(QuantizationConfig.model_fields)})
    (group,) = config.config_groups.values()
    assert group.weights.num_bits == 4 and group.input_activations is not None
    assert group.input_activations.num_bits == 4  # W4A4, static input global scales
    # transformers loads and runs it through compressed-tensors (which decompresses the
    # weights at the first forward): each decompressed weight is ours, and its logits are far
    # closer to ours than to the float model's (it fake-quantizes activations in its own order)
    theirs = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
    ids = token_batches(1, seed=9)[0]
    with torch.no_grad():
        logits_t, logits_n = theirs(ids).logits, model(ids).logits
        logits_f = tiny_llama()(ids).logits
    assert metrics.sqnr_db(logits_t, logits_n) > metrics.sqnr_db(logits_f, logits_t) + 3.0
    layers = [n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    for name in layers:
        ours, other = model.get_submodule(name), theirs.get_submodule(name)
        assert torch.equal(other.weight, ours.weight_nvfp4().dequantize(torch.bfloat16)), name
        assert torch.equal(other.input_global_scale, ours.input_global_scale), name
    state = theirs.state_dict()
    for key, value in model.state_dict().items():
        if key.endswith(NORMS):
            assert torch.equal(state[key], value.to(torch.bfloat16)), key  # smoothed norms


def test_nvfp4lab_reloads_it_bit_for_bit(recipe: tuple[torch.nn.Module, Path]) -> None:
    model, path = recipe
    loaded = checkpoint.load(path, backend="emulation")
    original = model.state_dict()
    for key, value in loaded.state_dict().items():
        assert value.dtype == original[key].dtype, key
        assert torch.equal(raw(value), raw(original[key])), key
    layers = [n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    assert layers and all(isinstance(loaded.get_submodule(n), NVFP4Linear) for n in layers)
    for name in layers:
        ours, theirs = model.get_submodule(name), loaded.get_submodule(name)
        assert ours.input_global_scale is not None
        assert torch.equal(theirs.input_global_scale, ours.input_global_scale), name
    ids = token_batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
