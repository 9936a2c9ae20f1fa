"""Write a model whose quantized Linears are NVFP4Linear as an NVFP4 checkpoint, in any format of
:data:`nvfp4lab.checkpoint.formats.FORMATS` (its spec names the tensors, converts the tensor
scales to the form on disk and writes the quantization config).

The directory is assembled under a hidden temporary name and renamed into place only when
everything is written, so a failed save never leaves a directory that looks like a checkpoint.
Tokenizer / generation / sentence-transformers files are copied from the source model folder.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from nvfp4lab.checkpoint import mixed_layers as mixed_io
from nvfp4lab.checkpoint.folders import (
    OWNER_MARKER,
    check_target,
    fresh_dir,
    remove_stale_dirs,
    replace_dir,
)
from nvfp4lab.checkpoint.formats import CheckpointFormatSpec, checkpoint_files, format_spec
from nvfp4lab.checkpoint.formats.transforms import (
    check_rotations,
    transform_config,
    transform_tensors,
    write_transform_config,
)
from nvfp4lab.checkpoint.kv_scales import checkpoint_kv_cache, kv_cache_names, kv_tensors
from nvfp4lab.checkpoint.records import SOURCE_ATTRIBUTE, Contents, Shard, StoredTensor, Unquantized
from nvfp4lab.checkpoint.refusals import CheckpointError, read_json
from nvfp4lab.checkpoint.rows import stored_tensor
from nvfp4lab.checkpoint.safetensors_files import (
    CONFIG_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    check_readable,
)
from nvfp4lab.constants import BLOCK_SIZE
from nvfp4lab.execution.layers import NVFP4Linear
from nvfp4lab.execution.whole_model import FUSED_GROUPS
from nvfp4lab.tensor import invalid_block_scales
from nvfp4lab.vocab import CheckpointFormat, Scheme, check_choice

__all__ = [
    "CHECKPOINT_FILES",
    "COPIED_FILES",
    "DEFAULT_MAX_SHARD_BYTES",
    "TransformersDtypeWarning",
    "UnsharedGlobalScaleWarning",
    "fused_groups",
    "save_pretrained",
    "write_atomically",
]

COPIED_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


class UnsharedGlobalScaleWarning(UserWarning):
    """A fused group (q/k/v, gate/up) is saved with different global scales: vLLM, which
    decodes all shards of a fused layer with the largest scale, would compute wrong outputs."""


def fused_groups(
    model: nn.Module, groups: Sequence[Sequence[str]] = FUSED_GROUPS
) -> list[list[str]]:
    """Full module names of sibling Linears that engines fuse (q/k/v, gate/up, ...).

    Only groups whose members all exist under the same parent are returned.
    """
    names = {name for name, _ in model.named_modules()}
    found: list[list[str]] = []
    for parent, _ in model.named_modules():
        prefix = f"{parent}." if parent else ""
        for group in groups:
            members = [prefix + leaf for leaf in group]
            if all(member in names for member in members):
                found.append(members)
    return found


def _global_scales(module: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's ENCODE tensor scale buffers (weight, then input when set), by buffer name."""
    return {name: b for name, b in module.named_buffers(recurse=False)
            if name.endswith("_global_scale")}


def _check_shared_global_scales(model: nn.Module, quantized: Mapping[str, nn.Module]) -> None:
    for members in fused_groups(model):
        if not all(m in quantized for m in members):
            continue
        held = [_global_scales(quantized[m]) for m in members]
        for attr in dict.fromkeys(name for scales in held for name in scales):
            values = [scales.get(attr) for scales in held]
            if any(v is None for v in values):
                continue
            floats = [float(v) for v in values]
            if len(set(floats)) > 1:
                detail = ", ".join(f"{m}={v:.9g}" for m, v in zip(members, floats, strict=True))
                raise CheckpointError(
                    f"fused group {members} has different {attr}s ({detail}); vLLM fuses these "
                    "layers and needs one shared scale. Quantize with "
                    "nvfp4lab.quantize_model(..., share_global_scale='auto') first, or pass "
                    "require_shared_global_scale=False to save it anyway"
                )


