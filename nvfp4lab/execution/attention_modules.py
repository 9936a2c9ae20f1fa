"""The attention modules of a transformers decoder that nvfp4lab reaches, and the function it
registers in transformers' ``AttentionInterface`` to reach them.

**The rule** (:func:`find_attention_modules`). A model's attention modules are those that hand
K and V to the function ``AttentionInterface`` holds under ``config._attn_implementation``
(modern transformers decoders do so after RoPE and the generation-cache update, with key / value
``[batch, kv_heads, kv_len, head_dim]``, before the KV heads are repeated for the query heads).
They are found in two steps, and a model fails as a whole, in one line naming its
``model_type``, why, and the tested types (:data:`SUPPORTED_MODEL_TYPES`):

1. By declaration. The model is a transformers ``PreTrainedModel`` whose class sets
   ``_supports_attention_backend`` (transformers' own flag for "attention dispatches through
   the interface") and is not an encoder-decoder. Its candidates are the submodules whose class
   is defined in a ``transformers.models.<type>.modeling_*`` module, is named ``...Attention``,
   has an integer ``layer_idx`` and ``is_causal`` True (causal self-attention: what a KV cache
   holds; encoders' and cross-attention modules are not). Each candidate class must keep its
   projections in ``nn.Linear`` (or nvfp4lab's ``NVFP4Linear``) children (GPT-2's ``Conv1D``
   is refused), and its ``forward`` must read ``_attn_implementation`` only to look the
   function up (``get_interface(self.config._attn_implementation, ...)``): a forward that
   compares the name (GPT-2's ``== "eager"``) would take another path once nvfp4lab renames
   the implementation. A config with ``num_hidden_layers = L`` must get exactly one candidate
   per layer, ``layer_idx`` 0 to L - 1 (a layer whose attention was replaced by a class the
   rule does not know is refused, not skipped).
2. By a probe. One forward of one token (``input_ids`` zeros ``[1, 1]``, a generation cache
   thrown away, no gradients; on the meta device when any weight is there, so a skeleton
   whose blocks are loaded later is probed too) runs with the configs switched to the KV
   function in pass-through mode, which counts its calls per module: every candidate must be
   called exactly once, with 4-d key / value, and no other module may call it. A model whose
   attention bypasses the interface, or calls it from modules the rule does not see, is
   refused. Forward hooks see the probe.

Tested: the model types of :data:`SUPPORTED_MODEL_TYPES`, in float32 and bfloat16, ``sdpa``
and ``eager``; any other type that passes both steps is accepted. The probe runs under a forked
random state (a model in training mode draws dropout masks), so it leaves the RNG as it was.

**The function.** :func:`register` adds ``"nvfp4lab_kv:<inner>"`` (``inner``: ``sdpa`` or
``eager``, the implementation the model had) with the inner implementation's mask function
(``AttentionMaskInterface``). It rotates query and key when the settings stored on the module
(:class:`KVSettings` under :data:`SETTINGS_ATTR`) hold a Q / K rotation, fake-quantizes key and
value with those settings, calls an observer stored under
:data:`OBSERVER_ATTR`, then the inner implementation looked up at call time (``sdpa``:
``ALL_ATTENTION_FUNCTIONS["sdpa"]``; ``eager``: the ``eager_attention_forward`` of the module's
own modeling module, Gemma 2 / 3's with logit softcapping), passing every keyword (``scaling``,
``dropout``, ``sliding_window``, ``softcap``, ``s_aux``, ...) through unchanged. Nothing of
transformers is copied or patched.
"""

from __future__ import annotations

import ast
import contextvars
import inspect
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nvfp4lab.execution.kv_cache import fake_quantize_kv
from nvfp4lab.execution.layers import NVFP4Linear
from nvfp4lab.hadamard import BlockRotation
from nvfp4lab.vocab import KVCacheKind

__all__ = [
    "KV_ATTENTION_PREFIX",
    "OBSERVER_ATTR",
    "SETTINGS_ATTR",
    "SUPPORTED_MODEL_TYPES",
    "WRAPPED_IMPLEMENTATIONS",
    "AttentionModule",
    "KVSettings",
    "eager_of",
    "find_attention_modules",
    "kv_attention_name",
    "register",
]

