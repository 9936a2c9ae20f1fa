"""On-disk plumbing shared by every checkpoint format: names, JSON, safetensors streaming.

Tensors are read lazily from memory-mapped files (:class:`TensorSource`, :class:`RowReader`),
never unpickled (pickle files are refused). Writes go to a hidden temporary sibling folder that is
renamed into place at the end (:mod:`nvfp4lab.checkpoint.folders`, re-exported here).

Every format describes its stored tensors the same way, under the model's names: a
:class:`StoredWeights` of :class:`TensorInfo` (file, byte range, dtype, shape; a
:class:`RowView` when the bytes hold the tensor in another layout, as GGUF's NVFP4 blocks do),
and writes a new checkpoint from one :class:`Contents` (shards of :class:`StoredTensor`, the
``config.json`` text, the scheme). The safetensors formats share their implementation here:
:func:`safetensors_weights` reads a folder's safetensors headers (:func:`read_header`: the 8-byte
little-endian length, then the JSON table of dtype, shape and byte range per tensor) and
:func:`write_safetensors_checkpoint` writes ``config.json``, the shards and their index;
:func:`write_safetensors` writes a file tensor by tensor, copying unchanged tensors file to file
in bounded chunks (``os.copy_file_range``), so no tensor is ever held whole.

Nothing here knows a checkpoint format: each format (:mod:`nvfp4lab.checkpoint.formats`) fills
a :class:`LayerNames` with its tensor names and reads its own configuration, through
:func:`quantization_block` when it lives in ``config.json``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from nvfp4lab.checkpoint.folders import (  # re-exported: files.py held them before
    LFS_POINTER_NOTE,
    OWNER_MARKER,
    check_target,
    folder_entries,
    fresh_dir,
    lfs_pointer,
    remove_stale_dirs,
    replace_dir,
    unsafe_entries,
    unsafe_message,
)
from nvfp4lab.checkpoint.validation import config_problem, header_problem, scale_value_problem
from nvfp4lab.tensor import invalid_block_scales
from nvfp4lab.vocab import Scheme

__all__ = [
    "CONFIG_NAME",
    "LFS_POINTER_NOTE",
    "OWNER_MARKER",
    "PICKLE_SUFFIXES",
    "SOURCE_ATTRIBUTE",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "CheckpointError",
    "Contents",
    "LayerNames",
    "RowReader",
    "RowView",
    "SafetensorsContainer",
    "Shard",
    "StoredTensor",
    "StoredWeights",
    "TaskRunner",
    "TensorInfo",
    "TensorSource",
    "Unquantized",
    "WeightFiles",
    "block_scale_error",
    "check_readable",
    "check_target",
    "config_problem",
    "folder_entries",
    "fresh_dir",
    "lfs_pointer",
    "missing_tensor",
    "parse_json",
    "quantization_block",
    "read_exact",
    "read_header",
    "read_json",
    "read_like",
    "read_rows",
    "read_scalar",
    "refuse_pickle",
    "remove_stale_dirs",
    "replace_dir",
    "safetensors_config",
    "safetensors_weights",
    "stored_tensor",
    "tensor_bytes",
    "tensor_scale_error",
    "weight_files",
    "write_safetensors",
    "write_safetensors_checkpoint",
]

CONFIG_NAME = "config.json"

WEIGHTS_NAME = "model.safetensors"

WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

PICKLE_SUFFIXES: tuple[str, ...] = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read; the message names the file and tensor."""


#: JSON nesting accepted in a checkpoint's JSON (configs, safetensors headers, GGUF's config
#: key): real ones nest under 10 levels; Python's parser and the code walking the result
#: (transformers' configs, ``copy.deepcopy``) recurse once or more per level.
MAX_JSON_DEPTH = 64


def _json_depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            depth += 1
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:
                stack.extend((v, depth) for v in (item.values() if isinstance(item, dict)
                                                  else item))
    return deepest


