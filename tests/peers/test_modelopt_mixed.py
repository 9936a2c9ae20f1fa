"""NVIDIA ModelOpt 0.47.0 as the oracle for nvfp4lab's ModelOpt MIXED_PRECISION checkpoints.

ModelOpt (imported from the directory ``make test-peers`` installs it into; nothing of it copied
here) quantizes a tiny Llama on the CPU with a per-layer config: attention Linears NVFP4 (W4A4,
or W4A16 with their input quantizers off), MLP Linears FP8 with per-channel weights and dynamic
per-token activations (``FP8_PER_CHANNEL_PER_TOKEN_CFG``'s quantizers), lm_head left float;
``export_hf_checkpoint`` writes ``quant_algo: MIXED_PRECISION`` with a ``quantized_layers`` map.
nvfp4lab loads that export (NVFP4Linear / FP8Linear / float), and ``save_pretrained(format=
"modelopt")`` of the loaded model writes ModelOpt's configurations field by field and its
tensors byte for byte. ModelOpt's per-tensor ``FP8`` layers (static input scale) are refused.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.execution import NVFP4Linear
from nvfp4lab.execution.mixed import FP8Linear
from tests.checkpoint.builders import file_tensors, raw
from tests.peers.modelopt_peer import export_hf_checkpoint, mtq, tiny_llama

pytestmark = [pytest.mark.peers, pytest.mark.filterwarnings("ignore")]

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
#: (name, NVFP4 per-layer algorithm, FP8 per-layer algorithm)
VARIANTS = [("w4a4", "NVFP4", "FP8_PER_CHANNEL_PER_TOKEN"),
            ("w4a16", "W4A16_NVFP4", "FP8_PER_CHANNEL_PER_TOKEN")]


def _quantizers(preset: dict, name: str) -> dict:
    """The ``cfg`` of ``*<name>`` in a ModelOpt preset's ``quant_cfg`` list."""
    return next(e["cfg"] for e in preset["quant_cfg"] if e.get("quantizer_name") == f"*{name}")


def _mixed_cfg(variant: str) -> dict:
    """NVFP4 everywhere (lm_head off, as the preset has it), then MLP quantizers FP8 per
    channel / per token (``fp8_pc_pt``) or per tensor (``fp8``), attention inputs off for
    W4A16."""
    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    preset = mtq.FP8_DEFAULT_CFG if variant == "fp8" else mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG
    extra = [{"quantizer_name": f"*mlp*{q}", "cfg": _quantizers(preset, q)}
             for q in ("weight_quantizer", "input_quantizer")]
    if variant == "w4a16":
        extra.append({"quantizer_name": "*self_attn*input_quantizer", "enable": False})
    cfg["quant_cfg"] = [*cfg["quant_cfg"], *extra]
    return cfg


def _export(variant: str, dtype: torch.dtype, path: Path) -> tuple[nn.Module, Path]:
    model = tiny_llama(dtype)
    float_model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (2, 32), generator=gen) for _ in range(4)]

    def forward_loop(m: nn.Module) -> None:
        for ids in batches:
            m(ids)

    mtq.quantize(model, _mixed_cfg(variant), forward_loop=forward_loop)
    export_hf_checkpoint(model, export_dir=str(path))
    return float_model, path


@pytest.fixture(scope="module",
                params=[(v, d) for v in VARIANTS for d in (torch.bfloat16, torch.float32)],
                ids=lambda p: f"{p[0][0]}-{str(p[1]).removeprefix('torch.')}")
def exported(request, tmp_path_factory) -> tuple[tuple[str, str, str], nn.Module, Path]:
    variant, dtype = request.param
    float_model, path = _export(variant[0], dtype, tmp_path_factory.mktemp("mixed") / "ckpt")
    return variant, float_model, path


def _layers(prefix: str = "model.layers.") -> list[tuple[str, str]]:
    return [(f"{prefix}{i}.{part}.{p}", part) for i in range(2)
            for part, names in (("self_attn", ATTN), ("mlp", MLP)) for p in names]


def test_export_is_mixed_precision_as_expected(exported) -> None:
    (_, nvfp4, fp8), _, path = exported
    quant = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "MIXED_PRECISION" and "exclude_modules" not in quant
    expected = {name: ({"quant_algo": nvfp4, "group_size": 16} if part == "self_attn"
                       else {"quant_algo": fp8}) for name, part in _layers()}
    assert quant["quantized_layers"] == expected  # lm_head absent: float


def test_load_keeps_the_bytes_and_fp8_is_ours(exported) -> None:
    (_, nvfp4, _), float_model, path = exported
    stored = file_tensors(path)
    model = checkpoint.load(path)
    assert type(model.get_submodule("lm_head")) is nn.Linear
    for name, part in _layers():
        layer = model.get_submodule(name)
        if part == "self_attn":
            assert isinstance(layer, NVFP4Linear), name
            assert torch.equal(layer.weight_packed, stored[f"{name}.weight"])
            assert torch.equal(raw(layer.weight_scale), raw(stored[f"{name}.weight_scale"]))
            assert (layer.input_global_scale is not None) == (nvfp4 == "NVFP4"), name
            continue
        assert isinstance(layer, FP8Linear) and layer.per_channel, name
        assert stored[f"{name}.weight_scale"].shape == (layer.out_features,)
        assert f"{name}.input_scale" not in stored
        assert torch.equal(raw(layer.weight), raw(stored[f"{name}.weight"])), name
        assert torch.equal(layer.weight_scale.reshape(-1), stored[f"{name}.weight_scale"]), name
        ours = FP8Linear.from_linear(float_model.get_submodule(name))  # independent of the file
        assert torch.equal(raw(ours.weight), raw(stored[f"{name}.weight"])), name
        assert torch.equal(ours.weight_scale, layer.weight_scale), name


def test_save_pretrained_modelopt_writes_modelopts_export(exported, tmp_path: Path) -> None:
    _, _, path = exported
    ours = checkpoint.save_pretrained(checkpoint.load(path), tmp_path / "ours", format="modelopt")
    mine, theirs = file_tensors(ours), file_tensors(path)
    assert sorted(mine) == sorted(theirs)
    for key, tensor in theirs.items():
        assert mine[key].dtype == tensor.dtype and mine[key].shape == tensor.shape, key
        assert torch.equal(raw(mine[key]), raw(tensor)), key
    hf_mine = json.loads((ours / "hf_quant_config.json").read_text())
    hf_theirs = json.loads((path / "hf_quant_config.json").read_text())
    assert hf_mine.keys() == hf_theirs.keys()
    for field in hf_theirs["quantization"]:
        assert hf_mine["quantization"][field] == hf_theirs["quantization"][field], field
    assert hf_mine == hf_theirs
    q_mine = json.loads((ours / "config.json").read_text())["quantization_config"]
    q_theirs = json.loads((path / "config.json").read_text())["quantization_config"]
    assert json.dumps(q_mine) == json.dumps(q_theirs)  # same fields, same order


def test_modelopt_per_tensor_fp8_is_refused(tmp_path: Path) -> None:
    _, path = _export("fp8", torch.bfloat16, tmp_path / "fp8")
    quant = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quantized_layers"]["model.layers.0.mlp.up_proj"] == {"quant_algo": "FP8"}
    with pytest.raises(CheckpointError, match=r"quant_algo 'FP8' \(per-tensor FP8 with a static "
                                              r"input scale, which FP8Linear"):
        checkpoint.load(path)
