"""A whole model: SmolLM2's forward pass over a window of text, float against NVFP4.

``nvfp4lab bench --model`` loads SmolLM2-135M-Instruct (:func:`nvfp4lab.models.smollm2`, offline),
takes the first ``tokens`` tokens of the evaluation text (:mod:`nvfp4lab.corpus`; 512 by default)
and times one forward pass (``model(input_ids=[1, tokens]).logits``, no KV cache) of three copies
of the model, in this process, interleaved round-robin
(:func:`nvfp4lab.bench.timing.time_interleaved`, so a busy machine slows all three alike):

* ``torch``: the float model as loaded (float32, or ``dtype``);
* ``w4a16``: every decoder Linear an :class:`~nvfp4lab.execution.layers.NVFP4Linear` (RTN,
  ``quantize_model(backend="w4a16")``, ``lm_head`` kept float), its weight decoded at every call
  (no cached dequantized weight: on the CPU the C++ LUT decode, :mod:`nvfp4lab.kernels`);
* ``emulation``: the same with W4A4 numerics (activations fake-quantized per call, dynamic
  scales), ``quantize_model(backend="emulation")``.

The settings are the process's (``NVFP4LAB_FUSED``: each row's ``path`` says which: ``default``
for ``auto``, ``fused`` for ``on``, ``eager`` for ``off``). Reported: the median time of a
forward pass, tokens/s (``tokens`` / median) and the time relative to the float forward; rows
(``op="forward"``, ``shape="smollm2-135m+<tokens>"``, ``M`` = tokens, ``flops`` = 2 · tokens ·
the Linear weights' elements) go to the results store beside llama.cpp's generation rows
(``op="generate"``, same model, ``nvfp4lab bench --llama-cpp``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nvfp4lab.bench.store import Measurement, measured_row
from nvfp4lab.bench.timing import Timing, time_interleaved
from nvfp4lab.settings import fused_mode
from nvfp4lab.vocab import Backend, CorpusPart, FusedMode, OrderName

__all__ = [
    "FLOAT_IMPL",
    "MODEL_IMPLS",
    "MODEL_NAME",
    "ForwardResult",
    "forward_rows",
    "run_forward",
    "settings_path",
]

#: The float model's name in the results (as the 16-bit ``matmul`` baseline rows name theirs).
FLOAT_IMPL = "torch"
#: What is timed, in the order printed.
MODEL_IMPLS: tuple[str, ...] = (FLOAT_IMPL, Backend.W4A16, Backend.EMULATION)
#: The model's name in the ``shape`` column (llama.cpp's generation rows use the same).
MODEL_NAME = "smollm2-135m"

_PATH_OF_MODE = {FusedMode.AUTO: "default", FusedMode.ON: "fused", FusedMode.OFF: "eager"}


@dataclass(frozen=True)
class ForwardResult:
    """One model copy's forward pass over ``tokens`` tokens: its ``timing`` (seconds per pass)."""

    impl: str  #: an entry of :data:`MODEL_IMPLS`
    tokens: int
    dtype: str
    path: str  #: the pipeline its NVFP4 layers ran ("" for the float model)
    flops: float  #: 2 · tokens · elements of the Linear weights
    timing: Timing

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of one forward pass."""
        return self.tokens / self.timing.median_s


def settings_path() -> str:
    """The ``path`` of the rows under the current ``NVFP4LAB_FUSED`` (auto: ``default``)."""
    return _PATH_OF_MODE[fused_mode()]


def _linear_elements(model: Any) -> int:
    """Elements of the float model's ``nn.Linear`` weights."""
    from torch import nn

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def run_forward(
    *,
    tokens: int = 512,
    dtype: str = "float32",
    device: str = "cpu",
    warmup: int = 1,
    repeats: int = 3,
    model: Any = None,
    tokenizer: Any = None,
) -> list[ForwardResult]:
    """Time SmolLM2's forward pass over ``tokens`` tokens, float and NVFP4 (module docstring).

    ``model``, ``tokenizer``: an already loaded SmolLM2 ``(model, tokenizer)`` (default:
    :func:`nvfp4lab.models.smollm2`); it is copied, never changed. Raises ValueError for fewer than
    one token or more than the evaluation text holds, ImportError without the ``[llm]`` extra.
    """
    import torch

    from nvfp4lab import corpus, models
    from nvfp4lab.bench.runner import bench_dtype
    from nvfp4lab.execution.whole_model import quantize_model

    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    dt = bench_dtype(dtype)
    if model is None or tokenizer is None:
        model, tokenizer = models.smollm2()
    ids = corpus.token_ids(tokenizer, corpus.pydoc_text(CorpusPart.EVALUATION))
    if ids.numel() < tokens:
        raise ValueError(
            f"the evaluation text has {ids.numel()} tokens, fewer than tokens={tokens}; "
            "pass a smaller number"
        )
    batch = ids[:tokens].unsqueeze(0).to(device)
    base = copy.deepcopy(model).to(device=device, dtype=dt).eval()
    copies: dict[str, Any] = {FLOAT_IMPL: base}
    for backend in MODEL_IMPLS[1:]:
        quantized = copy.deepcopy(base)
        quantize_model(quantized, backend=backend, convention=OrderName.VLLM_KERNEL)
        copies[backend] = quantized

    def forward(m: Any) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                m(input_ids=batch)

        return run

    flops = 2.0 * tokens * _linear_elements(base)
    timings = time_interleaved(
        {name: forward(m) for name, m in copies.items()},
        warmup=warmup,
        repeats=repeats,
        device=device,
    )
    path = settings_path()
    return [
        ForwardResult(name, tokens, dtype, "" if name == FLOAT_IMPL else path, flops, t)
        for name, t in timings.items()
    ]


def forward_rows(
    results: list[ForwardResult], env: dict[str, Any], seed: int
) -> list[dict[str, Any]]:
    """Results rows (``op="forward"``, ``backend`` = the implementation, ``M`` = tokens)."""
    return [
        measured_row(
            Measurement(
                op="forward",
                shape=f"{MODEL_NAME}+{r.tokens}",
                M=r.tokens,
                N=0,
                K=0,
                dtype=r.dtype,
                backend=r.impl,
                convention="" if r.impl == FLOAT_IMPL else str(OrderName.VLLM_KERNEL),
                timing=r.timing,
                flops=r.flops,
                path=r.path,
            ),
            env=env,
            seed=seed,
        )
        for r in results
    ]
