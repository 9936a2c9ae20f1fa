"""Rotations on disk: compressed-tensors' ``transform_config`` written, read, audited and refused,
with the installed compressed-tensors as the oracle for the matrices and for ``apply``."""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from compressed_tensors.transform import (
    TransformArgs,
    TransformConfig,
    TransformScheme,
    apply_transform_config,
)
from compressed_tensors.transform.utils.hadamard import (
    deterministic_hadamard_matrix,
    random_hadamard_matrix,
)
from torch import nn

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint import CheckpointError
from nvfp4lab.codec import quantize
from nvfp4lab.execution import NVFP4Linear, quantize_model
from nvfp4lab.hadamard import CT_DEFAULT_SEED, BlockRotation, ct_rotation, hadamard_transform
from tests.checkpoint.builders import (
    assert_same_tensors,
    file_tensors,
    raw,
    tiny_llama,
    token_batches,
)
from tests.checkpoint.test_reader import ct_quantize_and_save

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _v_scheme(kind: str = "random-hadamard", targets: list[str] | None = None,
              **extra: object) -> TransformConfig:
    """llm-compressor's QuIP "v" rotation: online input, its inverse fused into the weights."""
    targets = targets or ["Linear"]
    apply = [TransformArgs(targets=targets, location="input", ignore=["lm_head"]),
             TransformArgs(targets=targets, location="weight_input", inverse=True,
                           ignore=["lm_head"])]
    return TransformConfig(config_groups={"v": TransformScheme(type=kind, head_dim=16,
                                                               apply=apply, **extra)})


# -- the matrices -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 4, 8, 16, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_ct_rotation_equals_compressed_tensors_matrices(size: int, dtype: torch.dtype) -> None:
    assert torch.equal(ct_rotation("hadamard", size).matrix(dtype),
                       deterministic_hadamard_matrix(size, dtype))
    assert torch.equal(ct_rotation("random-hadamard", size).matrix(dtype),
                       random_hadamard_matrix(size, dtype, gen=torch.Generator()))
    gen = torch.Generator().manual_seed(7)
    assert torch.equal(ct_rotation("random-hadamard", size, seed=7).matrix(dtype),
                       random_hadamard_matrix(size, dtype, gen=gen))


def test_the_default_seed_is_a_fresh_generators_and_32_is_not_built() -> None:
    assert torch.Generator().initial_seed() == CT_DEFAULT_SEED
    assert ct_rotation(seed=CT_DEFAULT_SEED) == ct_rotation()
    assert ct_rotation(seed=1) != ct_rotation()
    # compressed-tensors' random-hadamard 32 is a tabulated matrix, not diag(s)·Sylvester
    table = random_hadamard_matrix(32, torch.float64, gen=torch.Generator())
    signs = torch.randint(0, 2, (32,), generator=torch.Generator(), dtype=torch.float64) * 2 - 1
    assert not torch.equal(table, signs[:, None] * deterministic_hadamard_matrix(32, torch.float64))
    with pytest.raises(ValueError, match="size 32 from a tabulated"):
        ct_rotation("random-hadamard", 32)
    # ... but it is read back from a checkpoint as it is stored
    assert torch.equal(BlockRotation.from_matrix("random-hadamard", table).matrix(torch.float64),
                       table)


def test_bad_matrices_are_refused_in_one_line() -> None:
    h = deterministic_hadamard_matrix(16, torch.float32)
    with pytest.raises(ValueError, match=r"only ±1 entries.*normalized"):
        BlockRotation.from_matrix("random-hadamard", h / 4)
    bad = h.clone()
    bad[0, 0] = -bad[0, 0]
    with pytest.raises(ValueError, match="not a Hadamard matrix"):
        BlockRotation.from_matrix("random-hadamard", bad)
    with pytest.raises(ValueError, match="'hadamard' transform is Sylvester"):
        BlockRotation.from_matrix("hadamard", -h)
    with pytest.raises(ValueError, match="kind must be one of"):
        ct_rotation("givens")


# -- compressed-tensors' apply on a CPU model == nvfp4lab's rotated layers -------------------------


def _two_linears(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 48, bias=False), nn.Linear(48, 32, bias=False)).float()


