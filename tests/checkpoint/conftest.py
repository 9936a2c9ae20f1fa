"""Checkpoints made once per module by nvfp4lab: shared and unshared, weight-only and W4A4."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint.builders import saved_checkpoint


@pytest.fixture(scope="module")
def nvfp4lab_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A weight-only checkpoint written by nvfp4lab (the base for the bad-input tests)."""
    return saved_checkpoint(tmp_path_factory.mktemp("nv") / "ckpt")


@pytest.fixture(scope="module")
def ct_w4a4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A W4A4 compressed-tensors checkpoint (shared fused scales, calibrated inputs)."""
    return saved_checkpoint(tmp_path_factory.mktemp("ct") / "ckpt", seed=3, w4a4=True)


@pytest.fixture(scope="module")
def unshared_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A weight-only checkpoint saved with share_global_scale=None (fused groups unshared)."""
    return saved_checkpoint(tmp_path_factory.mktemp("un") / "ckpt", seed=5,
                            share_global_scale=None)
