"""llama.cpp side by side: its CPU tokens/s on an NVFP4 GGUF against nvfp4lab's emulation of it.

``nvfp4lab bench --llama-cpp`` writes SmolLM2-135M-Instruct as nvfp4lab quantizes it (RTN,
every decoder Linear, a tensor scale per layer, weight-only) to an NVFP4 GGUF file
(``checkpoint.save_pretrained(..., format="gguf")``), reads that file back with
``checkpoint.load(..., backend="q8_0")`` (every quantized Linear runs llama.cpp's CPU arithmetic
bit for bit, :mod:`nvfp4lab.execution.ggml_cpu`), and times greedy generation of the same new
tokens from the same prompt, in this process, interleaved round-robin
(:func:`nvfp4lab.bench.timing.time_interleaved`):

* ``llama.cpp``: llama-cpp-python's ``Llama`` on the file (``n_threads`` = torch's threads, so
  both sides get the same cores), ``generate`` with ``top_k=1`` from a reset context;
* ``nvfp4lab[q8_0]``: transformers' ``generate`` (greedy, KV cache) on the loaded model.

Each sample is one whole generation: the prompt's forward pass and ``new_tokens`` decode steps;
tokens/s = ``new_tokens`` / its median. The ratio says how much slower the emulation is: it
reproduces ggml's float order with exact float64 FMAs in Python-driven torch ops (a correctness
tool), where ggml runs AVX2 code. When llama-cpp-python cannot be imported, the emulation is
timed alone and a one-line note says why.
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvfp4lab.bench import timing
from nvfp4lab.bench.store import Measurement, measured_row
from nvfp4lab.vocab import Backend, CheckpointFormat, CorpusPart, Engine, dtype_name

__all__ = [
    "LLAMA_CPP_IMPL",
    "NVFP4LAB_IMPL",
    "GenerationResult",
    "generation_rows",
    "llama_cpp_missing",
    "run_generation",
    "smollm2_gguf",
]

#: The implementations' names in the results.
LLAMA_CPP_IMPL = Engine.LLAMA_CPP.value
NVFP4LAB_IMPL = f"nvfp4lab[{Backend.Q8_0.value}]"


@dataclass(frozen=True)
class GenerationResult:
    """One implementation's greedy generation: ``new_tokens`` after ``prompt_tokens``, the
    ``timing`` of whole generations (seconds each), and the ``tokens`` it produced."""

    impl: str
    prompt_tokens: int
    new_tokens: int
    timing: timing.Timing
    tokens: tuple[int, ...]

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second (prompt included in the time)."""
        return self.new_tokens / self.timing.median_s


def llama_cpp_missing() -> str | None:
    """None when llama-cpp-python imports, else one line saying why not."""
    if importlib.util.find_spec("llama_cpp") is None:
        return (
            "llama-cpp-python is not importable: llama.cpp was not timed (install it, e.g. "
            "`make test-peers` puts 0.3.36 in ~/.cache/nvfp4lab/peers, and add it to PYTHONPATH)"
        )
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # a broken install: say so, time the emulation alone
        return f"llama-cpp-python does not import ({type(exc).__name__}: {exc}): not timed"
    return None


def smollm2_gguf(folder: str | Path) -> Path:
    """SmolLM2-135M-Instruct quantized by nvfp4lab (RTN, every decoder Linear, weight-only) and
    written to ``folder`` as an NVFP4 GGUF with the source's metadata and tokenizer; returns the
    ``.gguf`` file. Needs the ``[llm]`` extra."""
    from nvfp4lab import checkpoint, models
    from nvfp4lab.execution.whole_model import quantize_model

    model, _ = models.smollm2()
    quantize_model(model, backend=Backend.Q8_0)
    out = checkpoint.save_pretrained(model, folder, format=CheckpointFormat.GGUF, overwrite=True)
    return next(Path(out).glob("*.gguf"))


def run_generation(
    gguf: str | Path | None = None,
    *,
    prompt: Sequence[int] | None = None,
    prompt_tokens: int = 16,
    new_tokens: int = 8,
    warmup: int = 1,
    repeats: int = 3,
) -> tuple[list[GenerationResult], list[str]]:
    """Time greedy generation on ``gguf`` (None: :func:`smollm2_gguf` in a temporary folder) by
    llama.cpp and by nvfp4lab's ``q8_0`` emulation (module docstring). ``prompt``: token ids;
    None = the first ``prompt_tokens`` tokens of the evaluation text (:mod:`nvfp4lab.corpus`)
    in SmolLM2's tokenizer. Returns (results, notes)."""
    import torch

    from nvfp4lab import checkpoint, corpus, models

    for what, value in (("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens)):
        if value < 1:
            raise ValueError(f"{what} must be >= 1, got {value}")
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="nvfp4lab-gguf-") as tmp:
        path = Path(gguf) if gguf is not None else smollm2_gguf(Path(tmp) / "smollm2-nvfp4")
        model = checkpoint.load(path, backend=Backend.Q8_0)
        if prompt is None:
            text = corpus.pydoc_text(CorpusPart.EVALUATION)
            prompt = corpus.token_ids(models.smollm2_tokenizer(), text)[:prompt_tokens].tolist()
        prompt = list(prompt)
        vocabulary = model.get_input_embeddings().num_embeddings
        if not prompt or min(prompt) < 0 or max(prompt) >= vocabulary:
            raise ValueError(
                f"{path.name}: its vocabulary has {vocabulary} tokens and the prompt's token ids "
                f"run from {min(prompt, default=0)} to {max(prompt, default=0)} (the default "
                "prompt is SmolLM2's); pass a SmolLM2-135M GGUF, or prompt ids of its vocabulary"
            )
        made: dict[str, tuple[int, ...]] = {}

        def ours() -> None:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt)),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                )
            made[NVFP4LAB_IMPL] = tuple(out[0, len(prompt) :].tolist())

        impls: dict[str, Any] = {NVFP4LAB_IMPL: ours}
        missing = llama_cpp_missing()
        if missing is None:
            import llama_cpp

            llm = llama_cpp.Llama(
                model_path=str(path), n_threads=torch.get_num_threads(), verbose=False
            )

            def theirs() -> None:
                llm.reset()
                got: list[int] = []
                for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                    got.append(int(token))
                    if len(got) == new_tokens:
                        break
                made[LLAMA_CPP_IMPL] = tuple(got)

            impls = {LLAMA_CPP_IMPL: theirs, **impls}
        else:
            notes.append(missing)
        timings = timing.time_interleaved(impls, warmup=warmup, repeats=repeats, device="cpu")
    results = [
        GenerationResult(name, len(prompt), new_tokens, t, made[name])
        for name, t in timings.items()
    ]
    if len(results) == 2 and results[0].tokens != results[1].tokens:
        notes.append(
            "the two generated different greedy tokens (near-tied logits: llama.cpp's "
            "other ops differ in float order, docs/llama_cpp.md)"
        )
    return results, notes


def generation_rows(
    results: list[GenerationResult], env: dict[str, Any], seed: int
) -> list[dict[str, Any]]:
    """Results rows (``op="generate"``, ``backend`` = the implementation, ``M`` = prompt
    tokens, ``N`` = new tokens) for the store."""
    import torch

    return [
        measured_row(
            Measurement(
                op="generate",
                shape=f"smollm2-135m+{r.prompt_tokens}+{r.new_tokens}",
                M=r.prompt_tokens,
                N=r.new_tokens,
                K=0,
                dtype=dtype_name(torch.float32),
                backend=r.impl,
                convention="",
                timing=r.timing,
            ),
            env=env,
            seed=seed,
        )
        for r in results
    ]
