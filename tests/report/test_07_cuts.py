"""Notebook 07 computes nothing twice: the calibrated K / V scales, the same for every cache
kind, are calibrated once per `config_results` call, and every number stays what each
configuration's own calibration gives (bit for bit, on a seeded tiny Llama)."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab.execution import kv_calibration
from nvfp4lab.studies import llm
from nvfp4lab.studies import llm_configs as lc
from nvfp4lab.vocab import KVCacheKind
from tests.execution.test_attention import IDS, tiny_llama

BATCHES = [{"input_ids": IDS[:, :12], "attention_mask": torch.ones_like(IDS[:, :12])}]
CALIBRATED = [
    lc.LLMConfig("KV nvfp4, calibrated scales", None, kv_cache=KVCacheKind.NVFP4,
                 kv_scales=lc.CALIBRATED),
    lc.LLMConfig("KV fp8", None, kv_cache=KVCacheKind.FP8),
    lc.LLMConfig("KV fp8, calibrated scales", None, kv_cache=KVCacheKind.FP8,
                 kv_scales=lc.CALIBRATED),
]


def test_calibrated_kv_scales_are_calibrated_once_with_the_same_numbers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reference = tiny_llama()
    run = llm.reference_run(reference, IDS[0], context=8, progress=False)
    alone = [lc.config_result(reference, run, config, BATCHES) for config in CALIBRATED]
    calls = []
    real = kv_calibration.calibrate_kv_scales

    def counted(*args, **kwargs):
        calls.append(args[2] if len(args) > 2 else kwargs.get("kind"))
        return real(*args, **kwargs)

    monkeypatch.setattr(lc, "calibrate_kv_scales", counted)
    monkeypatch.setattr(kv_calibration, "calibrate_kv_scales", counted)
    together = lc.config_results(reference, run, CALIBRATED, BATCHES, progress=False)
    assert calls == [KVCacheKind.NVFP4]  # once, for the first configuration that needs it
    for one, shared in zip(alone, together, strict=True):
        for name in ("kld", "nll", "top1", "reference_nll"):
            assert torch.equal(getattr(one.fidelity, name), getattr(shared.fidelity, name))
        assert one.fidelity.row() == shared.fidelity.row(), one.label
    shared: dict[str, object] = {}
    lc.build(reference, CALIBRATED[0], BATCHES, shared=shared)
    scales, seconds = shared["kv_scales"]
    assert scales == real(reference, BATCHES, KVCacheKind.FP8) and seconds > 0
    # a build that reuses the calibration still counts its seconds (no wall-time ratio asserted:
    # its own time is >= 0 on a monotonic clock, plus the recorded calibration)
    _, again = lc.build(reference, CALIBRATED[0], BATCHES, shared=shared)
    assert again >= seconds


def test_calibration_passes_skip_the_output_head_only_when_it_observes_nothing() -> None:
    from nvfp4lab.execution import quantize_model
    from nvfp4lab.execution.layers import NVFP4Linear

    model = tiny_llama()
    assert lc._trunk(model, torch.nn.Module) is model.get_decoder()  # K / V: attention inside
    quantize_model(model, backend="emulation")  # lm_head ignored: it stays float
    assert lc._trunk(model, NVFP4Linear) is model.get_decoder()
    whole = tiny_llama()
    quantize_model(whole, backend="emulation", ignore=[])  # lm_head quantized: it observes
    assert isinstance(whole.lm_head, NVFP4Linear) and lc._trunk(whole, NVFP4Linear) is whole
    plain = torch.nn.Sequential(torch.nn.Linear(16, 16))
    assert lc._trunk(plain, torch.nn.Module) is plain  # no decoder to take
