"""``nvfp4lab audit``: per-layer checks of an NVFP4 checkpoint, streamed, for any size.

:func:`audit` reads the safetensors headers (:func:`~nvfp4lab.checkpoint.stream.inventory`),
then audits each quantized Linear (a fused q/k/v or gate/up group together) as one task on a
process pool or a Dask cluster; a task reads its tensors a few rows at a time from memory-mapped
files, so memory stays near the interpreter plus a few chunks whatever the checkpoint size, and
no model is built. One row per quantized layer:

* format: codes uint8 ``[N, K/2]``, block scales float8_e4m3fn ``[N, K/16]`` (a 128x4-padded
  shape means the swizzled layout), one float32 tensor scale (and input scale);
* tensor scale: finite and > 0; in the format's scale form (``scale_form``: ``encode``,
  ``2688/amax``, or ``decode``, ``amax/2688``; the column was ``convention`` before). Decoded
  weights have ``|W|max = max_b(|code|max * s_b) * d`` with ``d`` the DECODE scale. A value
  stored in the wrong form swaps ``d`` and ``1/d``: the two readings give ``|W|max`` whose
  product is about ``(6*448)^2``, so the reading with ``d > 1`` (|W|max above ~2688,
  implausible for weights) is flagged, with what its reciprocal would give; with
  ``--reference`` the float weights' amax decides;
* block scales: NaN, negative and zero counts (zero scales over nonzero codes lose the codes),
  fraction saturated at 448 and underflowed (at or below 2^-9), range (min nonzero, max);
* block scales piled at E4M3's floor (``floor_frac``): among the blocks that hold a nonzero
  code, the share whose E4M3 scale is subnormal or zero (below 2^-6, E4M3's smallest normal:
  3 significant bits or fewer, down to 2^-9, the smallest subnormal), flagged above
  :data:`FLOOR_LIMIT`. A tensor scale chosen for the tensor puts the largest block scales near
  448; with tensor scale 1 (a "naive" GGUF) weights of |w| < 0.09 give block scales
  ``amax_b/6 < 2^-6``, so nearly every block lands there and keeps fewer scale bits;
* a missing tensor scale, in a format where that is allowed (GGUF without a ``<name>.scale``
  sidecar: decoded with 1, the format's ``optional_tensor_scale`` note says why it matters);
* layout: real weight matrices have row and column structure, so the log block scales follow an
  additive row + column model closely (R²). Scales stored swizzled but read as plain scatter
  each 128x4 tile across rows and columns and lose that fit; unswizzling them restores it. The
  layer is flagged when unswizzling raises R² by :data:`SWIZZLE_GAIN` to at least
  :data:`SWIZZLE_MIN_R2` (unstructured, e.g. i.i.d. random, weights never are);
* fused groups whose tensor scales differ, in formats whose engine merges them
  (``shares_fused_scales``; llama.cpp keeps one scale per tensor): the extra error vLLM's
  max-merge causes in each shard, computed exactly (:mod:`nvfp4lab.execution.shared_scales`:
  its merged scale and its decode);
* a mixed checkpoint's FP8 / MXFP4 layers, after the NVFP4 rows (format ``fp8``,
  ``fp8-w8a16``, ``mxfp4``; a ModelOpt MIXED_PRECISION checkpoint's FP8_PER_CHANNEL_PER_TOKEN
  layers too: scale range and bad scales, decoded amax, NaN codes;
  :func:`~nvfp4lab.checkpoint.mixed_layers.audit_mixed_rows`), and a GGUF mix's Q8_0 layers
  (format ``q8_0``: block-scale range and non-finite scales; no vLLM kernel columns);
* the kernel vLLM would run the layer on for each of ``gpus`` (:func:`~nvfp4lab.select_backend`;
  it describes the scheme, whatever engine the format is for; FP8 / MXFP4 layers: vLLM 0.33.0's,
  "not modelled: ..." for another release);
* with ``reference`` (a float checkpoint folder): the weight SQNR against ``<layer>.weight``.
* with a compressed-tensors ``transform_config``, a ``transform`` column: each layer's online
  input rotation (type, block, group, precision, matrix stored or built) and the offline
  transforms fused into its stored weights, with issues for a matrix that is not ±1 Hadamard,
  an online transform nvfp4lab does not run and a bias vLLM 0.33 drops under a transform
  (:mod:`~nvfp4lab.checkpoint.formats.transforms`);
* a quantized KV cache (rows after the Linear rows, one per attention layer: ``kv_cache``,
  ``k_scale``, ``v_scale``): the kind a vLLM 0.33 release runs, scales present for every
  attention layer, finite and > 0 (:mod:`nvfp4lab.checkpoint.kv_scales`).

``issues`` lists what is wrong in words ("" when nothing is). The dtypes and shapes above and
the presence of input scales (as the configuration's scheme says) are checked by the validator
``load`` and ``convert`` share (:mod:`~nvfp4lab.checkpoint.validation`), and so are the values
of the tensor and input scales (finite, > 0, a float32 reciprocal that does not overflow: the
words ``load`` and ``convert`` refuse them in). What makes the whole folder unreadable is an
error (CheckpointError naming the file), not a row: a configuration the format's
``read_config`` refuses (another ``quant_algo``, two ModelOpt configs that disagree, layers
mixing schemes, ...), a model config that counts more layers than the tensors hold, and a
header that is not valid (safetensors offsets, dtypes, shapes, metadata; a GGUF file's counts,
offsets, or tensors that disagree with its config).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nvfp4lab.checkpoint.formats import CheckpointFormatSpec, detect_format, format_spec
from nvfp4lab.checkpoint.formats.compressed_tensors import group_kind
from nvfp4lab.checkpoint.formats.modelopt import FP8_ALGO
from nvfp4lab.checkpoint.formats.transforms import audit_transforms
from nvfp4lab.checkpoint.kv_scales import kv_cache_names, kv_rows
from nvfp4lab.checkpoint.mixed_layers import audit_mixed_rows
from nvfp4lab.checkpoint.records import LayerNames
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.checkpoint.stream import Inventory, RowReader, TensorInfo, inventory, read_scalar
from nvfp4lab.checkpoint.stream import run_tasks as _run_tasks
from nvfp4lab.checkpoint.validation import input_problems, scale_value_problem, weight_problems
from nvfp4lab.constants import BLOCK_SIZE, E4M3_MAX
from nvfp4lab.e2m1 import decode_e2m1, unpack_fp4
from nvfp4lab.execution import vllm_rules
from nvfp4lab.execution.whole_model import FUSED_GROUPS
from nvfp4lab.layout import unswizzle_scales
from nvfp4lab.tensor import NVFP4Tensor, invalid_block_scales
from nvfp4lab.vocab import CheckpointFormat, LayerFormat, Scheme

__all__ = ["COLUMNS", "DEFAULT_GPUS", "audit", "audit_rows", "write_csv"]

#: GPUs whose vLLM kernel choice is reported by default (one per NVFP4 kernel family).
DEFAULT_GPUS: tuple[str, ...] = ("A100 SXM 80GB", "H100 SXM", "B200", "RTX 5090")
SATURATED_LIMIT = 0.05  #: flag above this fraction of blocks at 448
UNDERFLOW_LIMIT = 0.05  #: flag above this fraction of blocks at or below 2^-9
FLOOR_LIMIT = 0.05  #: flag above this fraction of nonzero blocks with a scale below 2^-6
#: E4M3's smallest normal value: scales below it are subnormal (3 significant bits or fewer)
E4M3_MIN_NORMAL = 2.0**-6
SQNR_LIMIT_DB = 15.0  #: flag a weight SQNR below this (NVFP4 round-to-nearest gives ~20 dB)
SWIZZLE_GAIN = 0.15
SWIZZLE_MIN_R2 = 0.3
#: Elements decoded at a time (float32: 8 MiB per temporary).
CHUNK_ELEMENTS = 1 << 21
#: The columns of every row, in order; then one ``vllm <release> on <gpu>`` column per GPU,
#: then ``issues``. Values a layer does not have are None.
COLUMNS: tuple[str, ...] = (
    "layer", "format", "scheme", "shape", "scale_form", "tensor_scale", "input_scale",
    "decoded_amax", "scale_min", "scale_max", "scale_range_binades", "nan_scales",
    "negative_scales", "zero_scales", "saturated_frac", "underflow_frac", "floor_frac",
    "layout_r2",
    "layout_r2_unswizzled", "fused_group", "fused_shared", "merge_factor", "merge_sqnr_db",
    "weight_sqnr_db", "reference_amax", "kv_cache", "k_scale", "v_scale",
)


@dataclass(frozen=True)
class _Task:
    """One layer, or one fused group, with the tensor locations it needs."""

    fmt: CheckpointFormat
    layers: tuple[str, ...]
    tensors: dict[str, TensorInfo]
    reference: dict[str, TensorInfo | None]
    fused: bool
    stores_input: bool | None = None  # the config's scheme: W4A4 (True), W4A16 (False)


@dataclass
class _Layer:
    """What one task learns about one layer: the row, and what the merge check needs."""

    name: str
    row: dict[str, Any]
    issues: list[str] = field(default_factory=list)
    n: int = 0
    k: int = 0
    stored: float = math.nan  # the tensor scale as stored
    decode: float = math.nan  # its DECODE reading (amax/2688)


def _info(task: _Task, layer: str, leaf: str) -> TensorInfo | None:
    return task.tensors.get(f"{layer}.{leaf}")


def _check_structure(task: _Task, lay: _Layer, spec: CheckpointFormatSpec) -> bool:
    """Dtypes and shapes (the shared validator, :mod:`~nvfp4lab.checkpoint.validation`); sets
    ``lay.n``, ``lay.k``. False when the layer cannot be decoded."""
    names = spec.names
    problems = weight_problems(lay.name, names, task.tensors,
                               tensor_scale_optional=spec.optional_tensor_scale is not None)
    packed = _info(task, lay.name, names.packed)
    if packed is not None and packed.dtype == "U8" and len(packed.shape) == 2:
        lay.row["shape"] = f"{packed.shape[0]}x{2 * packed.shape[1]}"
    inputs = input_problems(lay.name, names, task.tensors, task.stores_input)
    lay.issues.extend(problems + inputs)
    inp = _info(task, lay.name, names.input_scale)
    if inp is not None and not inputs:
        lay.row["input_scale"] = read_scalar(inp)
        problem = scale_value_problem(lay.row["input_scale"], names.decode_form)
        if problem is not None:  # load's and convert's refusal
            lay.issues.append(f"input scale {names.input_scale} {problem}")
    if problems:
        return False
    assert packed is not None
    lay.n, lay.k = packed.shape[0], 2 * packed.shape[1]
    return True


def _r2(logs: torch.Tensor) -> float:
    """R² of the additive row + column model of a 2-D float64 tensor."""
    grand = logs.mean()
    fit = logs.mean(1, keepdim=True) + logs.mean(0, keepdim=True) - grand
    total = float(((logs - grand) ** 2).sum())
    return 1.0 - float(((logs - fit) ** 2).sum()) / total if total > 0 else math.nan


def _swizzle_fit(scales: torch.Tensor) -> tuple[float, float]:
    """(R² as stored, R² unswizzled) of the log2 block scales; NaN when no 128x4 tile fits."""
    rows, cols = scales.shape
    if rows % 128 or cols % 4 or not rows or not cols:
        return math.nan, math.nan
    as_is = scales.to(torch.float64).clamp_min(2.0**-9).nan_to_num(2.0**-9).log2()
    un = unswizzle_scales(scales, rows, cols).to(torch.float64).clamp_min(2.0**-9)
    return _r2(as_is), _r2(un.nan_to_num(2.0**-9).log2())


def _scale_stats(lay: _Layer, scales: torch.Tensor) -> None:
    raw = scales.view(torch.uint8)
    values = scales.to(torch.float32)
    nan, negative, _ = invalid_block_scales(scales)
    count = max(values.numel(), 1)
    valid = values[torch.isfinite(values) & (values > 0)]
    lay.row.update(
        nan_scales=nan, negative_scales=negative, zero_scales=int(((raw & 0x7F) == 0).sum()),
        saturated_frac=int((raw == 0x7E).sum()) / count,
        underflow_frac=int(((raw & 0x7F) <= 1).sum()) / count,
        scale_min=float(valid.min()) if valid.numel() else math.nan,
        scale_max=float(valid.max()) if valid.numel() else math.nan,
    )
    if valid.numel():
        lay.row["scale_range_binades"] = math.log2(lay.row["scale_max"] / lay.row["scale_min"])
    if nan or negative:
        lay.issues.append(f"{nan} NaN and {negative} negative block scale(s)")
    for key, limit, text in (
        ("saturated_frac", SATURATED_LIMIT, "saturated at 448 (tensor scale too large: clipped)"),
        ("underflow_frac", UNDERFLOW_LIMIT, "underflowed to <= 2^-9 (tensor scale too small)"),
    ):
        if lay.row[key] > limit:
            lay.issues.append(f"{100 * lay.row[key]:.1f}% of blocks {text}")
    stored, plain = _swizzle_fit(scales)
    lay.row.update(layout_r2=stored, layout_r2_unswizzled=plain)
    if plain >= SWIZZLE_MIN_R2 and plain - stored >= SWIZZLE_GAIN:
        lay.issues.append(f"block scales look swizzled (128x4 layout) where plain is expected: "
                          f"unswizzling raises the row/column fit R² from {stored:.2f} to "
                          f"{plain:.2f}")


def _decoder(lay: _Layer, spec: CheckpointFormatSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(ENCODE global scale, exact DECODE scale or None) to decode with."""
    return spec.from_disk(torch.tensor([lay.stored], dtype=torch.float32))


