"""Lossless conversion between NVFP4 checkpoint formats (any two of
:data:`nvfp4lab.checkpoint.formats.FORMATS`).

:func:`convert` streams: it reads only the weight files' headers (the source format's
``read_weights``), then the target format writes the new checkpoint tensor by tensor from those
locations (its ``write_checkpoint``), copying every unchanged tensor's bytes file to file in
bounded chunks (packed codes, E4M3 block scales, biases, embeddings, norms: all byte-identical)
or, where one of the two formats lays them out differently (GGUF's NVFP4 blocks), reading and
repacking them a few rows at a time, so memory stays small whatever the checkpoint size, and no
model is built. Safetensors shards are written in parallel
(:func:`nvfp4lab.checkpoint.stream.run_tasks`: local processes or a Dask cluster); a GGUF file is
one file, written in this process, a chunk of rows at a time (about 64 MiB of output rows,
``formats.gguf.CHUNK_BYTES``, and a few times that in temporaries while repacking). Per quantized
Linear only the names, the layout and the tensor scales change; each format's spec says all
three (its ``names``, its container, and ``from_disk`` / ``to_disk`` between its scale form on
disk and nvfp4lab's in-memory ENCODE scale). Codes ``[N, K/2]`` and block scales ``[N, K/16]``
keep their values and their bytes (GGUF: the four scale bytes of each 64-element block
unchanged, the codes repacked, LLaMA's q/k rows permuted whole); a tensor scale stored ENCODE
(2688/amax) by one format and DECODE (amax/2688) by the other
converts by its float32 reciprocal, ``fl32(1/x)``, and takes the
target's scalar shape. A layer of a format whose tensor scale is optional (a "naive" GGUF
tensor without ``.scale``) gets tensor scale 1, the value it decodes with.

The float32 reciprocal is not an exact involution: for some
values ``x``, ``fl(1/fl(1/x)) != x`` (about 14% of random float32 values), so a round trip
CT -> ModelOpt -> CT changes those scales by one ulp. :class:`ConvertReport` counts and names
them. The folder is written atomically (a temporary sibling renamed into place) with the
overwrite rules of :func:`~nvfp4lab.checkpoint.writer.save_pretrained`.

Everything in a source folder that is not a weight is copied byte for byte, as
``save_pretrained`` users expect (README, custom modelling code of ``auto_map``, processor
configs, sub-folders such as ``2_Normalize/``): all but the top-level ``*.safetensors`` and
``*.gguf`` files (a ``.gguf`` beside a compressed-tensors checkpoint read with
``source_format=`` would make the output two formats again), the source's weight files,
their index, ``config.json``
(rewritten) and the formats' quantization config files (written anew); hidden folders
(``.git``, ``.cache``) are left out.
Before anything is read or written, every entry of the source folder is checked with the one rule
of :func:`~nvfp4lab.checkpoint.folders.unsafe_entries`: a symlink is copied as the file it points
to only when that file lies inside the folder or, for a Hugging Face cache snapshot
(``models--*/snapshots/<rev>``, which is made of links ``../../blobs/<hash>``), in its
repository's ``blobs/``; a link elsewhere (``README.md -> /etc/hostname``: a local file pulled
into a folder the user may upload), a FIFO, a device, a linked folder, a dangling link or a link
loop is refused, all of them listed in one error. A source that is one file (a ``.gguf`` file)
has nothing else to copy; a Hugging Face cache ``models--*`` folder is read at the snapshot its
``refs/main`` names.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nvfp4lab.checkpoint.folders import check_target, folder_entries, hf_snapshot
from nvfp4lab.checkpoint.formats import FORMATS, CheckpointFormatSpec, detect_format, format_spec
from nvfp4lab.checkpoint.formats.gguf import SUFFIX as GGUF_SUFFIX
from nvfp4lab.checkpoint.formats.transforms import refuse_conversion, write_transform_config
from nvfp4lab.checkpoint.kv_scales import convert_kv_shard, kv_cache_names, kv_cache_refusal
from nvfp4lab.checkpoint.mixed_layers import stored_kind
from nvfp4lab.checkpoint.records import (
    Contents,
    Shard,
    StoredTensor,
    TaskRunner,
    TensorInfo,
    Unquantized,
)
from nvfp4lab.checkpoint.refusals import (
    CheckpointError,
    block_scale_error,
    read_json,
    tensor_scale_error,
)
from nvfp4lab.checkpoint.rows import RowReader
from nvfp4lab.checkpoint.safetensors_files import (
    CONFIG_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    check_readable,
)
from nvfp4lab.checkpoint.stream import (
    Inventory,
    check_workers,
    inventory,
    read_scalar,
    run_tasks,
)
from nvfp4lab.checkpoint.validation import input_problems, weight_problems
from nvfp4lab.checkpoint.writer import CHECKPOINT_FILES, write_atomically
from nvfp4lab.vocab import Scheme

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
    through_model: bool = False  #: a mixed checkpoint, loaded and saved through the model

    @property
    def fraction(self) -> float:
        return len(self.not_round_trip) / self.scales if self.scales else 0.0

    def summary(self) -> str:
        if self.through_model:
            return (f"{self.src} ({self.src_format}) -> {self.dst} ({self.dst_format}): a mixed-"
                    f"precision checkpoint, loaded and saved through the model in memory "
                    f"(every layer's bytes kept), {self.tensors} tensors")
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


def _convert_scale(value: float, src: CheckpointFormatSpec, dst: CheckpointFormatSpec) -> float:
    """A stored float32 tensor scale of ``src`` as ``dst`` stores it (through nvfp4lab's
    in-memory form: ``src.from_disk`` then ``dst.to_disk``)."""
    stored = torch.tensor([value], dtype=torch.float32)
    return float(dst.to_disk(*src.from_disk(stored)).reshape(()))


def _rename(key: str, layers: frozenset[str], src: CheckpointFormatSpec,
            dst: CheckpointFormatSpec) -> tuple[str, str | None]:
    """(new key, role) of ``key``: role is "global"/"input" for a tensor scale, "packed"/"block"
    for the codes and block scales, None for an unquantized tensor."""
    prefix, _, leaf = key.rpartition(".")
    if prefix in layers:
        old, new = src.names.roles(), dst.names.roles()
        for role, name in old.items():
            if leaf == name:
                return f"{prefix}.{new[role]}", role
    return key, None


@dataclass
class _Scales:
    """The tensor scales converted so far and the names of those whose reciprocal does not
    round-trip."""

    count: int = 0
    bad: list[str] = field(default_factory=list)

    def stored(self, key: str, value: float, src: CheckpointFormatSpec,
               dst: CheckpointFormatSpec) -> StoredTensor:
        new = _convert_scale(value, src, dst)
        self.count += 1
        if _convert_scale(new, dst, src) != _f32(value):
            self.bad.append(key)
        shape = dst.names.scalar_shape
        return StoredTensor(key, "F32", shape, 4, struct.pack("<f", new))


def _convert_shard(inv: Inventory, file: Path, src: CheckpointFormatSpec,
                   dst: CheckpointFormatSpec, scales: _Scales) -> Shard:
    """The output tensors of one source weight file, in its byte order: every tensor renamed,
    tensor scales converted (their values only are read), everything else to be copied from
    where it lies; a layer without a tensor scale (allowed by ``src``) gets 1."""
    layers = frozenset(inv.layers)
    out: list[StoredTensor] = []
    for key, info in inv.tensors.items():
        if info.file != file:
            continue
        new, role = _rename(key, layers, src, dst)
        if role in ("global", "input"):
            value = read_scalar(info)
            problem = tensor_scale_error(info.file, key, value, src.names)  # load's refusal
            if problem is not None:
                raise CheckpointError(f"{problem}; nothing was converted (nvfp4lab audit lists "
                                      "every such layer)")
            out.append(scales.stored(new, value, src, dst))
            continue
        out.append(StoredTensor(new, info.dtype, info.shape, info.nbytes, info))
        prefix = key.rpartition(".")[0]
        if role == "block" and f"{prefix}.{src.names.tensor_scale}" not in inv.tensors:
            out.append(scales.stored(f"{prefix}.{dst.names.tensor_scale}", 1.0, src, dst))
    name = file.name if file.suffix == ".safetensors" else WEIGHTS_NAME
    return Shard(name, tuple(out), inv.metadata.get(file) or {"format": "pt"})


#: Rows of block scales read at a time by convert's check (16 MiB at K = 2**20 elements per row).
SCALE_ROWS = 256


def _check_layers(inv: Inventory, stores_input: bool) -> None:
    """Every quantized layer must pass the shared validator
    (:mod:`~nvfp4lab.checkpoint.validation`: codes, block scales, tensor scale, and an input
    scale exactly when the scheme stores one); checked for all before anything is written."""
    spec = format_spec(inv.fmt)
    names = spec.names
    optional = spec.optional_tensor_scale is not None
    for layer in inv.layers:
        problems = weight_problems(layer, names, inv.tensors, tensor_scale_optional=optional)
        problems += input_problems(layer, names, inv.tensors, stores_input)
        if problems:
            info = inv.tensors.get(f"{layer}.{names.tensor_scale}") or inv.tensors.get(
                f"{layer}.{names.block_scale}")
            where = info.file if info is not None else inv.directory
            raise CheckpointError(f"{where}: layer {layer!r}: {problems[0]}; nothing was "
                                  "converted")
    for layer in inv.layers:
        _check_block_scales(inv.tensors[f"{layer}.{names.block_scale}"])


def _check_block_scales(info: TensorInfo) -> None:
    """Load's refusal of NaN or negative block scales (:func:`files.block_scale_error`), read
    :data:`SCALE_ROWS` rows at a time from the memory-mapped file (a layer's block scales are
    1/16 of its elements: N·K/16 bytes), before anything is written. ``info``: a block-scale
    tensor the validator passed, so 2-D with N >= 1 rows."""
    with RowReader(info) as reader:
        for start in range(0, info.shape[0], SCALE_ROWS):
            rows = reader.rows(start, start + SCALE_ROWS)
            problem = block_scale_error(info.file, info.key, rows, first_row=start)
            if problem is not None:
                raise CheckpointError(f"{problem}; nothing was converted (nvfp4lab audit lists "
                                      "every such layer)")


def _excluded(inv: Inventory) -> list[str]:
    """Unquantized modules with a 2-D floating ``weight`` (Linear, Embedding), from the tensor
    names alone (:attr:`~nvfp4lab.checkpoint.records.Unquantized.weights`)."""
    layers = set(inv.layers)
    return sorted(
        key.removesuffix(".weight")
        for key, info in inv.tensors.items()
        if key.endswith(".weight") and len(info.shape) == 2
        and info.dtype in ("F32", "F16", "BF16") and key.removesuffix(".weight") not in layers
    )


def _config_json(spec: CheckpointFormatSpec, path: Path) -> str:
    """The source's transformers config without its quantization config."""
    data = spec.model_config(path)
    data.pop("quantization_config", None)
    return json.dumps(data, indent=2)


