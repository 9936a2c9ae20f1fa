"""One interface for NVFP4 and its comparator formats: ``formats.get(name)``, ``available()``.

Every format object has ``name``, ``bits_per_element`` (storage bits per element INCLUDING block
and group scales, per-tensor scales excluded; :meth:`QuantFormat.storage_bits` adds those for a
given shape), ``options`` (accepted keyword options and defaults) and
``fake_quantize(x, **options) -> Tensor`` (same shape and dtype as ``x``); all of them also have
``quantize(x, **options)`` / ``dequantize(q, dtype=None)`` with a packed form.
Unknown format or option names raise ValueError listing the accepted ones.

==============  ======  ==========================================================================
name            bits    definition
==============  ======  ==========================================================================
``nvfp4``       4.5     E2M1, E4M3 scale per 16 along K, FP32 tensor scale; research options in
                        :mod:`nvfp4lab.variants` (both conventions of :mod:`nvfp4lab.quantize`)
``mxfp4``       4.25    OCP MX: E2M1, block 32 along K, E8M0 scale
                        ``2^(floor(log2 amax) - 2)`` (OCP floor rule: values in (6, 8)·scale clip
                        to 6), no tensor scale
``int4_g128``   4.125   symmetric INT4, group 128 along K, fp16 scale ``amax/7`` (computed in
                        fp32, rounded to fp16), ``q = clamp(round_half_even(x/s), -7, 7)``: the
                        code -8 is never produced, so the grid is symmetric
``fp8_e4m3``    8       ``e4m3(clamp(x/s, ±448))``, ``s = amax/448`` in fp32, per tensor (default)
                        or per channel (``granularity="channel"``: one scale per row of
                        ``[..., K]``, i.e. per output channel of a ``[N, K]`` weight)
``bf16``        16      identity after a round-to-nearest-even cast to bfloat16
==============  ======  ==========================================================================

Measured NMSE on a seeded 2048×2048 float32 N(0,1) tensor (tests/test_formats.py checks these):
nvfp4 9.04e-3 (20.44 dB), mxfp4 1.323e-2 (18.78 dB), int4_g128 1.378e-2, fp8_e4m3 7.00e-4,
bf16 2.76e-6. On Student-t(ν=3) (same size, :func:`nvfp4lab.format_study.sample`) the ranking
changes: nvfp4 8.22e-3 (slightly BETTER than on N(0,1)), mxfp4 2.00e-2, int4_g128 5.05e-2,
fp8_e4m3 6.98e-4 (per channel 6.27e-4, now ahead of per tensor). INT4-g128 loses 3.7× because one
outlier stretches its uniform grid over 128 values; MXFP4's power-of-two scale over 32 values
loses 1.5×; NVFP4's small blocks with a fine E4M3 scale map each block max onto the grid's top,
and the NMSE of heavy-tailed data is dominated by those large values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from nvfp4lab import variants
from nvfp4lab.constants import E2M1_MAX, E4M3_MAX
from nvfp4lab.e2m1 import decode_e2m1, pack_fp4, round_to_e2m1_codes, unpack_fp4
from nvfp4lab.quantize import abs_max, split_blocks
from nvfp4lab.tensor import NVFP4Tensor

__all__ = [
    "BF16Format",
    "BF16Tensor",
    "FP8E4M3Format",
    "FP8Tensor",
    "Int4GroupFormat",
    "Int4Tensor",
    "MXFP4Format",
    "MXFP4Tensor",
    "NVFP4Format",
    "QuantFormat",
    "available",
    "get",
    "register",
]

#: OCP MX block size and E8M0 exponent bias / range.
MX_BLOCK_SIZE: int = 32
E8M0_BIAS: int = 127
#: E2M1's largest exponent (6 = 1.5 · 2^2): the OCP scale is 2^(floor(log2 amax) - 2).
E2M1_EMAX: int = 2
INT4_GROUP_SIZE: int = 128
INT4_QMAX: int = 7
FP8_GRANULARITIES: tuple[str, ...] = ("tensor", "channel")
_FP16_MAX = torch.finfo(torch.float16).max


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


def _grouped(x: torch.Tensor, group: int, pad: bool, what: str) -> torch.Tensor:
    """float32 ``[..., K/group, group]`` view of ``x`` (zero-padding K when ``pad``)."""
    return split_blocks(x, group, pad, what).to(torch.float32)


def _flatten_groups(t: torch.Tensor) -> torch.Tensor:
    """``[..., nG, G]`` → ``[..., nG·G]`` (also for empty tensors)."""
    return t.reshape(*t.shape[:-2], t.shape[-2] * t.shape[-1])


def _ungroup(values: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return _flatten_groups(values)[..., : shape[-1]].to(dtype)


# --------------------------------------------------------------------------------------------
# NVFP4


class NVFP4Format(QuantFormat):
    """NVFP4 with the research options of :mod:`nvfp4lab.variants` (defaults: the foundation)."""

    name = "nvfp4"
    bits_per_element = 4.5
    description = "E2M1, E4M3 scale per 16 along K, FP32 tensor scale"
    options: Mapping[str, Any] = MappingProxyType(variants.OPTION_DEFAULTS)

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        variants.nvfp4_options(**options)  # full validation, names every accepted value
        return dict(options)

    def _fake(self, x: torch.Tensor, opts: dict[str, Any]) -> torch.Tensor:
        return variants.fake_quantize(x, **opts)

    def _quantize(self, x: torch.Tensor, opts: dict[str, Any]) -> NVFP4Tensor:
        return variants.quantize(x, **opts)

    def dequantize(
        self, q: Any, dtype: torch.dtype | None = None, *, hadamard: int | None = None
    ) -> torch.Tensor:
        """Decode an :class:`NVFP4Tensor` (a rotated one rotates back by itself; ``hadamard=``
        names the seed for a plain tensor holding rotated codes)."""
        return variants.dequantize(q, dtype, hadamard=hadamard)

    def _bits(self, shape: tuple[int, ...], numel: int, opts: dict[str, Any]) -> float:
        per_element = variants.nvfp4_options(**opts).bits_per_element
        tensor_scale = 0.0 if "global_scale" in opts and opts["global_scale"] is None else 32.0
        return per_element + tensor_scale / numel


# --------------------------------------------------------------------------------------------
# MXFP4


@dataclass
class PackedGroups:
    """Base of the packed comparator formats: 4-bit codes two per byte (``packed`` uint8
    ``[..., Kp/2]``, low nibble first), one scale per group (``scales``), the original ``shape``
    and ``dtype``. Subclasses define :meth:`dequantize`."""

    packed: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype = field(default=torch.float32)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class MXFP4Tensor(PackedGroups):
    """Packed MXFP4: E2M1 codes; ``scales`` uint8 ``[..., Kp/32]`` (E8M0 biased exponents,
    ``2^(byte - 127)``; view as ``torch.float8_e8m0fnu`` if wanted)."""

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        codes = unpack_fp4(self.packed)
        codes = codes.reshape(*codes.shape[:-1], self.scales.shape[-1], MX_BLOCK_SIZE)
        exponents = self.scales.to(torch.int32) - E8M0_BIAS
        values = torch.ldexp(decode_e2m1(codes), exponents.unsqueeze(-1))
        return _ungroup(values, self.shape, dtype or self.dtype)


class MXFP4Format(QuantFormat):
    """OCP MXFP4: E2M1 elements, block 32, E8M0 scale by the floor rule, no tensor scale."""

    name = "mxfp4"
    bits_per_element = 4.0 + 8.0 / MX_BLOCK_SIZE
    description = "E2M1, E8M0 power-of-two scale per 32 along K (OCP floor rule)"
    options: Mapping[str, Any] = MappingProxyType({"pad": False})

    @staticmethod
    def exponents(blocks: torch.Tensor) -> torch.Tensor:
        """int32 ``floor(log2 amax) - 2`` per block of ``[..., nb, 32]``, clamped to the E8M0
        range [-127, 127]; an all-zero block gets -127 (its codes are zero anyway)."""
        amax = abs_max(blocks, -1).to(torch.float32)
        _, e = torch.frexp(amax)  # amax = m · 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
        exp = torch.where(amax > 0, e - 1 - E2M1_EMAX, -E8M0_BIAS)
        return exp.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)

    def _encode(self, x: torch.Tensor, opts: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        variants.check_input(x)
        blocks = _grouped(x, MX_BLOCK_SIZE, opts["pad"], "mxfp4")
        exp = self.exponents(blocks)
        scaled = torch.ldexp(blocks, -exp.unsqueeze(-1)).clamp_(-E2M1_MAX, E2M1_MAX)
        return round_to_e2m1_codes(scaled), exp

    def _fake(self, x: torch.Tensor, opts: dict[str, Any]) -> torch.Tensor:
        codes, exp = self._encode(x, opts)
        return _ungroup(torch.ldexp(decode_e2m1(codes), exp.unsqueeze(-1)), x.shape, x.dtype)

    def _quantize(self, x: torch.Tensor, opts: dict[str, Any]) -> MXFP4Tensor:
        codes, exp = self._encode(x, opts)
        packed = pack_fp4(_flatten_groups(codes))
        return MXFP4Tensor(packed, (exp + E8M0_BIAS).to(torch.uint8), x.shape, x.dtype)


# --------------------------------------------------------------------------------------------
# INT4, group 128


@dataclass
class Int4Tensor(PackedGroups):
    """Packed symmetric INT4: two's-complement nibbles; ``scales`` float16 ``[..., Kp/128]``."""

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        nibbles = unpack_fp4(self.packed).to(torch.int8)
        q = torch.where(nibbles >= 8, nibbles - 16, nibbles).to(torch.float32)
        q = q.reshape(*q.shape[:-1], self.scales.shape[-1], INT4_GROUP_SIZE)
        values = q * self.scales.to(torch.float32).unsqueeze(-1)
        return _ungroup(values, self.shape, dtype or self.dtype)


