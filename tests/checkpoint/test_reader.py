"""checkpoint.load: compressed-tensors-made checkpoints read with their bytes unchanged, and every
malformed checkpoint refused with the file and tensor named."""

from __future__ import annotations

import json
import os
import shutil
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
from transformers import LlamaForCausalLM

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint import CheckpointError
from nvfp4lab.execution import NVFP4Linear
from nvfp4lab.tensor import NVFP4Tensor
from tests.checkpoint.builders import (
    assert_same_tensors,
    copy_checkpoint,
    file_tensors,
    raw,
    tiny_llama,
    token_batches,
)
from tests.checkpoint.hf_cache import LFS_POINTER, hf_cache_layout, sharded_checkpoint


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


@pytest.fixture(scope="module")
def ct_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ct") / "tiny-llama-nvfp4"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ct_quantize_and_save(tiny_llama(bias=True), path, "NVFP4")
    return path


def _rewrite_weights(path: Path, edit) -> Path:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return file


KEY = "model.layers.0.self_attn.q_proj"


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


def test_missing_tensor(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "c")
    file = _rewrite_weights(path, lambda t: t.pop(f"{KEY}.weight_scale"))
    with pytest.raises(CheckpointError, match=rf"{KEY}\.weight_scale") as err:
        checkpoint.load(path)
    assert str(file) in str(err.value)


def test_missing_plain_tensor(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "c")
    file = _rewrite_weights(path, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight") as err:
        checkpoint.load(path)
    assert str(file) in str(err.value)


def test_wrong_dtype(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "c")

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[f"{KEY}.weight_scale"] = t[f"{KEY}.weight_scale"].view(torch.uint8)

    file = _rewrite_weights(path, edit)
    with pytest.raises(CheckpointError, match=rf"{KEY}\.weight_scale.*torch\.uint8") as err:
        checkpoint.load(path)
    assert str(file) in str(err.value)


def test_wrong_shape(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "c")

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[f"{KEY}.weight_packed"] = t[f"{KEY}.weight_packed"][:, :16].contiguous()

    file = _rewrite_weights(path, edit)
    with pytest.raises(CheckpointError, match=rf"{KEY}\.weight_packed.*shape \[64, 16\]") as err:
        checkpoint.load(path)
    assert str(file) in str(err.value)


def test_bad_global_scale(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "c")

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
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "c")

    def edit(t: dict[str, torch.Tensor]) -> None:
        raw = t[f"{KEY}.weight_scale"].view(torch.uint8).clone()
        raw[3, 1] = byte
        t[f"{KEY}.weight_scale"] = raw.view(torch.float8_e4m3fn)

    file = _rewrite_weights(path, edit)
    with pytest.raises(CheckpointError, match=rf"{KEY}\.weight_scale.*{what}.*\(3, 1\)") as err:
        checkpoint.load(path)
    assert str(file) in str(err.value)


