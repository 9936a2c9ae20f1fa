"""The :class:`NVFP4Tensor` container and its decode (dequantization) arithmetic.

Conventions
-----------
* ``packed``: uint8 ``[..., Kp/2]``, two E2M1 codes per byte, element ``2i`` in the low nibble.
* ``scales``: ``torch.float8_e4m3fn`` ``[..., Kp/block]``, plain row-major layout (as on disk).
* ``global_scale``: float32 ``[1]`` in the ENCODE form, ``2688 / amax`` (what
  compressed-tensors stores as ``weight_global_scale`` / ``input_global_scale``). The DECODE
  convention (torchao ``per_tensor_scale``, ModelOpt ``weight_scale_2``) is its reciprocal.
* ``shape``: the original shape; its last dim ``K`` may be smaller than ``Kp`` when the input was
  zero-padded to a whole number of blocks (``pad=True``).
* Decoding: ``x_hat = value(code) * (scale / global_scale)`` in float32, then cast to ``dtype``.
  With 16-element blocks on a CPU/CUDA tensor it may run the fused kernel of
  :mod:`nvfp4lab.kernels` (``fused=``; bit for bit the same values).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from nvfp4lab.constants import BLOCK_SIZE, GLOBAL_SCALE_NUMERATOR
from nvfp4lab.e2m1 import decode_e2m1, unpack_fp4
from nvfp4lab.hadamard import hadamard_transform
from nvfp4lab.kernels import fused_route
from nvfp4lab.kernels.linear import decode as kernel_decode
from nvfp4lab.layout import swizzle_scales
from nvfp4lab.orders import DecodeRule
from nvfp4lab.scales import as_global_scale

__all__ = [
    "NVFP4Tensor",
    "RotatedNVFP4Tensor",
    "block_chunks",
    "block_decode_factor",
    "decode_blocks",
    "invalid_block_scales",
]

#: On the CPU, elementwise passes over ~2**18 elements at a time stay in cache: about 2x faster
#: than whole-tensor passes, and no full-size float32 temporaries. Other devices take one chunk.
CPU_CHUNK_ELEMENTS = 1 << 18


def block_chunks(blocks: int, block_size: int, device: torch.device) -> Iterator[slice]:
    """Slices over ``blocks`` flattened blocks of ``block_size`` elements, one per work chunk."""
    per = max(1, CPU_CHUNK_ELEMENTS // max(block_size, 1)) if device.type == "cpu" else blocks
    for start in range(0, blocks, max(per, 1)):
        yield slice(start, min(start + per, blocks))


def block_decode_factor(
    scales: torch.Tensor, global_scale: torch.Tensor, decode_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 ``[..., nb]`` factor each block's E2M1 values are multiplied by:
    ``scale / global_scale``, or ``scale * decode_scale`` when the exact DECODE scale is given
    (arguments as in :func:`decode_blocks`)."""
    if decode_scale is None:
        return scales.to(torch.float32) / global_scale
    return scales.to(torch.float32) * decode_scale


