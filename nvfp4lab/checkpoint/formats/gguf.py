"""GGUF NVFP4 (ggml type 40), as llama.cpp reads it (:data:`SPEC`).

Read and written with the ``gguf`` package (``GGUFReader`` / ``GGUFWriter``, its tensor-name maps
and constants); no GGUF byte is parsed or laid out by hand. A GGUF checkpoint is one ``.gguf``
file of tensors and metadata: :func:`~nvfp4lab.checkpoint.load` and ``convert`` take the file or
a folder holding exactly one; ``save_pretrained(..., format="gguf")`` and ``convert`` write a
folder holding ``model.gguf`` (:data:`WEIGHTS_FILE`), as every format writes a folder
(atomically, :mod:`nvfp4lab.checkpoint.folders`); pass ``<folder>/model.gguf`` to llama.cpp.

On disk, per quantized Linear whose GGUF name is ``<t>`` (``blk.0.attn_q``, from gguf's
``get_tensor_name_map(arch, n_blocks)``: the model's ``model.layers.0.self_attn.q_proj``):

* ``<t>.weight``: ``GGMLQuantizationType.NVFP4`` (40), ``[N, K]`` elements in blocks of 64 = 36
  bytes (K must be a multiple of 64): the four UE4M3 block-scale bytes of its 16-element
  sub-blocks, unchanged, then the codes repacked (``layout.to_ggml_nvfp4``); no tensor scale in
  the block (llama.cpp ggml-common.h ``block_nvfp4``, PR #19769);
* ``<t>.scale``: F32 ``[1]``, the DECODE tensor scale ``amax/2688``, which the graph multiplies
  into the matmul output (``build_lora_mm``: ``ggml_mul(res, w_s)``). llama.cpp's converter
  writes ModelOpt's ``weight_scale_2`` there (convert_hf_to_gguf.py ``_repack_nvfp4`` /
  ``_write_scale_tensor`` @0024aa7417efd50a7c2a79e049dfbbbceb0beaaf, flattened to ``[1]``) and,
  for compressed-tensors, the reciprocal of ``weight_global_scale`` (PR #21095: "the scales
  become reciprocal values"). So ``.scale`` = ModelOpt's ``weight_scale_2`` =
  1 / compressed-tensors' ``weight_global_scale``. The converter leaves out a scale within 1e-6
  of 1; a tensor without one decodes with tensor scale 1 (the "naive" NVFP4 GGUF whose quality
  suffers, llama.cpp #22858): :func:`~nvfp4lab.checkpoint.load` reads it so, ``audit`` flags
  it. nvfp4lab always writes the sidecar, so its value survives every round trip exactly;
* ``<t>.input_scale``: F32 ``[1]``, the DECODE activation scale (scheme "NVFP4" only), written
  by the converter the same way (llama.cpp's CUDA MMQ path computes its own per-row scale).

The ``attn_q`` / ``attn_k`` rows of LLaMA, SmolLM3, Granite and Arcee (llama.cpp's converter
classes built on ``LlamaModel``; :data:`GGUF_ARCHITECTURES`, which also refuses every model type
whose row order is not known) are stored permuted, as llama.cpp's converter permutes them
for its rotary layout (``LlamaModel.permute``: per head, rows ``(2, hd/2)`` -> ``(hd/2, 2)``;
the NVFP4 path permutes the weight and the block scales alike, conversion/llama.py
``_repack_nvfp4`` @7bca1fd9ca2a681b0182e16f24f832b7be1942af; transformers' GGUF loader reverses
it, ``LlamaTensorProcessor``). An NVFP4 block runs along K within a row, so moving whole rows
keeps every block intact: nvfp4lab writes rows permuted and reads them back unpermuted,
losslessly.

Unquantized tensors: 1-D ones (norms, biases) as F32 (llama.cpp's converter writes every 1-D
tensor F32; from bfloat16/float16 that is exact), 2-D ones (embeddings, an untied or float
``lm_head``) in their dtype, F32 / F16 / BF16 (all GGUF types; nothing is rounded). A tied
``lm_head`` is not written: llama.cpp falls back to ``token_embd``, as for the source model.
Reading also accepts other ggml types for the unquantized tensors (Q8_0, Q4_1, ...): they are
dequantized to float32 by ``gguf.quants.dequantize``.

Mixed models (:mod:`nvfp4lab.checkpoint.mixed_layers`): a
:class:`~nvfp4lab.execution.mixed_q8_0.Q8_0Linear` is written as ``<t>.weight`` of
``GGMLQuantizationType.Q8_0`` (8; ``block_q8_0``: the float16 ``d``, then 32 int8 codes, 34 bytes
per 32 values; q/k rows permuted as above) with its bias F32 and no sidecar; float Linears are
written like any 2-D float tensor. On reading, a Q8_0 tensor that is the weight of one of the
model's nn.Linear, of its shape, is seen as ``<linear>.weight`` int8 ``[N, K]`` and
``<linear>.weight_d`` float16 ``[N, K/32]`` (:class:`GgufView` parts of the same blocks) and
loads as a ``Q8_0Linear`` byte for byte (:meth:`GgufConfig.mixed_modules`); ``convert`` (through
the model) refuses such a file for the other formats, which declare no Q8_0.

Metadata: a model that came from a GGUF file (``source=`` of ``save_pretrained``, or the file
its reader recorded in the model's ``nvfp4lab_source`` attribute: ``nvfp4lab.models.smollm2``
and ``checkpoint.load`` set it) keeps that file's key-values: architecture, hyper-parameters,
tokenizer, chat template, ...; ``general.file_type`` becomes ``MOSTLY_NVFP4``. Without a GGUF
source, the hyper-parameters are written from the transformers config as llama.cpp's converter
does for a text model (``TextModel.set_gguf_parameters``), with no tokenizer: such a file holds
the tensors exactly but llama.cpp needs a tokenizer to load it. Either way nvfp4lab adds its
own key :data:`CONFIG_KEY`, the model's transformers ``config.json`` text, so that nvfp4lab
reads the model back exactly (llama.cpp ignores the key); a GGUF file without it (llama.cpp's
converter output) gets its transformers config from transformers' own GGUF reader.

This module holds the format spec (:class:`Gguf`, :data:`SPEC`), the file seen under the
model's names (:class:`GgufView`) and its quantization (:class:`GgufConfig`); the jobs beside it:
:mod:`~nvfp4lab.checkpoint.formats.gguf_read` (the ``gguf`` package, a file found and parsed),
:mod:`~nvfp4lab.checkpoint.formats.gguf_names` (architectures, tensor names, q/k permutation),
:mod:`~nvfp4lab.checkpoint.formats.gguf_write` (the writer),
:mod:`~nvfp4lab.checkpoint.formats.gguf_layout` (the bounds walk). Their public names stay
importable from here.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from nvfp4lab.checkpoint.formats.gguf_names import (
    FFN_SCALE_IGNORED,
    GGUF_ARCHITECTURES,
    NAMES,
    LlamaCppScaleWarning,
    ModelNames,
    arch_of,
    gguf_order,
    inverse_order,
    model_names,
)
from nvfp4lab.checkpoint.formats.gguf_read import (
    CONFIG_KEY,
    SUFFIX,
    config_dict,
    ggml_package,
    gguf_file,
    gguf_reader,
    one_line,
)
from nvfp4lab.checkpoint.formats.gguf_write import (
    CHUNK_BYTES,
    Q8_0_SCALE,
    WEIGHTS_FILE,
    kv_cache_refusal,
    write_gguf,
)
from nvfp4lab.checkpoint.formats.tensor_scales import TensorScaleForm
from nvfp4lab.checkpoint.records import ST_DTYPES, Contents, StoredWeights, TaskRunner, TensorInfo
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.checkpoint.validation import config_problem
from nvfp4lab.constants import (
    BLOCK_SIZE,
    GGML_NVFP4_BLOCK,
    GGML_NVFP4_BLOCK_BYTES,
    GGML_Q8_0_BLOCK,
)
from nvfp4lab.layout import from_ggml_nvfp4
from nvfp4lab.vocab import TENSOR_SCALE_STORAGE, CheckpointFormat, LayerFormat, Scheme

__all__ = [
    "CHUNK_BYTES",
    "CONFIG_KEY",
    "FFN_SCALE_IGNORED",
    "GGUF_ARCHITECTURES",
    "NAIVE_NOTE",
    "NAMES",
    "SPEC",
    "SUFFIX",
    "WEIGHTS_FILE",
    "Gguf",
    "GgufConfig",
    "GgufView",
    "LlamaCppScaleWarning",
    "gguf_file",
    "gguf_order",
    "gguf_reader",
]

#: The model's names in GGUF, under the name this module gave it before (its ``cache_clear``
#: forgets every model's names).
_names = model_names

NAIVE_NOTE = (
    "no tensor scale (<name>.scale sidecar): llama.cpp decodes it with tensor scale 1, a "
    "'naive' NVFP4 GGUF whose E4M3 block scales alone must cover |W|, and quality suffers "
    "(llama.cpp #22858)"
)


_QUANT = "quant"  # a GgufView part: a non-NVFP4 ggml type, dequantized
_Q8_CODES, _Q8_SCALES = "q8_codes", "q8_scales"  # GgufView parts: a Q8_0 Linear's two halves


# ---------------------------------------------------------------------------------------------
# reading the file once: tensors, metadata, the transformers config


@dataclass(frozen=True)
class _Tensor:
    """One tensor of a GGUF file: ``kind`` its ggml type, ``shape`` row-major (ggml's ``ne``
    reversed), ``offset`` absolute in the file, ``nbytes``."""

    name: str
    kind: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _Parsed:
    file: Path
    arch: str
    tensors: tuple[_Tensor, ...]
    config_json: str


def _transformers_config(file: Path) -> str:
    """The transformers config of a GGUF file nvfp4lab did not write, by transformers' own
    GGUF reader (metadata only), with ``architectures`` set to its causal-LM class."""
    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config = dict(load_gguf_checkpoint(str(file), return_tensors=False)["config"])
    except Exception as exc:
        raise CheckpointError(f"{file}: transformers cannot build a model config from its "
                              f"metadata ({one_line(exc)})") from exc
    if not config.get("architectures"):
        cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(config.get("model_type")))
        if cls:
            config["architectures"] = [cls]
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


@functools.lru_cache(maxsize=8)
def _parse_cached(file: str, mtime_ns: int, size: int) -> _Parsed:
    del mtime_ns, size  # the cache key: a rewritten file is read again
    gguf = ggml_package()
    path = Path(file)
    try:
        reader = gguf_reader(path)  # check_layout first: big-endian, tensors past the end...
        tensors = tuple(
            _Tensor(t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)),
                    int(t.data_offset), int(t.n_bytes))
            for t in reader.tensors
        )
        arch_field = reader.fields.get(gguf.Keys.General.ARCHITECTURE)
        arch = str(arch_field.contents()) if arch_field is not None else ""
        config = reader.fields.get(CONFIG_KEY)
        config_json = str(config.contents()) if config is not None else None
    except CheckpointError:
        raise
    except Exception as exc:  # ValueError, struct / numpy errors of a truncated file
        raise CheckpointError(f"{path}: cannot read it as GGUF ({one_line(exc)}); the file is "
                              "truncated, corrupt or not a GGUF file") from None
    if not arch:
        raise CheckpointError(f"{path}: no general.architecture in the metadata; not a model")
    own = config_json is not None
    if config_json is None:
        config_json = _transformers_config(path)
    _check_config(path, arch, tensors, config_dict(config_json, path), own)
    return _Parsed(path, arch, tensors, config_json)


def _check_config(file: Path, arch: str, tensors: Sequence[_Tensor], data: dict[str, Any],
                  own: bool) -> None:
    """Refuse a config that disagrees with the file before any model is built from it: more
    layers than the tensors' ``blk.<i>`` hold (``validation.config_problem``: building them
    would take ~15 KB each), or (``own``: nvfp4lab's :data:`CONFIG_KEY`, not derived from the
    metadata by transformers) a ``model_type`` of another architecture than the file's."""
    where = f"{file}: its config ({CONFIG_KEY if own else 'from the metadata'})"
    problem = config_problem(data, (t.name for t in tensors))
    if problem is not None:
        raise CheckpointError(f"{where}: {problem}")
    if own:
        try:
            claimed = ggml_package().MODEL_ARCH_NAMES[arch_of(str(data["model_type"]))[0]]
        except CheckpointError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        if claimed != arch:
            raise CheckpointError(
                f"{where} says model_type {data['model_type']!r} (GGUF architecture "
                f"{claimed!r}) but the file's general.architecture is {arch!r}; the config "
                "does not describe these tensors")


