"""compressed-tensors checkpoints: CT -> nvfp4lab, nvfp4lab -> transformers, round trips, bad input.

Every model is a tiny Llama built from a config in the test (hidden 64, 2 layers); nothing is
downloaded (HF_HUB_OFFLINE is set for the module).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationStatus,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils.helpers import (
    calculate_qparams,
    generate_gparam,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from nvfp4lab import checkpoint, metrics
from nvfp4lab.checkpoint import CheckpointError
from nvfp4lab.execution import NVFP4Linear, calibrate_inputs, quantize_model
from nvfp4lab.tensor import NVFP4Tensor

VOCAB = 128


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def tiny_llama(*, bias: bool = False, tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    """A random bf16 Llama: hidden 64, 2 layers, GQA (4 heads, 2 KV heads)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attention_bias=bias,
        mlp_bias=bias,
        tie_word_embeddings=tied,
    )
    # from_config(dtype=) as from_pretrained does: rotary frequencies stay float32 buffers
    # (``.to(torch.bfloat16)`` would round them and change every attention output)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def token_batches(n: int = 2, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 9), generator=gen) for _ in range(n)]


def ct_quantize_and_save(model: torch.nn.Module, path: Path, scheme: str = "NVFP4") -> None:
    """compressed-tensors 0.20 alone: preset, global/block scales, input scales, compress, save."""
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])}, ignore=["lm_head"]
    )
    apply_quantization_config(model, config)
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "quantization_scheme")}
    for module in layers.values():
        module.quantization_enabled = False  # calibrate on unquantized activations
    amax: dict[str, torch.Tensor] = {}

    def observe(name: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            value = args[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax.get(name, value), value)

        return hook

    handles = [m.register_forward_pre_hook(observe(n)) for n, m in layers.items()]
    with torch.no_grad():
        for ids in token_batches():
            model(ids)
    for handle in handles:
        handle.remove()
    with torch.no_grad():
        for name, module in layers.items():
            weight = module.weight
            gs = generate_gparam(*torch.aminmax(weight))
            module.weight_global_scale.data.copy_(gs)
            groups = weight.unflatten(-1, (-1, 16))
            args = module.quantization_scheme.weights
            scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=gs)
            module.weight_scale.data.copy_(scale)
            if hasattr(module, "input_global_scale"):
                module.input_global_scale.data.copy_(generate_gparam(-amax[name], amax[name]))
            module.quantization_status = QuantizationStatus.FROZEN
            module.quantization_enabled = True
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(path))
    compressor.update_config(str(path))


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes-comparable view (float8 has no torch.equal on every build)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(raw(a[key]), raw(b[key])), key


@pytest.fixture(scope="module")
def ct_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ct") / "tiny-llama-nvfp4"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ct_quantize_and_save(tiny_llama(bias=True), path, "NVFP4")
    return path


