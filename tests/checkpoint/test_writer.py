"""checkpoint.save_pretrained: what transformers reads back, byte-identical round trips, atomic
saves, shared fused scales."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from transformers import AutoModelForCausalLM

from nvfp4lab import checkpoint, metrics
from nvfp4lab.checkpoint import CheckpointError, safetensors_files
from nvfp4lab.execution import calibrate_inputs, quantize_model
from tests.checkpoint.builders import (
    assert_same_tensors,
    file_tensors,
    raw,
    tiny_llama,
    token_batches,
)


def _transformers_load(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()


def _decompressed(model: torch.nn.Module, name: str) -> torch.Tensor:
    return model.get_submodule(name).weight


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_transformers_reads_nvfp4lab_checkpoint_exactly(tmp_path: Path) -> None:
    model = tiny_llama()
    report = quantize_model(model, backend="w4a16", share_global_scale="llama")
    path = checkpoint.save_pretrained(model, tmp_path / "w4a16", require_shared_global_scale=True)
    theirs = _transformers_load(path)
    ids = token_batches(1, seed=5)[0]
    with torch.no_grad():
        logits_t = theirs(ids).logits  # first forward decompresses (compressed-tensors hook)
        logits_n = model(ids).logits
    for name in report.replaced_names:
        want = model.get_submodule(name).weight_nvfp4().dequantize(torch.bfloat16)
        assert torch.equal(_decompressed(theirs, name), want), name
    # no biases: both run F.linear / matmul on identical bf16 operands
    assert torch.equal(logits_t, logits_n)


def test_transformers_reads_nvfp4lab_checkpoint_with_bias(tmp_path: Path) -> None:
    model = tiny_llama(bias=True)
    report = quantize_model(model, backend="w4a16", share_global_scale="llama")
    path = checkpoint.save_pretrained(model, tmp_path / "bias", scheme="NVFP4A16")
    theirs = _transformers_load(path)
    ids = token_batches(1, seed=6)[0]
    with torch.no_grad():
        logits_t = theirs(ids).logits
        logits_n = model(ids).logits
    for name in report.replaced_names:
        want = model.get_submodule(name).weight_nvfp4().dequantize(torch.bfloat16)
        assert torch.equal(_decompressed(theirs, name), want), name
        assert torch.equal(theirs.get_submodule(name).bias, model.get_submodule(name).bias)
    # Not bit-exact: transformers' F.linear adds the bias inside the GEMM (fp32, one rounding);
    # nvfp4lab's w4a16 rounds the product to bf16, then adds the bias (vLLM's epilogue). Each
    # layer differs by <= 1 bf16 ulp, compounded over 2 layers: SQNR well above 30 dB.
    assert metrics.sqnr_db(logits_t, logits_n) > 30.0


def test_transformers_reads_nvfp4lab_w4a4_checkpoint(tmp_path: Path) -> None:
    reference = tiny_llama(bias=True)
    model = tiny_llama(bias=True)
    report = quantize_model(model, backend="emulation", share_global_scale="llama")
    calibrate_inputs(model, token_batches())
    path = checkpoint.save_pretrained(model, tmp_path / "w4a4")
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["input_activations"]["dynamic"] == "local"
    theirs = _transformers_load(path)
    ids = token_batches(1, seed=7)[0]
    with torch.no_grad():
        logits_t = theirs(ids).logits
        logits_n = model(ids).logits
        logits_f = reference(ids).logits
    for name in report.replaced_names:
        ours, other = model.get_submodule(name), theirs.get_submodule(name)
        assert torch.equal(other.input_global_scale, ours.input_global_scale), name
        assert torch.equal(other.weight, ours.weight_nvfp4().dequantize(torch.bfloat16)), name
    # compressed-tensors fake-quantizes activations in its own order (division, bf16 block amax)
    # while nvfp4lab's emulation uses vLLM's kernel order: the two W4A4 models agree far more
    # closely with each other than with the float model.
    assert metrics.sqnr_db(logits_t, logits_n) > metrics.sqnr_db(logits_f, logits_t) + 3.0


@pytest.mark.parametrize("shards", [False, True])
def test_round_trip_is_byte_identical(tmp_path: Path, shards: bool) -> None:
    model = tiny_llama(bias=True, tied=True)
    quantize_model(model, backend="emulation", share_global_scale="llama")
    calibrate_inputs(model, token_batches())
    max_bytes = 20_000 if shards else checkpoint.writer.DEFAULT_MAX_SHARD_BYTES
    first = checkpoint.save_pretrained(model, tmp_path / "a", max_shard_bytes=max_bytes)
    assert (first / safetensors_files.WEIGHTS_INDEX_NAME).is_file() == shards
    loaded = checkpoint.load(first, backend="emulation")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied
    original = model.state_dict()
    for key, value in loaded.state_dict().items():
        assert value.dtype == original[key].dtype and torch.equal(raw(value), raw(original[key]))
    second = checkpoint.save_pretrained(loaded, tmp_path / "b", max_shard_bytes=max_bytes)
    assert_same_tensors(file_tensors(first), file_tensors(second))
    assert json.loads((first / "config.json").read_text()) == json.loads(
        (second / "config.json").read_text()
    )
    ids = token_batches(1, seed=8)[0]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_save_copies_side_files(tmp_path: Path) -> None:
    source = tmp_path / "source"
    (source / "1_Pooling").mkdir(parents=True)
    (source / "tokenizer.json").write_text('{"version": "1.0"}')
    (source / "tokenizer_config.json").write_text("{}")
    (source / "1_Pooling" / "config.json").write_text("{}")
    (source / "notes.txt").write_text("not copied")
    model = tiny_llama()
    quantize_model(model, backend="w4a16")
    out = checkpoint.save_pretrained(model, tmp_path / "out", source=source)
    names = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "1_Pooling/config.json",
    }
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"


def test_issue32_side_files_linked_out_of_the_source_are_refused(tmp_path: Path) -> None:
    """A tokenizer file linking out of the source folder (``-> /etc/hostname``) was copied into
    the checkpoint; now nothing is written and the error names the link and its target. A link
    that stays inside the folder is copied as a file."""
    secret = tmp_path / "secret.txt"
    secret.write_text("local secret")
    source = tmp_path / "source"
    source.mkdir()
    (source / "tokenizer_config.json").write_text("{}")
    (source / "vocab.json").symlink_to("tokenizer_config.json")  # inside: fine
    (source / "tokenizer.json").symlink_to(secret)
    model = tiny_llama()
    quantize_model(model, backend="w4a16")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json.*secret\.txt.*outside"):
        checkpoint.save_pretrained(model, tmp_path / "out", source=source)
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []
    (source / "tokenizer.json").unlink()
    out = checkpoint.save_pretrained(model, tmp_path / "out", source=source)
    assert (out / "vocab.json").read_text() == "{}" and not (out / "vocab.json").is_symlink()


def test_a_generation_config_linked_out_of_the_source_is_named_once(tmp_path: Path) -> None:
    """generation_config.json is one of the copied files: the refusal counts and names it once
    (it was checked twice: '2 entries ... generation_config.json ..., generation_config.json')."""
    (tmp_path / "secret.txt").write_text("{}")
    source = tmp_path / "source"
    source.mkdir()
    (source / "generation_config.json").symlink_to(tmp_path / "secret.txt")
    model = tiny_llama()
    quantize_model(model, backend="w4a16")
    with pytest.raises(CheckpointError) as err:
        checkpoint.save_pretrained(model, tmp_path / "out", source=source)
    message = str(err.value)
    assert message.startswith(f"{source}: 1 entry nvfp4lab will not read (generation_config.json "
                              f"-> {tmp_path / 'secret.txt'} (outside"), message
    assert message.count("generation_config.json") == 1, message
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_failed_save_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama()
    quantize_model(model, backend="w4a16")

    def broken(self: ModelCompressor, directory: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(ModelCompressor, "update_config", broken)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_pretrained(model, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    assert _leftovers(tmp_path) == []


def test_failed_overwrite_keeps_old_checkpoint(
    nvfp4lab_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "ckpt"
    shutil.copytree(nvfp4lab_checkpoint, target)
    before = file_tensors(target)
    model = tiny_llama(seed=9)
    quantize_model(model, backend="w4a16")
    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("write failed")

    monkeypatch.setattr(safetensors_files, "write_safetensors", broken)
    with pytest.raises(OSError, match="write failed"):
        checkpoint.save_pretrained(model, target, overwrite=True)
    assert_same_tensors(before, file_tensors(target))
    assert _leftovers(tmp_path) == []


def test_save_refuses_existing_path_and_float_model(tmp_path: Path) -> None:
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "config.json").write_text("{}")  # not empty
    model = tiny_llama()
    with pytest.raises(ValueError, match="no NVFP4Linear"):
        checkpoint.save_pretrained(model, tmp_path / "float")
    quantize_model(model, backend="w4a16")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        checkpoint.save_pretrained(model, tmp_path / "exists")
    with pytest.raises(ValueError, match="input_global_scale"):
        checkpoint.save_pretrained(model, tmp_path / "w4a4", scheme="NVFP4")
    assert not (tmp_path / "float").exists() and not (tmp_path / "w4a4").exists()


def test_save_refuses_rotated_layers(tmp_path: Path) -> None:
    """A Hadamard-rotated layer holds W·Q; no checkpoint format stores the rotation."""
    model = tiny_llama()
    quantize_model(model, backend="w4a16", hadamard=1)
    with pytest.raises(ValueError, match=r"Hadamard-rotated weights .*hadamard=1"):
        checkpoint.save_pretrained(model, tmp_path / "rotated")
    assert not (tmp_path / "rotated").exists()


def test_require_shared_global_scale(tmp_path: Path) -> None:
    model = tiny_llama()
    # every layer its own global scale
    quantize_model(model, backend="w4a16", share_global_scale=None)
    with pytest.raises(CheckpointError, match=r"q_proj.*share_global_scale"):
        checkpoint.save_pretrained(model, tmp_path / "x", require_shared_global_scale=True)
    assert not (tmp_path / "x").exists()
    # the default warns (vLLM would decode the shards wrongly) but saves; False is silent
    with pytest.warns(checkpoint.UnsharedGlobalScaleWarning, match="q_proj"):
        checkpoint.save_pretrained(model, tmp_path / "w")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.save_pretrained(model, tmp_path / "v", require_shared_global_scale=False)
    shared = tiny_llama()
    quantize_model(shared, backend="w4a16", share_global_scale="llama")
    path = checkpoint.save_pretrained(shared, tmp_path / "y", require_shared_global_scale=True)
    stored = file_tensors(path)
    for group in checkpoint.fused_groups(shared):
        values = {float(stored[f"{m}.weight_global_scale"]) for m in group}
        assert len(values) == 1, group


# -- a quantized KV cache is never dropped without a word (issue 32, case 13) -------------------


@pytest.mark.parametrize(("kind", "fmt"), [("nvfp4", "compressed-tensors"), ("nvfp4", "gguf"),
                                           ("fp8", "gguf")])
def test_a_quantized_kv_cache_is_refused_where_the_format_cannot_hold_it(
        kind: str, fmt: str, tmp_path: Path) -> None:
    """quantize_model(kv_cache=..., kv_scales=...) then save_pretrained in a format that cannot
    declare that KV cache (an NVFP4 cache in compressed-tensors, any in GGUF; the others are
    saved: tests/checkpoint/test_kv_cache_saved.py): refused in one line naming the kind, a
    layer and its scales, why, and the fix; nothing is written. Without the KV cache
    quantization the same model saves."""
    from nvfp4lab.execution import remove_kv_cache_quantization

    model = tiny_llama(seed=4)
    quantize_model(model, backend="w4a16", kv_cache=kind, kv_scales={0: (0.5, 2.0)})
    target = tmp_path / "ckpt"
    with pytest.raises(ValueError) as err:
        checkpoint.save_pretrained(model, target, format=fmt)
    message = str(err.value)
    assert "\n" not in message
    assert f"({kind} on 2 attention layer(s), e.g. model.layers.0.self_attn: k_scale=0.5 " \
           "v_scale=2)" in message
    assert fmt in message.lower() and "remove_kv_cache_quantization(model)" in message
    assert not target.exists() and list(tmp_path.iterdir()) == []
    assert remove_kv_cache_quantization(model)
    assert checkpoint.save_pretrained(model, target, format=fmt) == target
