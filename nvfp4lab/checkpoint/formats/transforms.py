"""Rotations on disk: compressed-tensors' ``transform_config`` for rotated NVFP4 layers.

A rotated :class:`~nvfp4lab.execution.layers.NVFP4Linear` (``hadamard=`` a
:class:`~nvfp4lab.hadamard.BlockRotation` ``R``) holds the codes of ``W R`` and multiplies
``x R`` online. compressed-tensors says exactly that with one ``TransformScheme`` per distinct
``R`` (``type`` "hadamard" / "random-hadamard", ``head_dim`` = the block, ``precision``) applied
twice to the same layers::

    TransformArgs(location="input")                      # online:  x -> x R  (x @ M / sqrt(b))
    TransformArgs(location="weight_input", inverse=True)  # offline: W -> W R  (fused, stored)

(compressed-tensors' ``apply_transform_weight``: ``weight_input`` applies ``Vᵀ`` as ``W Vᵀᵀ``,
so its inverse gives ``W V``; llm-compressor's QuIP "v" rotation is this pair.) The scheme goes
under ``quantization_config.transform_config.config_groups`` (group "v", then "v_1", ...) and
each layer stores the unnormalized ±1 matrix ``M`` as ``<layer>.<group>_input.weight`` float32
``[b, b]``: vLLM 0.33 loads it from there (``compressed_tensors/transform/module.py``: the
dense path of "random-hadamard" multiplies by the stored matrix / sqrt(b); "hadamard" runs
hadacore, Sylvester's matrix, whatever is stored; an NVFP4 W4A4 layer with an input transform
of block 16/32/64/128 takes the QuTLASS path on SM100).

Reading accepts any compressed-tensors transform_config whose ONLINE parts nvfp4lab can run:
an ``input`` transform on a quantized Linear (its matrix from the checkpoint, else built as
compressed-tensors builds it) becomes that layer's rotation; offline parts (``weight_input``,
``weight_output``) are already fused into the stored weights and need nothing. Refused, with
the reason: online ``output`` / ``q_attn`` / ``k_cache`` transforms, ``randomize=True`` (the
permutation compressed-tensors applies and vLLM 0.33 ignores), an input transform on a float
layer, two on one layer, a matrix that is not ±1 Hadamard. nvfp4lab's own seeded rotation
(``hadamard=int``: per-K random signs, a different matrix in each block) has no
compressed-tensors form, and ModelOpt / GGUF hold no rotation at all: those are refused.

**transformers does not run it.** transformers 5.25 with compressed-tensors 0.20.1 loads such a
folder without applying ``transform_config`` (it lists the stored ``<group>_input.weight`` as
UNEXPECTED keys and runs ``W R`` on unrotated inputs: measured on a SmolLM2 mix, KL 16 nats per
token against nvfp4lab, top-1 agreement 0). :func:`transformers_input_rotations` applies the
online part after loading (compressed-tensors' own ``apply_transform_config`` with the ``input``
transforms only: the weights already hold ``W R``); with it the same model agrees (KL 0.0019,
top-1 0.975 on 1,024 tokens, bfloat16; ``benchmarks/mixed_recipe.py``). vLLM 0.33 applies the
transforms itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvfp4lab.checkpoint.refusals import CheckpointError, read_json
from nvfp4lab.checkpoint.safetensors_files import CONFIG_NAME, quantization_block
from nvfp4lab.hadamard import CT_KINDS, BlockRotation, ct_rotation
from nvfp4lab.vocab import CheckpointFormat

__all__ = [
    "TRANSFORM_CONFIG",
    "LayerRotation",
    "audit_transforms",
    "check_rotations",
    "layer_rotations",
    "read_transform_config",
    "refuse_conversion",
    "transform_config",
    "transform_tensors",
    "transformers_input_rotations",
    "write_transform_config",
]

#: The key of ``quantization_config`` that holds the transforms.
TRANSFORM_CONFIG = "transform_config"
#: llm-compressor's name for an input-side (QuIP "v") rotation group.
GROUP = "v"
_OFFLINE = ("weight_input", "weight_output")

_NO_SEED_FORM = (
    "nvfp4lab's seeded rotation (hadamard=<int>: random signs drawn for every element of K, a "
    "different 16x16 matrix in each block) has no compressed-tensors form, which repeats ONE "
    "b x b matrix in every block; quantize with hadamard=nvfp4lab.hadamard.ct_rotation() "
    "(compressed-tensors' random-hadamard of block 16) to save a rotated model"
)
#: Why a format cannot hold a rotation.
NO_ROTATION: dict[CheckpointFormat, str] = {
    CheckpointFormat.MODELOPT: (
        "a ModelOpt checkpoint (hf_quant_config.json / quantization_config) has no place for "
        "an online rotation, so an engine would multiply unrotated inputs by W·R"),
    CheckpointFormat.GGUF: (
        "GGUF has no rotation metadata and llama.cpp applies none, so it would multiply "
        "unrotated inputs by W·R"),
}


@dataclass(frozen=True)
class LayerRotation:
    """The online rotation of one layer read from a checkpoint: the ``group`` (config group
    name), the ``rotation`` and the stored key of its matrix (None: built, not stored)."""

    layer: str
    group: str
    rotation: BlockRotation | None  # None only while being read
    key: str | None


def _rotations(quantized: Mapping[str, nn.Module]) -> dict[str, object]:
    return {n: m.hadamard for n, m in quantized.items()
            if getattr(m, "hadamard", None) is not None}


def check_rotations(quantized: Mapping[str, nn.Module], fmt: CheckpointFormat) -> None:
    """Refuse (ValueError) rotated layers a ``fmt`` checkpoint cannot hold: any rotation in
    ModelOpt / GGUF, nvfp4lab's seeded (int) rotation everywhere."""
    rotated = _rotations(quantized)
    if not rotated:
        return
    name, rot = next(iter(rotated.items()))
    head = (f"{len(rotated)} NVFP4Linear layer(s) hold Hadamard-rotated weights (W·R), e.g. "
            f"{name!r} (hadamard={rot!r})")
    if fmt in NO_ROTATION:
        raise ValueError(f"{head}: {NO_ROTATION[fmt]}. Save it as compressed-tensors (its "
                         "transform_config holds the rotation), or quantize without hadamard")
    seeded = [n for n, r in rotated.items() if not isinstance(r, BlockRotation)]
    if seeded:
        raise ValueError(f"{len(seeded)} NVFP4Linear layer(s) hold Hadamard-rotated weights "
                         f"(W·R) rotated by a seed, e.g. {seeded[0]!r} "
                         f"(hadamard={rotated[seeded[0]]!r}): {_NO_SEED_FORM}")


