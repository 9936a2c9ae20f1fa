"""The model's names in GGUF: which architectures, which tensor names, which rows permuted.

:data:`GGUF_ARCHITECTURES` (transformers ``model_type`` -> GGUF architecture and whether
llama.cpp's converter stores the q/k rows permuted; every other type is refused),
:func:`model_names` (each state-dict key through gguf's ``get_tensor_name_map``, built on the
meta device), :func:`gguf_order` (llama.cpp's rotary row permutation), :data:`NAMES` (the
leaves of one quantized Linear) and the llama.cpp caveat :data:`FFN_SCALE_IGNORED` with its
:class:`LlamaCppScaleWarning`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvfp4lab.checkpoint.formats.gguf_read import config_dict, ggml_package, one_line
from nvfp4lab.checkpoint.records import Contents, LayerNames
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.checkpoint.rows import read_rows
from nvfp4lab.vocab import TENSOR_SCALE_STORAGE, CheckpointFormat

__all__ = [
    "FFN_SCALE_IGNORED",
    "GGUF_ARCHITECTURES",
    "NAMES",
    "LlamaCppScaleWarning",
    "ModelNames",
    "arch_of",
    "gguf_order",
    "inverse_order",
    "model_names",
    "warn_ignored_ffn_scales",
]

#: The leaves of one quantized Linear as nvfp4lab names them: ``weight`` (codes uint8
#: ``[N, K/2]``) and ``weight_scale`` (E4M3 ``[N, K/16]``) are both read from the NVFP4 tensor
#: ``<t>.weight``; ``scale`` and ``input_scale`` are the sidecars ``<t>.scale`` /
#: ``<t>.input_scale`` (DECODE, F32 ``[1]``).
NAMES = LayerNames("weight", "weight_scale", "scale", "input_scale", (1,),
                   TENSOR_SCALE_STORAGE[CheckpointFormat.GGUF].decode)


#: transformers ``model_type`` -> (GGUF architecture, whether llama.cpp's converter stores the
#: ``attn_q`` / ``attn_k`` rows permuted), as data: ``LlamaModel`` permutes them
#: (``undo_permute = True``, ``modify_tensors``), and so do its subclasses ``SmolLM3Model``,
#: ``GraniteModel`` (``GraniteMoeModel`` beneath it) and ``ArceeModel``, which change only the
#: architecture and hyper-parameters (llama.cpp conversion/llama.py, granite.py, arcee.py
#: @7bca1fd9ca2a681b0182e16f24f832b7be1942af, smollm.py @5535795b; the same classes in
#: convert_hf_to_gguf.py); ``Qwen2Model`` / ``Qwen3Model`` / ``Qwen2MoeModel`` /
#: ``Qwen3MoeModel`` are plain ``TextModel`` s and write rows as they are (conversion/qwen.py
#: @03173d5e). A model type not listed is refused: writing its rows unpermuted where llama.cpp
#: expects them permuted (or the reverse) gives a file llama.cpp runs with wrong attention.
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("llama", True),
    "smollm3": ("smollm3", True),
    "granite": ("granite", True),
    "granitemoe": ("granitemoe", True),
    "arcee": ("arcee", True),
    "qwen2": ("qwen2", False),
    "qwen2_moe": ("qwen2moe", False),
    "qwen3": ("qwen3", False),
    "qwen3_moe": ("qwen3moe", False),
}


#: GGUF architectures whose graph in llama.cpp (the revision llama-cpp-python 0.3.36 vendors)
#: multiplies the attention projections by their ``.scale`` sidecar but not the FFN's
#: (``build_ffn`` is given no ``up_s`` / ``gate_s`` / ``down_s``): measured node by node in
#: tests/peers/test_llama_cpp_architectures.py; docs/llama_cpp.md has the numbers.
FFN_SCALE_IGNORED: frozenset[str] = frozenset({"smollm3", "granite", "granitemoe", "arcee"})


class LlamaCppScaleWarning(UserWarning):
    """A GGUF nvfp4lab writes correctly that llama.cpp runs wrongly (:data:`FFN_SCALE_IGNORED`)."""


@dataclass(frozen=True)
class ModelNames:
    """The model's names in GGUF: state-dict key -> GGUF tensor name; GGUF module name ->
    the model's module name; every nn.Linear of the model; the GGUF architecture name."""

    keys: dict[str, str]
    modules: dict[str, str]
    linears: tuple[str, ...]
    arch: str
    heads: dict[str, int]  # GGUF module name -> heads whose rows are stored permuted
    #: state-dict key -> its shape, and nn.Linear name -> (out_features, in_features), the
    #: model's (what the file's tensors must match); the model's class name
    shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    linear_shapes: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    model_class: str = ""


