"""The one place nvfp4lab reads the process environment.

Every function that depends on an environment variable takes an optional ``env`` mapping and
resolves it through :func:`environ`, so tests and notebooks can pass a dict instead of mutating
``os.environ``. The variables:

* ``NVFP4LAB_BACKEND`` — auto | native | emulation | w4a16: forces a backend (read by
  :func:`nvfp4lab.execution.dispatch.select_backend` at every call).
* ``VLLM_USE_NVFP4_CT_EMULATIONS`` — vLLM's switch, an integer: nonzero selects emulation
  (read by vLLM 0.9.2 to 0.23.0 only).
* ``VLLM_NVFP4_GEMM_BACKEND``, ``VLLM_USE_FBGEMM``, ``VLLM_BATCH_INVARIANT``,
  ``VLLM_DISABLED_KERNELS`` — the other vLLM variables the modelled releases read when they pick
  an NVFP4 kernel (:mod:`nvfp4lab.execution.vllm_rules` says which release reads which).
* ``NVFP4LAB_CACHE`` / ``XDG_CACHE_HOME`` — where packaged models are extracted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = [
    "BACKEND_ENV",
    "BATCH_INVARIANT_ENV",
    "CACHE_ENV",
    "DISABLED_KERNELS_ENV",
    "EMULATION_ENV",
    "FBGEMM_ENV",
    "GEMM_BACKEND_ENV",
    "VLLM_ENV_VARS",
    "environ",
]

BACKEND_ENV = "NVFP4LAB_BACKEND"
EMULATION_ENV = "VLLM_USE_NVFP4_CT_EMULATIONS"
GEMM_BACKEND_ENV = "VLLM_NVFP4_GEMM_BACKEND"
FBGEMM_ENV = "VLLM_USE_FBGEMM"
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
DISABLED_KERNELS_ENV = "VLLM_DISABLED_KERNELS"
CACHE_ENV = "NVFP4LAB_CACHE"

#: Every vLLM variable the dispatcher models, in the order reports list them.
VLLM_ENV_VARS: tuple[str, ...] = (
    EMULATION_ENV,
    GEMM_BACKEND_ENV,
    FBGEMM_ENV,
    BATCH_INVARIANT_ENV,
    DISABLED_KERNELS_ENV,
)


def environ(env: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """``env`` when given, else the live ``os.environ`` (read at call time, never cached)."""
    return os.environ if env is None else env
