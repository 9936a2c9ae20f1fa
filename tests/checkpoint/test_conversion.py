"""checkpoint.convert: lossless CT <-> ModelOpt conversion, streamed and atomic."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint import CheckpointError, conversion
from nvfp4lab.checkpoint.files import read_header
from nvfp4lab.execution import quantize_model
from tests.checkpoint.builders import file_tensors, raw, tiny_llama, token_batches

CT_TO_MO = {"weight_packed": "weight", "weight_scale": "weight_scale",
            "weight_global_scale": "weight_scale_2", "input_global_scale": "input_scale"}


def _mo_key(key: str) -> str:
    prefix, _, leaf = key.rpartition(".")
    return f"{prefix}.{CT_TO_MO[leaf]}" if leaf in CT_TO_MO else key


def _f32_reciprocal(x: float) -> float:
    return float(np.float32(1) / np.float32(x))


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_ct_to_modelopt_to_ct(ct_w4a4_checkpoint: Path, tmp_path: Path) -> None:
    original = file_tensors(ct_w4a4_checkpoint)
    to_mo = checkpoint.convert(ct_w4a4_checkpoint, tmp_path / "mo", format="modelopt", workers=0)
    mo = file_tensors(tmp_path / "mo")
    assert set(mo) == {_mo_key(k) for k in original}
    bad = []
    for key, value in original.items():
        new = mo[_mo_key(key)]
        if key.endswith("global_scale"):  # ENCODE [1] -> DECODE [] = fl32(1/x)
            assert new.shape == () and new.item() == _f32_reciprocal(value.item()), key
            if _f32_reciprocal(new.item()) != value.item():
                bad.append(_mo_key(key))
        else:
            assert new.dtype == value.dtype and torch.equal(raw(new), raw(value)), key
    assert sorted(to_mo.not_round_trip) == sorted(bad)
    assert to_mo.scales == sum(k.endswith("global_scale") for k in original) == 28
    back = checkpoint.convert(tmp_path / "mo", tmp_path / "ct", format="compressed-tensors",
                              workers=0)
    again = file_tensors(tmp_path / "ct")
    assert again.keys() == original.keys()
    changed = [k for k in original if not torch.equal(raw(again[k]), raw(original[k]))]
    assert sorted(_mo_key(k) for k in changed) == sorted(bad)  # only the reciprocal ones
    assert all(k.endswith("global_scale") for k in changed)
    assert back.not_round_trip == ()  # fl32(1/x) values always come back
    assert checkpoint.verify(tmp_path / "ct").model_class == "LlamaForCausalLM"


def test_converted_checkpoint_loads_with_the_same_codes(ct_w4a4_checkpoint: Path,
                                                        tmp_path: Path) -> None:
    checkpoint.convert(ct_w4a4_checkpoint, tmp_path / "mo", format="modelopt", workers=0)
    ct, mo = checkpoint.load(ct_w4a4_checkpoint), checkpoint.load(tmp_path / "mo")
    name = "model.layers.1.self_attn.v_proj"
    a, b = ct.get_submodule(name), mo.get_submodule(name)
    assert torch.equal(a.weight_packed, b.weight_packed)
    assert torch.equal(raw(a.weight_scale), raw(b.weight_scale))
    assert torch.equal(b.weight_decode_scale, torch.reciprocal(a.weight_global_scale))
    with torch.no_grad():
        ids = token_batches(1, seed=9)[0]
        la, lb = ct(ids).logits.float(), mo(ids).logits.float()
    assert torch.allclose(la, lb, rtol=0.02, atol=0.02)


def test_sharded_checkpoint_keeps_its_shards(tmp_path: Path) -> None:
    model = tiny_llama(seed=2)
    quantize_model(model, backend="w4a16", share_global_scale="llama")
    checkpoint.save_pretrained(model, tmp_path / "ct", max_shard_bytes=12_000)
    shards = sorted(p.name for p in (tmp_path / "ct").glob("*.safetensors"))
    assert len(shards) > 2
    checkpoint.convert(tmp_path / "ct", tmp_path / "mo", format="modelopt", workers=2)
    assert sorted(p.name for p in (tmp_path / "mo").glob("*.safetensors")) == shards
    index = json.loads((tmp_path / "mo" / "model.safetensors.index.json").read_text())
    src = json.loads((tmp_path / "ct" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {_mo_key(k): v for k, v in src["weight_map"].items()}
    assert index["metadata"]["total_size"] == src["metadata"]["total_size"]
    for shard in shards:
        keys = set(read_header(tmp_path / "mo" / shard)[1]) - {"__metadata__"}
        assert keys == {k for k, v in index["weight_map"].items() if v == shard}
    assert checkpoint.load(tmp_path / "mo") is not None


def test_same_bytes_in_process_pool_and_inline(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    checkpoint.convert(nvfp4lab_checkpoint, tmp_path / "a", format="modelopt", workers=0)
    checkpoint.convert(nvfp4lab_checkpoint, tmp_path / "b", format="modelopt", workers=2)
    a, b = (tmp_path / "a" / "model.safetensors"), (tmp_path / "b" / "model.safetensors")
    assert a.read_bytes() == b.read_bytes()


def test_overwrite_rules(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    dst = tmp_path / "mo"
    checkpoint.convert(nvfp4lab_checkpoint, dst, format="modelopt", workers=0)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        checkpoint.convert(nvfp4lab_checkpoint, dst, format="modelopt", workers=0)
    checkpoint.convert(nvfp4lab_checkpoint, dst, format="modelopt", overwrite=True, workers=0)
    (dst / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        checkpoint.convert(nvfp4lab_checkpoint, dst, format="modelopt", overwrite=True,
                           workers=0)
    assert (dst / "notes.txt").read_text() == "mine"
    with pytest.raises(CheckpointError, match="overlaps the source"):
        checkpoint.convert(nvfp4lab_checkpoint, nvfp4lab_checkpoint / "x", format="modelopt")
    with pytest.raises(CheckpointError, match="already a compressed-tensors checkpoint"):
        checkpoint.convert(nvfp4lab_checkpoint, tmp_path / "same", format="compressed-tensors")
    with pytest.raises(ValueError, match="unknown format"):
        checkpoint.convert(nvfp4lab_checkpoint, tmp_path / "x", format="gguf")
    with pytest.raises(FileNotFoundError):
        checkpoint.convert(tmp_path / "nope", tmp_path / "y", format="modelopt")
    assert _leftovers(tmp_path) == []


def test_a_failure_leaves_nothing(nvfp4lab_checkpoint: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(task: object) -> object:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(conversion, "_convert_shard", broken)
    with pytest.raises(OSError, match="nothing was written"):
        checkpoint.convert(nvfp4lab_checkpoint, tmp_path / "mo", format="modelopt", workers=0)
    assert list(tmp_path.iterdir()) == []


def test_reciprocal_round_trip_rate() -> None:
    """The fraction the reports quote: about 14% of float32 values (log-uniform over many
    binades) do not survive 1/(1/x); the counter agrees with numpy's float32 arithmetic."""
    rng = np.random.default_rng(0)
    values = (2.0 ** rng.uniform(-20, -5, 20_000)).astype(np.float32)
    fails = sum(not conversion.reciprocal_round_trips(float(v)) for v in values)
    exact = np.float32(1) / (np.float32(1) / values) != values
    assert fails == int(exact.sum())
    assert 0.12 < fails / len(values) < 0.16