@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
def test_compressed_tensors_apply_equals_nvfp4lab_rotation(kind: str) -> None:
    plain = _two_linears()
    rotated = copy.deepcopy(plain)
    apply_transform_config(rotated, _v_scheme(kind))
    rot = ct_rotation(kind)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    for i in range(2):
        ct_layer, layer = rotated[i], plain[i]
        # the factory's matrix, stored as the transform's weight
        assert torch.equal(ct_layer.v_input.weight, rot.matrix(torch.float32))
        # offline: W R fused in the matrix's dtype (float32: "input" comes first in the scheme)
        assert torch.equal(ct_layer.weight, hadamard_transform(layer.weight.detach(), rot))
        xi = x if i == 0 else torch.randn(5, 48)
        assert torch.equal(ct_layer.v_input(xi), NVFP4Linear.from_linear(
            layer, hadamard=rot, backend="w4a16").rotate_input(xi))
        # the quantized rotated layer == compressed-tensors' rotated input times NVFP4(W R)
        q = NVFP4Linear.from_linear(layer, hadamard=rot, backend="w4a16")
        assert torch.equal(raw(q.weight_packed), raw(quantize(ct_layer.weight.detach()).packed))
        # same GEMM: an unrotated layer of NVFP4(compressed-tensors' fused W R) on its x R
        plain_q = NVFP4Linear.from_quantized(quantize(ct_layer.weight.detach()), backend="w4a16")
        with torch.no_grad():
            assert torch.equal(q(xi), plain_q(ct_layer.v_input(xi)))
    with torch.no_grad():  # the rotation cancels: same function up to float rounding
        assert torch.allclose(rotated(x), plain(x), rtol=0, atol=1e-5)


# -- MR-GPTQ saved and loaded bit for bit ---------------------------------------------------------


