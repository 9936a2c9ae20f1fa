"""A user's own decoder, offline: find it (:func:`resolve_model`), check it from its config and
file headers alone (:func:`check_decoder`), load it (:func:`load_decoder`).

What a user may name (``spec``):

* nothing: SmolLM2-135M-Instruct, the model nvfp4lab ships (:func:`nvfp4lab.models.smollm2_path`);
* a folder holding ``config.json`` and safetensors weights (a ``save_pretrained`` folder, sharded
  or not, or a Hugging Face cache snapshot ``models--org--name/snapshots/<rev>``);
* a Hugging Face cache repository folder ``models--org--name`` (the snapshot ``refs/main``
  names, else its only snapshot);
* ``org/name``, looked up in the local Hugging Face cache (:func:`nvfp4lab.settings.hf_hub_cache`);
* a ``.gguf`` file (read by transformers' GGUF loader, weights dequantized).

Nothing is ever downloaded: transformers is called with ``local_files_only=True``, and a name
that is not in the cache is refused in one line. Files are read by the one rule of
:func:`nvfp4lab.checkpoint.folders.unsafe_entries`: regular files inside the folder, or a cache
snapshot's links into its own ``blobs/``. Pickle weights are never read. Supported: the causal
decoders whose projections are ``nn.Linear`` (:data:`SUPPORTED_DECODERS` are tested; another
``*ForCausalLM`` is accepted when, once loaded, its decoder blocks hold only ``nn.Linear``
projections).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvfp4lab import settings
from nvfp4lab.checkpoint.folders import HF_REPO_PREFIX, hf_snapshot
from nvfp4lab.checkpoint.formats.gguf_read import SUFFIX as GGUF_SUFFIX
from nvfp4lab.checkpoint.refusals import read_json
from nvfp4lab.checkpoint.safetensors_files import (
    CONFIG_NAME,
    check_readable,
    read_header,
    weight_files,
)
from nvfp4lab.vocab import CheckpointFormat

__all__ = [
    "DTYPES",
    "SUPPORTED_DECODERS",
    "DecoderInfo",
    "ModelKind",
    "ModelSource",
    "check_decoder",
    "check_projections",
    "check_tokenizer",
    "load_decoder",
    "load_encoder",
    "load_tokenizer",
    "resolve_model",
]

#: The decoder architectures (transformers ``model_type``) tested end to end: each is loaded as
#: ``AutoModelForCausalLM`` with ``nn.Linear`` projections.
SUPPORTED_DECODERS: tuple[str, ...] = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3",
    "granite",
)

#: Architectures refused outright: their projections are GPT-2's ``Conv1D`` (a transposed
#: weight nvfp4lab's layer swap does not handle).
CONV1D_DECODERS: tuple[str, ...] = ("gpt2", "openai-gpt", "imagegpt", "decision_transformer")

#: The dtypes a model may be loaded in, by name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_SUPPORTED_TEXT = ", ".join(SUPPORTED_DECODERS)


class ModelKind(StrEnum):
    """What a :class:`ModelSource` points at."""

    SMOLLM2 = "smollm2"  #: the shipped model (its float32 folder)
    FOLDER = "folder"  #: a folder holding config.json and safetensors
    GGUF = CheckpointFormat.GGUF.value  #: a .gguf file (the container's one spelling)


@dataclass(frozen=True)
class ModelSource:
    """Where a model is: ``kind`` a :class:`ModelKind` (smollm2 | folder | gguf); ``path`` the
    folder holding ``config.json`` (absolute) or the ``.gguf`` file; ``name`` for display
    (``org/name`` for a cache entry); ``revision`` the cache snapshot's name when it came from
    the HF cache."""

    kind: ModelKind
    path: Path
    name: str
    revision: str | None = None


@dataclass(frozen=True)
class DecoderInfo:
    """A decoder as its config and weight headers describe it (no weight read). ``dtype``: the
    checkpoint's own float dtype (a GGUF file's dequantized dtype is float32); ``parameters``:
    the elements of the stored tensors (a tied output head counted once); ``bytes_on_disk``:
    the weight files' size; ``tested``: whether ``model_type`` is in
    :data:`SUPPORTED_DECODERS`."""

    source: ModelSource
    model_type: str
    architectures: tuple[str, ...]
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype: str
    parameters: int
    bytes_on_disk: int
    tied: bool
    tested: bool


# ---------------------------------------------------------------------------------------------
# resolve


def _hf_repo(folder: Path) -> tuple[str, str | None] | None:
    """(``org/name``, revision) when ``folder`` is a snapshot ``models--org--name/snapshots/<rev>``
    of a Hugging Face cache, else None."""
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith(HF_REPO_PREFIX):
        repo = folder.parent.parent.name[len(HF_REPO_PREFIX):].replace("--", "/", 1)
        return repo, folder.name
    return None


def _snapshot_of(repo: Path) -> Path:
    """The snapshot of the cache repository folder ``repo``: the one ``refs/main`` names
    (:func:`~nvfp4lab.checkpoint.folders.hf_snapshot`), else its only snapshot; ValueError
    naming them when there are several and no ``refs/main``, or none."""
    if (repo / "refs" / "main").exists():
        return hf_snapshot(repo)
    folder = repo / "snapshots"
    found = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValueError(f"{repo} is a Hugging Face cache folder with no snapshot (nothing under "
                         f"{folder}); download the model again or pass a folder holding "
                         "config.json")
    shown = ", ".join(str(p) for p in found[:3]) + (" ..." if len(found) > 3 else "")
    raise ValueError(f"{repo} has {len(found)} snapshots and no refs/main to choose one; pass "
                     f"one of the snapshot folders ({shown})")


def _config_missing(folder: Path) -> ValueError:
    return ValueError(f"{folder} has no config.json: not a transformers model folder; give the "
                      "folder that holds config.json and *.safetensors")


def _folder_source(folder: Path) -> ModelSource:
    """A model folder (a cache repository folder is turned into its snapshot first)."""
    if folder.name.startswith(HF_REPO_PREFIX) and (folder / "snapshots").is_dir() \
            and not (folder / CONFIG_NAME).exists():
        folder = _snapshot_of(folder)
    folder = folder.absolute()
    if not (folder / CONFIG_NAME).exists():
        raise _config_missing(folder)
    cached = _hf_repo(folder)
    if cached is not None:
        return ModelSource(ModelKind.FOLDER, folder, cached[0], cached[1])
    return ModelSource(ModelKind.FOLDER, folder, folder.name)


def _gguf_source(file: Path) -> ModelSource:
    """A ``.gguf`` file: inside a cache snapshot, a link into that cache's blobs only (the one
    rule); elsewhere the file the user named, wherever a link to it leads (a regular file)."""
    file = file.absolute()
    cached = _hf_repo(file.parent)
    if cached is None:
        file = file.resolve()
    check_readable(file.parent, [file])
    name = f"{cached[0]}/{file.name}" if cached else file.name
    return ModelSource(ModelKind.GGUF, file, name, cached[1] if cached else None)


def _offline_note(env: Mapping[str, str] | None) -> str:
    if settings.hf_offline(env):
        return " (HF_HUB_OFFLINE is set and honoured: fetch it on a machine that is online)"
    return ""


def resolve_model(spec: str | os.PathLike[str] | None, *,
                  cache_dir: str | os.PathLike[str] | None = None,
                  env: Mapping[str, str] | None = None) -> ModelSource:
    """Where the model ``spec`` names is (see the module docstring for what it may be), found
    without downloading anything. ``cache_dir``: the Hugging Face hub cache to look ``org/name``
    up in (default :func:`nvfp4lab.settings.hf_hub_cache` of ``env``). ValueError in one line
    naming what was looked for and where."""
    if spec is None:
        from nvfp4lab import models

        return ModelSource(ModelKind.SMOLLM2, models.smollm2_path().absolute(), SMOLLM2_NAME)
    if not isinstance(spec, str | os.PathLike):
        raise TypeError(f"model must be a path, an org/name of the local Hugging Face cache or "
                        f"None (SmolLM2), got {type(spec).__name__}")
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        return _folder_source(path)
    if path.is_file() or path.is_symlink():
        if path.suffix.lower() == GGUF_SUFFIX:
            return _gguf_source(path)
        raise ValueError(f"{path} is a file, not a model: give the folder that holds config.json "
                         "and *.safetensors, or a .gguf file")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else settings.hf_hub_cache(env)
    if isinstance(spec, str) and _REPO_ID.fullmatch(text):
        repo = cache / (HF_REPO_PREFIX + text.replace("/", "--"))
        if repo.is_dir():
            source = _folder_source(repo)
            return ModelSource(source.kind, source.path, text, source.revision)
        raise ValueError(
            f"{text!r} is not a local folder and not in the local Hugging Face cache (looked for "
            f"{repo}); nvfp4lab downloads nothing{_offline_note(env)}: download it first "
            f"(hf download {text}) or give the folder that holds config.json and *.safetensors")
    raise ValueError(
        f"{text}: no such file or folder (and not an org/name of the local Hugging Face cache "
        f"{cache}); nvfp4lab downloads nothing{_offline_note(env)}: give the folder that holds "
        "config.json and *.safetensors, a .gguf file, or a model in that cache")


# ---------------------------------------------------------------------------------------------
# check


def _gguf_config(source: ModelSource) -> tuple[dict[str, Any], int, int]:
    """(transformers config, stored elements, file bytes) of a GGUF file."""
    from nvfp4lab.checkpoint.formats.gguf import SPEC

    config = SPEC.model_config(source.path)
    tensors = SPEC.read_weights(source.path).tensors.values()
    config.setdefault("dtype", "float32")
    return config, sum(math.prod(t.shape) for t in tensors), source.path.stat().st_size


def _folder_config(folder: Path) -> dict[str, Any]:
    """config.json of a model folder, every top-level file checked by the one link rule first
    (transformers may read any of them)."""
    if not (folder / CONFIG_NAME).exists():
        raise _config_missing(folder)
    check_readable(folder, sorted(p for p in folder.iterdir()
                                  if p.is_symlink() or not p.is_dir()))
    return read_json(folder / CONFIG_NAME)


def _folder_weights(folder: Path) -> tuple[int, int]:
    """(stored elements, weight bytes) of a model folder's safetensors, from their headers
    (pickle weights refused, never opened)."""
    files = weight_files(folder).files
    elements = 0
    for file in files:
        _, header = read_header(file)
        elements += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return elements, sum(f.stat().st_size for f in files)


def _kind_problem(config: Mapping[str, Any], where: Path, trust_remote_code: bool) -> str | None:
    """Why the config describes no decoder nvfp4lab can study, or None."""
    model_type = str(config.get("model_type", ""))
    archs = [str(a) for a in config.get("architectures") or ()]
    supported = f"supported: {_SUPPORTED_TEXT} (and other causal decoders with nn.Linear " \
                "projections)"
    if config.get("auto_map") and not trust_remote_code:
        return (f"{where}: the model needs trust_remote_code (config.json's auto_map names code "
                f"shipped with it: {', '.join(sorted(config['auto_map']))}); pass "
                "trust_remote_code=True (--trust-remote-code) only if you trust that code")
    if config.get("is_encoder_decoder"):
        return (f"{where}: model_type {model_type!r} is an encoder-decoder, not a causal "
                f"decoder; {supported}")
    if model_type in CONV1D_DECODERS:
        return (f"{where}: model_type {model_type!r} projects with GPT-2's Conv1D, not "
                f"nn.Linear; {supported}")
    if model_type in SUPPORTED_DECODERS or config.get("auto_map"):
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or not any(
            a.endswith("ForCausalLM") for a in archs):
        shown = ", ".join(archs) or "none"
        return (f"{where}: model_type {model_type!r} (architectures: {shown}) is not a causal "
                f"decoder transformers loads as AutoModelForCausalLM; {supported}")
    return None


def _number(config: Mapping[str, Any], key: str, where: Path, default: Any = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: config.json's {key} is {value!r}, expected a positive "
                         "integer; the config is incomplete or not a decoder's")
    return value


def _dtype_name(config: Mapping[str, Any]) -> str:
    raw = config.get("dtype") or config.get("torch_dtype") or "float32"
    name = str(raw).removeprefix("torch.")
    return name if name in DTYPES else "float32"


def check_decoder(source: ModelSource, *, trust_remote_code: bool = False) -> DecoderInfo:
    """What the decoder at ``source`` is, from its config and weight headers alone (nothing is
    loaded). ValueError (CheckpointError for the files) in one line: no config.json, no
    safetensors (pickle weights are never read), a link out of the folder (or out of the cache
    snapshot's blobs), a model needing ``trust_remote_code`` without it, an encoder-decoder,
    an encoder, a GPT-2-style Conv1D decoder."""
    if source.kind == ModelKind.GGUF:
        config, elements, size = _gguf_config(source)
        where = source.path
    else:
        config = _folder_config(source.path)
        where = source.path / CONFIG_NAME
    problem = _kind_problem(config, where, trust_remote_code)
    if problem is not None:
        raise ValueError(problem)
    if source.kind != ModelKind.GGUF:
        elements, size = _folder_weights(source.path)
    heads = _number(config, "num_attention_heads", where)
    hidden = _number(config, "hidden_size", where)
    return DecoderInfo(
        source=source,
        model_type=str(config["model_type"]),
        architectures=tuple(str(a) for a in config.get("architectures") or ()),
        layers=_number(config, "num_hidden_layers", where),
        hidden=hidden,
        heads=heads,
        kv_heads=_number(config, "num_key_value_heads", where, heads),
        head_dim=_number(config, "head_dim", where, None) if config.get("head_dim") is not None
        else hidden // heads,
        vocab=_number(config, "vocab_size", where),
        dtype=_dtype_name(config),
        parameters=elements,
        bytes_on_disk=size,
        tied=bool(config.get("tie_word_embeddings", True)),
        tested=str(config["model_type"]) in SUPPORTED_DECODERS,
    )


def check_tokenizer(tokenizer: Any, vocab_size: int) -> None:
    """Refuse (ValueError) a tokenizer whose ids (``len(tokenizer)``, added tokens included)
    exceed the model's vocabulary of ``vocab_size`` rows."""
    ids = len(tokenizer)
    if ids > vocab_size:
        raise ValueError(f"the tokenizer has {ids} token ids (0..{ids - 1}) but the model's "
                         f"vocabulary has {vocab_size} rows: they do not belong together; give "
                         "the tokenizer saved with the model")


# ---------------------------------------------------------------------------------------------
# load


def _blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks: the longest ``nn.ModuleList`` in the model."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of decoder blocks (nn.ModuleList); "
                         "not a decoder nvfp4lab can study")
    return max(lists, key=len)


