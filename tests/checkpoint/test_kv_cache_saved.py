"""A quantized KV cache saved with the checkpoint (issue 35 item 4): save_pretrained writes the
kind and each layer's k / v DECODE scales as each format's engine reads them, load restores them
(bit-identical logits), convert carries them between compressed-tensors and ModelOpt (same float32
values), audit reports and checks them; what a format cannot hold is refused."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.execution import KVCacheOptions, quantize_model
from nvfp4lab.execution.attention import kv_cache_settings
from tests.execution.test_attention import logits, tiny_llama

SCALES = {0: (0.5, 2.0), 1: (0.03125, 0.7500001)}
ATTN = ("model.layers.0.self_attn", "model.layers.1.self_attn")
#: (format, kind) -> the stored k / v leaves under the attention module and their shape.
SAVED = {
    ("compressed-tensors", "fp8"): ("k_scale", "v_scale", [1]),
    ("modelopt", "fp8"): ("k_proj.k_scale", "v_proj.v_scale", []),
    ("modelopt", "nvfp4"): ("k_proj.k_scale", "v_proj.v_scale", []),
    ("modelopt", "nvfp4_4over6"): ("k_proj.k_scale", "v_proj.v_scale", []),
}


def _model(kind: str, scales: dict | None = SCALES, seed: int = 3) -> torch.nn.Module:
    model = tiny_llama(seed=seed)
    quantize_model(model, backend="w4a16", kv_cache=KVCacheOptions(kind, scales=scales))
    return model


def _save(model: torch.nn.Module, path: Path, fmt: str) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bfloat16 note of compressed-tensors
        return checkpoint.save_pretrained(model, path, format=fmt)


def _stored(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = [k for k in f.keys() if k.endswith(("k_scale", "v_scale"))]  # noqa: SIM118
        return {k: f.get_tensor(k) for k in keys}


@pytest.mark.parametrize(("fmt", "kind"), list(SAVED))
def test_save_then_load_gives_the_same_logits(fmt: str, kind: str, tmp_path: Path) -> None:
    model = _model(kind)
    path = _save(model, tmp_path / "ckpt", fmt)
    k_leaf, v_leaf, shape = SAVED[(fmt, kind)]
    stored = _stored(path)
    expected = {f"{ATTN[i]}.{leaf}": torch.tensor(pair[j], dtype=torch.float32)
                for i, pair in SCALES.items() for j, leaf in enumerate((k_leaf, v_leaf))}
    assert set(stored) == set(expected)
    for key, value in stored.items():
        assert value.dtype == torch.float32 and list(value.shape) == shape
        assert torch.equal(value.reshape(()), expected[key])  # the float32 value, exactly
    loaded = checkpoint.load(path)
    assert kv_cache_settings(loaded) == kv_cache_settings(model)
    assert torch.equal(logits(loaded), logits(model))


def test_compressed_tensors_config_is_what_compressed_tensors_validates(tmp_path: Path) -> None:
    from compressed_tensors.quantization import QuantizationConfig

    path = _save(_model("fp8"), tmp_path / "ct", "compressed-tensors")
    block = json.loads((path / "config.json").read_text())["quantization_config"]
    fields = set(QuantizationConfig.model_fields)
    config = QuantizationConfig.model_validate({k: v for k, v in block.items() if k in fields})
    kv = config.kv_cache_scheme
    assert kv is not None and (kv.num_bits, str(kv.type), str(kv.strategy)) == (
        8, "float", "tensor")
    assert kv.symmetric is True and kv.dynamic is False


def test_modelopt_configs_declare_the_algorithm(tmp_path: Path) -> None:
    for kind, algo, scheme in (("fp8", "FP8", {"dynamic": False, "num_bits": 8, "type": "float"}),
                               ("nvfp4", "NVFP4", "NVFP4"), ("nvfp4_4over6", "NVFP4", "NVFP4")):
        path = _save(_model(kind), tmp_path / kind, "modelopt")
        hf = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
        block = json.loads((path / "config.json").read_text())["quantization_config"]
        assert hf["kv_cache_quant_algo"] == algo and block["kv_cache_scheme"] == scheme
        marker = {"nvfp4lab_kv_cache_dtype": kind} if kind == "nvfp4_4over6" else {}
        assert {k: v for k, v in hf.items() if k.startswith("nvfp4lab")} == marker


def test_default_scales_are_saved_as_one(tmp_path: Path) -> None:
    model = _model("nvfp4", scales=None)
    path = _save(model, tmp_path / "m", "modelopt")
    assert all(float(v) == 1.0 for v in _stored(path).values()) and len(_stored(path)) == 4
    assert torch.equal(logits(checkpoint.load(path)), logits(model))


@pytest.mark.parametrize(("kind", "fmt", "words"), [
    ("nvfp4", "compressed-tensors", "validate_kv_cache_scheme accepts num_bits 8"),
    ("nvfp4_4over6", "compressed-tensors", "format='modelopt'"),
    ("fp8", "gguf", "GGUF cannot hold it")])
def test_a_format_that_cannot_hold_it_refuses(kind: str, fmt: str, words: str,
                                              tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=words) as err:
        _save(_model(kind), tmp_path / "x", fmt)
    assert "\n" not in str(err.value) and not (tmp_path / "x").exists()


def test_convert_carries_the_scales_both_ways(tmp_path: Path) -> None:
    model = _model("fp8")
    ct = _save(model, tmp_path / "ct", "compressed-tensors")
    mo = tmp_path / "mo"
    checkpoint.convert(ct, mo, format="modelopt")
    back = tmp_path / "ct2"
    checkpoint.convert(mo, back, format="compressed-tensors")
    first, middle, last = _stored(ct), _stored(mo), _stored(back)
    assert first.keys() == last.keys() and all(torch.equal(first[k], last[k]) for k in first)
    for key, value in first.items():
        attn, leaf = key.rsplit(".", 1)
        assert torch.equal(middle[f"{attn}.{leaf[0]}_proj.{leaf}"], value.reshape(()))
    for folder in (mo, back):
        assert torch.equal(logits(checkpoint.load(folder)), logits(model))
    assert json.loads((mo / "hf_quant_config.json").read_text())["quantization"][
        "kv_cache_quant_algo"] == "FP8"


def test_convert_refuses_a_target_that_cannot_hold_it(tmp_path: Path) -> None:
    mo = _save(_model("nvfp4"), tmp_path / "mo", "modelopt")
    for fmt, words in (("compressed-tensors", "cannot declare an nvfp4 KV cache"),
                       ("gguf", "GGUF cannot hold it")):
        with pytest.raises(CheckpointError, match=words):
            checkpoint.convert(mo, tmp_path / fmt, format=fmt)
        assert not (tmp_path / fmt).exists()


def _rewrite(path: Path, change: dict[str, torch.Tensor | None]) -> None:
    file = path / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        meta = f.metadata()
    for key, value in change.items():
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    save_file(tensors, str(file), metadata=meta)


def test_audit_reports_and_checks_the_scales(tmp_path: Path) -> None:
    path = _save(_model("nvfp4"), tmp_path / "mo", "modelopt")
    rows = [r for r in checkpoint.audit_rows(path, gpus=()) if r["kv_cache"] is not None]
    assert [(r["layer"], r["k_scale"], r["v_scale"], r["issues"]) for r in rows] == [
        (ATTN[0], 0.5, 2.0, ""), (ATTN[1], 0.03125, float(torch.tensor(0.7500001)), "")]
    _rewrite(path, {f"{ATTN[0]}.v_proj.v_scale": None,
                    f"{ATTN[1]}.k_proj.k_scale": torch.tensor(-1.0)})
    rows = {r["layer"]: r for r in checkpoint.audit_rows(path, gpus=()) if r["kv_cache"]}
    assert "no v_scale stored" in rows[ATTN[0]]["issues"]
    assert "k_scale must be finite and > 0" in rows[ATTN[1]]["issues"]


def test_audit_flags_a_kind_vllm_does_not_run(tmp_path: Path) -> None:
    path = _save(_model("fp8"), tmp_path / "mo", "modelopt")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "int"}
    (path / "config.json").write_text(json.dumps(config))
    rows = [r for r in checkpoint.audit_rows(path, gpus=()) if r["layer"] in ATTN]
    assert len(rows) == 2 and all("'INT8'; vLLM 0.33 maps FP8 and NVFP4" in r["issues"]
                                  for r in rows)
    with pytest.raises(CheckpointError, match="INT8"):
        checkpoint.load(path)


def test_a_missing_scale_loads_as_the_engine_fills_it(tmp_path: Path) -> None:
    """compressed-tensors: vLLM starts from ones (1.0); ModelOpt: a k_scale alone serves both
    sides (BaseKVCacheMethod)."""
    ct = _save(_model("fp8"), tmp_path / "ct", "compressed-tensors")
    _rewrite(ct, {f"{ATTN[1]}.v_scale": None})
    assert kv_cache_settings(checkpoint.load(ct))[ATTN[1]] == ("fp8", 0.03125, 1.0)
    mo = _save(_model("fp8"), tmp_path / "mo", "modelopt")
    _rewrite(mo, {f"{ATTN[1]}.v_proj.v_scale": None})
    assert kv_cache_settings(checkpoint.load(mo))[ATTN[1]] == ("fp8", 0.03125, 0.03125)


def test_stored_scales_without_a_declared_cache_are_unexpected(tmp_path: Path) -> None:
    path = _save(_model("fp8"), tmp_path / "ct", "compressed-tensors")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]["kv_cache_scheme"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="have no place"):
        checkpoint.load(path)
    assert not kv_cache_settings(checkpoint.load(path, strict=False))