def _groups(quantized: Mapping[str, nn.Module]) -> dict[str, tuple[BlockRotation, list[str]]]:
    """Group name -> (rotation, layers), one group per distinct rotation, in layer order."""
    out: dict[str, tuple[BlockRotation, list[str]]] = {}
    by_rotation: dict[BlockRotation, str] = {}
    for name, rot in _rotations(quantized).items():
        assert isinstance(rot, BlockRotation)  # check_rotations ran
        if rot not in by_rotation:
            by_rotation[rot] = GROUP if not out else f"{GROUP}_{len(out)}"
            out[by_rotation[rot]] = (rot, [])
        out[by_rotation[rot]][1].append(name)
    return out


def transform_config(quantized: Mapping[str, nn.Module]) -> dict[str, Any] | None:
    """The ``transform_config`` of the rotated layers (validated with compressed-tensors'
    ``TransformConfig``, as JSON-ready data), or None when no layer is rotated."""
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme

    groups = _groups(quantized)
    if not groups:
        return None
    schemes = {
        group: TransformScheme(
            type=rot.kind, head_dim=rot.size, precision=rot.precision, randomize=False,
            apply=[TransformArgs(targets=list(layers), location="input"),
                   TransformArgs(targets=list(layers), location="weight_input", inverse=True)],
        )
        for group, (rot, layers) in groups.items()
    }
    return json.loads(TransformConfig(config_groups=schemes).model_dump_json())


