"""The checkpoint formats: one module each, one interface, one registry.

==========================  =================================================================
module                      holds
==========================  =================================================================
``compressed_tensors``      compressed-tensors NVFP4 (ENCODE tensor scales)
``modelopt``                NVIDIA ModelOpt 0.47 ``export_hf_checkpoint`` (DECODE tensor scales)
``gguf``                    GGUF NVFP4 (ggml type 40) as llama.cpp reads it: one file of tensors
                            and metadata, DECODE tensor scales in ``<name>.scale`` sidecars
``fp_quant``                FP-Quant's own NVFP4 format (``quant_method: "fp_quant"``, ENCODE
                            tensor scales, per-layer Hadamard matrices)
==========================  =================================================================

Each module defines a class with the members of :class:`CheckpointFormatSpec` and one instance
of it, ``SPEC``; :data:`FORMATS` maps every :class:`nvfp4lab.vocab.CheckpointFormat` member to
its spec. ``writer``, ``reader``, ``conversion``, ``auditing`` and ``stream`` only look specs up
here (:func:`format_spec`) and call them; no other module knows a format's names or files. A
spec reads and writes its own container: ``read_weights`` describes the stored tensors under the
model's names (:class:`~nvfp4lab.checkpoint.records.StoredWeights`), ``model_config`` gives the
model's ``config.json`` content and ``write_checkpoint`` writes a new checkpoint from one
:class:`~nvfp4lab.checkpoint.records.Contents`; the safetensors formats implement the three
through the shared container of :mod:`nvfp4lab.checkpoint.safetensors_files`.
The format modules import only the checkpoint plumbing (:mod:`~nvfp4lab.checkpoint.records`,
:mod:`~nvfp4lab.checkpoint.rows`, :mod:`~nvfp4lab.checkpoint.refusals`,
:mod:`~nvfp4lab.checkpoint.safetensors_files`, :mod:`~nvfp4lab.checkpoint.folders`,
:mod:`~nvfp4lab.checkpoint.formats.tensor_scales`), numerics / vocab and, one layer down,
:mod:`nvfp4lab.execution.shared_scales` (the fused-group merge rule), never this registry, the
writer or the reader. Adding a format:
``docs/architecture.md``, "How to add a checkpoint format".
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from nvfp4lab.checkpoint.folders import hf_snapshot
from nvfp4lab.checkpoint.formats import compressed_tensors, fp_quant, gguf, modelopt
from nvfp4lab.checkpoint.records import Contents, LayerNames, StoredWeights, TaskRunner
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.checkpoint.safetensors_files import CONFIG_NAME, quantization_block
from nvfp4lab.vocab import CheckpointFormat, Scheme

__all__ = [
    "FORMATS",
    "LAYER_NAMES",
    "CheckpointFormatSpec",
    "FormatConfig",
    "checkpoint_files",
    "detect_format",
    "format_spec",
    "registered_format",
]


@runtime_checkable
class FormatConfig(Protocol):
    """A format's validated configuration, as :meth:`CheckpointFormatSpec.read_config` returns
    it (``file``: where it was read)."""

    file: Path

    @property
    def unquantized(self) -> tuple[str, ...]:
        """The modules the config lists as left unquantized (names or wildcards)."""
        ...

    def checkpoint_scheme(self) -> Scheme:
        """The one :class:`~nvfp4lab.vocab.Scheme` of the checkpoint (CheckpointError when its
        layers mix schemes)."""
        ...

    def quantized_modules(self, model: nn.Module) -> dict[str, bool]:
        """Module name -> whether the layer stores a static input scale, for every Linear of
        ``model`` the config quantizes (CheckpointError when it quantizes none)."""
        ...


@runtime_checkable
class CheckpointFormatSpec(Protocol):
    """What nvfp4lab needs to know of one checkpoint format.

    ``format``: its vocabulary member; ``title``: how help texts name it; ``description``: how
    the unknown-format error names it; ``names``: the tensor names of a quantized Linear and the
    scale form on disk (:class:`~nvfp4lab.checkpoint.records.LayerNames`: ``decode`` True for
    DECODE amax/2688, False for ENCODE 2688/amax); ``config_files``: the files it writes besides
    ``config.json`` and the weights; ``weight_files``: the fixed names of the weight files it
    writes (those a name alone does not mark as weights, as ``*.safetensors`` does), which
    ``overwrite=True`` may replace too; ``transformers_needs_bfloat16``: whether transformers
    runs only bfloat16 checkpoints of it (``save_pretrained`` warns otherwise);
    ``optional_tensor_scale``: None when every quantized layer must store its tensor scale,
    else the one-line note ``audit`` gives a layer that has none (it decodes with tensor scale
    1); ``shares_fused_scales``: whether the engine that runs the format decodes a fused group
    (q/k/v, gate/up) with ONE tensor scale (vLLM), so that ``save_pretrained`` checks the group
    shares it and ``audit`` measures the merge; ``writes_in_tasks``: whether ``write_checkpoint``
    hands its files to the task runner (local pool workers or Dask), else it writes in this
    process and ``convert``'s ``workers`` / ``dask`` do not apply.

    ``path`` arguments are what the user passed: a checkpoint folder, or the file of a format
    kept in one file (``detect`` says which).
    """

    format: CheckpointFormat
    title: str
    description: str
    names: LayerNames
    config_files: tuple[str, ...]
    weight_files: tuple[str, ...]
    transformers_needs_bfloat16: bool
    optional_tensor_scale: str | None
    shares_fused_scales: bool
    writes_in_tasks: bool

    def detect(self, path: Path) -> bool:
        """Whether the folder's configuration files (or the file itself) say it is this format
        (never the tensors); CheckpointError for a configuration or file that claims this
        format but is not one."""
        ...

    def read_config(self, path: Path) -> FormatConfig:
        """The checkpoint's quantization configuration, validated (CheckpointError naming the
        file)."""
        ...

    def read_weights(self, path: Path) -> StoredWeights:
        """The stored tensors under the model's names, a quantized Linear's leaves as
        :attr:`names` has them, from the headers alone (CheckpointError naming the file)."""
        ...

    def model_config(self, path: Path) -> dict[str, Any]:
        """The model's transformers configuration (``config.json``'s content) as a dict."""
        ...

    def write_checkpoint(self, folder: Path, contents: Contents,
                         run: TaskRunner | None = None) -> list[str]:
        """Write ``contents`` into the new, empty ``folder`` (weights, model configuration,
        quantization configuration); ``run``: where to run tasks (default: in this process).
        Returns the relative paths written."""
        ...

    def to_disk(self, encode: torch.Tensor, decode: torch.Tensor | None) -> torch.Tensor:
        """A tensor scale as stored (shape ``names.scalar_shape``), from nvfp4lab's in-memory
        float32 ``[1]`` ENCODE scale and, when the layer holds one, its exact DECODE scale."""
        ...

    def from_disk(self, stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(ENCODE scale, exact DECODE scale or None) of a stored float32 ``[1]`` scale."""
        ...

    def fused_decode_scale(self, stored: Sequence[float]) -> torch.Tensor:
        """The one DECODE scale (float32 ``[1]``) the engine keeps for a fused group (q/k/v,
        gate/up) whose shards store the tensor scales ``stored`` (used when
        :attr:`shares_fused_scales`)."""
        ...


