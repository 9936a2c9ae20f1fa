"""Reference runs kept on disk, so that a reference model runs once per machine, not once per
process (a notebook, a study, a worker): :func:`cached_reference_run` is
:func:`nvfp4lab.studies.llm.reference_run` behind ``<cache_dir>/reference-runs/<key>.safetensors``.

The key (:func:`reference_key`) is a SHA-256 over what the run depends on: the model's class,
module classes, config and train/eval mode, every parameter and buffer (name, dtype, shape,
bytes; a tied head counted once), the devices (a CPU by :func:`nvfp4lab.settings.cpu_signature`,
a GPU by name and capability), torch's global switches of float arithmetic (float32 matmul
precision, TF32 and reduced-precision reductions, attention backends, deterministic algorithms,
autocast), the token ids scored, ``context``, ``batch_size``, the torch, transformers and nvfp4lab
versions and the source files that run it. A model with forward hooks (its modules' or global
ones), a module whose ``forward`` was replaced on the instance, or a module in training mode
(dropout) is never cached: what such code does is not in the key. The file holds ``ids``,
``nll`` and ``hidden_<b>`` per batch, the windows and batches as JSON metadata; only runs that
keep hidden states are stored. A file that does not read or does not match the key is ignored
with a warning, and the run is made again and rewritten (to a temporary name, then renamed:
racing processes are safe); the folder is kept under :data:`MAX_BYTES` (2 GiB) by deleting the
least recently used runs. ``cache=False`` or ``NVFP4LAB_REFERENCE_CACHE=0``
(:func:`nvfp4lab.settings.reference_cache`) turns the cache off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import operator
import os
import sys
import tempfile
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvfp4lab import settings
from nvfp4lab.studies import llm

__all__ = ["FORMAT", "SUBDIR", "cached_reference_run", "reference_key"]

#: The file layout's version (part of the key and of the metadata).
FORMAT = "1"
#: The cache's folder under :func:`nvfp4lab.settings.cache_dir`.
SUBDIR = "reference-runs"
#: Bytes a file may hold beyond its tensors (the safetensors header with the windows' JSON).
_HEADER_SLACK = 1 << 20
#: The folder's size bound: after a store, the least recently used runs (by modification time; a
#: read touches its file) are deleted until the folder holds at most this many bytes. SmolLM2's
#: run of 2,040 tokens is 4.7 MB; 12,000 tokens 28 MB.
MAX_BYTES = 2 << 30


def _nvfp4lab_version() -> str:
    """nvfp4lab's installed version (read from its distribution's metadata: the package root,
    which imports everything, sits above this layer); "unknown" when not installed."""
    try:
        return metadata.version("nvfp4lab")
    except metadata.PackageNotFoundError:
        return "unknown"


def _devices(model: nn.Module) -> str:
    """The devices ``model``'s tensors sit on, each with what tells its arithmetic apart."""
    names = []
    for device in sorted({str(t.device) for t in (*model.parameters(), *model.buffers())}):
        dev = torch.device(device)
        if dev.type == "cuda":
            major, minor = torch.cuda.get_device_capability(dev)
            device += f":{torch.cuda.get_device_name(dev)}:sm{major}{minor}"
        elif dev.type == "cpu":
            device += f":{settings.cpu_signature()}"
        names.append(device)
    return ",".join(names)


#: torch's global switches (attribute paths under ``torch``) that change a forward pass's float
#: arithmetic: on the CPU ``set_float32_matmul_precision("medium")`` makes oneDNN's float32
#: matmuls bfloat16 ones; on a GPU TF32, reduced-precision reductions and the SDPA backend.
_SWITCHES = (
    "backends.mkldnn.enabled", "backends.cuda.matmul.allow_tf32",
    "backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
    "backends.cuda.matmul.allow_bf16_reduced_precision_reduction", "backends.cudnn.enabled",
    "backends.cudnn.allow_tf32", "backends.cudnn.deterministic",
)
#: Functions under ``torch`` (no arguments) whose answer changes a forward pass's arithmetic.
_SWITCH_CALLS = (
    "get_float32_matmul_precision", "are_deterministic_algorithms_enabled",
    "backends.cuda.flash_sdp_enabled", "backends.cuda.mem_efficient_sdp_enabled",
    "backends.cuda.math_sdp_enabled", "backends.cuda.cudnn_sdp_enabled",
)