def transform_tensors(quantized: Mapping[str, nn.Module]) -> dict[str, torch.Tensor]:
    """``<layer>.<group>_input.weight``: each rotated layer's ±1 matrix, float32 ``[b, b]``."""
    return {f"{layer}.{group}_input.weight": rot.matrix(torch.float32)
            for group, (rot, layers) in _groups(quantized).items() for layer in layers}


def write_transform_config(folder: Path, config: Mapping[str, Any]) -> None:
    """Add ``config`` as ``quantization_config.transform_config`` of ``folder/config.json``
    (written as compressed-tensors' ``ModelCompressor.update_config`` writes the file)."""
    file = folder / CONFIG_NAME
    data = read_json(file)
    data["quantization_config"][TRANSFORM_CONFIG] = dict(config)
    file.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")


def transformers_input_rotations(model: nn.Module, directory: str | Path) -> int:
    """Make a transformers model loaded from the compressed-tensors folder ``directory`` rotate
    its layers' inputs as the checkpoint's ``transform_config`` says (module docstring: the
    online ``input`` transforms only, by compressed-tensors' ``apply_transform_config``), in
    place; returns the number of layers whose input it rotates (0: the folder has no
    transform, or ``model`` holds compressed-tensors transform modules already: applied
    twice, the rotation would be wrong). Every matrix compressed-tensors builds must equal
    the one the checkpoint stores (``<layer>.<group>_input.weight``, or the layer gets
    another rotation than the checkpoint's: CheckpointError naming it; a seed other than
    compressed-tensors' default draws another matrix)."""
    from compressed_tensors.transform import apply_transform_config
    from compressed_tensors.transform.factory.base import TransformBase
    from safetensors import safe_open

    folder = Path(directory)
    config = read_transform_config(folder)
    if config is None or any(isinstance(m, TransformBase) for m in model.modules()):
        return 0
    config = config.model_copy(deep=True)
    for scheme in config.config_groups.values():
        scheme.apply = [a for a in scheme.apply if a.location == "input"]
    apply_transform_config(model, config)
    built = {n: p for n, p in model.named_parameters(remove_duplicate=False)
             if n.rpartition(".")[0].endswith("_input") and n.endswith(".weight")}
    rotated = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names = f.keys()
            for key in names:
                if key in built:
                    stored = f.get_tensor(key)
                    if not torch.equal(built[key].detach().to(stored.dtype), stored):
                        raise CheckpointError(
                            f"{file}: {key} differs from the rotation compressed-tensors builds "
                            "from the transform_config (another seed?); transformers would run "
                            "a different rotation than the checkpoint's: run it in vLLM or "
                            "nvfp4lab.checkpoint.load")
                    rotated += 1
    return rotated


def read_transform_config(directory: Path) -> Any:
    """The folder's compressed-tensors ``TransformConfig`` (None when it has none or an empty
    one); CheckpointError naming config.json when compressed-tensors refuses it."""
    from compressed_tensors.transform import TransformConfig

    block = quantization_block(directory) if directory.is_dir() else None
    data = None if block is None else block.get(TRANSFORM_CONFIG)
    if not data:
        return None
    try:
        config = TransformConfig.model_validate(data)
    except Exception as exc:  # pydantic.ValidationError
        raise CheckpointError(f"{directory / CONFIG_NAME}: invalid transform_config: "
                              f"{exc}") from exc
    return config if config.config_groups else None