def decode_blocks(
    codes: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    decode_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 ``value(code) * (scale / global_scale)``, or ``value(code) * (scale *
    decode_scale)`` when the exact DECODE scale is given (ModelOpt's and vLLM's decode order).

    ``codes``: uint8 ``[..., nb, block]``; ``scales``: ``[..., nb]`` (any float dtype holding the
    E4M3 values); ``global_scale``: float32 ``[1]`` (encode form). Returns float32 of the
    shape of ``codes``.
    """
    block_factor = block_decode_factor(scales, global_scale, decode_scale)
    values = decode_e2m1(codes, torch.float32)
    values *= block_factor.unsqueeze(-1)
    return values


def invalid_block_scales(scales: torch.Tensor) -> tuple[int, int, tuple[int, ...] | None]:
    """(NaN count, negative count, index of the first invalid one or None) of E4M3 block scales.

    NVFP4 block scales are unsigned in hardware (UE4M3): a NaN code (0x7F/0xFF) or a set sign
    bit on a nonzero magnitude is corrupt data (``-0.0`` is accepted as zero).
    """
    raw = scales.view(torch.uint8)
    nan = (raw & 0x7F) == 0x7F
    negative = (raw & 0x80).bool() & ((raw & 0x7F) != 0)
    bad = nan | negative
    if not bool(bad.any()):
        return 0, 0, None
    first = tuple(int(i) for i in torch.nonzero(bad)[0])
    return int(nan.sum()), int(negative.sum()), first


@dataclass
class NVFP4Tensor:
    """An NVFP4-quantized tensor: packed E2M1 codes, E4M3 block scales, FP32 global scale.

    Construct it with :func:`nvfp4lab.quantize`, or from checkpoint tensors with keyword
    arguments ``packed=, scales=, global_scale=`` (``shape`` defaults to ``[..., 2 * Kp/2]``,
    ``dtype`` to float32, ``block_size`` to 16, the NVFP4 value; shapes must agree with it).
    ``decode_scale``: the exact DECODE tensor scale (amax/2688) when the producer stored one
    (ModelOpt's ``weight_scale_2``, or a ``convention="modelopt"`` quantization); decoding then
    multiplies by it, as ModelOpt and vLLM do, and ``global_scale`` is its float32 reciprocal.
    See the module docstring for the layout and scale forms. NaN or negative block scales
    are refused (:func:`invalid_block_scales`) unless ``check_scales=False``, the opt-out for
    studying broken data. Two NVFP4Tensors are ``==`` when their bytes, global scale, shape, dtype
    and block size are identical.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    shape: torch.Size | None = None
    dtype: torch.dtype = field(default=torch.float32)
    block_size: int = BLOCK_SIZE
    check_scales: bool = field(default=True, compare=False, repr=False)
    decode_scale: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.packed, torch.Tensor) or self.packed.dtype != torch.uint8:
            raise ValueError(
                f"NVFP4Tensor.packed must be a uint8 tensor, got "
                f"{getattr(self.packed, 'dtype', type(self.packed))}"
            )
        if not isinstance(self.scales, torch.Tensor) or self.scales.dtype != torch.float8_e4m3fn:
            hint = (
                " (raw bytes: use scales.view(torch.float8_e4m3fn))"
                if getattr(self.scales, "dtype", None) == torch.uint8
                else ""
            )
            raise ValueError(
                "NVFP4Tensor.scales must be a torch.float8_e4m3fn tensor, got "
                f"{getattr(self.scales, 'dtype', type(self.scales))}{hint}"
            )
        self.global_scale = as_global_scale(self.global_scale, self.packed.device)
        if self.decode_scale is not None:
            self.decode_scale = as_global_scale(self.decode_scale, self.packed.device)
        packed, scales = self.packed, self.scales
        if packed.ndim == 0 or scales.ndim != packed.ndim or packed.shape[:-1] != scales.shape[:-1]:
            raise ValueError(
                f"NVFP4Tensor shapes do not match: packed {tuple(packed.shape)} must be [..., K/2] "
                f"and scales {tuple(scales.shape)} [..., K/block] with the same leading dims"
            )
        if packed.device != scales.device:
            raise ValueError(
                f"NVFP4Tensor fields live on different devices: packed on {packed.device}, "
                f"scales on {scales.device}"
            )
        block = self.block_size
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % 2:
            raise ValueError(f"NVFP4Tensor.block_size must be a positive even int, got {block!r}")
        padded_k = 2 * packed.shape[-1]
        if padded_k != scales.shape[-1] * block:
            raise ValueError(
                f"NVFP4Tensor shapes do not match: packed {tuple(packed.shape)} holds {padded_k} "
                f"codes per row but scales {tuple(scales.shape)} cover {scales.shape[-1]} blocks "
                f"of {block} = {scales.shape[-1] * block}; packed must be [..., K/2] (two codes "
                "per byte) and scales [..., K/16]"
            )
        shape = torch.Size(self.shape) if self.shape is not None else torch.Size(
            (*packed.shape[:-1], padded_k)
        )
        if (
            len(shape) != packed.ndim
            or shape[:-1] != packed.shape[:-1]
            or not (padded_k - block < shape[-1] <= padded_k or shape[-1] == padded_k == 0)
        ):
            raise ValueError(
                f"NVFP4Tensor.shape {tuple(shape)} does not fit packed {tuple(packed.shape)}: "
                f"leading dims must match and K must be within one block ({block}) of {padded_k}"
            )
        self.shape = shape
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"NVFP4Tensor.dtype must be a floating torch.dtype, got {self.dtype}")
        if self.check_scales and not scales.is_meta:
            self._refuse_invalid_scales()

    def _refuse_invalid_scales(self) -> None:
        nan, negative, first = invalid_block_scales(self.scales)
        if first is not None:
            byte = int(self.scales.view(torch.uint8)[first])
            raise ValueError(
                f"NVFP4Tensor.scales holds {nan} NaN and {negative} negative E4M3 block scale(s) "
                f"(first at index {first}, byte 0x{byte:02x}); NVFP4 block scales are finite and "
                "non-negative. Pass check_scales=False to study such data anyway"
            )

    def __eq__(self, other: object) -> bool:
        """Exact equality: same bytes, global scale, shape, dtype, block size (and type)."""
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, NVFP4Tensor)
        return (
            self.shape == other.shape
            and self.dtype == other.dtype
            and self.block_size == other.block_size
            and self.packed.shape == other.packed.shape
            and self.scales.shape == other.scales.shape
            and torch.equal(self.packed, other.packed)
            and torch.equal(self.scales.view(torch.uint8), other.scales.view(torch.uint8))
            and torch.equal(self.global_scale, other.global_scale.to(self.global_scale.device))
            and (self.decode_scale is None) == (other.decode_scale is None)
            and (self.decode_scale is None or torch.equal(self.decode_scale, other.decode_scale))
            and vars(self).get("hadamard") == vars(other).get("hadamard")
        )

    __hash__ = None  # type: ignore[assignment]  # mutable tensors: not hashable

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def transform(self) -> str | None:
        """None for a plain NVFP4 tensor; a description when the codes encode a transformed
        tensor (e.g. Hadamard-rotated, :class:`RotatedNVFP4Tensor`) that a GEMM
        or a checkpoint must not consume as the original weight."""
        return None

    @property
    def nbytes(self) -> int:
        """Storage bytes of packed codes, block scales and the global scale."""
        return self.packed.nbytes + self.scales.nbytes + self.global_scale.nbytes

    @property
    def amax(self) -> float:
        """The amax implied by the global scale, ``2688 / global_scale``."""
        return GLOBAL_SCALE_NUMERATOR / float(self.global_scale)

    def codes(self) -> torch.Tensor:
        """E2M1 codes uint8 ``[..., Kp]`` (padding included)."""
        return unpack_fp4(self.packed)

    def dequantize(
        self, dtype: torch.dtype | None = None, *, fused: bool | None = None
    ) -> torch.Tensor:
        """Decode to ``dtype`` (default: the original dtype); returns a tensor of ``self.shape``.

        ``fused``: True/False forces the fused kernel on or off for this call (when it applies:
        16-element blocks, fp32/bf16/fp16 output, CPU or CUDA); None follows ``NVFP4LAB_FUSED``.
        On a CPU where the C++ LUT decode is built (:mod:`nvfp4lab.kernels.lut_decode`) the fused
        kernel is that one, from the first call under ``auto``; elsewhere the compiled graph.
        All three paths give the same bits.
        """
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dequantize needs a floating dtype, got {dtype}")
        if self.device.type == "meta":  # no data: the shape and dtype of the result only
            return torch.empty(self.shape, dtype=dtype or self.dtype, device="meta")
        out_dtype = dtype or self.dtype
        numel = 2 * self.packed.numel()
        if fused_route(numel, 2 * self.packed.shape[-1], out_dtype, self.device, fused,
                       block_size=self.block_size, native=True):
            over = self.decode_scale is None
            out = kernel_decode(  # the C++ LUT kernel on a CPU that has it, else the graph
                self.packed, self.scales, self.global_scale if over else self.decode_scale,
                out_dtype,
                rule=DecodeRule.SCALE_OVER_ENCODE if over else DecodeRule.SCALE_TIMES_DECODE,
            )
            return out if out.shape[-1] == self.shape[-1] else out[..., : self.shape[-1]]
        half = self.block_size // 2
        packed = self.packed.reshape(-1, half)  # one row of bytes per block
        scales = self.scales.reshape(-1)
        out = torch.empty(
            (packed.shape[0], self.block_size), dtype=dtype or self.dtype, device=self.device
        )
        for part in block_chunks(packed.shape[0], self.block_size, self.device):
            values = decode_blocks(
                unpack_fp4(packed[part]), scales[part], self.global_scale, self.decode_scale
            )
            out[part] = values
        out = out.reshape(*self.packed.shape[:-1], 2 * self.packed.shape[-1])
        return out if out.shape[-1] == self.shape[-1] else out[..., : self.shape[-1]]

    def swizzled_scales(self) -> torch.Tensor:
        """Block scales in the 128x4 blocked layout (2-D, leading dims flattened into rows)."""
        return swizzle_scales(self.scales.reshape(-1, self.scales.shape[-1]))

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        """A copy on ``device`` (a no-op copy of references when already there).

        ``.to`` moves an NVFP4Tensor between devices; for values in a float dtype use
        :meth:`dequantize` (``q.dequantize(torch.float16)``).
        """
        if isinstance(device, torch.dtype):
            raise TypeError(
                f"NVFP4Tensor.to moves the tensor between devices; it does not convert it to "
                f"{device}. For {device} values use q.dequantize({device})"
            )
        return NVFP4Tensor(
            packed=self.packed.to(device),
            scales=self.scales.to(device),
            global_scale=self.global_scale.to(device),
            shape=self.shape,
            dtype=self.dtype,
            block_size=self.block_size,
            check_scales=False,  # checked (or deliberately not) when this one was built
            decode_scale=None if self.decode_scale is None else self.decode_scale.to(device),
        )

    def __repr__(self) -> str:
        gs = "meta" if self.device.type == "meta" else f"{float(self.global_scale):.6g}"
        return (
            f"NVFP4Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"block_size={self.block_size}, global_scale={gs}, device={self.device}, "
            f"nbytes={self.nbytes})"
        )


