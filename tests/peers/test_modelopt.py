"""NVIDIA ModelOpt 0.47.0 as the oracle for nvfp4lab's ModelOpt order and checkpoint format.

ModelOpt is imported from the directory ``make test-peers`` installs it into (``--no-deps``, with
the few modules it imports that the venv lacks); nothing of it is copied here. Oracles:
``NVFP4QTensor.quantize`` / ``.dequantize`` (modelopt/torch/quantization/qtensor/nvfp4_tensor.py)
and ``mtq.quantize`` + ``export_hf_checkpoint`` (modelopt/torch/export/unified_export_hf.py) on a
tiny Llama built from a config on the CPU, offline. ModelOpt 0.47 warns that the project's
transformers is newer than it was tested with; the export is checked here, bit for bit.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import nvfp4lab
from nvfp4lab import checkpoint
from nvfp4lab.execution import NVFP4Linear, quantize_model
from tests.checkpoint.builders import file_tensors, modelopt_like, raw
from tests.peers.modelopt_peer import (
    MODELOPT,
    NVFP4QTensor,
    export_hf_checkpoint,
    mtq,
    tiny_llama,
)
from tests.sample_data import make

pytestmark = [pytest.mark.peers, pytest.mark.filterwarnings("ignore")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["normal", "student_t", "outliers", "zero_blocks"]
SHAPES = [(64, 256), (128, 4096), (4, 32, 512)]
CASES = [(s, d, k, seed) for s in SHAPES for d in DTYPES for k in KINDS for seed in (0, 1)]


def test_modelopt_version() -> None:
    assert MODELOPT.__version__ == "0.47.0"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


@pytest.mark.parametrize(("shape", "dtype", "kind", "seed"), CASES)
def test_convention_modelopt_is_nvfp4qtensor_bit_for_bit(shape, dtype, kind, seed) -> None:
    x = make(kind, shape, dtype, seed)
    qt, scale, scale_2 = NVFP4QTensor.quantize(x, 16)
    ours = nvfp4lab.quantize(x, convention="modelopt")
    assert torch.equal(ours.packed, qt._quantized_data)
    assert torch.equal(_bits(ours.scales), _bits(scale))
    assert torch.equal(_bits(ours.decode_scale.reshape(())), _bits(scale_2.reshape(())))
    theirs = qt.dequantize(torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
    assert torch.equal(ours.dequantize(torch.float32), theirs)  # == (ModelOpt: code 8 -> +0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_k_and_given_scale_2(dtype) -> None:
    x = make("normal", (8, 80), dtype, 3)[:, :72]
    qt, scale, scale_2 = NVFP4QTensor.quantize(x, 16)
    ours = nvfp4lab.quantize(x, convention="modelopt", pad=True)
    assert torch.equal(ours.packed, qt._quantized_data)
    assert torch.equal(_bits(ours.scales), _bits(scale))
    given = scale_2 * 1.5
    qt, scale, _ = NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=given)
    ours = nvfp4lab.quantize(x, convention="modelopt", pad=True, decode_scale=given)
    assert torch.equal(ours.packed, qt._quantized_data)
    assert torch.equal(_bits(ours.scales), _bits(scale))


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (2, 32), generator=gen) for _ in range(4)]


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32])
def exported(request, tmp_path_factory) -> tuple[dict[str, torch.Tensor], torch.nn.Module, Path]:
    """(float weights, the float model, ModelOpt's export folder) for one model dtype."""
    model = tiny_llama(request.param)
    float_model = copy.deepcopy(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    def forward_loop(m: torch.nn.Module) -> None:
        for ids in _batches():
            m(ids)

    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop=forward_loop)
    path = tmp_path_factory.mktemp("export") / "ckpt"
    export_hf_checkpoint(model, export_dir=str(path))
    return weights, float_model, path


def _quantized_names(path: Path) -> list[str]:
    return sorted(k.removesuffix(".weight_scale_2") for k in file_tensors(path)
                  if k.endswith(".weight_scale_2"))


def test_export_loads_with_bytes_unchanged_and_modelopts_weights(exported) -> None:
    _, _, path = exported
    stored = file_tensors(path)
    model = checkpoint.load(path, backend="w4a16")
    names = _quantized_names(path)
    assert len(names) == 14
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(2))
    for name in names:
        layer = model.get_submodule(name)
        assert isinstance(layer, NVFP4Linear)
        assert torch.equal(layer.weight_packed, stored[f"{name}.weight"])
        assert torch.equal(raw(layer.weight_scale), raw(stored[f"{name}.weight_scale"]))
        assert torch.equal(layer.weight_decode_scale, stored[f"{name}.weight_scale_2"].reshape(1))
        assert torch.equal(layer.input_decode_scale, stored[f"{name}.input_scale"].reshape(1))
        n, k = layer.out_features, layer.in_features
        theirs = NVFP4QTensor(torch.Size((n, k)), layer.dtype, stored[f"{name}.weight"]).dequantize(
            layer.dtype, scale=stored[f"{name}.weight_scale"],
            double_scale=stored[f"{name}.weight_scale_2"], block_sizes={-1: 16})
        assert torch.equal(layer.weight_nvfp4().dequantize(), theirs), name
        xs = x[..., :k].to(layer.dtype)
        assert torch.equal(layer(xs), torch.matmul(xs, theirs.T)), name


