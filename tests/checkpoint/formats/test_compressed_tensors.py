"""The compressed-tensors quantization config: built from compressed-tensors' presets, validated on
read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from compressed_tensors.quantization import (
    QuantizationConfig,
    preset_name_to_scheme,
)

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint import CheckpointError
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
    with pytest.raises(ValueError, match="unknown scheme"):
        checkpoint.quantization_config("MXFP4")  # type: ignore[arg-type]
