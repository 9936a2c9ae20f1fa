"""checkpoint.verify: transformers loads a saved folder and runs one forward pass (the
dtype-mismatch remedy is checked in tests/test_faults.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint import CheckpointError
from tests.checkpoint.builders import VOCAB


def test_verify_runs_the_checkpoint_in_transformers(nvfp4lab_checkpoint: Path) -> None:
    ok = checkpoint.verify(nvfp4lab_checkpoint, tokens=5)
    assert ok.model_class == "LlamaForCausalLM" and ok.tokens == 5
    assert ok.dtype == torch.bfloat16
    assert ok.output_shape == (1, 5, VOCAB)  # logits: batch 1, 5 tokens, the vocabulary


def test_verify_refuses_bad_input(tmp_path: Path, nvfp4lab_checkpoint: Path) -> None:
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        checkpoint.verify(tmp_path)
    for tokens in (0, True, 2.0):
        with pytest.raises(ValueError, match="tokens must be a positive int"):
            checkpoint.verify(nvfp4lab_checkpoint, tokens=tokens)  # type: ignore[arg-type]


def test_verify_a_modelopt_checkpoint_says_transformers_has_no_loader(
    tmp_path: Path, nvfp4lab_checkpoint: Path
) -> None:
    """issue 19: transformers' ignore_mismatched_sizes hint misleads; the error says why."""
    checkpoint.convert(nvfp4lab_checkpoint, tmp_path / "mo", format="modelopt")
    with pytest.raises(CheckpointError, match=r"transformers has no loader for ModelOpt NVFP4 "
                       r"checkpoints.*convert\(path, dst, format='compressed-tensors'\)"):
        checkpoint.verify(tmp_path / "mo")
