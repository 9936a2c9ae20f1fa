"""The model study: MiniLM's fidelity under NVFP4 (embeddings, retrieval, per-layer SQNR)."""

from __future__ import annotations

import math

import pytest

from nvfp4lab import models
from nvfp4lab.execution import NVFP4Linear
from nvfp4lab.studies import models as study
from tests.conftest import needs_minilm


def test_shipped_sentences() -> None:
    assert 20 <= len(study.SENTENCES) <= 40
    assert len(set(study.SENTENCES)) == len(study.SENTENCES)
    flat = [i for pair in study.PARAPHRASE_PAIRS for i in pair]
    assert len(set(flat)) == len(flat) and max(flat) < len(study.SENTENCES)


@needs_minilm
def test_w4a16_embedding_fidelity(
    encoder: models.SentenceEncoder, quantized: models.SentenceEncoder
) -> None:
    report = study.embedding_fidelity(encoder, quantized)
    summary = report.summary()
    assert len(report.cosine) == len(study.SENTENCES) == len(report.rows())
    assert 0.95 < summary["cosine_min"] <= summary["cosine_mean"] < 1.0  # measured ~0.969 / 0.977
    assert summary["similarity_max_abs_error"] < 0.15
    assert summary["neighbor_agreement"] >= 0.8
    assert study.paraphrase_recall(quantized) >= 0.9
    with pytest.raises(ValueError, match="tokenizer"):
        study.embedding_fidelity(encoder.model, quantized.model)


@needs_minilm
def test_layer_sqnr(encoder: models.SentenceEncoder, quantized: models.SentenceEncoder) -> None:
    sentences = study.SENTENCES[:8]
    propagated = study.layer_sqnr(encoder, quantized, sentences)
    isolated = study.layer_sqnr(encoder, quantized, sentences, mode="isolated")
    names = [n for n, m in quantized.model.named_modules() if isinstance(m, NVFP4Linear)]
    assert list(propagated.sqnr_db) == names == list(isolated.sqnr_db)
    assert all(math.isfinite(v) for v in propagated.sqnr_db.values())
    first = "encoder.layer.0.attention.self.query"  # same input in both modes
    assert propagated.sqnr_db[first] == isolated.sqnr_db[first]
    assert 15.0 < isolated.min < isolated.max < 40.0  # one NVFP4 GEMM: ~20-34 dB measured
    assert propagated.min < isolated.min  # errors accumulate through the encoder
    with pytest.raises(ValueError, match="mode"):
        study.layer_sqnr(encoder, quantized, mode="both")  # type: ignore[arg-type]


