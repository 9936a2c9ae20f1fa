"""Calibrated KV cache scales (execution.kv_calibration) against a slow oracle: K / V captured
with observe_attention, their amax over every batch computed by hand in float64, divided by 448
and rounded once to float32 through struct."""

from __future__ import annotations

import struct

import pytest
import torch

from nvfp4lab.execution import KVCacheOptions, quantize_kv_cache, quantize_model
from nvfp4lab.execution.attention import kv_cache_settings, observe_attention
from nvfp4lab.execution.kv_calibration import calibrate_kv_scales, kv_scale_from_amax
from tests.execution.test_attention import IDS, logits, tiny_llama, tiny_qwen3

BATCHES = [{"input_ids": IDS[:, :12]}, {"input_ids": IDS[:1, 3:10] * 2 % 97}]


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _oracle(model: torch.nn.Module) -> dict[int, tuple[float, float]]:
    seen: dict[int, list[float]] = {}

    def keep(module, query, key, value) -> None:
        k = max(abs(x) for x in key.double().flatten().tolist())
        v = max(abs(x) for x in value.double().flatten().tolist())
        old = seen.setdefault(module.layer_idx, [0.0, 0.0])
        seen[module.layer_idx] = [max(old[0], k), max(old[1], v)]

    with torch.no_grad(), observe_attention(model, keep):
        for batch in BATCHES:
            model(**batch)
    # amax is a value of the model's dtype (float32 here), so one float32 division
    return {i: (_f32(_f32(k) / 448.0), _f32(_f32(v) / 448.0)) for i, (k, v) in seen.items()}


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3])
@pytest.mark.parametrize("kind", ["nvfp4", "fp8", "nvfp4_4over6"])
def test_scales_equal_the_hand_computed_amax_over_448(build, kind: str) -> None:
    model = build()
    expected = _oracle(model)
    assert calibrate_kv_scales(model, BATCHES, kind) == expected
    assert sorted(expected) == [0, 1] and all(0 < s < 1 for p in expected.values() for s in p)


def test_quantize_model_with_calibrated_scales_is_the_two_calls() -> None:
    for backend in (None, "w4a16"):
        model, direct = tiny_llama(seed=2), tiny_llama(seed=2)
        report = quantize_model(model, backend=backend, calibration=BATCHES,
                                kv_cache=KVCacheOptions("nvfp4", scales="calibrated"))
        scales = calibrate_kv_scales(direct, BATCHES, "nvfp4")
        quantize_model(direct, backend=backend, kv_cache=KVCacheOptions("nvfp4", scales=scales))
        assert [(r.k_scale, r.v_scale) for r in report.kv_cache] == list(scales.values())
        assert torch.equal(logits(model), logits(direct))


def test_calibrated_scales_with_gptq_read_the_batches_twice() -> None:
    model = tiny_llama(seed=5)
    quantize_model(model, backend="w4a16", method="gptq", calibration=iter(BATCHES),
                   kv_cache=KVCacheOptions("fp8", scales="calibrated"))
    assert set(kv_cache_settings(model)) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}


def test_refusals() -> None:
    model = tiny_llama()
    with pytest.raises(ValueError, match="pass calibration="):
        quantize_model(model, backend=None, kv_cache=KVCacheOptions("fp8", scales="calibrated"))
    with pytest.raises(ValueError, match="calibrate_kv_scales"):
        quantize_kv_cache(model, "fp8", kv_scales="calibrated")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass 'calibrated'"):
        KVCacheOptions("fp8", scales="calibrate")
    quantize_kv_cache(model, "fp8")
    with pytest.raises(ValueError, match="quantized already"):
        calibrate_kv_scales(model, BATCHES, "fp8")
    assert kv_scale_from_amax(0.0) == 1.0 and kv_scale_from_amax(448.0) == 1.0
