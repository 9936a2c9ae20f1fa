"""Deprecated alias of :mod:`nvfp4lab.studies.number_formats` (notebook 04's study, renamed by
issue 33); importing it warns, and it goes in the next release."""

from __future__ import annotations

import warnings
from typing import Any

from nvfp4lab.studies import number_formats as _moved
from nvfp4lab.studies.number_formats import *  # noqa: F403  # the public names, as before
from nvfp4lab.studies.number_formats import __all__  # noqa: F401

warnings.warn("nvfp4lab.studies.formats is deprecated: import nvfp4lab.studies.number_formats",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """Every other name (private helpers too) as the moved module has it."""
    return getattr(_moved, name)