def _index_metadata(inv: Inventory) -> dict[str, Any]:
    if not inv.indexed:
        return {}
    index = read_json(inv.directory / WEIGHTS_INDEX_NAME)
    meta = index.get("metadata")
    return dict(meta) if isinstance(meta, dict) else {}


def _hidden(rel: Path, kind: str) -> bool:
    """An entry of a hidden folder (``.git/...``) or a hidden empty folder: never copied."""
    return rel.parts[0].startswith(".") and (len(rel.parts) > 1 or kind == "empty folder")


def _check_source(src: Path) -> None:
    """Refuse a source folder holding anything convert must not read or copy, listing every
    such entry (:func:`~nvfp4lab.checkpoint.safetensors_files.check_readable`); hidden folders
    are not read."""
    check_readable(src, [rel for rel, kind in folder_entries(src)
                         if kind != "empty folder" and not _hidden(rel, kind)])


def _side_files(src: Path, weights: Sequence[Path]) -> list[tuple[Path, str]]:
    """What :func:`convert` copies from ``src`` (see the module docstring): (relative path,
    "file" or "empty folder"), a symlink (checked by :func:`_check_source`) as a file."""
    skip = {WEIGHTS_INDEX_NAME, *(f for spec in FORMATS.values() for f in spec.config_files),
            *(p.name for p in weights), CONFIG_NAME}
    out: list[tuple[Path, str]] = []
    for rel, kind in folder_entries(src):
        top = rel.parts[0]
        if (len(rel.parts) == 1 and (top in skip or rel.suffix == ".safetensors"
                                     or rel.suffix.lower() == GGUF_SUFFIX)) or _hidden(rel, kind):
            continue
        out.append((rel, "file" if kind == "symlink" else kind))
    return out


