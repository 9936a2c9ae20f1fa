"""llama.cpp side by side: its CPU tokens/s on an NVFP4 GGUF against nvfp4lab's emulation of it.

``nvfp4lab bench --llama-cpp`` writes SmolLM2-135M-Instruct as nvfp4lab quantizes it (RTN,
every decoder Linear, a tensor scale per layer, weight-only) to an NVFP4 GGUF file
(``checkpoint.save_pretrained(..., format="gguf")``), reads that file back with
``checkpoint.load(..., backend="q8_0")`` (every quantized Linear runs llama.cpp's CPU arithmetic
bit for bit, :mod:`nvfp4lab.execution.ggml_cpu`) and times two phases, each in this process,
interleaved round-robin (:func:`nvfp4lab.bench.timing.time_interleaved`), both sides fed the
same token ids (nvfp4lab's tokenization of the evaluation text, :mod:`nvfp4lab.corpus`):

* prefill (:func:`run_prefill`): one pass over a ``P``-token prompt (default 128).
  ``llama.cpp``: llama-cpp-python's ``Llama`` (``n_batch`` >= P, so one batch) ``reset`` then
  ``eval(ids)``; ``nvfp4lab[q8_0]``: one forward of the loaded model on the ids (no_grad,
  ``use_cache=True``, last position's logits only, as ``generate``'s first step runs it).
  tokens/s = P / median time of one pass;
* generation (:func:`run_generation`): greedy generation of ``new_tokens`` from a short prompt.
  ``llama.cpp``: ``Llama.generate`` with ``top_k=1`` from a reset context; ``nvfp4lab[q8_0]``:
  transformers' ``generate`` (greedy, KV cache). tokens/s = ``new_tokens`` / median time of a
  whole generation (its short prompt's pass included): the decode speed.

Both sides get the same cores: ``n_threads`` and ``n_threads_batch`` = torch's threads. The
ratio (llama.cpp's tokens/s over nvfp4lab's) is what the emulation costs: its Linears run the
C++ NVFP4 x Q8_0 dot of :mod:`nvfp4lab.kernels.ggml_dot` (ggml's float order, AVX-512 / AVX2
at run time), the rest of the model is transformers' eager torch code called from Python, where
llama.cpp runs its whole graph in C. When llama-cpp-python cannot be imported, the emulation is
timed alone and a one-line note says why.
"""

from __future__ import annotations

import contextlib
import importlib.util
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvfp4lab.bench import timing
from nvfp4lab.bench.store import Measurement, measured_row
from nvfp4lab.vocab import Backend, CheckpointFormat, CorpusPart, Engine, dtype_name

__all__ = [
    "LLAMA_CPP_IMPL",
    "NVFP4LAB_IMPL",
    "PREFILL_TOKENS",
    "GenerationResult",
    "PrefillResult",
    "generation_rows",
    "llama_cpp_missing",
    "prefill_rows",
    "run_generation",
    "run_prefill",
    "smollm2_gguf",
]

#: The implementations' names in the results.
LLAMA_CPP_IMPL = Engine.LLAMA_CPP.value
NVFP4LAB_IMPL = f"nvfp4lab[{Backend.Q8_0.value}]"
#: The prefill prompt's length by default, tokens.
PREFILL_TOKENS = 128
#: The model's name in the rows' ``shape``.
_MODEL = "smollm2-135m"


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


@dataclass(frozen=True)
class PrefillResult:
    """One implementation's pass over a ``prompt_tokens``-token prompt: the ``timing`` of whole
    passes (seconds each)."""

    impl: str
    prompt_tokens: int
    timing: timing.Timing

    @property
    def tokens_per_s(self) -> float:
        """Prompt tokens per second."""
        return self.prompt_tokens / self.timing.median_s


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


def _prompt_ids(model: Any, path: Path, prompt: Sequence[int] | None, count: int) -> list[int]:
    """``prompt`` as a list, or (None) the first ``count`` tokens of the evaluation text in
    SmolLM2's tokenizer; ValueError when an id is outside ``model``'s vocabulary."""
    from nvfp4lab import corpus, models

    if prompt is None:
        text = corpus.pydoc_text(CorpusPart.EVALUATION)
        prompt = corpus.token_ids(models.smollm2_tokenizer(), text)[:count].tolist()
    ids = [int(t) for t in prompt]
    vocabulary = model.get_input_embeddings().num_embeddings
    if not ids or min(ids) < 0 or max(ids) >= vocabulary:
        raise ValueError(
            f"{path.name}: its vocabulary has {vocabulary} tokens and the prompt's token ids "
            f"run from {min(ids, default=0)} to {max(ids, default=0)} (the default "
            "prompt is SmolLM2's); pass a SmolLM2-135M GGUF, or prompt ids of its vocabulary"
        )
    return ids