def check_projections(model: nn.Module) -> None:
    """Refuse (ValueError naming the module and its type) a model whose decoder blocks hold a
    weight matrix in anything but ``nn.Linear`` (GPT-2's Conv1D, a fused custom layer)."""
    for i, block in enumerate(_blocks(model)):
        for name, module in block.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2 \
                    and not isinstance(module, nn.Linear):
                raise ValueError(
                    f"{type(model).__name__}: block {i}'s {name} is a {type(module).__name__}, "
                    f"not nn.Linear; nvfp4lab studies decoders whose projections are nn.Linear "
                    f"(supported: {_SUPPORTED_TEXT})")


def _dtype(dtype: str | torch.dtype | None, info: DecoderInfo) -> torch.dtype:
    if dtype is None:
        return DTYPES[info.dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or None: the checkpoint's own, "
                     f"{info.dtype}), got {dtype!r}")


#: tokenizer_config.json's class names of a generic tokenizer, all of it in tokenizer.json.
_GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _tokenizer(folder: Path, where: dict[str, Any]) -> Any:
    """The folder's tokenizer. A generic one (``tokenizer_config.json`` names
    :data:`_GENERIC_TOKENIZERS` and ``tokenizer.json`` is there) is loaded as that class:
    ``AutoTokenizer`` would pick the model type's own class instead (transformers 5 does for
    Qwen2), which rebuilds the pre-tokenizer and splits the text otherwise than the saved
    tokenizer does."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_file = folder / "tokenizer_config.json"
    if (config_file.is_file() and (folder / "tokenizer.json").is_file()
            and read_json(config_file).get("tokenizer_class") in _GENERIC_TOKENIZERS):
        return PreTrainedTokenizerFast.from_pretrained(**where)
    return AutoTokenizer.from_pretrained(**where)


def load_decoder(source: ModelSource, *, dtype: str | torch.dtype | None = None,
                 trust_remote_code: bool = False) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` of ``source``, offline: ``model`` an ``AutoModelForCausalLM`` in
    eval mode on the CPU (``model(input_ids=[B, T] int64).logits`` is ``[B, T, vocab]``) in
    ``dtype`` (default: the checkpoint's own, float32 for a GGUF file), its tokenizer from the
    same folder or GGUF file. A model read from a GGUF file (SmolLM2's too) names it in its
    :data:`~nvfp4lab.checkpoint.records.SOURCE_ATTRIBUTE`, so that saving it as GGUF keeps the
    file's metadata and tokenizer. Checked first (:func:`check_decoder`), then every weight
    matrix of the decoder blocks must be ``nn.Linear`` (:func:`check_projections`) and the
    tokenizer's ids must fit the vocabulary (:func:`check_tokenizer`)."""
    from nvfp4lab import models

    info = check_decoder(source, trust_remote_code=trust_remote_code)
    torch_dtype = _dtype(dtype, info)
    if source.kind == ModelKind.GGUF:
        model, tokenizer = models.load_gguf(source.path, torch_dtype)
    else:
        from transformers import AutoModelForCausalLM

        where = dict(pretrained_model_name_or_path=str(source.path), local_files_only=True,
                     trust_remote_code=trust_remote_code)
        with models._transformers_progress():
            tokenizer = _tokenizer(source.path, where)
            model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch_dtype)
    model.eval()
    if source.kind != ModelKind.FOLDER:  # the GGUF file it came from, as models.smollm2 marks it
        from nvfp4lab.checkpoint.records import SOURCE_ATTRIBUTE

        gguf_file = source.path if source.kind == ModelKind.GGUF else models._smollm2_gguf()[0]
        setattr(model, SOURCE_ATTRIBUTE, gguf_file)
    check_projections(model)
    check_tokenizer(tokenizer, int(model.config.vocab_size))
    return model, tokenizer


