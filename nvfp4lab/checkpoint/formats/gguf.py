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
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from nvfp4lab.checkpoint.files import (
    LFS_POINTER_NOTE,
    ST_DTYPES,
    CheckpointError,
    Contents,
    LayerNames,
    StoredTensor,
    StoredWeights,
    TaskRunner,
    TensorInfo,
    check_readable,
    config_problem,
    lfs_pointer,
    parse_json,
    read_rows,
    tensor_bytes,
)
from nvfp4lab.checkpoint.formats.gguf_layout import check_layout
from nvfp4lab.constants import BLOCK_SIZE, GGML_NVFP4_BLOCK, GGML_NVFP4_BLOCK_BYTES
from nvfp4lab.layout import from_ggml_nvfp4, to_ggml_nvfp4
from nvfp4lab.vocab import CheckpointFormat, Scheme

__all__ = [
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

SUFFIX = ".gguf"
#: The file ``save_pretrained`` and ``convert`` write in the checkpoint folder.
WEIGHTS_FILE = "model.gguf"
#: The metadata key holding the model's transformers ``config.json`` text.
CONFIG_KEY = "nvfp4lab.config_json"
_MAGIC = b"GGUF"
#: The leaves of one quantized Linear as nvfp4lab names them: ``weight`` (codes uint8
#: ``[N, K/2]``) and ``weight_scale`` (E4M3 ``[N, K/16]``) are both read from the NVFP4 tensor
#: ``<t>.weight``; ``scale`` and ``input_scale`` are the sidecars ``<t>.scale`` /
#: ``<t>.input_scale`` (DECODE, F32 ``[1]``).
NAMES = LayerNames("weight", "weight_scale", "scale", "input_scale", (1,), True)
NAIVE_NOTE = (
    "no tensor scale (<name>.scale sidecar): llama.cpp decodes it with tensor scale 1, a "
    "'naive' NVFP4 GGUF whose E4M3 block scales alone must cover |W|, and quality suffers "
    "(llama.cpp #22858)"
)
#: Bytes of output (or input) rows handled at a time when repacking a tensor.
CHUNK_BYTES = 64 * 2**20
_FLOATS = {"F32": np.float32, "F16": np.float16}
_QUANT = "quant"  # a GgufView part: a non-NVFP4 ggml type, dequantized


def _ggml() -> Any:
    """The ``gguf`` package (CheckpointError naming the install when it is missing)."""
    try:
        import gguf
    except ImportError:
        raise CheckpointError("the GGUF format needs the gguf package, not installed: pip "
                              "install 'nvfp4lab[llm]' (or pip install gguf==0.19.0)") from None
    return gguf


@functools.cache
def _plain_reader_class() -> type:
    _ggml()
    from gguf.gguf_reader import GGUFReader  # the class itself, even while models patches gguf

    class PlainArrayReader(GGUFReader):  # type: ignore[misc]
        """gguf's reader with the file's mapping held as a plain ``ndarray`` view of the same
        bytes: numpy's ``memmap`` subclass runs Python code on every slice, and the reader
        slices the file once per field part (one per vocabulary entry)."""

        @property  # type: ignore[override]
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, mapped: Any) -> None:
            self._plain = mapped.view(np.ndarray)  # keeps the mapping alive as its base

    return PlainArrayReader


def gguf_reader(path: str | os.PathLike[str]) -> Any:
    """gguf's ``GGUFReader`` of ``path``, read-only, with the fields and tensors gguf parses
    (byte for byte the same), parsed about 2.5x faster: 1.0 s instead of 2.5 s for SmolLM2's
    49,152-token vocabulary. The file's layout is first walked with bounds
    (:func:`~nvfp4lab.checkpoint.formats.gguf_layout.check_layout`: every count against the
    bytes that remain, CheckpointError naming the file and key or tensor), so no count in it
    can make the reader loop or allocate past the file; then raises what ``GGUFReader``
    raises."""
    check_layout(Path(path))
    return _plain_reader_class()(path, "r")


