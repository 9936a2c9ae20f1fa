"""The LLM study for a model larger than memory: the reference and each configuration evaluated
block by block, each decoder block's weights read from the safetensors when its turn comes.

A local model folder (``config.json`` and ``*.safetensors``, one file or shards with their index,
possibly links into a Hugging Face cache's ``blobs/``) is opened as a :class:`StreamedModel`:
the model built from ``config.json`` on the ``meta`` device (no weights), then only what lies
outside the decoder blocks materialized from the safetensors, tensor by tensor (embeddings, final
norm, output head; tied weights stay tied; non-persistent buffers such as the rotary
frequencies computed as ``from_pretrained`` computes them). A block is materialized only while it
runs (:meth:`StreamedModel.load_block`: a copy of the meta block, its tensors read from disk and
cast to the model's dtype) and dropped after.

:func:`streamed_reference` captures block 0's call for every batch of windows (the model's own
code up to its first block, :func:`~nvfp4lab.execution.streamed_blocks.capture_calls`), runs
every block over all of them in turn, then the model's code after the blocks (final norm, head)
per batch: the :class:`~nvfp4lab.studies.llm.ReferenceRun` that
:func:`~nvfp4lab.studies.llm.reference_run` makes of the fully loaded model, bit for bit in the
same dtype (built by ``reference_run``'s own steps from the streamed outputs). It keeps the head's
input per batch, so configurations need not run the reference again, and the model's own head
(not a copy: nothing here changes it; a vocabulary x hidden matrix, 1 GB for a 128k vocabulary
in bf16, is not held twice).

:func:`streamed_config_row` is :func:`~nvfp4lab.studies.llm_configs.config_row` computed the same
way: per block, its weights read, the configuration applied to that block alone
(:func:`~nvfp4lab.execution.streamed_blocks.quantize_block`: RTN, GPTQ / MR-GPTQ calibrated on
the calibration batches' calls as they leave the already quantized earlier blocks, as
``sequential_gptq`` does in memory; calibrated input scales from the calibration calls run through
the block in calibration mode), the evaluation calls run through it, the block dropped. KV cache
kinds are set on the model before anything runs (as ``quantize_model`` does). The rows equal the
in-memory path's in the same dtype, bit for bit, but for ``build_seconds`` (here: the seconds
spent reading, quantizing and calibrating blocks, evaluation excluded).

Memory: one block's weights (and, for GPTQ, its Hessians) and the activations of all windows
(one ``[B, T, hidden]`` tensor per batch, twice while a block runs) plus those of the calibration
batches. The tensors outside the blocks (the embeddings, the final norm, the head) are in memory
only before the first block and after the last (:meth:`StreamedModel.outside_released`: read
again from the checkpoint, the same values); the comparison runs batch by batch
(:func:`~nvfp4lab.studies.llm.token_fidelity`). The safetensors files are mapped only while
tensors are read. CPU only.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.checkpoint.safetensors_files import CONFIG_NAME, read_header, weight_files
from nvfp4lab.execution.attention import quantize_kv_cache, remove_kv_cache_quantization
from nvfp4lab.execution.calibrate import calibration
from nvfp4lab.execution.sequential import Blocks, find_blocks
from nvfp4lab.execution.streamed_blocks import (
    StreamedBatch,
    capture_calls,
    finish,
    placeholder_weights,
    quantize_block,
    run_calls,
)
from nvfp4lab.settings import tqdm_class
from nvfp4lab.studies import llm
from nvfp4lab.studies.llm_configs import CALIBRATED, ConfigResult, LLMConfig
from nvfp4lab.studies.llm_statistics import TokenFidelity
from nvfp4lab.studies.peak_memory import PeakRSS
from nvfp4lab.vocab import Backend, QuantMethod, check_dtype

__all__ = [
    "StreamedModel",
    "streamed_config_result",
    "streamed_config_results",
    "streamed_config_row",
    "streamed_reference",
]

#: safetensors dtype names of the floating dtypes a model may run in.
_FLOAT_NAMES: dict[str, torch.dtype] = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
}


def _dtype_of(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` or the torch dtype, checked."""
    if isinstance(dtype, str):
        found = getattr(torch, dtype, None)
        if not isinstance(found, torch.dtype):
            raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        dtype = found
    return check_dtype(dtype)


