"""FP-Quant's per-layer Hadamard matrices: stored, read, and translated to and from
compressed-tensors' transforms (one job of :mod:`nvfp4lab.checkpoint.formats.fp_quant`).

What FP-Quant stores per quantized Linear ``<layer>`` (read from FP-Quant's exporter
``src/quantization/gptq.py`` and ``transforms.get_transform_matrix`` at IST-DASLab/FP-Quant
d2e3092, its inference library ``fp_quant/module/linear.py``, and vLLM 0.33's
``quantization/fp_quant.py``):

* ``<layer>.forward_hadamard_matrix``: ``[h, h]`` in the model dtype (bfloat16: both engines run
  FP-Quant in bfloat16 only), ``h = hadamard_group_size``, the NORMALIZED matrix ``H = M /
  sqrt(h)`` (``M`` ±1: Sylvester's for ``transform_init`` "hadamard", its column-sorted form for
  "gsr", the identity ``I`` for "identity"). vLLM's ``fusedQuantizeNv(x, H, act_global_scale)``
  rotates each block of ``h`` input elements, ``x_b -> x_b H``, then quantizes; the stored codes
  are those of the weights rotated the same way, ``W_b H`` (the exporter fuses it offline).
* ``<layer>.backward_hadamard_matrix``: the same matrix (a copy; only training uses it).

So one layer's rotation is nvfp4lab's :class:`~nvfp4lab.hadamard.BlockRotation` of size ``h``
with the ±1 matrix ``M = round(H sqrt(h))`` (``x -> x · blockdiag(M) / sqrt(h)``), or none for
``I``. nvfp4lab computes it in float32 (``precision``: FP-Quant stores none; its engines use the
bfloat16 ``H``, whose entries ±1/sqrt(h) are exact for h = 16 and 64 and rounded for 32 and
128). ``read_weights`` presents a rotated layer's matrix as compressed-tensors names it,
``<layer>.<group>_input.weight`` float32 ±1 (:class:`PlusMinusOne` reads it from the stored
bfloat16 ``H``), so that ``load`` and ``convert`` to compressed-tensors handle it as they handle
a ``transform_config``; an identity matrix and every backward copy are checked and then not
presented (nothing to run).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from nvfp4lab.checkpoint.formats.transforms import (
    NO_ROTATION,
    LayerRotation,
    read_transform_config,
    transform_config,
    transform_tensors,
)
from nvfp4lab.checkpoint.records import StoredTensor, TensorInfo
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.checkpoint.rows import RowReader, read_rows
from nvfp4lab.hadamard import CT_KINDS, BlockRotation, ct_rotation, sylvester_matrix
from nvfp4lab.vocab import CheckpointFormat

__all__ = [
    "BACKWARD",
    "FORWARD",
    "GROUP_SIZES",
    "MATRIX_DTYPE",
    "PlusMinusOne",
    "audit_rotations",
    "ct_names",
    "layer_rotations",
    "matrix_rotation",
    "model_matrices",
    "normalized",
    "rotation_config",
    "source_rotations",
]

FORWARD = "forward_hadamard_matrix"
BACKWARD = "backward_hadamard_matrix"
#: ``hadamard_group_size`` values transformers' ``FPQuantConfig`` accepts with NVFP4 forward.
GROUP_SIZES: tuple[int, ...] = (16, 32, 64, 128)
#: The dtype FP-Quant's engines hold the matrices in (vLLM: the layer's bfloat16 params).
MATRIX_DTYPE = torch.bfloat16
_NO_PRECISION = ("FP-Quant stores no rotation precision (its engines multiply by the bfloat16 "
                 "matrix; nvfp4lab reads it back as float32)")


def normalized(rotation: BlockRotation | None, size: int) -> torch.Tensor:
    """The stored matrix: ``M / sqrt(size)`` (identity for None), bfloat16 ``[size, size]``,
    each entry rounded once from float64."""
    if rotation is None:
        return torch.eye(size, dtype=MATRIX_DTYPE)
    return (rotation.matrix(torch.float64) / math.sqrt(size)).to(MATRIX_DTYPE)


def _entry(size: int, dtype: torch.dtype) -> set[float]:
    """The magnitudes ``1/sqrt(size)`` may have in ``dtype`` (rounded once from float64, or
    through float32 as a float32 transform writes it)."""
    exact = torch.tensor(1 / math.sqrt(size), dtype=torch.float64)
    return {float(exact.to(dtype)), float(exact.to(torch.float32).to(dtype))}


def matrix_rotation(value: torch.Tensor, where: str) -> BlockRotation | None:
    """The rotation a stored ``[h, h]`` matrix means: None for the identity, else the
    :class:`BlockRotation` of its signs; CheckpointError naming ``where`` (file: tensor) for
    anything else (another magnitude, a matrix that is not ±1/sqrt(h) Hadamard)."""
    h = value.shape[0]
    if torch.equal(value.to(torch.float64), torch.eye(h, dtype=torch.float64)):
        return None
    magnitudes = set(value.abs().to(torch.float64).unique().tolist())
    allowed = _entry(h, value.dtype)
    if len(magnitudes) != 1 or not magnitudes <= allowed:
        shown = ", ".join(f"{m:.9g}" for m in sorted(magnitudes)[:3])
        raise CheckpointError(
            f"{where} holds entries of magnitude {shown}; an FP-Quant matrix is the identity or "
            f"a Hadamard matrix normalized by 1/sqrt({h}) = {min(allowed):.9g} in {value.dtype}")
    signs = torch.sign(value.to(torch.float64))
    kind = "hadamard" if torch.equal(signs.to(torch.int64), sylvester_matrix(h)) else (
        "random-hadamard")
    try:
        return BlockRotation.from_matrix(kind, signs)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc


@dataclass(frozen=True)
class PlusMinusOne:
    """A stored normalized matrix read as compressed-tensors stores its transform: float32 ±1
    (a :class:`~nvfp4lab.checkpoint.records.RowView`; ``stored``: the matrix on disk, already
    checked by :func:`matrix_rotation`)."""

    stored: TensorInfo

    def rows(self, start: int, stop: int) -> torch.Tensor:
        with RowReader(self.stored) as reader:
            value = reader.rows()
        return torch.sign(value.to(torch.float64)).to(torch.float32)[start:stop]


def ct_names(rotations: Mapping[str, BlockRotation]) -> dict[str, str]:
    """Layer -> ``<layer>.<group>_input.weight``: the compressed-tensors name of each rotated
    layer's matrix, groups assigned as :func:`~nvfp4lab.checkpoint.formats.transforms.
    transform_config` assigns them (one per distinct rotation, in layer order)."""
    held = {name: SimpleNamespace(hadamard=rot) for name, rot in rotations.items()}
    keys = transform_tensors(held)  # type: ignore[arg-type]
    out: dict[str, str] = {}
    for key in keys:
        layer = key.rsplit(".", 2)[0]
        out[layer] = key
    return out


def rotation_config(rotations: Mapping[str, BlockRotation], target: CheckpointFormat,
                    where: Path) -> dict[str, Any] | None:
    """The ``transform_config`` a converted compressed-tensors checkpoint needs for
    ``rotations`` (None: none rotated); CheckpointError naming ``where`` (the source) when
    ``target`` holds no rotation."""
    if not rotations:
        return None
    if target in NO_ROTATION:
        first = next(iter(rotations))
        raise CheckpointError(
            f"{where}: its {FORWARD} tensors rotate inputs online ({len(rotations)} layer(s), e.g. "
            f"{first!r}) and {NO_ROTATION[target]}; nothing was converted")
    if target != CheckpointFormat.COMPRESSED_TENSORS:
        return None
    held = {name: SimpleNamespace(hadamard=rot) for name, rot in rotations.items()}
    return transform_config(held)  # type: ignore[arg-type]


def layer_rotations(tensors: Mapping[str, TensorInfo], quantized: Iterable[str],
                    read: Any) -> dict[str, LayerRotation]:
    """Layer -> its :class:`LayerRotation`, from the ``<layer>.<group>_input.weight`` tensors
    ``read_weights`` presents (``read(key)``: the float32 ±1 matrix)."""
    out: dict[str, LayerRotation] = {}
    layers = set(quantized)
    for key, (layer, group) in _presented(tensors).items():
        if layer in layers:
            matrix = read(key)
            out[layer] = LayerRotation(layer, group, BlockRotation.from_matrix(_kind(matrix),
                                                                               matrix), key)
    return out


def _presented(tensors: Iterable[str]) -> dict[str, tuple[str, str]]:
    """``<layer>.<group>_input.weight`` key -> (layer, group), for every such name."""
    out: dict[str, tuple[str, str]] = {}
    for key in tensors:
        if key.endswith("_input.weight"):
            layer, _, leaf = key.removesuffix(".weight").rpartition(".")
            out[key] = (layer, leaf.removesuffix("_input"))
    return out


def _kind(matrix: torch.Tensor) -> str:
    h = matrix.shape[0]
    same = torch.equal(matrix.to(torch.int64), sylvester_matrix(h)) if h & (h - 1) == 0 else False
    return "hadamard" if same else "random-hadamard"


def model_matrices(quantized: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``save_pretrained``'s FP-Quant tensors of the model's quantized layers: every layer's
    forward and backward matrix (the identity for an unrotated layer), bfloat16 ``[h, h]``;
    ValueError for rotations FP-Quant cannot hold (sizes that differ or are not 16/32/64/128,
    a precision other than float32)."""
    rotations = {n: m.hadamard for n, m in quantized.items()
                 if isinstance(getattr(m, "hadamard", None), BlockRotation)}
    size = check_sizes({n: r.size for n, r in rotations.items()}, ValueError)
    for name, rot in rotations.items():
        if rot.precision != torch.float32:
            raise ValueError(f"{name!r} is rotated with precision {rot.precision} "
                             f"(hadamard={rot!r}): {_NO_PRECISION}; rotate with "
                             "precision=torch.float32 or save as compressed-tensors")
    out: dict[str, torch.Tensor] = {}
    for name in quantized:
        matrix = normalized(rotations.get(name), size)
        out[f"{name}.{FORWARD}"] = matrix
        out[f"{name}.{BACKWARD}"] = matrix.clone()
    return out


def check_sizes(sizes: Mapping[str, int], error: type[Exception]) -> int:
    """The one ``hadamard_group_size`` of rotations of ``sizes`` (16 when none is rotated);
    ``error`` when they differ or FP-Quant has no such size."""
    found = sorted(set(sizes.values()))
    if len(found) > 1:
        layers = {s: next(n for n, v in sizes.items() if v == s) for s in found}
        shown = ", ".join(f"{s} ({layers[s]!r})" for s in found)
        raise error(f"the rotations have blocks of different sizes ({shown}); an FP-Quant "
                    "checkpoint has one hadamard_group_size for every layer")
    size = found[0] if found else GROUP_SIZES[0]
    if size not in GROUP_SIZES:
        raise error(f"a rotation of block {size} (e.g. {next(iter(sizes))!r}); FP-Quant's NVFP4 "
                    f"hadamard_group_size is one of {', '.join(map(str, GROUP_SIZES))} "
                    "(transformers' FPQuantConfig)")
    return size


def _matches(name: str, targets: Iterable[str]) -> bool:
    """compressed-tensors' target rule on a quantized Linear's name (no model is built in a
    conversion): its class ``Linear``, a ``re:`` pattern (``re.match``) or the exact name."""
    return any(t == "Linear" or t == name or (t.startswith("re:") and re.match(t[3:], name))
               for t in targets)


def _stored(tensors: Mapping[str, StoredTensor], key: str) -> torch.Tensor | None:
    held = tensors.get(key)
    return None if held is None else read_rows(held).to(torch.float64)


def source_rotations(source: Path | None, layers: Iterable[str],
                     tensors: Mapping[str, StoredTensor]) -> tuple[dict[str, BlockRotation],
                                                                    set[str]]:
    """(layer -> rotation, the transform tensors to drop) of a compressed-tensors source being
    converted: its ``transform_config``'s online input transforms on the quantized ``layers``,
    each layer's matrix as stored among ``tensors`` (``<layer>.<group>_input.weight``), else the
    group's stored one, else compressed-tensors' own. CheckpointError for what FP-Quant cannot
    hold: online output / q_attn / k_cache transforms, ``randomize``, a precision other than
    float32 (:func:`check_sizes` then checks the blocks)."""
    config = read_transform_config(source) if source is not None and source.is_dir() else None
    if config is None:
        return {}, set()
    where = f"{source}: its transform_config"
    layers = list(layers)
    out: dict[str, BlockRotation] = {}
    drop = {k for k in tensors for g in config.config_groups
            if re.fullmatch(rf".*\.{re.escape(g)}_[a-z_]+\.weight", k)}
    for group, scheme in config.config_groups.items():
        online = [a for a in scheme.apply if a.is_online()]
        bad = [getattr(a.location, "value", a.location) for a in online]
        if any(loc != "input" for loc in bad) or (online and scheme.randomize):
            raise CheckpointError(f"{where} group {group!r} applies online {bad} transforms "
                                  f"(randomize={scheme.randomize}); FP-Quant holds one online "
                                  "input rotation per layer; nothing was converted")
        if online and (scheme.type not in CT_KINDS or scheme.precision != torch.float32):
            raise CheckpointError(f"{where} group {group!r} is {scheme.type} with precision "
                                  f"{scheme.precision}: {_NO_PRECISION}; nothing was converted")
        shared: dict[int, BlockRotation] = {}
        chosen: dict[str, int] = {}
        for args in online:
            for name in layers:
                if _matches(name, args.targets) and not _matches(name, args.ignore):
                    chosen[name] = scheme.head_dim or 0
                    value = _stored(tensors, f"{name}.{group}_input.weight")
                    if value is not None:
                        rot = BlockRotation.from_matrix(scheme.type, value)
                        out[name] = shared.setdefault(rot.size, rot)
        for name, size in chosen.items():
            if name not in out:
                size = size or next(iter(shared), 0)
                if size not in shared:
                    shared[size] = ct_rotation(scheme.type, size)
                out[name] = shared[size]
    return out, drop


def audit_rotations(layers: Iterable[str], tensors: Mapping[str, TensorInfo],
                    size: int) -> dict[str, tuple[str, str]]:
    """Layer -> (``transform`` column, issue) for ``nvfp4lab audit``: the online input rotation
    a layer's ``forward_hadamard_matrix`` holds, or "none (identity)"."""
    out: dict[str, tuple[str, str]] = {}
    keys = {layer: key for key, (layer, _) in _presented(tensors).items()}
    for layer in layers:
        key = keys.get(layer)
        if key is None:
            out[layer] = (f"none (identity {FORWARD} {size}x{size})", "")
            continue
        with RowReader(tensors[key]) as reader:
            kind = _kind(reader.rows())
        out[layer] = (f"input {kind} {size} ({FORWARD}, online, bfloat16 on disk)", "")
    return out
