"""Mixed precision: each Linear of a model in its own format (:class:`~nvfp4lab.vocab.LayerFormat`).

=============  =====================================================  ===========================
format         what runs                                              bits per weight (the rule)
=============  =====================================================  ===========================
nvfp4-rtn      :class:`NVFP4Linear`, W4A16 (weights NVFP4 by round    4 + 8/16 + 32/(N·K)
               to nearest, activations in the model's dtype)
nvfp4-gptq     the same layer, its codes by GPTQ                      4 + 8/16 + 32/(N·K)
nvfp4-mr-gptq  the same layer holding NVFP4 of ``W Q`` by GPTQ          4 + 8/16 + 32/(N·K)
               (MR-GPTQ; Q compressed-tensors' random-hadamard 16,
               :data:`~nvfp4lab.execution.whole_model.MR_GPTQ_ROTATION`;
               inputs rotated at run time; the 16x16 rotation stored
               once per checkpoint is not counted)
fp8            :class:`FP8Linear`: W8A8 as vLLM 0.33 runs FP8         8 + 32/K (per channel)
               (below)                                                8 + 32/(N·K) (per tensor)
fp8-w8a16      :class:`FP8Linear` with float activations (W8A16, the  8 + 32/K (per channel)
               same weight bytes; below)
mxfp4          :class:`MXFP4Linear`, W4A16 (E2M1, an E8M0 scale per   4 + 8/32
               32 along K; activations in the model's dtype, as
               vLLM's Marlin MXFP4 path on Hopper)
q8_0           :class:`~nvfp4lab.execution.mixed_q8_0.Q8_0Linear`:    8 + 16/32
               llama.cpp's Q8_0 (int8, float16 scale per 32; Q8_0
               activations), for GGUF mixes
bf16           the Linear left as it is (float)                       16
=============  =====================================================  ===========================

**Effective bits** (:func:`effective_bits`): the weight bits of every quantizable Linear (the
rule above: element bits plus every stored scale, the per-tensor ones included, biases not
counted), averaged over their weights (``Σ bits_l · N_l K_l / Σ N_l K_l``). A layer left float
counts 16 bits whatever its dtype (a float32 study model is deployed in bfloat16). Uniform
NVFP4 is 4.5 (plus 32 bits a layer), uniform FP8 8.06 for SmolLM2.

**FP8 as vLLM 0.33 runs it** (``CompressedTensorsW8A8Fp8`` with llm-compressor's FP8_DYNAMIC
scheme: per-channel weight scales, dynamic per-token activation scales; ``Fp8LinearMethod`` /
the online ``fp8`` method keep one weight scale per tensor, ``per_channel=False`` here):

* weight: ``s_w = amax(|W row|) / 448`` in float32 (a zero one replaced by float32 eps, as
  compressed-tensors' ``calculate_qparams`` does), ``W_q = e4m3(clamp(W / s_w, ±448))``
  (compressed-tensors' quantize: a division, round to nearest even by the cast);
* activation, per call and token (``QuantFP8`` dynamic per-token): ``s_x = max(amax(|x
  row|) / 448, 1 / (448·512))`` in float32, ``x_q = e4m3(clamp(x · (1 / s_x), ±448))`` (a
  reciprocal, then a product);
* GEMM: ``acc = x_q · W_qᵀ`` accumulated exactly and rounded once to float32 (sums of E4M3
  products are exact in float64 for K below 2^17; the tensor-core accumulation order is not
  modelled), then ``(acc · s_x) · s_wᵀ`` in float32, ``+ bias`` in float32, cast to the input's
  dtype (vLLM's ``ChannelWiseTorchFP8ScaledMMLinearKernel`` epilogue, in that order).

**FP8 W8A16** (``fp8-w8a16``; vLLM 0.33 loads a compressed-tensors group whose weights are FP8
and whose ``input_activations`` is null as ``CompressedTensorsW8A16Fp8``, the Marlin FP8 kernel,
on every GPU from sm_75): the same weight bytes and scales; the activations stay in the model's
dtype, ``acc = x · W_qᵀ`` accumulated in float64 and rounded once to float32 (the products of a
bfloat16 value and an E4M3 code are exact there), then ``acc · s_wᵀ``, ``+ bias``, the cast.
No activation error: beside NVFP4 W4A16 layers this keeps the whole mix weight-only.

:func:`apply_mix` installs a mix: FP8, MXFP4 and Q8_0 layers first, then the NVFP4 RTN layers,
the GPTQ layers and last the MR-GPTQ layers, all by
:func:`~nvfp4lab.execution.whole_model.quantize_model` (so GPTQ
calibrates on the model with every other layer already in its format, and fused shards of one
format share their global scale as quantize_model shares them). A mix that is all one NVFP4
method gives quantize_model's model bit for bit.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nvfp4lab import number_formats
from nvfp4lab.codec import compute_global_scale
from nvfp4lab.constants import BLOCK_SIZE, E4M3_MAX
from nvfp4lab.execution.gptq import GPTQOptions, gptq_quantize
from nvfp4lab.execution.layers import NVFP4Linear
from nvfp4lab.execution.mixed_q8_0 import Q8_0_BITS, Q8_0Linear
from nvfp4lab.execution.quantize_report import QuantizeReport
from nvfp4lab.execution.whole_model import (
    DEFAULT_IGNORE,
    FUSED_GROUPS,
    MR_GPTQ_ROTATION,
    quantize_model,
)
from nvfp4lab.hadamard import hadamard_transform
from nvfp4lab.number_formats.base import PackedBlocks
from nvfp4lab.vocab import Backend, LayerFormat, QuantMethod, check_choice

__all__ = [
    "NVFP4_FORMATS",
    "FP8Linear",
    "MXFP4Linear",
    "MixReport",
    "Q8_0Linear",
    "apply_mix",
    "check_mix",
    "effective_bits",
    "fused_units",
    "layer_bits",
    "quantizable_linears",
    "quantize_layer",
    "shared_global_scale",
]

#: Smallest dynamic activation scale (vLLM's ``_FP8_MIN_SCALING_FACTOR``).
FP8_MIN_SCALE: float = 1.0 / (E4M3_MAX * 512.0)
#: Elements per MXFP4 block.
MXFP4_BLOCK = 32
#: The NVFP4 layer formats (an NVFP4Linear with a tensor scale).
NVFP4_FORMATS = (LayerFormat.NVFP4_RTN, LayerFormat.NVFP4_GPTQ, LayerFormat.NVFP4_MR_GPTQ)
_NVFP4 = NVFP4_FORMATS
#: The NVFP4 formats quantize_model builds, in apply_mix's order, with their method.
_NVFP4_METHODS = ((LayerFormat.NVFP4_RTN, QuantMethod.RTN),
                  (LayerFormat.NVFP4_GPTQ, QuantMethod.GPTQ),
                  (LayerFormat.NVFP4_MR_GPTQ, QuantMethod.MR_GPTQ))
_FP8 = (LayerFormat.FP8, LayerFormat.FP8_W8A16)


# ---------------------------------------------------------------------------------------------
# FP8 W8A8
# ---------------------------------------------------------------------------------------------


def fp8_weight(weight: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_q float8_e4m3fn [N, K], s_w float32 [N, 1] or [1, 1])`` of a float ``[N, K]`` weight
    (module docstring: compressed-tensors' scale and quantize)."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)
    scale = amax / E4M3_MAX
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def fp8_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 of ``x [M, K]``: ``(x_q float8_e4m3fn [M, K], s_x float32 [M, 1])``
    as vLLM's ``QuantFP8`` (native path) computes them."""
    amax = x.abs().amax(dim=-1).unsqueeze(-1).to(torch.float32)
    scale = (amax / E4M3_MAX).clamp(min=FP8_MIN_SCALE)
    q = (x.to(torch.float32) * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


class FP8Linear(nn.Module):
    """A Linear in FP8 W8A8 as vLLM 0.33 runs it, or W8A16 with ``quantize_activations=False``
    (module docstring). Buffers: ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` float32
    ``[N, 1]`` (per channel) or ``[1, 1]``; ``bias`` in the original dtype or None.
    ``forward(x [..., K])`` returns ``[..., N]`` in ``x.dtype``."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, *, quantize_activations: bool = True) -> None:
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2:
            raise ValueError(f"FP8Linear needs a float8_e4m3fn [N, K] weight, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.quantize_activations = bool(quantize_activations)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.to(torch.float32))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, per_channel: bool = True,
                    quantize_activations: bool = True) -> FP8Linear:
        """Quantize ``linear``'s weight (per output channel, or one scale with
        ``per_channel=False``); ``quantize_activations=False``: W8A16."""
        weight, scale = fp8_weight(linear.weight, per_channel)
        return cls(weight, scale, linear.bias, quantize_activations=quantize_activations)

    @property
    def layer_format(self) -> LayerFormat:
        """``fp8`` (W8A8) or ``fp8-w8a16``."""
        return LayerFormat.FP8 if self.quantize_activations else LayerFormat.FP8_W8A16

    @property
    def per_channel(self) -> bool:
        return self.weight_scale.shape[0] == self.out_features and self.out_features > 1

    def dequantized_weight(self) -> torch.Tensor:
        """``W_q · s_w``, float32 ``[N, K]``."""
        return self.weight.to(torch.float32) * self.weight_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if self.quantize_activations:
            x_q, x_s = fp8_activation(rows)
            acc = (x_q.to(torch.float64) @ self.weight.to(torch.float64).T).to(torch.float32)
            out = acc * x_s * self.weight_scale.T
        else:
            acc = (rows.to(torch.float64) @ self.weight.to(torch.float64).T).to(torch.float32)
            out = acc * self.weight_scale.T
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        scales = "per channel" if self.per_channel else "per tensor"
        acts = "activations per token" if self.quantize_activations else "W8A16"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight scales {scales}, {acts}")


# ---------------------------------------------------------------------------------------------
# MXFP4 W4A16
# ---------------------------------------------------------------------------------------------


class MXFP4Linear(nn.Module):
    """A Linear with MXFP4 weights (:mod:`nvfp4lab.number_formats`' ``mxfp4``: E2M1 codes two a
    byte in ``weight_packed`` uint8 ``[N, K/2]``, one E8M0 exponent byte a block of 32 in
    ``weight_scale`` ``[N, K/32]``) and activations in the model's dtype: ``forward(x [..., K])``
    decodes the weight to ``x.dtype`` (every MXFP4 value is exact there) and runs ``F.linear``."""

    def __init__(self, packed: PackedBlocks, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape
        self._info = packed.info
        self.register_buffer("weight_packed", packed.packed)
        self.register_buffer("weight_scale", packed.scales)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> MXFP4Linear:
        """Quantize ``linear``'s weight (K a multiple of 32)."""
        if linear.in_features % MXFP4_BLOCK:
            raise ValueError(f"MXFP4 needs K to be a multiple of {MXFP4_BLOCK}, got "
                             f"{linear.in_features}: keep this layer in another format")
        return cls(number_formats.get(LayerFormat.MXFP4).quantize(linear.weight.detach()),
                   linear.bias)

    @classmethod
    def from_stored(cls, packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                    bias: torch.Tensor | None = None) -> MXFP4Linear:
        """The layer of stored bytes (a checkpoint's): ``packed`` uint8 ``[N, K/2]``,
        ``scales`` uint8 E8M0 ``[N, K/32]``, held as given; ``dtype``: the model's."""
        n, half = packed.shape
        if packed.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(
                scales.shape) != (n, 2 * half // MXFP4_BLOCK) or (2 * half) % MXFP4_BLOCK:
            raise ValueError(f"MXFP4Linear.from_stored needs uint8 [N, K/2] codes and uint8 "
                             f"[N, K/32] scales, got {packed.dtype} {list(packed.shape)} and "
                             f"{scales.dtype} {list(scales.shape)}")
        info = number_formats.get(LayerFormat.MXFP4).info  # type: ignore[attr-defined]
        return cls(PackedBlocks(packed, scales, torch.Size((n, 2 * half)), dtype, info), bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        packed = PackedBlocks(self.weight_packed, self.weight_scale,
                              torch.Size((self.out_features, self.in_features)), dtype, self._info)
        return packed.dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, W4A16")


# ---------------------------------------------------------------------------------------------
# Layers, units and bits
# ---------------------------------------------------------------------------------------------


def quantizable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linears a mix may set, in module order: exactly ``nn.Linear``, K a multiple of 16,
    not the output head (``lm_head``, which quantize_model leaves float by default)."""
    out = {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or module.in_features % BLOCK_SIZE:
            continue
        if any(name == s or name.endswith("." + s) for s in DEFAULT_IGNORE):
            continue
        out[name] = module
    return out


def fused_units(names: Sequence[str]) -> list[tuple[str, ...]]:
    """``names`` grouped into the units an engine loads with one format: the members of a fused
    group (:data:`~nvfp4lab.execution.whole_model.FUSED_GROUPS`: q/k/v, gate/up) under one
    parent form one unit, every other layer its own; in the order of each unit's first name."""
    unit_of: dict[str, tuple[str, ...]] = {}
    for group in FUSED_GROUPS:
        by_parent: dict[str, list[str]] = {}
        for name in names:
            parent, _, leaf = name.rpartition(".")
            if leaf in group and name not in unit_of:
                by_parent.setdefault(parent, []).append(name)
        for members in by_parent.values():
            if len(members) > 1:
                unit = tuple(sorted(members, key=list(names).index))
                unit_of.update(dict.fromkeys(unit, unit))
    out: list[tuple[str, ...]] = []
    for name in names:
        unit = unit_of.get(name, (name,))
        if unit not in out:
            out.append(unit)
    return out


def layer_bits(fmt: str, n: int, k: int, *, per_channel: bool = True) -> float:
    """Bits per weight of an ``[n, k]`` weight in ``fmt`` (the module docstring's rule)."""
    fmt = check_choice("layer format", fmt, LayerFormat)
    if fmt in _NVFP4:
        return 4.0 + 8.0 / BLOCK_SIZE + 32.0 / (n * k)
    if fmt in _FP8:
        return 8.0 + (32.0 / k if per_channel else 32.0 / (n * k))
    if fmt == LayerFormat.MXFP4:
        return 4.0 + 8.0 / MXFP4_BLOCK
    if fmt == LayerFormat.Q8_0:
        return Q8_0_BITS
    return 16.0


def _shape(model: nn.Module, name: str) -> tuple[int, int]:
    module = model.get_submodule(name)
    return int(module.out_features), int(module.in_features)


def effective_bits(model: nn.Module, mix: Mapping[str, str], *, per_channel: bool = True) -> float:
    """Bits per weight of ``model``'s quantizable Linears under ``mix`` (name -> format; a
    quantizable Linear it leaves out counts as ``bf16``): ``Σ bits · N K / Σ N K`` (module
    docstring). ``model``: the float model, or the mixed one (its layers keep their shapes)."""
    names = list(dict.fromkeys([*quantizable_linears(model), *mix]))
    if not names:
        raise ValueError(f"{type(model).__name__} has no quantizable Linear (nn.Linear with K a "
                         f"multiple of {BLOCK_SIZE}, not the output head)")
    total = weights = 0.0
    for name in names:
        n, k = _shape(model, name)
        bits = layer_bits(mix.get(name, LayerFormat.BF16), n, k, per_channel=per_channel)
        total += bits * n * k
        weights += n * k
    return total / weights


def check_mix(model: nn.Module, mix: Mapping[str, str]) -> dict[str, LayerFormat]:
    """``mix`` with every format a :class:`LayerFormat` member; ValueError for a name that is not
    a quantizable Linear of ``model`` (naming the first few that are) or an unknown format,
    TypeError for a mix that is not a mapping."""
    if not isinstance(mix, Mapping):
        raise TypeError(f"mix must be a mapping of layer name -> format, got {type(mix).__name__}")
    linears = quantizable_linears(model)
    out: dict[str, LayerFormat] = {}
    for name, fmt in mix.items():
        if name not in linears:
            shown = ", ".join(list(linears)[:3])
            raise ValueError(f"mix names {name!r}, which is not a quantizable Linear of "
                             f"{type(model).__name__} (e.g. {shown}); use the full module names")
        out[name] = LayerFormat(check_choice(f"format of {name!r}", fmt, LayerFormat))
    return out


def shared_global_scale(linears: Mapping[str, nn.Linear], name: str,
                        fmt: str = LayerFormat.NVFP4_RTN) -> torch.Tensor:
    """The NVFP4 weight global scale ``name`` gets in ``fmt`` when its fused unit
    (:func:`fused_units` of ``linears``' names) is quantized together, as quantize_model shares
    it: ``min_i 2688 / amax(W_i)`` over the unit (its own scale when it is alone; of ``W_i Q``,
    the tensor quantized, for ``nvfp4-mr-gptq``), float32 ``[1]``."""
    unit = next(u for u in fused_units(list(linears)) if name in u)
    rotated = check_choice("layer format", fmt, LayerFormat) == LayerFormat.NVFP4_MR_GPTQ
    scales = [compute_global_scale(hadamard_transform(linears[m].weight.detach(), MR_GPTQ_ROTATION)
                                   if rotated else linears[m].weight.detach()) for m in unit]
    return torch.stack(scales).min(dim=0).values


def quantize_layer(
    linear: nn.Linear, fmt: str, *, hessian: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None, gptq: GPTQOptions | None = None,
    per_channel: bool = True,
) -> nn.Module:
    """``linear`` in ``fmt`` as one module (``bf16``: ``linear`` itself). ``nvfp4-gptq`` and
    ``nvfp4-mr-gptq`` need ``hessian`` (float ``[K, K]``, ∝ Σ x xᵀ of the layer's inputs);
    ``global_scale``: the NVFP4 ENCODE global scale (None: the layer's own;
    :func:`shared_global_scale` of ``fmt`` for a fused unit)."""
    fmt = check_choice("layer format", fmt, LayerFormat)
    if fmt == LayerFormat.NVFP4_RTN:
        return NVFP4Linear.from_linear(linear, weight_global_scale=global_scale,
                                       backend=Backend.W4A16)
    if fmt in (LayerFormat.NVFP4_GPTQ, LayerFormat.NVFP4_MR_GPTQ):
        if hessian is None:
            raise ValueError(f"{fmt} needs the layer's hessian (collect it from "
                             "calibration inputs: execution.gptq_model.collect_hessians)")
        rotation = MR_GPTQ_ROTATION if fmt == LayerFormat.NVFP4_MR_GPTQ else None
        result = gptq_quantize(linear.weight, hessian, global_scale=global_scale,
                               options=gptq, hadamard=rotation)  # type: ignore[arg-type]
        bias = None if linear.bias is None else linear.bias.detach()
        assert result.weight is not None
        return NVFP4Linear.from_quantized(result.weight, bias, backend=Backend.W4A16)
    if fmt in _FP8:
        return FP8Linear.from_linear(linear, per_channel=per_channel,
                                     quantize_activations=fmt == LayerFormat.FP8)
    if fmt == LayerFormat.MXFP4:
        return MXFP4Linear.from_linear(linear)
    if fmt == LayerFormat.Q8_0:
        return Q8_0Linear.from_linear(linear)
    return linear


def set_layer(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """Install ``module`` as ``model``'s submodule ``name``; returns the module it replaced."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, module)
    return old


# ---------------------------------------------------------------------------------------------
# A whole mix
# ---------------------------------------------------------------------------------------------


@dataclass
class MixReport:
    """What :func:`apply_mix` did: ``formats`` (name -> format of every quantizable Linear,
    the ones the mix left out as ``bf16``), ``bits`` (:func:`effective_bits`), and the
    :class:`QuantizeReport` of the NVFP4 RTN / GPTQ / MR-GPTQ calls (``nvfp4``, in that
    order)."""

    formats: dict[str, LayerFormat]
    bits: float
    nvfp4: list[QuantizeReport] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Layers per format."""
        out: dict[str, int] = {}
        for fmt in self.formats.values():
            out[str(fmt)] = out.get(str(fmt), 0) + 1
        return out


def _linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if n and type(m) is nn.Linear]


def apply_mix(
    model: nn.Module, mix: Mapping[str, str], *, calibration: Iterable[Any] | None = None,
    gptq: GPTQOptions | None = None, per_channel: bool = True,
) -> MixReport:
    """Put every Linear named in ``mix`` (name -> :class:`LayerFormat`) in its format, in place;
    quantizable Linears it leaves out stay float. ``calibration``: model inputs (tokenizer
    outputs) for the ``nvfp4-gptq`` / ``nvfp4-mr-gptq`` layers, which GPTQ calibrates on the
    model with every other layer already in its format (module docstring). ``gptq``:
    :class:`GPTQOptions`. ``per_channel``: FP8 weight scales per output channel (else one per
    tensor). Bad names or formats, or GPTQ layers without ``calibration``, are refused before
    anything changes."""
    formats = check_mix(model, mix)
    wanted = {fmt: [n for n, f in formats.items() if f == fmt] for fmt in LayerFormat}
    for fmt in (LayerFormat.NVFP4_GPTQ, LayerFormat.NVFP4_MR_GPTQ):
        if wanted[fmt] and calibration is None:
            raise ValueError(f"the mix has {fmt} layers: pass calibration= (model inputs from "
                             "a calibration text, e.g. corpus.calibration_batches(tokenizer))")
    bits = effective_bits(model, formats, per_channel=per_channel)
    full = {**dict.fromkeys(quantizable_linears(model), LayerFormat.BF16), **formats}
    originals = {n: model.get_submodule(n) for n, f in formats.items() if f != LayerFormat.BF16}
    report = MixReport(full, bits)
    try:
        for name in (wanted[LayerFormat.FP8] + wanted[LayerFormat.FP8_W8A16]
                     + wanted[LayerFormat.MXFP4] + wanted[LayerFormat.Q8_0]):
            layer = quantize_layer(originals[name], formats[name], per_channel=per_channel)
            set_layer(model, name, layer)
        for fmt, method in _NVFP4_METHODS:
            if not wanted[fmt]:
                continue
            chosen = set(wanted[fmt])
            ignore = [n for n in _linear_names(model) if n not in chosen]
            rtn = method == QuantMethod.RTN
            with warnings.catch_warnings():  # the RTN layers of this mix stay as they are
                warnings.filterwarnings("ignore", message=r".*are NVFP4Linear already",
                                        category=UserWarning)
                report.nvfp4.append(quantize_model(
                    model, backend=Backend.W4A16, method=method,
                    ignore=[re.compile("^" + re.escape(n) + "$") for n in ignore] or (),
                    calibration=None if rtn else calibration, gptq=None if rtn else gptq))
    except BaseException:  # all or nothing: every layer as it was
        for name, original in originals.items():
            set_layer(model, name, original)
        raise
    return report
