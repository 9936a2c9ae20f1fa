"""NVFP4 and its comparator formats behind one interface: ``formats.get(name)``, ``available()``.

===============  ========================================  ======================================
module           holds                                     add here
===============  ========================================  ======================================
``base``         the :class:`QuantFormat` interface; block  a new element or scale kind
                 formats as data (element, scale, block)
``nvfp4``        NVFP4 with its research options (the      an NVFP4 option (in
                 codec's pipeline)                         :mod:`nvfp4lab.codec`)
``comparators``  MXFP4, INT4-g128 (data), FP8, BF16        a comparator: a ``BlockFormatInfo``
                                                           if it is a scaled block format
===============  ========================================  ======================================

Register a new format with :func:`register`; names are looked up forgivingly by :func:`get`.
"""

from __future__ import annotations

from nvfp4lab.number_formats.base import (
    BlockFormat,
    BlockFormatInfo,
    ElementFormat,
    PackedBlocks,
    QuantFormat,
    ScaleFormat,
)
from nvfp4lab.number_formats.comparators import (
    INT4_G128,
    MXFP4,
    BF16Format,
    BF16Tensor,
    FP8E4M3Format,
    FP8Tensor,
)
from nvfp4lab.number_formats.nvfp4 import NVFP4Format, options_label

__all__ = [
    "BF16Format",
    "BF16Tensor",
    "BlockFormat",
    "BlockFormatInfo",
    "ElementFormat",
    "FP8E4M3Format",
    "FP8Tensor",
    "NVFP4Format",
    "PackedBlocks",
    "QuantFormat",
    "ScaleFormat",
    "available",
    "get",
    "options_label",
    "register",
]

_REGISTRY: dict[str, QuantFormat] = {}


def register(fmt: QuantFormat, *, replace: bool = False) -> QuantFormat:
    """Add ``fmt`` to the registry under ``fmt.name`` (ValueError if taken, unless ``replace``)."""
    if not isinstance(fmt, QuantFormat) or not fmt.name:
        raise ValueError(f"register() takes a named QuantFormat instance, got {fmt!r}")
    if fmt.name in _REGISTRY and not replace:
        raise ValueError(f"format {fmt.name!r} is already registered; pass replace=True")
    _REGISTRY[fmt.name] = fmt
    return fmt


for _fmt in (
    NVFP4Format(),
    BlockFormat(MXFP4),
    BlockFormat(INT4_G128),
    FP8E4M3Format(),
    BF16Format(),
):
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
