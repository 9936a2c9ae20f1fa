"""Read an NVFP4 checkpoint (any format of :data:`nvfp4lab.checkpoint.formats.FORMATS`,
detected) into a transformers model with NVFP4Linear layers.

The model is built from its config (the format's ``model_config``) with every parameter moved
to the meta device as it is created (no float weight is ever materialized for a quantized layer),
then tensors are streamed from the weight files (the format's ``read_weights``: safetensors,
or a GGUF file's tensors under the model's names) one module at a time; quantized Linears become
:class:`nvfp4lab.execution.layers.NVFP4Linear` holding the stored bytes and scales unchanged.
transformers is imported inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvfp4lab.checkpoint.folders import hf_snapshot
from nvfp4lab.checkpoint.formats import CheckpointFormatSpec, detect_format, format_spec
from nvfp4lab.checkpoint.formats.transforms import LayerRotation, layer_rotations
from nvfp4lab.checkpoint.kv_scales import kv_cache_names, restore_kv_cache, stored_kv_keys
from nvfp4lab.checkpoint.mixed_layers import load_mixed_linear
from nvfp4lab.checkpoint.records import SOURCE_ATTRIBUTE, LayerNames
from nvfp4lab.checkpoint.refusals import (
    CheckpointError,
    block_scale_error,
    refuse_pickle,
    tensor_scale_error,
)
from nvfp4lab.checkpoint.rows import (
    TensorSource,
    missing_tensor,
    read_exact,
    read_like,
    stored_meta,
)
from nvfp4lab.checkpoint.safetensors_files import PICKLE_SUFFIXES
from nvfp4lab.constants import BLOCK_SIZE
from nvfp4lab.execution.layers import NVFP4Linear
from nvfp4lab.tensor import NVFP4Tensor
from nvfp4lab.vocab import AUTO

__all__ = ["load"]


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create every ``nn.Parameter`` on the meta device while modules are built.

    Buffers stay real (position ids, rotary frequencies are computed in ``__init__`` and often
    not stored in checkpoints). Not thread-safe: it patches ``nn.Module.register_parameter``.
    """
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _config_dtype(config: Any) -> torch.dtype | None:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


def _build_skeleton(
    data: dict[str, Any], where: Path, dtype: torch.dtype | None,
    model_class: type[nn.Module] | None, stored_bytes: int | None = None,
) -> tuple[nn.Module, torch.dtype]:
    """The model of the configuration ``data`` (``config.json``'s content, as the format gives
    it), parameters on the meta device; ``where``: the checkpoint, recorded as transformers'
    ``from_pretrained`` records it (``config._name_or_path``). ``stored_bytes``: the bytes of
    the stored tensors, which bound the model the configuration may describe
    (:func:`_check_config_size`)."""
    import transformers

    try:
        config = transformers.CONFIG_MAPPING[data["model_type"]].from_dict(data)
    except Exception as exc:
        raise CheckpointError(
            f"{where}: transformers cannot build a config from its configuration ({exc!r})"
        ) from exc
    config._name_or_path = str(where)
    dtype = dtype or _config_dtype(config) or torch.float32
    cls: Any = model_class
    if cls is None:
        for arch in getattr(config, "architectures", None) or ():
            cls = getattr(transformers, arch, None)
            if cls is not None:
                break
    def build() -> nn.Module:
        if cls is None:
            return transformers.AutoModel.from_config(config, dtype=dtype)
        if hasattr(cls, "_from_config"):
            return cls._from_config(config, dtype=dtype)
        return cls(config)

    if stored_bytes is not None:
        _check_config_size(build, stored_bytes, where)
    with _parameters_on_meta():
        model = build()
    return model, dtype


#: How many times the stored bytes a configuration's model may take in memory before it is
#: refused: an NVFP4 weight stored in 4.5 bits per element (codes, block scales) becomes a float32
#: [N, K] of 32 bits, 7.1x; the rest is stored as it is held.
CONFIG_BYTES_PER_STORED_BYTE = 8
#: Bytes a configuration's model may take beyond that (buffers no checkpoint stores: position
#: ids, rotary tables of a long context).
CONFIG_SLACK_BYTES = 256 << 20