def parse_json(text: str | bytes, file: Path | str, what: str = "") -> Any:
    """``json.loads(text)`` of ``file`` (``what``: the part of the file it is, for the
    message); CheckpointError naming the file for text that is not JSON or nests deeper than
    :data:`MAX_JSON_DEPTH` (Python's parser raises RecursionError near 1,000 levels)."""
    where = f"{file}: {what}" if what else f"{file}:"
    try:
        data = json.loads(text)
    except RecursionError:
        data = None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{where} not valid JSON ({exc})") from None
    else:
        if _json_depth(data) <= MAX_JSON_DEPTH:
            return data
    raise CheckpointError(f"{where} JSON nested more than {MAX_JSON_DEPTH} levels deep (no "
                          "checkpoint's JSON nests that deep); the file is corrupt or hostile")


def read_json(file: Path) -> dict[str, Any]:
    try:
        with open(file, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise CheckpointError(f"{file} not found: not a checkpoint directory") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{file}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                              f"offset {exc.start}); save it as UTF-8 JSON") from None
    data = parse_json(text, file)
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


#: Set on a model by whatever read it (:func:`nvfp4lab.checkpoint.load`,
#: :func:`nvfp4lab.models.smollm2`): the file or folder it came from, which a format whose files
#: carry more than tensors (GGUF: architecture, hyper-parameters, tokenizer) copies from when it
#: saves the model again.
SOURCE_ATTRIBUTE = "nvfp4lab_source"


