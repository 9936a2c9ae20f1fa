"""The safetensors container the safetensors formats share: ``config.json`` plus shards.

:func:`read_header` reads a safetensors header (the 8-byte little-endian length, then the JSON
table of dtype, shape and byte range per tensor, validated); :func:`safetensors_weights` reads a
folder's headers (and index) into a :class:`~nvfp4lab.checkpoint.records.StoredWeights`;
:func:`write_safetensors` writes a file tensor by tensor, copying unchanged tensors file to file
in bounded chunks (``os.copy_file_range``), so no tensor is ever held whole;
:func:`write_safetensors_checkpoint` writes ``config.json``, the shards and their index.
:class:`SafetensorsContainer` gives a format class these members. Nothing here knows a
checkpoint format: a format reads its own configuration, through :func:`quantization_block`
when it lives in ``config.json``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvfp4lab.checkpoint.folders import (
    LFS_POINTER_NOTE,
    lfs_pointer,
    unsafe_entries,
    unsafe_message,
)
from nvfp4lab.checkpoint.records import (
    Contents,
    StoredTensor,
    StoredWeights,
    TaskRunner,
    TensorInfo,
    Unquantized,
)
from nvfp4lab.checkpoint.refusals import CheckpointError, parse_json, read_json, refuse_pickle
from nvfp4lab.checkpoint.rows import read_rows, tensor_bytes
from nvfp4lab.checkpoint.validation import config_problem, header_problem
from nvfp4lab.vocab import Scheme

__all__ = [
    "CONFIG_NAME",
    "COPY_CHUNK_BYTES",
    "MAX_HEADER_BYTES",
    "PICKLE_SUFFIXES",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "SafetensorsContainer",
    "WeightFiles",
    "check_readable",
    "quantization_block",
    "read_header",
    "safetensors_config",
    "safetensors_weights",
    "weight_files",
    "write_safetensors",
    "write_safetensors_checkpoint",
]

CONFIG_NAME = "config.json"

WEIGHTS_NAME = "model.safetensors"

WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

PICKLE_SUFFIXES: tuple[str, ...] = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def quantization_block(directory: Path) -> dict[str, Any] | None:
    """``config.json``'s ``quantization_config`` object (transformers' place for it), or None
    when the folder has no ``config.json`` or the file has no such key (CheckpointError when
    the key holds anything but an object)."""
    file = directory / CONFIG_NAME
    if not file.is_file():
        return None
    block = read_json(file).get("quantization_config")
    if block is not None and not isinstance(block, dict):
        raise CheckpointError(f"{file}: quantization_config is a {type(block).__name__} "
                              f"({str(block)[:60]}), expected a JSON object")
    return block


@dataclass(frozen=True)
class WeightFiles:
    """The safetensors files of a checkpoint and, when it has an index, its ``weight_map``
    (tensor name -> the file that holds it; the index is the authority)."""

    files: list[Path]
    weight_map: dict[str, Path] | None = None


def check_readable(directory: Path, paths: Sequence[Path]) -> None:
    """Refuse (CheckpointError listing them all) the ``paths`` of the checkpoint folder
    ``directory`` that nvfp4lab must not read: links resolving outside it (but a Hugging Face
    cache snapshot's links into its ``blobs/``) and anything but regular files
    (:func:`~nvfp4lab.checkpoint.folders.unsafe_entries`, the one rule)."""
    found = unsafe_entries(directory, paths)
    if found:
        raise CheckpointError(unsafe_message(directory, found))


def _index_map(directory: Path, index: Path) -> dict[str, Path]:
    """``weight_map`` of ``index`` with every file named inside ``directory`` (links are
    checked by :func:`check_readable`, which lets a Hugging Face cache snapshot's through)."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has no weight_map")
    out: dict[str, Path] = {}
    for key, name in weight_map.items():
        rel = Path(str(name))
        if rel.is_absolute() or os.path.normpath(rel).split(os.sep)[0] in ("..", ".", ""):
            raise CheckpointError(
                f"{index}: weight_map sends {key!r} to {str(name)!r}, outside the checkpoint "
                "folder; a checkpoint's files must lie inside its folder"
            )
        if rel.suffix in PICKLE_SUFFIXES:
            raise refuse_pickle(directory / rel)
        out[str(key)] = directory / os.path.normpath(rel)
    return out


def weight_files(directory: Path) -> WeightFiles:
    """The safetensors files of a checkpoint directory (and its index's map), refusing pickles
    and, with the index, any of them that is a link out of the folder or not a regular file
    (:func:`check_readable`)."""
    index = directory / WEIGHTS_INDEX_NAME
    if os.path.lexists(index):
        check_readable(directory, [index])
        weight_map = _index_map(directory, index)
        files = sorted(set(weight_map.values()))
        check_readable(directory, [f for f in files if os.path.lexists(f)])
        return WeightFiles(files, weight_map)
    single = directory / WEIGHTS_NAME
    found = [single] if os.path.lexists(single) else sorted(directory.glob("*.safetensors"))
    if found:
        check_readable(directory, found)
        return WeightFiles(found)
    pickles = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise refuse_pickle(pickles[0])
    raise CheckpointError(f"{directory} holds no .safetensors weight file")


#: Largest safetensors header accepted (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000


def read_header(file: Path) -> tuple[int, dict[str, Any]]:
    """(byte offset where the data starts, the JSON header) of a safetensors file.

    The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
    (offsets relative to the data start) and may hold ``"__metadata__"``. Nothing else is read.
    The header is validated (:func:`~nvfp4lab.checkpoint.validation.header_problem`: entries,
    dtypes, shapes, byte ranges, overlaps); CheckpointError names the file and tensor.
    """
    try:
        with open(file, "rb") as handle:
            head = handle.read(8)
            size = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < size <= MAX_HEADER_BYTES:
                if lfs_pointer(file):
                    raise CheckpointError(f"{file} {LFS_POINTER_NOTE}")
                raise CheckpointError(f"{file}: not a safetensors file (bad header length)")
            raw = handle.read(size)
    except FileNotFoundError:
        raise CheckpointError(f"{file} is listed in the checkpoint but does not exist") from None
    try:
        header = parse_json(raw, file, "not a safetensors file, its header is")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{file}: not a safetensors file (header: {exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: not a safetensors file (header is not a JSON object)")
    problem = header_problem(header)
    if problem is not None:
        raise CheckpointError(f"{file}: {problem}")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if file.stat().st_size < 8 + size + end:
        raise CheckpointError(
            f"{file}: truncated ({file.stat().st_size} bytes, the header needs {8 + size + end})"
        )
    return 8 + size, header


#: Bytes moved per system call when copying tensors file to file.
COPY_CHUNK_BYTES = 64 * 2**20


def _copy_range(src: Path, offset: int, nbytes: int, out_fd: int) -> None:
    with open(src, "rb", buffering=0) as handle:
        fd = handle.fileno()
        done = 0
        while done < nbytes:
            step = min(COPY_CHUNK_BYTES, nbytes - done)
            try:
                moved = os.copy_file_range(fd, out_fd, step, offset + done)
            except (AttributeError, OSError):  # no copy_file_range here (or across devices)
                chunk = memoryview(os.pread(fd, step, offset + done))
                moved = len(chunk)
                while chunk:
                    chunk = chunk[os.write(out_fd, chunk):]
            if moved <= 0:
                raise CheckpointError(f"{src}: ended early while copying {nbytes} bytes")
            done += moved


def write_safetensors(
    path: Path, tensors: Sequence[StoredTensor], metadata: dict[str, str] | None = None
) -> int:
    """Write ``tensors`` in order as a safetensors file at ``path``; returns the data bytes.

    Memory stays bounded by :data:`COPY_CHUNK_BYTES` whatever the tensor sizes (beyond the
    tensors the caller already holds in memory)."""
    header: dict[str, Any] = {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb", buffering=0) as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        for t in tensors:
            if isinstance(t.data, bytes):
                if len(t.data) != t.nbytes:
                    raise CheckpointError(f"{t.name}: {len(t.data)} bytes given, {t.nbytes} due")
                out.write(t.data)
            elif (stored := t.source()) is not None and stored.view is None:
                _copy_range(stored.file, stored.offset, t.nbytes, out.fileno())
            else:
                _write_rows(t, out)
    return offset


def _write_rows(tensor: StoredTensor, out: Any) -> None:
    """Write a tensor held in memory or read through a view, :data:`COPY_CHUNK_BYTES` at a
    time."""
    rows = tensor.shape[0] if tensor.shape else 1
    step = max(1, COPY_CHUNK_BYTES // max(tensor.nbytes // max(rows, 1), 1))
    written = 0
    for start in range(0, rows, step) if tensor.shape else (0,):
        chunk = tensor_bytes(read_rows(tensor, start, start + step))
        written += len(chunk)
        while chunk:
            chunk = chunk[out.write(chunk):]
    if written != tensor.nbytes:
        raise CheckpointError(f"{tensor.name}: {written} bytes given, {tensor.nbytes} due")


def _in_process(fn: Callable[[Any], Any], tasks: Sequence[Any]) -> list[Any]:
    return [fn(task) for task in tasks]


def _write_shard(task: tuple[Path, tuple[StoredTensor, ...], dict[str, str]]) -> int:
    path, tensors, metadata = task
    return write_safetensors(path, tensors, metadata)


def write_safetensors_checkpoint(
    folder: Path,
    contents: Contents,
    write_config: Callable[[Path, Scheme, Unquantized], None],
    run: TaskRunner | None = None,
) -> list[str]:
    """Write ``contents`` into ``folder`` as the safetensors formats store a checkpoint: each
    shard a safetensors file (one task each on ``run``, default in this process), the index
    when asked, ``config.json``, then the format's quantization config (``write_config``).
    Returns the relative paths written."""
    tasks = [(folder.absolute() / shard.name, shard.tensors, shard.metadata)
             for shard in contents.shards]
    (run or _in_process)(_write_shard, tasks)
    written = [shard.name for shard in contents.shards]
    if contents.index:
        weight_map = {t.name: shard.name for shard in contents.shards for t in shard.tensors}
        meta = {**contents.index_metadata,
                "total_size": sum(t.nbytes for t in contents.tensors())}
        body = {"metadata": meta, "weight_map": weight_map}
        (folder / WEIGHTS_INDEX_NAME).write_text(json.dumps(body, indent=2, sort_keys=True),
                                                 encoding="utf-8")
        written.append(WEIGHTS_INDEX_NAME)
    (folder / CONFIG_NAME).write_text(contents.config_json, encoding="utf-8")
    write_config(folder, contents.scheme, contents.unquantized)
    return [*written, CONFIG_NAME]


def _file_entries(file: Path) -> tuple[dict[str, str], list[TensorInfo]]:
    start, header = read_header(file)
    meta = header.pop("__metadata__", None) or {}
    entries = []
    for key, entry in header.items():
        begin, end = entry["data_offsets"]
        entries.append(TensorInfo(file, key, str(entry["dtype"]), tuple(entry["shape"]),
                                  start + int(begin), int(end) - int(begin)))
    entries.sort(key=lambda t: t.offset)
    return {str(k): str(v) for k, v in meta.items()}, entries


def safetensors_weights(path: Path) -> StoredWeights:
    """The tensors of a safetensors checkpoint folder, from its (validated) headers alone.

    With an index, each tensor comes from the file its ``weight_map`` names; without one, a
    tensor stored in two files is an error naming both. File paths are absolute (tasks may run
    elsewhere: a Dask worker works in a folder of its own).
    """
    directory = Path(path)
    weights = weight_files(directory.absolute())
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[Path, dict[str, str]] = {}
    for file in weights.files:
        metadata[file], entries = _file_entries(file)
        for info in entries:
            if weights.weight_map is not None:
                if weights.weight_map.get(info.key) == file:
                    tensors[info.key] = info
                continue
            if info.key in tensors:
                raise CheckpointError(
                    f"tensor {info.key!r} is stored in two weight files, "
                    f"{tensors[info.key].file} and {file}, and no {WEIGHTS_INDEX_NAME} says "
                    "which one counts; remove the stale copy or add an index"
                )
            tensors[info.key] = info
    for key, file in (weights.weight_map or {}).items():
        if key not in tensors:
            raise CheckpointError(f"{file}: the index maps tensor {key!r} to this file, but the "
                                  "file does not hold it")
    return StoredWeights(directory, tuple(weights.files), tensors, metadata,
                         weights.weight_map is not None)


def safetensors_config(path: Path) -> dict[str, Any]:
    """``config.json`` of a safetensors checkpoint folder (CheckpointError naming it when it is
    missing, not a JSON object, or counts more layers than the weight files' tensor names hold:
    :func:`~nvfp4lab.checkpoint.validation.config_problem`, checked before anything builds the
    model)."""
    file = Path(path) / CONFIG_NAME
    data = read_json(file)
    problem = config_problem(data, safetensors_weights(Path(path)).tensors)
    if problem is not None:
        raise CheckpointError(f"{file}: {problem}")
    return data


class SafetensorsContainer:
    """The container members of :class:`~nvfp4lab.checkpoint.formats.CheckpointFormatSpec` that
    every safetensors format shares (``config.json`` plus safetensors shards): a format class
    inherits them and defines ``write_config``, its quantization config."""

    def read_weights(self, path: Path) -> StoredWeights:
        """The folder's safetensors tensors (:func:`safetensors_weights`)."""
        return safetensors_weights(path)

    def model_config(self, path: Path) -> dict[str, Any]:
        """The folder's ``config.json``."""
        return safetensors_config(path)

    def write_checkpoint(self, folder: Path, contents: Contents,
                         run: TaskRunner | None = None) -> list[str]:
        """``config.json``, safetensors shards (and index), then ``write_config``
        (:func:`write_safetensors_checkpoint`)."""
        return write_safetensors_checkpoint(folder, contents, self.write_config, run)

    def write_config(self, folder: Path, scheme: Scheme, unquantized: Unquantized) -> None:
        """The format's quantization config in ``folder`` (each format defines it)."""
        raise NotImplementedError
