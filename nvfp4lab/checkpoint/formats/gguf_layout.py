"""The byte layout of a GGUF file, walked with bounds before gguf's ``GGUFReader`` parses it.

``GGUFReader`` trusts every count it reads: a metadata array claiming 2**62 elements makes it
loop (and grow) until the process is killed, a tensor offset near 2**64 wraps (numpy uint64)
into the header, dims whose product overflows read garbage. :func:`check_layout` reads the same
structure (llama.cpp's ``gguf.cpp``: magic, version, tensor and key-value counts, the key-values,
the tensor infos, the aligned data section) and bounds each count by the bytes that remain
before anything is read or allocated: key-value and tensor counts, string lengths, array
lengths (and their total, :data:`MAX_METADATA_VALUES`), nesting, ``n_dims``, each tensor's
dims, type, byte count and offset, which must lie inside the file. It only reads; a file it
passes parses in ``GGUFReader`` with every count already checked. Errors are one line naming the
file and the key or tensor (:class:`~nvfp4lab.checkpoint.refusals.CheckpointError`).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any

from nvfp4lab.checkpoint.refusals import CheckpointError

__all__ = ["MAX_METADATA_VALUES", "check_layout"]

#: Array elements accepted over all metadata arrays of one file. ``GGUFReader`` keeps about
#: 700 bytes and 16 us per element (one numpy view each: 1M elements -> 0.7 GB, 16 s, measured);
#: the largest real tokenizers hold under 1M (Gemma 3: 262,144 tokens x 3 arrays; Llama 3:
#: 128,256 tokens x 2 + 280,147 merges), so 2**21 bounds the reader near 1.5 GB.
MAX_METADATA_VALUES = 2**21
#: Nesting of metadata arrays accepted (llama.cpp writes none; gguf's reader recurses per level).
MAX_ARRAY_DEPTH = 2
#: ggml's GGML_MAX_DIMS.
MAX_DIMS = 4
_ALIGNMENT_KEY = "general.alignment"
_DEFAULT_ALIGNMENT = 32
#: GGUFValueType -> bytes of one value (STRING = 8 and ARRAY = 9 are variable).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_SUPPORTED_VERSIONS = (2, 3)
_MAGIC = b"GGUF"


class _Walk:
    """A cursor over the mapped file; every read is checked against the bytes that remain."""

    def __init__(self, data: Any, file: Path) -> None:
        self.data, self.file, self.at, self.values = data, file, 0, 0

    @property
    def left(self) -> int:
        return len(self.data) - self.at

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.file}: not a valid GGUF file: {what}; the file is "
                               "truncated, corrupt or hostile")

    def need(self, count: int, each: int, what: str) -> None:
        """Refuse ``count`` items of at least ``each`` bytes when fewer bytes remain."""
        if count * each > self.left:
            raise self.fail(f"{what} claims {count} item(s) of {each}+ bytes at offset "
                            f"{self.at}, but only {self.left} bytes remain")

    def unpack(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        self.need(1, size, what)
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return int(value)

    def string(self, what: str) -> bytes:
        length = self.unpack("<Q", f"the length of {what}")
        self.need(length, 1, what)
        value = bytes(self.data[self.at:self.at + length])
        self.at += length
        return value

    def value(self, kind: int, key: str, depth: int = 0) -> int | None:
        """Skip one value of type ``kind`` (its u32 value when it is a UINT32, else None)."""
        if kind in _SCALAR_BYTES:
            size = _SCALAR_BYTES[kind]
            self.need(1, size, f"the value of {key!r}")
            value = struct.unpack_from("<I", self.data, self.at)[0] if kind == _UINT32 else None
            self.at += size
            return value
        if kind == _STRING:
            self.string(f"the string value of {key!r}")
            return None
        if kind != _ARRAY:
            raise self.fail(f"key {key!r} has value type {kind}, which GGUF does not define")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"key {key!r} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")
        item = self.unpack("<I", f"the element type of {key!r}")
        count = self.unpack("<Q", f"the length of {key!r}")
        least = _SCALAR_BYTES.get(item, 8 if item == _STRING else 12)
        self.need(count, least, f"array {key!r}")
        self.values += count
        if self.values > MAX_METADATA_VALUES:
            raise self.fail(f"its metadata arrays hold more than {MAX_METADATA_VALUES} "
                            f"elements (array {key!r} has {count}); nvfp4lab reads up to that "
                            "many (real tokenizers hold under 1M)")
        if item in _SCALAR_BYTES:
            self.at += count * least
        elif item == _STRING:
            self._strings(count, key)
        else:
            for _ in range(count):
                self.value(item, key, depth + 1)
        return None

    def _strings(self, count: int, key: str) -> None:
        """Skip ``count`` strings (a tokenizer's vocabulary: one tight loop, ~25 ms for
        SmolLM2's 98k strings)."""
        data, at, end, unpack = self.data, self.at, len(self.data), struct.unpack_from
        for index in range(count):
            if at + 8 > end or at + 8 + unpack("<Q", data, at)[0] > end:
                self.at = at
                raise self.fail(f"string {index} of array {key!r} runs past the end of the "
                                "file")
            at += 8 + unpack("<Q", data, at)[0]
        self.at = at


def _tensor_info(walk: _Walk, sizes: dict[int, tuple[int, int]]) -> tuple[str, int, int]:
    """(name, offset in the data section, bytes) of the next tensor info, its dims and type
    checked."""
    raw = walk.string("a tensor name")
    name = raw.decode("utf-8", "replace")
    n_dims = walk.unpack("<I", f"the n_dims of tensor {name!r}")
    if n_dims > MAX_DIMS:
        raise walk.fail(f"tensor {name!r} has n_dims {n_dims}; ggml tensors have at most "
                        f"{MAX_DIMS}")
    walk.need(n_dims, 8, f"the dims of tensor {name!r}")
    dims = [walk.unpack("<Q", "a dim") for _ in range(n_dims)]
    kind = walk.unpack("<I", f"the type of tensor {name!r}")
    offset = walk.unpack("<Q", f"the offset of tensor {name!r}")
    if kind not in sizes:
        raise walk.fail(f"tensor {name!r} has ggml type {kind}, which the gguf package does "
                        "not know")
    if 0 in dims:
        raise walk.fail(f"tensor {name!r} has dims {dims} (ggml order); every dim holds at "
                        "least one element")
    block, type_size = sizes[kind]
    if dims and dims[0] % block:
        raise walk.fail(f"tensor {name!r} has {dims[0]} elements per row, not a multiple of "
                        f"its type's block of {block}")
    return name, offset, math.prod(dims) // block * type_size


def check_layout(file: Path) -> None:
    """Walk the GGUF ``file`` with bounds (see the module docstring); CheckpointError naming
    the file and the key or tensor at the first count the bytes cannot hold."""
    from gguf import GGML_QUANT_SIZES

    sizes = {int(k): v for k, v in GGML_QUANT_SIZES.items()}
    try:
        with open(file, "rb") as handle:
            total = os.fstat(handle.fileno()).st_size
            if total < 24:
                raise CheckpointError(f"{file}: truncated ({total} bytes; a GGUF header alone "
                                      "takes 24)")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _walk(_Walk(data, file), sizes, total)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read it ({exc.strerror})") from None


def _walk(walk: _Walk, sizes: dict[int, tuple[int, int]], total: int) -> None:
    if bytes(walk.data[:4]) != _MAGIC:
        raise CheckpointError(f"{walk.file}: not a GGUF file (it starts with "
                              f"{bytes(walk.data[:4])!r}, a GGUF file with {_MAGIC!r})")
    walk.at = 4
    version = walk.unpack("<I", "the version")
    if version & 0xFFFF == 0:
        raise CheckpointError(f"{walk.file}: a big-endian GGUF file; nvfp4lab reads "
                              "little-endian ones (llama.cpp's default)")
    if version not in _SUPPORTED_VERSIONS:
        raise walk.fail(f"version {version} (gguf reads versions 2 and 3)")
    tensors = walk.unpack("<Q", "the tensor count")
    keys = walk.unpack("<Q", "the key-value count")
    walk.need(keys, 8 + 4 + 1, "the key-value count")
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(keys):
        key = walk.string("a metadata key").decode("utf-8", "replace")
        kind = walk.unpack("<I", f"the value type of {key!r}")
        value = walk.value(kind, key)
        if key == _ALIGNMENT_KEY:
            if value is None or value <= 0 or value & (value - 1):
                raise walk.fail(f"{_ALIGNMENT_KEY} is not a UINT32 power of two")
            alignment = value
    walk.need(tensors, 8 + 4 + 4 + 8, "the tensor count")
    infos = [_tensor_info(walk, sizes) for _ in range(tensors)]
    start = -(-walk.at // alignment) * alignment
    for name, offset, nbytes in infos:
        if offset % alignment:
            raise walk.fail(f"tensor {name!r} has data offset {offset}, not a multiple of the "
                            f"alignment {alignment}")
        if start + offset + nbytes > total:
            raise walk.fail(f"tensor {name!r} ({nbytes} bytes at data offset {offset}, file "
                            f"byte {start + offset}) ends past the end of the file ({total} "
                            "bytes)")
