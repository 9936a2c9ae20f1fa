"""Deprecated alias of :mod:`nvfp4lab.report.runner` (the report runner moved to
``nvfp4lab/report/``); importing it warns, and it goes in the next release."""

from __future__ import annotations

import warnings
from typing import Any

from nvfp4lab.report import runner as _moved
from nvfp4lab.report.runner import *  # noqa: F403  # the public names, as before
from nvfp4lab.report.runner import __all__  # noqa: F401

warnings.warn("nvfp4lab.reports is deprecated: import nvfp4lab.report.runner",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """Every other name (private helpers too) as the moved module has it."""
    return getattr(_moved, name)