@dataclass(frozen=True)
class _Tensors:
    """Where each tensor of a safetensors checkpoint lies: name -> file; ``dtypes``: name ->
    its safetensors dtype (``"BF16"``, ...); ``shapes``: name -> shape."""

    files: dict[str, Path]
    dtypes: dict[str, str]
    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, folder: Path) -> _Tensors:
        found = weight_files(folder)
        files: dict[str, Path] = {}
        dtypes: dict[str, str] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for file in found.files:
            _, header = read_header(file)
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if found.weight_map is not None and found.weight_map.get(name) != file:
                    continue  # the index is the authority
                files[name] = file
                dtypes[name] = entry["dtype"]
                shapes[name] = tuple(entry["shape"])
        missing = sorted(set(found.weight_map or ()) - set(files))
        if missing:
            raise CheckpointError(f"{folder}: the index lists {missing[0]!r} in "
                                  f"{found.weight_map[missing[0]]}, whose header lacks it "  # type: ignore[index]
                                  f"({len(missing)} tensor(s) missing)")
        return cls(files, dtypes, shapes)

    def main_dtype(self, folder: Path) -> torch.dtype:
        """The floating dtype holding the most elements (the checkpoint's dtype)."""
        counts: dict[str, int] = {}
        for name, kind in self.dtypes.items():
            if kind in _FLOAT_NAMES:
                size = 1
                for d in self.shapes[name]:
                    size *= d
                counts[kind] = counts.get(kind, 0) + size
        if not counts:
            raise ValueError(f"{folder}: no float32 / bfloat16 / float16 tensor in its "
                             "safetensors; pass dtype= explicitly")
        return _FLOAT_NAMES[max(counts, key=lambda k: counts[k])]

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (checkpoint names), each file opened (mapped) only while its
        tensors are read."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, keys in by_file.items():
            with safe_open(os.fspath(file), framework="pt", device="cpu") as handle:
                for key in keys:
                    out[key] = handle.get_tensor(key)
        return out


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (root.get_submodule(path) if path else root), leaf


