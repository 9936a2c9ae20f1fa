"""FP-Quant's own NVFP4 checkpoint format (``quant_method: "fp_quant"``; :data:`SPEC`).

Written from the format as FP-Quant's exporter writes it (``model_quant.py``,
``src/quantization/gptq.py``, ``qconfig.py``, ``quant_ops.py`` at IST-DASLab/FP-Quant d2e3092)
and as transformers 5.25 (``FPQuantConfig``, ``quantizers/quantizer_fp_quant.py``) and vLLM 0.33
(``model_executor/layers/quantization/fp_quant.py``) read it; no code of theirs is used. Per
quantized Linear ``<name>`` (real quantization, ``pseudoquantization: false``):

* ``<name>.qweight``: uint8 ``[N, K/2]``, E2M1 codes (sign bit 3), element ``2i`` in the low
  nibble (``pack_fp4_to_uint8``: ``q[:, 1::2] << 4 | q[:, ::2]``), the codes of the ROTATED
  weight;
* ``<name>.scales``: **uint8** ``[N, K/16]``, the bytes of the E4M3 block scales
  (``cast_scales_to_eXmY``: ``.to(float8_e4m3fn).view(uint8)``), plain row-major layout (vLLM
  swizzles them at run time with ``to_blocked``); ``read_weights`` presents them as
  float8_e4m3fn, the same bytes;
* ``<name>.weight_global_scale`` / ``<name>.act_global_scale``: float32 ``[1]``, the ENCODE
  scales ``2688 / amax`` (``FP8_E4M3_MAX * FP4_E2M1_MAX / amax``; the activation's calibrated,
  FP-Quant keeping the smallest over the calibration batches); a weight decodes as ``code *
  E4M3(scale) / weight_global_scale`` and vLLM's GEMM multiplies by ``1 / (weight_global_scale *
  act_global_scale)``; the exporter's ``--fuse_global_scale`` gives q/k/v and gate/up the
  smallest (vLLM keeps one value per fused layer);
* ``<name>.forward_hadamard_matrix`` / ``backward_hadamard_matrix``: the online input rotation
  (:mod:`~nvfp4lab.checkpoint.formats.fp_quant_rotations`).

The configuration is ``config.json``'s ``quantization_config``: ``forward_dtype`` "nvfp4"
("mxfp4" is refused: not NVFP4), ``forward_method`` "abs_max", ``backward_dtype`` "bf16",
``hadamard_group_size`` 16/32/64/128, ``modules_to_not_convert`` (a Linear whose full name ENDS
WITH an entry stays float, the string rule of both engines), ``store_master_weights`` false and
``pseudoquantization`` false (a pseudo-quantized ``dqweight`` or master-weight checkpoint holds
float weights, no codes: refused), ``transform_init`` (used only when quantizing in flight).
FP-Quant is W4A4 only (every engine quantizes the activations with ``act_global_scale``): a
weight-only model is refused, and so is a KV cache (vLLM's ``FPQuantConfig`` reads none). Both
engines run it in bfloat16 only (vLLM refuses other parameter dtypes, transformers casts).
transformers loads it only on a CUDA / XPU device with the ``fp_quant`` package (and QuTLASS on
Blackwell), vLLM only on SM100.

A rotated layer holds the codes of ``W R`` and its matrix: nvfp4lab reads it as an
:class:`~nvfp4lab.execution.layers.NVFP4Linear` with that :class:`~nvfp4lab.hadamard.BlockRotation`,
and converts it to and from compressed-tensors' ``transform_config``; ModelOpt and GGUF, which
hold no rotation, are refused. The optional members ``rotation_tensors``, ``layer_rotations``,
``rotation_config`` and ``audit_rotations`` are how ``save_pretrained``, ``load``, ``convert``
and ``audit`` ask a format that stores rotations its own way.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvfp4lab.checkpoint.formats import fp_quant_rotations as rotations
from nvfp4lab.checkpoint.formats.fp_quant_rotations import BACKWARD, FORWARD, GROUP_SIZES
from nvfp4lab.checkpoint.formats.tensor_scales import TensorScaleForm
from nvfp4lab.checkpoint.formats.transforms import LayerRotation
from nvfp4lab.checkpoint.records import (
    Contents,
    LayerNames,
    Shard,
    StoredTensor,
    StoredWeights,
    TaskRunner,
    TensorInfo,
    Unquantized,
)
from nvfp4lab.checkpoint.refusals import CheckpointError, read_json
from nvfp4lab.checkpoint.rows import RowReader, stored_tensor
from nvfp4lab.checkpoint.safetensors_files import (
    CONFIG_NAME,
    SafetensorsContainer,
    quantization_block,
    safetensors_weights,
    write_safetensors_checkpoint,
)
from nvfp4lab.vocab import TENSOR_SCALE_STORAGE, CheckpointFormat, Scheme

__all__ = ["NAMES", "QUANT_METHOD", "SPEC", "FPQuant", "FPQuantConfig", "quantization_config",
           "read_fp_quant_config"]

#: ``quantization_config.quant_method`` of an FP-Quant checkpoint.
QUANT_METHOD = "fp_quant"
#: The tensor names of one quantized Linear (ENCODE tensor scales, float32 ``[1]``).
NAMES = LayerNames("qweight", "scales", "weight_global_scale", "act_global_scale", (1,),
                   TENSOR_SCALE_STORAGE[CheckpointFormat.FP_QUANT].decode)
#: How FP-Quant stores the block scales (E4M3 bytes) and how nvfp4lab presents them.
SCALES_ON_DISK, SCALES_READ = "U8", "F8_E4M3"
_FORWARD_DTYPE, _METHOD, _BACKWARD_DTYPE = "nvfp4", "abs_max", "bf16"
_TRANSFORM_INITS = ("hadamard", "identity", "gsr")
#: Keys vLLM 0.33's ``FPQuantConfig.from_config`` requires.
_REQUIRED = ("hadamard_group_size", "forward_dtype", "forward_method", "modules_to_not_convert")


@dataclass(frozen=True)
class FPQuantConfig:
    """A validated FP-Quant NVFP4 configuration (``file``: where it was read)."""

    hadamard_group_size: int
    modules_to_not_convert: tuple[str, ...]
    file: Path

    @property
    def unquantized(self) -> tuple[str, ...]:
        """``modules_to_not_convert``: name suffixes."""
        return self.modules_to_not_convert

    def checkpoint_scheme(self) -> Scheme:
        """NVFP4 (W4A4): FP-Quant always quantizes the activations."""
        return Scheme.NVFP4

    def quantized_modules(self, model: nn.Module) -> dict[str, bool]:
        """Every nn.Linear whose full name ends with no entry of ``modules_to_not_convert`` (the
        rule of vLLM's ``get_quant_method`` and fp_quant's ``replace_with_fp_quant_linear``),
        each with its static input scale."""
        out = {name: True for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and not excluded(name, self.unquantized)}
        if not out:
            raise CheckpointError(f"{self.file}: modules_to_not_convert "
                                  f"{list(self.unquantized)} leaves no Linear quantized")
        return out


def excluded(name: str, suffixes: Iterable[str]) -> bool:
    """Whether FP-Quant leaves module ``name`` unquantized: its name ends with an entry."""
    return any(name.endswith(s) for s in suffixes)


def _refuse(file: Path, key: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"{file}: quantization_config.{key} is {value!r}; {why}")


def read_fp_quant_config(path: str | Path) -> FPQuantConfig:
    """Read and validate an FP-Quant configuration (``config.json``'s ``quantization_config``)
    with transformers' ``FPQuantConfig`` rules for NVFP4 and the keys vLLM 0.33 requires;
    CheckpointError naming the file and key for anything nvfp4lab cannot read as NVFP4 codes."""
    file = Path(path) / CONFIG_NAME
    block = quantization_block(Path(path))
    if block is None or block.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"{file}: quantization_config.quant_method is not {QUANT_METHOD!r}")
    for key in _REQUIRED:
        if key not in block:
            raise CheckpointError(f"{file}: quantization_config has no {key!r}, which vLLM "
                                  "0.33's FPQuantConfig.from_config requires")
    checks = (
        ("forward_dtype", _FORWARD_DTYPE, "nvfp4lab reads NVFP4 FP-Quant checkpoints only"),
        ("forward_method", _METHOD, "NVFP4 FP-Quant uses 'abs_max' (transformers' rule)"),
        ("backward_dtype", _BACKWARD_DTYPE, "NVFP4 forward goes with 'bf16' backward only"),
        ("store_master_weights", False, "the checkpoint holds float master weights, not "
                                        "NVFP4 codes"),
        ("pseudoquantization", False, "the checkpoint holds dequantized 'dqweight' tensors, "
                                      "not NVFP4 codes (vLLM 0.33 does not read it either)"),
    )
    defaults = {"backward_dtype": _BACKWARD_DTYPE, "store_master_weights": False,
                "pseudoquantization": False}
    for key, want, why in checks:
        if block.get(key, defaults.get(key)) != want:
            raise _refuse(file, key, block.get(key), why)
    if block.get("transform_init", "hadamard") not in _TRANSFORM_INITS:
        raise _refuse(file, "transform_init", block.get("transform_init"),
                      f"transformers accepts {', '.join(_TRANSFORM_INITS)}")
    size = block["hadamard_group_size"]
    if isinstance(size, bool) or size not in GROUP_SIZES:
        raise _refuse(file, "hadamard_group_size", size,
                      f"NVFP4 FP-Quant uses {', '.join(map(str, GROUP_SIZES))}")
    keep = block["modules_to_not_convert"]
    if not isinstance(keep, list) or not all(isinstance(k, str) and k for k in keep):
        raise _refuse(file, "modules_to_not_convert", keep,
                      "it must be a list of module name suffixes (vLLM and transformers read "
                      "null differently)")
    return FPQuantConfig(int(size), tuple(keep), file)


def quantization_config(size: int, modules_to_not_convert: Iterable[str]) -> dict[str, Any]:
    """The ``quantization_config`` block, keys as FP-Quant's ``prepare_quantization_config``
    writes them (real quantization)."""
    return {
        "forward_dtype": _FORWARD_DTYPE,
        "backward_dtype": _BACKWARD_DTYPE,
        "forward_method": _METHOD,
        "hadamard_group_size": size,
        "modules_to_not_convert": sorted(modules_to_not_convert),
        "quant_method": QUANT_METHOD,
        "store_master_weights": False,
        "pseudoquantization": False,
        "transform_init": "hadamard",
    }


def _not_converted(unquantized: Unquantized, layers: Iterable[str],
                   dropped: Iterable[str] = ()) -> list[str]:
    """``modules_to_not_convert``: every unquantized module with a 2-D weight and every plain
    name the source lists (wildcards have no FP-Quant form; the modules they matched are among
    the weights; a compressed-tensors transform matrix, ``dropped``, is none), and ``lm_head``
    (FP-Quant's default, which keeps a tied head float in transformers) unless a quantized
    layer ends with it; CheckpointError when an entry would also leave a quantized layer
    float."""
    gone = {d.removesuffix(".weight") for d in dropped}
    names = {n for n in unquantized.listed if not n.startswith("re:")
             and not any(c in n for c in "*?[")} | set(unquantized.weights) - gone
    layers = list(layers)
    if not any(layer.endswith("lm_head") for layer in layers):
        names.add("lm_head")
    for layer in layers:
        hit = next((n for n in sorted(names) if layer.endswith(n)), None)
        if hit is not None:
            raise CheckpointError(
                f"the quantized layer {layer!r} ends with {hit!r}, which FP-Quant's "
                "modules_to_not_convert must list (an unquantized module), so engines would "
                "leave it float; rename or quantize that module")
    return sorted(names)


def _matrix_value(info: TensorInfo, size: int) -> torch.Tensor:
    where = f"{info.file}: tensor {info.key!r}"
    if info.shape != (size, size) or info.torch_dtype is None or (
            not info.torch_dtype.is_floating_point):
        raise CheckpointError(f"{where} is {info.dtype} {list(info.shape)}, expected a float "
                              f"[{size}, {size}] (hadamard_group_size {size})")
    with RowReader(info) as reader:
        return reader.rows()


def _describe(path: Path) -> tuple[StoredWeights, dict[str, Any]]:
    """(the stored tensors as nvfp4lab reads them, layer -> its rotation): block scales as
    float8_e4m3fn, each rotated layer's matrix as ``<layer>.<group>_input.weight`` float32 ±1,
    identity matrices and backward copies checked and left out."""
    base = safetensors_weights(path)
    size = read_fp_quant_config(path).hadamard_group_size
    layers = [k.removesuffix(f".{NAMES.packed}") for k in base.tensors
              if k.endswith(f".{NAMES.packed}")]
    found: dict[str, Any] = {}
    hidden: set[str] = set()
    for layer in layers:
        forward = base.tensors.get(f"{layer}.{FORWARD}")
        if forward is None:
            raise CheckpointError(f"{base.directory}: layer {layer!r} has no {FORWARD} (vLLM "
                                  "0.33 would run it with an uninitialized matrix)")
        value = _matrix_value(forward, size)
        rot = rotations.matrix_rotation(value, f"{forward.file}: tensor {forward.key!r}")
        backward = base.tensors.get(f"{layer}.{BACKWARD}")
        if backward is not None and not torch.equal(
                _matrix_value(backward, size).to(torch.float64), value.to(torch.float64)):
            raise CheckpointError(f"{backward.file}: tensor {backward.key!r} differs from "
                                  f"{FORWARD}; FP-Quant stores the same matrix twice")
        hidden |= {forward.key, *(() if backward is None else (backward.key,))}
        if rot is not None:
            found[layer] = rot
    names = rotations.ct_names(found)
    scales = {f"{layer}.{NAMES.block_scale}" for layer in layers}
    tensors: dict[str, TensorInfo] = {}
    for key, info in base.tensors.items():
        layer = key.removesuffix(f".{FORWARD}")
        if key in scales and info.dtype == SCALES_ON_DISK:
            info = dataclasses.replace(info, dtype=SCALES_READ)
        elif key in hidden and layer in names:
            info = TensorInfo(info.file, info.key, "F32", (size, size), info.offset,
                              size * size * 4, view=rotations.PlusMinusOne(info))
            key = names[layer]
        elif key in hidden:
            continue
        tensors[key] = info
    return dataclasses.replace(base, tensors=tensors), found


class FPQuant(TensorScaleForm, SafetensorsContainer):
    """FP-Quant's NVFP4 format (see the module docstring)."""

    format = CheckpointFormat.FP_QUANT
    title = "FP-Quant NVFP4"
    description = f"{QUANT_METHOD!r} (FP-Quant NVFP4, forward_dtype nvfp4)"
    names = NAMES
    config_files: tuple[str, ...] = ()
    weight_files: tuple[str, ...] = ()
    transformers_needs_bfloat16 = False
    optional_tensor_scale: str | None = None
    shares_fused_scales = TENSOR_SCALE_STORAGE[format].shared_in_fused_groups
    writes_in_tasks = True

    def detect(self, directory: Path) -> bool:
        """``config.json`` ``quantization_config.quant_method == "fp_quant"``."""
        block = quantization_block(directory) if directory.is_dir() else None
        return block is not None and block.get("quant_method") == QUANT_METHOD

    def read_config(self, directory: Path) -> FPQuantConfig:
        return read_fp_quant_config(directory)

    def read_weights(self, path: Path) -> StoredWeights:
        """The folder's tensors as nvfp4lab reads them (:func:`_describe`)."""
        return _describe(Path(path))[0]

    def kv_cache_refusal(self, kind: str) -> str | None:
        """Every KV cache: vLLM 0.33's FPQuantConfig has no KV cache method."""
        return (f"an {self.title} checkpoint has no place for a KV cache (vLLM 0.33's "
                "FPQuantConfig reads no kv_cache_scheme and no k / v scales); save as ModelOpt "
                "or compressed-tensors")

    # -- rotations (the optional members the writer, reader, convert and audit ask) ----------

    def rotation_tensors(self, quantized: Mapping[str, nn.Module]) -> dict[str, torch.Tensor]:
        """Every quantized layer's forward / backward matrix (identity when not rotated)."""
        return rotations.model_matrices(quantized)

    def layer_rotations(self, directory: Path, model: nn.Module, quantized: Iterable[str],
                        source: Any) -> dict[str, LayerRotation]:
        """Layer -> its rotation, from the matrices :meth:`read_weights` presents."""
        return rotations.layer_rotations(source.entries, quantized,
                                         lambda key: source.get(key).cpu())

    def rotation_config(self, path: Path, target: CheckpointFormat) -> dict[str, Any] | None:
        """The ``transform_config`` a compressed-tensors ``target`` needs (None without a
        rotation); CheckpointError when ``target`` holds no rotation."""
        return rotations.rotation_config(_describe(Path(path))[1], target, Path(path))

    def audit_rotations(self, path: Path, layers: Iterable[str], tensors: Mapping[str, Any],
                        read: Any) -> dict[str, tuple[str, str]]:
        """Layer -> (``transform`` column, issue) for ``nvfp4lab audit``."""
        size = read_fp_quant_config(path).hadamard_group_size
        return rotations.audit_rotations(layers, tensors, size)

    # -- writing --------------------------------------------------------------------------------

    def write_checkpoint(self, folder: Path, contents: Contents,
                         run: TaskRunner | None = None) -> list[str]:
        """The FP-Quant checkpoint of ``contents``: block scales stored as uint8, each layer's
        matrices (given, as ``save_pretrained`` gives them; else from a compressed-tensors
        source's ``transform_config``; else the identity), ``quantization_config``."""
        if contents.scheme != Scheme.NVFP4:
            raise CheckpointError(
                f"an {self.title} checkpoint is W4A4 (every engine quantizes activations with "
                f"act_global_scale); scheme {str(contents.scheme)!r} has no activation scales: "
                "calibrate the inputs (nvfp4lab.calibrate_inputs) or save another format")
        if contents.kv_cache is not None:
            raise CheckpointError(self.kv_cache_refusal(contents.kv_cache) or "")
        every = {t.name: t for t in contents.tensors()}
        layers = [n.removesuffix(f".{NAMES.packed}") for n in every
                  if n.endswith(f".{NAMES.packed}")]
        given = [layer for layer in layers if f"{layer}.{FORWARD}" in every]
        extra: dict[str, torch.Tensor] = {}
        drop: set[str] = set()
        if given:
            missing = sorted(set(layers) - set(given))
            if missing:
                raise CheckpointError(f"layer {missing[0]!r} has no {FORWARD}")
            size = every[f"{given[0]}.{FORWARD}"].shape[0]
        else:
            found, drop = rotations.source_rotations(contents.source, layers, every)
            size = rotations.check_sizes({n: r.size for n, r in found.items()}, CheckpointError)
            extra = {layer: rotations.normalized(found.get(layer), size) for layer in layers}
        shards = tuple(self._shard(shard, set(layers), extra, drop) for shard in contents.shards)
        keep = _not_converted(contents.unquantized, layers, drop)

        def write_config(where: Path, scheme: Scheme, unquantized: Unquantized) -> None:
            data = read_json(where / CONFIG_NAME)
            data["quantization_config"] = quantization_config(size, keep)
            (where / CONFIG_NAME).write_text(json.dumps(data, indent=2), encoding="utf-8")

        return write_safetensors_checkpoint(folder, dataclasses.replace(contents, shards=shards),
                                            write_config, run)

    @staticmethod
    def _shard(shard: Shard, layers: set[str], extra: Mapping[str, torch.Tensor],
               drop: set[str]) -> Shard:
        """``shard`` as FP-Quant stores it: block scales re-typed uint8 (same bytes), dropped
        transform tensors, ``extra`` matrices after each layer's codes."""
        out: list[StoredTensor] = []
        for t in shard.tensors:
            if t.name in drop:
                continue
            prefix, _, leaf = t.name.rpartition(".")
            if prefix in layers and leaf == NAMES.block_scale and t.dtype == SCALES_READ:
                t = dataclasses.replace(t, dtype=SCALES_ON_DISK)
            out.append(t)
            if prefix in extra and leaf == NAMES.packed:
                out += [stored_tensor(f"{prefix}.{FORWARD}", extra[prefix]),
                        stored_tensor(f"{prefix}.{BACKWARD}", extra[prefix].clone())]
        return dataclasses.replace(shard, tensors=tuple(out))

    def write_config(self, folder: Path, scheme: Scheme, unquantized: Unquantized) -> None:
        """Not used: :meth:`write_checkpoint` writes the configuration (it needs the group
        size the matrices give)."""
        raise NotImplementedError


SPEC = FPQuant()