def _check_scheme(where: Path, group: str, scheme: Any) -> None:
    if scheme.type not in CT_KINDS:
        raise CheckpointError(f"{where}: transform group {group!r} has type {scheme.type!r}; "
                              f"nvfp4lab runs {' and '.join(CT_KINDS)} transforms")
    if scheme.randomize and any(a.is_online() for a in scheme.apply):
        raise CheckpointError(
            f"{where}: transform group {group!r} has randomize=True: compressed-tensors permutes "
            "its matrix by a stored perm, vLLM 0.33 ignores the permutation, so the checkpoint "
            "means two different models; nvfp4lab does not read it")
    for args in scheme.apply:
        location = getattr(args.location, "value", args.location)
        if args.is_online() and location != "input":
            raise CheckpointError(
                f"{where}: transform group {group!r} applies an online {location!r} transform; "
                "nvfp4lab runs online input rotations only (output / q_attn / k_cache "
                "rotations are not supported)")


def _matrix(source: Any, key: str, kind: str, size: int, precision: torch.dtype,
            where: Path) -> BlockRotation | None:
    """The rotation stored under ``key`` (None when absent), checked ``[size, size]`` ±1."""
    if source.file_of(key) is None:
        return None
    value = source.get(key)
    if tuple(value.shape) != (size, size) or not value.is_floating_point():
        raise CheckpointError(f"{source.file_of(key)}: transform matrix {key!r} is "
                              f"{value.dtype} {list(value.shape)}, expected a float "
                              f"[{size}, {size}]")
    try:
        return BlockRotation.from_matrix(kind, value, precision)
    except ValueError as exc:
        raise CheckpointError(f"{source.file_of(key)}: transform matrix {key!r}: {exc}") from exc


def _built(kind: str, size: int, precision: torch.dtype, where: Path,
           group: str) -> BlockRotation:
    try:
        return ct_rotation(kind, size, precision=precision)
    except ValueError as exc:
        raise CheckpointError(f"{where}: transform group {group!r} stores no matrix and "
                              f"nvfp4lab cannot build it: {exc}") from exc


def layer_rotations(directory: Path, model: nn.Module, quantized: Iterable[str],
                    source: Any) -> dict[str, LayerRotation]:
    """Layer -> its online input rotation, from the folder's transform_config (matched with
    compressed-tensors' own target / ignore rules on ``model``); {} when it has none.
    ``source``: the stored tensors (a :class:`~nvfp4lab.checkpoint.rows.TensorSource`)."""
    config = read_transform_config(directory)
    if config is None:
        return {}
    from compressed_tensors.utils.match import match_named_modules

    where = directory / CONFIG_NAME
    layers = set(quantized)
    out: dict[str, LayerRotation] = {}
    for group, scheme in config.config_groups.items():
        _check_scheme(where, group, scheme)
        matched = [(name, module) for args in scheme.apply
                   if getattr(args.location, "value", args.location) == "input"
                   for name, module in match_named_modules(model, args.targets, args.ignore)]
        for name, module in matched:
            if name not in layers or not isinstance(module, nn.Linear):
                raise CheckpointError(
                    f"{where}: transform group {group!r} rotates the input of {name!r}, which "
                    "is not a quantized Linear; nvfp4lab rotates quantized layers only")
            if name in out:
                raise CheckpointError(f"{where}: {name!r} has two input transforms "
                                      f"({out[name].group!r} and {group!r})")
            size = scheme.head_dim or module.in_features
            if module.in_features % size:
                raise CheckpointError(f"{where}: transform group {group!r} has head_dim {size}, "
                                      f"which does not divide {name!r}'s in_features "
                                      f"{module.in_features}")
            key = f"{name}.{group}_input.weight"
            out[name] = LayerRotation(name, group, _matrix(source, key, scheme.type, size,
                                                           scheme.precision, where), key)
        # one matrix per size in a group (compressed-tensors caches it by size; transformers
        # may store it once, under the first layer, as a tied weight): a layer that stores none
        # takes the group's stored one, else compressed-tensors' own (built)
        shared: dict[int, BlockRotation] = {}
        for name, _ in matched:
            rot = out[name].rotation
            if rot is not None:
                shared.setdefault(rot.size, rot)
        for name, module in matched:
            if out[name].rotation is None:
                size = scheme.head_dim or module.in_features
                if size not in shared:
                    shared[size] = _built(scheme.type, size, scheme.precision, where, group)
                out[name] = LayerRotation(name, group, shared[size], None)
    return out


