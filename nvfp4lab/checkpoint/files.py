"""On-disk plumbing shared by every checkpoint format: names, JSON, safetensors streaming.

Tensors are read lazily from memory-mapped safetensors files (:class:`TensorSource`), never
unpickled (pickle files are refused). Writes go to a hidden temporary sibling folder that is
renamed into place at the end (:mod:`nvfp4lab.checkpoint.folders`, re-exported here).

For work on checkpoints larger than memory, :func:`read_header` reads a safetensors header (the
8-byte little-endian length, then the JSON table of dtype, shape and byte range per tensor) and
:func:`write_safetensors` writes a file tensor by tensor, copying unchanged tensors file to file
in bounded chunks (``os.copy_file_range``), so no tensor is ever held whole.

Nothing here knows a checkpoint format: each format (:mod:`nvfp4lab.checkpoint.formats`) fills
a :class:`LayerNames` with its tensor names and reads its own configuration, through
:func:`quantization_block` when it lives in ``config.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nvfp4lab.checkpoint.folders import (  # re-exported: files.py held them before
    OWNER_MARKER,
    check_target,
    folder_entries,
    fresh_dir,
    remove_stale_dirs,
    replace_dir,
)
from nvfp4lab.checkpoint.validation import header_problem

__all__ = [
    "CONFIG_NAME",
    "OWNER_MARKER",
    "PICKLE_SUFFIXES",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "CheckpointError",
    "LayerNames",
    "StoredTensor",
    "TensorSource",
    "Unquantized",
    "WeightFiles",
    "check_target",
    "folder_entries",
    "fresh_dir",
    "missing_tensor",
    "quantization_block",
    "read_exact",
    "read_header",
    "read_json",
    "read_like",
    "refuse_pickle",
    "remove_stale_dirs",
    "replace_dir",
    "weight_files",
    "write_safetensors",
]

CONFIG_NAME = "config.json"

WEIGHTS_NAME = "model.safetensors"

WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

PICKLE_SUFFIXES: tuple[str, ...] = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read; the message names the file and tensor."""


def read_json(file: Path) -> dict[str, Any]:
    try:
        with open(file, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise CheckpointError(f"{file} not found: not a checkpoint directory") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{file}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                              f"offset {exc.start}); save it as UTF-8 JSON") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


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


def refuse_pickle(file: Path) -> CheckpointError:
    return CheckpointError(
        f"{file} is a pickle file ({file.suffix}); nvfp4lab never unpickles checkpoints "
        "(unpickling runs arbitrary code). Convert it to safetensors with a trusted tool first"
    )


@dataclass(frozen=True)
class WeightFiles:
    """The safetensors files of a checkpoint and, when it has an index, its ``weight_map``
    (tensor name -> the file that holds it; the index is the authority)."""

    files: list[Path]
    weight_map: dict[str, Path] | None = None


