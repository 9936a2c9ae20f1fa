"""FP-Quant's own NVFP4 format: save_pretrained(format="fp-quant"), load, convert to and from
compressed-tensors transforms, audit, refusals and hostile files.

The oracles: transformers' own ``FPQuantConfig`` validation for the configuration (transformers
cannot load the weights on a CPU: its ``FPQuantHfQuantizer.validate_environment`` needs a CUDA or
XPU device and the ``fp_quant`` package, checked below), and a slow reference of the layout
written here from FP-Quant's exporter (``pack_fp4_to_uint8``: element 2i in the low nibble;
``cast_scales_to_eXmY``: E4M3 bytes as uint8; decode ``code * scale / global_scale``; the
normalized Hadamard ``H = M / sqrt(h)`` multiplying each block of K on the right), independent of
nvfp4lab's codec."""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from compressed_tensors.transform import TransformConfig
from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix
from safetensors.torch import load_file, save_file
from transformers.utils.quantization_config import FPQuantConfig as TransformersFPQuantConfig

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint import CheckpointError
from nvfp4lab.checkpoint.formats import detect_format
from nvfp4lab.execution import NVFP4Linear, calibrate_inputs, quantize_model
from nvfp4lab.hadamard import BlockRotation, ct_rotation
from tests.checkpoint.builders import (
    E2M1_VALUES,
    assert_same_tensors,
    copy_checkpoint,
    file_tensors,
    raw,
    tiny_llama,
    token_batches,
    unpack_codes,
)
from tests.processes import cli_here

os.environ.setdefault("HF_HUB_OFFLINE", "1")

Q = "model.layers.0.self_attn.q_proj"
WEIGHTS = "model.safetensors"


def _w4a4(rotation: BlockRotation | None, seed: int = 2) -> tuple[torch.nn.Module,
                                                                  torch.nn.Module]:
    """(the float tiny Llama, it quantized W4A4 with calibrated ENCODE input scales, every layer
    rotated by ``rotation``)."""
    import copy

    floats = tiny_llama(seed=seed)
    model = copy.deepcopy(floats)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_model(model, backend="emulation", hadamard=rotation, share_global_scale="llama")
    calibrate_inputs(model, token_batches())
    return floats, model


@pytest.fixture(scope="module")
def rotated(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, torch.nn.Module,
                                                               Path]:
    """compressed-tensors' random-hadamard of block 16 (not symmetric: the side it multiplies
    on matters) on every layer, saved as FP-Quant."""
    floats, model = _w4a4(ct_rotation("random-hadamard", 16))
    path = checkpoint.save_pretrained(model, tmp_path_factory.mktemp("fpq") / "ckpt",
                                      format="fp-quant")
    return floats, model, path


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(token_batches()[0]).logits


# -- the configuration: transformers' FPQuantConfig as the oracle --------------------------------


def test_the_config_is_fp_quants_and_transformers_validates_it(rotated) -> None:
    _, _, path = rotated
    data = json.loads((path / "config.json").read_text())["quantization_config"]
    assert data == {"forward_dtype": "nvfp4", "backward_dtype": "bf16",
                    "forward_method": "abs_max", "hadamard_group_size": 16,
                    "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
                    "quant_method": "fp_quant", "store_master_weights": False,
                    "pseudoquantization": False, "transform_init": "hadamard"}
    oracle = TransformersFPQuantConfig.from_dict(data)  # post_init: transformers' validation
    assert (oracle.forward_dtype, oracle.hadamard_group_size, oracle.modules_to_not_convert) == (
        "nvfp4", 16, ["lm_head", "model.embed_tokens"])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    assert config.quantization_config["quant_method"] == "fp_quant"
    assert detect_format(path) == "fp-quant"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_transformers_cannot_load_fp_quant_weights_on_a_cpu(rotated) -> None:
    """Why the layout oracle is written here: transformers' quantizer refuses a CPU machine
    before it reads a tensor."""
    from transformers.quantizers.quantizer_fp_quant import FPQuantHfQuantizer

    _, _, path = rotated
    data = json.loads((path / "config.json").read_text())["quantization_config"]
    quantizer = FPQuantHfQuantizer(TransformersFPQuantConfig.from_dict(data))
    with pytest.raises(NotImplementedError, match="only supported on GPU"):
        quantizer.validate_environment(device_map=None)