def _parse(path: str | os.PathLike[str]) -> _Parsed:
    file = gguf_file(path)
    stat = file.stat()
    return _parse_cached(str(file), stat.st_mtime_ns, stat.st_size)


# ---------------------------------------------------------------------------------------------
# the file seen under the model's names


@dataclass(frozen=True)
class GgufView:
    """Rows of one GGUF tensor as nvfp4lab names them (a
    :class:`~nvfp4lab.checkpoint.records.RowView`). ``part``: "codes" / "scales" (the two halves
    of an NVFP4 tensor, ``layout.from_ggml_nvfp4``), "values" (a float tensor of ``dtype``
    stored in another row order) or "quant" (another ggml type ``kind``, dequantized to float32
    by ``gguf.quants.dequantize``). ``cols``: elements per row of the named tensor (0: 1-D);
    ``heads``: rows stored permuted (:func:`gguf_order`), 0 when not; ``name``: the GGUF
    tensor, for errors.

    The "scales" part gives every block-scale byte as stored (``audit`` counts NaN and negative
    ones, ``load`` refuses them naming the tensor); the "codes" part refuses (CheckpointError
    naming the file and tensor) rows whose scale bytes ggml and E4M3 read as different values
    (``layout.from_ggml_nvfp4``), so ``convert`` never writes them."""

    file: Path
    offset: int
    rows_total: int
    row_bytes: int
    part: str
    dtype: str
    cols: int = 0
    kind: int = 0
    heads: int = 0
    name: str = ""

    def rows(self, start: int, stop: int) -> torch.Tensor:
        stop = max(start, min(stop, self.rows_total))
        memory = np.memmap(self.file, dtype=np.uint8, mode="r", offset=self.offset,
                           shape=(self.rows_total, self.row_bytes))
        if self.heads:
            index = inverse_order(gguf_order(self.rows_total, self.heads))[start:stop].numpy()
            raw = np.asarray(memory[index])
        else:
            raw = np.array(memory[start:stop])
        del memory
        if self.part == "scales":  # each block's leading scale bytes, unchanged
            blocks = torch.from_numpy(raw).reshape(stop - start, -1, GGML_NVFP4_BLOCK_BYTES)
            scales = blocks[..., :GGML_NVFP4_BLOCK // BLOCK_SIZE].reshape(stop - start, -1)
            return scales.contiguous().view(torch.float8_e4m3fn)
        if self.part == "codes":
            try:
                return from_ggml_nvfp4(torch.from_numpy(raw))[0]
            except ValueError as exc:
                raise CheckpointError(f"{self.file}: tensor {self.name!r}, rows {start}-"
                                      f"{stop - 1}: {exc}") from None
        if self.part in (_Q8_CODES, _Q8_SCALES):  # block_q8_0: fp16 d, then 32 int8 codes
            blocks = torch.from_numpy(raw).reshape(stop - start, -1, GGML_Q8_0_BLOCK + 2)
            if self.part == _Q8_SCALES:
                return blocks[..., :2].contiguous().view(torch.float16).reshape(stop - start, -1)
            return blocks[..., 2:].contiguous().view(torch.int8).reshape(stop - start, -1)
        if self.part == _QUANT:
            gguf = ggml_package()
            values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(self.kind))
            out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        else:
            out = torch.from_numpy(raw).reshape(-1).view(ST_DTYPES[self.dtype])
        return out.reshape((stop - start, self.cols) if self.cols else (stop - start,))