def warn_ignored_ffn_scales(contents: Contents, names: ModelNames) -> None:
    """One :class:`LlamaCppScaleWarning` when ``names.arch`` is in :data:`FFN_SCALE_IGNORED` and
    an FFN tensor scale is not 1: llama.cpp would run those products ``1/scale`` too large."""
    if names.arch not in FFN_SCALE_IGNORED:
        return
    gguf_module = {hf: g for g, hf in names.modules.items()}
    off = []
    for tensor in contents.tensors():
        module, _, leaf = tensor.name.rpartition(".")
        base = gguf_module.get(module, "")
        if leaf == NAMES.tensor_scale and base.rpartition(".")[2].startswith("ffn_"):
            value = float(read_rows(tensor).reshape(-1)[0])
            if value != 1.0:
                off.append((base, value))
    if off:
        warnings.warn(
            f"llama.cpp's {names.arch} graph (llama-cpp-python 0.3.36) ignores the FFN tensors' "
            f".scale sidecar: {len(off)} of this file's FFN tensor scales are not 1 (first "
            f"{off[0][0]}.scale = {off[0][1]:.6g}), so llama.cpp runs those products 1/scale too "
            "large (NaN logits measured); the file itself is exact (nvfp4lab reads it back bit "
            "for bit). docs/llama_cpp.md says more",
            LlamaCppScaleWarning, stacklevel=4)


def arch_of(model_type: str) -> tuple[Any, bool]:
    """(gguf's ``MODEL_ARCH`` of a transformers ``model_type``, whether its q/k rows are stored
    permuted), from :data:`GGUF_ARCHITECTURES`."""
    gguf = ggml_package()
    if model_type not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"model_type {model_type!r} is not one nvfp4lab writes or reads as GGUF "
            f"({', '.join(GGUF_ARCHITECTURES)}: the architectures whose q/k row order in "
            "llama.cpp's converter it knows); save it in another format (compressed-tensors, "
            "modelopt)")
    name, permuted = GGUF_ARCHITECTURES[model_type]
    by_name = {n: arch for arch, n in gguf.MODEL_ARCH_NAMES.items()}
    if name not in by_name:
        raise CheckpointError(f"GGUF architecture {name!r} (model_type {model_type!r}) is not in "
                              "this gguf package's MODEL_ARCH_NAMES; pip install gguf==0.19.0")
    return by_name[name], permuted


@functools.lru_cache(maxsize=8)
def model_names(config_json: str) -> ModelNames:
    """Build the model on the meta device (no memory) from its config and map each state-dict
    key through gguf's ``get_tensor_name_map(arch, n_blocks)``."""
    import transformers

    gguf = ggml_package()
    data = config_dict(config_json, Path("config"))
    try:
        config = transformers.CONFIG_MAPPING[data["model_type"]].from_dict(data)
        cls = next((getattr(transformers, a) for a in (config.architectures or ())
                    if hasattr(transformers, a)), transformers.AutoModelForCausalLM)
        with torch.device("meta"):
            model = (cls.from_config(config) if cls is transformers.AutoModelForCausalLM
                     else cls._from_config(config))
    except Exception as exc:
        raise CheckpointError(f"transformers cannot build the model of this config "
                              f"({one_line(exc)})") from exc
    arch, permuted = arch_of(str(data["model_type"]))
    blocks = int(getattr(config, "num_hidden_layers", 0) or 0)
    table = gguf.get_tensor_name_map(arch, blocks)
    keys: dict[str, str] = {}
    modules: dict[str, str] = {}
    for key in model.state_dict():
        module, _, leaf = key.rpartition(".")
        name = table.get_name(module)
        if name is not None:
            keys[key] = f"{name}.{leaf}"
            modules.setdefault(name, module)
    linears = tuple(n for n, m in model.named_modules() if isinstance(m, nn.Linear))
    heads: dict[str, int] = {}
    if permuted:
        n_head = int(getattr(config, "num_attention_heads", 0) or 0)
        n_kv = int(getattr(config, "num_key_value_heads", None) or n_head)
        q_key, k_key = gguf.MODEL_TENSOR.ATTN_Q, gguf.MODEL_TENSOR.ATTN_K
        for b in range(blocks):
            heads[gguf.TENSOR_NAMES[q_key].format(bid=b)] = n_head
            heads[gguf.TENSOR_NAMES[k_key].format(bid=b)] = n_kv
    return ModelNames(keys, modules, linears, gguf.MODEL_ARCH_NAMES[arch], heads,
                  {k: tuple(v.shape) for k, v in model.state_dict().items()},
                  {n: (m.out_features, m.in_features) for n, m in model.named_modules()
                   if isinstance(m, nn.Linear)}, type(model).__name__)


def gguf_order(rows: int, heads: int) -> torch.Tensor:
    """int64 ``[rows]``: GGUF row ``g`` holds the model's row ``order[g]`` (llama.cpp's
    ``LlamaModel.permute``: each head's ``hd`` rows, seen as ``(2, hd/2)``, transposed to
    ``(hd/2, 2)``)."""
    if heads <= 0 or rows % heads or (rows // heads) % 2:
        raise CheckpointError(f"{rows} rows cannot be split into {heads} heads of an even "
                              "size: the rotary row permutation does not apply")
    hd = rows // heads
    g = torch.arange(rows)
    within = g % hd
    return (g - within) + (within % 2) * (hd // 2) + within // 2


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``order`` (int64, same length)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return inverse
