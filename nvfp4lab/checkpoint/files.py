"""Deprecated (kept for one release): the old home of the checkpoint plumbing, now re-exported.

``files.py`` held three jobs, now each in its own module: the format-neutral records
(:mod:`nvfp4lab.checkpoint.records`), reading stored tensors' rows
(:mod:`nvfp4lab.checkpoint.rows`), the safetensors container
(:mod:`nvfp4lab.checkpoint.safetensors_files`) and the refusal wording
(:mod:`nvfp4lab.checkpoint.refusals`); the folder helpers it re-exported live in
:mod:`nvfp4lab.checkpoint.folders`. Every ``from nvfp4lab.checkpoint.files import X`` keeps
working and gives the same object (private helpers too); importing it warns
(DeprecationWarning), and it goes in the next release: import from the new modules instead.
Setting an attribute here (``monkeypatch.setattr(files, "write_safetensors", ...)``) also sets
it in the module that defines it, so code that calls it there sees the change.
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any

from nvfp4lab.checkpoint import folders, records, refusals, rows, safetensors_files
from nvfp4lab.checkpoint.folders import (
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
from nvfp4lab.checkpoint.records import (
    DTYPE_NAMES,
    SOURCE_ATTRIBUTE,
    ST_DTYPES,
    Contents,
    LayerNames,
    RowView,
    Shard,
    StoredTensor,
    StoredWeights,
    TaskRunner,
    TensorInfo,
    Unquantized,
)
from nvfp4lab.checkpoint.refusals import (
    MAX_JSON_DEPTH,
    CheckpointError,
    block_scale_error,
    parse_json,
    read_json,
    refuse_pickle,
    tensor_scale_error,
)
from nvfp4lab.checkpoint.rows import (
    RowReader,
    TensorSource,
    missing_tensor,
    read_exact,
    read_like,
    read_rows,
    read_scalar,
    stored_meta,
    stored_tensor,
    tensor_bytes,
)
from nvfp4lab.checkpoint.safetensors_files import (
    CONFIG_NAME,
    COPY_CHUNK_BYTES,
    MAX_HEADER_BYTES,
    PICKLE_SUFFIXES,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    SafetensorsContainer,
    WeightFiles,
    check_readable,
    quantization_block,
    read_header,
    safetensors_config,
    safetensors_weights,
    weight_files,
    write_safetensors,
    write_safetensors_checkpoint,
)
from nvfp4lab.checkpoint.validation import config_problem

__all__ = [
    "CONFIG_NAME",
    "COPY_CHUNK_BYTES",
    "DTYPE_NAMES",
    "LFS_POINTER_NOTE",
    "MAX_HEADER_BYTES",
    "MAX_JSON_DEPTH",
    "OWNER_MARKER",
    "PICKLE_SUFFIXES",
    "SOURCE_ATTRIBUTE",
    "ST_DTYPES",
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
    "stored_meta",
    "stored_tensor",
    "tensor_bytes",
    "tensor_scale_error",
    "unsafe_entries",
    "unsafe_message",
    "weight_files",
    "write_safetensors",
    "write_safetensors_checkpoint",
]

warnings.warn("nvfp4lab.checkpoint.files is deprecated: import nvfp4lab.checkpoint.records, "
              ".rows, .refusals or .safetensors_files", DeprecationWarning, stacklevel=2)

_MOVED_TO = (folders, records, refusals, rows, safetensors_files)

#: The module that defines each re-exported name (where its callers look it up).
_HOMES: dict[str, types.ModuleType] = {
    name: home
    for home in _MOVED_TO
    for name in getattr(home, "__all__", ())
    if name in __all__
}


def _home_of(name: str) -> types.ModuleType | None:
    """The module that now holds ``name`` (a re-exported or a private name), or None."""
    if name in _HOMES:
        return _HOMES[name]
    return next((home for home in _MOVED_TO if name in vars(home)), None)


def __getattr__(name: str) -> Any:
    """Every other name (the private helpers ``files.py`` held) as its new module has it."""
    home = _home_of(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return vars(home)[name]


class _ForwardingModule(types.ModuleType):
    """This module, with attribute assignment passed on to the name's defining module."""

    def __setattr__(self, name: str, value: Any) -> None:
        home = _home_of(name)
        if home is not None and getattr(home, name, None) is getattr(self, name, None):
            setattr(home, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _ForwardingModule
