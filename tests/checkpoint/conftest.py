"""Checkpoints made once per module: by nvfp4lab in both formats, shared and unshared."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from nvfp4lab import checkpoint
from nvfp4lab.execution import quantize_model
from tests.checkpoint.builders import modelopt_like, tiny_llama, token_batches


@pytest.fixture(scope="module")
def nvfp4lab_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A weight-only checkpoint written by nvfp4lab (the base for the bad-input tests)."""
    model = tiny_llama()
    quantize_model(model, backend="w4a16", share_global_scale="llama")
    path = tmp_path_factory.mktemp("nv") / "ckpt"
    checkpoint.save_pretrained(model, path)
    return path


@pytest.fixture(scope="module")
def ct_w4a4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A W4A4 compressed-tensors checkpoint (shared fused scales, calibrated inputs)."""
    model = tiny_llama(seed=3)
    quantize_model(model, backend="w4a16", share_global_scale="llama")
    modelopt_like(model, token_batches())
    path = tmp_path_factory.mktemp("ct") / "ckpt"
    checkpoint.save_pretrained(model, path)
    return path


@pytest.fixture(scope="module")
def unshared_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A weight-only checkpoint saved with share_global_scale=None (fused groups unshared)."""
    model = tiny_llama(seed=5)
    quantize_model(model, backend="w4a16", share_global_scale=None)
    path = tmp_path_factory.mktemp("un") / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoint.UnsharedGlobalScaleWarning)
        checkpoint.save_pretrained(model, path)
    return path