#: The prefix of the attention implementations nvfp4lab registers ("nvfp4lab_kv:sdpa", ...).
KV_ATTENTION_PREFIX: str = "nvfp4lab_kv:"
#: transformers implementations the KV attention can wrap (the model's before the call).
WRAPPED_IMPLEMENTATIONS: tuple[str, ...] = ("sdpa", "eager")
#: The model types TESTED (tests/execution/test_attention_architectures.py, transformers 5.25:
#: float32 / bfloat16, sdpa / eager, logits equal to the oracle's bit for bit). Any other type
#: whose attention passes :func:`find_attention_modules`' rule and probe is accepted too.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3",
    "granite",
)
#: The attribute holding a module's KV settings, and its observer.
SETTINGS_ATTR = "_nvfp4lab_kv_cache"
OBSERVER_ATTR = "_nvfp4lab_attention_observer"

#: While a probe runs: the list its calls go to, as (module, key shape, value shape).
_PROBE: contextvars.ContextVar[list[tuple[nn.Module, tuple[int, ...], tuple[int, ...]]] | None] = (
    contextvars.ContextVar("nvfp4lab_attention_probe", default=None)
)


@dataclass(frozen=True)
class KVSettings:
    """One attention module's KV cache: the kind, the float32 DECODE scales and the Q / K
    rotation (``qk_rotation``: compressed-tensors' ``hadamard`` transform of block ``b``,
    applied to query and key per head after RoPE, before K is quantized; None: none)."""

    kind: KVCacheKind
    k_scale: float
    v_scale: float
    qk_rotation: BlockRotation | None = None


@dataclass(frozen=True)
class AttentionModule:
    """An attention module the probe saw call the interface once: its name, the module, the
    shape of what it hands attention (``kv_heads``, K's ``head_dim``, V's ``value_dim``) and its
    config's implementation without nvfp4lab's prefix (``sdpa`` / ``eager``)."""

    name: str
    module: nn.Module
    kv_heads: int
    head_dim: int
    value_dim: int
    implementation: str


def kv_attention_name(inner: str) -> str:
    """The registered name of the KV attention wrapping ``inner`` (``"sdpa"`` / ``"eager"``)."""
    return KV_ATTENTION_PREFIX + inner