def refuse_conversion(directory: Path, fmt: CheckpointFormat, target: CheckpointFormat) -> None:
    """CheckpointError when the compressed-tensors ``directory`` rotates inputs online and
    ``target`` cannot hold a rotation (offline-only transforms are fused: nothing to keep)."""
    if fmt != CheckpointFormat.COMPRESSED_TENSORS or target not in NO_ROTATION:
        return
    config = read_transform_config(directory)
    if config is None:
        return
    online = [g for g, s in config.config_groups.items() if any(a.is_online() for a in s.apply)]
    if online:
        raise CheckpointError(
            f"{directory}: its transform_config rotates inputs online (group {online[0]!r}) "
            f"and {NO_ROTATION[target]}; nothing was converted")


def _name_matches(name: str, targets: Iterable[str]) -> bool:
    """compressed-tensors' target rule on a quantized Linear's name alone: its class
    ("Linear"), a ``re:`` pattern, or the exact name (no model is built in an audit)."""
    import re

    for t in targets:
        if t == "Linear" or t == name or (t.startswith("re:") and re.match(t[3:], name)):
            return True
    return False


def audit_transforms(directory: Path, layers: Iterable[str], tensors: Mapping[str, Any],
                     read: Any) -> dict[str, tuple[str, str]]:
    """Layer -> (``transform`` column, issue or "") for ``nvfp4lab audit``: the online input
    rotation (type, block, group, precision, whether its matrix is stored and valid) and the
    offline transforms fused into the stored weights. ``tensors``: the inventory's
    :class:`~nvfp4lab.checkpoint.records.TensorInfo` by name; ``read(info)``: the tensor."""
    config = read_transform_config(directory)
    out: dict[str, tuple[str, str]] = {}
    if config is None:
        return out
    for name in layers:
        parts: list[str] = []
        issues: list[str] = []
        for group, scheme in config.config_groups.items():
            for args in scheme.apply:
                if not _name_matches(name, args.targets) or _name_matches(name, args.ignore):
                    continue
                location = getattr(args.location, "value", args.location)
                block = scheme.head_dim or "K"
                inv = " inverse" if args.inverse else ""
                if not args.is_online():
                    parts.append(f"{location}{inv} {scheme.type} {block} ({group}, fused)")
                    continue
                precision = str(scheme.precision).removeprefix("torch.")
                key = f"{name}.{group}_{location}.weight"
                suffix = f".{group}_{location}.weight"
                where_from = ("stored" if key in tensors else "shared" if any(
                    k.endswith(suffix) for k in tensors) else "built")
                parts.append(f"{location}{inv} {scheme.type} {block} ({group}, online, "
                             f"{precision}, matrix {where_from})")
                if location != "input" or scheme.randomize:
                    issues.append(f"online {location} transform (randomize={scheme.randomize}) "
                                  "is not run by nvfp4lab")
                elif key in tensors:
                    try:
                        BlockRotation.from_matrix(scheme.type, read(tensors[key]))
                    except ValueError as exc:
                        issues.append(f"transform matrix {key}: {exc}")
                if f"{name}.bias" in tensors:
                    issues.append("vLLM 0.33 runs no bias under an online transform "
                                  "(CompressedTensorsLinearTransformMethod asserts bias is None)")
        out[name] = ("; ".join(parts), "; ".join(issues))
    return out