def _check_config_size(build: Callable[[], nn.Module], stored_bytes: int, where: Path) -> None:
    """Build the configuration's model on the meta device (nothing allocated) and refuse it,
    before anything real is built, when its parameters and buffers would take more than
    :data:`CONFIG_BYTES_PER_STORED_BYTE` times the ``stored_bytes`` (+ :data:`CONFIG_SLACK_BYTES`):
    a ``config.json`` whose sizes (``vocab_size``, ``intermediate_size``,
    ``max_position_embeddings``, ...) the stored tensors cannot back (``vocab_size: 10**9``
    allocated 128 GB before any tensor was read). A model that cannot be built on the meta device
    is not checked here (the shape checks of the load refuse it later)."""
    try:
        with torch.device("meta"):
            skeleton = build()
    except Exception:
        return
    held = [(name, t) for name, t in (*skeleton.named_parameters(), *skeleton.named_buffers())]
    total = sum(t.numel() * t.element_size() for _, t in held)
    if total <= CONFIG_BYTES_PER_STORED_BYTE * stored_bytes + CONFIG_SLACK_BYTES:
        return
    name, largest = max(held, key=lambda item: item[1].numel() * item[1].element_size())
    raise CheckpointError(
        f"{where}: its configuration describes a model of {total / 2**30:.1f} GiB (the largest "
        f"tensor {name} {list(largest.shape)}) but the checkpoint stores {stored_bytes / 2**20:.1f}"
        " MiB of tensors; the config.json sizes (vocab_size, hidden_size, intermediate_size, "
        "max_position_embeddings, ...) do not match the stored weights: fix config.json"
    )


def _read_scale(source: TensorSource, key: str, names: LayerNames,
                optional: bool = False) -> torch.Tensor:
    """A float32 tensor scale, checked finite and > 0, as ``[1]``; any shape of the format's
    ``scalar_shapes`` is accepted (ModelOpt's 0-d scalars also as ``[1]``, as vLLM does).
    ``optional``: a missing one is 1 (the same in either convention)."""
    if optional and source.file_of(key) is None:
        return torch.ones(1, dtype=torch.float32)
    shape = names.scalar_shape
    found = tuple(stored_meta(source, key)[2])
    if found in names.scalar_shapes:
        shape = found
    value = read_exact(source, key, torch.float32, shape)
    problem = tensor_scale_error(source.file_of(key), key, float(value.reshape(-1)), names)
    if problem is not None:
        raise problem
    return value.reshape(1)


def _check_block_scales(source: TensorSource, key: str, scales: torch.Tensor) -> torch.Tensor:
    """Block scales are unsigned in hardware (UE4M3): refuse NaN codes and negative values."""
    problem = block_scale_error(source.file_of(key), key, scales)
    if problem is not None:
        raise problem
    return scales


def _expected_keys(model: nn.Module, quantized: Mapping[str, Any], names: LayerNames) -> set[str]:
    prefixes = tuple(f"{name}." for name in quantized)
    keys = {k for k in model.state_dict() if not k.startswith(prefixes)}
    for name in quantized:
        keys.update(f"{name}.{leaf}" for leaf in (names.packed, names.block_scale))
    return keys


