"""Activation-scale calibration: record each NVFP4Linear's input amax, set its
``input_global_scale`` (ENCODE form, 2688/amax); the calibration batches GPTQ runs
(:func:`calibration_batches`, :func:`run_batch`; :mod:`nvfp4lab.execution.gptq_model` runs them)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nvfp4lab.codec import compute_global_scale
from nvfp4lab.execution.layers import NVFP4Linear
from nvfp4lab.scales import abs_max
from nvfp4lab.vocab import OrderName, check_choice

__all__ = [
    "CalibrationResult",
    "calibrate_inputs",
    "calibration",
    "calibration_batches",
    "run_batch",
]


@dataclass
class CalibrationResult:
    """Running max |input| per NVFP4Linear (filled during :func:`calibration`).

    ``amax``: layer name -> amax (float, input units); ``global_scales``: name -> the ENCODE
    scale set on exit; ``not_seen``: layers that received no input (their scale is unchanged).
    """

    amax: dict[str, float] = field(default_factory=dict)
    global_scales: dict[str, float] = field(default_factory=dict)
    not_seen: list[str] = field(default_factory=list)


@contextmanager
def calibration(
    model: nn.Module, *, convention: str = OrderName.VLLM_KERNEL
) -> Iterator[CalibrationResult]:
    """Record each NVFP4Linear's running max |input| (of ``x Q`` for a rotated layer, what its
    GEMM quantizes); on a normal exit set its ``input_global_scale = 2688/amax``
    (:func:`compute_global_scale` semantics: float32 for "kernel", the input dtype for
    "compressed-tensors"; amax 0 -> 1.0).

    While inside, the layers run weight-only (activations are observed unquantized, as
    compressed-tensors calibrates with activation quantization disabled). On an exception the
    hooks are removed and no scale is changed.
    """
    check_choice("convention", convention, OrderName)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    running: dict[str, torch.Tensor] = {}
    result = CalibrationResult()

    def make_hook(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            if not isinstance(x, torch.Tensor) or x.numel() == 0:
                return
            if isinstance(module, NVFP4Linear):  # the GEMM's input: x Q for a rotated layer
                x = module.rotate_input(x.detach())
            amax = abs_max(x.detach())
            prev = running.get(name)
            running[name] = amax if prev is None else torch.maximum(prev, amax.to(prev.dtype))

        return hook

    handles = [m.register_forward_pre_hook(make_hook(n)) for n, m in layers.items()]
    for m in layers.values():
        m._calibrating = True
    ok = False
    try:
        yield result
        ok = True
    finally:
        for h in handles:
            h.remove()
        for m in layers.values():
            m._calibrating = False
    if ok:
        for name, layer in layers.items():
            amax = running.get(name)
            if amax is None:
                result.not_seen.append(name)
                continue
            gs = compute_global_scale(amax.reshape(1), convention=convention)
            layer.set_input_global_scale(gs)
            result.amax[name] = float(amax)
            result.global_scales[name] = float(gs)


def calibrate_inputs(
    model: nn.Module, batches: Iterable[Any], *, convention: str = OrderName.VLLM_KERNEL
) -> CalibrationResult:
    """Run ``batches`` through ``model`` inside :func:`calibration` (no grad) and return the
    result. A batch is passed as ``model(**b)`` for a mapping, ``model(*b)`` for a tuple/list,
    else ``model(b)``."""
    with torch.no_grad(), calibration(model, convention=convention) as result:
        for batch in batches:
            if isinstance(batch, Mapping):
                model(**batch)
            elif isinstance(batch, tuple | list):
                model(*batch)
            else:
                model(batch)
    return result


def _check_batch(batch: object, index: int) -> None:
    parts = list(batch.values()) if isinstance(batch, Mapping) else (
        list(batch) if isinstance(batch, tuple | list) else [batch]
    )
    if not parts or not any(isinstance(p, torch.Tensor) for p in parts):
        raise TypeError(
            f"calibration batch {index} is a {type(batch).__name__} holding no tensor; pass model "
            "inputs: tokenizer outputs (dicts of tensors), tensors, or tuples of tensors "
            "(tokenize sentences first)"
        )


def calibration_batches(calibration: Iterable[Any] | None) -> list[Any]:
    """The calibration batches as a list (they are run once per stage), checked: a mapping of
    tensors (``model(**b)``), a tuple/list (``model(*b)``) or a tensor (``model(b)``)."""
    if calibration is None:
        raise ValueError(
            "method='gptq' needs calibration=<iterable of model inputs> (e.g. a list of "
            "tokenizer outputs); method='rtn' needs none"
        )
    if isinstance(calibration, str | bytes | torch.Tensor | Mapping):
        raise TypeError(
            f"calibration must be an iterable of batches (e.g. a list of tokenizer outputs), got "
            f"a single {type(calibration).__name__}; wrap it in a list"
        )
    try:
        batches = list(calibration)
    except TypeError:
        raise TypeError(
            f"calibration must be an iterable of model inputs, got {type(calibration).__name__}"
        ) from None
    if not batches:
        raise ValueError("calibration is empty: pass at least one batch of model inputs")
    for i, batch in enumerate(batches):
        _check_batch(batch, i)
    return batches


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def run_batch(model: nn.Module, batch: Any) -> Any:
    """``model(**b)`` for a mapping, ``model(*b)`` for a tuple/list, else ``model(b)``; tensors
    are moved to the device of the model's first parameter or buffer."""
    first = next(iter((*model.parameters(), *model.buffers())), None)
    device = first.device if first is not None else torch.device("cpu")
    if isinstance(batch, Mapping):
        return model(**{k: _to(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple | list):
        return model(*(_to(v, device) for v in batch))
    return model(_to(batch, device))
