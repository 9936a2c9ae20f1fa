"""Stored tensors read lazily, whole or a few rows at a time, and tensors made ready to write.

Tensors are read from read-only memory maps of their byte range (:class:`RowReader`, or through
a :class:`~nvfp4lab.checkpoint.records.RowView` when stored in another layout), never unpickled;
:class:`TensorSource` serves ``load`` by the model's names, :func:`read_exact` /
:func:`read_like` check dtype and shape first. :func:`stored_tensor`, :func:`read_rows` and
:func:`tensor_bytes` are the writing side: a tensor to write, its rows, its bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from nvfp4lab.checkpoint.records import (
    DTYPE_NAMES,
    ST_DTYPES,
    StoredTensor,
    StoredWeights,
    TensorInfo,
)
from nvfp4lab.checkpoint.refusals import CheckpointError

__all__ = [
    "RowReader",
    "TensorSource",
    "missing_tensor",
    "read_exact",
    "read_like",
    "read_rows",
    "read_scalar",
    "stored_meta",
    "stored_tensor",
    "tensor_bytes",
]

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