class StreamedModel:
    """A causal LM from a local folder with its decoder blocks on the meta device (module
    docstring). ``model``: the transformers model (``AutoModelForCausalLM.from_config`` of the
    folder's config, eval mode), everything outside the blocks materialized in ``dtype`` (None:
    the checkpoint's dtype, the floating dtype holding most of its elements); ``blocks``: its
    decoder blocks (the ``nn.ModuleList`` holding most Linear layers). ``folder``: a resolved
    model folder (``config.json`` + safetensors).

    Refused in one line (ValueError, naming the folder and the fix): a folder without
    ``config.json``; a model whose tensors the checkpoint lacks (names tried: the model's, with
    and without its ``base_model_prefix``); a model without repeated blocks. CheckpointError
    for unreadable safetensors (no weight file, pickles, links out of the folder)."""

    def __init__(self, folder: str | os.PathLike[str], dtype: str | torch.dtype | None = None,
                 ) -> None:
        self.folder = Path(folder)
        if not (self.folder / CONFIG_NAME).is_file():
            raise ValueError(f"{self.folder} has no {CONFIG_NAME}: pass a model folder (the "
                             "config.json and *.safetensors of a Hugging Face model)")
        self._tensors = _Tensors.of(self.folder)
        self.dtype = (self._tensors.main_dtype(self.folder) if dtype is None
                      else _dtype_of(dtype))
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(self.folder, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
        self.model: nn.Module = model.eval()
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        blocks = find_blocks(model, linears)
        if blocks is None:
            raise ValueError(f"{self.folder}: {type(model).__name__} has no repeated blocks of "
                             "Linear layers (an nn.ModuleList of decoder layers): it cannot be "
                             "run block by block")
        self.blocks: Blocks = blocks
        self._prefix = getattr(model, "base_model_prefix", "") or ""
        self._materialize(model, "", skip=f"{blocks.name}.")
        for name, tensor in (*model.named_parameters(), *model.named_buffers()):
            owner, leaf = _owner(model, name)
            if tensor.is_meta and leaf not in owner._non_persistent_buffers_set:
                self._key(name)  # every block tensor is in the checkpoint: refused up front

    @property
    def num_blocks(self) -> int:
        return len(self.blocks.modules)

    def _key(self, name: str) -> str:
        """The checkpoint's name of the model's tensor ``name``."""
        prefix = f"{self._prefix}." if self._prefix else ""
        tried = [name]
        if prefix and name.startswith(prefix):
            tried.append(name[len(prefix):])
        elif prefix:
            tried.append(prefix + name)
        for key in tried:
            if key in self._tensors.files:
                return key
        raise ValueError(
            f"{self.folder}: the checkpoint holds no tensor {name!r} of "
            f"{type(self.model).__name__} (tried {', '.join(map(repr, tried))}): the safetensors "
            "are not this config's model; pass the folder the model was saved to"
        )

    def _materialize(self, root: nn.Module, prefix: str, skip: str | None = None) -> None:
        """Every meta parameter and buffer of ``root`` (named ``prefix + name`` in the model),
        but those below ``skip``, read from the checkpoint (cast to the meta tensor's dtype)
        or, for non-persistent buffers, computed as ``from_pretrained`` does."""
        groups: dict[int, list[str]] = {}
        tensors: dict[int, torch.Tensor] = {}
        for name, param in root.named_parameters(remove_duplicate=False):
            if param.is_meta and not (skip and (prefix + name).startswith(skip)):
                groups.setdefault(id(param), []).append(name)
                tensors[id(param)] = param
        computed: list[tuple[nn.Module, str]] = []
        for name, buffer in root.named_buffers(remove_duplicate=False):
            if not buffer.is_meta or (skip and (prefix + name).startswith(skip)):
                continue
            owner, leaf = _owner(root, name)
            if leaf in owner._non_persistent_buffers_set:
                computed.append((owner, leaf))
            else:
                groups.setdefault(id(buffer), []).append(name)
                tensors[id(buffer)] = buffer
        keys = {tid: self._first_key(prefix, names) for tid, names in groups.items()}
        values = self._tensors.read(list(dict.fromkeys(keys.values())))
        for tid, names in groups.items():
            meta = tensors[tid]
            value = values[keys[tid]]
            if tuple(value.shape) != tuple(meta.shape):
                raise ValueError(f"{self.folder}: tensor {keys[tid]!r} has shape "
                                 f"{tuple(value.shape)}, the model's {prefix + names[0]!r} "
                                 f"{tuple(meta.shape)}: the safetensors are not this config's")
            value = value.to(meta.dtype)
            new: torch.Tensor = (nn.Parameter(value, requires_grad=False)
                                 if isinstance(meta, nn.Parameter) else value)
            new._is_hf_initialized = True  # type: ignore[attr-defined]  # init leaves it
            for name in names:
                owner, leaf = _owner(root, name)
                store = owner._parameters if isinstance(meta, nn.Parameter) else owner._buffers
                store[leaf] = new
        for owner, leaf in computed:
            owner._buffers[leaf] = torch.empty_like(owner._buffers[leaf], device="cpu")
        init = getattr(self.model, "_init_weights", None)
        for owner in dict.fromkeys(o for o, _ in computed):
            if callable(init):
                init(owner)  # transformers' own computation (rotary frequencies, ...)
        left = [prefix + n for n, t in (*root.named_parameters(), *root.named_buffers())
                if t.is_meta and not (skip and (prefix + n).startswith(skip))]
        if left:
            raise ValueError(f"{self.folder}: {type(self.model).__name__}'s {left[0]!r} could "
                             "not be materialized (not in the checkpoint, nor computed)")

    def _first_key(self, prefix: str, names: Sequence[str]) -> str:
        """The checkpoint key of the first of ``names`` (tied names of one tensor) found."""
        for name in names[:-1]:
            try:
                return self._key(prefix + name)
            except ValueError:
                continue
        return self._key(prefix + names[-1])

    @contextmanager
    def outside_released(self) -> Iterator[None]:
        """The parameters outside the blocks (embeddings, final norm, head) on the meta device
        while inside, read again from the checkpoint on leaving: while the blocks run one by one
        nothing needs them, and a 32,000 × 2,048 vocabulary's embeddings and untied head are
        2 × 131 MB in bf16 (2 GB for a 128 k × 4,096 one). Tied parameters stay tied."""
        skip = f"{self.blocks.name}."
        self._to_meta(skip)
        try:
            yield
        finally:
            self._materialize(self.model, "", skip=skip)

    def _to_meta(self, skip: str) -> None:
        """Every parameter of the model not named ``skip...`` replaced by a meta one (one per
        tied tensor): the model no longer holds the real ones."""
        metas: dict[int, nn.Parameter] = {}
        for name, param in list(self.model.named_parameters(remove_duplicate=False)):
            if name.startswith(skip) or param.is_meta:
                continue
            meta = metas.get(id(param))
            if meta is None:
                meta = metas[id(param)] = nn.Parameter(
                    torch.empty_like(param, device="meta"), requires_grad=False)
            owner, leaf = _owner(self.model, name)
            owner._parameters[leaf] = meta

    def load_block(self, index: int) -> nn.Module:
        """A materialized copy of block ``index`` (its tensors read from the checkpoint, in the
        model's dtype); the model's own block stays on the meta device. Drop it after use."""
        block = copy.deepcopy(self.blocks.modules[index])
        prefix = f"{self.blocks.name}.{index}." if self.blocks.name else f"{index}."
        self._materialize(block, prefix)
        return block


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


class _Finisher:
    """A causal LM for :func:`llm.reference_run` / :func:`llm.token_fidelity` whose blocks
    already ran: called on batch ``i``'s ``input_ids`` (in order, again from the first after the
    last: a reference kept as a model is run again at each comparison), it runs the model's code
    after the blocks on the streamed last-block outputs ``hidden[i]`` (:func:`finish`)."""

    def __init__(self, streamed: StreamedModel, inputs: Sequence[torch.Tensor],
                 hidden: Sequence[torch.Tensor]) -> None:
        self._streamed, self._inputs, self._hidden = streamed, list(inputs), list(hidden)
        self._next = 0
        self.config = streamed.model.config

    def get_output_embeddings(self) -> nn.Module | None:
        return self._streamed.model.get_output_embeddings()  # type: ignore[operator]

    def get_input_embeddings(self) -> nn.Module | None:
        return self._streamed.model.get_input_embeddings()  # type: ignore[operator]

    def __call__(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        index = self._next
        if not torch.equal(input_ids, self._inputs[index]):
            raise RuntimeError("the streamed model is asked for windows in another order than "
                               "it ran them")
        self._next = (index + 1) % len(self._inputs)
        batch = {"input_ids": input_ids, **kwargs}
        return finish(self._streamed.model, self._streamed.blocks, batch, self._hidden[index])


def _opened(model: str | os.PathLike[str] | StreamedModel,
            dtype: str | torch.dtype | None) -> StreamedModel:
    if isinstance(model, StreamedModel):
        if dtype is not None and _dtype_of(dtype) != model.dtype:
            raise ValueError(f"dtype={dtype} beside a StreamedModel in {model.dtype}: open the "
                             "folder again with that dtype")
        return model
    return StreamedModel(model, dtype)


def _bar(total: int, desc: str, progress: bool) -> Any:
    return tqdm_class()(total=total, desc=desc, unit="block", disable=not progress, leave=False)


def _model_inputs(ids: torch.Tensor) -> dict[str, Any]:
    """What :func:`llm.reference_run` passes the model for one batch."""
    return {"input_ids": ids, "use_cache": False}


def _streamed_hidden(streamed: StreamedModel, inputs: Sequence[torch.Tensor], desc: str,
                     progress: bool) -> list[torch.Tensor]:
    """The last block's output per batch of ``inputs`` (int64 ``[B, T]`` each), the float
    blocks run one at a time."""
    calls = capture_calls(streamed.model, streamed.blocks, [_model_inputs(x) for x in inputs])
    with streamed.outside_released(), _bar(streamed.num_blocks, desc, progress) as bar:
        for index in range(streamed.num_blocks):
            block = streamed.load_block(index)
            calls = run_calls(block, index, calls)
            del block
            bar.update(1)
    return [batch.hidden for batch in calls]


def streamed_reference(
    model: str | os.PathLike[str] | StreamedModel,
    ids: torch.Tensor,
    *,
    context: int = llm.DEFAULT_CONTEXT,
    batch_size: int = llm.DEFAULT_BATCH_SIZE,
    dtype: str | torch.dtype | None = None,
    progress: bool = True,
) -> llm.ReferenceRun:
    """:func:`llm.reference_run` of the model in folder ``model`` (or an open
    :class:`StreamedModel`) on the token ids ``ids`` (int64 ``[N]``), block by block: the
    same windows (``context`` tokens) and batches (``batch_size`` windows), the same numbers as
    the fully loaded model in ``dtype`` (None: the checkpoint's dtype; ``"float32"`` to match the
    in-memory study). A progress bar counts the blocks unless ``progress`` is False."""
    streamed = _opened(model, dtype)
    ids = llm._token_ids(ids, None)
    context = llm._whole("context", context, 2, "tokens per window, one to predict from")
    llm._check_ids(ids, llm._vocabulary(streamed.model), "reference")
    windows = llm.windows_of(ids.numel(), context)
    if not windows:
        raise ValueError(f"the text has {ids.numel()} token(s): nothing to predict")
    batches = llm._batches(windows, batch_size)
    inputs = [llm._stack(ids, windows, batch) for batch in batches]
    hidden = _streamed_hidden(streamed, inputs, "reference", progress)
    finisher = _Finisher(streamed, inputs, hidden)
    head = llm._output_head(finisher)
    kept: list[torch.Tensor] | None = [] if head is not None else None
    captured: list[torch.Tensor] = []
    handle = None if head is None else head.register_forward_pre_hook(
        lambda module, args: captured.append(args[0].detach()))
    nll = []
    try:  # reference_run's loop, without its copy of the head (nothing changes this one)
        for input_ids in inputs:
            captured.clear()
            logits = llm._forward(finisher, input_ids)
            if kept is not None:
                kept = llm._keep_hidden(kept, captured, head, logits)
            nll.append(llm._nll(logits, input_ids))
            del logits
    finally:
        if handle is not None:
            handle.remove()
    return llm.ReferenceRun(
        ids=ids, windows=windows, batches=batches, context=context, batch_size=batch_size,
        nll=torch.cat(nll), hidden=None if kept is None else tuple(kept),
        head=None if kept is None else head, model=finisher if kept is None else None,
        keep_logits=False)  # the head's logits are made again for each model: memory first


@contextmanager
def _kv_cache(streamed: StreamedModel, kind: str | None,
              qk_rotation: int | None = None) -> Iterator[None]:
    """The model's attention reading K / V from a ``kind`` cache while inside (None: as is),
    with Q / K rotated by a Hadamard of block ``qk_rotation`` before it (None: no rotation).
    ``quantize_kv_cache`` probes the model with a one-token forward: it runs on placeholder
    block weights (zeros taking no memory), the values of which it does not look at."""
    if kind is None:
        yield
        return
    with placeholder_weights(streamed.blocks):
        quantize_kv_cache(streamed.model, kind, qk_rotation=qk_rotation)
    try:
        yield
    finally:
        remove_kv_cache_quantization(streamed.model)


def _block_options(config: LLMConfig) -> dict[str, Any]:
    return {"backend": config.backend, "method": config.quant_method,
            "convention": config.convention}


def _streamed_fidelity(
    streamed: StreamedModel, run: llm.ReferenceRun, config: LLMConfig,
    calibration_batches: Sequence[Any], progress: bool,
) -> tuple[TokenFidelity, float]:
    """``config``'s :class:`TokenFidelity` on ``run``, block by block, and the seconds spent
    reading, quantizing and calibrating blocks (module docstring)."""
    gptq = config.method == QuantMethod.GPTQ and config.backend is not None
    scales = config.backend == Backend.EMULATION and config.input_scales == CALIBRATED
    seconds = 0.0
    with _kv_cache(streamed, config.kv_cache, getattr(config, "kv_rotation", None)):
        start = time.perf_counter()
        inputs = [run.input_ids(i) for i in range(len(run.batches))]
        calls = capture_calls(streamed.model, streamed.blocks,
                              [_model_inputs(x) for x in inputs])
        both = capture_calls(streamed.model, streamed.blocks,
                             list(calibration_batches)) if gptq or scales else []
        gptq_calls: list[StreamedBatch] = both if gptq else []
        scale_calls: list[StreamedBatch] = both if scales else []
        del both
        seconds += time.perf_counter() - start
        with streamed.outside_released(), _bar(streamed.num_blocks, config.label,
                                                progress) as bar:
            for index in range(streamed.num_blocks):
                start = time.perf_counter()
                block = streamed.load_block(index)
                if config.backend is not None:
                    quantize_block(block, [b.call(index) for b in gptq_calls],
                                   **_block_options(config))
                if scales:
                    with torch.no_grad(), calibration(block):
                        scale_calls = run_calls(block, index, scale_calls)
                if gptq and index + 1 < streamed.num_blocks:
                    gptq_calls = run_calls(block, index, gptq_calls)
                seconds += time.perf_counter() - start
                calls = run_calls(block, index, calls)
                del block
                bar.update(1)
        hidden = [batch.hidden for batch in calls]
        del calls, gptq_calls, scale_calls
        with torch.no_grad():
            fidelity = llm.token_fidelity(run, _Finisher(streamed, inputs, hidden),
                                          progress=False)
    return fidelity, seconds


def streamed_config_result(
    model: str | os.PathLike[str] | StreamedModel,
    run: llm.ReferenceRun,
    config: LLMConfig,
    calibration_batches: Sequence[Any] = (),
    *,
    dtype: str | torch.dtype | None = None,
    progress: bool = True,
) -> ConfigResult:
    """:func:`~nvfp4lab.studies.llm_configs.config_result` of ``config``, block by block, on
    the model in folder ``model`` (or an open :class:`StreamedModel`; ``dtype`` as
    :func:`streamed_reference` takes it: the run's dtype) against ``run`` (a
    :func:`streamed_reference`, or an in-memory ``reference_run``, of the same model and dtype).
    ``calibration_batches``: model inputs from the calibration text (GPTQ, calibrated input
    scales). The result equals the in-memory one but for ``build_seconds`` (module docstring)
    and ``peak_rss_mb`` (this process's peak resident memory while it ran, MiB). A progress bar
    (one line) counts the blocks unless ``progress`` is False."""
    if config.needs_calibration and not calibration_batches:
        raise ValueError(f"configuration {config.label!r} needs calibration_batches "
                         "(corpus.calibration_batches(tokenizer))")
    if getattr(config, "kv_scales", None) is not None:
        raise ValueError(f"configuration {config.label!r}: calibrated KV scales are computed on "
                         "the whole model in memory, not block by block; run it in memory")
    if getattr(config, "w4a4", None) is not None:
        raise ValueError(f"configuration {config.label!r}: the W4A4 recipes (w4a4=) are not "
                         "run block by block yet; run it in memory")
    if getattr(config, "weight_format", None) is not None:
        raise ValueError(f"configuration {config.label!r}: {config.weight_format} weights "
                         "(weight_format=) are not built block by block yet; run it in memory")
    streamed = _opened(model, dtype)
    with PeakRSS() as peak:
        fidelity, seconds = _streamed_fidelity(streamed, run, config, calibration_batches,
                                               progress)
    return ConfigResult(config, fidelity, seconds, peak.mb)


def streamed_config_row(
    model: str | os.PathLike[str] | StreamedModel,
    run: llm.ReferenceRun,
    config: LLMConfig,
    calibration_batches: Sequence[Any] = (),
    *,
    dtype: str | torch.dtype | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """:meth:`ConfigResult.row` of :func:`streamed_config_result`: the row
    :func:`~nvfp4lab.studies.llm_configs.config_row` gives the fully loaded model."""
    return streamed_config_result(model, run, config, calibration_batches, dtype=dtype,
                                  progress=progress).row()


def streamed_config_results(
    model: str | os.PathLike[str] | StreamedModel,
    run: llm.ReferenceRun,
    configs: Sequence[LLMConfig],
    calibration_batches: Sequence[Any] = (),
    *,
    dtype: str | torch.dtype | None = None,
    progress: bool = True,
) -> list[ConfigResult]:
    """:func:`streamed_config_result` of every configuration, in order, on one open model
    (a progress line per configuration)."""
    streamed = _opened(model, dtype)
    return [streamed_config_result(streamed, run, config, calibration_batches,
                                   progress=progress) for config in configs]
