"""The format-neutral records of a checkpoint: what every format reads and writes, named.

A format describes its stored tensors under the model's names: a :class:`StoredWeights` of
:class:`TensorInfo` (file, byte range, dtype, shape; a :class:`RowView` when the bytes hold the
tensor in another layout, as GGUF's NVFP4 blocks do), the leaves of one quantized Linear as a
:class:`LayerNames`; it writes a new checkpoint from one :class:`Contents` (shards of
:class:`StoredTensor`, the ``config.json`` text, the scheme, the :class:`Unquantized` modules).
Plain data only: reading rows is :mod:`nvfp4lab.checkpoint.rows`, the safetensors container
:mod:`nvfp4lab.checkpoint.safetensors_files`, the refusals :mod:`nvfp4lab.checkpoint.refusals`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from nvfp4lab.vocab import Scheme

__all__ = [
    "DTYPE_NAMES",
    "SOURCE_ATTRIBUTE",
    "ST_DTYPES",
    "Contents",
    "KVCacheNames",
    "LayerNames",
    "RowView",
    "Shard",
    "StoredTensor",
    "StoredWeights",
    "TaskRunner",
    "TensorInfo",
    "Unquantized",
]

#: Set on a model by whatever read it (:func:`nvfp4lab.checkpoint.load`,
#: :func:`nvfp4lab.models.smollm2`): the file or folder it came from, which a format whose files
#: carry more than tensors (GGUF: architecture, hyper-parameters, tokenizer) copies from when it
#: saves the model again.
SOURCE_ATTRIBUTE = "nvfp4lab_source"


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


#: The safetensors dtype string of each torch dtype nvfp4lab reads and writes.
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in ST_DTYPES.items()}


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


def _renamed(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=3)


@dataclass(frozen=True)
class LayerNames:
    """The tensor leaves of one quantized Linear ``<name>`` in a checkpoint format.

    ``packed``: uint8 ``[N, K/2]`` codes; ``block_scale``: float8_e4m3fn ``[N, K/16]`` block
    scales (plain layout); ``tensor_scale`` / ``input_scale``: float32 of shape ``scalar_shape``
    (also read: any shape of ``scalar_shapes``), in the DECODE form (amax/2688) when
    ``decode_form`` is True, else ENCODE (2688/amax). The fields' names before issue 33
    (``scale``, ``global_scale``, ``decode``) still read, with a DeprecationWarning.
    """

    packed: str
    block_scale: str
    tensor_scale: str
    input_scale: str
    scalar_shape: tuple[int, ...]
    decode_form: bool
    also_read: tuple[tuple[int, ...], ...] = ()

    @property
    def scale(self) -> str:
        """Deprecated: :attr:`block_scale`."""
        _renamed("LayerNames.scale", "block_scale")
        return self.block_scale

    @property
    def global_scale(self) -> str:
        """Deprecated: :attr:`tensor_scale` (it holds either form, not only the ENCODE one)."""
        _renamed("LayerNames.global_scale", "tensor_scale")
        return self.tensor_scale

    @property
    def decode(self) -> bool:
        """Deprecated: :attr:`decode_form`."""
        _renamed("LayerNames.decode", "decode_form")
        return self.decode_form

    @property
    def scalar_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The tensor-scale shapes accepted on read: ``scalar_shape`` first, then ``also_read``."""
        return (self.scalar_shape, *self.also_read)

    def roles(self) -> dict[str, str]:
        """role -> leaf for the four quantized tensors (roles: packed, block (the block
        scales), global, input)."""
        return {"packed": self.packed, "block": self.block_scale, "global": self.tensor_scale,
                "input": self.input_scale}

    def keys(self, prefix: str) -> dict[str, str]:
        """role -> full tensor name of the layer ``prefix`` (``<prefix>.<leaf>``)."""
        return {role: f"{prefix}.{leaf}" for role, leaf in self.roles().items()}


@dataclass(frozen=True)
class KVCacheNames:
    """How a format stores a quantized KV cache's per-layer DECODE scales (vLLM's ``k_scale`` /
    ``v_scale``): the leaves under an attention module ``<attn>`` (``k_scale`` or
    ``k_proj.k_scale``: ``<attn>.<k_scale>``), float32 of shape ``scalar_shape`` (also read:
    ``also_read``), and ``missing``: the value a side without a stored scale gets (None: vLLM's
    ``BaseKVCacheMethod`` rule, :func:`~nvfp4lab.execution.kv_cache.kv_global_scale`)."""

    k_scale: str
    v_scale: str
    scalar_shape: tuple[int, ...]
    also_read: tuple[tuple[int, ...], ...] = ()
    missing: float | None = None

    def keys(self, attention: str) -> tuple[str, str]:
        """The (k, v) tensor names of the attention module ``attention``."""
        return f"{attention}.{self.k_scale}", f"{attention}.{self.v_scale}"

    def attention_of(self, key: str) -> tuple[str, int] | None:
        """(attention module name, 0 for K / 1 for V) of a stored KV scale name, else None."""
        for side, leaf in enumerate((self.k_scale, self.v_scale)):
            if key.endswith(f".{leaf}"):
                return key[: -len(leaf) - 1], side
        return None


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
    leaves and tensor-scale form those of the format written), grouped as the caller
    wants them in files (a format holding one file ignores the grouping); ``config_json``: the
    model's ``config.json`` text without a quantization config; ``scheme`` / ``unquantized``:
    what the format's quantization config records; ``index``: write a safetensors index
    (``index_metadata`` its ``metadata``, ``total_size`` added); ``source``: the file or folder
    the model came from (a format may copy metadata from it), or None; ``kv_cache``: the
    quantized KV cache kind the format's config declares (a
    :class:`~nvfp4lab.vocab.KVCacheKind` value; its k / v scales are among the tensors, named
    by the format's :class:`KVCacheNames`), or None.
    """

    shards: tuple[Shard, ...]
    config_json: str
    scheme: Scheme
    unquantized: Unquantized
    index: bool = False
    index_metadata: dict[str, Any] = field(default_factory=dict)
    source: Path | None = None
    kv_cache: str | None = None

    def tensors(self) -> Iterator[StoredTensor]:
        """Every tensor, shard by shard, in order."""
        for shard in self.shards:
            yield from shard.tensors


#: ``run(fn, tasks)``: ``[fn(t) for t in tasks]``, wherever the caller runs tasks
#: (:func:`nvfp4lab.checkpoint.stream.run_tasks`); ``fn`` is module-level, the tasks picklable.
TaskRunner = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]
