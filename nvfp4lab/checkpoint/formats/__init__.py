"""The checkpoint formats: one module each, one interface, one registry.

==========================  =================================================================
module                      holds
==========================  =================================================================
``compressed_tensors``      compressed-tensors NVFP4 (ENCODE tensor scales)
``modelopt``                NVIDIA ModelOpt 0.47 ``export_hf_checkpoint`` (DECODE tensor scales)
==========================  =================================================================

Each module defines a class with the members of :class:`CheckpointFormatSpec` and one instance
of it, ``SPEC``; :data:`FORMATS` maps every :class:`nvfp4lab.vocab.CheckpointFormat` member to
its spec. ``writer``, ``reader``, ``conversion``, ``auditing`` and ``stream`` only look specs up
here (:func:`format_spec`) and call them; no other module knows a format's names or files.
The format modules import only :mod:`nvfp4lab.checkpoint.files` (and numerics / vocab), never
this registry, the writer or the reader. Adding a format: ``docs/architecture.md``, "How to add a
checkpoint format".
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from nvfp4lab.checkpoint.files import (
    CONFIG_NAME,
    CheckpointError,
    LayerNames,
    Unquantized,
    quantization_block,
)
from nvfp4lab.checkpoint.formats import compressed_tensors, modelopt
from nvfp4lab.vocab import CheckpointFormat, Scheme, check_choice

__all__ = [
    "FORMATS",
    "LAYER_NAMES",
    "CheckpointFormatSpec",
    "FormatConfig",
    "checkpoint_files",
    "detect_format",
    "format_spec",
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
    scale convention on disk (:class:`~nvfp4lab.checkpoint.files.LayerNames`: ``decode`` True for
    DECODE amax/2688, False for ENCODE 2688/amax); ``config_files``: the files it writes besides
    ``config.json`` and the weights; ``transformers_needs_bfloat16``: whether transformers runs
    only bfloat16 checkpoints of it (``save_pretrained`` warns otherwise).
    """

    format: CheckpointFormat
    title: str
    description: str
    names: LayerNames
    config_files: tuple[str, ...]
    transformers_needs_bfloat16: bool

    def detect(self, directory: Path) -> bool:
        """Whether the folder's configuration files say it is this format (never the weights);
        CheckpointError for a configuration that claims this format but is not one."""
        ...

    def read_config(self, directory: Path) -> FormatConfig:
        """The folder's configuration, validated (CheckpointError naming the file)."""
        ...

    def write_config(self, folder: Path, scheme: Scheme, unquantized: Unquantized) -> None:
        """Add the quantization config to ``folder/config.json`` (already written without one)
        and write :attr:`config_files`."""
        ...

    def to_disk(self, encode: torch.Tensor, decode: torch.Tensor | None) -> torch.Tensor:
        """A tensor scale as stored (shape ``names.scalar_shape``), from nvfp4lab's in-memory
        float32 ``[1]`` ENCODE scale and, when the layer holds one, its exact DECODE scale."""
        ...

    def from_disk(self, stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(ENCODE scale, exact DECODE scale or None) of a stored float32 ``[1]`` scale."""
        ...

    def fused_decode_scale(self, stored: Sequence[float]) -> torch.Tensor:
        """The one DECODE scale (float32 ``[1]``) vLLM keeps for a fused group (q/k/v,
        gate/up) whose shards store the tensor scales ``stored``."""
        ...


#: Every checkpoint format, by its vocabulary member; detection tries them in this order.
FORMATS: dict[CheckpointFormat, CheckpointFormatSpec] = {
    spec.format: spec for spec in (compressed_tensors.SPEC, modelopt.SPEC)
}
#: The tensor names of each format (kept for callers of the former ``files.LAYER_NAMES``).
LAYER_NAMES: dict[CheckpointFormat, LayerNames] = {f: s.names for f, s in FORMATS.items()}


def format_spec(fmt: object) -> CheckpointFormatSpec:
    """The spec of the checkpoint format ``fmt`` (a member or its string); ValueError
    ``unknown format …; accepted values: …`` otherwise."""
    return FORMATS[check_choice("format", fmt, CheckpointFormat)]  # type: ignore[index]


def checkpoint_files() -> frozenset[str]:
    """The configuration files of every format besides ``config.json``."""
    return frozenset(f for spec in FORMATS.values() for f in spec.config_files)


def _and(items: Sequence[str]) -> str:
    return " and ".join(items) if len(items) < 3 else ", ".join(items[:-1]) + " and " + items[-1]


def detect_format(path: str | Path) -> CheckpointFormat:
    """The format of the checkpoint folder ``path``, from its configuration alone: the one
    format of :data:`FORMATS` whose ``detect`` accepts it.

    Raises :class:`CheckpointError` (or FileNotFoundError for a missing folder) naming what was
    found instead.
    """
    directory = Path(path)
    if not directory.exists():
        raise FileNotFoundError(f"checkpoint folder {directory} does not exist")
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is a file; pass the checkpoint folder")
    found = [fmt for fmt, spec in FORMATS.items() if spec.detect(directory)]
    if len(found) == 1:
        return found[0]
    if found:
        raise CheckpointError(f"{directory} looks like several checkpoint formats at once "
                              f"({_and([f.value for f in found])}); remove the stale config")
    block = quantization_block(directory)
    method = None if block is None else block.get("quant_method")
    if method is not None:
        accepted = _and([spec.description for spec in FORMATS.values()])
        raise CheckpointError(
            f"{directory / CONFIG_NAME}: quantization_config.quant_method is {method!r}; nvfp4lab "
            f"reads {accepted} checkpoints"
        )
    if not (directory / CONFIG_NAME).is_file():
        raise CheckpointError(f"{directory} has no {CONFIG_NAME}: not a checkpoint folder")
    others = sorted(checkpoint_files())
    missing = f" and there is no {' or '.join(others)}" if others else ""
    raise CheckpointError(
        f"{directory / CONFIG_NAME} has no quantization_config{missing}: not a quantized "
        "checkpoint (a float model?)"
    )