class Int4GroupFormat(QuantFormat):
    """Symmetric INT4 with one fp16 scale ``amax/7`` per group of 128 along K (classic W4A16)."""

    name = "int4_g128"
    bits_per_element = 4.0 + 16.0 / INT4_GROUP_SIZE
    description = "symmetric INT4 [-7, 7], fp16 scale amax/7 per 128 along K"
    options: Mapping[str, Any] = MappingProxyType({"pad": False})

    def _encode(self, x: torch.Tensor, opts: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 ``[..., nG, 128]`` in [-7, 7], scales float16 ``[..., nG]``).

        A scale that overflows fp16 saturates at 65504 (values then clip to ±7·65504); one that
        underflows to 0 (amax below ~4e-7) zeroes its group."""
        variants.check_input(x)
        groups = _grouped(x, INT4_GROUP_SIZE, opts["pad"], "int4_g128")
        amax = abs_max(groups, -1)
        scales = (amax / INT4_QMAX).clamp_(max=_FP16_MAX).to(torch.float16)
        s = scales.to(torch.float32).unsqueeze(-1)
        ratio = torch.where(s > 0, groups / torch.where(s > 0, s, 1.0), 0.0)
        q = torch.round(ratio).clamp_(-INT4_QMAX, INT4_QMAX)  # torch.round: half to even
        return q.to(torch.int8), scales

    def _fake(self, x: torch.Tensor, opts: dict[str, Any]) -> torch.Tensor:
        q, scales = self._encode(x, opts)
        values = q.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)
        return _ungroup(values, x.shape, x.dtype)

    def _quantize(self, x: torch.Tensor, opts: dict[str, Any]) -> Int4Tensor:
        q, scales = self._encode(x, opts)
        nibbles = (_flatten_groups(q) & 0xF).to(torch.uint8)
        return Int4Tensor(pack_fp4(nibbles), scales, x.shape, x.dtype)


# --------------------------------------------------------------------------------------------
# FP8 E4M3


@dataclass
class FP8Tensor:
    """FP8 E4M3 data (``torch.float8_e4m3fn``, shape of the input) and float32 DECODE scale(s)
    ``amax/448``: ``[1]`` per tensor or ``[..., 1]`` per channel."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype = field(default=torch.float32)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.data.to(torch.float32) * self.scale).to(dtype or self.dtype)


