"""The LLM study on a user's own model and text: :func:`study` (and ``nvfp4lab study``).

One call answers "what does NVFP4 do to **my** model, on **my** text": the model is found offline
(:func:`nvfp4lab.local_models.resolve_model`: SmolLM2 by default, a local folder, a Hugging Face
cache entry or a ``.gguf`` file), the text is split into calibration and evaluation parts by the
corpus rules (:mod:`nvfp4lab.texts`; CPython's pydoc topics by default), each configuration of
:mod:`nvfp4lab.studies.llm_configs` is built once and scored against the reference, and the
verdict of :mod:`nvfp4lab.studies.llm_verdict` names the best configuration of each family.

**Two texts in one pass.** Every configuration is scored on the evaluation part and, for the
domain effect, on a second text of another genre (:func:`nvfp4lab.texts.domain_text`: a play
for the pydoc calibration text, the pydoc evaluation part for a user's text). Both are cut into
whole windows of ``context`` tokens (the evaluation part first, at most ``tokens`` tokens each,
a tail shorter than a window dropped) and run as one sequence of windows: one reference run,
one build and one scoring pass per configuration; the per-token values are then split back by
window into one :class:`~nvfp4lab.studies.llm_statistics.TokenFidelity` per text. A window is
scored exactly as on its own (windows never see each other), so the evaluation numbers are those
of a study of the evaluation part alone with the same batches.

**Larger than memory.** ``streamed=True`` (or ``None`` with a model folder whose weights take more
than a quarter of the machine's memory) evaluates the reference and every configuration block by
block from the safetensors (:mod:`nvfp4lab.studies.llm_streamed`), with the same numbers as the
in-memory path in the same dtype. ``dask=ADDRESS`` builds and scores the configurations on a Dask
cluster (every worker reads the model from the same path), with the results of the in-process run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nvfp4lab import corpus, settings
from nvfp4lab.local_models import (
    DecoderInfo,
    ModelKind,
    ModelSource,
    check_decoder,
    check_tokenizer,
    load_decoder,
    load_tokenizer,
    resolve_model,
)
from nvfp4lab.studies import llm
from nvfp4lab.studies.llm_config_names import config_names, select_configs
from nvfp4lab.studies.llm_configs import (
    ConfigResult,
    LLMConfig,
    configurations,
)
from nvfp4lab.studies.llm_search import SEARCH_FORMATS, check_search_formats, study_search
from nvfp4lab.studies.llm_statistics import TokenFidelity, fidelity_of
from nvfp4lab.studies.llm_verdict import (
    FamilyVerdict,
    best_per_family,
    comparison_rows,
    family_table,
    verdict_text,
)
from nvfp4lab.studies.reference_cache import cached_reference_run
from nvfp4lab.vocab import CorpusPart

__all__ = [
    "RESULTS_CSV",
    "RESULTS_JSON",
    "SMOKE_SETTINGS",
    "StudyPlan",
    "StudyResult",
    "config_names",
    "plan_study",
    "run_study",
    "select_configs",
    "study",
]

#: What ``smoke`` changes: evaluation tokens per text, calibration windows, tokens per window.
SMOKE_SETTINGS: dict[str, int] = {"tokens": 128, "samples": 4, "context": 64}
#: The study's defaults (notebook 07's): tokens per text, calibration windows and their length.
DEFAULTS: dict[str, int] = {"tokens": 2048, "samples": 32, "context": 256, "length": 256}
#: The files :meth:`StudyResult.save` writes.
RESULTS_CSV, RESULTS_JSON = "study.csv", "study.json"
#: The two texts' names in the table's ``text`` column.
EVALUATION = str(CorpusPart.EVALUATION)
#: Stream a model folder (``streamed=None``) when its weights, in the study's dtype, take more
#: than this share of the machine's memory.
STREAM_SHARE = 0.25


# ---------------------------------------------------------------------------------------------
# The plan: model, text and windows, checked before anything heavy runs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class StudyPlan:
    """What :func:`run_study` runs, every input checked (:func:`plan_study` makes it).

    ``ids``: the token ids of both texts, int64 ``[windows * context]`` (evaluation windows
    first); ``eval_windows`` / ``domain_windows``: their window counts; ``batches``: the
    calibration model inputs (GPTQ, calibrated input scales); ``dtype``: the dtype every model
    runs in; ``streamed``: block by block from the safetensors."""

    source: ModelSource
    info: DecoderInfo
    split: corpus.TextSplit
    domain_name: str
    configs: tuple[LLMConfig, ...]
    ids: torch.Tensor = field(repr=False)
    context: int
    eval_windows: int
    domain_windows: int
    batches: tuple[Any, ...] = field(repr=False)
    samples: int
    dtype: torch.dtype
    streamed: bool
    trust_remote_code: bool = False
    search_bits: float | None = None  #: the mixed-precision search's budget (llm_search)
    search_formats: tuple[str, ...] = tuple(SEARCH_FORMATS)  #: the formats it chooses among

    def describe(self) -> dict[str, Any]:
        """The plan as JSON-ready facts (the page's header)."""
        return {
            "model": self.source.name, "model_path": str(self.source.path),
            "model_kind": str(self.source.kind), "model_type": self.info.model_type,
            "parameters": self.info.parameters, "dtype": str(self.dtype).removeprefix("torch."),
            "streamed": self.streamed, "text": self.split.source, "split_rule": self.split.rule,
            "domain_text": self.domain_name, "context": self.context,
            "evaluation_windows": self.eval_windows, "domain_windows": self.domain_windows,
            "calibration_samples": self.samples,
            "configurations": [c.label for c in self.configs], "search_bits": self.search_bits,
            "search_formats": list(self.search_formats) if self.search_bits is not None else [],
        }


def _whole_windows(ids: torch.Tensor, tokens: int, context: int, what: str) -> torch.Tensor:
    """The first ``tokens`` ids cut to whole windows of ``context``; ValueError when less than
    one window is left."""
    ids = ids[:tokens]
    kept = (ids.numel() // context) * context
    if kept == 0:
        raise ValueError(f"the {what} holds {ids.numel()} tokens, fewer than one window of "
                         f"--context {context}; give more text or a smaller --context")
    return ids[:kept]


def _model_bytes(info: DecoderInfo, dtype: torch.dtype) -> float:
    return float(info.parameters) * torch.empty((), dtype=dtype).element_size()


def _memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return math.inf


def plan_study(
    model: str | os.PathLike[str] | None = None,
    *,
    text: str | os.PathLike[str] | None = None,
    calibration: str | os.PathLike[str] | None = None,
    configs: Sequence[str] | Sequence[LLMConfig] | None = None,
    tokens: int | None = None,
    context: int | None = None,
    samples: int | None = None,
    smoke: bool = False,
    dtype: str | torch.dtype | None = None,
    streamed: bool | None = None,
    trust_remote_code: bool = False,
    seed: int = 0,
    search: float | None = None,
    search_formats: Sequence[str] | None = None,
) -> StudyPlan:
    """Resolve and check everything :func:`study` needs, reading no weights: the model
    (:func:`~nvfp4lab.local_models.resolve_model`, :func:`~nvfp4lab.local_models.check_decoder`),
    its tokenizer, the text and its split, the windows of both texts, the calibration batches.
    Every bad input is a ValueError (or FileNotFoundError) in one line naming it and the fix."""
    from nvfp4lab import texts

    defaults = {**DEFAULTS, **(SMOKE_SETTINGS if smoke else {})}
    tokens = defaults["tokens"] if tokens is None else llm._whole("tokens", tokens, 2,
                                                                  "evaluation tokens per text")
    context = defaults["context"] if context is None else llm._whole(
        "context", context, 2, "tokens per window, one to predict from")
    samples = defaults["samples"] if samples is None else llm._whole(
        "samples", samples, 1, "calibration windows")
    chosen = (list(configs) if configs and isinstance(configs[0], LLMConfig)
              else select_configs(configs, smoke=smoke))  # type: ignore[arg-type]
    source = resolve_model(model)
    info = check_decoder(source, trust_remote_code=trust_remote_code)
    if calibration is not None and text is None:
        raise ValueError("--calibration needs --text (the evaluation text it goes with)")
    if text is None:
        split = corpus.pydoc_split()
    elif calibration is None:
        split = texts.split_text(texts.read_documents(text))
    else:
        split = texts.split_files(calibration, text)
    domain_name, domain = texts.domain_text(split)
    tokenizer = load_tokenizer(source, trust_remote_code=trust_remote_code)
    check_tokenizer(tokenizer, info.vocab)
    evaluation = _whole_windows(corpus.token_ids(tokenizer, split.evaluation), tokens, context,
                                "evaluation text")
    second = _whole_windows(corpus.token_ids(tokenizer, domain), tokens, context,
                            f"second text ({domain_name})")
    if search is not None and (isinstance(search, bool) or not isinstance(search, int | float)
                               or not 0 < search < 64):
        raise ValueError(f"--search bits={search!r}: give the effective bits per weight, e.g. 5.0")
    formats = check_search_formats(search, search_formats)
    needs = any(c.needs_calibration for c in chosen) or search is not None
    batches = tuple(corpus.calibration_batches(
        tokenizer, text=split.calibration, samples=samples, length=DEFAULTS["length"],
        seed=seed)) if needs else ()
    torch_dtype = _study_dtype(dtype, source, info)
    if streamed is None:
        streamed = (source.kind != ModelKind.GGUF
                    and _model_bytes(info, torch_dtype) > STREAM_SHARE * _memory_bytes())
    if streamed and search is not None:
        raise ValueError("--search runs on the model in memory: pass --in-memory")
    if streamed and source.kind == ModelKind.GGUF:
        raise ValueError(f"{source.path}: a GGUF file cannot be streamed block by block; "
                         "convert it to a safetensors folder or leave out --streamed")
    chosen = _streamable(chosen, bool(streamed), asked=bool(configs))
    return StudyPlan(
        source=source, info=info, split=split, domain_name=domain_name,
        configs=tuple(chosen), ids=torch.cat([evaluation, second]), context=context,
        eval_windows=evaluation.numel() // context, domain_windows=second.numel() // context,
        batches=batches, samples=samples if needs else 0, dtype=torch_dtype,
        streamed=bool(streamed), trust_remote_code=trust_remote_code,
        search_bits=None if search is None else float(search), search_formats=formats,
    )


def _streamable(configs: list[LLMConfig], streamed: bool, *, asked: bool) -> list[LLMConfig]:
    """``configs`` that a block-by-block study can build: calibrated KV-cache scales (computed
    from the whole model's K / V over the calibration text) and the W4A4 recipes (``w4a4=``:
    scales searched and folded across blocks) need the whole model, and the comparator weight
    formats (``weight_format=``, MXFP4 / INT4-g128) are built by the in-memory path only, so a
    streamed study leaves them out of the default list and refuses them when asked for by
    name."""
    if not streamed:
        return configs
    whole = [c for c in configs if getattr(c, "kv_scales", None) is not None
             or getattr(c, "w4a4", None) is not None
             or getattr(c, "weight_format", None) is not None]
    if whole and asked:
        names = ", ".join(c.label for c in whole)
        raise ValueError(f"{names}: these are built with the whole model in memory only "
                         "(calibrated KV scales, W4A4 recipes, MXFP4 / INT4-g128 weights); "
                         "leave them out or pass --in-memory")
    return [c for c in configs if c not in whole]


def _study_dtype(dtype: str | torch.dtype | None, source: ModelSource,
                 info: DecoderInfo) -> torch.dtype:
    """The dtype the study runs in: ``dtype`` as given ("float32", "bfloat16", "float16"),
    else float32 (the study's arithmetic so far; SmolLM2 and GGUF files are float32 anyway)."""
    from nvfp4lab.local_models import DTYPES

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")


# ---------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------


def _say(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


def _reference(plan: StudyPlan, progress: bool) -> tuple[llm.ReferenceRun, Any]:
    """The reference run over both texts' windows, and the in-memory model (None streamed)."""
    batch = llm.DEFAULT_BATCH_SIZE
    if plan.streamed:
        from nvfp4lab.studies.llm_streamed import streamed_reference

        run = streamed_reference(plan.source.path, plan.ids, context=plan.context,
                                 batch_size=batch, dtype=plan.dtype, progress=progress)
        return run, None
    model, _ = load_decoder(plan.source, dtype=plan.dtype,
                            trust_remote_code=plan.trust_remote_code)
    run = cached_reference_run(model, plan.ids, context=plan.context, batch_size=batch,
                               progress=progress)
    return run, model


def _score(plan: StudyPlan, run: llm.ReferenceRun, reference: Any, config: LLMConfig,
           progress: bool, shared: dict[str, Any] | None = None) -> ConfigResult:
    """One configuration built and scored over every window (in memory or streamed; in memory,
    ``shared`` is ``llm_configs.build``'s dict of passes made once for several)."""
    if plan.streamed:
        from nvfp4lab.studies.llm_streamed import streamed_config_result

        return streamed_config_result(plan.source.path, run, config, plan.batches,
                                      dtype=plan.dtype, progress=progress)
    from nvfp4lab.studies.llm_configs import config_result

    return config_result(reference, run, config, plan.batches, shared=shared)


def _remote_score(plan: StudyPlan, run: llm.ReferenceRun, config: LLMConfig) -> ConfigResult:
    """:func:`_score` on a Dask worker: the worker's torch threads as this process's settings
    say, the model read from the plan's path (in memory: loaded once per worker process)."""
    settings.use_torch_threads()
    reference = None if plan.streamed else _worker_model(plan)
    return _score(plan, run, reference, config, progress=False)


_WORKER_MODELS: dict[tuple[str, str], Any] = {}


def _worker_model(plan: StudyPlan) -> Any:
    key = (str(plan.source.path), str(plan.dtype))
    if key not in _WORKER_MODELS:
        _WORKER_MODELS.clear()
        _WORKER_MODELS[key] = load_decoder(plan.source, dtype=plan.dtype,
                                           trust_remote_code=plan.trust_remote_code)[0]
    return _WORKER_MODELS[key]


def _split(fidelity: TokenFidelity, first: int) -> tuple[TokenFidelity, TokenFidelity]:
    """``fidelity`` over all windows as (its first ``first`` windows, the rest)."""
    counts = fidelity.window_tokens
    cut = sum(counts[:first])
    parts = []
    for sl, windows in ((slice(0, cut), counts[:first]), (slice(cut, None), counts[first:])):
        parts.append(fidelity_of(fidelity.kld[sl], fidelity.nll[sl], fidelity.reference_nll[sl],
                                 fidelity.top1[sl], windows, fidelity.context))
    return parts[0], parts[1]


def _line(result: ConfigResult, done: int, total: int) -> str:
    f = result.fidelity
    lo, hi = f.kld_ci95
    return (f"[{done}/{total}] {result.label}: mean KLD {f.kld_mean:.4g} (95 % {lo:.4g} to "
            f"{hi:.4g}), perplexity ratio {f.perplexity_ratio:.4g}, top-1 "
            f"{f.top1_agreement:.4f}, {f.windows} windows; built in {result.build_seconds:.1f} s")


def _run_all(plan: StudyPlan, run: llm.ReferenceRun, reference: Any, dask: str | None,
             progress: bool) -> list[ConfigResult]:
    total = len(plan.configs)
    if dask is None:
        from nvfp4lab.studies.llm_configs import shared_calibration

        out, shared = [], None
        if reference is not None:  # in memory: one float pass for K / V scales and smoothing
            shared = shared_calibration(reference, plan.configs, plan.batches)
            if shared:
                _say(progress, f"K / V scales and smoothing statistics: one calibration pass, "
                               f"{shared['kv_scales'][1]:.1f} s")
        for i, config in enumerate(plan.configs):
            _say(progress, f"[{i + 1}/{total}] {config.label}: building and scoring ...")
            out.append(_score(plan, run, reference, config, progress, shared))
            _say(progress, _line(out[-1], i + 1, total))
        return out
    from distributed import Client, as_completed

    with Client(dask, timeout="30s") as client:
        run_future = client.scatter(run, broadcast=True)
        plan_future = client.scatter(plan, broadcast=True)
        futures = {client.submit(_remote_score, plan_future, run_future, config, pure=False):
                   config for config in plan.configs}
        results: dict[str, ConfigResult] = {}
        for done, future in enumerate(as_completed(futures), start=1):
            result = future.result()
            results[result.label] = result
            _say(progress, _line(result, done, total) + " (on the cluster)")
    return [results[c.label] for c in plan.configs]


@dataclass(frozen=True, eq=False)
class StudyResult:
    """What :func:`study` found. ``plan``: what ran; ``reference_perplexity``: the reference's
    perplexity per text; ``evaluation`` / ``domain``: one
    :class:`~nvfp4lab.studies.llm_configs.ConfigResult` per configuration on the evaluation part
    and on the second text; ``verdicts``: the best of each family on the evaluation part
    (:func:`~nvfp4lab.studies.llm_verdict.best_per_family`); ``seconds``: the whole run."""

    plan: StudyPlan
    reference_perplexity: dict[str, float]
    evaluation: tuple[ConfigResult, ...]
    domain: tuple[ConfigResult, ...]
    verdicts: tuple[FamilyVerdict, ...]
    seconds: float
    search: Any = None  #: the search step (``llm_search.StudySearch``) or None

    def rows(self) -> list[dict[str, Any]]:
        """The table: one row per configuration and text (``text``: ``evaluation`` or the
        second text's name), :meth:`ConfigResult.row`'s columns."""
        out = []
        for name, results in ((EVALUATION, self.evaluation), (self.plan.domain_name, self.domain)):
            out += [{"text": name, **r.row()} for r in results]
        return out

    @property
    def table(self) -> Any:
        """:meth:`rows` as a pandas DataFrame indexed by (text, label)."""
        import pandas as pd

        return pd.DataFrame(self.rows()).set_index(["text", "label"])

    def domain_rows(self) -> list[dict[str, Any]]:
        """Per configuration: mean KLD (95 % interval) on the evaluation part and on the second
        text, and their ratio (how far the calibration carries)."""
        out = []
        for ev, dom in zip(self.evaluation, self.domain, strict=True):
            a, b = ev.fidelity, dom.fidelity
            out.append({"label": ev.label, "kld_evaluation": a.kld_mean,
                        "kld_evaluation_lo": a.kld_ci95[0], "kld_evaluation_hi": a.kld_ci95[1],
                        "kld_second": b.kld_mean, "kld_second_lo": b.kld_ci95[0],
                        "kld_second_hi": b.kld_ci95[1],
                        "second_over_evaluation": b.kld_mean / a.kld_mean
                        if a.kld_mean > 0 else math.nan})
        return out

    def verdict(self) -> str:
        """The verdict's markdown (:func:`~nvfp4lab.studies.llm_verdict.verdict_text`)."""
        return verdict_text(self.verdicts)

    def save(self, out: str | os.PathLike[str]) -> tuple[Path, Path]:
        """Write ``out/study.csv`` (:meth:`rows`) and ``out/study.json`` (the plan, the
        verdict, its tables and the domain effect), replacing them; the folder must exist."""
        import pandas as pd

        folder = Path(out)
        csv, facts = folder / RESULTS_CSV, folder / RESULTS_JSON
        pd.DataFrame(self.rows()).to_csv(csv, index=False)
        payload = {
            "plan": self.plan.describe(), "reference_perplexity": self.reference_perplexity,
            "verdict": self.verdict(), "families": family_table(self.verdicts),
            "comparisons": comparison_rows(self.verdicts), "domain": self.domain_rows(),
            "seconds": self.seconds,
        }
        facts.write_text(json.dumps(payload, indent=1, default=_json_default) + "\n")
        if self.search is not None:  # sensitivity.csv, frontier.csv, mix.json beside them
            self.search.save(folder, self.plan.eval_windows)
        return csv, facts


def _json_default(value: Any) -> Any:
    if isinstance(value, float | int):
        return value
    return str(value)


def run_study(plan: StudyPlan, *, dask: str | None = None, progress: bool = True,
              on_reference: Callable[[llm.ReferenceRun], None] | None = None) -> StudyResult:
    """Run ``plan``: the reference once over both texts, then every configuration (here, or on
    the Dask cluster at ``dask``), one progress line per configuration on stderr unless
    ``progress`` is False."""
    start = time.perf_counter()
    how = "block by block" if plan.streamed else "in memory"
    _say(progress, f"nvfp4lab study: {plan.source.name} ({plan.info.model_type}, "
                   f"{str(plan.dtype).removeprefix('torch.')}, {how}); {plan.eval_windows} "
                   f"evaluation + {plan.domain_windows} {plan.domain_name} windows of "
                   f"{plan.context} tokens; {len(plan.configs)} configurations")
    run, reference = _reference(plan, progress)
    if on_reference is not None:
        on_reference(run)
    results = _run_all(plan, run, reference, dask, progress)
    search = None if plan.search_bits is None else study_search(
        reference, run, plan.batches, plan.search_bits, dask=dask, progress=progress,
        formats=plan.search_formats)
    results += [] if search is None else [search.result]
    del reference
    pairs = [(r, *_split(r.fidelity, plan.eval_windows)) for r in results]
    evaluation = tuple(ConfigResult(r.config, ev, r.build_seconds, r.peak_rss_mb)
                       for r, ev, _ in pairs)
    domain = tuple(ConfigResult(r.config, dom, r.build_seconds, r.peak_rss_mb)
                   for r, _, dom in pairs)
    ref_nll = run.nll
    cut = sum(run.window_tokens[: plan.eval_windows])
    perplexity = {EVALUATION: math.exp(float(ref_nll[:cut].mean())),
                  plan.domain_name: math.exp(float(ref_nll[cut:].mean()))}
    return StudyResult(plan, perplexity, evaluation, domain,
                       tuple(best_per_family(evaluation)), time.perf_counter() - start, search)


def study(
    model: str | os.PathLike[str] | None = None,
    *,
    text: str | os.PathLike[str] | None = None,
    calibration: str | os.PathLike[str] | None = None,
    configs: Sequence[str] | Sequence[LLMConfig] | None = None,
    tokens: int | None = None,
    context: int | None = None,
    samples: int | None = None,
    smoke: bool = False,
    dtype: str | torch.dtype | None = None,
    streamed: bool | None = None,
    dask: str | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
    search: float | None = None,
    search_formats: Sequence[str] | None = None,
) -> StudyResult:
    """What NVFP4 does to ``model`` on ``text``: :func:`plan_study` then :func:`run_study`.

    ``model``: None (SmolLM2), a folder, ``org/name`` in the local Hugging Face cache, or a
    ``.gguf`` file. ``text``: a plain-text, markdown or JSONL file (None: CPython's pydoc
    topics), split by the corpus rules, or the evaluation text when ``calibration`` is given.
    ``configs``: names of :func:`config_names` (None: all; ``smoke``: four, few tokens).
    ``tokens``: evaluation tokens per text (default 2,048); ``context``: tokens per window
    (256); ``samples``: calibration windows of 256 tokens (32). ``dtype``: "float32" (default),
    "bfloat16" or "float16". ``streamed``: block by block (None: when the model is large).
    ``dask``: a Dask scheduler address. ``search``: bits per weight for the mixed-precision
    search (:mod:`~nvfp4lab.studies.llm_search`: one more row, its files in ``.save``);
    ``search_formats``: the :class:`~nvfp4lab.vocab.LayerFormat` values it chooses among.
    Returns a :class:`StudyResult` (``.table``, ``.verdict()``, ``.save(folder)``).
    """
    plan = plan_study(model, text=text, calibration=calibration, configs=configs,
                      tokens=tokens, context=context, samples=samples, smoke=smoke, dtype=dtype,
                      streamed=streamed, trust_remote_code=trust_remote_code, search=search,
                      search_formats=search_formats)
    return run_study(plan, dask=dask, progress=progress)



# ---------------------------------------------------------------------------------------------
# Notebook 07's setup: the same inputs for any model and text
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class NotebookSetup:
    """What notebook 07's cells use: the model found (``source``), loaded (``model``,
    ``tokenizer``, float32 by default), the text split (``split``), the configurations, the
    calibration ``batches``, the reference ``run`` over the evaluation part and ``ids``: its first
    window ``[1, T]`` for the per-layer views."""

    source: ModelSource
    model: Any
    tokenizer: Any
    split: corpus.TextSplit
    configs: list[LLMConfig]
    batches: list[Any]
    run: llm.ReferenceRun
    ids: torch.Tensor

    def summary(self) -> str:
        """One line: model and its dtype, reference perplexity, tokens, configurations,
        calibration."""
        samples = len(self.batches) and sum(b["input_ids"].shape[0] for b in self.batches)
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        return (f"{self.source.name} ({dtype}): reference perplexity {self.run.perplexity:.3f} on "
                f"{self.run.tokens} evaluation tokens ({len(self.run.windows)} windows) | "
                f"{len(self.configs)} configurations | {samples} calibration windows")


def notebook_setup(
    model: str | os.PathLike[str] | None = None,
    text: str | os.PathLike[str] | None = None,
    *,
    smoke: bool = False,
    seed: int = 0,
    context: int = DEFAULTS["context"],
    max_tokens: int = DEFAULTS["tokens"],
    samples: int = DEFAULTS["samples"],
    length: int = DEFAULTS["length"],
    dtype: str = "float32",
) -> NotebookSetup:
    """Notebook 07's inputs for ``model`` (None: SmolLM2, as :func:`plan_study` finds models)
    and ``text`` (None: the pydoc topics; a file: split by :func:`nvfp4lab.texts.split_text`):
    the evaluation part scored up to ``max_tokens`` tokens in windows of ``context`` (``smoke``:
    128 tokens in windows of 64 and 4 calibration windows), calibration windows of ``length``
    tokens drawn with ``seed``; ``dtype`` ("float32", "bfloat16" or "float16") is the dtype
    every model runs in, the reference included. No progress bar (a page shows none)."""
    from nvfp4lab import texts

    if smoke:
        max_tokens, samples, context = (SMOKE_SETTINGS["tokens"], SMOKE_SETTINGS["samples"],
                                        SMOKE_SETTINGS["context"])
    source = resolve_model(model)
    loaded, tokenizer = load_decoder(source, dtype=dtype)
    split = (corpus.pydoc_split() if text is None
             else texts.split_text(texts.read_documents(text)))
    batches = corpus.calibration_batches(tokenizer, text=split.calibration, samples=samples,
                                         length=length, seed=seed)
    run = cached_reference_run(loaded, split.evaluation, tokenizer=tokenizer, context=context,
                               max_tokens=max_tokens, progress=False)
    return NotebookSetup(source, loaded, tokenizer, split, configurations(smoke=smoke), batches,
                         run, run.input_ids(0)[:1])