@dataclass(repr=False, eq=False)
class RotatedNVFP4Tensor(NVFP4Tensor):
    """NVFP4 codes and scales of the Hadamard-rotated tensor ``x Q`` (``hadamard`` = the seed).

    :meth:`dequantize` undoes the rotation (it returns an approximation of ``x``);
    :meth:`dequantize_rotated` returns ``x Q`` itself, what a GEMM whose other operand was rotated
    with the same seed consumes (:func:`nvfp4lab.hadamard.rotate_gemm_operands`). ``linear``
    refuses it (its :attr:`transform` is set: it would use ``x Q`` as ``x``);
    ``NVFP4Linear.from_quantized`` makes it a rotated layer, which rotates its inputs too.
    """

    hadamard: int = 0

    @property
    def transform(self) -> str | None:
        return f"Hadamard-rotated along K (seed {self.hadamard})"

    def dequantize_rotated(
        self, dtype: torch.dtype | None = None, *, fused: bool | None = None
    ) -> torch.Tensor:
        """Decode the rotated tensor ``x Q`` as stored."""
        return super().dequantize(dtype, fused=fused)

    def dequantize(
        self, dtype: torch.dtype | None = None, *, fused: bool | None = None
    ) -> torch.Tensor:
        """Decode and rotate back: ``dequantize_rotated() Q^T`` (in float32), then ``dtype``."""
        rotated = super().dequantize(torch.float32, fused=fused)
        back = hadamard_transform(rotated, self.hadamard, inverse=True)
        return back.to(dtype or self.dtype)

    def to(self, device: torch.device | str) -> RotatedNVFP4Tensor:
        moved = super().to(device)
        return RotatedNVFP4Tensor(**{**vars(moved), "hadamard": self.hadamard})

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", hadamard={self.hadamard})"
