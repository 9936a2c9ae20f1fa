"""The NVIDIA ModelOpt NVFP4 checkpoint format (``export_hf_checkpoint`` of ModelOpt 0.47;
:data:`SPEC`).

Written from the format as ModelOpt 0.47.0 exports it and vLLM 0.33.0 reads it (no code of either
is used). Per quantized Linear ``<name>``:

* ``<name>.weight``: uint8 ``[N, K/2]``, E2M1 codes, element ``2i`` in the low nibble;
* ``<name>.weight_scale``: float8_e4m3fn ``[N, K/16]``, block scales, plain row-major layout;
* ``<name>.weight_scale_2``: float32 ``[]`` (0-d), the DECODE tensor scale ``amax(W) / 2688``;
* ``<name>.input_scale``: float32 ``[]`` (0-d), the DECODE activation scale ``amax(x) / 2688``
  ("NVFP4", W4A4 only).

Unquantized tensors keep their names and the model dtype. Fused groups (q/k/v, gate/up) share
``weight_scale_2`` and ``input_scale`` (the group's max): vLLM keeps ONE value per fused layer,
``max`` over the shards (:mod:`nvfp4lab.execution.shared_scales`). The configuration is written
twice:
``hf_quant_config.json`` (``{"producer": {"name": "modelopt", "version": ...}, "quantization":
{"quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules"}}``, the form vLLM needs all
four keys of) and a ``quantization_config`` in ``config.json`` (``quant_method: "modelopt"``,
compressed-tensors-like ``config_groups``, ``ignore``); vLLM reads the latter when present.
``quant_algo`` "NVFP4" (W4A4) and "W4A16_NVFP4" (weight-only) are read, and "MIXED_PRECISION"
(below); every other algorithm (FP8, NVFP4_AWQ, ...) is refused. A quantized KV cache is
declared as ModelOpt 0.47 exports it (``kv_cache_quant_algo`` "FP8" / "NVFP4" in
``hf_quant_config.json``, ``kv_cache_scheme`` in ``config.json``) with its DECODE scales in
``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale`` (:data:`KV_CACHE_NAMES`;
``docs/kv_cache.md``).

nvfp4lab writes ``producer.name = "modelopt"`` because vLLM routes the ``hf_quant_config.json``
form to its ModelOpt loader by that name; ``version`` is the export format written (0.47.0).

Why ModelOpt's codes differ from the kernel order in bf16/fp16 (0.02-0.44% of codes)
    ModelOpt quantizes with the DECODE scale ``d = amax/2688`` and divides, ``y = x / (s * d)``;
    the kernel order multiplies by reciprocals of the ENCODE scale, ``y = x * (1 / (s * (1/gs)))``.
    Both approximate the same exact ``x * 2688 / (amax * s)`` with different 1-3 ulp float32
    errors (2688 = 21 * 2^7 makes ``amax/2688`` inexact, and ``1/(1/d) != d`` for ~14% of
    values). A code can only differ when the exact value lies within those few ulps of an E2M1
    decision point (0.25, 0.75, ..., 5). With fp32 inputs (24-bit significands) that happens for
    ~1e-7 of elements. bf16 (8 bits) and fp16 (11 bits) inputs, the amax and E4M3 scales are
    short rationals, so the exact value often IS a midpoint (e.g. ``x = amax/8`` in a block with
    ``s = 448`` gives exactly 0.75): 0.2% of bf16 and 0.02% of fp16 elements are exact ties, and
    the two orders' rounding errors send each tie to a different side. Block scales differ the
    same way one level up (exact E4M3 midpoints). ``convention="modelopt"`` reproduces ModelOpt.

Mixed precision (``quant_algo: "MIXED_PRECISION"``, ModelOpt 0.47's ``process_layer_quant_config``
when a model holds more than one per-layer format; vLLM 0.33's ``ModelOptMixedPrecisionConfig``):
``hf_quant_config.json`` lists every quantized Linear in ``quantized_layers`` (module order) as
``{"quant_algo": "NVFP4" | "W4A16_NVFP4", "group_size": 16}`` or ``{"quant_algo":
"FP8_PER_CHANNEL_PER_TOKEN"}`` and writes no ``exclude_modules``: a Linear absent from the map is
float. ``config.json`` (``convert_hf_quant_config_format``) holds one config group per distinct
entry (first-seen order, ``targets`` sorted), the same ``quantized_layers`` and ``ignore: []``.
An FP8_PER_CHANNEL_PER_TOKEN layer (nvfp4lab's per-channel :class:`FP8Linear`) stores
``<name>.weight`` float8_e4m3fn ``[N, K]`` and ``<name>.weight_scale`` float32 ``[N]`` (1-D, no
input scale: activations are quantized per token at run time). Read and written here: those three
algorithms (:data:`MIXED_LAYER_ALGOS`), NVFP4 layers of one scheme. Refused: per-tensor
``"FP8"`` (static input scale, which :class:`FP8Linear` does not hold), MXFP4 (vLLM 0.33's
``LINEAR_ALGOS`` has none) and every other algorithm.

In memory nvfp4lab holds ENCODE scales; a ModelOpt DECODE scale read from disk is also kept
exactly (``weight_decode_scale`` / ``input_decode_scale``) and written back unchanged.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from nvfp4lab.checkpoint.formats.tensor_scales import TensorScaleForm
from nvfp4lab.checkpoint.records import (
    Contents,
    KVCacheNames,
    LayerNames,
    TaskRunner,
    Unquantized,
)
from nvfp4lab.checkpoint.refusals import CheckpointError, read_json
from nvfp4lab.checkpoint.safetensors_files import (
    CONFIG_NAME,
    SafetensorsContainer,
    quantization_block,
)
from nvfp4lab.constants import BLOCK_SIZE
from nvfp4lab.vocab import TENSOR_SCALE_STORAGE, CheckpointFormat, Scheme

__all__ = [
    "HF_QUANT_CONFIG_NAME",
    "KV_CACHE_ALGOS",
    "KV_CACHE_NAMES",
    "MIXED_ALGO",
    "MIXED_LAYER_ALGOS",
    "MODELOPT_FP8_KIND",
    "MODELOPT_VERSION",
    "QUANT_ALGOS",
    "QUANT_METHOD",
    "SPEC",
    "ModelOpt",
    "ModelOptConfig",
    "config_quantization",
    "excluded",
    "hf_quant_config",
    "mixed_config_quantization",
    "mixed_hf_quant_config",
    "read_modelopt_config",
    "write_mixed_configs",
]

HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
#: ``quantization_config.quant_method`` (and ``producer.name``) of a ModelOpt checkpoint.
QUANT_METHOD = "modelopt"
#: The tensor names of one quantized Linear (DECODE tensor scales, float32 ``[]``; ``[1]`` is
#: also read, as vLLM does).
NAMES = LayerNames("weight", "weight_scale", "weight_scale_2", "input_scale", (),
                   TENSOR_SCALE_STORAGE[CheckpointFormat.MODELOPT].decode, ((1,),))
#: The ModelOpt export format nvfp4lab reads and writes.
MODELOPT_VERSION = "0.47.0"
#: ModelOpt ``quant_algo`` -> the NVFP4 scheme it stores.
QUANT_ALGOS: dict[str, Scheme] = {"NVFP4": Scheme.NVFP4, "W4A16_NVFP4": Scheme.NVFP4A16}
_ALGO_OF: dict[Scheme, str] = {scheme: algo for algo, scheme in QUANT_ALGOS.items()}
#: ``quant_algo`` of a checkpoint whose layers differ in format (``quantized_layers`` map).
MIXED_ALGO = "MIXED_PRECISION"
#: The FP8 per-layer algorithm nvfp4lab reads and writes: per-channel weight scales, dynamic
#: per-token activations (vLLM 0.33 ``resolve``: ``kFp8StaticTokenSym`` / ``kFp8DynamicTokenSym``).
FP8_ALGO = "FP8_PER_CHANNEL_PER_TOKEN"
#: The layer kind of a ModelOpt FP8_PER_CHANNEL_PER_TOKEN Linear for
#: :func:`~nvfp4lab.checkpoint.mixed_layers.load_mixed_linear` (weight scale float32 ``[N]``).
MODELOPT_FP8_KIND = "fp8-modelopt"
#: Per-layer ``quant_algo`` of a MIXED_PRECISION checkpoint -> ``"nvfp4"`` / ``"fp8"``.
MIXED_LAYER_ALGOS: dict[str, str] = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", FP8_ALGO: "fp8"}


@dataclass(frozen=True)
class ModelOptConfig:
    """A validated ModelOpt NVFP4 configuration (``file``: where it was read)."""

    quant_algo: str
    scheme: Scheme
    group_size: int
    exclude_modules: tuple[str, ...]
    kv_cache_quant_algo: str | None
    file: Path
    #: MIXED_PRECISION: (module name, per-layer ``quant_algo``) in stored order; else empty.
    layers: tuple[tuple[str, str], ...] = ()

    @property
    def unquantized(self) -> tuple[str, ...]:
        """``exclude_modules``: module names and fnmatch wildcards; CheckpointError for a
        MIXED_PRECISION config (its FP8 layers no other format declares, so no convert)."""
        if self.layers:
            raise CheckpointError(
                f"{self.file}: quant_algo {MIXED_ALGO!r} holds per-layer formats no other format "
                "declares; a mixed checkpoint cannot be converted (load it with "
                "nvfp4lab.checkpoint.load)")
        return self.exclude_modules

    def checkpoint_scheme(self) -> Scheme:
        return self.scheme

    @property
    def kv_cache(self) -> str | None:
        """The KV cache kind ``kv_cache_quant_algo`` declares (``fp8``, ``nvfp4``, or
        ``nvfp4_4over6`` where nvfp4lab recorded that write), None without one; CheckpointError
        naming the file for an algorithm vLLM 0.33 does not map to a cache (INT8,
        NVFP4_AFFINE, ...)."""
        if self.kv_cache_quant_algo is None:
            return None
        kind = KV_CACHE_ALGOS.get(self.kv_cache_quant_algo)
        if kind is None:
            raise CheckpointError(
                f"{self.file}: kv_cache_quant_algo {self.kv_cache_quant_algo!r}; vLLM 0.33 maps "
                "FP8 and NVFP4 only (MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP), others run unquantized")
        return kind

    def quantized_modules(self, model: nn.Module) -> dict[str, bool]:
        """Module name -> whether it stores an input scale: every nn.Linear not matched by
        ``exclude_modules`` (as vLLM decides), all of one scheme; MIXED_PRECISION: the NVFP4
        entries of ``quantized_layers`` (:meth:`mixed_modules`: the FP8 ones)."""
        static = self.scheme == Scheme.NVFP4
        if self.layers:
            return {name: algo == "NVFP4" for name, algo in self._mixed(model)
                    if MIXED_LAYER_ALGOS[algo] == "nvfp4"}
        out = {
            name: static
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not excluded(name, self.exclude_modules)
        }
        if not out:
            raise CheckpointError(
                f"{self.file}: every Linear of the model is in exclude_modules "
                f"{list(self.exclude_modules)}; nothing is quantized"
            )
        return out

    def mixed_modules(self, model: nn.Module) -> dict[str, str]:
        """The FP8_PER_CHANNEL_PER_TOKEN Linears of a MIXED_PRECISION config: name ->
        :data:`MODELOPT_FP8_KIND` (empty for a single-algorithm config)."""
        return {name: MODELOPT_FP8_KIND for name, algo in self._mixed(model)
                if MIXED_LAYER_ALGOS[algo] == "fp8"}

    def _mixed(self, model: nn.Module) -> list[tuple[str, str]]:
        """``layers`` not matched by ``exclude_modules`` (vLLM checks those first), each an
        nn.Linear of ``model`` (CheckpointError naming the file otherwise)."""
        modules = dict(model.named_modules())
        out = [(n, a) for n, a in self.layers if not excluded(n, self.exclude_modules)]
        for name, _ in out:
            if not isinstance(modules.get(name), nn.Linear):
                found = type(modules[name]).__name__ if name in modules else "no such module"
                raise CheckpointError(f"{self.file}: quantized_layers names {name!r} ({found}); "
                                      "nvfp4lab loads quantized nn.Linear layers of the model only")
        return out


def _mixed_layers(file: Path, raw: Any) -> tuple[tuple[str, str], ...]:
    """The validated ``quantized_layers`` map of a MIXED_PRECISION config: (name, upper-case
    algorithm) pairs; CheckpointError naming the file and layer for an algorithm nvfp4lab
    cannot hold, a group size other than 16, or NVFP4 layers of both schemes."""
    if not isinstance(raw, dict) or not raw:
        raise CheckpointError(f"{file}: quant_algo {MIXED_ALGO!r} is not NVFP4 throughout and "
                              "its 'quantized_layers' map is missing or empty: add one (layer "
                              "name -> {'quant_algo': ...})")
    out: list[tuple[str, str]] = []
    for name, entry in raw.items():
        algo = str(entry.get("quant_algo") if isinstance(entry, dict) else entry).upper()
        if algo not in MIXED_LAYER_ALGOS:
            why = ("per-tensor FP8 with a static input scale, which FP8Linear (dynamic per "
                   "token) does not hold" if algo == "FP8" else "not a format nvfp4lab holds")
            raise CheckpointError(
                f"{file}: quantized_layers[{name!r}] has quant_algo {algo!r} ({why}); nvfp4lab "
                f"reads {', '.join(MIXED_LAYER_ALGOS)} layers")
        group = entry.get("group_size", BLOCK_SIZE) if isinstance(entry, dict) else BLOCK_SIZE
        if MIXED_LAYER_ALGOS[algo] == "nvfp4" and group != BLOCK_SIZE:
            raise CheckpointError(f"{file}: quantized_layers[{name!r}] has group_size {group!r}; "
                                  f"NVFP4 uses blocks of {BLOCK_SIZE}")
        out.append((str(name), algo))
    schemes = {a for _, a in out if MIXED_LAYER_ALGOS[a] == "nvfp4"}
    if len(schemes) > 1:
        raise CheckpointError(f"{file}: quantized_layers mix NVFP4 (W4A4) and W4A16_NVFP4 "
                              "layers; nvfp4lab reads one NVFP4 scheme per checkpoint")
    return tuple(out)


def _group_size(block: dict[str, Any]) -> Any:
    if "group_size" in block:
        return block["group_size"]
    for group in (block.get("config_groups") or {}).values():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and "group_size" in weights:
            return weights["group_size"]
    return BLOCK_SIZE


def _from_config_json(block: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    kv_algo = _kv_algo(block.get("kv_cache_scheme") or block.get("kv_cache_quant_algo"))
    exclude = block.get("ignore", block.get("exclude_modules", []))
    return block.get("quant_algo"), _group_size(block), exclude, kv_algo


def _check_agreement(directory: Path, file: Path, algo: Any) -> None:
    """``hf_quant_config.json``, when there is one beside a ``config.json`` ModelOpt config,
    must name the same ``quant_algo`` (vLLM reads one, other tools the other)."""
    hf_file = directory / HF_QUANT_CONFIG_NAME
    if not hf_file.is_file():
        return
    quant = read_json(hf_file).get("quantization")
    other = quant.get("quant_algo") if isinstance(quant, dict) else None
    if str(other).upper() != str(algo).upper():
        raise CheckpointError(
            f"{file} says quant_algo {algo!r} but {hf_file} says {other!r}; the two "
            "configurations must agree (vLLM reads the first, other tools the second): fix or "
            "remove the stale one"
        )


def read_modelopt_config(path: str | Path) -> ModelOptConfig:
    """Read and validate a ModelOpt NVFP4 configuration, as vLLM does: ``config.json``'s
    ``quantization_config`` when it has one, else ``hf_quant_config.json``.

    Raises :class:`CheckpointError` naming the file for another algorithm, a group size other
    than 16, or an ``hf_quant_config.json`` whose ``quant_algo``
    disagrees with ``config.json``'s.
    """
    directory = Path(path)
    block = quantization_block(directory)
    if block is not None and block.get("quant_method") == QUANT_METHOD:
        file = directory / CONFIG_NAME
        algo, group, exclude, kv = _from_config_json(block)
    else:
        file = directory / HF_QUANT_CONFIG_NAME
        quant = read_json(file).get("quantization")
        if not isinstance(quant, dict):
            raise CheckpointError(f"{file} has no 'quantization' object: not a ModelOpt config")
        algo, group = quant.get("quant_algo"), quant.get("group_size", BLOCK_SIZE)
        exclude, kv = quant.get("exclude_modules") or [], quant.get("kv_cache_quant_algo")
    key = str(algo).upper()
    layers: tuple[tuple[str, str], ...] = ()
    if key == MIXED_ALGO:
        layers = _mixed_layers(file, _block_of(directory, file).get("quantized_layers"))
        key = "NVFP4" if any(a == "NVFP4" for _, a in layers) else "W4A16_NVFP4"
    elif key not in QUANT_ALGOS:
        raise CheckpointError(
            f"{file}: quant_algo {algo!r} is not NVFP4; nvfp4lab reads ModelOpt "
            f"{' and '.join(repr(a) for a in QUANT_ALGOS)} (and {MIXED_ALGO!r}) checkpoints only"
        )
    if file.name == CONFIG_NAME:
        _check_agreement(directory, file, algo)
    if group != BLOCK_SIZE:
        raise CheckpointError(f"{file}: group_size {group!r}; NVFP4 uses blocks of {BLOCK_SIZE}")
    kv = _kv_algo(kv)
    if kv == "NVFP4" and _block_of(directory, file).get(KV_4OVER6_KEY) == "nvfp4_4over6":
        kv = "NVFP4_4OVER6"
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise CheckpointError(f"{file}: exclude_modules / ignore must be a list of names")
    quant_algo = MIXED_ALGO if layers else key
    return ModelOptConfig(quant_algo, QUANT_ALGOS[key], BLOCK_SIZE, tuple(exclude), kv, file,
                          layers)


def excluded(name: str, patterns: Iterable[str]) -> bool:
    """Whether module ``name`` is left unquantized by ModelOpt ``exclude_modules`` ``patterns``:
    an exact name, an fnmatch wildcard (``model.layers.0.mlp*``) or a dotted prefix."""
    return any(
        name == p or fnmatch.fnmatchcase(name, p) or name.startswith(p + ".") for p in patterns
    )


def hf_quant_config(scheme: str, exclude: Iterable[str]) -> dict[str, Any]:
    """The ``hf_quant_config.json`` object of an NVFP4 export, key order as ModelOpt writes it."""
    return {
        "producer": {"name": QUANT_METHOD, "version": MODELOPT_VERSION},
        "quantization": {
            "quant_algo": _ALGO_OF[Scheme(scheme)],
            "kv_cache_quant_algo": None,
            "group_size": BLOCK_SIZE,
            "exclude_modules": sorted(exclude),
        },
    }


def config_quantization(scheme: str, exclude: Iterable[str]) -> dict[str, Any]:
    """The ``quantization_config`` block ModelOpt appends to ``config.json``."""
    spec = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK_SIZE}
    group: dict[str, Any] = {"weights": dict(spec), "targets": ["Linear"]}
    if Scheme(scheme) == Scheme.NVFP4:
        group = {"input_activations": dict(spec), **group}
    return {
        "config_groups": {"group_0": group},
        "ignore": sorted(exclude),
        "quant_algo": _ALGO_OF[Scheme(scheme)],
        "producer": {"name": QUANT_METHOD, "version": MODELOPT_VERSION},
        "quant_method": QUANT_METHOD,
    }


def _layer_entry(algo: str) -> dict[str, Any]:
    """One ``quantized_layers`` entry as ModelOpt 0.47 writes it (``process_layer_quant_config``
    in modelopt/torch/export/quant_utils.py)."""
    return {"quant_algo": algo} if algo == FP8_ALGO else {"quant_algo": algo,
                                                          "group_size": BLOCK_SIZE}


def _group_of(algo: str) -> dict[str, Any]:
    """The config group body of one per-layer algorithm, as ModelOpt 0.47's
    ``_quant_algo_to_group_config`` (modelopt/torch/export/convert_hf_config.py) maps it."""
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK_SIZE}
    if algo == FP8_ALGO:
        return {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                "weights": {"dynamic": False, "num_bits": 8, "type": "float",
                            "strategy": "channel"}}
    if algo == "NVFP4":
        return {"input_activations": dict(fp4), "weights": dict(fp4)}
    return {"weights": dict(fp4)}


def mixed_hf_quant_config(layers: Mapping[str, str]) -> dict[str, Any]:
    """``hf_quant_config.json`` of a MIXED_PRECISION export; ``layers``: every quantized Linear
    (module order) -> its algorithm (:data:`MIXED_LAYER_ALGOS`)."""
    return {
        "producer": {"name": QUANT_METHOD, "version": MODELOPT_VERSION},
        "quantization": {
            "quant_algo": MIXED_ALGO,
            "kv_cache_quant_algo": None,
            "quantized_layers": {name: _layer_entry(algo) for name, algo in layers.items()},
        },
    }


def mixed_config_quantization(layers: Mapping[str, str]) -> dict[str, Any]:
    """The ``quantization_config`` ModelOpt 0.47 puts in ``config.json`` for MIXED_PRECISION
    (``convert_hf_quant_config_format``): one group per distinct layer entry in first-seen
    order, targets sorted, the ``quantized_layers`` map again and an empty ``ignore``."""
    targets: dict[str, list[str]] = {}
    for name, algo in layers.items():
        targets.setdefault(algo, []).append(name)
    groups = {f"group_{i}": {**_group_of(algo), "targets": sorted(names)}
              for i, (algo, names) in enumerate(targets.items())}
    return {
        "config_groups": groups,
        "quantized_layers": {name: _layer_entry(algo) for name, algo in layers.items()},
        "ignore": [],
        "quant_algo": MIXED_ALGO,
        "producer": {"name": QUANT_METHOD, "version": MODELOPT_VERSION},
        "quant_method": QUANT_METHOD,
    }


def write_mixed_configs(folder: Path, layers: Mapping[str, str]) -> None:
    """Replace ``folder``'s single-algorithm ModelOpt configs with the MIXED_PRECISION ones,
    keeping the KV cache they declare."""
    old = read_json(folder / HF_QUANT_CONFIG_NAME).get("quantization") or {}
    kind = old.get(KV_4OVER6_KEY) or KV_CACHE_ALGOS.get(str(old.get("kv_cache_quant_algo")))
    data = read_json(folder / CONFIG_NAME)
    data["quantization_config"] = mixed_config_quantization(layers)
    for name, body in ((CONFIG_NAME, data), (HF_QUANT_CONFIG_NAME, mixed_hf_quant_config(layers))):
        with open(folder / name, "w", encoding="utf-8") as handle:
            json.dump(body, handle, indent=4)
    if kind:
        _add_kv_cache(folder, kind)


#: ModelOpt ``kv_cache_quant_algo`` -> the nvfp4lab KV cache kind (``NVFP4_4OVER6``: an
#: ``NVFP4`` cache nvfp4lab recorded as written with the 4over6 search, :data:`KV_4OVER6_KEY`).
KV_CACHE_ALGOS: dict[str, str] = {"FP8": "fp8", "NVFP4": "nvfp4", "NVFP4_4OVER6": "nvfp4_4over6"}
#: nvfp4lab's own key beside ``kv_cache_quant_algo`` "NVFP4" saying the cache was written with
#: vLLM's 4over6 search (``--kv-cache-dtype nvfp4_4over6``: same layout and scales); engines
#: ignore it.
KV_4OVER6_KEY = "nvfp4lab_kv_cache_dtype"
#: Where ModelOpt 0.47 stores the KV cache's DECODE scales (``postprocess_state_dict``:
#: ``k_bmm_quantizer._amax`` -> ``<attn>.k_proj.k_scale``, float32 0-d; vLLM 0.33's
#: ``maybe_remap_kv_scale_name`` maps it to ``<attn>.attn.k_scale``); ``[1]`` also read; a
#: missing one follows vLLM's ``BaseKVCacheMethod`` rule.
KV_CACHE_NAMES = KVCacheNames("k_proj.k_scale", "v_proj.v_scale", (), ((1,),), missing=None)


def _kv_algo(kv: Any) -> str | None:
    """A ``kv_cache_quant_algo`` string or ``kv_cache_scheme`` (string or dict: FP8 as 8-bit
    float, NVFP4 as 4-bit float, the mapping of vLLM 0.33's ``get_kv_cache_quant_algo_string``)
    as an upper-case algorithm name; None without one."""
    if not kv:
        return None
    if isinstance(kv, dict):
        bits, kind = kv.get("num_bits"), kv.get("type")
        if kind == "float" and bits == 8:
            return "FP8"
        if kind == "float" and bits == 4:
            return "NVFP4"
        return f"{kind}{bits}".upper()
    return str(kv).upper()


def _block_of(directory: Path, file: Path) -> dict[str, Any]:
    """The configuration object ``file`` holds (``quantization_config`` / ``quantization``)."""
    data = read_json(file)
    block = data.get("quantization_config" if file.name == CONFIG_NAME else "quantization")
    return block if isinstance(block, dict) else {}


def _kv_entries(kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``config.json`` entries, ``hf_quant_config.json`` entries) of a ``kind`` KV cache, as
    ModelOpt 0.47 writes them (``convert_hf_config``: FP8 as a ``kv_cache_scheme`` dict, other
    algorithms as their name)."""
    algo = "FP8" if kind == "fp8" else "NVFP4"
    scheme: Any = {"dynamic": False, "num_bits": 8, "type": "float"} if algo == "FP8" else algo
    extra = {KV_4OVER6_KEY: kind} if kind == "nvfp4_4over6" else {}
    return {"kv_cache_scheme": scheme, **extra}, {"kv_cache_quant_algo": algo, **extra}


def _add_kv_cache(folder: Path, kind: str) -> None:
    """Declare a ``kind`` KV cache in both configuration files of ``folder``."""
    in_config, in_hf = _kv_entries(kind)
    for name, key, entries in ((CONFIG_NAME, "quantization_config", in_config),
                               (HF_QUANT_CONFIG_NAME, "quantization", in_hf)):
        data = read_json(folder / name)
        data[key].update(entries)
        with open(folder / name, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=4)


class ModelOpt(TensorScaleForm, SafetensorsContainer):
    """The ModelOpt NVFP4 format (see the module docstring)."""

    format = CheckpointFormat.MODELOPT
    title = "ModelOpt NVFP4"
    description = f"{QUANT_METHOD!r} (NVFP4)"
    names = NAMES
    weight_files: tuple[str, ...] = ()
    optional_tensor_scale: str | None = None
    shares_fused_scales = TENSOR_SCALE_STORAGE[format].shared_in_fused_groups
    writes_in_tasks = True
    config_files: tuple[str, ...] = (HF_QUANT_CONFIG_NAME,)
    transformers_needs_bfloat16 = False

    def detect(self, directory: Path) -> bool:
        """``quant_method == "modelopt"`` in ``config.json``'s ``quantization_config``, or no
        ``quant_method`` there and an ``hf_quant_config.json`` whose producer is ModelOpt (another
        producer raises :class:`CheckpointError`)."""
        block = quantization_block(directory)
        method = None if block is None else block.get("quant_method")
        if method == QUANT_METHOD:
            return True
        hf_file = directory / HF_QUANT_CONFIG_NAME
        if method is not None or not hf_file.is_file():
            return False
        producer = read_json(hf_file).get("producer") or {}
        if isinstance(producer, dict) and producer.get("name") == QUANT_METHOD:
            return True
        raise CheckpointError(f"{hf_file}: producer {producer!r} is not ModelOpt")

    def read_config(self, directory: Path) -> ModelOptConfig:
        return read_modelopt_config(directory)

    kv_cache_names = KV_CACHE_NAMES

    def kv_cache_refusal(self, kind: str) -> str | None:
        """None: ModelOpt declares every nvfp4lab KV cache kind (FP8, NVFP4)."""
        return None

    def write_checkpoint(self, folder: Path, contents: Contents,
                         run: TaskRunner | None = None) -> list[str]:
        """The safetensors checkpoint, then the KV cache algorithm when ``contents.kv_cache``."""
        written = SafetensorsContainer.write_checkpoint(self, folder, contents, run)
        if contents.kv_cache is not None:
            _add_kv_cache(folder, contents.kv_cache)
        return written

    def write_config(self, folder: Path, scheme: Scheme, unquantized: Unquantized) -> None:
        """Add the ``quantization_config`` to ``folder/config.json`` and write
        ``hf_quant_config.json`` (``exclude_modules``: ``unquantized.weights``)."""
        exclude = unquantized.weights
        data = read_json(folder / CONFIG_NAME)
        data["quantization_config"] = config_quantization(scheme, exclude)
        with open(folder / CONFIG_NAME, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=4)
        with open(folder / HF_QUANT_CONFIG_NAME, "w", encoding="utf-8") as handle:
            json.dump(hf_quant_config(scheme, exclude), handle, indent=4)


SPEC = ModelOpt()
