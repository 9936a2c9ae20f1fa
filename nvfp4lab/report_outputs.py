"""Deprecated alias of :mod:`nvfp4lab.report.outputs` (the report runner moved to
``nvfp4lab/report/``); importing it warns, and it goes in the next release."""

from __future__ import annotations

import warnings
from typing import Any

from nvfp4lab.report import outputs as _moved
from nvfp4lab.report.outputs import *  # noqa: F403  # the public names, as before
from nvfp4lab.report.outputs import __all__  # noqa: F401

warnings.warn("nvfp4lab.report_outputs is deprecated: import nvfp4lab.report.outputs",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """Every other name (private helpers too) as the moved module has it."""
    return getattr(_moved, name)