def eager_of(module: nn.Module) -> Callable[..., Any]:
    """The modeling module's own ``eager_attention_forward`` (what ``"eager"`` means there)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise ValueError(
            f"{type(module).__name__}'s module {type(module).__module__} has no "
            "eager_attention_forward; use attn_implementation='sdpa'"
        )
    return fn  # type: ignore[no-any-return]


def _kv_attention(inner: str) -> Callable[..., Any]:
    """The attention function registered as ``kv_attention_name(inner)``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> Any:
        probe = _PROBE.get()
        if probe is not None:  # pass-through: count, quantize nothing, call no observer
            probe.append((module, tuple(key.shape), tuple(value.shape)))
        else:
            settings: KVSettings | None = module.__dict__.get(SETTINGS_ATTR)
            if settings is not None:  # key / value: [batch, kv_heads, kv_len, head_dim]
                if settings.qk_rotation is not None:  # x -> x R along head_dim, per head
                    query = settings.qk_rotation.apply(query)
                    key = settings.qk_rotation.apply(key)
                key = fake_quantize_kv(key, settings.kind, settings.k_scale)
                value = fake_quantize_kv(value, settings.kind, settings.v_scale)
            observer = module.__dict__.get(OBSERVER_ATTR)
            if observer is not None:
                observer(module, query, key, value)
        default = eager_of(module) if inner == "eager" else None
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(inner, default)
        return fn(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = attention.__qualname__ = f"nvfp4lab_kv_{inner}_attention"
    return attention


def register(inner: str) -> str:
    """Register the KV attention wrapping ``inner`` and its mask function (idempotent); returns
    its name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    name = kv_attention_name(inner)
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _kv_attention(inner))
    if name not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


class _Refused(Exception):
    """A reason the model is not supported (turned into one ValueError line)."""


def _tested() -> str:
    return ", ".join(SUPPORTED_MODEL_TYPES)


def _is_candidate(module: nn.Module) -> bool:
    cls = type(module)
    return (
        cls.__module__.startswith("transformers.models.") and ".modeling_" in cls.__module__
        and cls.__name__.endswith("Attention")
        and isinstance(getattr(module, "layer_idx", None), int)
        and getattr(module, "is_causal", False) is True
    )


def _projections(module: nn.Module) -> str | None:
    """Why ``module``'s projections are not ``nn.Linear`` (None when they are)."""
    for child_name, child in module.named_children():
        weight = getattr(child, "weight", None)
        if (isinstance(weight, torch.Tensor) and weight.ndim >= 2
                and not isinstance(child, nn.Linear | NVFP4Linear)):
            return (f"{type(module).__name__} projects with {type(child).__name__} "
                    f"({child_name}), not nn.Linear")
    return None


def _forward_source(cls: type) -> str | None:
    """Why ``cls.forward`` may not read ``_attn_implementation`` only as ``get_interface``'s
    argument (None when it does)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return (f"the source of {cls.__name__}.forward cannot be read to check how it picks its "
                "attention function")
    tree = ast.parse(source)
    allowed = {
        id(arg) for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr",
                                                  getattr(node.func, "id", None)) == "get_interface"
        for arg in node.args
    }
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "_attn_implementation"
                and id(node) not in allowed):
            line = source.splitlines()[node.lineno - 1].strip()
            return (f"{cls.__name__}.forward reads _attn_implementation outside get_interface "
                    f"(`{line}`), so its path would change when nvfp4lab renames the "
                    "implementation")
    return None


def _inner(caller: str, name: str, module: nn.Module) -> str:
    """The wrapped implementation of ``module``'s config (its KV prefix removed), checked."""
    impl = module.config._attn_implementation  # type: ignore[union-attr]
    inner = impl.removeprefix(KV_ATTENTION_PREFIX) if isinstance(impl, str) else impl
    if inner not in WRAPPED_IMPLEMENTATIONS:
        raise ValueError(
            f"{caller}: {name} runs attn_implementation {impl!r}; the KV cache attention wraps "
            f"{', '.join(map(repr, WRAPPED_IMPLEMENTATIONS))}: load the model with "
            "attn_implementation='sdpa' (or 'eager')"
        )
    if inner == "eager":
        eager_of(module)
    return inner  # type: ignore[no-any-return]


def _one_token_forward(model: nn.Module) -> None:
    """``model(input_ids=[[0]], use_cache=True)``, the cache thrown away (with a cache,
    transformers skips its packed-sequence check, which reads values). A model with any
    parameter or buffer on the meta device (a skeleton whose blocks are loaded one at a time)
    runs on the meta device as a whole: every tensor swapped for a meta one for this call only
    (``torch.func.functional_call``), nothing allocated or changed."""
    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    if any(t.is_meta for _, t in named):
        meta = {name: torch.empty_like(t, device="meta") for name, t in named}
        ids = torch.zeros((1, 1), dtype=torch.long, device="meta")
        torch.func.functional_call(model, meta, kwargs={"input_ids": ids, "use_cache": True})
        return
    device = named[0][1].device if named else None
    cuda = sorted({t.device.index or 0 for _, t in named if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True)


def _probe(model: nn.Module, modules: list[tuple[str, nn.Module, str]]) -> list[
        tuple[nn.Module, tuple[int, ...], tuple[int, ...]]]:
    """One forward of one token with every config switched to the KV function in pass-through
    mode; returns its calls as (module, key shape, value shape)."""
    configs: dict[int, tuple[Any, str]] = {}
    for _, module, inner in modules:
        configs.setdefault(id(module.config), (module.config, inner))  # type: ignore[union-attr]
    model_config = getattr(model, "config", None)
    model_impl = getattr(model_config, "_attn_implementation", None)
    if id(model_config) not in configs and model_impl in WRAPPED_IMPLEMENTATIONS:
        configs[id(model_config)] = (model_config, model_impl)
    saved = [(config, config._attn_implementation) for config, _ in configs.values()]
    calls: list[tuple[nn.Module, tuple[int, ...], tuple[int, ...]]] = []
    token = _PROBE.set(calls)
    try:
        for config, inner in configs.values():
            config._attn_implementation = register(inner)
        with torch.no_grad():
            _one_token_forward(model)
    except Exception as err:
        first = (str(err).splitlines() or [""])[0]
        raise _Refused(f"its one-token probe forward failed ({type(err).__name__}: {first})"
                       ) from err
    finally:
        _PROBE.reset(token)
        for config, impl in saved:
            config._attn_implementation = impl
    return calls


def _found(model: nn.Module, caller: str) -> list[AttentionModule]:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise _Refused("it is not a transformers PreTrainedModel")
    if not getattr(type(model), "_supports_attention_backend", False):
        raise _Refused(f"{type(model).__name__} does not declare _supports_attention_backend "
                       "(its attention need not go through transformers' AttentionInterface)")
    if getattr(model.config, "is_encoder_decoder", False):
        raise _Refused("it is an encoder-decoder")
    candidates = [(name, m) for name, m in model.named_modules() if _is_candidate(m)]
    if not candidates:
        raise _Refused("it has no causal self-attention module (a transformers.models class "
                       "named ...Attention with an integer layer_idx and is_causal True)")
    reasons = [why for cls in dict.fromkeys(type(m) for _, m in candidates)
               for why in (_projections(next(m for _, m in candidates if type(m) is cls)),
                           _forward_source(cls)) if why]
    if reasons:
        raise _Refused("; ".join(reasons))
    layers = getattr(model.config, "num_hidden_layers", None)
    indices = sorted(m.layer_idx for _, m in candidates)  # type: ignore[misc]
    if isinstance(layers, int) and indices != list(range(layers)):
        raise _Refused(
            f"its {layers} decoder layers should have one attention module each, layer_idx 0 to "
            f"{layers - 1}; the rule finds layer_idx {indices} (a replaced or custom attention?)"
        )
    with_inner = [(name, m, _inner(caller, name, m)) for name, m in candidates]
    seen: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {id(m): [] for _, m in
                                                                        candidates}
    for module, k_shape, v_shape in _probe(model, with_inner):
        if id(module) not in seen:
            name = next((n for n, m in model.named_modules() if m is module), "?")
            raise _Refused(
                f"{name} ({type(module).__name__}) calls the attention interface but is not an "
                "attention module by the rule"
            )
        seen[id(module)].append((k_shape, v_shape))
    out = []
    for name, module, inner in with_inner:
        shapes = seen[id(module)]
        if len(shapes) != 1:
            how = "not called" if not shapes else f"called {len(shapes)} times"
            raise _Refused(
                f"{name} ({type(module).__name__}) was {how} through transformers' "
                "AttentionInterface in a one-token forward (its attention bypasses the interface)"
            )
        (k_shape, v_shape), = shapes
        if len(k_shape) != 4 or len(v_shape) != 4 or k_shape[:3] != v_shape[:3]:
            raise _Refused(
                f"{name} hands attention key {list(k_shape)} / value {list(v_shape)}, not "
                "[batch, kv_heads, kv_len, head_dim]"
            )
        out.append(AttentionModule(name, module, k_shape[1], k_shape[3], v_shape[3], inner))
    return out


def find_attention_modules(model: nn.Module, caller: str) -> list[AttentionModule]:
    """The attention modules of ``model`` by the module's rule, in module order, checked by the
    one-token probe (module docstring). ValueError in one line, starting with ``caller``, when
    the model is refused (its type, the reason and the tested types) or a module runs an
    implementation other than ``sdpa`` / ``eager`` (or nvfp4lab's KV function around them).
    The model is left as it was either way."""
    try:
        return _found(model, caller)
    except _Refused as why:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(
            f"{caller}: {type(model).__name__} (model_type {model_type!r}) is not supported: "
            f"{why}; nvfp4lab reaches K after RoPE in transformers decoders whose attention "
            f"modules call the AttentionInterface (tested model types: {_tested()})"
        ) from why.__cause__