def _float_dtype(kind: int) -> str | None:
    """The safetensors dtype of a float ggml type, None for a quantized one."""
    q = ggml_package().GGMLQuantizationType
    return {int(q.F32): "F32", int(q.F16): "F16", int(q.BF16): "BF16"}.get(kind)


def _model_name(t: _Tensor, names: ModelNames) -> tuple[str, str]:
    """(the model's name of GGUF tensor ``t``, its GGUF module) (the GGUF name when the model
    has no such tensor)."""
    module, _, leaf = t.name.rpartition(".")
    hf = names.modules.get(module)
    return (t.name if hf is None else f"{hf}.{leaf}"), module


def _check_linear(file: Path, t: _Tensor, prefix: str, names: ModelNames) -> None:
    """An NVFP4 tensor must be the weight of an nn.Linear of the config's model, of its shape
    (checked before any row is read: its rows and K come from the file's dims)."""
    expected = names.linear_shapes.get(prefix) if t.name.endswith(".weight") else None
    if expected is None:
        raise CheckpointError(
            f"{file}: tensor {t.name!r} is NVFP4 but {prefix!r} is no nn.Linear of the "
            f"config's {names.model_class}; nvfp4lab reads NVFP4 Linear weights only "
            "(embeddings, norms and the rest are stored in float types)")
    if tuple(t.shape) != expected:
        raise CheckpointError(
            f"{file}: NVFP4 tensor {t.name!r} is {list(t.shape)} (rows N, elements per row K) "
            f"but the config's {prefix!r} is an nn.Linear of {list(expected)} "
            "(out_features, in_features); the file and its config disagree")