class FP8E4M3Format(QuantFormat):
    """FP8 E4M3 with a float32 scale ``amax/448`` per tensor (default) or per channel (row)."""

    name = "fp8_e4m3"
    bits_per_element = 8.0
    description = "FP8 E4M3, fp32 scale amax/448 per tensor (or per channel)"
    options: Mapping[str, Any] = MappingProxyType({"granularity": "tensor"})

    def _encode(self, x: torch.Tensor, opts: dict[str, Any]) -> FP8Tensor:
        granularity = opts["granularity"]
        if granularity not in FP8_GRANULARITIES:
            raise ValueError(
                f"unknown granularity {granularity!r} for fp8_e4m3; accepted values: "
                f"{', '.join(repr(g) for g in FP8_GRANULARITIES)}"
            )
        variants.check_input(x)
        xf = x.to(torch.float32)
        if xf.numel() == 0:
            amax = xf.new_zeros(1 if granularity == "tensor" else (*xf.shape[:-1], 1))
        elif granularity == "tensor":
            amax = abs_max(xf).reshape(1)
        else:
            amax = abs_max(xf, -1).unsqueeze(-1)
        scale = amax / E4M3_MAX
        scale = torch.where(torch.isfinite(scale) & (scale > 0), scale, 1.0)
        data = (xf / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return FP8Tensor(data, scale, x.dtype)

    def _fake(self, x: torch.Tensor, opts: dict[str, Any]) -> torch.Tensor:
        return self._encode(x, opts).dequantize()

    def _quantize(self, x: torch.Tensor, opts: dict[str, Any]) -> FP8Tensor:
        return self._encode(x, opts)

    def _bits(self, shape: tuple[int, ...], numel: int, opts: dict[str, Any]) -> float:
        n_scales = 1 if opts["granularity"] == "tensor" else numel // shape[-1]
        return 8.0 + 32.0 * n_scales / numel


# --------------------------------------------------------------------------------------------
# BF16


@dataclass
class BF16Tensor:
    """A bfloat16 copy of the input and its original dtype."""

    data: torch.Tensor
    dtype: torch.dtype = field(default=torch.float32)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.data.to(dtype or self.dtype)


class BF16Format(QuantFormat):
    """The unquantized baseline: round-to-nearest-even cast to bfloat16 and back."""

    name = "bf16"
    bits_per_element = 16.0
    description = "bfloat16 cast (baseline)"

    def _fake(self, x: torch.Tensor, opts: dict[str, Any]) -> torch.Tensor:
        variants.check_input(x, "propagate")
        return x.to(torch.bfloat16).to(x.dtype)

    def _quantize(self, x: torch.Tensor, opts: dict[str, Any]) -> BF16Tensor:
        variants.check_input(x, "propagate")
        return BF16Tensor(x.to(torch.bfloat16), x.dtype)


# --------------------------------------------------------------------------------------------
# registry

_REGISTRY: dict[str, QuantFormat] = {}


def register(fmt: QuantFormat, *, replace: bool = False) -> QuantFormat:
    """Add ``fmt`` to the registry under ``fmt.name`` (ValueError if taken, unless ``replace``)."""
    if not isinstance(fmt, QuantFormat) or not fmt.name:
        raise ValueError(f"register() takes a named QuantFormat instance, got {fmt!r}")
    if fmt.name in _REGISTRY and not replace:
        raise ValueError(f"format {fmt.name!r} is already registered; pass replace=True")
    _REGISTRY[fmt.name] = fmt
    return fmt


for _fmt in (NVFP4Format(), MXFP4Format(), Int4GroupFormat(), FP8E4M3Format(), BF16Format()):
    register(_fmt)


def get(name: str) -> QuantFormat:
    """The registered format called ``name``, case- and separator-insensitive ("NVFP4",
    "int4-g128"); unknown names raise ValueError listing the available ones."""
    try:
        return _REGISTRY[name.strip().lower().replace("-", "_").replace(" ", "_")]
    except (KeyError, TypeError, AttributeError):
        raise ValueError(
            f"unknown format {name!r}; available formats: {', '.join(_REGISTRY)}"
        ) from None


def available() -> dict[str, float]:
    """Registered format names → bits per element (block/group scales included)."""
    return {name: fmt.bits_per_element for name, fmt in _REGISTRY.items()}