def _key_prefix_fix(model: nn.Module, keys: set[str], expected: set[str]) -> tuple[str, str]:
    """(strip, add) turning stored keys into model keys via ``base_model_prefix``.

    Handles a checkpoint saved from ``BertForX`` (keys ``bert.…``) loaded as ``BertModel`` and
    the reverse, as transformers does.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix or keys & expected:
        return "", ""
    dotted = f"{prefix}."
    if {k.removeprefix(dotted) for k in keys if k.startswith(dotted)} & expected:
        return dotted, ""
    if {dotted + k for k in keys} & expected:
        return "", dotted
    return "", ""


def _load_quantized_linear(
    source: TensorSource,
    name: str,
    module: nn.Linear,
    spec: CheckpointFormatSpec,
    static_input: bool,
    dtype: torch.dtype,
    backend: str,
) -> tuple[nn.Module, set[str]]:
    """One quantized Linear from its stored tensors (``spec``: the format); a stored DECODE
    scale (``spec.from_disk``) is kept exactly as the layer's ``*_decode_scale`` buffer."""
    names = spec.names
    n, k = module.out_features, module.in_features
    if k % BLOCK_SIZE:
        raise CheckpointError(f"{name}: in_features={k} is not a multiple of {BLOCK_SIZE}")
    keys = names.keys(name)
    packed = read_exact(source, keys["packed"], torch.uint8, (n, k // 2))
    scales = read_exact(source, keys["block"], torch.float8_e4m3fn, (n, k // BLOCK_SIZE))
    scales = _check_block_scales(source, keys["block"], scales)
    optional = spec.optional_tensor_scale is not None
    gs, decode = spec.from_disk(_read_scale(source, keys["global"], names, optional))
    used = {keys["packed"], keys["block"], keys["global"]}
    bias = None
    if module.bias is not None:
        bias = read_like(source, f"{name}.bias", module.bias)
        used.add(f"{name}.bias")
    weight = NVFP4Tensor(packed=packed, scales=scales, global_scale=gs, shape=(n, k), dtype=dtype,
                         decode_scale=decode)
    layer = NVFP4Linear.from_quantized(weight, bias, backend=backend)
    if static_input:
        encode, exact = spec.from_disk(_read_scale(source, keys["input"], names))
        if exact is not None:
            layer.set_input_decode_scale(exact)
        else:
            layer.set_input_global_scale(encode)
        used.add(keys["input"])
    return layer, used


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, leaf = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), leaf


def _load_plain_tensors(
    model: nn.Module, source: TensorSource, skip: Sequence[str]
) -> set[str]:
    """Fill every parameter and buffer outside ``skip`` (module names) that the files hold.

    Tied parameters (one Parameter under several names) are read once and stay tied.
    """
    prefixes = tuple(f"{name}." for name in skip)
    used: set[str] = set()
    aliases: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if not name.startswith(prefixes):
            aliases.setdefault(id(param), (param, []))[1].append(name)
    for param, names in aliases.values():
        present = [n for n in names if source.file_of(n) is not None]
        if not present:
            continue
        value = read_like(source, present[0], param)
        new = nn.Parameter(value, requires_grad=param.requires_grad)
        for name in names:
            owner, leaf = _owner(model, name)
            owner._parameters[leaf] = new
        used.update(present)
    for name, buffer in list(model.named_buffers(remove_duplicate=False)):
        if name.startswith(prefixes) or source.file_of(name) is None:
            continue
        owner, leaf = _owner(model, name)
        owner._buffers[leaf] = read_like(source, name, buffer)
        used.add(name)
    return used


def _install_rotations(model: nn.Module, rotations: Mapping[str, LayerRotation]) -> set[str]:
    """Give each loaded NVFP4Linear its online input rotation (its buffers already hold the
    stored ``W R``); returns the stored matrices' keys."""
    for name, rot in rotations.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, NVFP4Linear) and rot.rotation is not None
        layer.set_rotation(rot.rotation)
    return {rot.key for rot in rotations.values() if rot.key is not None}


def load(
    path: str | os.PathLike[str],
    *,
    backend: str = AUTO,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    model_class: type[nn.Module] | None = None,
    strict: bool = True,
    format: str | None = None,
) -> nn.Module:
    """Load an NVFP4 checkpoint (any format nvfp4lab knows) into a transformers model.

    ``path``: the checkpoint folder, or the file of a format kept in one file (a ``.gguf`` file;
    a folder holding exactly one ``.gguf`` file is read as that file), or a Hugging Face cache
    ``models--*`` folder (its ``refs/main`` snapshot). The format comes from the configuration
    (:func:`~nvfp4lab.checkpoint.formats.detect_format`); ``format`` (a
    :class:`~nvfp4lab.vocab.CheckpointFormat`) picks one in a folder that holds several.
    Quantized Linears (as the format's config decides: compressed-tensors' target/ignore
    matching; ModelOpt: every Linear not in ``exclude_modules``, as vLLM does; GGUF: every
    NVFP4 tensor) become :class:`nvfp4lab.NVFP4Linear` (``backend`` passed on; the layers of
    a compressed-tensors FP8 / MXFP4 group ``FP8Linear`` / ``MXFP4Linear``,
    :mod:`~nvfp4lab.checkpoint.mixed_layers`) holding the stored codes / block scales /
    tensor scales byte for byte (a stored DECODE scale,
    ModelOpt's and GGUF's, is kept exactly in ``weight_decode_scale`` / ``input_decode_scale``,
    and the ENCODE buffers hold its float32 reciprocal; a GGUF tensor without a ``.scale``
    sidecar gets tensor scale 1, as llama.cpp decodes it); other float tensors are cast to
    ``dtype`` (default: the config's dtype, else float32). ``model_class``: the transformers
    class to build (default: ``config.architectures[0]``, else ``AutoModel``). ``strict``: raise
    on stored tensors the model has no place for. Raises :class:`CheckpointError` naming the
    file and tensor for a missing tensor, a wrong dtype or shape, a configuration the format
    refuses (another algorithm, a group size other than 16, ...), a pickle file or a truncated
    file. A compressed-tensors ``transform_config`` gives each layer with an online input
    rotation that :class:`~nvfp4lab.hadamard.BlockRotation` (its stored matrix;
    :mod:`~nvfp4lab.checkpoint.formats.transforms`; what nvfp4lab cannot run is refused).
    A KV cache the configuration declares (``docs/kv_cache.md``: compressed-tensors'
    ``kv_cache_scheme``, ModelOpt's ``kv_cache_quant_algo``) is restored with
    :func:`~nvfp4lab.execution.quantize_kv_cache`, each attention layer with its stored float32
    k / v DECODE scales (a missing one as the format's engine fills it). Returns the model in
    eval mode on ``device``, its
    :data:`~nvfp4lab.checkpoint.records.SOURCE_ATTRIBUTE` set to ``path``.
    """
    where = hf_snapshot(Path(path))
    if where.is_file() and where.suffix in PICKLE_SUFFIXES:
        raise refuse_pickle(where)
    if not where.exists():
        raise FileNotFoundError(f"checkpoint directory {where} does not exist")
    spec = format_spec(detect_format(where, format))
    config = spec.read_config(where)
    config.checkpoint_scheme()  # one scheme per checkpoint: audit and convert refuse a mix too
    stored = spec.read_weights(where)  # headers validated (the shared validator) on the way
    device = torch.device(device)
    stored_bytes = sum(info.nbytes for info in stored.tensors.values())
    model, dtype = _build_skeleton(spec.model_config(where), stored.directory, dtype,
                                   model_class, stored_bytes)
    quantized: Mapping[str, bool] = config.quantized_modules(model)
    mixed: Mapping[str, str] = getattr(config, "mixed_modules", lambda _: {})(model)

    source = TensorSource(stored, device)
    expected = _expected_keys(model, quantized, spec.names)
    strip, add = _key_prefix_fix(model, set(source.entries), expected)
    source.rekey(strip, add)
    used: set[str] = set()
    rotations = getattr(spec, "layer_rotations", layer_rotations)(  # transform_config, or the
        stored.directory, model, quantized, source)  # format's own (FP-Quant's matrices)
    for name, static_input in quantized.items():
        module = model.get_submodule(name)
        assert isinstance(module, nn.Linear)
        layer, keys = _load_quantized_linear(
            source, name, module, spec, static_input, dtype, backend
        )
        owner, leaf = _owner(model, name)
        setattr(owner, leaf, layer)
        used |= keys
    for name, kind in mixed.items():  # compressed-tensors' FP8 / MXFP4 groups
        module = model.get_submodule(name)
        assert isinstance(module, nn.Linear)
        layer, keys = load_mixed_linear(source, name, module, kind, dtype)
        setattr(*_owner(model, name), layer)
        used |= keys
    used |= _install_rotations(model, rotations)
    used |= _load_plain_tensors(model, source, [*quantized, *mixed])
    kv_kind, kv_keys = _kv_cache_keys(config, spec, source)
    used |= kv_keys
    unexpected = sorted(set(source.entries) - used)
    if strict and unexpected:
        shown = ", ".join(repr(k) for k in unexpected[:5])
        raise CheckpointError(
            f"{source.file_of(unexpected[0])}: {len(unexpected)} stored tensor(s) have no "
            f"place in {type(model).__name__} (e.g. {shown}); pass strict=False to ignore "
            "them"
        )
    leftovers = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if leftovers:
        raise missing_tensor(source, leftovers[0])
    model.to(device)
    model.eval()
    if kv_kind is not None:
        names = kv_cache_names(spec)
        assert names is not None
        restore_kv_cache(model, kv_kind, {k: source.entries[k] for k in kv_keys}, names)
    setattr(model, SOURCE_ATTRIBUTE, where)
    return model


def _kv_cache_keys(config: Any, spec: CheckpointFormatSpec,
                   source: TensorSource) -> tuple[str | None, set[str]]:
    """(the KV cache kind the configuration declares or None, its stored k / v scale keys);
    the config's ``kv_cache`` refuses a kind vLLM 0.33 does not run (CheckpointError). Without
    a declared kind the keys are none (stored scales are then unexpected tensors)."""
    kind = getattr(config, "kv_cache", None)
    names = kv_cache_names(spec)
    if kind is None or names is None:
        return None, set()
    pairs = stored_kv_keys(source.entries, names).values()
    return kind, {key for pair in pairs for key in pair if key is not None}