def test_export_codes_are_convention_modelopt_with_the_stored_scale_2(exported) -> None:
    weights, _, path = exported
    stored = file_tensors(path)
    for name in _quantized_names(path):
        q = nvfp4lab.quantize(weights[f"{name}.weight"], convention="modelopt",
                              decode_scale=stored[f"{name}.weight_scale_2"])
        assert torch.equal(q.packed, stored[f"{name}.weight"]), name
        assert torch.equal(raw(q.scales), raw(stored[f"{name}.weight_scale"])), name


def _structure(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {k: (v.dtype, tuple(v.shape)) for k, v in file_tensors(path).items()}


def test_save_pretrained_modelopt_matches_the_export(exported, tmp_path: Path) -> None:
    _, float_model, path = exported
    ours = copy.deepcopy(float_model)
    quantize_model(ours, backend="w4a16", convention="modelopt", share_global_scale="llama")
    modelopt_like(ours, _batches())
    checkpoint.save_pretrained(ours, tmp_path / "ours", format="modelopt")
    names = lambda p: sorted(f.name for f in p.iterdir())  # noqa: E731
    assert names(tmp_path / "ours") == names(path)
    assert _structure(tmp_path / "ours") == _structure(path)
    for file in ("hf_quant_config.json",):
        assert json.loads((tmp_path / "ours" / file).read_text()) == json.loads(
            (path / file).read_text())
    mine = json.loads((tmp_path / "ours" / "config.json").read_text())
    theirs = json.loads((path / "config.json").read_text())
    assert mine["quantization_config"] == theirs["quantization_config"]
    assert json.dumps(mine["quantization_config"]) == json.dumps(theirs["quantization_config"])
    assert mine["dtype"] == theirs["dtype"] and mine["architectures"] == theirs["architectures"]


def test_export_round_trips_through_compressed_tensors(exported, tmp_path: Path) -> None:
    _, _, path = exported
    checkpoint.convert(path, tmp_path / "ct", format="compressed-tensors", workers=0)
    report = checkpoint.convert(tmp_path / "ct", tmp_path / "mo", format="modelopt", workers=0)
    original, back = file_tensors(path), file_tensors(tmp_path / "mo")
    assert original.keys() == back.keys()
    for key in original:
        if not key.endswith(("weight_scale_2", "input_scale")):
            assert torch.equal(raw(original[key]), raw(back[key])), key
    assert report.scales == 28