def _llama(path: Path, tokens: int) -> Any:
    """llama-cpp-python's ``Llama`` on ``path`` with torch's threads for decode and batches, a
    context and a batch that hold ``tokens`` tokens at once."""
    import llama_cpp
    import torch

    threads = torch.get_num_threads()
    batch = max(512, tokens)
    return llama_cpp.Llama(
        model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=batch,
        n_batch=batch, n_ubatch=batch, verbose=False,
    )


@contextlib.contextmanager
def _loaded(gguf: str | Path | None, prompt: Sequence[int] | None,
            prompt_tokens: int) -> Iterator[tuple[Path, Any, list[int]]]:
    """``(path, model, ids)``: the GGUF (None: :func:`smollm2_gguf` in a temporary folder,
    deleted on exit), read back with the ``q8_0`` backend, and the prompt's token ids
    (:func:`_prompt_ids`)."""
    from nvfp4lab import checkpoint

    with tempfile.TemporaryDirectory(prefix="nvfp4lab-gguf-") as tmp:
        path = Path(gguf) if gguf is not None else smollm2_gguf(Path(tmp) / "smollm2-nvfp4")
        model = checkpoint.load(path, backend=Backend.Q8_0)
        yield path, model, _prompt_ids(model, path, prompt, prompt_tokens)


def run_prefill(
    gguf: str | Path | None = None,
    *,
    prompt: Sequence[int] | None = None,
    prompt_tokens: int = PREFILL_TOKENS,
    warmup: int = 1,
    repeats: int = 3,
) -> tuple[list[PrefillResult], list[str]]:
    """Time one pass over a prompt on ``gguf`` (None: :func:`smollm2_gguf` in a temporary
    folder) by llama.cpp and by nvfp4lab's ``q8_0`` emulation (module docstring). ``prompt``:
    token ids, fed to both sides; None = the first ``prompt_tokens`` tokens of the evaluation
    text in SmolLM2's tokenizer. Returns (results, notes)."""
    import torch

    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
    notes: list[str] = []
    with _loaded(gguf, prompt, prompt_tokens) as (path, model, ids):
        if len(ids) < prompt_tokens and prompt is None:
            notes.append(f"the evaluation text has {len(ids)} tokens, fewer than {prompt_tokens}")
        x = torch.tensor([ids])
        mask = torch.ones(1, len(ids), dtype=torch.long)

        def ours() -> None:
            with torch.no_grad():
                model(input_ids=x, attention_mask=mask, use_cache=True, logits_to_keep=1)

        impls: dict[str, Any] = {NVFP4LAB_IMPL: ours}
        missing = llama_cpp_missing()
        if missing is None:
            llm = _llama(path, len(ids))

            def theirs() -> None:
                llm.reset()
                llm.eval(ids)

            impls = {LLAMA_CPP_IMPL: theirs, **impls}
        else:
            notes.append(missing)
        timings = timing.time_interleaved(impls, warmup=warmup, repeats=repeats, device="cpu")
    return [PrefillResult(name, len(ids), t) for name, t in timings.items()], notes


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

    for what, value in (("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens)):
        if value < 1:
            raise ValueError(f"{what} must be >= 1, got {value}")
    notes: list[str] = []
    with _loaded(gguf, prompt, prompt_tokens) as (path, model, ids):
        prompt = ids
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
            llm = _llama(path, len(prompt) + new_tokens)

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


def _row(
    op: str, shape: str, m: int, n: int, impl: str, t: timing.Timing, env: dict[str, Any],
    seed: int,
) -> dict[str, Any]:
    """One float32 results row of SmolLM2 (no K, no convention)."""
    import torch

    return measured_row(
        Measurement(
            op=op, shape=shape, M=m, N=n, K=0, dtype=dtype_name(torch.float32), backend=impl,
            convention="", timing=t,
        ),
        env=env,
        seed=seed,
    )


def prefill_rows(
    results: list[PrefillResult], env: dict[str, Any], seed: int
) -> list[dict[str, Any]]:
    """Results rows (``op="prefill"``, ``shape="smollm2-135m+<P>"``, ``backend`` = the
    implementation, ``M`` = prompt tokens, ``N`` = 0) for the store."""
    return [
        _row("prefill", f"{_MODEL}+{r.prompt_tokens}", r.prompt_tokens, 0, r.impl, r.timing, env,
             seed)
        for r in results
    ]


def generation_rows(
    results: list[GenerationResult], env: dict[str, Any], seed: int
) -> list[dict[str, Any]]:
    """Results rows (``op="generate"``, ``backend`` = the implementation, ``M`` = prompt
    tokens, ``N`` = new tokens) for the store."""
    return [
        _row("generate", f"{_MODEL}+{r.prompt_tokens}+{r.new_tokens}", r.prompt_tokens,
             r.new_tokens, r.impl, r.timing, env, seed)
        for r in results
    ]