def _resolve_scheme(scheme: str | None, quantized: Mapping[str, NVFP4Linear]) -> Scheme:
    with_input = [n for n, m in quantized.items() if m.input_global_scale is not None]
    if scheme is None:
        if with_input and len(with_input) == len(quantized):
            return Scheme.NVFP4
        if not with_input:
            return Scheme.NVFP4A16
        missing = sorted(set(quantized) - set(with_input))
        raise ValueError(
            f"{len(with_input)} of {len(quantized)} NVFP4Linear layers have an "
            f"input_global_scale (missing e.g. {missing[0]!r}); pass scheme='NVFP4A16' to save "
            "weight-only, or calibrate all layers for scheme='NVFP4'"
        )
    resolved = check_choice("scheme", scheme, Scheme)
    if resolved == Scheme.NVFP4 and len(with_input) != len(quantized):
        missing = sorted(set(quantized) - set(with_input))
        raise ValueError(
            f"scheme 'NVFP4' (W4A4) needs an input_global_scale on every quantized layer; "
            f"{len(missing)} have none (e.g. {missing[0]!r}). Calibrate with "
            "nvfp4lab.calibrate_inputs, or save with scheme='NVFP4A16'"
        )
    return resolved  # type: ignore[return-value]


def _quantized_tensors(
    name: str, module: nn.Module, scheme: Scheme, spec: CheckpointFormatSpec
) -> dict[str, torch.Tensor]:
    """The tensors of one NVFP4Linear under the format's names, tensor scales converted to its
    form on disk (``spec.to_disk``), validated."""
    names = spec.names
    out: dict[str, torch.Tensor] = {}
    packed = module.weight_packed
    scale = module.weight_scale
    n, k = int(module.out_features), int(module.in_features)
    if k % BLOCK_SIZE:
        raise CheckpointError(
            f"{name}: in_features={k} is not a multiple of {BLOCK_SIZE}; the checkpoint "
            "formats cannot store a padded NVFP4 weight"
        )
    scalar = names.scalar_shape
    expected = {
        names.packed: (packed, torch.uint8, (n, k // 2)),
        names.block_scale: (scale, torch.float8_e4m3fn, (n, k // BLOCK_SIZE)),
        names.tensor_scale: (spec.to_disk(module.weight_global_scale,
                                          module.weight_decode_scale), torch.float32, scalar),
    }
    if scheme == Scheme.NVFP4:
        expected[names.input_scale] = (
            spec.to_disk(module.input_global_scale, module.input_decode_scale),
            torch.float32, scalar,
        )
    for leaf, (tensor, dtype, shape) in expected.items():
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{name}.{leaf}: expected {dtype} {list(shape)}, the module holds "
                f"{tensor.dtype} {list(tensor.shape)}"
            )
        out[leaf] = tensor
    nan, negative, first = invalid_block_scales(scale)
    if first is not None:
        raise CheckpointError(
            f"{name}.weight_scale holds {nan} NaN and {negative} negative E4M3 block scale(s) "
            f"(first at {first}); a checkpoint with them could not be read back: fix the layer"
        )
    bias = getattr(module, "bias", None)
    if bias is not None:
        out["bias"] = bias
    return {f"{name}.{leaf}": t for leaf, t in out.items()}


def _state_to_save(
    model: nn.Module,
    quantized: Mapping[str, nn.Module],
    scheme: Scheme,
    dtype: torch.dtype | None,
    spec: CheckpointFormatSpec,
    mixed: Mapping[str, nn.Module],
) -> dict[str, torch.Tensor]:
    """Name -> tensor in ``model.state_dict()`` order; tied (aliased) tensors written once.

    ``dtype``: cast unquantized floating tensors (and biases) to it; packed weights, block
    scales, FP8 weights and scales and float32 global scales are never touched. ``spec``: the
    format written; ``mixed``: the FP8 / MXFP4 layers (:mod:`~nvfp4lab.checkpoint.mixed_layers`).
    """
    tensors: dict[str, torch.Tensor] = {}
    by_owner: dict[str, list[str]] = {}
    own = {n: _quantized_tensors(n, m, scheme, spec) for n, m in quantized.items()}
    own.update({n: mixed_io.layer_tensors(n, m, fmt=spec.format) for n, m in mixed.items()})
    for name, held in own.items():
        for key, tensor in held.items():
            if dtype is not None and key.endswith(".bias"):
                tensor = tensor.to(dtype)
            tensors[key] = tensor
            by_owner.setdefault(f"{name}.", []).append(key)
    skip = {"" if not name else f"{name}." for name in own}
    tied_targets = _tied_targets(model)
    seen: dict[tuple[int, int, tuple[int, ...], torch.dtype], str] = {}
    ordered: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict(keep_vars=False).items():
        owner = next((p for p in skip if key.startswith(p)), None)
        if owner is not None:
            for own in by_owner.pop(owner, ()):
                ordered[own] = tensors[own]
            continue
        if tensor.device.type == "meta":
            raise CheckpointError(f"{key} is on the meta device (never loaded); cannot save it")
        ident = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.dtype,
        )
        if tensor.numel() and ident in seen:
            if key in tied_targets:
                continue  # transformers re-ties it from the source on load
            if seen[ident] in tied_targets:
                del ordered[seen[ident]]
            else:
                continue
        seen[ident] = key
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        ordered[key] = tensor
    for key, tensor in tensors.items():
        ordered.setdefault(key, tensor)
    return ordered


def _tied_targets(model: nn.Module) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None)
    if isinstance(keys, Mapping):
        return set(keys)
    if isinstance(keys, list | tuple | set):
        return set(keys)
    return set()


def _shards(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> tuple[Shard, ...]:
    """The tensors in safetensors-sized groups (a new one above ``max_shard_bytes``), named as
    transformers names its shards."""
    groups: list[list[StoredTensor]] = [[]]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(stored_tensor(key, tensor.detach().to("cpu").contiguous()))
        size += nbytes
    if len(groups) == 1:
        names = [WEIGHTS_NAME]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    return tuple(Shard(name, tuple(group), {"format": "pt"})
                 for name, group in zip(names, groups, strict=True))


def _model_dtype(model: nn.Module, quantized: Mapping[str, nn.Module]) -> torch.dtype:
    for module in quantized.values():
        dtype = getattr(module, "dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _config_json(model: nn.Module, source: Path | None, dtype: torch.dtype) -> str:
    """config.json's text as transformers writes it (diff against defaults), without a
    quantization config: the format adds its own."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        config = copy.deepcopy(config)
        if type(model).__module__.startswith("transformers."):
            config.architectures = [type(model).__name__]
        config.dtype = dtype
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        return str(config.to_json_string(use_diff=True))
    if source is not None and (source / CONFIG_NAME).is_file():
        data = read_json(source / CONFIG_NAME)
        data.pop("quantization_config", None)
    else:
        data = {}
    return json.dumps(data, indent=2, sort_keys=True)


def _source_dir(model: nn.Module, source: str | os.PathLike[str] | None) -> Path | None:
    """The folder whose tokenizer / generation files are copied: ``source`` (a folder; a file,
    such as a GGUF source, has none), else the model's ``config._name_or_path`` when it is a
    local folder."""
    if source is not None:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"source={str(source)!r} does not exist")
        return path if path.is_dir() else None
    config = getattr(model, "config", None)
    for candidate in (
        getattr(config, "_name_or_path", None),
        getattr(model, "name_or_path", None),
    ):
        if isinstance(candidate, str) and candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


def _origin(model: nn.Module, source: str | os.PathLike[str] | None,
            folder: Path | None) -> Path | None:
    """What the model came from, for a format that copies metadata from it: ``source``, else
    the file or folder its reader recorded (:data:`~nvfp4lab.checkpoint.records.SOURCE_ATTRIBUTE`;
    passed on even when it no longer exists, so that a format which copies from it refuses
    rather than dropping its metadata), else the side-file folder."""
    if source is not None:
        return Path(source)
    recorded = getattr(model, SOURCE_ATTRIBUTE, None)
    if isinstance(recorded, str | os.PathLike):
        return Path(recorded)
    return folder


def _copy_side_files(source: Path | None, directory: Path, written: set[str]) -> list[str]:
    copied: list[str] = []
    if source is None:
        return copied
    for rel in COPIED_FILES:
        src = source / rel
        if rel in written or not src.is_file():
            continue
        dst = directory / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        copied.append(rel)
    return copied


#: Names (relative paths) a checkpoint folder may hold besides its weights: what overwrite=True
#: may replace.
CHECKPOINT_FILES: frozenset[str] = frozenset(
    {CONFIG_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME, *checkpoint_files(), *COPIED_FILES}
)


class TransformersDtypeWarning(UserWarning):
    """A checkpoint saved in a dtype that transformers (with compressed-tensors 0.20) cannot run."""


def _quantized_layers(model: nn.Module, mixed: bool) -> dict[str, NVFP4Linear]:
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    if not quantized and not mixed:
        raise ValueError(
            "the model has no NVFP4Linear layer (nor FP8Linear / MXFP4Linear); quantize it "
            "first (nvfp4lab.quantize_model, execution.apply_mix) or save it with transformers"
        )
    if "" in quantized:
        raise ValueError("the model itself is an NVFP4Linear; wrap it in a container module")
    return quantized


def _kv_tensors(kv: tuple[str, dict[str, tuple[float, float]]] | None,
                spec: CheckpointFormatSpec) -> dict[str, torch.Tensor]:
    """The KV cache's k / v scale tensors under the format's names (none without a cache)."""
    names = kv_cache_names(spec)
    return {} if kv is None or names is None else kv_tensors(kv[1], names)


def _check_fused(
    model: nn.Module, quantized: Mapping[str, nn.Module], require: bool | None
) -> None:
    if require is False:
        return
    try:
        _check_shared_global_scales(model, quantized)
    except CheckpointError as err:
        if require:
            raise
        warnings.warn(str(err), UnsharedGlobalScaleWarning, stacklevel=3)


def _warn_transformers_dtype(target: Path, dtype: torch.dtype) -> None:
    """compressed-tensors 0.20 decompresses NVFP4 weights to bfloat16 whatever the model dtype
    (fixed upstream later, compressed-tensors PR #839): another dtype fails in transformers."""
    if dtype != torch.bfloat16:
        warnings.warn(
            f"{target} is saved with dtype {dtype}, but transformers (through compressed-tensors "
            "0.20, which decompresses NVFP4 weights to bfloat16) cannot run it: F.linear fails on "
            f"{dtype} activations with bfloat16 weights. Save with dtype=torch.bfloat16, or load "
            "it with from_pretrained(..., dtype=torch.bfloat16); checkpoint.verify(path) checks",
            TransformersDtypeWarning,
            stacklevel=3,
        )


def write_atomically(target: Path, write: Callable[[Path], None], *, overwrite: bool = True,
                     checkpoint_files: frozenset[str] | None = None) -> None:
    """``write(tmp)`` into a hidden temporary sibling, then rename it to ``target``
    (:func:`~nvfp4lab.checkpoint.folders.replace_dir` with ``overwrite`` and ``checkpoint_files``:
    nothing that appeared at ``target`` meanwhile is destroyed). Stale temporary siblings of
    dead saves are removed first; a failure leaves nothing behind and is reported as a
    :class:`CheckpointError` (an OSError stays one) naming ``target``, not the temporary
    folder."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_dirs(target)
        tmp = fresh_dir(target, "tmp")
    except PermissionError:
        raise PermissionError(f"cannot write {target}: permission denied creating folders in "
                              f"{target.parent} (a permission problem); pick a folder you can "
                              "write to or fix its permissions") from None
    try:
        write(tmp)
        (tmp / OWNER_MARKER).unlink()
        replace_dir(tmp, target, overwrite=overwrite, checkpoint_files=checkpoint_files)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, Exception):
            raise
        message = f"saving {target} failed, nothing was written: " + str(exc).replace(
            str(tmp), str(target)
        )
        if isinstance(exc, OSError):  # disk full, permissions: still an OSError for callers
            kind = FileExistsError if isinstance(exc, FileExistsError) else OSError
            raise kind(*((exc.errno, message) if exc.errno else (message,))) from exc
        raise CheckpointError(f"{message} ({type(exc).__name__})") from exc


def _unquantized(model: nn.Module) -> Unquantized:
    """What ``model`` leaves unquantized: its Linears that are not NVFP4Linear (in module
    order), and every such module holding a 2-D floating weight (Linear, Embedding), sorted."""
    linears = tuple(
        name for name, module in model.named_modules()
        if name and isinstance(module, nn.Linear) and not isinstance(module, NVFP4Linear)
    )
    weights = tuple(sorted(
        name
        for name, module in model.named_modules()
        if name and not isinstance(module, (NVFP4Linear, *mixed_io.MIXED_TYPES))
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.ndim == 2 and module.weight.is_floating_point()
    ))
    return Unquantized(linears, weights)


def _write_transforms(folder: Path, quantized: Mapping[str, NVFP4Linear]) -> None:
    """The rotated layers' compressed-tensors ``transform_config`` (none: nothing written)."""
    config = transform_config(quantized)
    if config is not None:
        write_transform_config(folder, config)


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    scheme: Scheme | None = None,
    format: str = CheckpointFormat.COMPRESSED_TENSORS,
    source: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    require_shared_global_scale: bool | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write ``model`` (quantized Linears are NVFP4Linear) as an NVFP4 checkpoint.

    ``format``: a :class:`~nvfp4lab.vocab.CheckpointFormat` (default compressed-tensors,
    ENCODE tensor scales; ModelOpt and GGUF store DECODE scales, taken from the layer's exact
    ``*_decode_scale`` buffers when it has them, else the float32 reciprocal of the ENCODE
    scale). Each format's module in :mod:`nvfp4lab.checkpoint.formats` says what it writes
    (GGUF: ``path/model.gguf``, one file; every in_features a multiple of 64).

    ``scheme``: "NVFP4" (W4A4; every quantized layer needs ``input_global_scale``),
    "NVFP4A16" (weight-only; input scales are not written), or None to infer it from the
    layers. Plain ``nn.Linear`` layers stay float and are listed in the config's ``ignore``.
    ``source``: a directory whose tokenizer/generation files are copied (default: the model's
    ``config._name_or_path`` when that is a local directory), or the file the model came from;
    GGUF copies the metadata (architecture, hyper-parameters, tokenizer) of a GGUF ``source``
    (default: the model's ``nvfp4lab_source`` attribute, which ``load`` and
    ``nvfp4lab.models.smollm2`` set). ``require_shared_global_scale``:
    every fused group (:data:`FUSED_GROUPS`: q/k/v, gate/up, ...) must share its global scales
    to load correctly in vLLM (it decodes all shards with the max; not checked for a format whose
    engine keeps one scale per tensor, GGUF); ``True`` raises when one does
    not, ``None`` (default) warns with :class:`UnsharedGlobalScaleWarning`, ``False`` is silent.
    FP8Linear / MXFP4Linear layers (``execution.apply_mix``) are saved in compressed-tensors (a
    config group per kind) or ModelOpt (MIXED_PRECISION, no MXFP4; ValueError before writing
    otherwise; :mod:`~nvfp4lab.checkpoint.mixed_layers`). ``dtype``: cast the unquantized
    floating tensors (embeddings, norms, biases, float Linears) to it and record it as the
    config's dtype; default: keep them.
    ``path`` may be missing or an empty folder; ``overwrite=True`` replaces a folder that holds
    only checkpoint files (:data:`CHECKPOINT_FILES`, weights); anything else is refused with
    FileExistsError naming what would be lost. ``max_shard_bytes``: split the weights into
    several files (with ``model.safetensors.index.json``) above this size.

    A model whose KV cache is quantized (``quantize_model(..., kv_cache=...)``,
    :func:`~nvfp4lab.execution.quantize_kv_cache`) is saved with it where the format's engine
    reads one (:mod:`nvfp4lab.checkpoint.kv_scales`, ``docs/kv_cache.md``): compressed-tensors
    declares FP8 (``kv_cache_scheme``, ``<attn>.k_scale`` / ``v_scale``), ModelOpt FP8 and NVFP4
    (``kv_cache_quant_algo``, ``<attn>.k_proj.k_scale`` / ``v_proj.v_scale``), each layer's
    float32 DECODE scales as the model holds them; what a format cannot declare (NVFP4 in
    compressed-tensors, anything in GGUF) is refused with ValueError naming the kind, the
    scales and the reason (``remove_kv_cache_quantization(model)`` first to save the weights
    alone).

    Rotated layers (``hadamard=`` a :class:`~nvfp4lab.hadamard.BlockRotation`, stored ``W R``)
    are saved as compressed-tensors with a ``transform_config``
    (:mod:`~nvfp4lab.checkpoint.formats.transforms`); a seeded rotation, or any rotation in
    ModelOpt / GGUF, is refused with ValueError naming why.

    The packed bytes and scales are written exactly as the modules hold them (NaN or negative
    block scales are refused: every checkpoint nvfp4lab writes, nvfp4lab can read). The folder is
    assembled under a temporary name and renamed into place at the end. Returns ``path``.

    compressed-tensors 0.20 decompresses NVFP4 weights to bfloat16 whatever the model dtype, so
    transformers runs only bfloat16 compressed-tensors checkpoints: any other dtype is saved with a
    :class:`TransformersDtypeWarning` naming the remedy (:func:`nvfp4lab.checkpoint.verify`
    checks a saved folder in transformers).
    """
    spec = format_spec(format)
    target = Path(path)
    check_target(target, overwrite, CHECKPOINT_FILES)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    mixed = mixed_io.mixed_layers(model)  # FP8 / MXFP4: refused here but in compressed-tensors
    mixed_io.check_mixed(model, mixed, spec.format)
    quantized = _quantized_layers(model, bool(mixed))
    check_rotations(quantized, spec.format)  # transforms.py: which rotations the format holds
    kv = checkpoint_kv_cache(model, spec)  # refused here, before anything is written
    resolved = _resolve_scheme(scheme, quantized)
    if spec.shares_fused_scales:
        _check_fused(model, quantized, require_shared_global_scale)
    unquantized = _unquantized(model)
    src = _source_dir(model, source)
    if src is not None:  # a link out of the source folder is never read into the checkpoint
        check_readable(src, [src / rel for rel in (CONFIG_NAME, *COPIED_FILES)
                             if os.path.lexists(src / rel)])
    tensors = _state_to_save(model, quantized, resolved, dtype, spec, mixed)
    own = getattr(spec, "rotation_tensors", None)  # a format storing rotations its own way
    tensors.update(transform_tensors(quantized) if own is None else own(quantized))
    tensors.update(_kv_tensors(kv, spec))
    config_dtype = dtype or _model_dtype(model, quantized)
    shards = _shards(tensors, max_shard_bytes)
    contents = Contents(shards, _config_json(model, src, config_dtype), resolved, unquantized,
                        index=len(shards) > 1, source=_origin(model, source, src),
                        kv_cache=None if kv is None else kv[0])

    def write(tmp: Path) -> None:
        written = {*spec.write_checkpoint(tmp, contents), *spec.config_files}
        if mixed:  # per-kind groups by exact names (compressed-tensors), or MIXED_PRECISION
            mixed_io.write_groups(tmp, quantized, mixed, resolved, unquantized.listed,
                                  spec.format, model)
        if own is None:
            _write_transforms(tmp, quantized)
        generation = getattr(model, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained") and (
            src is None or not (src / "generation_config.json").is_file()
        ):
            generation.save_pretrained(str(tmp))
            written.add("generation_config.json")
        _copy_side_files(src, tmp, written)

    write_atomically(target, write, overwrite=overwrite, checkpoint_files=CHECKPOINT_FILES)
    if spec.transformers_needs_bfloat16:
        _warn_transformers_dtype(target, config_dtype)
    return target