class RowView(Protocol):
    """How to read a stored tensor whose bytes are not laid out as it is named (a GGUF NVFP4
    tensor seen as codes and block scales, rows stored permuted): rows ``start:stop`` (first
    dim) as a torch tensor of the named dtype and shape. Picklable (tasks carry it)."""

    def rows(self, start: int, stop: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor lies: ``file``, its ``key`` there, safetensors ``dtype`` string,
    ``shape``, absolute byte ``offset`` in the file and ``nbytes`` (the named tensor's bytes).

    ``view``: None when the bytes ``offset:offset + nbytes`` are the tensor, row-major; else
    the :class:`RowView` that reads its rows (the bytes on disk then hold it in another
    layout).
    """

    file: Path
    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    view: RowView | None = field(default=None, compare=False)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return ST_DTYPES.get(self.dtype)


class RowReader:
    """Rows of one stored tensor, read from a read-only memory map of its byte range (or
    through its :attr:`TensorInfo.view`).

    ``rows(start, stop)`` returns a copy of rows ``start:stop`` (first dim) as a torch tensor of
    the stored dtype; only those pages are touched. Use as a context manager (unmaps on exit).
    """

    def __init__(self, info: TensorInfo) -> None:
        dtype = info.torch_dtype
        if dtype is None:
            raise CheckpointError(f"{info.file}: tensor {info.key!r} has dtype {info.dtype}, "
                                  "which torch cannot hold")
        self.info = info
        self.dtype = dtype
        self.shape = info.shape
        self.row_bytes = info.nbytes // max(info.shape[0], 1) if info.shape else info.nbytes
        self._map: np.memmap | None = None
        if info.nbytes and info.view is None:
            self._map = np.memmap(info.file, dtype=np.uint8, mode="r", offset=info.offset,
                                  shape=(info.nbytes,))

    def rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if not self.shape:
            if self.info.view is not None:
                return self.info.view.rows(0, 1).reshape(())
            return self._as_tensor(0, self.info.nbytes, ())
        stop = self.shape[0] if stop is None else min(stop, self.shape[0])
        if self.info.view is not None:
            return self.info.view.rows(start, stop)
        return self._as_tensor(start * self.row_bytes, stop * self.row_bytes,
                               (stop - start, *self.shape[1:]))

    def _as_tensor(self, begin: int, end: int, shape: tuple[int, ...]) -> torch.Tensor:
        raw = np.array(self._map[begin:end]) if self._map is not None else np.zeros(0, np.uint8)
        return torch.from_numpy(raw).view(self.dtype).reshape(shape)

    def close(self) -> None:
        self._map = None

    def __enter__(self) -> RowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_scalar(info: TensorInfo) -> float:
    """The single float value of a one-element tensor (a global or input scale)."""
    if math.prod(info.shape) != 1:
        raise CheckpointError(f"{info.file}: tensor {info.key!r} has shape {list(info.shape)}, "
                              "expected one value")
    with RowReader(info) as reader:
        return float(reader.rows().reshape(()).to(torch.float64))


@dataclass(frozen=True)
class StoredWeights:
    """The tensors of a checkpoint as nvfp4lab names them (the model's names, a quantized
    Linear's leaves as its format's :class:`LayerNames`), from the files' headers alone:
    ``tensors`` (name -> :class:`TensorInfo`, in file and byte order), the weight ``files``,
    each file's string ``metadata``, and whether an ``index`` names the file of each tensor."""

    directory: Path
    files: tuple[Path, ...]
    tensors: dict[str, TensorInfo]
    metadata: dict[Path, dict[str, str]]
    indexed: bool = False


class TensorSource:
    """Lazy access to the tensors of a checkpoint (:class:`StoredWeights`, memory-mapped, no
    unpickling), for :func:`nvfp4lab.checkpoint.load`.

    ``entries`` maps the model-side key to its :class:`TensorInfo`; :meth:`rekey` renames
    keys; tensors are read whole (:class:`RowReader`) and moved to ``device``.
    """

    def __init__(self, weights: StoredWeights, device: torch.device) -> None:
        self.entries: dict[str, TensorInfo] = dict(weights.tensors)
        self.device = device

    def rekey(self, strip: str, add: str) -> None:
        """Rename every key ``k`` to ``add + k.removeprefix(strip)``."""
        self.entries = {add + k.removeprefix(strip): v for k, v in self.entries.items()}

    def file_of(self, key: str) -> Path | None:
        entry = self.entries.get(key)
        return None if entry is None else entry.file

    def files(self) -> str:
        return ", ".join(sorted({str(info.file) for info in self.entries.values()}))

    def get(self, key: str) -> torch.Tensor:
        info = self.entries[key]
        try:
            with RowReader(info) as reader:
                return reader.rows().to(self.device)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{info.file}: cannot read tensor {info.key!r} ({exc})") from exc

    def meta(self, key: str) -> tuple[str, list[int]]:
        """(safetensors dtype string such as "U8", shape) without reading the data."""
        info = self.entries[key]
        return info.dtype, list(info.shape)


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
        """role -> leaf for the four quantized tensors (roles: packed, block (the block
        scales), global, input)."""
        return {"packed": self.packed, "block": self.scale, "global": self.global_scale,
                "input": self.input_scale}

    def keys(self, prefix: str) -> dict[str, str]:
        """role -> full tensor name of the layer ``prefix`` (``<prefix>.<leaf>``)."""
        return {role: f"{prefix}.{leaf}" for role, leaf in self.roles().items()}


def tensor_scale_error(file: Path | None, key: str, value: float,
                       names: LayerNames) -> CheckpointError | None:
    """The one refusal of a stored tensor (or input) scale ``value`` of tensor ``key``
    (``load`` raises it, ``convert`` too, before writing anything; ``audit`` flags the layer
    in the same words): not finite and > 0, or a float32 reciprocal that overflows
    (:func:`~nvfp4lab.checkpoint.validation.scale_value_problem`), naming the file, the tensor
    and the format's convention; None for a valid one."""
    problem = scale_value_problem(value, names.decode)
    return None if problem is None else CheckpointError(f"{file}: tensor {key!r} {problem}")


def block_scale_error(file: Path | None, key: str, scales: torch.Tensor,
                      first_row: int = 0) -> CheckpointError | None:
    """The one refusal of stored E4M3 block ``scales`` of tensor ``key`` (rows from
    ``first_row`` on: a part of it may be checked at a time) holding NaN codes or negative values
    (``load`` and ``convert`` raise it; ``audit`` flags the layer), naming the file, the tensor,
    the first bad byte and how many there are; None when all are valid."""
    nan, negative, first = invalid_block_scales(scales)
    if first is None:
        return None
    byte = int(scales.view(torch.uint8)[first])
    where = (first[0] + first_row, *first[1:])
    return CheckpointError(
        f"{file}: tensor {key!r} holds {nan} NaN and {negative} negative E4M3 block scale(s) "
        f"(first at {where}, byte 0x{byte:02x}); NVFP4 block scales are non-negative and finite, "
        "so this checkpoint is corrupt or not NVFP4"
    )


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


@dataclass(frozen=True)
class StoredTensor:
    """One tensor to write: ``name``, safetensors ``dtype`` string, ``shape``, ``nbytes`` and
    ``data``: the new bytes, a torch tensor holding them, ``(file, offset)`` to copy ``nbytes``
    from unchanged, or the :class:`TensorInfo` of a stored tensor to copy (file to file in
    bounded chunks when its bytes are laid out as named, row by row through its view
    otherwise)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    data: bytes | torch.Tensor | TensorInfo | tuple[Path, int]

    def source(self) -> TensorInfo | None:
        """Where the bytes lie when they are copied from a file, else None."""
        if isinstance(self.data, TensorInfo):
            return self.data
        if isinstance(self.data, tuple):
            file, offset = self.data
            return TensorInfo(Path(file), self.name, self.dtype, self.shape, offset, self.nbytes)
        return None


#: The safetensors dtype string of each torch dtype nvfp4lab reads and writes.
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in ST_DTYPES.items()}


def stored_tensor(name: str, tensor: torch.Tensor) -> StoredTensor:
    """A CPU tensor to write under ``name`` (CheckpointError for a dtype safetensors has no
    name for)."""
    dtype = DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise CheckpointError(f"{name}: dtype {tensor.dtype} cannot be stored")
    return StoredTensor(name, dtype, tuple(tensor.shape), tensor.numel() * tensor.element_size(),
                        tensor)


def read_rows(tensor: StoredTensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Rows ``start:stop`` (first dim; the whole value of a 0-d tensor) of a tensor to write,
    as a CPU torch tensor of its dtype and shape."""
    dtype = ST_DTYPES[tensor.dtype]
    data = tensor.data
    stored = tensor.source()
    if stored is not None:
        with RowReader(stored) as reader:
            return reader.rows(start, stop) if tensor.shape else reader.rows()
    if isinstance(data, torch.Tensor):
        value = data.detach().to("cpu")
    else:
        value = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
    value = value.reshape(tensor.shape)
    return value[start:stop] if tensor.shape else value


def tensor_bytes(value: torch.Tensor) -> memoryview:
    """The row-major bytes of a CPU tensor (no copy when it is contiguous)."""
    flat = value.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


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


# --------------------------------------------------------------------------------------------
# the checkpoint folder of the safetensors formats (config.json and safetensors shards)


@dataclass(frozen=True)
class Shard:
    """One weight file to write: its ``name`` in the folder, its ``tensors`` in order and its
    string ``metadata``."""

    name: str
    tensors: tuple[StoredTensor, ...]
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Contents:
    """Everything a format's ``write_checkpoint`` writes into a new folder.

    ``shards``: the tensors under nvfp4lab's names (the model's names; a quantized Linear's
    leaves and tensor-scale convention those of the format written), grouped as the caller
    wants them in files (a format holding one file ignores the grouping); ``config_json``: the
    model's ``config.json`` text without a quantization config; ``scheme`` / ``unquantized``:
    what the format's quantization config records; ``index``: write a safetensors index
    (``index_metadata`` its ``metadata``, ``total_size`` added); ``source``: the file or folder
    the model came from (a format may copy metadata from it), or None.
    """

    shards: tuple[Shard, ...]
    config_json: str
    scheme: Scheme
    unquantized: Unquantized
    index: bool = False
    index_metadata: dict[str, Any] = field(default_factory=dict)
    source: Path | None = None

    def tensors(self) -> Iterator[StoredTensor]:
        """Every tensor, shard by shard, in order."""
        for shard in self.shards:
            yield from shard.tensors


#: ``run(fn, tasks)``: ``[fn(t) for t in tasks]``, wherever the caller runs tasks
#: (:func:`nvfp4lab.checkpoint.stream.run_tasks`); ``fn`` is module-level, the tasks picklable.
TaskRunner = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]


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