@pytest.fixture(scope="module")
def nvfp4lab_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A weight-only checkpoint written by nvfp4lab (the base for the bad-input tests)."""
    model = tiny_llama()
    quantize_model(model, backend="w4a16", share_global_scale="llama")
    path = tmp_path_factory.mktemp("nv") / "ckpt"
    checkpoint.save_pretrained(model, path)
    return path


# ---------------------------------------------------------------------------------------------
# compressed-tensors -> nvfp4lab
# ---------------------------------------------------------------------------------------------


def test_ct_checkpoint_loads_with_stored_bytes(ct_checkpoint: Path) -> None:
    model = checkpoint.load(ct_checkpoint, backend="w4a16")
    stored = file_tensors(ct_checkpoint)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(layers) == 14  # 7 Linears per layer; lm_head ignored
    assert isinstance(model.lm_head, torch.nn.Linear)
    for name, layer in layers.items():
        for leaf in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale",
                     "bias"):
            got, want = getattr(layer, leaf), stored[f"{name}.{leaf}"]
            assert got.dtype == want.dtype and torch.equal(raw(got), raw(want)), f"{name}.{leaf}"
    state = model.state_dict()
    for key, value in stored.items():
        assert torch.equal(raw(state[key]), raw(value)), key


def test_ct_weight_only_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "a16"
    ct_quantize_and_save(tiny_llama(), path, "NVFP4A16")
    model = checkpoint.load(path, backend="w4a16")
    stored = file_tensors(path)
    layer = model.model.layers[1].mlp.down_proj
    assert isinstance(layer, NVFP4Linear) and layer.input_global_scale is None
    prefix = "model.layers.1.mlp.down_proj"
    assert torch.equal(layer.weight_packed, stored[f"{prefix}.weight_packed"])
    assert f"{prefix}.input_global_scale" not in stored


def test_ct_checkpoint_w4a16_layers_equal_ct_decompress(ct_checkpoint: Path) -> None:
    model = checkpoint.load(ct_checkpoint, backend="w4a16")
    config = checkpoint.read_quantization_config(ct_checkpoint)
    scheme = config.config_groups["group_0"]
    gen = torch.Generator().manual_seed(3)
    with safe_open(str(ct_checkpoint / "model.safetensors"), "pt") as f:
        for name, layer in model.named_modules():
            if not isinstance(layer, NVFP4Linear):
                continue
            compressed = {
                leaf: f.get_tensor(f"{name}.{leaf}")
                for leaf in ("weight_packed", "weight_scale", "weight_global_scale")
            }
            w_ct = NVFP4PackedCompressor.decompress(compressed, scheme)["weight"]
            assert w_ct.dtype == torch.bfloat16
            assert torch.equal(w_ct, layer.weight_nvfp4().dequantize(torch.bfloat16)), name
            x = torch.randn(3, 5, layer.in_features, generator=gen).to(torch.bfloat16)
            with torch.no_grad():
                out = layer(x)
                # w4a16 = decompressed weight through F.linear, bias added to the bf16 output
                assert torch.equal(out, F.linear(x, w_ct) + layer.bias), name
                layer.bias = None
                assert torch.equal(layer(x), F.linear(x, w_ct)), name


def test_ct_checkpoint_round_trips_byte_identical(ct_checkpoint: Path, tmp_path: Path) -> None:
    model = checkpoint.load(ct_checkpoint, backend="w4a16")
    # compressed-tensors alone gives q/k/v their own scales (llm-compressor fuses them): the
    # bytes are re-saved as they are, on purpose
    out = checkpoint.save_pretrained(
        model, tmp_path / "again", require_shared_global_scale=False
    )
    assert_same_tensors(file_tensors(ct_checkpoint), file_tensors(out))
    ours = json.loads((out / "config.json").read_text())["quantization_config"]
    theirs = json.loads((ct_checkpoint / "config.json").read_text())["quantization_config"]
    assert ours == theirs  # the same compressed-tensors classes produced both


# ---------------------------------------------------------------------------------------------
# nvfp4lab -> transformers
# ---------------------------------------------------------------------------------------------


def _transformers_load(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()


def _decompressed(model: torch.nn.Module, name: str) -> torch.Tensor:
    return model.get_submodule(name).weight


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


# ---------------------------------------------------------------------------------------------
# nvfp4lab -> disk -> nvfp4lab
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [False, True])
def test_round_trip_is_byte_identical(tmp_path: Path, shards: bool) -> None:
    model = tiny_llama(bias=True, tied=True)
    quantize_model(model, backend="emulation", share_global_scale="llama")
    calibrate_inputs(model, token_batches())
    max_bytes = 20_000 if shards else checkpoint.writer.DEFAULT_MAX_SHARD_BYTES
    first = checkpoint.save_pretrained(model, tmp_path / "a", max_shard_bytes=max_bytes)
    assert (first / checkpoint.files.WEIGHTS_INDEX_NAME).is_file() == shards
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


def test_load_never_dequantizes(
    nvfp4lab_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("load() dequantized a weight")

    monkeypatch.setattr(NVFP4Tensor, "dequantize", refuse)
    model = checkpoint.load(nvfp4lab_checkpoint, backend="w4a16")
    for module in model.modules():
        if isinstance(module, NVFP4Linear):
            assert not hasattr(module, "weight")
            assert not module.cache_dequantized


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


# ---------------------------------------------------------------------------------------------
# Save errors and atomicity
# ---------------------------------------------------------------------------------------------


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


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
    import safetensors.torch

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("write failed")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="write failed"):
        checkpoint.save_pretrained(model, target, overwrite=True)
    assert_same_tensors(before, file_tensors(target))
    assert _leftovers(tmp_path) == []


def test_save_refuses_existing_path_and_float_model(tmp_path: Path) -> None:
    (tmp_path / "exists").mkdir()
    model = tiny_llama()
    with pytest.raises(ValueError, match="no NVFP4Linear"):
        checkpoint.save_pretrained(model, tmp_path / "float")
    quantize_model(model, backend="w4a16")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        checkpoint.save_pretrained(model, tmp_path / "exists")
    with pytest.raises(ValueError, match="input_global_scale"):
        checkpoint.save_pretrained(model, tmp_path / "w4a4", scheme="NVFP4")
    assert not (tmp_path / "float").exists() and not (tmp_path / "w4a4").exists()


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


# ---------------------------------------------------------------------------------------------
# Bad input: every error names the file and the tensor
# ---------------------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(path: Path, edit) -> Path:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return file


def _edit_config(path: Path, **changes: object) -> Path:
    file = path / "config.json"
    data = json.loads(file.read_text())
    qc = data["quantization_config"]
    for key, value in changes.items():
        if key == "group_size":
            qc["config_groups"]["group_0"]["weights"]["group_size"] = value
        else:
            qc[key] = value
    file.write_text(json.dumps(data))
    return file


KEY = "model.layers.0.self_attn.q_proj"


def test_missing_tensor(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(nvfp4lab_checkpoint, tmp_path / "c")
    file = _rewrite_weights(path, lambda t: t.pop(f"{KEY}.weight_scale"))
    with pytest.raises(CheckpointError, match=rf"{KEY}\.weight_scale") as err:
        checkpoint.load(path)
    assert str(file) in str(err.value)


def test_missing_plain_tensor(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(nvfp4lab_checkpoint, tmp_path / "c")
    file = _rewrite_weights(path, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight") as err:
        checkpoint.load(path)
    assert str(file) in str(err.value)


def test_wrong_dtype(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(nvfp4lab_checkpoint, tmp_path / "c")

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[f"{KEY}.weight_scale"] = t[f"{KEY}.weight_scale"].view(torch.uint8)

    file = _rewrite_weights(path, edit)
    with pytest.raises(CheckpointError, match=rf"{KEY}\.weight_scale.*torch\.uint8") as err:
        checkpoint.load(path)
    assert str(file) in str(err.value)


def test_wrong_shape(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(nvfp4lab_checkpoint, tmp_path / "c")

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[f"{KEY}.weight_packed"] = t[f"{KEY}.weight_packed"][:, :16].contiguous()

    file = _rewrite_weights(path, edit)
    with pytest.raises(CheckpointError, match=rf"{KEY}\.weight_packed.*shape \[64, 16\]") as err:
        checkpoint.load(path)
    assert str(file) in str(err.value)


def test_bad_global_scale(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(nvfp4lab_checkpoint, tmp_path / "c")

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[f"{KEY}.weight_global_scale"] = torch.zeros(1)

    _rewrite_weights(path, edit)
    with pytest.raises(CheckpointError, match=rf"{KEY}\.weight_global_scale.*> 0"):
        checkpoint.load(path)


@pytest.mark.parametrize(("byte", "what"), [(0x7F, "1 NaN"), (0xB8, "1 negative")])
def test_bad_block_scale(
    nvfp4lab_checkpoint: Path, tmp_path: Path, byte: int, what: str
) -> None:
    """A NaN (0x7f) or negative (sign bit, e.g. 0xb8 = -1.0) E4M3 block scale is corrupt: it
    would silently flip or poison a block, so loading refuses it naming file and tensor."""
    path = _copy(nvfp4lab_checkpoint, tmp_path / "c")

    def edit(t: dict[str, torch.Tensor]) -> None:
        raw = t[f"{KEY}.weight_scale"].view(torch.uint8).clone()
        raw[3, 1] = byte
        t[f"{KEY}.weight_scale"] = raw.view(torch.float8_e4m3fn)

    file = _rewrite_weights(path, edit)
    with pytest.raises(CheckpointError, match=rf"{KEY}\.weight_scale.*{what}.*\(3, 1\)") as err:
        checkpoint.load(path)
    assert str(file) in str(err.value)


def test_unexpected_tensor(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(nvfp4lab_checkpoint, tmp_path / "c")
    _rewrite_weights(path, lambda t: t.__setitem__("extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"extra\.weight.*strict=False"):
        checkpoint.load(path)
    assert isinstance(checkpoint.load(path, strict=False), LlamaForCausalLM)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"format": "float-quantized"}, "format is 'float-quantized'"),
        ({"quant_method": "modelopt"}, "quant_method is 'modelopt'"),
        ({"quantization_status": "frozen"}, "quantization_status is 'frozen'"),
        ({"group_size": 32}, "group_size=32"),
    ],
)
def test_bad_config(
    nvfp4lab_checkpoint: Path, tmp_path: Path, change: dict[str, object], pattern: str
) -> None:
    path = _copy(nvfp4lab_checkpoint, tmp_path / "c")
    file = _edit_config(path, **change)
    with pytest.raises(CheckpointError, match=pattern) as err:
        checkpoint.load(path)
    assert str(file) in str(err.value)


def test_pickle_files_are_refused(
    nvfp4lab_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_unpickling(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    path = _copy(nvfp4lab_checkpoint, tmp_path / "c")
    (path / "model.safetensors").unlink()
    pickle = path / "pytorch_model.bin"
    pickle.write_bytes(b"\x80\x04K\x01.")  # a pickle of the int 1; never executed
    with pytest.raises(CheckpointError, match="never unpickles") as err:
        checkpoint.load(path)
    assert str(pickle) in str(err.value)
    with pytest.raises(CheckpointError, match="pickle"):
        checkpoint.load(pickle)


def test_truncated_safetensors(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(nvfp4lab_checkpoint, tmp_path / "c")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated") as err:
        checkpoint.load(path)
    assert str(file) in str(err.value)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        checkpoint.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json"):
        checkpoint.load(tmp_path / "empty")


def test_quantization_config_is_compressed_tensors_preset() -> None:
    config = checkpoint.quantization_config("NVFP4A16", ignore=["lm_head"])
    assert isinstance(config, QuantizationConfig)
    group = config.config_groups["group_0"]
    preset = preset_name_to_scheme("NVFP4A16", ["Linear"])
    assert group.weights == preset.weights and group.input_activations is None
    assert config.format == "nvfp4-pack-quantized" and config.ignore == ["lm_head"]
    with pytest.raises(ValueError, match="unknown scheme"):
        checkpoint.quantization_config("MXFP4")  # type: ignore[arg-type]
