"""The format interface, and block formats described as data.

Every format object has ``name``, ``bits_per_element`` (storage bits per element INCLUDING block
and group scales, per-tensor scales excluded; :meth:`QuantFormat.storage_bits` adds those for a
given shape), ``description``, ``options`` (accepted keyword options and their defaults) and
``fake_quantize(x, **options)`` (same shape and dtype as ``x``), ``quantize(x, **options)`` (a
packed form with ``.dequantize(dtype)`` and ``.nbytes``) and ``dequantize(q, dtype=None)``.
Unknown option names raise ValueError listing the accepted ones.

A scaled block format is data (as graphcore's gfloat ``BlockFormatInfo``): an
:class:`ElementFormat` (how a scaled value becomes a 4-bit code and back), a
:class:`ScaleFormat` (how a block's max becomes a stored scale, and the scale's value) and a
block size along K. :class:`BlockFormat` runs any such triple:

    s = value(encode_scale(amax_block))          (float32)
    code = encode_element(x / s)                 (0 where s == 0)
    x_hat = decode_element(code) * s             (float32, then the wanted dtype)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from nvfp4lab.e2m1 import pack_fp4, unpack_fp4
from nvfp4lab.inputs import check_input, finite_amax, split_blocks
from nvfp4lab.scales import abs_max
from nvfp4lab.vocab import NonFinite

__all__ = [
    "BlockFormat",
    "BlockFormatInfo",
    "ElementFormat",
    "PackedBlocks",
    "QuantFormat",
    "ScaleFormat",
    "checked_input",
]


def checked_input(x: torch.Tensor, name: str, nonfinite: str = NonFinite.RAISE) -> None:
    """The codec's input check for a comparator format (NaN/Inf refused unless propagated)."""
    check_input(x)
    if nonfinite == NonFinite.RAISE:
        finite_amax(x, fix=f"clean the input ({name} has no NaN/Inf policy)")


class QuantFormat:
    """Base class of a number format; subclasses implement ``_fake``, ``_quantize``, ``_bits``."""

    name: str = ""
    bits_per_element: float = 0.0
    description: str = ""
    #: accepted keyword options and their defaults
    options: Mapping[str, Any] = MappingProxyType({})

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """Options merged over the defaults; ValueError for unknown names (listing accepted)."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            accepted = ", ".join(self.options) or "(none)"
            raise ValueError(
                f"unknown option(s) {', '.join(unknown)} for format {self.name!r}; accepted "
                f"options: {accepted}"
            )
        return {**self.options, **options}

    def fake_quantize(self, x: torch.Tensor, **options: Any) -> torch.Tensor:
        """Quantize-dequantize ``x`` (fp32/bf16/fp16 ``[..., K]``); returns x's shape and dtype."""
        return self._fake(x, self.check_options(options))

    def quantize(self, x: torch.Tensor, **options: Any) -> Any:
        """The packed form of ``x`` (a container with ``.dequantize(dtype)``)."""
        return self._quantize(x, self.check_options(options))

    def dequantize(self, q: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Decode a packed form made by :meth:`quantize` (default dtype: the input's)."""
        return q.dequantize(dtype)

    def storage_bits(self, shape: torch.Size | tuple[int, ...], **options: Any) -> float:
        """Average storage bits per element of a tensor of ``shape``, every scale included."""
        numel = 1
        for d in shape:
            numel *= int(d)
        if numel <= 0:
            raise ValueError(f"storage_bits needs a non-empty shape, got {tuple(shape)}")
        return self._bits(tuple(int(d) for d in shape), numel, self.check_options(options))

    def _fake(self, x: torch.Tensor, opts: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def _quantize(self, x: torch.Tensor, opts: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _bits(self, shape: tuple[int, ...], numel: int, opts: dict[str, Any]) -> float:
        return self.bits_per_element

    def __repr__(self) -> str:
        return f"<format {self.name}: {self.bits_per_element:g} bits/element — {self.description}>"


# --------------------------------------------------------------------------------------------
# block formats as data
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ElementFormat:
    """A 4-bit element: ``encode`` float32 values (already divided by the block scale) to uint8
    codes 0..15, ``decode`` codes to float32. ``max_value``: largest magnitude;
    ``max_exponent``: its binary exponent (``floor(log2 max)``, for power-of-two scales)."""

    name: str
    bits: int
    max_value: float
    max_exponent: int
    encode: Callable[[torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ScaleFormat:
    """A block scale: ``encode(amax, element)`` maps float32 block maxima ``[..., nb]`` to the
    stored scales; ``value(stored)`` gives their float32 multipliers."""

    name: str
    bits: int
    encode: Callable[[torch.Tensor, ElementFormat], torch.Tensor]
    value: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BlockFormatInfo:
    """A scaled block format: element, scale and elements per scale along K."""

    name: str
    element: ElementFormat
    scale: ScaleFormat
    block_size: int
    description: str

    @property
    def bits_per_element(self) -> float:
        return self.element.bits + self.scale.bits / self.block_size


def _flatten_groups(t: torch.Tensor) -> torch.Tensor:
    """``[..., nG, G]`` → ``[..., nG·G]`` (also for empty tensors)."""
    return t.reshape(*t.shape[:-2], t.shape[-2] * t.shape[-1])


def _ungroup(values: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return _flatten_groups(values)[..., : shape[-1]].to(dtype)


@dataclass
class PackedBlocks:
    """A packed block-format tensor: 4-bit codes two per byte (``packed`` uint8 ``[..., Kp/2]``,
    low nibble first), one stored scale per block (``scales [..., Kp/block]``, the scale
    format's storage dtype), the original ``shape`` and ``dtype``, and the ``info`` to decode."""

    packed: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    info: BlockFormatInfo = field(repr=False)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        codes = unpack_fp4(self.packed)
        codes = codes.reshape(*codes.shape[:-1], self.scales.shape[-1], self.info.block_size)
        s = self.info.scale.value(self.scales).unsqueeze(-1)
        return _ungroup(self.info.element.decode(codes) * s, self.shape, dtype or self.dtype)


class BlockFormat(QuantFormat):
    """Any :class:`BlockFormatInfo`, with one option ``pad`` (zero-pad K to whole blocks)."""

    options: Mapping[str, Any] = MappingProxyType({"pad": False})

    def __init__(self, info: BlockFormatInfo) -> None:
        self.info = info
        self.name = info.name
        self.bits_per_element = info.bits_per_element
        self.description = info.description

    def _encode(self, x: torch.Tensor, opts: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes uint8 ``[..., nb, B]``, stored scales ``[..., nb]``)."""
        checked_input(x, self.name)
        blocks = split_blocks(x, self.info.block_size, opts["pad"], self.name).to(torch.float32)
        stored = self.info.scale.encode(abs_max(blocks, -1), self.info.element)
        s = self.info.scale.value(stored).unsqueeze(-1)
        scaled = torch.where(s > 0, blocks / torch.where(s > 0, s, 1.0), 0.0)
        return self.info.element.encode(scaled), stored

    def _fake(self, x: torch.Tensor, opts: dict[str, Any]) -> torch.Tensor:
        codes, stored = self._encode(x, opts)
        values = self.info.element.decode(codes) * self.info.scale.value(stored).unsqueeze(-1)
        return _ungroup(values, x.shape, x.dtype)

    def _quantize(self, x: torch.Tensor, opts: dict[str, Any]) -> PackedBlocks:
        codes, stored = self._encode(x, opts)
        return PackedBlocks(pack_fp4(_flatten_groups(codes)), stored, x.shape, x.dtype, self.info)