@pytest.mark.parametrize(("key", "value", "ours"), [
    ("forward_method", "quest", "'abs_max'"),
    ("hadamard_group_size", 8, "16, 32, 64, 128"),
    ("backward_dtype", "mxfp4", "'bf16' backward"),
    ("transform_init", "random", "hadamard, identity, gsr"),
])
def test_configs_transformers_refuses_are_refused(rotated, tmp_path: Path, key: str,
                                                  value: object, ours: str) -> None:
    _, _, path = rotated
    data = json.loads((path / "config.json").read_text())
    data["quantization_config"][key] = value
    with pytest.raises(ValueError):
        TransformersFPQuantConfig.from_dict(data["quantization_config"])
    bad = copy_checkpoint(path, tmp_path / "bad")
    (bad / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=f"quantization_config.{key} is .*{ours}"):
        checkpoint.load(bad)


@pytest.mark.parametrize(("key", "value", "why"), [
    ("forward_dtype", "mxfp4", "reads NVFP4 FP-Quant checkpoints only"),
    ("pseudoquantization", True, "dequantized 'dqweight'"),
    ("store_master_weights", True, "float master weights"),
    ("modules_to_not_convert", None, "list of module name suffixes"),
])
def test_checkpoints_without_nvfp4_codes_are_refused(rotated, tmp_path: Path, key: str,
                                                     value: object, why: str) -> None:
    """transformers reads these (MXFP4, pseudo-quantized bf16 ``dqweight``, master weights,
    a null list it reads as ['lm_head'] while vLLM reads it as none); they hold no NVFP4 codes
    (or mean two things), so nvfp4lab names why in one line."""
    _, _, path = rotated
    data = json.loads((path / "config.json").read_text())
    data["quantization_config"][key] = value
    bad = copy_checkpoint(path, tmp_path / "bad")
    (bad / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=why) as err:
        checkpoint.load(bad)
    assert str(bad / "config.json") in str(err.value) and "\n" not in str(err.value)


# -- the layout: a slow reference written from FP-Quant's exporter --------------------------------


def _by_hand(stored: dict[str, torch.Tensor], layer: str) -> torch.Tensor:
    """float64 ``[N, K]`` of the stored, rotated weight: low nibble first, E2M1 values, E4M3
    bytes, divided by the ENCODE ``weight_global_scale``."""
    codes = unpack_codes(stored[f"{layer}.qweight"]).long()
    values = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes]
    scales = stored[f"{layer}.scales"].view(torch.float8_e4m3fn).to(torch.float64)
    blocks = values.reshape(*scales.shape, 16) * scales[..., None]
    return blocks.reshape(codes.shape) / stored[f"{layer}.weight_global_scale"].double()