def _stream_layer(task: _Task, lay: _Layer, spec: CheckpointFormatSpec) -> None:
    """Decoded |W|max, zero scales over nonzero codes and (with a reference) the SQNR, reading
    ``CHUNK_ELEMENTS`` at a time."""
    names = spec.names
    gs, decode = _decoder(lay, spec)
    ref_info = task.reference.get(lay.name)
    if lay.name in task.reference and ref_info is None:
        lay.issues.append(f"the reference has no {lay.name}.weight")
    elif ref_info is not None and ref_info.shape != (lay.n, lay.k):
        lay.issues.append(f"the reference weight is {list(ref_info.shape)}, expected "
                          f"{[lay.n, lay.k]}")
        ref_info = None
    step = max(1, CHUNK_ELEMENTS // max(lay.k, 1))
    code_max, lost, ref_amax, signal, noise = 0.0, 0, 0.0, 0.0, 0.0
    nonzero, floor = 0, 0
    with RowReader(task.tensors[f"{lay.name}.{names.packed}"]) as pr, \
            RowReader(task.tensors[f"{lay.name}.{names.block_scale}"]) as sr:
        ref = RowReader(ref_info) if ref_info is not None else None
        for start in range(0, lay.n, step):
            packed, scales = pr.rows(start, start + step), sr.rows(start, start + step)
            values = decode_e2m1(unpack_fp4(packed), torch.float32).abs()
            block_max = values.reshape(*scales.shape, BLOCK_SIZE).amax(-1)
            s = scales.to(torch.float32)
            code_max = max(code_max, float(torch.nan_to_num(block_max * s, nan=0.0).max()))
            lost += int(((s == 0) & (block_max > 0)).sum())
            nonzero += int((block_max > 0).sum())
            floor += int(((block_max > 0) & ~(s >= E4M3_MIN_NORMAL)).sum())
            if ref is not None:
                w = ref.rows(start, start + step).to(torch.float64)
                q = NVFP4Tensor(packed, scales, gs, check_scales=False, decode_scale=decode)
                signal += float((w * w).sum())
                noise += float(((w - q.dequantize(torch.float32).double()) ** 2).sum())
                ref_amax = max(ref_amax, float(w.abs().max()))
        if ref is not None:
            ref.close()
    lay.row["decoded_amax"] = code_max * lay.decode
    lay.row["floor_frac"] = floor / nonzero if nonzero else 0.0
    if lay.row["floor_frac"] > FLOOR_LIMIT:
        lay.issues.append(
            f"block scales piled at E4M3's floor: {100 * lay.row['floor_frac']:.1f}% of nonzero "
            "blocks have a subnormal or zero scale (< 2^-6; the tensor scale is too small or "
            "missing)")
    if lost:
        lay.issues.append(f"{lost} block(s) have scale 0 over nonzero codes (decoded as 0)")
    if ref is not None:
        _reference_checks(lay, signal, noise, ref_amax, code_max)


def _reference_checks(lay: _Layer, signal: float, noise: float, ref_amax: float,
                      code_max: float) -> None:
    sqnr = math.inf if noise == 0 else 10 * math.log10(signal / noise) if signal else -math.inf
    lay.row.update(weight_sqnr_db=sqnr, reference_amax=ref_amax)
    if sqnr < SQNR_LIMIT_DB:
        lay.issues.append(f"weight SQNR {sqnr:.1f} dB against the reference (NVFP4 "
                          "round-to-nearest gives about 20 dB)")
    if ref_amax > 0 and code_max > 0 and lay.decode > 0:
        flipped = code_max / lay.decode
        if abs(math.log2(lay.row["decoded_amax"] / ref_amax)) > 1 >= abs(
                math.log2(flipped / ref_amax)):
            lay.issues.append(f"the reference |W|max is {ref_amax:.4g}: the tensor scale "
                              "matches it only in the other form (its reciprocal)")


def _scale_form_check(lay: _Layer, names: LayerNames) -> None:
    """Flag a tensor scale whose DECODE reading exceeds 1 (|W|max above the block scales'
    reach, see the module docstring); also NaN, infinite, zero and negative values."""
    problem = scale_value_problem(lay.stored, names.decode_form)  # load's and convert's refusal
    if problem is not None:
        lay.issues.append(f"tensor scale {names.tensor_scale} {problem}")
        return
    lay.decode = lay.stored if names.decode_form else 1.0 / lay.stored
    if lay.decode > 1.0:
        expected = "DECODE (amax/2688)" if names.decode_form else "ENCODE (2688/amax)"
        other = "ENCODE" if names.decode_form else "DECODE"
        lay.issues.append(
            f"tensor scale {lay.stored:.6g} looks like an {other} scale stored where the "
            f"{expected} one is expected: it decodes |W| up to {lay.decode * 6 * E4M3_MAX:.4g} "
            f"(up to {6 * E4M3_MAX / lay.decode:.4g} read as its reciprocal)"
        )


def _audit_layer(task: _Task, name: str) -> _Layer:
    spec = format_spec(task.fmt)
    names = spec.names
    lay = _Layer(name, {"layer": name, "format": task.fmt.value})
    has_input = _info(task, name, names.input_scale) is not None
    lay.row["scheme"] = (Scheme.NVFP4 if has_input else Scheme.NVFP4A16).value
    if not _check_structure(task, lay, spec):
        return lay
    stored = _info(task, name, names.tensor_scale)
    lay.row["scale_form"] = "decode" if names.decode_form else "encode"
    if stored is None:  # allowed by the format (validated above): decoded with 1
        lay.stored = 1.0
        lay.issues.append(str(spec.optional_tensor_scale))
    else:
        lay.stored = read_scalar(stored)
        lay.row["tensor_scale"] = lay.stored
    _scale_form_check(lay, names)
    with RowReader(task.tensors[f"{name}.{names.block_scale}"]) as reader:
        _scale_stats(lay, reader.rows())
    if math.isfinite(lay.decode):
        try:
            _stream_layer(task, lay, spec)
        except CheckpointError:
            # codes a format cannot give beside NaN or negative block scales (GGUF: ggml and
            # E4M3 read those bytes differently; load and convert refuse them): flagged above
            if not (lay.row["nan_scales"] or lay.row["negative_scales"]):
                raise
    return lay


def _merge_cost(task: _Task, layers: list[_Layer]) -> None:
    """Per shard of an unshared fused group: vLLM's merged decode scale and the weight SQNR of
    the shard decoded with it against its own (:mod:`nvfp4lab.execution.shared_scales`)."""
    from nvfp4lab.execution.shared_scales import decode_with

    spec = format_spec(task.fmt)
    names = spec.names
    ok = [lay for lay in layers if math.isfinite(lay.decode) and lay.n]
    if len(ok) != len(layers) or len({lay.stored for lay in ok}) == 1:
        return
    merged = spec.fused_decode_scale([lay.stored for lay in ok])
    for lay in ok:
        gs, decode = _decoder(lay, spec)
        own = decode if decode is not None else torch.reciprocal(gs)
        signal = noise = 0.0
        step = max(1, CHUNK_ELEMENTS // lay.k)
        with RowReader(task.tensors[f"{lay.name}.{names.packed}"]) as pr, \
                RowReader(task.tensors[f"{lay.name}.{names.block_scale}"]) as sr:
            for start in range(0, lay.n, step):
                t = NVFP4Tensor(pr.rows(start, start + step), sr.rows(start, start + step), gs,
                                check_scales=False)
                a, b = decode_with(t, own).double(), decode_with(t, merged).double()
                signal, noise = signal + float((a * a).sum()), noise + float(((a - b) ** 2).sum())
        factor = float(merged.double() / own.double())
        sqnr = math.inf if noise == 0 else 10 * math.log10(signal / noise)
        lay.row.update(merge_factor=factor, merge_sqnr_db=sqnr)
        if factor != 1.0:
            lay.issues.append(
                f"fused group {'/'.join(x.name.rpartition('.')[2] for x in ok)} has unshared "
                f"tensor scales: vLLM's max-merge decodes this shard x{factor:.4g} (weight SQNR "
                f"{sqnr:.1f} dB)"
            )


def _run_task(task: _Task) -> list[dict[str, Any]]:
    layers = [_audit_layer(task, name) for name in task.layers]
    if task.fused:
        for lay in layers:
            lay.row["fused_group"] = "/".join(n.rpartition(".")[2] for n in task.layers)
            lay.row["fused_shared"] = len({x.stored for x in layers}) == 1
        _merge_cost(task, layers)
    for lay in layers:
        lay.row["issues"] = "; ".join(lay.issues)
    return [lay.row for lay in layers]


def _groups(layers: Sequence[str]) -> list[tuple[tuple[str, ...], bool]]:
    """The layers in tasks: each complete fused group together, every other layer alone."""
    present, taken, out = set(layers), set(), []
    for name in layers:
        if name in taken:
            continue
        parent, _, leaf = name.rpartition(".")
        prefix = f"{parent}." if parent else ""
        for group in FUSED_GROUPS:
            members = tuple(prefix + g for g in group)
            if leaf in group and all(m in present and m not in taken for m in members):
                out.append((members, True))
                taken.update(members)
                break
        else:
            out.append(((name,), False))
            taken.add(name)
    return out


def _tasks(inv: Inventory, reference: Inventory | None,
           stores_input: bool | None) -> list[_Task]:
    out = []
    merged = format_spec(inv.fmt).shares_fused_scales
    groups = _groups(inv.layers) if merged else [((name,), False) for name in inv.layers]
    for members, fused in groups:
        keys = {k: v for k, v in inv.tensors.items() if k.rpartition(".")[0] in members}
        refs = {m: reference.get(f"{m}.weight") for m in members} if reference else {}
        out.append(_Task(inv.fmt, members, keys, refs, fused, stores_input))
    return out


def _backends(scheme: str, gpus: Sequence[str], vllm: str | None,
              cache: dict[str, dict[str, str]]) -> dict[str, str]:
    if scheme not in cache and scheme == FP8_ALGO:  # ModelOpt's FP8 loader: not in the rules
        cache[scheme] = {f"vllm {vllm_rules.release(vllm)} on {gpu}": (
            f"not modelled: vLLM's ModelOpt {FP8_ALGO} path is not in select_backend's rules "
            "(compressed-tensors' FP8_DYNAMIC is)") for gpu in gpus}
    if scheme not in cache:
        from nvfp4lab.execution.dispatch import select_backend

        cache[scheme] = {}
        for gpu in gpus:
            try:
                c = select_backend(gpu=gpu, vllm=vllm, scheme=scheme, env={})
            except ValueError as err:  # FP8 / MXFP4 rules: vLLM 0.33.0 on CUDA only
                if scheme in (Scheme.NVFP4, Scheme.NVFP4A16):
                    raise
                cache[scheme][f"vllm {vllm_rules.release(vllm)} on {gpu}"] = (
                    f"not modelled: {err}")
                continue
            text = f"{c.numerics} ({c.kernel})" if c.kernel else f"none: {c.error}"
            cache[scheme][f"vllm {c.vllm} on {gpu}"] = text
    return cache[scheme]


def _reference_inventory(reference: str | os.PathLike[str] | None) -> Inventory | None:
    if reference is None:
        return None
    path = Path(reference)
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        raise FileNotFoundError(f"reference folder {path} {what} (pass the float checkpoint "
                                "folder)")
    return inventory(path, CheckpointFormat.COMPRESSED_TENSORS)


def _stores_input(inv: Inventory) -> bool:
    """Whether the layers store an input scale, as the validated configuration's one scheme
    says (the format's ``read_config`` and ``checkpoint_scheme``, which ``load`` and
    ``convert`` also run: a config they refuse, layers mixing schemes included, raises
    CheckpointError here too), after the model config is checked against the tensors (the
    format's ``model_config``, which ``load`` builds the model from and ``convert`` writes)."""
    spec = format_spec(inv.fmt)
    spec.model_config(inv.path or inv.directory)
    return spec.read_config(inv.path or inv.directory).checkpoint_scheme() == Scheme.NVFP4


def _weight_only_fp8(inv: Inventory) -> set[str]:
    """The layers of a compressed-tensors checkpoint's FP8 W8A16 config groups (weights 8-bit
    float, no input activations): the stored ``<name>.weight`` names their targets match by
    compressed-tensors' own ``match_name`` (an exact name or an ``re:`` pattern), or every one
    for a class target (``Linear``), less the config's ``ignore``."""
    from compressed_tensors.utils.match import match_name

    config = format_spec(inv.fmt).read_config(inv.path or inv.directory).config
    targets = [t for group in config.config_groups.values()
               if group_kind(group) == LayerFormat.FP8_W8A16 for t in group.targets]
    ignore = list(config.ignore or ())
    names = {key.rpartition(".")[0] for key in inv.tensors if key.endswith(".weight")}

    def hit(name: str, patterns: Sequence[str]) -> bool:
        return any(match_name(name, t) or (t == "Linear") for t in patterns)

    return {n for n in names if hit(n, targets) and not any(match_name(n, t) for t in ignore)}


def _transforms(inv: Inventory) -> dict[str, tuple[str, str]]:
    """Layer -> (``transform`` column, issue) of a compressed-tensors transform_config
    (:func:`~nvfp4lab.checkpoint.formats.transforms.audit_transforms`); {} without one."""
    own = getattr(format_spec(inv.fmt), "audit_rotations", None)  # a format's own rotations
    if inv.fmt != CheckpointFormat.COMPRESSED_TENSORS and own is None:
        return {}

    def read(info: TensorInfo) -> torch.Tensor:
        with RowReader(info) as reader:
            return reader.rows().clone()

    return (audit_transforms if own is None else own)(inv.path or inv.directory, inv.layers,
                                                      inv.tensors, read)


def audit_rows(
    path: str | os.PathLike[str],
    *,
    reference: str | os.PathLike[str] | None = None,
    gpus: Sequence[str] = DEFAULT_GPUS,
    vllm: str | None = None,
    workers: int | None = None,
    dask: str | None = None,
    progress: bool = False,
    format: str | None = None,
) -> list[dict[str, Any]]:
    """The audit table of the checkpoint folder ``path`` as a list of rows (dicts), one per
    quantized layer in checkpoint order (see the module docstring for the checks).

    ``reference``: a float checkpoint folder (safetensors with ``<layer>.weight``) for the weight
    SQNR. ``gpus``: catalogue names whose vLLM kernel is reported (``vllm``: the release, default
    the latest modelled). ``workers`` / ``dask`` / ``progress``: where the per-layer tasks run
    (:func:`~nvfp4lab.checkpoint.stream.run_tasks`). ``format``: the checkpoint format to read
    (default: detected; :func:`~nvfp4lab.checkpoint.formats.detect_format`).
    """
    inv = inventory(path, detect_format(path, format))
    weight_only = (_weight_only_fp8(inv) if inv.fmt == CheckpointFormat.COMPRESSED_TENSORS
                   else set())
    mixed = audit_mixed_rows(inv.tensors, weight_only, inv.fmt == CheckpointFormat.MODELOPT) if (
        inv.fmt in (CheckpointFormat.COMPRESSED_TENSORS, CheckpointFormat.GGUF,
                    CheckpointFormat.MODELOPT)) else []
    if not inv.layers and not mixed:
        raise CheckpointError(f"{path}: no quantized layer found in the weight files")
    tasks = _tasks(inv, _reference_inventory(reference), _stores_input(inv))
    done = _run_tasks(_run_task, tasks, workers=workers, dask=dask, progress=progress,
                      desc="audit")
    rows = {row["layer"]: row for result in done for row in result}
    cache: dict[str, dict[str, str]] = {}
    out = []
    transforms = _transforms(inv)
    for name in inv.layers:
        row = dict.fromkeys(COLUMNS) | rows[name]
        issues = row.pop("issues")
        row.update(_backends(row["scheme"], gpus, vllm, cache))
        if transforms:  # a compressed-tensors transform_config: one more column
            row["transform"], problem = transforms.get(name, ("", ""))
            issues = "; ".join(p for p in (issues, problem) if p)
        row["issues"] = issues
        out.append(row)
    for row in mixed:  # FP8 / MXFP4 / Q8_0 layers of a mixed checkpoint: their scheme's kernel
        issues = row.pop("issues")  # (a GGUF Q8_0 layer: llama.cpp's, no vLLM scheme)
        q8_0 = row["format"] == LayerFormat.Q8_0
        backends = {} if q8_0 else _backends(row["scheme"], gpus, vllm, cache)
        out.append(dict.fromkeys(COLUMNS) | row | backends | {"issues": issues})
    return out + _kv_cache_rows(inv)


def _kv_cache_rows(inv: Inventory) -> list[dict[str, Any]]:
    """One row per attention layer of a quantized KV cache (after the Linear rows): ``layer``
    the attention module, ``kv_cache`` the kind the configuration declares, ``k_scale`` /
    ``v_scale`` the stored DECODE scales, ``issues`` (``kv_scales.kv_rows``: a kind vLLM 0.33
    does not run, a layer without scales, a scale not finite or not > 0)."""
    spec = format_spec(inv.fmt)
    config = spec.read_config(inv.path or inv.directory)
    return [dict.fromkeys(COLUMNS) | {"format": inv.fmt.value} | r.row()
            for r in kv_rows(config, inv.tensors, kv_cache_names(spec))]


def audit(path: str | os.PathLike[str], **options: Any) -> Any:
    """:func:`audit_rows` as a pandas DataFrame when pandas is installed (else the rows)."""
    rows = audit_rows(path, **options)
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover - pandas comes with the notebooks extra
        return rows
    return pd.DataFrame(rows)


def write_csv(rows: Sequence[dict[str, Any]], file: str | os.PathLike[str]) -> Path:
    """Write audit rows as CSV (columns: the union of the rows' keys, first-seen order)."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    out = Path(file)
    with open(out, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return out
