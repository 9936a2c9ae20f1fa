"""The one place nvfp4lab reads the process environment.

Every function that depends on an environment variable takes an optional ``env`` mapping and
resolves it through :func:`environ`, so tests and notebooks can pass a dict instead of mutating
``os.environ``. The variables:

* ``NVFP4LAB_BACKEND`` — auto | native | emulation | w4a16: forces a backend (read by
  :func:`nvfp4lab.execution.dispatch.select_backend` at every call).
* ``VLLM_USE_NVFP4_CT_EMULATIONS`` — vLLM's switch, an integer: nonzero selects emulation.
* ``NVFP4LAB_CACHE`` / ``XDG_CACHE_HOME`` — where packaged models are extracted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["BACKEND_ENV", "CACHE_ENV", "EMULATION_ENV", "environ"]

BACKEND_ENV = "NVFP4LAB_BACKEND"
EMULATION_ENV = "VLLM_USE_NVFP4_CT_EMULATIONS"
CACHE_ENV = "NVFP4LAB_CACHE"


def environ(env: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """``env`` when given, else the live ``os.environ`` (read at call time, never cached)."""
    return os.environ if env is None else env