#: Every checkpoint format, by its vocabulary member; detection tries them in this order.
FORMATS: dict[CheckpointFormat, CheckpointFormatSpec] = {
    spec.format: spec for spec in (compressed_tensors.SPEC, modelopt.SPEC, gguf.SPEC,
                                    fp_quant.SPEC)
}
#: The tensor names of each format (kept for callers of the former ``files.LAYER_NAMES``).
LAYER_NAMES: dict[CheckpointFormat, LayerNames] = {f: s.names for f, s in FORMATS.items()}


def registered_format(fmt: object, keyword: str = "format") -> CheckpointFormat:
    """The key of :data:`FORMATS` that ``fmt`` (a member or its string) names, read from the
    registry (so a format registered at run time is found); ValueError ``unknown <keyword> …;
    accepted values: …`` (the registered formats) otherwise."""
    if isinstance(fmt, str):
        for key in FORMATS:
            if key == fmt:
                return key
    accepted = ", ".join(repr(key.value) for key in FORMATS)
    raise ValueError(f"unknown {keyword} {fmt!r}; accepted values: {accepted}")


def format_spec(fmt: object) -> CheckpointFormatSpec:
    """The spec of the checkpoint format ``fmt`` (a member or its string); ValueError
    ``unknown format …; accepted values: …`` otherwise."""
    return FORMATS[registered_format(fmt)]


