"""``NVFP4Linear``, whole-model quantization and activation-scale calibration.

:class:`NVFP4Linear` stores its weight with exactly the tensor names of a compressed-tensors
"nvfp4-pack-quantized" checkpoint, so a checkpoint's per-layer state dict loads with
``load_state_dict``:

=======================  ==========================  ==========================================
name                     dtype / shape               meaning
=======================  ==========================  ==========================================
``weight_packed``        uint8 ``[N, K/2]``          E2M1 codes, element 2i in the low nibble
``weight_scale``         float8_e4m3fn ``[N, K/16]`` block scales, plain row-major layout
``weight_global_scale``  float32 ``[1]``             ENCODE convention, 2688/amax(W)
``input_global_scale``   float32 ``[1]`` or None     ENCODE convention for the activations;
                                                     None -> computed from each call's input
``bias``                 ``dtype`` ``[N]`` or None   a Parameter, untouched by quantization
=======================  ==========================  ==========================================
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nvfp4lab.constants import BLOCK_SIZE
from nvfp4lab.dispatch import BACKENDS, BackendChoice, select_backend
from nvfp4lab.linear import BIAS_MODES, _linear
from nvfp4lab.quantize import CONVENTIONS, abs_max, compute_global_scale, quantize
from nvfp4lab.tensor import NVFP4Tensor, as_global_scale

__all__ = [
    "SHARE_PRESETS",
    "CalibrationResult",
    "NVFP4Linear",
    "QuantizeReport",
    "ReplacedLayer",
    "SkippedLayer",
    "calibrate_inputs",
    "calibration",
    "quantize_model",
]

_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
_BACKEND_CHOICES: tuple[str, ...] = ("auto", *BACKENDS)

#: Fused groups whose shards must share one weight global scale to load in vLLM.
SHARE_PRESETS: dict[str, tuple[tuple[str, ...], ...]] = {
    "llama": (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
    "bert": (("query", "key", "value"),),
}


def _check_backend(backend: str) -> None:
    if backend not in _BACKEND_CHOICES:
        raise ValueError(f"unknown backend {backend!r}; accepted values: {_BACKEND_CHOICES}")


class NVFP4Linear(nn.Module):
    """A Linear layer with an NVFP4 weight; forward is :func:`nvfp4lab.linear.linear`.

    ``in_features`` (K) must be a multiple of 16. ``dtype`` is the dtype of the bias and the
    default dtype of :meth:`weight_nvfp4` dequantization; ``forward`` computes in the INPUT's
    dtype (fp32/bf16/fp16), as :func:`~nvfp4lab.linear.linear` does.

    ``backend``: "auto" resolves :func:`~nvfp4lab.dispatch.select_backend` for the input's
    device at EVERY forward (so the environment variables are read per call); a concrete backend
    pins it. ``bias_mode``: "output" (default) | "fp32" | "dropped" (see ``linear``).
    ``input_global_scale`` None means dynamic: computed from each forward's input.

    ``cache_dequantized=True`` keeps ``weight.dequantize(dtype)`` for the emulation and w4a16
    paths, per (dtype, device), rebuilt when a weight buffer changes. Memory: N*K*2 bytes for
    bf16/fp16 (N*K*4 for fp32) per cached dtype, i.e. 3.6x (7.1x) the packed weight's
    0.5625 B/weight. The cache is not part of the state dict.
    """

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_global_scale: torch.Tensor
    input_global_scale: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        cache_dequantized: bool = False,
        bias_mode: str = "output",
    ) -> None:
        super().__init__()
        if in_features <= 0 or in_features % BLOCK_SIZE:
            raise ValueError(
                f"NVFP4Linear needs in_features (K) to be a positive multiple of {BLOCK_SIZE}, "
                f"got {in_features}"
            )
        if out_features <= 0:
            raise ValueError(f"out_features must be positive, got {out_features}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        _check_backend(backend)
        if bias_mode not in BIAS_MODES:
            raise ValueError(f"unknown bias_mode {bias_mode!r}; accepted values: {BIAS_MODES}")
        self.in_features = in_features
        self.out_features = out_features
        self.backend = backend
        self.bias_mode = bias_mode
        self.dtype = dtype
        self.cache_dequantized = cache_dequantized
        self._calibrating = False
        self._dq_cache: dict[tuple[Any, ...], torch.Tensor] = {}
        n, k = out_features, in_features
        self.register_buffer(
            "weight_packed", torch.zeros(n, k // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer(
            "weight_scale",
            torch.zeros(n, k // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device),
        )
        self.register_buffer(
            "weight_global_scale", torch.ones(1, dtype=torch.float32, device=device)
        )
        self.register_buffer("input_global_scale", None)
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.zeros(n, dtype=dtype, device=device), requires_grad=False
            )
        else:
            self.register_parameter("bias", None)

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_quantized(
        cls,
        weight: NVFP4Tensor,
        bias: torch.Tensor | None = None,
        *,
        input_global_scale: torch.Tensor | float | None = None,
        backend: str = "auto",
        cache_dequantized: bool = False,
        bias_mode: str = "output",
    ) -> NVFP4Linear:
        """Wrap an NVFP4Tensor ``[N, K]`` (K a multiple of 16, unpadded) and an optional bias.

        The layer's dtype is the bias dtype, else the weight's original dtype.
        """
        if not isinstance(weight, NVFP4Tensor):
            raise TypeError(f"weight must be an NVFP4Tensor, got {type(weight).__name__}")
        if weight.transform is not None:
            raise ValueError(
                f"weight holds a transformed tensor ({weight.transform}), not W itself: a layer "
                "(and a checkpoint) would use it as W; quantize W without the transform"
            )
        if len(weight.shape) != 2 or weight.block_size != BLOCK_SIZE:
            raise ValueError(
                f"weight must be a 2-D NVFP4Tensor with block size 16, got shape "
                f"{tuple(weight.shape)} and block size {weight.block_size}"
            )
        n, k = weight.shape
        if k != 2 * weight.packed.shape[-1]:
            raise ValueError(
                f"weight was quantized with K={k} padded to {2 * weight.packed.shape[-1]}; "
                "NVFP4Linear (like compressed-tensors) needs K to be a multiple of 16"
            )
        dtype = bias.dtype if bias is not None else weight.dtype
        if dtype not in _DTYPES:
            dtype = torch.bfloat16
        layer = cls(
            k,
            n,
            bias is not None,
            backend=backend,
            device=weight.device,
            dtype=dtype,
            cache_dequantized=cache_dequantized,
            bias_mode=bias_mode,
        )
        with torch.no_grad():
            layer.weight_packed.copy_(weight.packed)
            layer.weight_scale.copy_(weight.scales)
            layer.weight_global_scale.copy_(weight.global_scale)
            if bias is not None and layer.bias is not None:
                layer.bias.copy_(bias.detach())
        layer.set_input_global_scale(input_global_scale)
        return layer

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        backend: str = "auto",
        input_global_scale: torch.Tensor | float | None = None,
        weight_global_scale: torch.Tensor | float | None = None,
        convention: str = "kernel",
        cache_dequantized: bool = False,
        bias_mode: str = "output",
    ) -> NVFP4Linear:
        """Quantize an ``nn.Linear`` (weight ``[N, K]``, K a multiple of 16).

        ``weight_global_scale`` (ENCODE convention) defaults to ``2688/amax(W)``;
        ``convention`` is the quantization arithmetic ("kernel" or "compressed-tensors").
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if w.dtype not in _DTYPES:
            raise ValueError(f"the Linear's weight must be fp32/bf16/fp16, got {w.dtype}")
        if w.shape[1] % BLOCK_SIZE:
            raise ValueError(
                f"in_features={w.shape[1]} is not a multiple of {BLOCK_SIZE}: cannot quantize to "
                "NVFP4 (leave this layer unquantized)"
            )
        q = quantize(w, weight_global_scale, convention=convention)  # type: ignore[arg-type]
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls.from_quantized(
            q,
            bias,
            input_global_scale=input_global_scale,
            backend=backend,
            cache_dequantized=cache_dequantized,
            bias_mode=bias_mode,
        )

    # -- accessors -----------------------------------------------------------------------------

    def weight_nvfp4(self) -> NVFP4Tensor:
        """The weight as an :class:`NVFP4Tensor` sharing this layer's buffers (no copy)."""
        return NVFP4Tensor(
            packed=self.weight_packed,
            scales=self.weight_scale,
            global_scale=self.weight_global_scale,
            shape=torch.Size((self.out_features, self.in_features)),
            dtype=self.dtype,
        )

    def set_input_global_scale(self, value: torch.Tensor | float | None) -> None:
        """Set the ENCODE-convention activation scale (2688/amax); None -> dynamic per call."""
        if value is None:
            self.input_global_scale = None
            return
        self.input_global_scale = as_global_scale(value, self.weight_packed.device).clone()

    def backend_choice(self, device: torch.device | str | None = None, *,
                       env: Mapping[str, str] | None = None) -> BackendChoice | None:
        """The selection "auto" makes for ``device`` (default: the buffers' device) now.

        None when the layer was built with a concrete backend.
        """
        if self.backend != "auto":
            return None
        return select_backend(device if device is not None else self.weight_packed.device, env=env)

    def _resolve_backend(self, x: torch.Tensor) -> str:
        if self._calibrating:
            return "w4a16"  # observe unquantized activations while calibrating
        if self.backend == "auto":
            return select_backend(x.device).name
        return self.backend

    def _cached_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        if not self.cache_dequantized:
            return None
        bufs = (self.weight_packed, self.weight_scale, self.weight_global_scale)
        key = (dtype, self.weight_packed.device, *((b.data_ptr(), b._version) for b in bufs))
        cached = self._dq_cache.get(key)
        if cached is None:
            self._dq_cache.clear()
            cached = self.weight_nvfp4().dequantize(dtype)
            self._dq_cache[key] = cached
        return cached

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` (fp32/bf16/fp16) -> ``[..., N]`` in ``x.dtype``."""
        backend = self._resolve_backend(x)
        w_dq = self._cached_weight(x.dtype) if backend != "native" else None
        return _linear(
            x,
            self.weight_nvfp4(),
            self.bias,
            input_global_scale=self.input_global_scale,
            backend=backend,
            bias_mode=self.bias_mode,
            w_dq=w_dq,
        )

    def extra_repr(self) -> str:
        if self.backend == "auto":
            try:
                choice = self.backend_choice()
                backend = f"auto → {choice.name} ({choice.reason})" if choice else "auto"
            except ValueError as err:  # a bad environment variable
                backend = f"auto (cannot resolve: {err})"
        else:
            backend = f"{self.backend} (fixed when the layer was built; auto would re-select)"
        igs = self.input_global_scale
        if igs is None:
            act = "dynamic"
        elif igs.is_meta:
            act = "static"
        else:
            act = f"{float(igs):.6g}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, dtype={self.dtype}, input_global_scale={act}, "
            f"bias_mode={self.bias_mode}, backend={backend}"
        )

    # -- dtype/device moves ----------------------------------------------------------------------

    _QUANTIZED_BUFFERS: tuple[str, ...] = (
        "weight_packed",
        "weight_scale",
        "weight_global_scale",
        "input_global_scale",
    )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``.to(device)`` moves everything; ``.to(dtype)`` / ``.half()`` / ``.bfloat16()`` cast
        only the bias (and the layer's ``dtype``): the quantized buffers keep their formats
        (a float32 global scale cast to bf16 would be rounded)."""
        order = list(self._buffers)
        held = {
            name: self._buffers.pop(name)
            for name in self._QUANTIZED_BUFFERS
            if self._buffers.get(name) is not None
        }
        try:
            super()._apply(fn, recurse)
        finally:
            for name, buf in held.items():
                moved = fn(buf)
                if moved.dtype != buf.dtype:
                    moved = buf.to(device=moved.device)
                self._buffers[name] = moved
            for name in self._QUANTIZED_BUFFERS:  # None-valued buffers stay registered
                self._buffers.setdefault(name, None)
            ordered = [(name, self._buffers[name]) for name in order if name in self._buffers]
            self._buffers.clear()
            self._buffers.update(ordered)
        new_dtype = fn(torch.empty(0, dtype=self.dtype)).dtype
        if new_dtype in _DTYPES:
            self.dtype = new_dtype
        self._dq_cache.clear()
        return self

    # -- state dict ----------------------------------------------------------------------------

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Accept an ``input_global_scale`` when the layer is dynamic (None), and treat its
        absence (weight-only NVFP4A16 checkpoints) as dynamic activation scaling."""
        key = prefix + "input_global_scale"
        if key in state_dict and self.input_global_scale is None:
            self.input_global_scale = torch.ones(
                1, dtype=torch.float32, device=self.weight_packed.device
            )
        elif key not in state_dict and self.input_global_scale is not None:
            self.input_global_scale = None
        self._dq_cache.clear()
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


# ---------------------------------------------------------------------------------------------
# quantize_model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplacedLayer:
    """A Linear replaced by an NVFP4Linear. ``weight_global_scale``: ENCODE convention."""

    name: str
    in_features: int
    out_features: int
    bias: bool
    weight_global_scale: float
    shared_with: tuple[str, ...] = ()


@dataclass(frozen=True)
class SkippedLayer:
    """A module left as it was, and why."""

    name: str
    type: str
    reason: str


@dataclass
class QuantizeReport:
    """What :func:`quantize_model` replaced and skipped (and why)."""

    replaced: list[ReplacedLayer] = field(default_factory=list)
    skipped: list[SkippedLayer] = field(default_factory=list)
    shared_groups: list[tuple[str, ...]] = field(default_factory=list)

    @property
    def replaced_names(self) -> list[str]:
        return [r.name for r in self.replaced]

    @property
    def skipped_names(self) -> list[str]:
        return [s.name for s in self.skipped]

    def rows(self) -> list[dict[str, object]]:
        """One dict per layer (for a pandas DataFrame)."""
        out: list[dict[str, object]] = [
            {
                "name": r.name,
                "action": "replaced",
                "shape": f"{r.out_features}x{r.in_features}",
                "weight_global_scale": r.weight_global_scale,
                "detail": f"shared with {', '.join(r.shared_with)}" if r.shared_with else "",
            }
            for r in self.replaced
        ]
        out += [
            {"name": s.name, "action": "skipped", "shape": "", "weight_global_scale": None,
             "detail": f"{s.type}: {s.reason}"}
            for s in self.skipped
        ]
        return out

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} Linear layer(s), skipped {len(self.skipped)}"]
        for r in self.replaced:
            shared = (
                f"  (global scale shared with {', '.join(r.shared_with)})" if r.shared_with else ""
            )
            lines.append(
                f"  + {r.name}: [{r.out_features}, {r.in_features}] gs={r.weight_global_scale:.6g}"
                f"{shared}"
            )
        lines += [f"  - {s.name} ({s.type}): {s.reason}" for s in self.skipped]
        return "\n".join(lines)


IgnoreSpec = str | re.Pattern[str]


def _ignored_by(name: str, ignore: Iterable[IgnoreSpec]) -> IgnoreSpec | None:
    """``"re:<pattern>"`` -> ``re.match`` (compressed-tensors' syntax); a compiled pattern ->
    ``search``; a plain string -> the exact name or a dotted suffix ("lm_head" matches
    "model.lm_head")."""
    for spec in ignore:
        if isinstance(spec, re.Pattern):
            if spec.search(name):
                return spec
        elif spec.startswith("re:"):
            if re.match(spec[3:], name):
                return spec
        elif name == spec or name.endswith("." + spec):
            return spec
    return None


def _share_groups(
    names: Sequence[str], share: str | Sequence[Sequence[str]] | None
) -> list[tuple[str, ...]]:
    """Groups of layer names (from ``names``) sharing one weight global scale."""
    if share is None:
        return []
    if share == "auto":
        specs_auto = tuple(dict.fromkeys(g for groups in SHARE_PRESETS.values() for g in groups))
        return _share_groups(names, specs_auto)
    if isinstance(share, str):
        if share not in SHARE_PRESETS:
            raise ValueError(
                f"unknown share_global_scale preset {share!r}; presets: 'auto', "
                f"{', '.join(repr(p) for p in sorted(SHARE_PRESETS))}, None "
                "or a sequence of groups of layer names/suffixes"
            )
        specs: Sequence[Sequence[str]] = SHARE_PRESETS[share]
    else:
        specs = share
    present = set(names)
    groups: list[tuple[str, ...]] = []
    taken: set[str] = set()
    for spec in specs:
        if isinstance(spec, str):
            raise ValueError(
                f"share_global_scale groups must be sequences of names, got the string {spec!r}"
            )
        by_parent: dict[str, list[str]] = {}
        for member in spec:
            for name in names:
                if name == member or name.endswith("." + member):
                    parent = name[: len(name) - len(member)]
                    by_parent.setdefault(parent, []).append(name)
        for members in by_parent.values():
            group = tuple(dict.fromkeys(m for m in members if m in present and m not in taken))
            if len(group) > 1:
                groups.append(group)
                taken.update(group)
    return groups


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def quantize_model(
    model: nn.Module,
    *,
    backend: str = "auto",
    ignore: Iterable[IgnoreSpec] = ("lm_head",),
    share_global_scale: str | Sequence[Sequence[str]] | None = "auto",
    convention: str = "kernel",
    cache_dequantized: bool = False,
    bias_mode: str = "output",
) -> QuantizeReport:
    """Replace ``nn.Linear`` layers of ``model`` in place by :class:`NVFP4Linear`.

    Skipped, with the reason in the report: names matched by ``ignore`` (exact names, dotted
    suffixes, ``"re:<regex>"`` or compiled patterns), Linear layers with K not a multiple of 16,
    subclasses of nn.Linear (e.g. ``nn.MultiheadAttention.out_proj``, whose parent reads
    ``.weight`` directly), and other modules holding parameters (not nn.Linear).

    ``share_global_scale``: ``"auto"`` (default: every preset's groups, where present), a preset
    ("llama": q/k/v_proj and gate/up_proj; "bert": query/key/value), groups of names/suffixes,
    or None (every layer its own scale); the members found under one parent share the weight
    global scale ``min_i 2688/amax(W_i)`` (= 2688 / the group's max amax), as fused shards in
    vLLM-loadable checkpoints must (vLLM decodes all shards with one scale). Activation scales
    start dynamic (None); use
    :func:`calibration` / :func:`calibrate_inputs` to set them.
    """
    _check_backend(backend)
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown convention {convention!r}; accepted values: {CONVENTIONS}")
    ignore = tuple(ignore)
    report = QuantizeReport()
    candidates: dict[str, nn.Linear] = {}
    for name, module in model.named_modules():
        if not name:
            continue
        kind = type(module).__name__
        if isinstance(module, NVFP4Linear):
            continue
        if isinstance(module, nn.Linear):
            spec = _ignored_by(name, ignore)
            if spec is not None:
                report.skipped.append(SkippedLayer(name, kind, f"ignored (matches {spec!r})"))
            elif type(module) is not nn.Linear:
                report.skipped.append(
                    SkippedLayer(name, kind, "subclass of nn.Linear: its owner may read .weight")
                )
            elif module.in_features % BLOCK_SIZE:
                report.skipped.append(
                    SkippedLayer(
                        name, kind, f"K={module.in_features} is not a multiple of {BLOCK_SIZE}"
                    )
                )
            elif module.weight.dtype not in _DTYPES:
                reason = f"weight dtype {module.weight.dtype} is not fp32/bf16/fp16"
                report.skipped.append(SkippedLayer(name, kind, reason))
            else:
                candidates[name] = module
        elif any(True for _ in module.parameters(recurse=False)):
            report.skipped.append(SkippedLayer(name, kind, "not nn.Linear"))

    groups = _share_groups(list(candidates), share_global_scale)
    shared_gs: dict[str, torch.Tensor] = {}
    partners: dict[str, tuple[str, ...]] = {}
    for group in groups:
        scales = [
            compute_global_scale(candidates[m].weight.detach(), convention=convention)  # type: ignore[arg-type]
            for m in group
        ]
        gs = torch.stack([s.to(scales[0].device) for s in scales]).min(dim=0).values
        for m in group:
            shared_gs[m] = gs
            partners[m] = tuple(o for o in group if o != m)
    report.shared_groups = groups

    for name, module in candidates.items():
        layer = NVFP4Linear.from_linear(
            module,
            backend=backend,
            weight_global_scale=shared_gs.get(name),
            convention=convention,
            cache_dequantized=cache_dequantized,
            bias_mode=bias_mode,
        )
        _set_submodule(model, name, layer)
        report.replaced.append(
            ReplacedLayer(
                name=name,
                in_features=layer.in_features,
                out_features=layer.out_features,
                bias=layer.bias is not None,
                weight_global_scale=float(layer.weight_global_scale),
                shared_with=partners.get(name, ()),
            )
        )
    return report


# ---------------------------------------------------------------------------------------------
# Calibration of input global scales
# ---------------------------------------------------------------------------------------------


@dataclass
class CalibrationResult:
    """Running max |input| per NVFP4Linear (filled during :func:`calibration`).

    ``amax``: layer name -> amax (float, input units); ``global_scales``: name -> the ENCODE
    scale set on exit; ``not_seen``: layers that received no input (their scale is unchanged).
    """

    amax: dict[str, float] = field(default_factory=dict)
    global_scales: dict[str, float] = field(default_factory=dict)
    not_seen: list[str] = field(default_factory=list)


@contextmanager
def calibration(model: nn.Module, *, convention: str = "kernel") -> Iterator[CalibrationResult]:
    """Record each NVFP4Linear's running max |input|; on a normal exit set its
    ``input_global_scale = 2688/amax`` (:func:`compute_global_scale` semantics: float32 for
    "kernel", the input dtype for "compressed-tensors"; amax 0 -> 1.0).

    While inside, the layers run weight-only (activations are observed unquantized, as
    compressed-tensors calibrates with activation quantization disabled). On an exception the
    hooks are removed and no scale is changed.
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown convention {convention!r}; accepted values: {CONVENTIONS}")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    running: dict[str, torch.Tensor] = {}
    result = CalibrationResult()

    def make_hook(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            if not isinstance(x, torch.Tensor) or x.numel() == 0:
                return
            amax = abs_max(x.detach())
            prev = running.get(name)
            running[name] = amax if prev is None else torch.maximum(prev, amax.to(prev.dtype))

        return hook

    handles = [m.register_forward_pre_hook(make_hook(n)) for n, m in layers.items()]
    for m in layers.values():
        m._calibrating = True
    ok = False
    try:
        yield result
        ok = True
    finally:
        for h in handles:
            h.remove()
        for m in layers.values():
            m._calibrating = False
    if ok:
        for name, layer in layers.items():
            amax = running.get(name)
            if amax is None:
                result.not_seen.append(name)
                continue
            gs = compute_global_scale(amax.reshape(1), convention=convention)  # type: ignore[arg-type]
            layer.set_input_global_scale(gs)
            result.amax[name] = float(amax)
            result.global_scales[name] = float(gs)


def calibrate_inputs(
    model: nn.Module, batches: Iterable[Any], *, convention: str = "kernel"
) -> CalibrationResult:
    """Run ``batches`` through ``model`` inside :func:`calibration` (no grad) and return the
    result. A batch is passed as ``model(**b)`` for a mapping, ``model(*b)`` for a tuple/list,
    else ``model(b)``."""
    with torch.no_grad(), calibration(model, convention=convention) as result:
        for batch in batches:
            if isinstance(batch, Mapping):
                model(**batch)
            elif isinstance(batch, tuple | list):
                model(*batch)
            else:
                model(batch)
    return result