def _q8_0_infos(parsed: _Parsed, t: _Tensor, prefix: str, heads: int) -> dict[str, TensorInfo]:
    """A Q8_0 Linear weight as its int8 codes ``<prefix>.weight`` ``[N, K]`` and float16 block
    scales ``<prefix>.weight_d`` ``[N, K/32]`` (the bounds walk checked that its ``N · K/32``
    blocks of 34 bytes lie in the file)."""
    n, k = t.shape
    view = functools.partial(GgufView, parsed.file, t.offset, n, t.nbytes // n, heads=heads,
                             name=t.name)
    nb = k // GGML_Q8_0_BLOCK
    return {
        f"{prefix}.weight": TensorInfo(parsed.file, t.name, "I8", (n, k), t.offset, n * k,
                                       view(part=_Q8_CODES, dtype="I8", cols=k)),
        f"{prefix}.{Q8_0_SCALE}": TensorInfo(parsed.file, t.name, "F16", (n, nb), t.offset,
                                             2 * n * nb,
                                             view(part=_Q8_SCALES, dtype="F16", cols=nb)),
    }


def _tensor_infos(parsed: _Parsed) -> tuple[dict[str, TensorInfo], dict[str, bool],
                                             tuple[str, ...]]:
    """The file's tensors under the model's names, the quantized Linears (model name ->
    whether it stores an input scale) and the Q8_0 Linears (a Q8_0 tensor that is the weight of
    one of the model's nn.Linear, of its shape: read as codes and scales, module docstring)."""
    gguf = ggml_package()
    names = model_names(parsed.config_json)
    nvfp4 = int(gguf.GGMLQuantizationType.NVFP4)
    q8_0 = int(gguf.GGMLQuantizationType.Q8_0)
    present = {t.name for t in parsed.tensors}
    out: dict[str, TensorInfo] = {}
    quantized: dict[str, bool] = {}
    q8_layers: list[str] = []
    for t in parsed.tensors:
        key, module = _model_name(t, names)
        heads = names.heads.get(module, 0) if t.name.endswith((".weight", ".bias")) else 0
        rows = t.shape[0] if t.shape else 1
        row_bytes = t.nbytes // max(rows, 1)
        prefix = key.rpartition(".")[0]
        if t.kind == q8_0 and t.name.endswith(".weight") and len(t.shape) == 2 and (
                names.linear_shapes.get(prefix) == tuple(t.shape)):
            out.update(_q8_0_infos(parsed, t, prefix, heads))
            q8_layers.append(prefix)
            continue
        if t.kind == nvfp4:
            if len(t.shape) != 2:
                raise CheckpointError(
                    f"{parsed.file}: NVFP4 tensor {t.name!r} has shape {list(t.shape)}; "
                    "nvfp4lab reads 2-D NVFP4 weights (one Linear each), not stacked experts")
            n, k = t.shape
            prefix = key.rpartition(".")[0]
            _check_linear(parsed.file, t, prefix, names)
            view = functools.partial(GgufView, parsed.file, t.offset, n, row_bytes,
                                     dtype="U8", heads=heads, name=t.name)
            out[f"{prefix}.{NAMES.packed}"] = TensorInfo(
                parsed.file, t.name, "U8", (n, k // 2), t.offset, n * k // 2,
                view(part="codes", cols=k // 2))
            out[f"{prefix}.{NAMES.block_scale}"] = TensorInfo(
                parsed.file, t.name, "F8_E4M3", (n, k // BLOCK_SIZE), t.offset,
                n * k // BLOCK_SIZE, view(part="scales", cols=k // BLOCK_SIZE))
            quantized[prefix] = f"{module}.{NAMES.input_scale}" in present
            continue
        dtype = _float_dtype(t.kind)
        cols = t.shape[1] if len(t.shape) == 2 else 0
        if len(t.shape) > 2:
            raise CheckpointError(f"{parsed.file}: tensor {t.name!r} has shape "
                                  f"{list(t.shape)}; nvfp4lab reads 1-D and 2-D tensors")
        expected = names.shapes.get(key)
        if expected is not None and tuple(t.shape) != expected:
            raise CheckpointError(
                f"{parsed.file}: tensor {t.name!r} has shape {list(t.shape)} but the config's "
                f"{names.model_class} has {key!r} of shape {list(expected)}; the file and its "
                "config disagree")
        if dtype is None:
            view = GgufView(parsed.file, t.offset, rows, row_bytes, _QUANT, "F32", cols,
                            t.kind, heads)
            out[key] = TensorInfo(parsed.file, t.name, "F32", t.shape, t.offset,
                                  4 * max(rows, 1) * max(cols, 1), view)
        elif heads:
            view = GgufView(parsed.file, t.offset, rows, row_bytes, "values", dtype, cols,
                            heads=heads)
            out[key] = TensorInfo(parsed.file, t.name, dtype, t.shape, t.offset, t.nbytes, view)
        else:
            out[key] = TensorInfo(parsed.file, t.name, dtype, t.shape, t.offset, t.nbytes)
    return out, quantized, tuple(q8_layers)


# ---------------------------------------------------------------------------------------------
# the configuration (what load, audit and convert ask of a format)


@dataclass(frozen=True)
class GgufConfig:
    """What a GGUF file says of its quantization (``file``: the GGUF file): its NVFP4 tensors
    by the model's module name (-> whether the layer stores an input scale), the model's
    Linears, and those stored Q8_0 (``q8_0``: a mixed model's
    :class:`~nvfp4lab.execution.mixed_q8_0.Q8_0Linear` layers)."""

    file: Path
    quantized: dict[str, bool]
    linears: tuple[str, ...]
    q8_0: tuple[str, ...] = ()

    @property
    def unquantized(self) -> tuple[str, ...]:
        """Every nn.Linear of the model that has no NVFP4 tensor (a tied ``lm_head`` too), which
        another format's config records on ``convert``; CheckpointError for a file with Q8_0
        Linears, which no other format declares."""
        if self.q8_0:
            raise CheckpointError(
                f"{self.file}: {len(self.q8_0)} Linear(s) are stored Q8_0 (e.g. "
                f"{self.q8_0[0]!r}), which neither compressed-tensors nor ModelOpt declares; a "
                "mixed GGUF cannot be converted (load it with nvfp4lab.checkpoint.load)")
        return tuple(n for n in self.linears if n not in self.quantized)

    def mixed_modules(self, model: nn.Module) -> dict[str, str]:
        """The Q8_0 Linears: name -> ``"q8_0"`` (each an nn.Linear of ``model``)."""
        self._check_linears(model, self.q8_0, "Q8_0")
        return dict.fromkeys(self.q8_0, str(LayerFormat.Q8_0))

    def _check_linears(self, model: nn.Module, names: Iterable[str], kind: str) -> None:
        """CheckpointError for a stored ``kind`` tensor whose name is no nn.Linear of ``model``."""
        for name in names:
            try:
                module = model.get_submodule(name)
            except AttributeError:
                module = None
            if not isinstance(module, nn.Linear):
                raise CheckpointError(f"{self.file}: the {kind} tensor of {name!r} has no "
                                      f"nn.Linear in {type(model).__name__} to load into")

    def checkpoint_scheme(self) -> Scheme:
        """NVFP4 when every NVFP4 tensor has an ``.input_scale`` sidecar, NVFP4A16 when none
        has; CheckpointError when they mix."""
        static = list(self.quantized.values())
        if any(static) and not all(static):
            missing = next(n for n, s in self.quantized.items() if not s)
            raise CheckpointError(f"{self.file}: some NVFP4 tensors have an input_scale sidecar "
                                  f"and some not (e.g. {missing!r}); nvfp4lab reads one scheme "
                                  "per checkpoint")
        return Scheme.NVFP4 if static and all(static) else Scheme.NVFP4A16

    def quantized_modules(self, model: nn.Module) -> dict[str, bool]:
        """Module name -> whether it stores a static input scale, for every NVFP4 tensor."""
        self._check_linears(model, self.quantized, "NVFP4")
        return dict(self.quantized)


class Gguf(TensorScaleForm):
    """The GGUF NVFP4 format (see the module docstring)."""

    format = CheckpointFormat.GGUF
    title = "GGUF"
    description = "'gguf' (NVFP4, ggml type 40)"
    names = NAMES
    config_files: tuple[str, ...] = ()
    weight_files: tuple[str, ...] = (WEIGHTS_FILE,)
    transformers_needs_bfloat16 = False
    optional_tensor_scale: str | None = NAIVE_NOTE
    #: llama.cpp keeps one tensor scale per tensor: q/k/v and gate/up are never merged
    shares_fused_scales = TENSOR_SCALE_STORAGE[format].shared_in_fused_groups
    #: No quantized KV cache in a GGUF file (``gguf_write.kv_cache_refusal``).
    kv_cache_refusal = staticmethod(kv_cache_refusal)
    writes_in_tasks = False

    def detect(self, path: Path) -> bool:
        """A ``.gguf`` file, or a folder holding ``.gguf`` files (CheckpointError for several, or
        a file that does not start with the GGUF magic)."""
        if path.is_file():
            if path.suffix.lower() != SUFFIX:
                return False
        elif not path.is_dir() or not any(p.suffix.lower() == SUFFIX for p in path.iterdir()):
            return False
        gguf_file(path)
        return True

    def read_config(self, path: Path) -> GgufConfig:
        """The NVFP4 tensors of the file (CheckpointError when it holds none)."""
        parsed = _parse(path)
        _, quantized, q8_0 = _tensor_infos(parsed)
        if not quantized:
            gguf = ggml_package()
            kinds = sorted({gguf.GGMLQuantizationType(t.kind).name for t in parsed.tensors})
            raise CheckpointError(f"{parsed.file} holds no NVFP4 tensor (its types: "
                                  f"{', '.join(kinds)}); nvfp4lab reads NVFP4 GGUF files "
                                  "(ggml type 40)")
        return GgufConfig(parsed.file, quantized, model_names(parsed.config_json).linears, q8_0)

    def read_weights(self, path: Path) -> StoredWeights:
        """The file's tensors under the model's names (an NVFP4 tensor as its codes and block
        scales, read through :class:`GgufView`; q/k rows unpermuted)."""
        parsed = _parse(path)
        tensors, _, _ = _tensor_infos(parsed)
        return StoredWeights(parsed.file.parent, (parsed.file,), tensors, {parsed.file: {}})

    def model_config(self, path: Path) -> dict[str, Any]:
        """The transformers config: :data:`CONFIG_KEY`, else transformers' GGUF reader's."""
        parsed = _parse(path)
        return config_dict(parsed.config_json, parsed.file)

    def write_checkpoint(self, folder: Path, contents: Contents,
                         run: TaskRunner | None = None) -> list[str]:
        """``folder/model.gguf`` (one file, written tensor by tensor in chunks of rows in this
        process: ``run`` is not needed)."""
        del run
        return write_gguf(folder, contents)


SPEC = Gguf()
