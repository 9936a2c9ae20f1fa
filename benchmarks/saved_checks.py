"""Checks the recipe benchmarks run on a saved checkpoint (imported by the scripts beside it):
compressed-tensors' own validation of the config, and tensor-for-tensor equality."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def validated(path: Path) -> bool:
    """Whether compressed-tensors' ``QuantizationConfig`` (and ``TransformConfig``, when the
    folder has a ``transform_config``) accept ``path/config.json``'s quantization_config
    (raises when not)."""
    from compressed_tensors.quantization import QuantizationConfig

    block = json.loads((path / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(
        {k: v for k, v in block.items() if k in set(QuantizationConfig.model_fields)})
    if "transform_config" in block:
        from compressed_tensors.transform import TransformConfig

        TransformConfig.model_validate(block["transform_config"])
    return True


def save_checked(model: torch.nn.Module, path: Path) -> tuple[Path, int, bool]:
    """``model`` saved as compressed-tensors at ``path``: the folder, its weight bytes and
    :func:`validated`."""
    from nvfp4lab import checkpoint

    folder = checkpoint.save_pretrained(model, path)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return folder, size, validated(folder)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as torch.equal compares it (float8 as its bytes)."""
    return tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor


def same_tensors(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Every state-dict entry of ``a`` and ``b``: the same keys, dtypes and bits."""
    left, right = a.state_dict(), b.state_dict()
    return left.keys() == right.keys() and all(
        left[k].dtype == right[k].dtype and torch.equal(_bits(left[k]), _bits(right[k]))
        for k in left)