def gguf_file(path: str | os.PathLike[str]) -> Path:
    """The GGUF file of ``path``: the file itself, or the one ``.gguf`` file of a folder
    (CheckpointError when the folder holds none or several, or the file is not GGUF)."""
    where = Path(path)
    if where.is_dir():
        found = sorted(p for p in where.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
        if not found:
            raise CheckpointError(f"{where} holds no {SUFFIX} file")
        if len(found) > 1:
            raise CheckpointError(f"{where} holds {len(found)} {SUFFIX} files "
                                  f"({', '.join(p.name for p in found[:3])}); pass the one to "
                                  "read")
        check_readable(where, found)  # no link out of the folder (the one rule)
        where = found[0]
    _check_magic(where)
    return where.absolute()


def _check_magic(file: Path) -> None:
    try:
        with open(file, "rb") as handle:
            head = handle.read(4)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read it ({exc.strerror})") from None
    if head != _MAGIC and lfs_pointer(file):
        raise CheckpointError(f"{file} {LFS_POINTER_NOTE}")
    if head != _MAGIC:
        raise CheckpointError(f"{file}: not a GGUF file (it starts with {head!r}, a GGUF file "
                              f"with {_MAGIC!r}); the file is corrupt or not GGUF")


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


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
                              f"metadata ({_one_line(exc)})") from exc
    if not config.get("architectures"):
        cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(config.get("model_type")))
        if cls:
            config["architectures"] = [cls]
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


@functools.lru_cache(maxsize=8)
def _parse_cached(file: str, mtime_ns: int, size: int) -> _Parsed:
    del mtime_ns, size  # the cache key: a rewritten file is read again
    gguf = _ggml()
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
        raise CheckpointError(f"{path}: cannot read it as GGUF ({_one_line(exc)}); the file is "
                              "truncated, corrupt or not a GGUF file") from None
    if not arch:
        raise CheckpointError(f"{path}: no general.architecture in the metadata; not a model")
    own = config_json is not None
    if config_json is None:
        config_json = _transformers_config(path)
    _check_config(path, arch, tensors, _config_dict(config_json, path), own)
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
            claimed = _ggml().MODEL_ARCH_NAMES[_arch_of(str(data["model_type"]))[0]]
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


def _config_dict(text: str, where: Path) -> dict[str, Any]:
    data = parse_json(text, where, f"{CONFIG_KEY} is")
    if not isinstance(data, dict) or "model_type" not in data:
        raise CheckpointError(f"{where}: {CONFIG_KEY} is not a transformers config (an object "
                              "with model_type)")
    return data


# ---------------------------------------------------------------------------------------------
# names: the model's state-dict keys <-> GGUF tensor names (gguf's own name map)


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


def _warn_ignored_ffn_scales(contents: Contents, names: _Names) -> None:
    """One :class:`LlamaCppScaleWarning` when ``names.arch`` is in :data:`FFN_SCALE_IGNORED` and
    an FFN tensor scale is not 1: llama.cpp would run those products ``1/scale`` too large."""
    if names.arch not in FFN_SCALE_IGNORED:
        return
    gguf_module = {hf: g for g, hf in names.modules.items()}
    off = []
    for tensor in contents.tensors():
        module, _, leaf = tensor.name.rpartition(".")
        base = gguf_module.get(module, "")
        if leaf == NAMES.global_scale and base.rpartition(".")[2].startswith("ffn_"):
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


def _arch_of(model_type: str) -> tuple[Any, bool]:
    """(gguf's ``MODEL_ARCH`` of a transformers ``model_type``, whether its q/k rows are stored
    permuted), from :data:`GGUF_ARCHITECTURES`."""
    gguf = _ggml()
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


@dataclass(frozen=True)
class _Names:
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