def _check_overlap(src: Path, dst: Path) -> None:
    if not src.exists():
        raise FileNotFoundError(f"checkpoint folder {src} does not exist")
    s, d = src.resolve(), dst.resolve()
    if s == d or d.is_relative_to(s) or s.is_relative_to(d):
        raise CheckpointError(f"the destination {dst} overlaps the source {src}; convert to "
                              "a folder outside it")


def _members(side: list[tuple[Path, str]]) -> frozenset[str]:
    """What ``overwrite=True`` may replace in the destination: checkpoint files and whatever
    convert copies from the source."""
    return CHECKPOINT_FILES | {rel.as_posix() for rel, _ in side}


def _write_weights(tmp: Path, spec: CheckpointFormatSpec, contents: Contents,
                   run: TaskRunner) -> list[str]:
    """The target format writes the converted checkpoint into ``tmp``."""
    return spec.write_checkpoint(tmp, contents, run)


def _copy_side_files(source: Path, tmp: Path, side: list[tuple[Path, str]]) -> None:
    for rel, kind in side:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        if kind == "file":
            shutil.copy2(source / rel, tmp / rel)
        else:
            (tmp / rel).mkdir()


def _kv_cache(config: Any, src: CheckpointFormatSpec, dst: CheckpointFormatSpec) -> str | None:
    """The KV cache kind the source declares (None without one); CheckpointError when the
    target format cannot hold it (or the source's kind is one vLLM 0.33 does not run)."""
    kind = getattr(config, "kv_cache", None)
    if kind is None:
        return None
    reason = kv_cache_refusal(dst, kind)
    if reason is not None:
        raise CheckpointError(f"the source declares an {kind} KV cache and {reason}; nothing "
                              "was converted")
    return kind


