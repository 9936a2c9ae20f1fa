"""The one validator of what a checkpoint's files declare, shared by ``load``, ``audit`` and
``convert``; it reads headers only, never tensor data.

* :func:`header_problem`: a safetensors header (the JSON table of dtype, shape and byte range
  per tensor). :func:`nvfp4lab.checkpoint.safetensors_files.read_header` runs it on every
  header it reads, so ``load`` (before safetensors opens the file), the streamed inventory of
  ``audit`` and ``convert`` refuse the same files in the same words: an entry that is not an
  object, a dtype nvfp4lab does not read (sub-byte ``F4`` included: NVFP4 codes are U8, two per
  byte), a shape that is not a list of non-negative integers, ``data_offsets`` that are not two
  integers, negative or reversed offsets, a byte range whose length is not the shape's bytes, two
  tensors sharing bytes, and a ``__metadata__`` that is not a flat map of strings.
* :func:`weight_problems` / :func:`input_problems`: the tensors of one quantized Linear as its
  format names them (:class:`~nvfp4lab.checkpoint.records.LayerNames`): codes U8 ``[N, K/2]`` with
  K a multiple of 16, block scales F8_E4M3 ``[N, K/16]``, one float32 tensor scale, and an input
  scale exactly when the configuration's scheme stores one. ``audit`` lists these problems in
  its ``issues`` column; ``convert`` refuses the checkpoint before writing anything; ``load``
  checks the same facts against the model it builds (``files.read_exact``).

The configuration is validated by each format's ``read_config``
(:mod:`nvfp4lab.checkpoint.formats`), which ``load``, ``audit`` and ``convert`` all call.

The functions return what is wrong in words, naming the tensor (``None`` / ``[]`` when nothing
is); callers add the file and raise :class:`~nvfp4lab.checkpoint.refusals.CheckpointError` or list
the problem. It imports only numerics at run time (``files`` imports it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any, Protocol

from nvfp4lab.constants import BLOCK_SIZE as _BLOCK
from nvfp4lab.layout import padded_scale_shape


class LayerNames(Protocol):
    """What the layer checks read of a format's :class:`nvfp4lab.checkpoint.records.LayerNames`
    (a structural type: this module stays below ``files.py``, which imports it)."""

    packed: str
    block_scale: str
    tensor_scale: str
    input_scale: str
    scalar_shape: tuple[int, ...]

    @property
    def scalar_shapes(self) -> tuple[tuple[int, ...], ...]: ...

__all__ = [
    "DTYPE_BYTES",
    "LAYER_COUNT_KEYS",
    "config_problem",
    "header_problem",
    "input_problems",
    "scale_value_problem",
    "weight_problems",
]

#: Bytes per element of every safetensors dtype nvfp4lab reads (sub-byte F4 / F6 are not).
DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _entry_problem(name: str, entry: object) -> str | None:
    """What is wrong with one tensor's header entry on its own, or None."""
    if not isinstance(entry, dict):
        return (f"tensor {name!r}: its header entry is {entry!r} (a {type(entry).__name__}), "
                "not an object with dtype, shape and data_offsets")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        return f"tensor {name!r} has no {' or '.join(missing)} in the header"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        return (f"tensor {name!r} has dtype {dtype!r}, which nvfp4lab does not read (one of "
                f"{', '.join(DTYPE_BYTES)}; NVFP4 codes are stored as U8 [N, K/2], two per byte)")
    if not isinstance(shape, list) or not all(_int(d) and d >= 0 for d in shape):
        return (f"tensor {name!r} has shape {shape!r}; a shape is a list of non-negative "
                "integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_int, offsets))):
        return (f"tensor {name!r} has data_offsets {offsets!r}; expected [begin, end], two "
                "integer byte offsets")
    begin, end = offsets
    if begin < 0 or end < begin:
        return (f"tensor {name!r} has data_offsets {offsets!r}: negative or reversed (a byte "
                "range needs 0 <= begin <= end)")
    due = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != due:
        return (f"tensor {name!r} is {dtype} {shape}, {due} bytes, but its data_offsets "
                f"{offsets} hold {end - begin} bytes; the header does not match the data")
    return None


def header_problem(header: Mapping[str, Any]) -> str | None:
    """What is wrong with a safetensors header (the parsed JSON object), or None."""
    meta = header.get("__metadata__")
    if meta is not None and (not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        return (f"__metadata__ is {meta!r}; safetensors metadata is a flat object of strings "
                "(nested values are refused by the safetensors library)")
    ranges = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        problem = _entry_problem(name, entry)
        if problem is not None:
            return problem
        begin, end = entry["data_offsets"]
        ranges.append((begin, end, name))
    ranges.sort()
    reach, last = 0, ""
    for begin, end, name in ranges:
        if begin < reach and end > begin:
            return (f"tensors {last!r} (bytes up to {reach}) and {name!r} (bytes {begin}-{end}) "
                    "overlap in the data; every tensor needs its own byte range (the header "
                    "is corrupt)")
        if end > reach:
            reach, last = end, name
    return None


class _Stored(Protocol):
    """What the layer checks read of a stored tensor (a ``stream.TensorInfo``)."""

    dtype: str
    shape: tuple[int, ...]


def _scalar_problem(info: _Stored, leaf: str, what: str, names: LayerNames) -> str | None:
    if info.dtype != "F32" or tuple(info.shape) not in names.scalar_shapes:
        return (f"{what} {leaf} is {info.dtype} {list(info.shape)}; expected F32 "
                f"{list(names.scalar_shape)}")
    return None


def weight_problems(layer: str, names: LayerNames, tensors: Mapping[str, _Stored], *,
                    tensor_scale_optional: bool = False) -> list[str]:
    """What is wrong with the codes, block scales and tensor scale of the quantized Linear
    ``layer`` (``tensors``: stored name -> dtype and shape); [] when they can be decoded.
    ``tensor_scale_optional``: the format decodes a layer without a tensor scale with 1 (GGUF),
    so a missing one is not a problem here."""
    leaves = (names.packed, names.block_scale, names.tensor_scale)
    found = [tensors.get(f"{layer}.{leaf}") for leaf in leaves]
    missing = [leaf for leaf, info in zip(leaves, found, strict=True) if info is None
               and not (tensor_scale_optional and leaf == names.tensor_scale)]
    if missing:
        return [f"missing tensor(s) {', '.join(missing)}"]
    packed, scale, glob = found
    assert packed is not None and scale is not None
    if packed.dtype != "U8" or len(packed.shape) != 2:
        return [f"codes {names.packed} are {packed.dtype} {list(packed.shape)}; expected U8 "
                "[N, K/2] (two E2M1 codes per byte)"]
    n, k = packed.shape[0], 2 * packed.shape[1]
    if not n or not k:
        return [f"codes {names.packed} are U8 {list(packed.shape)}: no elements; an NVFP4 "
                f"weight has N >= 1 rows of K >= {_BLOCK} elements"]
    if k % _BLOCK:
        return [f"codes {names.packed} are U8 {list(packed.shape)}: K = {k} elements per row is "
                f"not a multiple of {_BLOCK} (an NVFP4 block holds {_BLOCK})"]
    out = []
    problem = None if glob is None else _scalar_problem(glob, names.tensor_scale,
                                                        "tensor scale", names)
    if problem:
        out.append(problem)
    plain = (n, k // _BLOCK)
    if scale.dtype != "F8_E4M3":
        out.append(f"block scales {names.block_scale} are {scale.dtype} {list(scale.shape)}; "
                   "expected F8_E4M3 (E4M3)")
    elif tuple(scale.shape) != plain:
        hint = (" (the 128x4-padded shape of the swizzled layout)"
                if tuple(scale.shape) == tuple(padded_scale_shape(*plain)) else "")
        out.append(f"block scales {names.block_scale} are {list(scale.shape)}{hint}; expected "
                   f"plain {list(plain)} for codes {list(packed.shape)}")
    return out


def input_problems(layer: str, names: LayerNames, tensors: Mapping[str, _Stored],
                   stores_input: bool | None) -> list[str]:
    """What is wrong with the input scale of ``layer``: not one float32 value, or present /
    absent against ``stores_input`` (the configuration's scheme; None: either)."""
    info = tensors.get(f"{layer}.{names.input_scale}")
    if info is None:
        if stores_input:
            return [f"missing tensor {names.input_scale}: the configuration's scheme (W4A4) "
                    "stores a static input scale per quantized layer"]
        return []
    if stores_input is False:
        return [f"tensor {names.input_scale} is stored but the configuration's scheme is "
                "weight-only (W4A16), which has no input scale"]
    problem = _scalar_problem(info, names.input_scale, "input scale", names)
    return [problem] if problem else []


#: The smallest float32 scale whose float32 reciprocal is finite: 1/x rounds to inf in float32
#: from 2**128 - 2**103 (halfway between FLT_MAX and 2**128) up, so x must exceed its inverse.
_RECIPROCAL_LIMIT = Fraction(1, 2**128 - 2**103)


def scale_value_problem(value: float, decode: bool) -> str | None:
    """What is wrong with a stored tensor or input scale ``value`` (``decode``: the format
    stores DECODE scales, amax/2688, else ENCODE, 2688/amax), or None: it must be finite and
    > 0, and its float32 reciprocal finite (every format reads or writes the other convention
    by that reciprocal: a denormal 1e-44 would become inf)."""
    what = "DECODE form, amax/2688" if decode else "ENCODE form, 2688/amax"
    if not (math.isfinite(value) and value > 0):
        return f"must be finite and > 0 ({what}), got {value}"
    if Fraction(value) <= _RECIPROCAL_LIMIT:
        return (f"is {value:.6g}, whose float32 reciprocal overflows to inf ({what}); a scale "
                f"needs 1/scale finite in float32 (> {float(_RECIPROCAL_LIMIT):.6g})")
    return None


#: Config keys that count a model's repeated layers (transformers' names and attribute maps).
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _layers_held(names: Iterable[str]) -> int:
    """Layers the tensor names hold: their largest integer name component + 1 (0 if none)."""
    top = -1
    for name in names:
        for part in name.split("."):
            if part.isascii() and part.isdigit() and len(part) < 10:
                top = max(top, int(part))
    return top + 1


#: Layers a config may count beyond those the tensor names hold: models that share one stored
#: layer (ALBERT: 12 layers, one group stored) or a partial checkpoint stay readable (``load``
#: then names a missing tensor), while building them costs at most a few MB.
LAYER_SLACK = 256


def config_problem(config: Mapping[str, Any], names: Iterable[str]) -> str | None:
    """What is wrong with a model's config against the stored tensor ``names``, before anything
    is built per layer (transformers builds every layer the config counts, ~15 KB each even on
    the meta device: 1,000,000 layers grew 15 MB/s until killed), or None: a layer count
    (:data:`LAYER_COUNT_KEYS`, also in ``text_config``) more than :data:`LAYER_SLACK` above the
    layers the names hold (their largest layer index + 1)."""
    held: int | None = None
    for where in (config, config.get("text_config")):
        if not isinstance(where, Mapping):
            continue
        for key in LAYER_COUNT_KEYS:
            claimed = where.get(key)
            if not _int(claimed):
                continue
            if held is None:
                held = _layers_held(names)
            if claimed > held + LAYER_SLACK:
                shown = (f"layers 0-{held - 1} ({held})" if held else "no numbered layer")
                return (f"{key} is {claimed} but the weights hold {shown}; the config does not "
                        f"describe these weights (fix {key})")
    return None