@functools.lru_cache(maxsize=8)
def _names(config_json: str) -> _Names:
    """Build the model on the meta device (no memory) from its config and map each state-dict
    key through gguf's ``get_tensor_name_map(arch, n_blocks)``."""
    import transformers

    gguf = _ggml()
    data = _config_dict(config_json, Path("config"))
    try:
        config = transformers.CONFIG_MAPPING[data["model_type"]].from_dict(data)
        cls = next((getattr(transformers, a) for a in (config.architectures or ())
                    if hasattr(transformers, a)), transformers.AutoModelForCausalLM)
        with torch.device("meta"):
            model = (cls.from_config(config) if cls is transformers.AutoModelForCausalLM
                     else cls._from_config(config))
    except Exception as exc:
        raise CheckpointError(f"transformers cannot build the model of this config "
                              f"({_one_line(exc)})") from exc
    arch, permuted = _arch_of(str(data["model_type"]))
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
    return _Names(keys, modules, linears, gguf.MODEL_ARCH_NAMES[arch], heads,
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


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return inverse


# ---------------------------------------------------------------------------------------------
# the file seen under the model's names


@dataclass(frozen=True)
class GgufView:
    """Rows of one GGUF tensor as nvfp4lab names them (a
    :class:`~nvfp4lab.checkpoint.files.RowView`). ``part``: "codes" / "scales" (the two halves
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
            index = _inverse(gguf_order(self.rows_total, self.heads))[start:stop].numpy()
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
        if self.part == _QUANT:
            gguf = _ggml()
            values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(self.kind))
            out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        else:
            out = torch.from_numpy(raw).reshape(-1).view(ST_DTYPES[self.dtype])
        return out.reshape((stop - start, self.cols) if self.cols else (stop - start,))


def _float_dtype(kind: int) -> str | None:
    """The safetensors dtype of a float ggml type, None for a quantized one."""
    q = _ggml().GGMLQuantizationType
    return {int(q.F32): "F32", int(q.F16): "F16", int(q.BF16): "BF16"}.get(kind)


def _model_name(t: _Tensor, names: _Names) -> tuple[str, str]:
    """(the model's name of GGUF tensor ``t``, its GGUF module) (the GGUF name when the model
    has no such tensor)."""
    module, _, leaf = t.name.rpartition(".")
    hf = names.modules.get(module)
    return (t.name if hf is None else f"{hf}.{leaf}"), module


def _check_linear(file: Path, t: _Tensor, prefix: str, names: _Names) -> None:
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


def _tensor_infos(parsed: _Parsed) -> tuple[dict[str, TensorInfo], dict[str, bool]]:
    """The file's tensors under the model's names, and the quantized Linears (model name ->
    whether it stores an input scale)."""
    gguf = _ggml()
    names = _names(parsed.config_json)
    nvfp4 = int(gguf.GGMLQuantizationType.NVFP4)
    present = {t.name for t in parsed.tensors}
    out: dict[str, TensorInfo] = {}
    quantized: dict[str, bool] = {}
    for t in parsed.tensors:
        key, module = _model_name(t, names)
        heads = names.heads.get(module, 0) if t.name.endswith((".weight", ".bias")) else 0
        rows = t.shape[0] if t.shape else 1
        row_bytes = t.nbytes // max(rows, 1)
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
            out[f"{prefix}.{NAMES.scale}"] = TensorInfo(
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
    return out, quantized


# ---------------------------------------------------------------------------------------------
# the configuration (what load, audit and convert ask of a format)


@dataclass(frozen=True)
class GgufConfig:
    """What a GGUF file says of its quantization (``file``: the GGUF file): its NVFP4 tensors
    by the model's module name (-> whether the layer stores an input scale) and the model's
    other Linears."""

    file: Path
    quantized: dict[str, bool]
    linears: tuple[str, ...]

    @property
    def unquantized(self) -> tuple[str, ...]:
        """Every nn.Linear of the model that has no NVFP4 tensor (a tied ``lm_head`` too)."""
        return tuple(n for n in self.linears if n not in self.quantized)

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
        for name in self.quantized:
            try:
                module = model.get_submodule(name)
            except AttributeError:
                module = None
            if not isinstance(module, nn.Linear):
                raise CheckpointError(f"{self.file}: the NVFP4 tensor of {name!r} has no "
                                      f"nn.Linear in {type(model).__name__} to load into")
        return dict(self.quantized)


# ---------------------------------------------------------------------------------------------
# writing


class _Streamed:
    """A tensor ``GGUFWriter.write_tensor_data`` writes (it asks ``nbytes`` and ``tofile``),
    produced chunk by chunk so that no tensor is held whole."""

    def __init__(self, nbytes: int, chunks: Callable[[], Iterator[memoryview]]) -> None:
        self.nbytes = nbytes
        self._chunks = chunks

    def tofile(self, fout: Any) -> None:
        written = 0
        for chunk in self._chunks():
            fout.write(chunk)
            written += len(chunk)
        if written != self.nbytes:
            raise CheckpointError(f"wrote {written} bytes of a tensor of {self.nbytes}")


@dataclass(frozen=True)
class _Out:
    """One GGUF tensor to write: its name, ggml type, the shape and numpy dtype GGUFWriter's
    ``add_tensor_info`` takes (bytes per row for a quantized or BF16 type), and its data."""

    name: str
    kind: Any
    shape: tuple[int, ...]
    np_dtype: Any
    nbytes: int
    data: _Streamed


def _row_steps(rows: int, row_bytes: int, heads: int) -> Iterator[tuple[int, int]]:
    """Row ranges of about :data:`CHUNK_BYTES`, whole heads when rows are permuted."""
    unit = rows // heads if heads else 1
    step = max(1, CHUNK_BYTES // max(row_bytes * unit, 1)) * unit
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def _permuted(value: torch.Tensor, start: int, order: torch.Tensor | None) -> torch.Tensor:
    """GGUF rows ``start:start + len(value)`` from the model's rows of the same (whole-head)
    range."""
    if order is None:
        return value
    return value[order[start:start + value.shape[0]] - start]


def _nvfp4_out(name: str, packed: StoredTensor, block: StoredTensor, heads: int) -> _Out:
    gguf = _ggml()
    n, k = packed.shape[0], 2 * packed.shape[1]
    if (packed.dtype != "U8" or len(packed.shape) != 2 or block.dtype != "F8_E4M3"
            or tuple(block.shape) != (n, k // BLOCK_SIZE)):
        raise CheckpointError(f"{name}: codes {packed.dtype} {list(packed.shape)} and block "
                              f"scales {block.dtype} {list(block.shape)} are not NVFP4 "
                              "(U8 [N, K/2], F8_E4M3 [N, K/16])")
    if k % GGML_NVFP4_BLOCK:
        raise CheckpointError(
            f"{packed.name.rpartition('.')[0]}: K = {k} is not a multiple of {GGML_NVFP4_BLOCK}"
            f": GGUF NVFP4 stores blocks of {GGML_NVFP4_BLOCK} elements (llama.cpp "
            f"block_nvfp4); save this model in another format or use in_features that are "
            f"multiples of {GGML_NVFP4_BLOCK}")
    row_bytes = k // GGML_NVFP4_BLOCK * GGML_NVFP4_BLOCK_BYTES
    order = gguf_order(n, heads) if heads else None

    def chunks() -> Iterator[memoryview]:
        for a, b in _row_steps(n, row_bytes, heads):
            codes = _permuted(read_rows(packed, a, b), a, order)
            scales = _permuted(read_rows(block, a, b), a, order)
            try:
                yield tensor_bytes(to_ggml_nvfp4(codes, scales))
            except ValueError as exc:
                raise CheckpointError(f"{packed.name}: {exc}") from None

    return _Out(f"{name}.weight", gguf.GGMLQuantizationType.NVFP4, (n, row_bytes), np.uint8,
                n * row_bytes, _Streamed(n * row_bytes, chunks))


def _float_out(name: str, tensor: StoredTensor, heads: int) -> _Out:
    """An unquantized tensor: 1-D ones as F32, 2-D ones in their float dtype."""
    gguf = _ggml()
    q = gguf.GGMLQuantizationType
    if tensor.dtype not in ("F32", "F16", "BF16") or len(tensor.shape) > 2:
        raise CheckpointError(f"{tensor.name}: {tensor.dtype} {list(tensor.shape)}; GGUF "
                              "holds 1-D and 2-D float tensors (F32, F16, BF16) besides NVFP4")
    one_d = len(tensor.shape) <= 1
    dtype = "F32" if one_d else tensor.dtype
    rows = tensor.shape[0] if tensor.shape else 1
    cols = 1 if one_d else tensor.shape[1]
    size = {"F32": 4, "F16": 2, "BF16": 2}[dtype]
    order = gguf_order(rows, heads) if heads else None

    def chunks() -> Iterator[memoryview]:
        for a, b in _row_steps(rows, cols * size, heads):
            value = read_rows(tensor, a, b) if tensor.shape else read_rows(tensor).reshape(1)
            yield tensor_bytes(_permuted(value.to(ST_DTYPES[dtype]), a, order))

    nbytes = rows * cols * size
    shape = (rows,) if one_d else (rows, cols)
    if dtype == "BF16":
        return _Out(name, q.BF16, (rows, cols * size), np.uint8, nbytes,
                    _Streamed(nbytes, chunks))
    return _Out(name, None, shape, _FLOATS[dtype], nbytes, _Streamed(nbytes, chunks))


def _plan(contents: Contents, names: _Names) -> list[_Out]:
    """The GGUF tensors of ``contents``, in its order (an NVFP4 tensor where its codes are)."""
    tensors = {t.name: t for t in contents.tensors()}
    quantized = {k.removesuffix(f".{NAMES.scale}") for k in tensors
                 if k.endswith(f".{NAMES.scale}")}
    gguf_module = {hf: g for g, hf in names.modules.items()}
    out: list[_Out] = []
    for key, tensor in tensors.items():
        module, _, leaf = key.rpartition(".")
        if module in quantized:
            base = gguf_module.get(module)
            if base is None:
                raise CheckpointError(f"{module}: gguf's name map for {names.arch} has no name "
                                      "for this layer; it cannot be written as GGUF")
            if leaf == NAMES.packed:
                out.append(_nvfp4_out(base, tensor, tensors[f"{module}.{NAMES.scale}"],
                                      names.heads.get(base, 0)))
            elif leaf in (NAMES.global_scale, NAMES.input_scale):
                out.append(_float_out(f"{base}.{leaf}", tensor, 0))
            elif leaf == "bias":
                out.append(_float_out(f"{base}.{leaf}", tensor, names.heads.get(base, 0)))
            elif leaf != NAMES.scale:
                raise CheckpointError(f"{key}: a quantized layer's tensor GGUF has no place for")
            continue
        target = names.keys.get(key)
        if target is None:
            raise CheckpointError(f"{key}: gguf's name map for {names.arch} has no name for "
                                  "this tensor; it cannot be written as GGUF")
        base = target.rpartition(".")[0]
        out.append(_float_out(target, tensor, names.heads.get(base, 0)))
    return out


def _source_file(source: Path | None) -> Path | None:
    """The GGUF file a model came from: ``source`` when it is a GGUF file or a folder holding
    exactly one, else None; CheckpointError when ``source`` no longer exists (its metadata
    would be dropped without a word)."""
    if source is None:
        return None
    if not source.exists():
        raise CheckpointError(
            f"{source}: the file this model was read from is gone (moved or deleted); a GGUF "
            "save copies its metadata (tokenizer, chat template, hyper-parameters), without "
            "which llama.cpp cannot load the result: move it back, or pass "
            "save_pretrained(..., source=<its new path>)")
    if source.is_file() and source.suffix.lower() == SUFFIX:
        return gguf_file(source)
    if source.is_dir():
        found = [p for p in source.iterdir() if p.suffix.lower() == SUFFIX and p.is_file()]
        return gguf_file(found[0]) if len(found) == 1 else None
    return None


def _copy_metadata(writer: Any, source: Path, arch: str) -> None:
    """Every key-value of the GGUF ``source`` but its header, architecture, file type, split
    keys and nvfp4lab's config, as stored (strings as their bytes)."""
    gguf = _ggml()
    kind = gguf.GGUFValueType
    try:
        reader = gguf_reader(source)
    except Exception as exc:
        raise CheckpointError(f"{source}: cannot read it as GGUF ({_one_line(exc)})") from None
    found = reader.fields.get(gguf.Keys.General.ARCHITECTURE)
    if found is None or str(found.contents()) != arch:
        raise CheckpointError(
            f"the source {source} is a {found.contents() if found else 'model without an'} "
            f"architecture, the model saved is {arch}; pass source= the GGUF file the model "
            "was read from")
    skip = {gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE, CONFIG_KEY}
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "split.")) or key in skip or not field.types:
            continue
        main = field.types[0]
        sub = field.types[-1] if main == kind.ARRAY else None
        if sub == kind.ARRAY:
            continue  # nested arrays: none in llama.cpp's keys, and GGUFWriter packs none
        if sub == kind.STRING:
            value: Any = [bytes(field.parts[i]) for i in field.data]
        elif main == kind.STRING:
            value = bytes(field.parts[field.data[0]])
        else:
            value = field.contents()
        if main == kind.ARRAY and not len(value):
            continue
        writer.add_key_value(key, value, main, sub)