def _kv_shards(shards: tuple[Shard, ...], kind: str | None, src: CheckpointFormatSpec,
               dst: CheckpointFormatSpec) -> tuple[Shard, ...]:
    """The shards with the KV scales under the target's names and shape (values kept)."""
    src_names, dst_names = kv_cache_names(src), kv_cache_names(dst)
    if kind is None or src_names is None or dst_names is None:
        return shards
    return tuple(convert_kv_shard(shard, src_names, dst_names) for shard in shards)


def _mixed(inv: Inventory) -> bool:
    """Whether the checkpoint holds layers in another format than NVFP4, from the headers
    (:func:`~nvfp4lab.checkpoint.mixed_layers.stored_kind`: FP8, Q8_0 or MXFP4 weights)."""
    return any(stored_kind(key, inv.tensors) is not None for key in inv.tensors)


def _convert_mixed(source: Path, target: Path, src_format: str, dst_format: str,
                   overwrite: bool) -> ConvertReport:
    """A mixed-precision checkpoint converted through the model: :func:`~nvfp4lab.checkpoint.
    reader.load` (every layer byte for byte) then :func:`~nvfp4lab.checkpoint.writer.
    save_pretrained` to ``dst_format``, whose refusals apply (a layer the target cannot
    declare: FP8 W8A16 or MXFP4 in ModelOpt, FP8 in GGUF, Q8_0 outside GGUF) before anything is
    written. The whole model is held in memory."""
    from nvfp4lab.checkpoint.reader import load
    from nvfp4lab.checkpoint.writer import save_pretrained

    try:
        model = load(source, format=src_format)
        path = save_pretrained(model, target, format=dst_format, source=source,
                               overwrite=overwrite)
    except ValueError as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{source}: cannot convert this mixed-precision checkpoint to "
                              f"{dst_format}: {exc}") from exc
    tensors = len(inventory(path, dst_format).tensors)
    return ConvertReport(source, path, src_format, dst_format, tensors, 0, through_model=True)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: str,
    source_format: str | None = None,
    overwrite: bool = False,
    workers: int | None = None,
    dask: str | None = None,
    progress: bool = False,
) -> ConvertReport:
    """Convert the NVFP4 checkpoint ``src`` (a folder, a ``.gguf`` file or a Hugging Face cache
    ``models--*`` folder) to ``format`` (a :class:`~nvfp4lab.vocab.CheckpointFormat`) in the new
    folder ``dst``; returns a :class:`ConvertReport`. ``source_format``: the format to read
    ``src`` as (default: detected, :func:`~nvfp4lab.checkpoint.formats.detect_format`; needed
    where a folder holds several, such as a compressed-tensors folder with a ``.gguf`` file).

    Codes and block scales keep their values and bytes (repacked where a format lays them out
    in other blocks: GGUF), every unquantized tensor is copied byte for byte (GGUF writes 1-D
    ones as F32, which is exact); tensor scales convert by their float32 reciprocal (see the
    module docstring). Between safetensors formats the shard layout and the index are kept;
    every other file of a source folder is copied byte for byte (sub-folders too; see the module
    docstring). A quantized KV cache is carried: its kind into the target's configuration,
    each layer's float32 k / v DECODE scales renamed and reshaped to the target's names with the
    same values (both safetensors formats store the DECODE form); a target that cannot hold it
    (GGUF; an NVFP4 cache in compressed-tensors) is refused. A mixed-precision checkpoint (FP8,
    MXFP4 or Q8_0 layers beside the NVFP4 ones) converts through the model instead
    (:func:`_convert_mixed`: in memory; the target's refusals apply). ``dst`` may be missing or
    an empty folder; ``overwrite=True`` replaces a folder
    holding only checkpoint files and files copied from ``src`` (anything else, symlinks and
    empty folders included, is refused with FileExistsError, also when it appears while
    converting). ``workers`` / ``dask`` / ``progress``: where safetensors shards are written
    (:func:`~nvfp4lab.checkpoint.stream.run_tasks`). Converting to the format ``src`` already
    has is an error. A compressed-tensors source whose ``transform_config`` rotates inputs online
    is refused for ModelOpt and GGUF, which hold no rotation
    (:mod:`~nvfp4lab.checkpoint.formats.transforms`).
    """
    dst_spec = format_spec(format)
    target_format = dst_spec.format
    check_workers(workers)
    if not dst_spec.writes_in_tasks and (dask is not None or workers):
        raise ValueError(
            f"{dst_spec.title} is written in this process: workers and dask (--workers, --dask) "
            "apply to the safetensors formats only; leave them out"
        )
    source, target = hf_snapshot(Path(src)), Path(dst)
    _check_overlap(source, target)
    if source.is_dir():
        _check_source(source)  # links out of the folder, devices, FIFOs: before anything is read
    inv = inventory(source, detect_format(source, source_format, keyword="source_format"))
    side = _side_files(source, inv.files) if source.is_dir() else []
    check_target(target, overwrite, _members(side))
    if inv.fmt == target_format:
        raise CheckpointError(f"{source} is already a {inv.fmt.value} checkpoint; nothing to "
                              "convert (copy the folder instead)")
    if _mixed(inv):
        return _convert_mixed(source, target, inv.fmt.value, target_format.value, overwrite)
    if not inv.layers:
        raise CheckpointError(f"{source}: no quantized layer found in the weight files")
    src_spec = format_spec(inv.fmt)
    src_config = src_spec.read_config(source)
    refuse_conversion(source, inv.fmt, target_format)  # a rotation the target cannot hold
    own = getattr(src_spec, "rotation_config", None)  # a format storing rotations its own way
    transforms = None if own is None else own(source, target_format)
    scheme = src_config.checkpoint_scheme()
    _check_layers(inv, scheme == Scheme.NVFP4)
    unquantized = Unquantized(src_config.unquantized, tuple(_excluded(inv)))
    scales = _Scales()
    kv_kind = _kv_cache(src_config, src_spec, dst_spec)
    shards = tuple(_convert_shard(inv, f, src_spec, dst_spec, scales) for f in inv.files)
    shards = _kv_shards(shards, kv_kind, src_spec, dst_spec)
    contents = Contents(shards, _config_json(src_spec, source), scheme, unquantized,
                        index=inv.indexed, index_metadata=_index_metadata(inv), source=source,
                        kv_cache=kv_kind)
    run = functools.partial(run_tasks, workers=workers, dask=dask, progress=progress,
                            desc=f"convert to {target_format.value}")

    def write(tmp: Path) -> None:
        _write_weights(tmp, dst_spec, contents, run)
        if transforms is not None:  # the source's rotations as a compressed-tensors config
            write_transform_config(tmp, transforms)
        _copy_side_files(source, tmp, side)

    write_atomically(target, write, overwrite=overwrite, checkpoint_files=_members(side))
    return ConvertReport(source, target, inv.fmt.value, target_format.value,
                         sum(1 for _ in contents.tensors()), scales.count, tuple(scales.bad),
                         tuple(rel.as_posix() for rel, _ in side))