def test_unexpected_tensor(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "c")
    _rewrite_weights(path, lambda t: t.__setitem__("extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"extra\.weight.*strict=False"):
        checkpoint.load(path)
    assert isinstance(checkpoint.load(path, strict=False), LlamaForCausalLM)


def test_pickle_files_are_refused(
    nvfp4lab_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_unpickling(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "c")
    (path / "model.safetensors").unlink()
    pickle = path / "pytorch_model.bin"
    pickle.write_bytes(b"\x80\x04K\x01.")  # a pickle of the int 1; never executed
    with pytest.raises(CheckpointError, match="never unpickles") as err:
        checkpoint.load(path)
    assert str(pickle) in str(err.value)
    with pytest.raises(CheckpointError, match="pickle"):
        checkpoint.load(pickle)


def test_truncated_safetensors(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "c")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated") as err:
        checkpoint.load(path)
    assert str(file) in str(err.value)


# --------------------------------------------------------------------------------------------
# issue 32: folders from strangers (links out of the folder, the Hugging Face cache layout, a
# folder holding two formats, git-LFS pointers)


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(raw(sa[key]), raw(sb[key])), key


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharded_checkpoint(tmp_path_factory.mktemp("sharded") / "ckpt", seed=6)


def test_issue32_case1_weights_are_never_read_through_a_link_out(
        nvfp4lab_checkpoint: Path, sharded: Path, tmp_path: Path) -> None:
    """issue 32 case 1: a weight file that is a link to a file outside the folder (and outside
    a Hugging Face cache's blobs) is refused with the convert's words."""
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "c")
    elsewhere = tmp_path / "elsewhere.safetensors"
    (path / "model.safetensors").rename(elsewhere)
    (path / "model.safetensors").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match=rf"^{path}: 1 entry nvfp4lab will not read "
                                              rf"\(model\.safetensors -> {elsewhere} \(outside "
                                              r"the checkpoint folder\)\)"):
        checkpoint.load(path)
    shards = copy_checkpoint(sharded, tmp_path / "s")
    first = sorted(shards.glob("*.safetensors"))[0]
    first.rename(tmp_path / "shard")
    first.symlink_to("../shard")
    with pytest.raises(CheckpointError, match=rf"{first.name} -> \.\./shard = "
                                              rf"{tmp_path / 'shard'} \(outside"):
        checkpoint.load(shards)
    gguf = tmp_path / "gg"
    checkpoint.convert(nvfp4lab_checkpoint, gguf, format="gguf")
    (gguf / "model.gguf").rename(tmp_path / "elsewhere.gguf")
    (gguf / "model.gguf").symlink_to(tmp_path / "elsewhere.gguf")
    with pytest.raises(CheckpointError, match=r"model\.gguf -> .*elsewhere\.gguf \(outside"):
        checkpoint.load(gguf)  # a folder holding one .gguf: the same rule
    assert checkpoint.load(gguf / "model.gguf") is not None  # the file named by the user


def test_issue32_case14_a_hugging_face_cache_snapshot_loads(sharded: Path,
                                                           tmp_path: Path) -> None:
    """issue 32 case 14: the snapshot of a sharded checkpoint laid out as the Hugging Face cache
    lays it out (index, shards and config links ../../blobs/<hash>) loads as the plain folder
    does; so does the models--* folder (its refs/main snapshot)."""
    snapshot = hf_cache_layout(sharded, tmp_path / "hub")
    assert (snapshot / "model.safetensors.index.json").is_symlink()
    want = checkpoint.load(sharded)
    _same_state(checkpoint.load(snapshot), want)
    _same_state(checkpoint.load(snapshot.parent.parent), want)


def test_issue32_format_picks_one_of_two_formats_and_lfs_pointers_are_named(
        nvfp4lab_checkpoint: Path, unshared_checkpoint: Path, tmp_path: Path) -> None:
    """issue 32: a compressed-tensors folder that also holds a .gguf file reads with format=;
    a git-LFS pointer where a weight file should be is named as such."""
    both = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "both")
    checkpoint.convert(unshared_checkpoint, tmp_path / "gg", format="gguf")
    shutil.copy(tmp_path / "gg" / "model.gguf", both / "model.gguf")
    with pytest.raises(CheckpointError, match=r"several checkpoint formats at once .*"
                                              r"format='compressed-tensors' or format='gguf'"):
        checkpoint.load(both)
    _same_state(checkpoint.load(both, format="compressed-tensors"),
                checkpoint.load(nvfp4lab_checkpoint))
    _same_state(checkpoint.load(both, format="gguf"),
                checkpoint.load(tmp_path / "gg" / "model.gguf"))
    with pytest.raises(CheckpointError, match=r"is not a 'modelopt' \(NVFP4\) checkpoint, which "
                                              r"format='modelopt' asks for"):
        checkpoint.load(both, format="modelopt")
    (both / "model.gguf").unlink()
    (both / "model.safetensors").write_bytes(LFS_POINTER)
    with pytest.raises(CheckpointError, match=rf"^{both / 'model.safetensors'} is an "
                                              r"un-fetched git-LFS pointer .*git lfs pull"):
        checkpoint.load(both)