def _hyperparameters(writer: Any, config: dict[str, Any]) -> None:
    """A text model's hyper-parameters as llama.cpp's converter writes them
    (``TextModel.set_gguf_parameters`` and ``LlamaModel.set_gguf_parameters``), those the
    config has."""
    text = {**config, **(config.get("text_config") or {})}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    heads = text.get("num_attention_heads")
    head_dim = text.get("head_dim") or (text["hidden_size"] // heads
                                        if heads and text.get("hidden_size") else None)
    for method, value in (
        ("add_block_count", text.get("num_hidden_layers")),
        ("add_context_length", text.get("max_position_embeddings")),
        ("add_embedding_length", text.get("hidden_size")),
        ("add_feed_forward_length", text.get("intermediate_size")),
        ("add_head_count", heads),
        ("add_head_count_kv", text.get("num_key_value_heads")),
        ("add_rope_freq_base", rope.get("rope_theta", text.get("rope_theta"))),
        ("add_layer_norm_rms_eps", text.get("rms_norm_eps")),
        ("add_vocab_size", text.get("vocab_size")),
        ("add_rope_dimension_count", head_dim),
    ):
        if value is not None:
            getattr(writer, method)(value)
    if text.get("model_type") in ("granite", "granitemoe"):  # GraniteModel.set_gguf_parameters
        for method, key in (("add_attention_scale", "attention_multiplier"),
                            ("add_embedding_scale", "embedding_multiplier"),
                            ("add_residual_scale", "residual_multiplier"),
                            ("add_logit_scale", "logits_scaling")):
            if text.get(key):
                getattr(writer, method)(text[key])