#: The ops whose float32 precision torch sets (``torch.backends.<op>.fp32_precision``).
_FP32_OPS = ("mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn", "cuda.matmul", "cudnn.conv",
             "cudnn.rnn")


def _fp32_precision(op: str) -> str:
    """The float32 precision ``op`` (an entry of :data:`_FP32_OPS`) runs at: its own setting, or
    where that is "none" its parents' ("mkldnn", then the top), "ieee" when all are "none" (so
    a process that set the default explicitly gets the same key as one that never did)."""
    parts = op.split(".")
    for depth in range(len(parts), -1, -1):
        try:
            value = operator.attrgetter(".".join(["backends", *parts[:depth], "fp32_precision"]))(
                torch)
        except (AttributeError, RuntimeError):
            continue
        if value != "none":
            return str(value)
    return "ieee"


def _switches(devices: str) -> str:
    """torch's global switches of float arithmetic now (:data:`_SWITCHES`, :data:`_SWITCH_CALLS`,
    the float32 precision of :data:`_FP32_OPS` and autocast on each device type in
    ``devices``), "?" for one this torch lacks."""
    parts = [f"{op}.fp32={_fp32_precision(op)}" for op in _FP32_OPS]
    for name in (*_SWITCHES, *_SWITCH_CALLS):
        try:
            value = operator.attrgetter(name)(torch)
            value = value() if name in _SWITCH_CALLS else value
        except (AttributeError, RuntimeError):
            value = "?"
        parts.append(f"{name}={value}")
    for kind in sorted({d.split(":", 1)[0] for d in devices.split(",") if d}):
        try:
            on = torch.is_autocast_enabled(kind)
            parts.append(f"autocast.{kind}={on}:{torch.get_autocast_dtype(kind) if on else ''}")
        except (AttributeError, RuntimeError, TypeError):
            parts.append(f"autocast.{kind}=?")
    return ";".join(parts)


