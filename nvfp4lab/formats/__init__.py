"""Deprecated alias of :mod:`nvfp4lab.number_formats` (renamed by issue 33: "formats" also named
the checkpoint formats of :mod:`nvfp4lab.checkpoint.formats`); importing it warns, and it goes in
the next release. ``nvfp4lab.formats.base`` / ``.comparators`` / ``.nvfp4`` are the moved
modules themselves (one registry, not a copy)."""

from __future__ import annotations

import sys
import warnings
from typing import Any

from nvfp4lab import number_formats as _moved
from nvfp4lab.number_formats import *  # noqa: F403  # the public names, as before
from nvfp4lab.number_formats import (
    __all__,  # noqa: F401
    base,
    comparators,
    nvfp4,
)

for _module in (base, comparators, nvfp4):
    sys.modules[f"{__name__}.{_module.__name__.rpartition('.')[2]}"] = _module

warnings.warn("nvfp4lab.formats is deprecated: import nvfp4lab.number_formats",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """Every other name (private helpers too) as the moved package has it."""
    return getattr(_moved, name)