def _write(folder: Path, contents: Contents) -> list[str]:
    gguf = _ggml()
    config = _config_dict(contents.config_json, folder / WEIGHTS_FILE)
    names = _names(contents.config_json)
    plan = _plan(contents, names)  # every refusal before the file is opened
    _warn_ignored_ffn_scales(contents, names)
    if not any(o.kind == gguf.GGMLQuantizationType.NVFP4 for o in plan):
        raise CheckpointError("no quantized layer to write; a GGUF NVFP4 file holds at least one")
    writer = gguf.GGUFWriter(path=None, arch=names.arch)
    source = _source_file(contents.source)
    if source is not None:
        _copy_metadata(writer, source, names.arch)
    else:
        _hyperparameters(writer, config)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_NVFP4)
    writer.add_string(CONFIG_KEY, contents.config_json)
    for o in plan:
        writer.add_tensor_info(o.name, o.shape, np.dtype(o.np_dtype), o.nbytes, raw_dtype=o.kind)
    try:
        writer.write_header_to_file(path=folder / WEIGHTS_FILE)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for o in plan:
            writer.write_tensor_data(o.data)
    finally:
        writer.close()
    return [WEIGHTS_FILE]


class Gguf:
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
    shares_fused_scales = False
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
        _, quantized = _tensor_infos(parsed)
        if not quantized:
            gguf = _ggml()
            kinds = sorted({gguf.GGMLQuantizationType(t.kind).name for t in parsed.tensors})
            raise CheckpointError(f"{parsed.file} holds no NVFP4 tensor (its types: "
                                  f"{', '.join(kinds)}); nvfp4lab reads NVFP4 GGUF files "
                                  "(ggml type 40)")
        return GgufConfig(parsed.file, quantized, _names(parsed.config_json).linears)

    def read_weights(self, path: Path) -> StoredWeights:
        """The file's tensors under the model's names (an NVFP4 tensor as its codes and block
        scales, read through :class:`GgufView`; q/k rows unpermuted)."""
        parsed = _parse(path)
        tensors, _ = _tensor_infos(parsed)
        return StoredWeights(parsed.file.parent, (parsed.file,), tensors, {parsed.file: {}})

    def model_config(self, path: Path) -> dict[str, Any]:
        """The transformers config: :data:`CONFIG_KEY`, else transformers' GGUF reader's."""
        parsed = _parse(path)
        return _config_dict(parsed.config_json, parsed.file)

    def write_checkpoint(self, folder: Path, contents: Contents,
                         run: TaskRunner | None = None) -> list[str]:
        """``folder/model.gguf`` (one file, written tensor by tensor in chunks of rows in this
        process: ``run`` is not needed)."""
        del run
        return _write(folder, contents)

    def to_disk(self, encode: torch.Tensor, decode: torch.Tensor | None) -> torch.Tensor:
        """The stored DECODE scale ``[1]``: the layer's exact DECODE buffer when it has one,
        else the float32 reciprocal of the ENCODE scale."""
        if encode.shape != (1,):
            return encode
        value = decode if decode is not None else torch.reciprocal(encode)
        return value.reshape(NAMES.scalar_shape)

    def from_disk(self, stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(ENCODE scale = the float32 reciprocal, the stored DECODE scale kept exactly)."""
        return torch.reciprocal(stored), stored

    def fused_decode_scale(self, stored: Sequence[float]) -> torch.Tensor:
        """llama.cpp merges no group (:attr:`shares_fused_scales` is False); were one merged,
        its DECODE scale would be the max (float32 ``[1]``)."""
        return torch.tensor([max(stored)], dtype=torch.float32)


SPEC = Gguf()