def _hooked(model: nn.Module) -> bool:
    """Whether ``model``'s forward is not a function of the key: a forward (pre-)hook on any of
    its modules or a global one, a module whose ``forward`` is an instance attribute, or a
    module in training mode (dropout draws new numbers on every run)."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    if any(m.training for m in model.modules()):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m)
               for m in model.modules())


def _config(model: nn.Module) -> str:
    """``model.config`` as JSON (every field) with its attention implementation; "" without."""
    config = getattr(model, "config", None)
    if config is None:
        return ""
    try:
        text = config.to_json_string(use_diff=False)
    except (AttributeError, TypeError, ValueError):
        text = repr(config)
    return f"{text}|attn={getattr(config, '_attn_implementation', None)}"


def _code(cls: type) -> str:
    """What says which code makes the run: transformers' version and the SHA-256 of the files of
    :mod:`nvfp4lab.studies.llm`, this module and ``cls``'s module (an edit to any of them, in a
    checkout whose version number stays the same, must not read an old run)."""
    parts = [str(getattr(sys.modules.get("transformers"), "__version__", None))]
    for module in (llm, sys.modules[__name__], sys.modules.get(cls.__module__)):
        path = getattr(module, "__file__", None)
        if path and os.path.isfile(path):
            parts.append(hashlib.sha256(Path(path).read_bytes()).hexdigest())
    return ",".join(parts)


def reference_key(model: nn.Module, ids: torch.Tensor, context: int, batch_size: int) -> str | None:
    """The cache key (64 hex digits) of ``model``'s run over ``ids`` (int64 ``[N]``) in windows
    of ``context`` tokens, ``batch_size`` windows a pass; None when a tensor cannot be read
    (on the meta device, a subclass without bytes) or the model has hooks or a replaced
    ``forward`` (:func:`_hooked`): such a model is not cached. Tensors are hashed one at a time
    (each copied to the CPU alone, never all at once)."""
    if _hooked(model):
        return None
    digest = hashlib.sha256()

    def part(*items: object) -> None:
        for item in items:
            data = item if isinstance(item, bytes | memoryview) else str(item).encode()
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)

    cls = type(model)
    devices = _devices(model)
    part(FORMAT, f"{cls.__module__}.{cls.__qualname__}", torch.__version__, _nvfp4lab_version(),
         context, batch_size, model.training, devices, _switches(devices), _config(model),
         _code(cls))
    part(";".join(f"{name}:{type(m).__qualname__}" for name, m in model.named_modules()))
    part(ids.to(torch.int64).contiguous().numpy().tobytes())
    tensors = dict(model.state_dict(keep_vars=True))
    for name, buffer in model.named_buffers():
        tensors.setdefault(name, buffer)
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        if tensor.is_meta or type(tensor) not in (torch.Tensor, nn.Parameter):
            return None
        part(name, tensor.dtype, tuple(tensor.shape))
        alias = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape),
                 tensor.stride())
        if alias in seen and tensor.numel():
            part(f"same as {seen[alias]}")
            continue
        seen[alias] = name
        flat = tensor.cpu().contiguous().reshape(-1)
        part(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


def _expected_hidden(model: nn.Module) -> tuple[int, torch.dtype, torch.device] | None:
    """(hidden size, dtype, device) of the input of ``model``'s output head, from its 2-D
    weight; None when it has no such head (then nothing is cached)."""
    head = llm._output_head(model)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    return int(weight.shape[1]), weight.dtype, weight.device


def _store(path: Path, run: llm.ReferenceRun, key: str) -> None:
    """Write ``run`` to ``path`` through a temporary file in its folder (atomic rename)."""
    assert run.hidden is not None
    tensors = {"ids": run.ids.contiguous(), "nll": run.nll.contiguous()}
    for index, hidden in enumerate(run.hidden):
        tensors[f"hidden_{index}"] = hidden.detach().to("cpu", copy=True).contiguous()
    metadata = {"format": FORMAT, "key": key, "context": str(run.context),
                "batch_size": str(run.batch_size), "windows": json.dumps(run.windows),
                "batches": json.dumps(run.batches)}
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, temp, metadata=metadata)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def _evict(folder: Path, keep: Path) -> None:
    """Delete the least recently used runs of ``folder`` (never ``keep``) until its runs take at
    most :data:`MAX_BYTES`. Files another process deletes meanwhile are skipped."""
    runs = []
    for entry in folder.glob("*.safetensors"):
        try:
            info = entry.stat()
        except OSError:
            continue
        runs.append((info.st_mtime, info.st_size, entry))
    total = sum(size for _, size, _ in runs)
    for _, size, entry in sorted(runs):
        if total <= MAX_BYTES:
            break
        if entry != keep:
            entry.unlink(missing_ok=True)
            total -= size


def _load(path: Path, model: nn.Module, ids: torch.Tensor, context: int, batch_size: int,
          key: str, hidden: tuple[int, torch.dtype, torch.device]) -> llm.ReferenceRun:
    """The run stored at ``path``, checked against what ``key`` promises (ValueError on any
    mismatch; the head is copied from ``model``, the hidden states moved to its device)."""
    from safetensors import safe_open

    windows = llm.windows_of(ids.numel(), context)
    batches = llm._batches(windows, batch_size)
    size, dtype, device = hidden
    expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
        "ids": (torch.int64, (ids.numel(),)),
        "nll": (torch.float64, (sum(b - a - 1 for a, b in windows),)),
    }
    for index, batch in enumerate(batches):
        a, b = windows[batch[0]]
        expected[f"hidden_{index}"] = (dtype, (len(batch), b - a, size))
    limit = _HEADER_SLACK + sum(
        torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size()
        for dt, shape in expected.values())
    if path.stat().st_size > limit:
        raise ValueError(f"{path.stat().st_size} bytes, more than the {limit} expected")
    with safe_open(str(path), framework="pt", device="cpu") as fh:
        meta = fh.metadata() or {}
        want = {"format": FORMAT, "key": key, "context": str(context),
                "batch_size": str(batch_size)}
        if any(meta.get(name) != value for name, value in want.items()):
            raise ValueError("its metadata does not match the key")
        if (json.loads(meta.get("windows", "null")) != [list(w) for w in windows]
                or json.loads(meta.get("batches", "null")) != [list(b) for b in batches]):
            raise ValueError("its windows or batches are not this text's")
        if set(fh.keys()) != set(expected):
            raise ValueError(f"{len(set(fh.keys()))} tensors, expected {len(expected)}")
        loaded = {}
        for name, (dt, shape) in expected.items():
            tensor = fh.get_tensor(name)
            if tensor.dtype != dt or tuple(tensor.shape) != shape:
                raise ValueError(f"{name} is {tensor.dtype} {tuple(tensor.shape)}, expected "
                                 f"{dt} {shape}")
            loaded[name] = tensor
    if not torch.equal(loaded["ids"], ids):
        raise ValueError("its token ids are not the text's")
    return llm.ReferenceRun(
        ids=ids, windows=windows, batches=batches, context=context, batch_size=batch_size,
        nll=loaded["nll"],
        hidden=tuple(loaded[f"hidden_{i}"].to(device) for i in range(len(batches))),
        head=llm.output_head_copy(model),
    )


def cached_reference_run(
    model: llm.CausalLM,
    text: str | torch.Tensor | None = None,
    *,
    tokenizer: Any = None,
    context: int = llm.DEFAULT_CONTEXT,
    batch_size: int = llm.DEFAULT_BATCH_SIZE,
    max_tokens: int | None = None,
    progress: bool = True,
    cache: bool = True,
) -> llm.ReferenceRun:
    """:func:`nvfp4lab.studies.llm.reference_run` with the same arguments and result, read from
    ``<cache_dir>/reference-runs/<key>.safetensors`` when an earlier process stored it (see the
    module docstring), else run and stored there. ``cache=False`` or
    ``NVFP4LAB_REFERENCE_CACHE=0``: run every time, nothing read or written."""
    if not (cache and settings.reference_cache()) or not isinstance(model, nn.Module):
        return llm.reference_run(model, text, tokenizer=tokenizer, context=context,
                                 batch_size=batch_size, max_tokens=max_tokens, progress=progress)
    context = llm._whole("context", context, 2, "tokens per window, one to predict from")
    batch_size = llm._whole("batch_size", batch_size, 1, "windows per forward pass")
    if max_tokens is not None:
        max_tokens = llm._whole("max_tokens", max_tokens, 2, "tokens scored")
    ids = llm._token_ids(text, tokenizer)[:max_tokens]  # the ids reference_run scores
    hidden = _expected_hidden(model)
    key = reference_key(model, ids, context, batch_size) if hidden is not None else None
    if key is None or hidden is None:  # no head to rebuild logits with, unreadable, hooked
        return llm.reference_run(model, ids, context=context, batch_size=batch_size,
                                 progress=progress)
    path = settings.cache_dir() / SUBDIR / f"{key}.safetensors"
    if path.is_file():
        llm._check_causal_lm(model, "reference")
        llm._check_ids(ids, llm._vocabulary(model), "reference")
        try:
            run = _load(path, model, ids, context, batch_size, key, hidden)
        except Exception as err:  # a stranger's file: any failure means "run it again"
            warnings.warn(f"ignoring the cached reference run {path} ({err}); running the "
                          "reference again", stacklevel=2)
        else:
            with contextlib.suppress(OSError):  # a read-only cache still serves its runs
                os.utime(path)  # used: the last to be evicted
            return run
    run = llm.reference_run(model, ids, context=context, batch_size=batch_size,
                            progress=progress)
    if run.hidden is not None and all(
            h.dtype == hidden[1] and h.shape[-1] == hidden[0] for h in run.hidden):
        try:
            _store(path, run, key)
            _evict(path.parent, keep=path)
        except (OSError, RuntimeError, ValueError) as err:
            warnings.warn(f"could not store the reference run in {path} ({err})", stacklevel=2)
    return run
