"""Writing a GGUF NVFP4 file: the tensor plan, the metadata and the bytes, chunk by chunk.

:func:`write_gguf` writes ``<folder>/model.gguf`` (:data:`WEIGHTS_FILE`) from a
:class:`~nvfp4lab.checkpoint.records.Contents`: every refusal first (:func:`_plan`: an NVFP4
tensor where its codes are, a Q8_0 tensor where a mixed model's int8 codes are, q/k rows
permuted, the float tensors F32 / F16 / BF16), then the
key-values (copied from the GGUF file the model came from, else its hyper-parameters as
llama.cpp's converter writes them, plus :data:`~nvfp4lab.checkpoint.formats.gguf_read.CONFIG_KEY`),
then the tensors through gguf's ``GGUFWriter``, :data:`CHUNK_BYTES` of rows at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nvfp4lab.checkpoint.formats.gguf_names import (
    NAMES,
    ModelNames,
    gguf_order,
    model_names,
    warn_ignored_ffn_scales,
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
from nvfp4lab.checkpoint.records import ST_DTYPES, Contents, StoredTensor
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.checkpoint.rows import read_rows, tensor_bytes
from nvfp4lab.constants import (
    BLOCK_SIZE,
    GGML_NVFP4_BLOCK,
    GGML_NVFP4_BLOCK_BYTES,
    GGML_Q8_0_BLOCK,
)
from nvfp4lab.execution.ggml_cpu import q8_0_blocks
from nvfp4lab.execution.mixed_q8_0 import SCALE_BUFFER as Q8_0_SCALE
from nvfp4lab.layout import to_ggml_nvfp4

__all__ = ["CHUNK_BYTES", "Q8_0_SCALE", "WEIGHTS_FILE", "kv_cache_refusal", "write_gguf"]

#: The file ``save_pretrained`` and ``convert`` write in the checkpoint folder.
WEIGHTS_FILE = "model.gguf"


#: Bytes of output (or input) rows handled at a time when repacking a tensor.
CHUNK_BYTES = 64 * 2**20
_FLOATS = {"F32": np.float32, "F16": np.float16}


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
    gguf = ggml_package()
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


def _q8_0_out(name: str, codes: StoredTensor, d: StoredTensor, heads: int) -> _Out:
    """A Q8_0 Linear weight as ggml type 8: per row and 32 values the float16 ``d`` then the
    32 int8 codes (34 bytes), rows permuted like every q/k weight."""
    gguf = ggml_package()
    n, k = codes.shape if len(codes.shape) == 2 else (0, 0)
    if (codes.dtype != "I8" or len(codes.shape) != 2 or k % GGML_Q8_0_BLOCK or d.dtype != "F16"
            or tuple(d.shape) != (n, k // GGML_Q8_0_BLOCK)):
        raise CheckpointError(f"{codes.name}: codes {codes.dtype} {list(codes.shape)} and "
                              f"scales {d.dtype} {list(d.shape)} are not Q8_0 (I8 [N, K], F16 "
                              f"[N, K/{GGML_Q8_0_BLOCK}], K a multiple of {GGML_Q8_0_BLOCK})")
    row_bytes = k // GGML_Q8_0_BLOCK * (GGML_Q8_0_BLOCK + 2)
    order = gguf_order(n, heads) if heads else None

    def chunks() -> Iterator[memoryview]:
        for a, b in _row_steps(n, row_bytes, heads):
            q = _permuted(read_rows(codes, a, b), a, order)
            yield tensor_bytes(q8_0_blocks(q, _permuted(read_rows(d, a, b), a, order)))

    return _Out(f"{name}.weight", gguf.GGMLQuantizationType.Q8_0, (n, row_bytes), np.uint8,
                n * row_bytes, _Streamed(n * row_bytes, chunks))


def _float_out(name: str, tensor: StoredTensor, heads: int) -> _Out:
    """An unquantized tensor: 1-D ones as F32, 2-D ones in their float dtype."""
    gguf = ggml_package()
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


def _plan(contents: Contents, names: ModelNames) -> list[_Out]:
    """The GGUF tensors of ``contents``, in its order (an NVFP4 tensor where its codes are)."""
    tensors = {t.name: t for t in contents.tensors()}
    quantized = {k.removesuffix(f".{NAMES.block_scale}") for k in tensors
                 if k.endswith(f".{NAMES.block_scale}")}
    q8_0 = {k.removesuffix(f".{Q8_0_SCALE}") for k in tensors if k.endswith(f".{Q8_0_SCALE}")}
    gguf_module = {hf: g for g, hf in names.modules.items()}
    out: list[_Out] = []
    for key, tensor in tensors.items():
        module, _, leaf = key.rpartition(".")
        if module in q8_0:
            base = gguf_module.get(module)
            if base is None:
                raise CheckpointError(f"{module}: gguf's name map for {names.arch} has no name "
                                      "for this layer; it cannot be written as GGUF")
            if leaf == "weight":
                out.append(_q8_0_out(base, tensor, tensors[f"{module}.{Q8_0_SCALE}"],
                                     names.heads.get(base, 0)))
            elif leaf == "bias":
                out.append(_float_out(f"{base}.{leaf}", tensor, names.heads.get(base, 0)))
            elif leaf != Q8_0_SCALE:
                raise CheckpointError(f"{key}: a Q8_0 layer's tensor GGUF has no place for")
            continue
        if module in quantized:
            base = gguf_module.get(module)
            if base is None:
                raise CheckpointError(f"{module}: gguf's name map for {names.arch} has no name "
                                      "for this layer; it cannot be written as GGUF")
            if leaf == NAMES.packed:
                out.append(_nvfp4_out(base, tensor, tensors[f"{module}.{NAMES.block_scale}"],
                                      names.heads.get(base, 0)))
            elif leaf in (NAMES.tensor_scale, NAMES.input_scale):
                out.append(_float_out(f"{base}.{leaf}", tensor, 0))
            elif leaf == "bias":
                out.append(_float_out(f"{base}.{leaf}", tensor, names.heads.get(base, 0)))
            elif leaf != NAMES.block_scale:
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
    gguf = ggml_package()
    kind = gguf.GGUFValueType
    try:
        reader = gguf_reader(source)
    except Exception as exc:
        raise CheckpointError(f"{source}: cannot read it as GGUF ({one_line(exc)})") from None
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


def kv_cache_refusal(kind: str) -> str:
    """Why a GGUF file cannot hold a quantized KV cache of any ``kind`` (kept refused: no
    keyword drops it; the caller removes the quantization first)."""
    return (f"GGUF cannot hold it: a GGUF file has no KV cache kind or k / v scales (llama.cpp "
            f"picks its cache type at run time with --cache-type-k / --cache-type-v and has no "
            f"{kind} cache with these scales)")


def write_gguf(folder: Path, contents: Contents) -> list[str]:
    if contents.kv_cache is not None:
        raise CheckpointError(kv_cache_refusal(contents.kv_cache))
    gguf = ggml_package()
    config = config_dict(contents.config_json, folder / WEIGHTS_FILE)
    names = model_names(contents.config_json)
    plan = _plan(contents, names)  # every refusal before the file is opened
    warn_ignored_ffn_scales(contents, names)
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