def _index_map(directory: Path, index: Path) -> dict[str, Path]:
    """``weight_map`` of ``index`` with every file checked to lie inside ``directory``."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has no weight_map")
    root = directory.resolve()
    out: dict[str, Path] = {}
    for key, name in weight_map.items():
        rel = Path(str(name))
        target = (directory / rel).resolve()
        if rel.is_absolute() or not target.is_relative_to(root):
            raise CheckpointError(
                f"{index}: weight_map sends {key!r} to {str(name)!r}, outside the checkpoint "
                "folder; a checkpoint's files must lie inside its folder"
            )
        if rel.suffix in PICKLE_SUFFIXES:
            raise refuse_pickle(directory / rel)
        out[str(key)] = directory / rel
    return out


def weight_files(directory: Path) -> WeightFiles:
    """The safetensors files of a checkpoint directory (and its index's map), refusing pickles."""
    index = directory / WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map = _index_map(directory, index)
        return WeightFiles(sorted(set(weight_map.values())), weight_map)
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return WeightFiles([single])
    found = sorted(directory.glob("*.safetensors"))
    if found:
        return WeightFiles(found)
    pickles = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise refuse_pickle(pickles[0])
    raise CheckpointError(f"{directory} holds no .safetensors weight file")


def _open(file: Path, device: torch.device, stack: contextlib.ExitStack) -> tuple[Any, list[str]]:
    from safetensors import safe_open

    if not file.is_file():
        raise CheckpointError(f"{file} is listed in the checkpoint but does not exist")
    try:
        handle = stack.enter_context(safe_open(str(file), framework="pt", device=str(device)))
        return handle, list(handle.keys())
    except Exception as exc:  # SafetensorError for truncated / corrupt headers
        raise CheckpointError(
            f"{file}: cannot read it as safetensors ({exc}); the file is truncated, "
            "corrupt or not a safetensors file"
        ) from exc


class TensorSource:
    """Lazy access to the tensors of several safetensors files (memory-mapped, no unpickling).

    ``entries`` maps the model-side key to (file, stored key); :meth:`rekey` renames keys. With an
    index, every key comes from the file its ``weight_map`` names (a copy of it in another file is
    ignored); without one, a key held by two files is an error naming both.
    """

    def __init__(
        self, weights: WeightFiles, device: torch.device, stack: contextlib.ExitStack
    ) -> None:
        self.entries: dict[str, tuple[Path, str]] = {}
        self._handles: dict[Path, Any] = {}
        held: dict[Path, set[str]] = {}
        for file in weights.files:
            self._handles[file], keys = _open(file, device, stack)
            held[file] = set(keys)
            if weights.weight_map is not None:
                continue
            for key in keys:
                if key in self.entries:
                    raise CheckpointError(
                        f"tensor {key!r} is stored in two weight files, {self.entries[key][0]} "
                        f"and {file}, and no {WEIGHTS_INDEX_NAME} says which one counts; remove "
                        "the stale copy or add an index"
                    )
                self.entries[key] = (file, key)
        for key, file in (weights.weight_map or {}).items():
            if key not in held[file]:
                raise CheckpointError(
                    f"{file}: the index maps tensor {key!r} to this file, but the file does not "
                    "hold it"
                )
            self.entries[key] = (file, key)

    def rekey(self, strip: str, add: str) -> None:
        """Rename every key ``k`` to ``add + k.removeprefix(strip)``."""
        self.entries = {add + k.removeprefix(strip): v for k, v in self.entries.items()}

    def file_of(self, key: str) -> Path | None:
        entry = self.entries.get(key)
        return None if entry is None else entry[0]

    def files(self) -> str:
        return ", ".join(sorted({str(f) for f, _ in self.entries.values()}))

    def get(self, key: str) -> torch.Tensor:
        file, stored = self.entries[key]
        try:
            return self._handles[file].get_tensor(stored)
        except Exception as exc:
            raise CheckpointError(f"{file}: cannot read tensor {stored!r} ({exc})") from exc

    def meta(self, key: str) -> tuple[str, list[int]]:
        """(safetensors dtype string such as "U8", shape) without reading the data."""
        file, stored = self.entries[key]
        view = self._handles[file].get_slice(stored)
        return view.get_dtype(), list(view.get_shape())


ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


def missing_tensor(source: TensorSource, key: str) -> CheckpointError:
    return CheckpointError(
        f"missing tensor {key!r}: it is in none of the checkpoint's weight files "
        f"({source.files()})"
    )


def stored_meta(source: TensorSource, key: str) -> tuple[Path, torch.dtype | str, list[int]]:
    file = source.file_of(key)
    if file is None:
        raise missing_tensor(source, key)
    st_dtype, shape = source.meta(key)
    return file, ST_DTYPES.get(st_dtype, st_dtype), shape


def read_exact(
    source: TensorSource, key: str, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """Read ``key`` after checking its stored dtype and shape (errors name file and tensor)."""
    file, found, found_shape = stored_meta(source, key)
    if found != dtype:
        raise CheckpointError(f"{file}: tensor {key!r} has dtype {found}, expected {dtype}")
    if found_shape != list(shape):
        raise CheckpointError(
            f"{file}: tensor {key!r} has shape {found_shape}, expected {list(shape)}"
        )
    return source.get(key)


def read_like(source: TensorSource, key: str, like: torch.Tensor) -> torch.Tensor:
    """Read ``key`` for a parameter/buffer shaped like ``like``; floats are cast to its dtype."""
    file, found, found_shape = stored_meta(source, key)
    if found_shape != list(like.shape):
        raise CheckpointError(
            f"{file}: tensor {key!r} has shape {found_shape}, the model expects "
            f"{list(like.shape)}"
        )
    if not isinstance(found, torch.dtype) or found.is_floating_point != like.is_floating_point():
        raise CheckpointError(
            f"{file}: tensor {key!r} has dtype {found}, the model expects {like.dtype}"
        )
    return source.get(key).to(like.dtype)


# --------------------------------------------------------------------------------------------
# what a format names and lists, and safetensors files read and written without holding tensors


@dataclass(frozen=True)
class LayerNames:
    """The tensor leaves of one quantized Linear ``<name>`` in a checkpoint format.

    ``packed``: uint8 ``[N, K/2]`` codes; ``scale``: float8_e4m3fn ``[N, K/16]`` block scales
    (plain layout); ``global_scale`` / ``input_scale``: float32 of shape ``scalar_shape`` (also
    read: any shape of ``scalar_shapes``), in the DECODE convention (amax/2688) when ``decode``
    is True, else ENCODE (2688/amax).
    """

    packed: str
    scale: str
    global_scale: str
    input_scale: str
    scalar_shape: tuple[int, ...]
    decode: bool
    also_read: tuple[tuple[int, ...], ...] = ()

    @property
    def scalar_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The tensor-scale shapes accepted on read: ``scalar_shape`` first, then ``also_read``."""
        return (self.scalar_shape, *self.also_read)

    def roles(self) -> dict[str, str]:
        """role -> leaf for the four quantized tensors (roles: packed, scale, global, input)."""
        return {"packed": self.packed, "scale": self.scale, "global": self.global_scale,
                "input": self.input_scale}

    def keys(self, prefix: str) -> dict[str, str]:
        """role -> full tensor name of the layer ``prefix`` (``<prefix>.<leaf>``)."""
        return {role: f"{prefix}.{leaf}" for role, leaf in self.roles().items()}


@dataclass(frozen=True)
class Unquantized:
    """The modules a checkpoint leaves in floating point, for a format's config to list.

    ``listed``: module names or fnmatch wildcards (``model.layers.*.mlp``): the unquantized
    Linears of a model being saved, or what the config of a checkpoint being converted lists;
    ``weights``: every unquantized module holding a 2-D floating ``weight`` (Linear, Embedding),
    sorted. Each format picks what its config records.
    """

    listed: tuple[str, ...]
    weights: tuple[str, ...]


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
                raise CheckpointError(f"{file}: not a safetensors file (bad header length)")
            header = json.loads(handle.read(size))
    except FileNotFoundError:
        raise CheckpointError(f"{file} is listed in the checkpoint but does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
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


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file to write: ``data`` is the new bytes, or ``(file,
    offset)`` to copy ``nbytes`` from unchanged."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    data: bytes | tuple[Path, int]


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

    Memory stays bounded by :data:`COPY_CHUNK_BYTES` whatever the tensor sizes."""
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
            else:
                _copy_range(t.data[0], t.data[1], t.nbytes, out.fileno())
    return offset
