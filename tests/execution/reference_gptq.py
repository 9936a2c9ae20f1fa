"""The oracle for whole-model GPTQ: sequential GPTQ as it ran before the block pipeline.

Stage by stage (a fused group is one stage), the WHOLE model runs over every calibration batch
with a forward pre-hook per layer of the stage, each layer accumulating its own float64
Hessian (padding tokens left out); every layer is then quantized on its own with
:func:`gptq_quantize` and installed before the next stage is calibrated. Slow (one full pass per
stage) and plain on purpose: :func:`nvfp4lab.execution.quantize_model` must give its bits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from nvfp4lab.execution import NVFP4Linear
from nvfp4lab.execution import whole_model as wm
from nvfp4lab.execution.calibrate import run_batch
from nvfp4lab.execution.gptq import GPTQOptions, Hessian, gptq_quantize
from nvfp4lab.execution.gptq_model import _stages


def _mask(batch: Any, x: torch.Tensor) -> torch.Tensor | None:
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if isinstance(mask, torch.Tensor) and x.ndim == 3 and tuple(mask.shape) == x.shape[:2]:
        return mask != 0
    return None


def _stage_hessians(model: nn.Module, stage: Sequence[str], batches: Sequence[Any]
                    ) -> dict[str, Hessian]:
    hessians: dict[str, Hessian] = {}
    current: list[Any] = [None]

    def hook_for(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            hessians.setdefault(name, Hessian(x.shape[-1], x.device)).add(
                x, _mask(current[0], x))

        return hook

    handles = [model.get_submodule(n).register_forward_pre_hook(hook_for(n)) for n in stage]
    try:
        with torch.no_grad():
            for batch in batches:
                current[0] = batch
                run_batch(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    return hessians


def whole_model_gptq(
    model: nn.Module,
    batches: Sequence[Any],
    *,
    share: str | None = "auto",
    options: GPTQOptions | None = None,
    backend: str = "w4a16",
    hadamard: int | None = None,
) -> list[str]:
    """Quantize ``model`` in place (every Linear ``quantize_model`` would take, lm_head left
    out; ``hadamard``: MR-GPTQ, each layer by ``gptq_quantize(hadamard=...)``); returns the
    layer names in order."""
    report = wm.QuantizeReport()
    candidates = wm._candidates(model, wm.DEFAULT_IGNORE, report)
    groups = wm._share_groups(list(candidates), share)
    shared = wm._shared_scales(candidates, groups, "kernel", hadamard)
    for stage in _stages(list(candidates), groups):
        hessians = _stage_hessians(model, stage, batches)
        for name in stage:
            weight = candidates[name].weight.detach()
            h = (hessians[name].matrix() if name in hessians
                 else torch.eye(weight.shape[1], dtype=torch.float64))
            result = gptq_quantize(weight, h, global_scale=shared.get(name), options=options,
                                   hadamard=hadamard)
            assert result.weight is not None
            bias = candidates[name].bias
            layer = NVFP4Linear.from_quantized(
                result.weight, None if bias is None else bias.detach(), backend=backend,
                cache_dequantized=True,
            )
            wm._set_submodule(model, name, layer)
    return list(candidates)


def differing(a: nn.Module, b: nn.Module) -> list[str]:
    """State-dict entries of two models whose bytes differ (float8 compared as bytes)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    out = []
    for key in sa:
        x, y = sa[key], sb[key]
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        if x.dtype != y.dtype or not torch.equal(x, y):
            out.append(key)
    return out