def checkpoint_files() -> frozenset[str]:
    """The configuration files of every format besides ``config.json``, and the fixed weight
    file names (:attr:`CheckpointFormatSpec.weight_files`)."""
    return frozenset(f for spec in FORMATS.values() for f in (*spec.config_files,
                                                               *spec.weight_files))


def _and(items: Sequence[str]) -> str:
    return " and ".join(items) if len(items) < 3 else ", ".join(items[:-1]) + " and " + items[-1]


def detect_format(path: str | Path, fmt: object = None, *,
                  keyword: str = "format") -> CheckpointFormat:
    """The format of the checkpoint at ``path`` (a folder, the file of a format kept in one
    file, or a Hugging Face cache ``models--*`` folder, read at its ``refs/main`` snapshot),
    from its configuration alone: the one format of :data:`FORMATS` whose ``detect`` accepts
    it; ``fmt`` (a member or its string) picks one instead, checked with its ``detect``.

    Raises :class:`CheckpointError` (or FileNotFoundError for a missing path) naming what was
    found instead; a folder that looks like several formats (a compressed-tensors folder that
    also holds a ``.gguf`` file, or an un-fetched git-LFS pointer named so) is refused with
    the ``keyword=`` values that pick one (``keyword``: the caller's parameter for ``fmt``).
    """
    where = hf_snapshot(Path(path))
    if not where.exists():
        raise FileNotFoundError(f"checkpoint folder {where} does not exist")
    if fmt is not None:
        chosen = registered_format(fmt, keyword)
        if not FORMATS[chosen].detect(where):
            raise CheckpointError(f"{where} is not a {FORMATS[chosen].description} checkpoint, "
                                  f"which {keyword}={chosen.value!r} asks for; pass the format "
                                  "it is, or leave it out to detect it")
        return chosen
    found: list[CheckpointFormat] = []
    problems: dict[CheckpointFormat, str] = {}
    for form, spec in FORMATS.items():
        try:
            if spec.detect(where):
                found.append(form)
        except CheckpointError as exc:
            problems[form] = str(exc)
    if len(found) == 1 and not problems:
        return found[0]
    if len(found) + len(problems) > 1:
        seen = [f.value if f not in problems else f"{f.value}: {problems[f]}"
                for f in FORMATS if f in found or f in problems]
        picks = " or ".join(f"{keyword}={f.value!r}" for f in FORMATS
                            if f in found or f in problems)
        raise CheckpointError(f"{where} looks like several checkpoint formats at once "
                              f"({_and(seen)}); pass the one to read ({picks}), or remove the "
                              "stale files")
    if problems:
        raise CheckpointError(next(iter(problems.values())))
    if not where.is_dir():
        raise CheckpointError(f"{where} is a file nvfp4lab does not read as a checkpoint; pass "
                              "the checkpoint folder")
    block = quantization_block(where)
    method = None if block is None else block.get("quant_method")
    if method is not None:
        accepted = _and([spec.description for spec in FORMATS.values()])
        raise CheckpointError(
            f"{where / CONFIG_NAME}: quantization_config.quant_method is {method!r}; nvfp4lab "
            f"reads {accepted} checkpoints"
        )
    if not (where / CONFIG_NAME).is_file():
        raise CheckpointError(f"{where} has no {CONFIG_NAME}: not a checkpoint folder")
    others = sorted(checkpoint_files())
    missing = f" and there is no {' or '.join(others)}" if others else ""
    raise CheckpointError(
        f"{where / CONFIG_NAME} has no quantization_config{missing}: not a quantized "
        "checkpoint (a float model?)"
    )
