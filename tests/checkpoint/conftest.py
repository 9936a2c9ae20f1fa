"""Checkpoints made once per session: one by compressed-tensors, one by nvfp4lab."""

from __future__ import annotations

from pathlib import Path

import pytest

from nvfp4lab import checkpoint
from nvfp4lab.execution import quantize_model
from tests.checkpoint.builders import (
    tiny_llama,
)


@pytest.fixture(scope="module")
def nvfp4lab_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A weight-only checkpoint written by nvfp4lab (the base for the bad-input tests)."""
    model = tiny_llama()
    quantize_model(model, backend="w4a16", share_global_scale="llama")
    path = tmp_path_factory.mktemp("nv") / "ckpt"
    checkpoint.save_pretrained(model, path)
    return path
