"""The ModelOpt NVFP4 format: save_pretrained(format="modelopt"), load, detection, refusals, and
the exact DECODE-scale buffers of NVFP4Linear. (ModelOpt itself is the oracle in
tests/peers/test_modelopt.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint import CheckpointError
from nvfp4lab.checkpoint.formats.modelopt import (
    HF_QUANT_CONFIG_NAME,
    SPEC,
    excluded,
    hf_quant_config,
)
from nvfp4lab.execution import NVFP4Linear, quantize_model
from nvfp4lab.vocab import CheckpointFormat
from tests.checkpoint.builders import (
    copy_checkpoint,
    decode_decode_order,
    file_tensors,
    modelopt_like,
    raw,
    tiny_llama,
    token_batches,
)

LAYER = "model.layers.0.self_attn.q_proj"
EXCLUDE = ["lm_head", "model.embed_tokens"]


def _model(seed: int = 0, *, w4a4: bool = True) -> torch.nn.Module:
    model = tiny_llama(seed=seed)
    quantize_model(model, backend="w4a16", convention="modelopt", share_global_scale="llama")
    return modelopt_like(model, token_batches()) if w4a4 else model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    model = _model()
    path = tmp_path_factory.mktemp("mo") / "ckpt"
    checkpoint.save_pretrained(model, path, format="modelopt")
    return model, path


def test_files_tensors_and_configs_are_modelopts(saved: tuple[torch.nn.Module, Path]) -> None:
    model, path = saved
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", "generation_config.json", HF_QUANT_CONFIG_NAME, "model.safetensors"]
    tensors = file_tensors(path)
    layer = model.get_submodule(LAYER)
    n, k = layer.out_features, layer.in_features
    expected = {"weight": (torch.uint8, (n, k // 2)),
                "weight_scale": (torch.float8_e4m3fn, (n, k // 16)),
                "weight_scale_2": (torch.float32, ()), "input_scale": (torch.float32, ())}
    for leaf, (dtype, shape) in expected.items():
        t = tensors[f"{LAYER}.{leaf}"]
        assert (t.dtype, tuple(t.shape)) == (dtype, shape), leaf
    assert not any(k.endswith(("weight_packed", "global_scale", "decode_scale")) for k in tensors)
    assert torch.equal(tensors[f"{LAYER}.weight"], layer.weight_packed)
    assert tensors[f"{LAYER}.weight_scale_2"].item() == layer.weight_decode_scale.item()
    assert tensors[f"{LAYER}.input_scale"].item() == layer.input_decode_scale.item()
    assert json.loads((path / HF_QUANT_CONFIG_NAME).read_text()) == {
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": EXCLUDE}}
    spec = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    assert json.loads((path / "config.json").read_text())["quantization_config"] == {
        "config_groups": {"group_0": {"input_activations": spec, "weights": spec,
                                      "targets": ["Linear"]}},
        "ignore": EXCLUDE, "quant_algo": "NVFP4",
        "producer": {"name": "modelopt", "version": "0.47.0"}, "quant_method": "modelopt"}


def test_fused_groups_share_weight_scale_2(saved: tuple[torch.nn.Module, Path]) -> None:
    tensors = file_tensors(saved[1])
    for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        parent = "model.layers.1." + ("self_attn." if "q_proj" in group else "mlp.")
        values = {tensors[f"{parent}{m}.weight_scale_2"].item() for m in group}
        assert len(values) == 1, group


@pytest.mark.parametrize("backend", ["w4a16", "emulation"])
def test_loads_back_with_identical_outputs(
    saved: tuple[torch.nn.Module, Path], backend: str
) -> None:
    model, path = saved
    loaded = checkpoint.load(path, backend=backend)
    for m in model.modules():
        if isinstance(m, NVFP4Linear):
            m.backend = backend
    with torch.no_grad():
        for ids in token_batches(3, seed=7):
            assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_load_keeps_decode_scales_and_resave_is_byte_identical(
    saved: tuple[torch.nn.Module, Path], tmp_path: Path
) -> None:
    _, path = saved
    loaded = checkpoint.load(path)
    stored = file_tensors(path)
    layer = loaded.get_submodule(LAYER)
    d = stored[f"{LAYER}.weight_scale_2"].reshape(1)
    assert torch.equal(layer.weight_decode_scale, d)
    assert torch.equal(layer.weight_global_scale, torch.reciprocal(d))
    assert torch.equal(layer.input_global_scale, torch.reciprocal(stored[f"{LAYER}.input_scale"]
                                                                  .reshape(1)))
    checkpoint.save_pretrained(loaded, tmp_path / "again", format="modelopt")
    again = file_tensors(tmp_path / "again")
    assert again.keys() == stored.keys()
    for key in stored:
        assert torch.equal(raw(again[key]), raw(stored[key])), key


def test_decoding_is_modelopts_order(saved: tuple[torch.nn.Module, Path]) -> None:
    """value * fl32(scale * weight_scale_2), an oracle written in the test with numpy."""
    stored = file_tensors(saved[1])
    loaded = checkpoint.load(saved[1])
    for name in (LAYER, "model.layers.1.mlp.down_proj"):
        want = decode_decode_order(stored[f"{name}.weight"], stored[f"{name}.weight_scale"],
                                   stored[f"{name}.weight_scale_2"].item())
        got = loaded.get_submodule(name).weight_nvfp4().dequantize(torch.float32)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name


def test_weight_only_scheme(tmp_path: Path) -> None:
    model = _model(w4a4=False)
    checkpoint.save_pretrained(model, tmp_path / "w", format="modelopt")
    config = json.loads((tmp_path / "w" / HF_QUANT_CONFIG_NAME).read_text())
    assert config["quantization"]["quant_algo"] == "W4A16_NVFP4"
    qc = json.loads((tmp_path / "w" / "config.json").read_text())["quantization_config"]
    assert "input_activations" not in qc["config_groups"]["group_0"]
    assert not any(k.endswith("input_scale") for k in file_tensors(tmp_path / "w"))
    loaded = checkpoint.load(tmp_path / "w")
    assert loaded.get_submodule(LAYER).input_global_scale is None


def test_excluded_layers_stay_float(tmp_path: Path) -> None:
    model = tiny_llama()
    quantize_model(model, backend="w4a16", convention="modelopt",
                   ignore=["lm_head", "model.layers.0.mlp.down_proj"])
    checkpoint.save_pretrained(model, tmp_path / "x", format="modelopt")
    exclude = json.loads((tmp_path / "x" / HF_QUANT_CONFIG_NAME).read_text())
    assert exclude["quantization"]["exclude_modules"] == [
        "lm_head", "model.embed_tokens", "model.layers.0.mlp.down_proj"]
    loaded = checkpoint.load(tmp_path / "x")
    assert type(loaded.get_submodule("model.layers.0.mlp.down_proj")) is torch.nn.Linear
    assert isinstance(loaded.get_submodule("model.layers.1.mlp.down_proj"), NVFP4Linear)


def test_hf_quant_config_alone_is_read(saved: tuple[torch.nn.Module, Path],
                                       tmp_path: Path) -> None:
    """ModelOpt <= 0.29 wrote only hf_quant_config.json; vLLM still reads it."""
    path = copy_checkpoint(saved[1], tmp_path / "old")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    assert checkpoint.detect_format(path) == CheckpointFormat.MODELOPT
    assert isinstance(checkpoint.load(path).get_submodule(LAYER), NVFP4Linear)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"quant_algo": "FP8"}, "quant_algo 'FP8' is not NVFP4"),
        ({"quant_algo": "MIXED_PRECISION"}, "quant_algo 'MIXED_PRECISION' is not NVFP4"),
        ({"group_size": 32}, "group_size 32"),
        ({"kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "int"}},
         "kv_cache_quant_algo 'INT8'; vLLM 0.33 maps FP8 and NVFP4 only"),
    ],
)
def test_other_algorithms_are_refused(saved: tuple[torch.nn.Module, Path], tmp_path: Path,
                                      change: dict[str, object], pattern: str) -> None:
    path = copy_checkpoint(saved[1], tmp_path / "bad")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=pattern) as err:
        checkpoint.load(path)
    assert "config.json" in str(err.value)


def test_a_missing_tensor_is_named(saved: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = copy_checkpoint(saved[1], tmp_path / "miss")
    tensors = file_tensors(path)
    del tensors[f"{LAYER}.weight_scale_2"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{LAYER}\.weight_scale_2"):
        checkpoint.load(path)


def test_detect_format(saved: tuple[torch.nn.Module, Path], nvfp4lab_checkpoint: Path,
                       tmp_path: Path) -> None:
    assert checkpoint.detect_format(saved[1]) == CheckpointFormat.MODELOPT
    assert checkpoint.detect_format(nvfp4lab_checkpoint) == CheckpointFormat.COMPRESSED_TENSORS
    tiny_llama().save_pretrained(tmp_path / "float")
    with pytest.raises(CheckpointError, match="not a quantized checkpoint"):
        checkpoint.detect_format(tmp_path / "float")
    with pytest.raises(FileNotFoundError):
        checkpoint.detect_format(tmp_path / "nope")


def test_exclude_patterns() -> None:
    assert excluded("lm_head", ["lm_head"])
    assert excluded("model.layers.0.mlp.down_proj", ["model.layers.0.mlp*"])
    assert excluded("model.layers.0.mlp.down_proj", ["model.layers.0"])
    assert not excluded("model.layers.10.mlp.down_proj", ["model.layers.1"])


def test_compressed_tensors_state_dict_drops_stale_decode_scales() -> None:
    layer = _model(w4a4=True).get_submodule(LAYER)
    assert layer.weight_decode_scale is not None and layer.input_decode_scale is not None
    state = {k: v for k, v in layer.state_dict().items() if "decode" not in k}
    state["weight_global_scale"] = state["weight_global_scale"] * 2
    fresh = NVFP4Linear(layer.in_features, layer.out_features, bias=False)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh.weight_decode_scale, layer.weight_decode_scale)
    fresh.load_state_dict(state)
    assert fresh.weight_decode_scale is None and fresh.input_decode_scale is None
    assert fresh.weight_nvfp4().decode_scale is None
    fresh.set_input_decode_scale(0.5)
    assert fresh.input_global_scale.item() == 2.0
    fresh.set_input_global_scale(3.0)
    assert fresh.input_decode_scale is None


def test_kernel_convention_model_saves_reciprocals(tmp_path: Path) -> None:
    """A layer without a DECODE buffer is written with fl32(1/ENCODE)."""
    model = tiny_llama()
    quantize_model(model, backend="w4a16", share_global_scale="llama")
    checkpoint.save_pretrained(model, tmp_path / "k", format="modelopt")
    stored = file_tensors(tmp_path / "k")[f"{LAYER}.weight_scale_2"].item()
    gs = model.get_submodule(LAYER).weight_global_scale.numpy()
    assert stored == float(np.float32(1) / gs[0])


# -- the format's spec, against compressed-tensors' ModelOpt converter (an independent reading) --


def test_names_and_convention_match_compressed_tensors_modelopt_converter() -> None:
    """compressed-tensors' ``ModelOptNvfp4Converter`` renames a ModelOpt layer to
    compressed-tensors names and stores 1/x: the two specs must do the same."""
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import (
        ModelOptNvfp4Converter,
    )

    ct = checkpoint.FORMATS[CheckpointFormat.COMPRESSED_TENSORS]
    gen = torch.Generator().manual_seed(0)
    scales = torch.rand(2, generator=gen, dtype=torch.float32) * 0.1 + 1e-3
    stored = {
        f"m.{SPEC.names.packed}": torch.zeros(4, 8, dtype=torch.uint8),
        f"m.{SPEC.names.block_scale}": torch.ones(4, 1, dtype=torch.float8_e4m3fn),
        f"m.{SPEC.names.tensor_scale}": scales[0].reshape(SPEC.names.scalar_shape),
        f"m.{SPEC.names.input_scale}": scales[1].reshape(SPEC.names.scalar_shape),
    }
    oracle = ModelOptNvfp4Converter(targets=["Linear"]).process(dict(stored))
    mo, ours = SPEC.names.keys("m"), ct.names.keys("m")
    assert set(oracle) == set(ours.values())
    for role in ("global", "input"):
        value = stored[mo[role]].reshape(1)
        converted = ct.to_disk(*SPEC.from_disk(value))
        assert float(converted) == float(oracle[ours[role]]), role
    assert SPEC.names.decode_form and not ct.names.decode_form


def test_decode_scales_stored_exactly_and_read_back() -> None:
    held = torch.tensor([0.0123], dtype=torch.float32)
    stored = SPEC.to_disk(torch.reciprocal(held), held)
    assert stored.shape == () and float(stored) == float(held)
    assert float(SPEC.to_disk(torch.tensor([81.3]), None)) == float(
        np.float32(1) / np.float32(81.3))
    encode, exact = SPEC.from_disk(held)
    assert exact is held and float(encode) == float(np.float32(1) / np.float32(0.0123))
    assert SPEC.names.scalar_shapes == ((), (1,))
    assert float(SPEC.fused_decode_scale([0.5, 0.25, 0.75])) == 0.75


def test_detect_from_hf_quant_config_alone(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert not SPEC.detect(tmp_path)
    (tmp_path / HF_QUANT_CONFIG_NAME).write_text(json.dumps(hf_quant_config("NVFP4", [])))
    assert SPEC.detect(tmp_path) and checkpoint.detect_format(tmp_path) == "modelopt"
    config = SPEC.read_config(tmp_path)
    assert (config.quant_algo, config.checkpoint_scheme(), config.unquantized) == (
        "NVFP4", "NVFP4", ())
    (tmp_path / HF_QUANT_CONFIG_NAME).write_text(json.dumps({"producer": {"name": "other"}}))
    with pytest.raises(CheckpointError, match="is not ModelOpt"):
        SPEC.detect(tmp_path)
