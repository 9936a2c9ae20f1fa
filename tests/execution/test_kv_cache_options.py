"""``quantize_model(kv_cache=KVCacheOptions(...))``: the KV cache job as one option object,
beside ``gptq=GPTQOptions(...)``; the older ``kv_cache=<kind>, kv_scales=...`` keywords mean
the same, bit for bit. And the report records' old import path."""

from __future__ import annotations

import pytest
import torch

import nvfp4lab
from nvfp4lab.execution import KVCacheOptions, NVFP4Linear, quantize_model
from nvfp4lab.execution.attention import KVCacheOptions as defined
from nvfp4lab.vocab import KVCacheKind
from tests.execution.test_attention import SCALE_PAIRS, SCALES, logits, tiny_llama


def test_options_are_exported_beside_gptq_options() -> None:
    assert nvfp4lab.KVCacheOptions is KVCacheOptions is defined
    assert "KVCacheOptions" in nvfp4lab.__all__ and "KVCacheOptions" in nvfp4lab.execution.__all__


@pytest.mark.parametrize("backend", ["w4a16", None])
def test_options_equal_the_older_keywords(backend: str | None) -> None:
    old, new = tiny_llama(), tiny_llama()
    r_old = quantize_model(old, backend=backend, kv_cache="fp8_e4m3", kv_scales=SCALES)
    options = KVCacheOptions("fp8_e4m3", scales=SCALES)
    r_new = quantize_model(new, backend=backend, kv_cache=options)
    assert options.kind is KVCacheKind.FP8  # vLLM's alias, held as the kind
    assert [(x.k_scale, x.v_scale) for x in r_new.kv_cache] == SCALE_PAIRS
    assert r_new.kv_cache == r_old.kv_cache and str(r_new) == str(r_old)
    assert any(isinstance(m, NVFP4Linear) for m in new.modules()) == (backend is not None)
    assert torch.equal(logits(new), logits(old))


def test_default_scales_are_one() -> None:
    report = quantize_model(tiny_llama(), backend=None, kv_cache=KVCacheOptions("nvfp4"))
    assert [(x.kind, x.k_scale, x.v_scale, x.scales_from) for x in report.kv_cache] == [
        ("nvfp4", 1.0, 1.0, "default")] * 2


def test_refusals_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match="unknown KVCacheOptions kind 'int8'; accepted values: "
                                         "'nvfp4', 'nvfp4_4over6', 'fp8'"):
        KVCacheOptions("int8")
    model = tiny_llama()
    before = logits(model)
    with pytest.raises(ValueError, match=r"kv_scales= beside kv_cache=KVCacheOptions\(\.\.\.\): "
                                         r"give the scales once"):
        quantize_model(model, backend="w4a16", kv_cache=KVCacheOptions("fp8"),
                       kv_scales={0: 1.0})
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())
    assert torch.equal(logits(model), before)
    with pytest.raises(ValueError, match=r"kv_scales keys 7 match no attention layer"):
        quantize_model(model, backend="w4a16", kv_cache=KVCacheOptions("fp8", scales={7: 1.0}))
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())
    assert torch.equal(logits(model), before)


def test_report_records_keep_their_whole_model_names() -> None:
    """The report's records live in ``quantize_report``; ``whole_model`` still hands them out."""
    from nvfp4lab.execution import quantize_report, whole_model

    for name in ("QuantizeReport", "ReplacedLayer", "SkippedLayer", "IgnoreSpec"):
        assert getattr(whole_model, name) is getattr(quantize_report, name), name
    report = quantize_model(tiny_llama(), backend=None, kv_cache=KVCacheOptions("fp8"))
    assert isinstance(report, whole_model.QuantizeReport)
