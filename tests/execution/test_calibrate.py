"""Activation-scale calibration: encode-form input scales, nothing changed on failure."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab.codec import compute_global_scale
from nvfp4lab.execution import (
    NVFP4Linear,
    calibrate_inputs,
    calibration,
    quantize_model,
)
from nvfp4lab.hadamard import hadamard_transform
from tests.execution.tiny_models import tiny_model, token_batches


def test_calibration_sets_encode_scales() -> None:
    model = tiny_model()
    quantize_model(model, backend="emulation")
    batches = token_batches()
    # record max |input| of every NVFP4Linear independently (same weight-only forward)
    seen: dict[str, float] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, NVFP4Linear):
            def hook(mod, args, name=name):
                seen[name] = max(seen.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(m.register_forward_pre_hook(hook))
    result = calibrate_inputs(model, batches)
    for h in hooks:
        h.remove()
    assert set(result.amax) == set(seen) and not result.not_seen
    for name, amax in seen.items():
        layer = model.get_submodule(name)
        assert result.amax[name] == amax
        assert float(layer.input_global_scale) == pytest.approx(2688.0 / amax, rel=1e-7)
        assert torch.equal(
            layer.input_global_scale, compute_global_scale(torch.tensor([amax]))
        )
    assert not any(m._calibrating for m in model.modules() if isinstance(m, NVFP4Linear))


def test_calibration_exception_changes_nothing() -> None:
    model = tiny_model()
    quantize_model(model)
    with pytest.raises(RuntimeError, match="boom"), calibration(model):
        model(token_batches(1)[0])
        raise RuntimeError("boom")
    layers = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    assert all(m.input_global_scale is None and not m._forward_pre_hooks for m in layers)


def test_rotated_layer_calibrates_on_the_rotated_input() -> None:
    """A rotated layer's GEMM quantizes x Q: its static input scale is 2688/amax(x Q)."""
    torch.manual_seed(0)
    layer = NVFP4Linear.from_linear(torch.nn.Linear(64, 32), backend="emulation", hadamard=2)
    batches = [torch.randn(5, 64) for _ in range(3)]
    calibrate_inputs(torch.nn.Sequential(layer), batches)
    amax = max(float(hadamard_transform(x, 2).abs().max()) for x in batches)
    assert float(layer.input_global_scale) == float(compute_global_scale(torch.tensor([amax])))
