"""Deprecated alias of :mod:`nvfp4lab.oracles.ggml` (llama.cpp's CPU arithmetic oracle moved to
``nvfp4lab/oracles/``); importing it warns, and it goes in the next release."""

from __future__ import annotations

import warnings

from nvfp4lab.oracles.ggml import *  # noqa: F403  # the public names, as before
from nvfp4lab.oracles.ggml import __all__  # noqa: F401

warnings.warn(
    "nvfp4lab.reference_ggml is deprecated: import nvfp4lab.oracles.ggml",
    DeprecationWarning,
    stacklevel=2,
)