def load_tokenizer(source: ModelSource, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer of ``source`` alone, offline (no weights read): the folder's (as
    :func:`load_decoder` loads it) or the GGUF file's vocabulary."""
    if source.kind == ModelKind.GGUF:
        from transformers import AutoTokenizer

        from nvfp4lab import models

        with models._gguf_parsed_once():
            return AutoTokenizer.from_pretrained(
                str(source.path.parent), gguf_file=source.path.name, local_files_only=True)
    where = dict(pretrained_model_name_or_path=str(source.path), local_files_only=True,
                 trust_remote_code=trust_remote_code)
    return _tokenizer(source.path, where)


#: Encoder model types a study of sentence embeddings (notebook 05) is tested with.
ENCODER_TYPES: tuple[str, ...] = ("bert", "roberta", "xlm-roberta", "distilbert", "mpnet")


def load_encoder(spec: str | os.PathLike[str], *, dtype: str | torch.dtype = "float32",
                 env: Mapping[str, str] | None = None) -> Any:
    """A local sentence encoder (notebook 05's ``ENCODER``): ``spec`` a model folder or
    ``org/name`` in the local Hugging Face cache (:func:`resolve_model`'s rules; nothing is
    downloaded), returned as :class:`nvfp4lab.models.SentenceEncoder`. Refused in one line: a
    GGUF file, a decoder (``is_decoder`` or a ``*ForCausalLM`` architecture) and a model type
    that is not an encoder of :data:`ENCODER_TYPES`."""
    from nvfp4lab import models

    if spec is None:
        raise ValueError("load_encoder needs a model folder or org/name (MiniLM: "
                         "nvfp4lab.models.minilm())")
    source = resolve_model(spec, env=env)
    if source.kind != ModelKind.FOLDER:
        raise ValueError(f"{source.path}: an encoder must be a model folder (config.json and "
                         "safetensors), not a GGUF file or the shipped decoder")
    config = read_json(source.path / "config.json")
    model_type = config.get("model_type")
    decoder = config.get("is_decoder") or any(
        str(a).endswith("ForCausalLM") for a in config.get("architectures") or ())
    if decoder or model_type not in ENCODER_TYPES:
        raise ValueError(f"{source.path}: model_type {model_type!r} is not a sentence encoder "
                         f"nvfp4lab studies ({', '.join(ENCODER_TYPES)}); decoders go to "
                         "nvfp4lab study / notebook 07")
    found = weight_files(source.path).files
    if not found:
        raise ValueError(f"{source.path} holds no *.safetensors weights")
    check_readable(source.path, found)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else DTYPES.get(str(dtype))
    if torch_dtype is None:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return models.sentence_encoder(source.path, dtype=torch_dtype)