@pytest.fixture(scope="module")
def mr_gptq(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path]:
    model = tiny_llama(seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_model(model, backend="w4a16", method="mr-gptq", hadamard=ct_rotation(),
                       calibration=token_batches())
        path = checkpoint.save_pretrained(model, tmp_path_factory.mktemp("mr") / "ckpt")
    return model, path


def test_mr_gptq_writes_a_transform_config_compressed_tensors_validates(mr_gptq) -> None:
    model, path = mr_gptq
    data = json.loads((path / "config.json").read_text())["quantization_config"]
    config = TransformConfig.model_validate(data["transform_config"])
    (name, scheme), = config.config_groups.items()
    assert (name, scheme.type, scheme.head_dim, scheme.randomize) == ("v", "random-hadamard",
                                                                      16, False)
    assert [(a.location, a.inverse) for a in scheme.apply] == [("input", False),
                                                               ("weight_input", True)]
    layers = [n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    assert scheme.apply[0].targets == layers == scheme.apply[1].targets
    stored = file_tensors(path)
    for n in layers:
        assert torch.equal(stored[f"{n}.v_input.weight"], ct_rotation().matrix(torch.float32))


def test_mr_gptq_round_trip_is_bit_for_bit(mr_gptq, tmp_path: Path) -> None:
    model, path = mr_gptq
    loaded = checkpoint.load(path, backend="w4a16")
    for name, layer in model.named_modules():
        if isinstance(layer, NVFP4Linear):
            back = loaded.get_submodule(name)
            assert back.hadamard == layer.hadamard == ct_rotation()
            for leaf in ("weight_packed", "weight_scale", "weight_global_scale"):
                assert torch.equal(raw(getattr(back, leaf)), raw(getattr(layer, leaf))), leaf
    ids = token_batches()[0]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    again = checkpoint.save_pretrained(loaded, tmp_path / "again")
    assert_same_tensors(file_tensors(again), file_tensors(path))


def test_audit_reports_the_transform_per_layer(mr_gptq) -> None:
    _, path = mr_gptq
    rows = checkpoint.audit_rows(path, gpus=("B200",))
    assert all(r["transform"] == "input random-hadamard 16 (v, online, float32, matrix stored); "
               "weight_input inverse random-hadamard 16 (v, fused)" for r in rows)
    assert all(r["issues"] == "" for r in rows)


def test_formats_without_a_rotation_are_refused(mr_gptq, tmp_path: Path) -> None:
    model, path = mr_gptq
    for fmt, why in (("modelopt", "ModelOpt checkpoint .* has no place"),
                     ("gguf", "GGUF has no rotation")):
        with pytest.raises(ValueError, match=why):
            checkpoint.save_pretrained(model, tmp_path / fmt, format=fmt)
        with pytest.raises(CheckpointError, match=f"rotates inputs online.*{why}"):
            checkpoint.convert(path, tmp_path / f"c-{fmt}", format=fmt)
        assert not (tmp_path / fmt).exists() and not (tmp_path / f"c-{fmt}").exists()


def test_default_mr_gptq_saves_and_loads_bit_for_bit(tmp_path: Path) -> None:
    """quantize_model(method="mr-gptq") with no hadamard= rotates by compressed-tensors' own
    random-hadamard 16 (its factory's matrix from a fresh generator), equals the explicit
    hadamard=ct_rotation() run, and saves, validates and reloads bit for bit."""
    model, explicit = tiny_llama(seed=3), tiny_llama(seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_model(model, backend="w4a16", method="mr-gptq", calibration=token_batches())
        quantize_model(explicit, backend="w4a16", method="mr-gptq", hadamard=ct_rotation(),
                       calibration=token_batches())
        path = checkpoint.save_pretrained(model, tmp_path / "ckpt")
    ct_matrix = random_hadamard_matrix(16, torch.float32, gen=torch.Generator())
    layers = [n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    assert len(layers) == 14
    leaves = ("weight_packed", "weight_scale", "weight_global_scale")
    for name in layers:
        layer = model.get_submodule(name)
        assert torch.equal(layer.hadamard.matrix(torch.float32), ct_matrix)
        for leaf in leaves:
            assert torch.equal(raw(getattr(layer, leaf)),
                               raw(getattr(explicit.get_submodule(name), leaf))), (name, leaf)
    data = json.loads((path / "config.json").read_text())["quantization_config"]
    scheme = TransformConfig.model_validate(data["transform_config"]).config_groups["v"]
    assert (scheme.type, scheme.head_dim) == ("random-hadamard", 16)
    assert scheme.apply[0].targets == layers
    stored = file_tensors(path)
    assert all(torch.equal(stored[f"{n}.v_input.weight"], ct_matrix) for n in layers)
    loaded = checkpoint.load(path, backend="w4a16")
    for name in layers:
        back, layer = loaded.get_submodule(name), model.get_submodule(name)
        assert back.hadamard == layer.hadamard
        for leaf in leaves:
            assert torch.equal(raw(getattr(back, leaf)), raw(getattr(layer, leaf))), (name, leaf)
    ids = token_batches()[0]
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.equal(loaded(ids).logits, logits)
        assert torch.equal(explicit(ids).logits, logits)


def test_a_seeded_rotation_is_refused_with_the_fix(tmp_path: Path) -> None:
    model = tiny_llama()
    quantize_model(model, backend="w4a16", hadamard=3)
    with pytest.raises(ValueError, match=r"rotated by a seed.*hadamard=3.*ct_rotation\(\)"):
        checkpoint.save_pretrained(model, tmp_path / "seeded")


# -- a checkpoint made by compressed-tensors itself (llm-compressor's QuIP "v") -------------------


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path]:
    """compressed-tensors alone: apply_transform_config, NVFP4A16 quantization, compress, save.
    Returns a twin of the rotated float model (its transforms kept) and the folder."""
    model = tiny_llama(seed=4)
    apply_transform_config(model, _v_scheme())
    twin = copy.deepcopy(model)
    path = tmp_path_factory.mktemp("peer") / "ckpt"
    ct_quantize_and_save(model, path, "NVFP4A16")
    return twin, path


def test_a_compressed_tensors_checkpoint_loads_as_rotated_layers(peer) -> None:
    twin, path = peer
    loaded = checkpoint.load(path, backend="w4a16")
    x = torch.randn(3, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5))
    layers = [(n, m) for n, m in loaded.named_modules() if isinstance(m, NVFP4Linear)]
    assert len(layers) == 14
    for name, layer in layers:
        assert layer.hadamard == ct_rotation()
        ct_transform = twin.get_submodule(f"{name}.v_input")
        xi = x if layer.in_features == 64 else torch.randn(3, layer.in_features,
                                                          dtype=torch.bfloat16)
        assert torch.equal(layer.rotate_input(xi), ct_transform(xi))
        # the stored codes are NVFP4(W R): decoded they approximate compressed-tensors' fused W R
        fused = twin.get_submodule(name).weight.float()
        err = (layer.weight_nvfp4().dequantize_rotated(torch.float32) - fused).norm()
        assert err / fused.norm() < 0.15


def test_the_peer_checkpoint_stores_the_shared_matrix_once_and_audit_says_so(peer) -> None:
    _, path = peer
    stored = [k for k in file_tensors(path) if k.endswith(".v_input.weight")]
    assert stored == ["model.layers.0.self_attn.q_proj.v_input.weight"]  # a tied weight
    rows = checkpoint.audit_rows(path, gpus=("B200",))
    found = {r["transform"].split(";")[0].split(", ")[-1] for r in rows}
    assert found == {"matrix stored)", "matrix shared)"}
    assert all("transform" not in r["issues"] for r in rows)  # (its fused scales are unshared)


def test_unsupported_transforms_are_refused(peer, tmp_path: Path) -> None:
    _, path = peer

    def edited(tag: str, edit) -> Path:
        dst = tmp_path / tag
        import shutil

        shutil.copytree(path, dst)
        data = json.loads((dst / "config.json").read_text())
        edit(data["quantization_config"]["transform_config"]["config_groups"]["v"])
        (dst / "config.json").write_text(json.dumps(data))
        return dst

    perm = edited("perm", lambda g: g.update(randomize=True))
    with pytest.raises(CheckpointError, match=r"randomize=True.*vLLM 0\.33 ignores"):
        checkpoint.load(perm)
    out = edited("out", lambda g: g["apply"][0].update(location="output"))
    with pytest.raises(CheckpointError, match="online 'output' transform"):
        checkpoint.load(out)
    kind = edited("kind", lambda g: g.update(type="hadamard"))
    with pytest.raises(CheckpointError, match="'hadamard' transform is Sylvester"):
        checkpoint.load(kind)


def test_a_matrix_is_built_when_none_is_stored_and_a_bad_one_refused(peer, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    _, path = peer
    key = "model.layers.0.self_attn.q_proj.v_input.weight"
    for tag, edit in (("none", lambda t: t.pop(key)), ("bad", lambda t: t[key].mul_(0.25))):
        dst = shutil.copytree(path, tmp_path / tag)
        tensors = load_file(str(dst / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        if tag == "none":  # compressed-tensors' own matrix, from a fresh generator
            loaded = checkpoint.load(dst, backend="w4a16")
            assert {m.hadamard for m in loaded.modules() if isinstance(m, NVFP4Linear)} == {
                ct_rotation()}
        else:
            with pytest.raises(CheckpointError, match=rf"{key}.*only ±1 entries"):
                checkpoint.load(dst)


def test_transformers_runs_the_rotation_only_when_it_is_applied(mr_gptq, tmp_path: Path) -> None:
    """transformers 5.25 + compressed-tensors 0.20 load a transform_config checkpoint without its
    input rotations (a wrong model, silently); transformers_input_rotations applies them, and
    verify does so itself. Compared with nvfp4lab's model on the same ids (bfloat16 checkpoint:
    what transformers runs)."""
    from transformers import AutoModelForCausalLM

    model, _ = mr_gptq
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = checkpoint.save_pretrained(model, tmp_path / "bf16", dtype=torch.bfloat16)
    ours = checkpoint.load(path, backend="w4a16").eval()
    ids = token_batches(1, seed=4)[0]

    def kl_to_ours(theirs: nn.Module) -> float:
        with torch.no_grad():
            a = theirs(ids).logits.float().log_softmax(-1)
            b = ours(ids).logits.float().log_softmax(-1)
        return float((b.exp() * (b - a)).sum(-1).mean())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
        rotated = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
    layers = [n for n, m in ours.named_modules() if isinstance(m, NVFP4Linear)]
    assert checkpoint.transformers_input_rotations(rotated, path) == len(layers)
    close, wrong = kl_to_ours(rotated), kl_to_ours(plain)
    assert close < 1e-4 < wrong / 10, (close, wrong)  # measured 0.0 and 0.0128
    assert checkpoint.verify(path).input_rotations == len(layers)
    assert checkpoint.transformers_input_rotations(rotated, path) == 0  # never applied twice
    # a stored matrix that is not the one compressed-tensors builds: refused, not run wrongly
    import shutil

    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(path, other)
    (file,) = sorted(other.glob("*.safetensors"))
    tensors = load_file(str(file))
    key = next(k for k in tensors if k.endswith("v_input.weight"))
    tensors[key] = -tensors[key]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{key} differs from the rotation"):
        checkpoint.transformers_input_rotations(plain, other)