def _unrotate(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``W_b Hᵀ`` per block of K: undoes ``W_b H`` for an orthogonal H."""
    b = h.shape[0]
    return (w.reshape(w.shape[0], -1, b) @ h.T).reshape(w.shape)


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    return 10 * math.log10(float(ref.pow(2).sum() / (ref - got).pow(2).sum()))


def test_stored_tensors_follow_fp_quants_layout(rotated) -> None:
    floats, model, path = rotated
    stored = load_file(str(path / WEIGHTS))
    layer = model.get_submodule(Q)
    expect = {"qweight": (torch.uint8, [64, 32]), "scales": (torch.uint8, [64, 4]),
              "weight_global_scale": (torch.float32, [1]), "act_global_scale": (torch.float32, [1]),
              "forward_hadamard_matrix": (torch.bfloat16, [16, 16]),
              "backward_hadamard_matrix": (torch.bfloat16, [16, 16])}
    assert {k.removeprefix(f"{Q}."): (v.dtype, list(v.shape)) for k, v in stored.items()
            if k.startswith(f"{Q}.")} == expect
    assert torch.equal(stored[f"{Q}.qweight"], layer.weight_packed)
    assert torch.equal(stored[f"{Q}.scales"], raw(layer.weight_scale))
    assert torch.equal(stored[f"{Q}.weight_global_scale"], layer.weight_global_scale)
    assert torch.equal(stored[f"{Q}.act_global_scale"], layer.input_global_scale)
    # the matrix: compressed-tensors' signs times Sylvester (its factory's), / sqrt(16), bfloat16
    signs = ct_rotation("random-hadamard", 16).matrix(torch.float64)
    sylvester = deterministic_hadamard_matrix(16, torch.float64)
    assert torch.equal((signs / sylvester).abs(), torch.ones(16, 16))  # rows of ±Sylvester
    h = stored[f"{Q}.forward_hadamard_matrix"]
    assert torch.equal(h, (signs / 4).to(torch.bfloat16))
    assert torch.equal(stored[f"{Q}.backward_hadamard_matrix"], h)
    # the stored codes are those of W H: un-rotating the hand decode gives W back (NVFP4 RTN
    # error only), multiplying on the other side does not
    w = floats.get_submodule(Q).weight.detach().double()
    decoded = _by_hand(stored, Q)
    right = _sqnr_db(w, _unrotate(decoded, h.double()))
    wrong = _sqnr_db(w, _unrotate(decoded, h.double().T))
    assert right > 17 and wrong < 3, (right, wrong)


def test_an_unrotated_model_stores_identity_matrices(tmp_path: Path) -> None:
    _, model = _w4a4(None, seed=4)
    path = checkpoint.save_pretrained(model, tmp_path / "plain", format="fp-quant")
    stored = load_file(str(path / WEIGHTS))
    for name, m in model.named_modules():
        if isinstance(m, NVFP4Linear):
            assert torch.equal(stored[f"{name}.forward_hadamard_matrix"],
                               torch.eye(16, dtype=torch.bfloat16))
    loaded = checkpoint.load(path, backend="emulation")
    assert all(m.hadamard is None for m in loaded.modules() if isinstance(m, NVFP4Linear))
    assert torch.equal(_logits(loaded), _logits(model))
    rows = checkpoint.audit_rows(path, gpus=("B200",))
    assert {r["transform"] for r in rows} == {"none (identity forward_hadamard_matrix 16x16)"}


# -- round trips, bit for bit --------------------------------------------------------------------


def test_save_load_save_is_bit_for_bit(rotated, tmp_path: Path) -> None:
    _, model, path = rotated
    loaded = checkpoint.load(path, backend="emulation")
    for name, layer in model.named_modules():
        if isinstance(layer, NVFP4Linear):
            back = loaded.get_submodule(name)
            assert back.hadamard == layer.hadamard
            for leaf in ("weight_packed", "weight_scale", "weight_global_scale",
                         "input_global_scale"):
                assert torch.equal(raw(getattr(back, leaf)), raw(getattr(layer, leaf))), leaf
    assert torch.equal(_logits(loaded), _logits(model))
    again = checkpoint.save_pretrained(loaded, tmp_path / "again", format="fp-quant")
    assert_same_tensors(file_tensors(again), file_tensors(path))


@pytest.mark.parametrize("size", [32, 64])
def test_other_blocks_round_trip(size: int, tmp_path: Path) -> None:
    """Sylvester of 32 (entries ±1/sqrt(32) rounded in bfloat16) and 64 (exact)."""
    _, model = _w4a4(ct_rotation("hadamard", size), seed=5)
    path = checkpoint.save_pretrained(model, tmp_path / "b", format="fp-quant")
    data = json.loads((path / "config.json").read_text())["quantization_config"]
    assert data["hadamard_group_size"] == size
    stored = load_file(str(path / WEIGHTS))
    want = (deterministic_hadamard_matrix(size, torch.float64) / math.sqrt(size)).bfloat16()
    assert torch.equal(stored[f"{Q}.forward_hadamard_matrix"], want)
    loaded = checkpoint.load(path, backend="emulation")
    assert loaded.get_submodule(Q).hadamard == ct_rotation("hadamard", size)
    assert torch.equal(_logits(loaded), _logits(model))


def test_convert_to_compressed_tensors_and_back_is_lossless(rotated, tmp_path: Path) -> None:
    _, model, path = rotated
    ct = checkpoint.convert(path, tmp_path / "ct", format="compressed-tensors").dst
    block = json.loads((ct / "config.json").read_text())["quantization_config"]
    config = TransformConfig.model_validate(block["transform_config"])  # compressed-tensors'
    (group, scheme), = config.config_groups.items()
    assert (group, scheme.type, scheme.head_dim) == ("v", "random-hadamard", 16)
    assert [(a.location, a.inverse) for a in scheme.apply] == [("input", False),
                                                               ("weight_input", True)]
    stored = file_tensors(ct)
    assert torch.equal(stored[f"{Q}.v_input.weight"],
                       ct_rotation("random-hadamard", 16).matrix(torch.float32))
    assert torch.equal(_logits(checkpoint.load(ct, backend="emulation")), _logits(model))
    back = checkpoint.convert(ct, tmp_path / "back", format="fp-quant").dst
    assert_same_tensors(file_tensors(back), file_tensors(path))
    assert (json.loads((back / "config.json").read_text())["quantization_config"]
            == json.loads((path / "config.json").read_text())["quantization_config"])


def test_a_plain_compressed_tensors_w4a4_checkpoint_converts_both_ways(
        ct_w4a4_checkpoint: Path, tmp_path: Path) -> None:
    fpq = checkpoint.convert(ct_w4a4_checkpoint, tmp_path / "fpq", format="fp-quant").dst
    stored = file_tensors(fpq)
    assert torch.equal(stored[f"{Q}.forward_hadamard_matrix"], torch.eye(16).bfloat16())
    back = checkpoint.convert(fpq, tmp_path / "ct", format="compressed-tensors").dst
    assert_same_tensors(file_tensors(back), file_tensors(ct_w4a4_checkpoint))
    assert torch.equal(_logits(checkpoint.load(fpq, backend="emulation")),
                       _logits(checkpoint.load(ct_w4a4_checkpoint, backend="emulation")))


def test_audit_rows_name_the_rotation(rotated, capfd: pytest.CaptureFixture[str]) -> None:
    _, _, path = rotated
    rows = checkpoint.audit_rows(path, gpus=("B200",))
    assert len(rows) == 14 and all(r["format"] == "fp-quant" and r["scheme"] == "NVFP4"
                                   and r["scale_form"] == "encode" and r["issues"] == ""
                                   for r in rows)
    assert {r["transform"] for r in rows} == {
        "input random-hadamard 16 (forward_hadamard_matrix, online, bfloat16 on disk)"}
    done = cli_here(["audit", str(path)], capfd)
    assert done.returncode == 0 and "14 quantized layers, 0 flagged" in done.stdout, done.stdout


# -- refusals --------------------------------------------------------------------------------------


def test_what_fp_quant_cannot_hold_is_refused(rotated, tmp_path: Path) -> None:
    _, model, path = rotated
    for fmt, why in (("modelopt", "ModelOpt checkpoint .* has no place"),
                     ("gguf", "GGUF has no rotation")):
        with pytest.raises(CheckpointError, match=f"{path}: its forward_hadamard_matrix tensors "
                                                  f"rotate inputs online .*{why}"):
            checkpoint.convert(path, tmp_path / fmt, format=fmt)
        assert not (tmp_path / fmt).exists()
    weight_only = tiny_llama(seed=1)
    quantize_model(weight_only, backend="emulation")
    with pytest.raises(CheckpointError, match=r"is W4A4 .* scheme 'NVFP4A16'"):
        checkpoint.save_pretrained(weight_only, tmp_path / "wo", format="fp-quant")
    import copy

    mixed = copy.deepcopy(model)
    mixed.get_submodule(Q).set_rotation(ct_rotation("hadamard", 32))
    with pytest.raises(ValueError, match=r"blocks of different sizes \(16 .*32 "):
        checkpoint.save_pretrained(mixed, tmp_path / "mixed", format="fp-quant")
    low = copy.deepcopy(model)
    low.get_submodule(Q).set_rotation(ct_rotation("random-hadamard", 16,
                                                  precision=torch.bfloat16))
    with pytest.raises(ValueError, match="FP-Quant stores no rotation precision"):
        checkpoint.save_pretrained(low, tmp_path / "low", format="fp-quant")
    seeded = tiny_llama()
    quantize_model(seeded, backend="emulation", hadamard=3)
    with pytest.raises(ValueError, match="rotated by a seed"):
        checkpoint.save_pretrained(seeded, tmp_path / "seeded", format="fp-quant")
    assert not any((tmp_path / n).exists() for n in ("wo", "mixed", "low", "seeded"))


# -- hostile files ---------------------------------------------------------------------------------


def _edit(path: Path, **tensors: torch.Tensor) -> Path:
    stored = file_tensors(path)
    stored.update(tensors)
    save_file(stored, str(path / WEIGHTS), metadata={"format": "pt"})
    return path


HOSTILE = {
    "a normalized float32 matrix times 4 (unnormalized ±1)": (
        {"forward_hadamard_matrix": lambda h: (h.float() * 4)},
        "holds entries of magnitude 1; an FP-Quant matrix is the identity or a Hadamard"),
    "a backward copy that differs": (
        {"backward_hadamard_matrix": lambda h: torch.eye(16, dtype=torch.bfloat16)},
        "differs from forward_hadamard_matrix"),
    "a matrix of the wrong block": (
        {"forward_hadamard_matrix": lambda h: torch.eye(32, dtype=torch.bfloat16)},
        "is BF16 [32, 32], expected a float [16, 16]"),
    "±1/4 entries that are not Hadamard": (
        {"forward_hadamard_matrix": lambda h: torch.full((16, 16), 0.25, dtype=torch.bfloat16)},
        "not a Hadamard matrix"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_bad_matrices_are_one_line_from_load_convert_and_audit(
        case: str, rotated, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    _, _, path = rotated
    edits, needle = HOSTILE[case]
    stored = file_tensors(path)
    bad = _edit(copy_checkpoint(path, tmp_path / "bad"), **{
        f"{Q}.{leaf}": make(stored[f"{Q}.forward_hadamard_matrix"])
        for leaf, make in edits.items()})
    with pytest.raises(CheckpointError, match=re.escape(needle)) as err:
        checkpoint.load(bad)
    assert str(bad / WEIGHTS) in str(err.value) and "\n" not in str(err.value)
    for argv in (["audit", str(bad)], ["convert", str(bad), str(tmp_path / "out"),
                                       "--format", "compressed-tensors"]):
        done = cli_here(argv, capfd)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], done.stderr
    assert not (tmp_path / "out").exists()


def test_a_missing_matrix_and_stored_scale_dtypes_are_refused(rotated, tmp_path: Path,
                                                              capfd) -> None:
    _, _, path = rotated
    stored = file_tensors(path)
    missing = copy_checkpoint(path, tmp_path / "missing")
    del stored[f"{Q}.forward_hadamard_matrix"]
    save_file(stored, str(missing / WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"layer '{Q}' has no forward_hadamard_matrix"):
        checkpoint.load(missing)
    # block scales stored as float32 (not FP-Quant's uint8 bytes): audit flags the layer,
    # load refuses naming file and tensor
    floats = _edit(copy_checkpoint(path, tmp_path / "f32"),
                   **{f"{Q}.scales": torch.ones(64, 4)})
    done = cli_here(["audit", str(floats)], capfd)
    assert done.returncode == 1 and "1 flagged" in done.stdout, done.stdout
    with pytest.raises(CheckpointError, match=rf"{Q}.scales' has dtype torch.float32"):
        checkpoint.load(floats)
    nan = _edit(copy_checkpoint(path, tmp_path / "nan"),
                **{f"{Q}.act_global_scale": torch.tensor([float("nan")])})
    with pytest.raises(CheckpointError, match=rf"{Q}.act_global_scale' must be finite and > 0"):
        checkpoint.load(nan)


# -- a checkpoint made by compressed-tensors itself, converted ------------------------------------


@pytest.mark.parametrize("stored", ["once", "none"])
def test_a_compressed_tensors_made_rotated_checkpoint_converts(stored: str,
                                                               tmp_path: Path) -> None:
    """compressed-tensors alone (llm-compressor's QuIP "v": online input, inverse fused into the
    weights; W4A4) stores the group's matrix once, under the first layer (``once``), or not at
    all (``none``: compressed-tensors' own matrix, from a fresh generator); every FP-Quant layer
    gets it, and the converted model computes what the source does."""
    from compressed_tensors.transform import TransformArgs, TransformScheme, apply_transform_config

    from tests.checkpoint.test_reader import ct_quantize_and_save

    model = tiny_llama(seed=6)
    apply = [TransformArgs(targets=["Linear"], location="input", ignore=["lm_head"]),
             TransformArgs(targets=["Linear"], location="weight_input", inverse=True,
                           ignore=["lm_head"])]
    apply_transform_config(model, TransformConfig(config_groups={
        "v": TransformScheme(type="random-hadamard", head_dim=16, apply=apply)}))
    src = tmp_path / "ct"
    ct_quantize_and_save(model, src, "NVFP4")
    tensors = load_file(str(src / WEIGHTS))
    assert [k for k in tensors if k.endswith("v_input.weight")] == [f"{Q}.v_input.weight"]
    if stored == "none":
        del tensors[f"{Q}.v_input.weight"]
        save_file(tensors, str(src / WEIGHTS), metadata={"format": "pt"})
    fpq = checkpoint.convert(src, tmp_path / "fpq", format="fp-quant").dst
    out = file_tensors(fpq)
    want = (ct_rotation().matrix(torch.float64) / 4).bfloat16()
    layers = [k.removesuffix(".qweight") for k in out if k.endswith(".qweight")]
    assert len(layers) == 14 and not any("v_input" in k for k in out)
    for layer in layers:
        assert torch.equal(out[f"{layer}.forward_hadamard_matrix"], want), layer
    keep = json.loads((fpq / "config.json").read_text())["quantization_config"][
        "modules_to_not_convert"]
    assert keep == ["lm_head", "model.embed_tokens"]
    assert torch.equal(_logits(checkpoint.load(fpq, backend="emulation")),
                       _logits(checkpoint.load(src, backend="emulation")))
