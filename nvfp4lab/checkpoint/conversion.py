"""Lossless conversion between NVFP4 checkpoint formats (any two of
:data:`nvfp4lab.checkpoint.formats.FORMATS`).

:func:`convert` streams: it reads only the safetensors headers, then writes each output shard
tensor by tensor, copying every unchanged tensor's bytes file to file in bounded chunks (packed
codes, E4M3 block scales, biases, embeddings, norms: all byte-identical), so memory stays small
whatever the checkpoint size, and no model is built. Shards are converted in parallel
(:func:`nvfp4lab.checkpoint.stream.run_tasks`: local processes or a Dask cluster). Per quantized
Linear only the names and the tensor scales change; each format's spec says both (its ``names``,
and ``from_disk`` / ``to_disk`` between its convention on disk and nvfp4lab's in-memory ENCODE
scale). Codes ``[N, K/2]`` and block scales ``[N, K/16]`` keep their bytes under the new names;
a tensor scale stored ENCODE (2688/amax) by one format and DECODE (amax/2688) by the other
converts by its float32 reciprocal, ``fl32(1/x)``, and takes the target's scalar shape.

The float32 reciprocal is not an exact involution: for some
values ``x``, ``fl(1/fl(1/x)) != x`` (about 14% of random float32 values), so a round trip
CT -> ModelOpt -> CT changes those scales by one ulp. :class:`ConvertReport` counts and names
them. The folder is written atomically (a temporary sibling renamed into place) with the
overwrite rules of :func:`~nvfp4lab.checkpoint.writer.save_pretrained`.

Everything in ``src`` that is not a weight is copied byte for byte, as ``save_pretrained``
users expect (README, custom modelling code of ``auto_map``, processor configs, sub-folders
such as ``2_Normalize/``): all but the top-level ``*.safetensors`` files, their index,
``config.json`` (rewritten) and the formats' quantization config files (written anew). A
symlink to a file is copied as the file it points to (a Hugging Face cache snapshot is made of
them); a symlink to a folder, or a dangling one, is refused; hidden folders (``.git``,
``.cache``) are left out.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nvfp4lab.checkpoint.files import (
    CONFIG_NAME,
    WEIGHTS_INDEX_NAME,
    CheckpointError,
    StoredTensor,
    Unquantized,
    check_target,
    folder_entries,
    read_json,
    write_safetensors,
)
from nvfp4lab.checkpoint.formats import FORMATS, CheckpointFormatSpec, format_spec
from nvfp4lab.checkpoint.stream import Inventory, TensorInfo, inventory, read_scalar, run_tasks
from nvfp4lab.checkpoint.validation import input_problems, weight_problems
from nvfp4lab.checkpoint.writer import CHECKPOINT_FILES, write_atomically
from nvfp4lab.vocab import CheckpointFormat, Scheme

__all__ = ["ConvertReport", "convert", "reciprocal_round_trips"]


@dataclass(frozen=True)
class ConvertReport:
    """What :func:`convert` did: the formats, ``tensors`` written, ``scales`` converted (tensor
    scales, weight and input) and ``not_round_trip``: the output names of the converted scales
    whose float32 reciprocal does not give back the input value exactly (``fraction``)."""

    src: Path
    dst: Path
    src_format: str
    dst_format: str
    tensors: int
    scales: int
    not_round_trip: tuple[str, ...] = field(default=())
    copied: tuple[str, ...] = field(default=())

    @property
    def fraction(self) -> float:
        return len(self.not_round_trip) / self.scales if self.scales else 0.0

    def summary(self) -> str:
        return (
            f"{self.src} ({self.src_format}) -> {self.dst} ({self.dst_format}): {self.tensors} "
            f"tensors, {self.scales} tensor scales converted by their float32 reciprocal, "
            f"{len(self.not_round_trip)} of them ({100 * self.fraction:.1f}%) do not round-trip "
            f"exactly (1/(1/x) != x); {len(self.copied)} other files copied byte for byte"
        )


def _f32(value: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def _reciprocal(value: float) -> float:
    """float32 ``1/x`` of a float32 ``x`` (exact division rounded once to float32)."""
    return _f32(1.0 / value)


def reciprocal_round_trips(value: float) -> bool:
    """Whether the float32 ``value`` comes back exactly from ``1/(1/value)`` in float32."""
    x = _f32(value)
    return _reciprocal(_reciprocal(x)) == x


@dataclass(frozen=True)
class _ShardTask:
    """Convert one shard: its tensors in byte order, the output path and the formats."""

    tensors: tuple[TensorInfo, ...]
    layers: frozenset[str]
    out: Path
    src_format: CheckpointFormat
    dst_format: CheckpointFormat
    metadata: dict[str, str]


def _convert_scale(value: float, src: CheckpointFormatSpec, dst: CheckpointFormatSpec) -> float:
    """A stored float32 tensor scale of ``src`` as ``dst`` stores it (through nvfp4lab's
    in-memory convention: ``src.from_disk`` then ``dst.to_disk``)."""
    stored = torch.tensor([value], dtype=torch.float32)
    return float(dst.to_disk(*src.from_disk(stored)).reshape(()))


def _rename(key: str, layers: frozenset[str], src: CheckpointFormat,
            dst: CheckpointFormat) -> tuple[str, str | None]:
    """(new key, role) of ``key``: role is "global"/"input" for a tensor scale, "packed"/"scale"
    for the codes and block scales, None for an unquantized tensor."""
    prefix, _, leaf = key.rpartition(".")
    if prefix in layers:
        old, new = format_spec(src).names.roles(), format_spec(dst).names.roles()
        for role, name in old.items():
            if leaf == name:
                return f"{prefix}.{new[role]}", role
    return key, None


def _convert_shard(task: _ShardTask) -> tuple[str, dict[str, str], list[str], int]:
    """Write one output shard; returns (file name, new key -> file name, keys of scales that
    do not round-trip, scales converted)."""
    out: list[StoredTensor] = []
    bad: list[str] = []
    scales = 0
    src, dst = format_spec(task.src_format), format_spec(task.dst_format)
    shape = dst.names.scalar_shape
    for info in task.tensors:
        key, role = _rename(info.key, task.layers, task.src_format, task.dst_format)
        if role in ("global", "input"):
            value = read_scalar(info)
            new = _convert_scale(value, src, dst)
            scales += 1
            if _convert_scale(new, dst, src) != _f32(value):
                bad.append(key)
            out.append(StoredTensor(key, "F32", shape, 4, struct.pack("<f", new)))
        else:
            out.append(StoredTensor(key, info.dtype, info.shape, info.nbytes,
                                    (info.file, info.offset)))
    write_safetensors(task.out, out, task.metadata)
    name = task.out.name
    return name, {t.name: name for t in out}, bad, scales


def _check_layers(inv: Inventory, stores_input: bool) -> None:
    """Every quantized layer must pass the shared validator
    (:mod:`~nvfp4lab.checkpoint.validation`: codes, block scales, tensor scale, and an input
    scale exactly when the scheme stores one); checked for all before anything is written."""
    names = format_spec(inv.fmt).names
    for layer in inv.layers:
        problems = weight_problems(layer, names, inv.tensors)
        problems += input_problems(layer, names, inv.tensors, stores_input)
        if problems:
            info = inv.tensors[f"{layer}.{names.global_scale}"]
            raise CheckpointError(f"{info.file}: layer {layer!r}: {problems[0]}; nothing was "
                                  "converted")


def _excluded(inv: Inventory) -> list[str]:
    """Unquantized modules with a 2-D floating ``weight`` (Linear, Embedding), from the tensor
    names alone (:attr:`~nvfp4lab.checkpoint.files.Unquantized.weights`)."""
    layers = set(inv.layers)
    return sorted(
        key.removesuffix(".weight")
        for key, info in inv.tensors.items()
        if key.endswith(".weight") and len(info.shape) == 2
        and info.dtype in ("F32", "F16", "BF16") and key.removesuffix(".weight") not in layers
    )


def _write_configs(inv: Inventory, dst: CheckpointFormatSpec, scheme: Scheme,
                   unquantized: Unquantized, tmp: Path) -> None:
    """The source's ``config.json`` without its quantization config, then ``dst``'s."""
    data = read_json(inv.directory / CONFIG_NAME)
    data.pop("quantization_config", None)
    (tmp / CONFIG_NAME).write_text(json.dumps(data, indent=2), encoding="utf-8")
    dst.write_config(tmp, scheme, unquantized)


def _write_index(inv: Inventory, tmp: Path, weight_map: dict[str, str]) -> None:
    if not inv.indexed:
        return
    index = read_json(inv.directory / WEIGHTS_INDEX_NAME)
    meta = index.get("metadata") if isinstance(index.get("metadata"), dict) else {}
    meta["total_size"] = sum(t.nbytes for t in inv.tensors.values())
    body = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / WEIGHTS_INDEX_NAME).write_text(json.dumps(body, indent=2), encoding="utf-8")


def _side_files(src: Path) -> list[tuple[Path, str]]:
    """What :func:`convert` copies from ``src`` (see the module docstring): (relative path,
    "file" or "empty folder"), a symlink to a file as a file."""
    skip = {CONFIG_NAME, WEIGHTS_INDEX_NAME, *(f for spec in FORMATS.values()
                                               for f in spec.config_files)}
    out: list[tuple[Path, str]] = []
    for rel, kind in folder_entries(src):
        top = rel.parts[0]
        if (len(rel.parts) == 1 and (top in skip or rel.suffix == ".safetensors")) or (
                top.startswith(".") and (len(rel.parts) > 1 or kind == "empty folder")):
            continue
        if kind == "symlink":
            if (src / rel).is_dir() or not (src / rel).exists():
                raise CheckpointError(
                    f"{src / rel} is a symlink to a folder or to nothing; convert copies files, "
                    "never linked folders: replace it with a copy or remove it")
            kind = "file"
        out.append((rel, kind))
    return out


def _check_paths(src: Path, dst: Path, overwrite: bool) -> list[tuple[Path, str]]:
    if not src.exists():
        raise FileNotFoundError(f"checkpoint folder {src} does not exist")
    s, d = src.resolve(), dst.resolve()
    if s == d or d.is_relative_to(s) or s.is_relative_to(d):
        raise CheckpointError(f"the destination {dst} overlaps the source {src}; convert to "
                              "a folder outside it")
    side = _side_files(src) if src.is_dir() else []
    check_target(dst, overwrite, _members(side))
    return side


def _members(side: list[tuple[Path, str]]) -> frozenset[str]:
    """What ``overwrite=True`` may replace in the destination: checkpoint files and whatever
    convert copies from the source."""
    return CHECKPOINT_FILES | {rel.as_posix() for rel, _ in side}


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: str,
    overwrite: bool = False,
    workers: int | None = None,
    dask: str | None = None,
    progress: bool = False,
) -> ConvertReport:
    """Convert the NVFP4 checkpoint ``src`` to ``format`` (a
    :class:`~nvfp4lab.vocab.CheckpointFormat`) in the new folder ``dst``; returns a
    :class:`ConvertReport`.

    Codes and block scales (and every unquantized tensor) are copied byte for byte; tensor
    scales convert by their float32 reciprocal (see the module docstring). The shard layout and
    the index are kept; every other file of ``src`` is copied byte for byte (sub-folders too;
    see the module docstring). ``dst`` may be missing or an empty folder; ``overwrite=True``
    replaces a folder holding only checkpoint files and files copied from ``src`` (anything
    else, symlinks and empty folders included, is refused with FileExistsError, also when it
    appears while converting). ``workers`` / ``dask`` / ``progress``: where shards
    are converted (:func:`~nvfp4lab.checkpoint.stream.run_tasks`). Converting to the format
    ``src`` already has is an error.
    """
    dst_spec = format_spec(format)
    target_format = dst_spec.format
    source, target = Path(src), Path(dst)
    side = _check_paths(source, target, overwrite)
    inv = inventory(source)
    if inv.fmt == target_format:
        raise CheckpointError(f"{source} is already a {inv.fmt.value} checkpoint; nothing to "
                              "convert (copy the folder instead)")
    if not inv.layers:
        raise CheckpointError(f"{source}: no quantized layer found in the weight files")
    src_config = format_spec(inv.fmt).read_config(inv.directory)
    scheme = src_config.checkpoint_scheme()
    _check_layers(inv, scheme == Scheme.NVFP4)
    unquantized = Unquantized(src_config.unquantized, tuple(_excluded(inv)))
    layers = frozenset(inv.layers)
    result: dict[str, Any] = {}

    def write(tmp: Path) -> None:
        # absolute: a Dask worker runs in a folder of its own
        tasks = [_ShardTask(tuple(inv.in_file(f)), layers, tmp.absolute() / f.name, inv.fmt,
                            target_format, inv.metadata[f]) for f in inv.files]
        done = run_tasks(_convert_shard, tasks, workers=workers, dask=dask, progress=progress,
                         desc=f"convert to {target_format.value}")
        weight_map = {k: v for _, keys, _, _ in done for k, v in keys.items()}
        result["bad"] = tuple(k for _, _, bad, _ in done for k in bad)
        result["scales"] = sum(n for *_, n in done)
        result["tensors"] = len(weight_map)
        _write_index(inv, tmp, weight_map)
        _write_configs(inv, dst_spec, scheme, unquantized, tmp)
        for rel, kind in side:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            if kind == "file":
                shutil.copy2(source / rel, tmp / rel)
            else:
                (tmp / rel).mkdir()

    write_atomically(target, write, overwrite=overwrite, checkpoint_files=_members(side))
    return ConvertReport(source, target, inv.fmt.value, target_format.value, result["tensors"],
                         result["scales"], result["bad"], tuple(rel.as_posix() for rel, _ in side))
