"""The model study: MiniLM's fidelity under NVFP4 (embeddings, retrieval, per-layer SQNR)."""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4lab import models
from nvfp4lab.execution import NVFP4Linear
from nvfp4lab.metrics import sqnr_db
from nvfp4lab.studies import model_fidelity as study
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




def test_calibration_sentences_are_held_apart() -> None:
    assert len(study.CALIBRATION_SENTENCES) == 64
    assert len(set(study.CALIBRATION_SENTENCES)) == 64
    assert not set(study.CALIBRATION_SENTENCES) & set(study.SENTENCES)


@needs_minilm
def test_calibration_batches(encoder: models.SentenceEncoder) -> None:
    batches = study.calibration_batches(encoder, batch_size=10)
    assert len(batches) == 7 and [b["input_ids"].shape[0] for b in batches] == [10] * 6 + [4]
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    assert 800 < tokens < 1000  # ~900 real tokens (docstring)
    with pytest.raises(ValueError, match="batch_size must be > 0"):
        study.calibration_batches(encoder, batch_size=0)


@needs_minilm
def test_capture_inputs_leaves_out_padding(encoder: models.SentenceEncoder) -> None:
    sentences = study.SENTENCES[:6]
    acts = study.capture_inputs(encoder, sentences)
    assert list(acts) == study.linear_names(encoder.model)
    real = int(encoder.tokenize(sentences)["attention_mask"].sum())
    q = acts["encoder.layer.0.attention.self.query"]
    assert q.shape == (real, 384) and acts["encoder.layer.0.output.dense"].shape == (real, 1536)
    assert torch.equal(q, acts["encoder.layer.0.attention.self.value"])  # one input, shared
    assert acts["pooler.dense"].shape == (6, 384)  # [CLS] rows: no token axis to mask
    # the same rows as an unmasked hook, with the padding rows removed by hand
    seen: list[torch.Tensor] = []
    layer = encoder.model.get_submodule("encoder.layer.0.attention.output.dense")
    handle = layer.register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    with torch.no_grad():
        batch = encoder.tokenize(sentences)
        encoder.model(**batch)
    handle.remove()
    want = seen[0][batch["attention_mask"].bool()]
    assert torch.equal(acts["encoder.layer.0.attention.output.dense"], want)


@needs_minilm
def test_layer_sqnr_mask_padding(
    encoder: models.SentenceEncoder, quantized: models.SentenceEncoder
) -> None:
    sentences = study.SENTENCES[:8]
    name = "encoder.layer.2.intermediate.dense"
    masked = study.layer_sqnr(encoder, quantized, sentences, mode="isolated", layers=[name],
                              mask_padding=True)
    x = study.capture_inputs(encoder, sentences, [name])[name]
    with torch.no_grad():
        ref = encoder.model.get_submodule(name)(x)
        got = quantized.model.get_submodule(name)(x)
    assert masked.sqnr_db[name] == pytest.approx(sqnr_db(ref, got), abs=1e-9)
    padded = study.layer_sqnr(encoder, quantized, sentences, mode="isolated", layers=[name])
    assert padded.sqnr_db[name] != masked.sqnr_db[name]
