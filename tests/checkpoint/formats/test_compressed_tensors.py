"""The compressed-tensors format module: its quantization config (built from compressed-tensors'
presets, validated on read) and its spec (tensor names, scale convention, detection), checked
against compressed-tensors' own classes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from compressed_tensors.quantization import (
    QuantizationConfig,
    preset_name_to_scheme,
)

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint import CheckpointError
from nvfp4lab.checkpoint.formats.compressed_tensors import (
    QUANTIZED_TENSOR_NAMES,
    SPEC,
    CompressedTensorsConfig,
    ignore_entries,
    quantization_config,
)
from nvfp4lab.checkpoint.records import Unquantized
from nvfp4lab.vocab import Scheme
from tests.checkpoint.builders import copy_checkpoint


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


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"format": "float-quantized"}, "format is 'float-quantized'"),
        ({"quant_method": "awq"}, "quant_method is 'awq'"),
        ({"quant_method": "modelopt"}, "quant_algo None is not NVFP4"),
        ({"quantization_status": "frozen"}, "quantization_status is 'frozen'"),
        ({"group_size": 32}, "group_size=32"),
    ],
)
def test_bad_config(
    nvfp4lab_checkpoint: Path, tmp_path: Path, change: dict[str, object], pattern: str
) -> None:
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "c")
    file = _edit_config(path, **change)
    with pytest.raises(CheckpointError, match=pattern) as err:
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
    with pytest.raises(ValueError, match="unknown scheme 'MXFP4'; accepted values: 'NVFP4', "
                                         "'NVFP4A16'"):
        checkpoint.quantization_config("MXFP4")  # type: ignore[arg-type]


# -- the format's spec, against compressed-tensors itself --------------------------------------


@pytest.mark.parametrize("with_input", [True, False])
def test_tensor_names_are_compressed_tensors_own(with_input: bool) -> None:
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    scheme = preset_name_to_scheme("NVFP4" if with_input else "NVFP4A16", ["Linear"])
    if with_input:  # a static activation scale, as nvfp4lab's W4A4 checkpoints store
        scheme.input_activations.dynamic = False
    expected = NVFP4PackedCompressor.compression_param_names(scheme)
    names = SPEC.names
    ours = (names.packed, names.block_scale, names.tensor_scale)
    assert ours + ((names.input_scale,) if with_input else ()) == expected
    assert QUANTIZED_TENSOR_NAMES[:3] == ours and QUANTIZED_TENSOR_NAMES[3] == names.input_scale
    assert SPEC.names.keys("m.q") == {"packed": "m.q.weight_packed", "block": "m.q.weight_scale",
                                      "global": "m.q.weight_global_scale",
                                      "input": "m.q.input_global_scale"}


def test_encode_scales_are_stored_as_held() -> None:
    encode = torch.tensor([81.30082], dtype=torch.float32)
    assert SPEC.to_disk(encode, torch.tensor([0.5])) is encode
    assert SPEC.from_disk(encode) == (encode, None)
    assert not SPEC.names.decode_form and SPEC.names.scalar_shapes == ((1,),)


def test_fused_decode_scale_is_vllms_reciprocal_of_the_max() -> None:
    stored = [700.0, 1234.5, 999.0]
    merged = SPEC.fused_decode_scale(stored)
    assert merged.dtype == torch.float32 and tuple(merged.shape) == (1,)
    assert float(merged) == float(np.float32(1) / np.float32(1234.5))


def test_config_written_and_read_back(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    SPEC.write_config(tmp_path, Scheme.NVFP4, Unquantized(("lm_head", "model.*.gate"), ()))
    assert SPEC.detect(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["model_type"] == "llama"
    qc = data["quantization_config"]
    assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "nvfp4-pack-quantized")
    assert qc["ignore"] == ignore_entries(["lm_head", "model.*.gate"])
    name, pattern = qc["ignore"]
    assert name == "lm_head" and pattern.startswith("re:")
    assert re.match(pattern[3:], "model.layers.3.gate")
    assert not re.match(pattern[3:], "model.layers.3.up")
    config = SPEC.read_config(tmp_path)
    assert config.checkpoint_scheme() == Scheme.NVFP4
    assert config.unquantized == (name, pattern)
    assert config.file == tmp_path / "config.json"
    model = torch.nn.ModuleDict({"lm_head": torch.nn.Linear(16, 4), "q": torch.nn.Linear(16, 4),
                                 "norm": torch.nn.LayerNorm(4)})
    assert config.quantized_modules(model) == {"q": True}


def test_mixed_schemes_have_no_single_scheme(tmp_path: Path) -> None:
    config = quantization_config("NVFP4")
    config.config_groups["group_1"] = preset_name_to_scheme("NVFP4A16", ["Embedding"])
    mixed = CompressedTensorsConfig(config, tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="config groups mix W4A4 and weight-only"):
        mixed.checkpoint_scheme()
