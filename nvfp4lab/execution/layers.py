"""``NVFP4Linear``: a Linear layer holding an NVFP4 weight under compressed-tensors names.

:class:`NVFP4Linear` stores its weight with exactly the tensor names of a compressed-tensors
"nvfp4-pack-quantized" checkpoint, so a checkpoint's per-layer state dict loads with
``load_state_dict``:

=======================  ==========================  ==========================================
name                     dtype / shape               meaning
=======================  ==========================  ==========================================
``weight_packed``        uint8 ``[N, K/2]``          E2M1 codes, element 2i in the low nibble
``weight_scale``         float8_e4m3fn ``[N, K/16]`` block scales, plain row-major layout
``weight_global_scale``  float32 ``[1]``             ENCODE form, 2688/amax(W)
``input_global_scale``   float32 ``[1]`` or None     ENCODE form for the activations;
                                                     None -> computed from each call's input
``bias``                 ``dtype`` ``[N]`` or None   a Parameter, untouched by quantization
``weight_decode_scale``  float32 ``[1]`` or None     optional: the exact DECODE scale (amax/2688,
                                                     ModelOpt's ``weight_scale_2``)
``input_decode_scale``   float32 ``[1]`` or None     optional: the exact DECODE activation scale
                                                     (ModelOpt's ``input_scale``)
=======================  ==========================  ==========================================

The two DECODE buffers exist because the float32 reciprocal does not round-trip: for about 14%
of float32 values ``d``, ``1/(1/d) != d``. A layer that came from a DECODE-form source (a
ModelOpt checkpoint, or ``convention="modelopt"`` quantization) keeps ``d`` itself, so that
saving it back writes ``d`` byte for byte. When ``weight_decode_scale`` is set,
:meth:`NVFP4Linear.weight_nvfp4` carries it (``NVFP4Tensor.decode_scale``) and the weight
decodes as ``value * (scale * d)``, ModelOpt's and vLLM's order for these checkpoints;
``weight_global_scale`` then holds ``1/d`` in float32. ``input_decode_scale`` is only kept for
saving: activations are always quantized with the ENCODE ``input_global_scale`` (vLLM, too,
quantizes them with ``1/input_scale``). Both are None by default and absent from the state dict
then, so compressed-tensors state dicts load as before; a state dict that sets an ENCODE scale
without its DECODE partner drops the stale DECODE buffer.

Rotated layers (``hadamard=seed``, MR-GPTQ style): the buffers hold the NVFP4 weight of ``W Q``,
``Q`` the seeded 16-point block Hadamard of :mod:`nvfp4lab.hadamard` (orthogonal), and forward
rotates its input the same way before the (optional) activation quantization and the GEMM::

    y = (x Q) · dequant(NVFP4(W Q))ᵀ + b        ≈ x Wᵀ + b, as Q Qᵀ = I

``x Q`` is computed in float32 and cast back to the input dtype (:func:`hadamard_transform`).
The rotation is an attribute, not a buffer. A seeded rotation has no checkpoint form
(:func:`nvfp4lab.checkpoint.save_pretrained` refuses it); a
:class:`~nvfp4lab.hadamard.BlockRotation` (compressed-tensors' block transform) is saved as a
compressed-tensors ``transform_config`` and read back
(:mod:`nvfp4lab.checkpoint.formats.transforms`).

``hadamard_block`` (default 16) is the rotation's block: 16/32/64/128 or any divisor of K with a
Hadamard matrix, and None for one full-size rotation of K (:func:`nvfp4lab.hadamard.rotate`;
QuaRot / FP-Quant style online rotations, :mod:`nvfp4lab.execution.w4a4_recipes`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nvfp4lab.codec import quantize
from nvfp4lab.constants import BLOCK_SIZE
from nvfp4lab.execution import rotated_gemm
from nvfp4lab.execution.dispatch import BackendChoice, select_backend
from nvfp4lab.execution.gemm import linear, vllm_dequantize
from nvfp4lab.hadamard import (
    HADAMARD_SIZE,
    BlockRotation,
    check_seed,
    rotate,
    rotation_blocks,
)
from nvfp4lab.options import order_argument
from nvfp4lab.orders import ArithmeticOrder
from nvfp4lab.scales import as_global_scale
from nvfp4lab.tensor import NVFP4Tensor, RotatedNVFP4Tensor, invalid_block_scales
from nvfp4lab.vocab import (
    AUTO,
    SUPPORTED_DTYPES,
    Backend,
    BiasMode,
    check_choice,
    check_dtype,
)

__all__ = ["BlockRotatedNVFP4Tensor", "NVFP4Linear"]


@dataclass(repr=False, eq=False)
class BlockRotatedNVFP4Tensor(RotatedNVFP4Tensor):
    """A :class:`~nvfp4lab.tensor.RotatedNVFP4Tensor` whose rotation block is
    ``rotation_block`` (None: full size) instead of 16: :meth:`dequantize` rotates back with
    :func:`nvfp4lab.hadamard.rotate`."""

    rotation_block: int | None = HADAMARD_SIZE

    def dequantize(
        self, dtype: torch.dtype | None = None, *, fused: bool | None = None
    ) -> torch.Tensor:
        """Decode and rotate back: ``dequantize_rotated() Qᵀ`` (float32), then ``dtype``."""
        rotated = self.dequantize_rotated(torch.float32, fused=fused)
        back = rotate(rotated, self.hadamard, block=self.rotation_block, inverse=True)
        return back.to(dtype or self.dtype)

    def to(self, device: torch.device | str) -> BlockRotatedNVFP4Tensor:
        moved = NVFP4Tensor.to(self, device)
        return BlockRotatedNVFP4Tensor(**{**vars(moved), "hadamard": self.hadamard,
                                          "rotation_block": self.rotation_block})


def _block_rotation_size(in_features: int, rotation: BlockRotation) -> int:
    """The block of a compressed-tensors rotation, checked to divide K (ValueError)."""
    if in_features % rotation.size:
        raise ValueError(f"{rotation!r} rotates blocks of {rotation.size}, which do not divide "
                         f"in_features={in_features}")
    return rotation.size


class NVFP4Linear(nn.Module):
    """A Linear layer with an NVFP4 weight; forward is :func:`nvfp4lab.execution.gemm.linear`.

    ``in_features`` (K) must be a multiple of 16. ``dtype`` is the dtype of the bias and the
    default dtype of :meth:`weight_nvfp4` dequantization; ``forward`` computes in the INPUT's
    dtype (fp32/bf16/fp16), as :func:`~nvfp4lab.execution.gemm.linear` does.

    ``backend``: "auto" resolves :func:`~nvfp4lab.execution.dispatch.select_backend` for the input's
    device at EVERY forward (so the environment variables are read per call); a concrete backend
    pins it ("q8_0" runs llama.cpp's CPU arithmetic). ``bias_mode``: "output" (default) | "fp32"
    | "dropped" (see ``linear``).
    ``input_global_scale`` None means dynamic: computed from each forward's input.

    ``cache_dequantized=True`` keeps the weight as the emulation and w4a16 paths decode it
    (:func:`~nvfp4lab.execution.gemm.vllm_dequantize`), per (dtype, device), rebuilt when a
    weight buffer changes. Memory: N*K*2 bytes for bf16/fp16 (N*K*4 for fp32) per cached dtype,
    i.e. 3.6x (7.1x) the packed weight's 0.5625 B/weight. The cache is not part of the state dict.

    ``hadamard``: None, or the seed of the block Hadamard ``Q`` the weight was rotated by (its
    buffers hold ``W Q``): forward then computes ``(x Q) · dequant(W Q)ᵀ + b`` (module docstring).
    ``hadamard_block``: that rotation's block (16 default; None: full size K).
    ``hadamard`` may also be a :class:`~nvfp4lab.hadamard.BlockRotation` (compressed-tensors'
    transform, which a checkpoint's ``transform_config`` stores; ``hadamard_block`` is then its
    size).
    """

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_global_scale: torch.Tensor
    input_global_scale: torch.Tensor | None
    weight_decode_scale: torch.Tensor | None
    input_decode_scale: torch.Tensor | None
    #: None: nvfp4lab's rotation order; a ``VllmRotationPlan``: forward runs vLLM's rotated path
    #: (:func:`nvfp4lab.execution.rotated_gemm.use_vllm_rotation`; a BlockRotation layer only).
    vllm_rotation: Any = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        backend: str = AUTO,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        cache_dequantized: bool = False,
        bias_mode: str = BiasMode.OUTPUT,
        hadamard: int | None = None,
        hadamard_block: int | None = HADAMARD_SIZE,
    ) -> None:
        super().__init__()
        if isinstance(hadamard, BlockRotation):
            hadamard_block = _block_rotation_size(in_features, hadamard)
        elif hadamard is not None:
            check_seed(hadamard)
            rotation_blocks(in_features, hadamard_block)
        if in_features <= 0 or in_features % BLOCK_SIZE:
            raise ValueError(
                f"NVFP4Linear needs in_features (K) to be a positive multiple of {BLOCK_SIZE}, "
                f"got {in_features}"
            )
        if out_features <= 0:
            raise ValueError(f"out_features must be positive, got {out_features}")
        check_dtype(dtype, "NVFP4Linear dtype")
        check_choice("backend", backend, Backend, extra=(AUTO,))
        check_choice("bias_mode", bias_mode, BiasMode)
        self.in_features = in_features
        self.out_features = out_features
        self.backend = backend
        self.bias_mode = bias_mode
        self.dtype = dtype
        self.cache_dequantized = cache_dequantized
        self.hadamard = hadamard
        self.hadamard_block = hadamard_block
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
        self.register_buffer("weight_decode_scale", None)
        self.register_buffer("input_decode_scale", None)
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
        backend: str = AUTO,
        cache_dequantized: bool = False,
        bias_mode: str = BiasMode.OUTPUT,
    ) -> NVFP4Linear:
        """Wrap an NVFP4Tensor ``[N, K]`` (K a multiple of 16, unpadded) and an optional bias.

        The layer's dtype is the bias dtype, else the weight's original dtype. A weight that
        carries its exact DECODE scale (``weight.decode_scale``) keeps it
        (``weight_decode_scale``). A :class:`~nvfp4lab.tensor.RotatedNVFP4Tensor` (codes of
        ``W Q``) gives a rotated layer (``hadamard`` = its seed) that rotates its inputs.
        """
        if not isinstance(weight, NVFP4Tensor):
            raise TypeError(f"weight must be an NVFP4Tensor, got {type(weight).__name__}")
        rotated = isinstance(weight, RotatedNVFP4Tensor)
        if weight.transform is not None and not rotated:
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
        if dtype not in SUPPORTED_DTYPES:
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
            hadamard=weight.hadamard if isinstance(weight, RotatedNVFP4Tensor) else None,
            hadamard_block=getattr(weight, "rotation_block", HADAMARD_SIZE),
        )
        with torch.no_grad():
            layer.weight_packed.copy_(weight.packed)
            layer.weight_scale.copy_(weight.scales)
            layer.weight_global_scale.copy_(weight.global_scale)
            if weight.decode_scale is not None:
                layer.weight_decode_scale = weight.decode_scale.detach().reshape(1).clone()
            if bias is not None and layer.bias is not None:
                layer.bias.copy_(bias.detach())
        layer.set_input_global_scale(input_global_scale)
        return layer

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        backend: str = AUTO,
        input_global_scale: torch.Tensor | float | None = None,
        weight_global_scale: torch.Tensor | float | None = None,
        order: str | ArithmeticOrder | None = None,
        cache_dequantized: bool = False,
        bias_mode: str = BiasMode.OUTPUT,
        hadamard: int | None = None,
        convention: str | ArithmeticOrder | None = None,
    ) -> NVFP4Linear:
        """Quantize an ``nn.Linear`` (weight ``[N, K]``, K a multiple of 16).

        ``weight_global_scale`` (ENCODE form) defaults to ``2688/amax(W)``
        (``2688/amax(W Q)`` when rotated); ``order`` (old keyword: ``convention``) is the
        quantization arithmetic order.
        ``hadamard=seed``: quantize ``W Q`` (:func:`nvfp4lab.quantize` with ``hadamard``, the
        rotation in the weight's dtype) into a rotated layer.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        check_dtype(w.dtype, "the Linear's weight (dtype)")
        if w.shape[1] % BLOCK_SIZE:
            raise ValueError(
                f"in_features={w.shape[1]} is not a multiple of {BLOCK_SIZE}: cannot quantize to "
                "NVFP4 (leave this layer unquantized)"
            )
        if hadamard is not None:
            check_seed(hadamard)
        q = quantize(w, weight_global_scale, order=order_argument(order, convention),
                     hadamard=hadamard)
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
        """The weight as an :class:`NVFP4Tensor` sharing this layer's buffers (no copy); a
        :class:`~nvfp4lab.tensor.RotatedNVFP4Tensor` for a rotated layer (its ``dequantize``
        rotates back to an approximation of W)."""
        plain = self._gemm_weight()
        if self.hadamard is None:
            return plain
        if self.hadamard_block != HADAMARD_SIZE:
            return BlockRotatedNVFP4Tensor(**vars(plain), hadamard=self.hadamard,
                                           rotation_block=self.hadamard_block)
        return RotatedNVFP4Tensor(**vars(plain), hadamard=self.hadamard)

    def _gemm_weight(self) -> NVFP4Tensor:
        """The buffers as a plain NVFP4Tensor: W, or ``W Q`` of a rotated layer, the operand its
        GEMM multiplies the (rotated) input with."""
        return NVFP4Tensor(
            packed=self.weight_packed,
            scales=self.weight_scale,
            global_scale=self.weight_global_scale,
            shape=torch.Size((self.out_features, self.in_features)),
            dtype=self.dtype,
            check_scales=False,  # checked when set: from_quantized and load_state_dict
            decode_scale=self.weight_decode_scale,
        )

    def set_rotation(self, rotation: BlockRotation) -> None:
        """Declare that the buffers hold ``W R`` for the compressed-tensors rotation ``rotation``
        (as a checkpoint's ``transform_config`` says): forward then rotates its inputs by ``R``."""
        if not isinstance(rotation, BlockRotation):
            raise TypeError(f"rotation must be a BlockRotation, got {type(rotation).__name__}")
        self.hadamard_block = _block_rotation_size(self.in_features, rotation)
        self.hadamard = rotation
        self._dq_cache.clear()

    def rotate_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` as the GEMM takes it: ``x Q`` (float32 arithmetic, ``x.dtype`` out) for a
        rotated layer, else ``x`` itself."""
        if self.hadamard is None:
            return x
        return rotate(x, self.hadamard, block=self.hadamard_block)

    def set_input_global_scale(self, value: torch.Tensor | float | None) -> None:
        """Set the ENCODE-form activation scale (2688/amax); None -> dynamic per call.

        Clears ``input_decode_scale`` (it would no longer describe this scale)."""
        self.input_decode_scale = None
        if value is None:
            self.input_global_scale = None
            return
        self.input_global_scale = as_global_scale(value, self.weight_packed.device).clone()

    def set_input_decode_scale(self, value: torch.Tensor | float) -> None:
        """Set the activation scale from its exact DECODE value ``d`` (amax/2688, ModelOpt's
        ``input_scale``): ``input_global_scale = 1/d`` in float32, and ``d`` is kept as
        ``input_decode_scale`` so that a ModelOpt save writes it back unchanged."""
        d = as_global_scale(value, self.weight_packed.device).clone()
        self.input_global_scale = torch.reciprocal(d)
        self.input_decode_scale = d

    def backend_choice(self, device: torch.device | str | None = None, *,
                       env: Mapping[str, str] | None = None) -> BackendChoice | None:
        """The selection "auto" makes for ``device`` (default: the buffers' device) now.

        None when the layer was built with a concrete backend.
        """
        if self.backend != AUTO:
            return None
        return select_backend(device if device is not None else self.weight_packed.device, env=env)

    def _resolve_backend(self, x: torch.Tensor) -> str:
        if self._calibrating:
            return Backend.W4A16  # observe unquantized activations while calibrating
        if self.backend == AUTO:
            return select_backend(x.device).name
        return self.backend

    def clear_dequantized_cache(self) -> None:
        """Free the dequantized weights kept by ``cache_dequantized=True`` (rebuilt on use)."""
        self._dq_cache.clear()

    def _cached_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        if not self.cache_dequantized:
            return None
        bufs = (self.weight_packed, self.weight_scale, self.weight_global_scale)
        key = (dtype, self.weight_packed.device, *((b.data_ptr(), b._version) for b in bufs))
        if self.weight_decode_scale is not None:
            key += (self.weight_decode_scale.data_ptr(), self.weight_decode_scale._version)
        cached = self._dq_cache.get(key)
        if cached is None:
            self._dq_cache.clear()
            cached = vllm_dequantize(self._gemm_weight(), dtype)
            self._dq_cache[key] = cached
        return cached

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` (fp32/bf16/fp16) -> ``[..., N]`` in ``x.dtype`` (a rotated layer
        multiplies ``x Q``)."""
        if self.vllm_rotation is not None and not self._calibrating:
            return rotated_gemm.layer_forward(self, x)
        backend = self._resolve_backend(x)
        decodes = backend in (Backend.EMULATION, Backend.W4A16)  # native / q8_0 keep the codes
        w_dq = self._cached_weight(x.dtype) if decodes else None
        return linear(
            self.rotate_input(x),
            self._gemm_weight(),
            self.bias,
            input_global_scale=self.input_global_scale,
            backend=backend,
            bias_mode=self.bias_mode,
            dequantized_weight=w_dq,
        )

    def extra_repr(self) -> str:
        if self.backend == AUTO:
            try:
                choice = self.backend_choice()
                backend = f"auto → {choice.name} ({choice.reason})" if choice else AUTO
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
        rotation = "" if self.hadamard is None else f", hadamard={self.hadamard}"
        if self.hadamard is not None and self.hadamard_block != HADAMARD_SIZE:
            rotation += f", hadamard_block={self.hadamard_block or 'full'}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, dtype={self.dtype}, input_global_scale={act}, "
            f"bias_mode={self.bias_mode}, backend={backend}{rotation}"
        )

    # -- dtype/device moves ----------------------------------------------------------------------

    _QUANTIZED_BUFFERS: tuple[str, ...] = (
        "weight_packed",
        "weight_scale",
        "weight_global_scale",
        "input_global_scale",
        "weight_decode_scale",
        "input_decode_scale",
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
        if new_dtype in SUPPORTED_DTYPES:
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
        """Accept an ``input_global_scale`` when the layer is dynamic (None). Otherwise every key
        behaves like any buffer's: a calibrated ``input_global_scale`` absent from
        ``state_dict`` is kept and listed in ``missing_keys`` (use
        :meth:`set_input_global_scale(None) <set_input_global_scale>` to make a layer dynamic).

        The optional DECODE buffers follow their ENCODE partner: one present in ``state_dict`` is
        accepted; one absent while its partner is present is dropped (set to None), so a
        compressed-tensors state dict never leaves a stale DECODE scale behind."""
        for decode, encode in (
            ("weight_decode_scale", "weight_global_scale"),
            ("input_decode_scale", "input_global_scale"),
            ("input_global_scale", None),
        ):
            if prefix + decode in state_dict and getattr(self, decode) is None:
                setattr(self, decode, torch.ones(
                    1, dtype=torch.float32, device=self.weight_packed.device
                ))
            elif encode is not None and prefix + decode not in state_dict and (
                prefix + encode in state_dict
            ):
                setattr(self, decode, None)
        self._dq_cache.clear()
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if not self.weight_scale.is_meta:
            nan, negative, first = invalid_block_scales(self.weight_scale)
            if first is not None:
                error_msgs.append(
                    f"{prefix}weight_scale holds {nan} NaN and {negative} negative E4M3 block "
                    f"scale(s) (first at {first}); NVFP4 block scales are finite and non-negative"
                )
