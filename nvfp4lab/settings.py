"""The one place nvfp4lab reads the process environment.

Every function that depends on an environment variable takes an optional ``env`` mapping and
resolves it through :func:`environ`, so tests and notebooks can pass a dict instead of mutating
``os.environ``. The variables:

* ``NVFP4LAB_BACKEND`` — auto | native | emulation | w4a16 | q8_0: forces a backend (read by
  :func:`nvfp4lab.execution.dispatch.select_backend` at every call).
* ``VLLM_USE_NVFP4_CT_EMULATIONS`` — vLLM's switch, an integer: nonzero selects emulation
  (read by vLLM 0.9.2 to 0.23.0 only).
* ``VLLM_NVFP4_GEMM_BACKEND``, ``VLLM_USE_FBGEMM``, ``VLLM_BATCH_INVARIANT``,
  ``VLLM_DISABLED_KERNELS`` — the other vLLM variables the modelled releases read when they pick
  an NVFP4 kernel (:mod:`nvfp4lab.execution.vllm_rules` says which release reads which).
* ``GGML_CUDA_MMQ_PREC`` — llama.cpp's q4 | q8 | auto: the activation precision of its CUDA
  MMQ (read by ``select_backend(engine="llama.cpp")``,
  :mod:`nvfp4lab.execution.llama_cpp_rules`).
* ``NVFP4LAB_CACHE`` / ``XDG_CACHE_HOME`` — nvfp4lab's cache directory (:func:`cache_dir`:
  ``$NVFP4LAB_CACHE``, else ``$XDG_CACHE_HOME/nvfp4lab``, else ``~/.cache/nvfp4lab``): where
  packaged models are extracted, the C++ decode kernel built, and the compiled fused kernels'
  default home (next item), and the reference runs kept on disk (next but one).
* ``TORCHINDUCTOR_CACHE_DIR`` — torch's own variable, where inductor keeps what it compiles (read
  by :func:`kernel_cache_dir`). When the user set it, it wins: nvfp4lab uses that directory and
  never changes it. Otherwise nvfp4lab's first fused call (:func:`use_kernel_cache`, before it
  compiles anything) sets it, in this process's ``os.environ``, to ``<cache_dir>/inductor``, so
  compiled kernels outlive ``/tmp`` and a machine pays each compilation once, not once per
  process. That folder has one subfolder per CPU (:func:`cpu_signature`): inductor's own cache
  keys do not tell the vector ISA it generated code for, so a cache filled on an AVX-512 CPU and
  read under AVX2 (another machine sharing a home folder, or ``ATEN_CPU_CAPABILITY=avx2``) ran
  16-lane loops over 8-lane vectors: wrong bits (tests/kernels/test_compiled.py under ``make
  test-isa`` caught it). torch writes its own default, ``<tmp>/torchinductor_<user>``, into the
  variable the first time anything touches its cache (loading a transformers model does): that
  value counts as unset (to keep torch's directory, set ``TORCHINDUCTOR_CACHE_DIR`` to any other
  path). ``import nvfp4lab`` changes nothing.
* ``NVFP4LAB_REFERENCE_CACHE`` — an integer: 0 turns off the disk cache of reference runs
  (:func:`nvfp4lab.studies.reference_cache.cached_reference_run`: ``<cache_dir>/reference-runs``,
  one safetensors file per model, scored tokens, context and batch size), so every process runs
  the reference model again (read by :func:`reference_cache` at every call; unset = on).
* ``ATEN_CPU_CAPABILITY`` — torch's variable (default | avx2 | avx512): caps the vector ISA of
  torch's CPU kernels and of the C++ inductor generates; part of :func:`cpu_signature`.
* ``NVFP4LAB_FUSED`` — auto | on | off: when quantize / fake_quantize / dequantize / linear run
  the fused compiled kernels of :mod:`nvfp4lab.kernels` (read by :func:`fused_mode` at every
  call; unset = auto).
* ``NVFP4LAB_NATIVE_ISA`` — scalar | avx2 | avx512: the widest vector path nvfp4lab's C++
  kernels (:mod:`nvfp4lab.kernels.native`: the LUT decode, the block encode and its ``max |x|``)
  may run, to check results on a narrower CPU than this one (read by :func:`native_isa` at every
  kernel call; unset = the best this CPU has; a cap above it runs the CPU's best).
* ``NVFP4LAB_TEXT_PROGRESS`` — an integer: nonzero makes progress bars plain text (``tqdm.std``
  on stderr) even in a Jupyter kernel, where ``tqdm.auto`` would draw an ipywidget that a static
  HTML page cannot show; the report runner sets it in its kernels (read by :func:`tqdm_class`
  and :func:`text_progress` at every call; unset = widgets where Jupyter offers them).
* ``NVFP4LAB_THREADS`` — a whole number from 1 to the machine's logical CPUs
  (:func:`thread_limit`): torch's intra-op CPU threads in each process that runs nvfp4lab
  work: a notebook kernel (its setup cell calls :func:`use_torch_threads`), a local worker
  process of ``convert``/``audit``, a Dask task (read by :func:`torch_threads`; unset =
  :data:`DEFAULT_THREADS`; every ``nvfp4lab`` command checks it before it starts). nvfp4lab
  runs in parallel across processes (notebooks side by side in ``make report``,
  ``--workers``, Dask workers), never inside one.
* ``HF_HUB_CACHE`` / ``HF_HOME`` / ``XDG_CACHE_HOME`` — the Hugging Face hub cache, where a model
  named ``org/name`` is looked up (:func:`hf_hub_cache`, huggingface_hub's order; nothing is
  ever downloaded); ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` (:func:`hf_offline`) is only
  said in the refusal of a name that is not there.
"""

from __future__ import annotations

import functools
import getpass
import hashlib
import os
import platform
import re
import tempfile
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from nvfp4lab.vocab import FusedMode, NativeIsa, check_choice

__all__ = [
    "BACKEND_ENV",
    "BATCH_INVARIANT_ENV",
    "CACHE_ENV",
    "CPU_CAPABILITY_ENV",
    "DEFAULT_THREADS",
    "DISABLED_KERNELS_ENV",
    "EMULATION_ENV",
    "FBGEMM_ENV",
    "FUSED_ENV",
    "GEMM_BACKEND_ENV",
    "INDUCTOR_CACHE_ENV",
    "KERNEL_CACHE_SUBDIR",
    "LLAMA_MMQ_PREC_ENV",
    "NATIVE_ISA_ENV",
    "REFERENCE_CACHE_ENV",
    "TEXT_PROGRESS_ENV",
    "THREADS_ENV",
    "VLLM_ENV_VARS",
    "cache_dir",
    "cpu_signature",
    "environ",
    "fused_mode",
    "hf_hub_cache",
    "hf_offline",
    "kernel_cache_dir",
    "native_isa",
    "reference_cache",
    "text_progress",
    "thread_limit",
    "torch_default_kernel_cache",
    "torch_threads",
    "tqdm_class",
    "use_kernel_cache",
    "use_torch_threads",
]

BACKEND_ENV = "NVFP4LAB_BACKEND"
EMULATION_ENV = "VLLM_USE_NVFP4_CT_EMULATIONS"
GEMM_BACKEND_ENV = "VLLM_NVFP4_GEMM_BACKEND"
FBGEMM_ENV = "VLLM_USE_FBGEMM"
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
DISABLED_KERNELS_ENV = "VLLM_DISABLED_KERNELS"
CACHE_ENV = "NVFP4LAB_CACHE"
FUSED_ENV = "NVFP4LAB_FUSED"
NATIVE_ISA_ENV = "NVFP4LAB_NATIVE_ISA"
TEXT_PROGRESS_ENV = "NVFP4LAB_TEXT_PROGRESS"
THREADS_ENV = "NVFP4LAB_THREADS"
REFERENCE_CACHE_ENV = "NVFP4LAB_REFERENCE_CACHE"
LLAMA_MMQ_PREC_ENV = "GGML_CUDA_MMQ_PREC"
#: torch's variable for inductor's cache directory (see the module docstring for what wins).
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
#: The compiled kernels' folder under :func:`cache_dir` when ``TORCHINDUCTOR_CACHE_DIR`` is unset
#: (a subfolder per :func:`cpu_signature` inside it).
KERNEL_CACHE_SUBDIR = "inductor"
#: torch's variable capping the vector ISA of its CPU kernels and of inductor's generated C++.
CPU_CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"
#: The file the CPU's feature flags are read from (Linux).
CPUINFO = Path("/proc/cpuinfo")

#: Torch CPU threads per process when ``NVFP4LAB_THREADS`` is unset. One, measured (notebook
#: 04's ``error_table``, 2048², on this project's 2-core machine while other work ran): 1 thread
#: 15.0 s wall / 10.8 s CPU, torch's default 2 threads 89.7 s wall / 58.8 s CPU. The studies run
#: many small ops; a second thread mostly waits for a busy core. Parallelism comes from
#: processes instead (see the module docstring).
DEFAULT_THREADS = 1

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


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """nvfp4lab's cache directory: ``$NVFP4LAB_CACHE``, else ``$XDG_CACHE_HOME/nvfp4lab``,
    else ``~/.cache/nvfp4lab`` (``env`` defaults to ``os.environ``; nothing is created)."""
    env = environ(env)
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV]).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "nvfp4lab"


def reference_cache(env: Mapping[str, str] | None = None) -> bool:
    """Whether reference runs are kept on disk under :func:`cache_dir`: ``NVFP4LAB_REFERENCE_CACHE``
    of ``env`` (default: the live environment), an integer, 0 = off; unset or empty = on.
    Anything else raises ValueError naming the variable."""
    raw = environ(env).get(REFERENCE_CACHE_ENV, "").strip()
    if not raw:
        return True
    try:
        return int(raw) != 0
    except ValueError:
        raise ValueError(
            f"{REFERENCE_CACHE_ENV} must be an integer (0 = no disk cache of reference runs), "
            f"got {raw!r}; unset it to keep the cache on"
        ) from None


def hf_hub_cache(env: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache folder, as huggingface_hub finds it: ``$HF_HUB_CACHE``, else
    ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
    ``~/.cache/huggingface/hub`` (``env`` defaults to ``os.environ``; nothing is created)."""
    env = environ(env)
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "huggingface" / "hub"


def hf_offline(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) of ``env`` is set to 1, ON, YES
    or TRUE (any case), as huggingface_hub reads it."""
    env = environ(env)
    value = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def torch_default_kernel_cache() -> Path:
    """torch's own default for ``TORCHINDUCTOR_CACHE_DIR``: ``torchinductor_<user>`` in the
    temporary directory, the characters ``\\/:*?"<>|`` of the user name replaced by ``_``
    (torch 2.13, ``torch/_inductor/runtime/cache_dir_utils.py``, ``default_cache_dir``; computed
    here without importing inductor, which would import dynamo)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError, ModuleNotFoundError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return Path(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def cpu_signature(env: Mapping[str, str] | None = None, cpuinfo: Path = CPUINFO) -> str:
    """The name of the CPU the compiled kernels are built for: ``<machine>-<ATEN_CPU_CAPABILITY
    or auto>-<12 hex digits of the CPU's feature flags>`` (from ``cpuinfo``'s first ``flags``
    line, read once per process: the ``auto`` rule asks on every eligible call; the processor's
    name where there is none), e.g. ``x86_64-auto-3f0c9a1b2d4e``. Two CPUs with other
    instruction sets, or one run under another ``ATEN_CPU_CAPABILITY``, get other names, so
    inductor's kernels generated for one are never loaded for the other."""
    capability = environ(env).get(CPU_CAPABILITY_ENV, "").strip().lower() or "auto"
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{platform.machine() or 'cpu'}-{capability}")
    return f"{safe}-{_cpu_flags_digest(cpuinfo)}"


@functools.cache
def _cpu_flags_digest(cpuinfo: Path) -> str:
    """12 hex digits of the SHA-256 of the CPU's sorted feature flags in ``cpuinfo`` (reading
    /proc/cpuinfo took ~30 us on 2 CPUs, more with many)."""
    flags = ""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as fh:
            # the first CPU's block is a few dozen lines: 4096 bounds a strange file
            for _, line in zip(range(4096), fh, strict=False):
                name, sep, value = line.partition(":")
                if sep and name.strip() in ("flags", "Features"):
                    flags = " ".join(sorted(value.split()))
                    break
    except OSError:
        pass
    flags = flags or platform.processor() or "unknown"
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def kernel_cache_dir(env: Mapping[str, str] | None = None) -> tuple[Path, bool]:
    """(inductor's cache directory for the fused kernels, whether ``TORCHINDUCTOR_CACHE_DIR`` of
    ``env`` chose it): that variable when set to anything but torch's own default (it wins, and
    is used as it is: one CPU per such folder is then the user's business), else
    ``<cache_dir>/inductor/<cpu_signature>``. torch writes its default into the variable itself
    the first time anything touches its cache (loading a transformers model does), so that value
    counts as unset. Nothing is created or set."""
    env = environ(env)
    own = env.get(INDUCTOR_CACHE_ENV, "").strip()
    if own and Path(own).expanduser().absolute() != torch_default_kernel_cache().absolute():
        return Path(own).expanduser().absolute(), True
    return (cache_dir(env) / KERNEL_CACHE_SUBDIR / cpu_signature(env)).absolute(), False


def use_kernel_cache(env: MutableMapping[str, str] | None = None) -> Path:
    """Point inductor at :func:`kernel_cache_dir` of ``env`` (default: this process's
    ``os.environ``) and return the directory: sets ``TORCHINDUCTOR_CACHE_DIR`` when it is unset,
    leaves it as it is otherwise. Called by the fused kernels before their first compilation
    (inductor reads the variable when it first touches its cache); nothing is created here."""
    target: MutableMapping[str, str] = os.environ if env is None else env
    path, chosen = kernel_cache_dir(target)
    if not chosen:  # unset, or torch's own default written by torch itself
        target[INDUCTOR_CACHE_ENV] = str(path)
    return path


def fused_mode(env: Mapping[str, str] | None = None) -> FusedMode:
    """``NVFP4LAB_FUSED`` of ``env`` (default: the live environment) as a :class:`FusedMode`;
    unset or empty means auto. A bad value raises ValueError naming it and the accepted ones."""
    value = environ(env).get(FUSED_ENV, "").strip().lower() or FusedMode.AUTO
    try:
        return check_choice(f"{FUSED_ENV} value", value, FusedMode)  # type: ignore[return-value]
    except ValueError as err:
        raise ValueError(f"{err} (unset = auto)") from None


def native_isa(env: Mapping[str, str] | None = None) -> NativeIsa | None:
    """``NVFP4LAB_NATIVE_ISA`` of ``env`` (default: the live environment) as a
    :class:`~nvfp4lab.vocab.NativeIsa`, the cap on the C++ kernels' vector path; None when unset
    or empty (the best this CPU has). A bad value raises ValueError naming it and the accepted
    ones."""
    value = environ(env).get(NATIVE_ISA_ENV, "").strip().lower()
    if not value:
        return None
    try:
        return check_choice(f"{NATIVE_ISA_ENV} value", value, NativeIsa)  # type: ignore[return-value]
    except ValueError as err:
        raise ValueError(f"{err} (unset = the best this CPU has)") from None


def text_progress(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``NVFP4LAB_TEXT_PROGRESS`` of ``env`` (default: the live environment) asks for
    plain-text progress bars: an integer, nonzero = yes; unset or empty = no. Anything else
    raises ValueError naming the variable."""
    raw = environ(env).get(TEXT_PROGRESS_ENV, "").strip()
    if not raw:
        return False
    try:
        return int(raw) != 0
    except ValueError:
        raise ValueError(
            f"{TEXT_PROGRESS_ENV} must be an integer (nonzero = plain-text progress bars), "
            f"got {raw!r}"
        ) from None


def tqdm_class(env: Mapping[str, str] | None = None) -> Any:
    """The tqdm class nvfp4lab's progress bars use: ``tqdm.std.tqdm`` (text) when
    :func:`text_progress` says so, else ``tqdm.auto.tqdm`` (a widget in Jupyter)."""
    if text_progress(env):
        from tqdm.std import tqdm
    else:
        from tqdm.auto import tqdm
    return tqdm


def thread_limit() -> int:
    """The most torch threads ``NVFP4LAB_THREADS`` may ask for: this machine's logical CPUs
    (``os.cpu_count()``; 1 when unknown). More threads than CPUs only wait for each other, and
    an absurd count makes torch's OpenMP runtime abort or crash (``1000000000`` asked libgomp
    for 216 GB; ``100000`` segfaulted a pool worker)."""
    return max(1, os.cpu_count() or 1)


def torch_threads(env: Mapping[str, str] | None = None) -> int:
    """Torch intra-op CPU threads for one nvfp4lab process: ``NVFP4LAB_THREADS`` of ``env``
    (default: the live environment), a whole number from 1 to :func:`thread_limit`; unset or
    empty means :data:`DEFAULT_THREADS`. Anything else raises ValueError naming the variable,
    the value and the range."""
    raw = environ(env).get(THREADS_ENV, "").strip()
    if not raw:
        return DEFAULT_THREADS
    limit = thread_limit()
    try:
        threads = int(raw)
    except ValueError:
        threads = 0
    if not 1 <= threads <= limit:
        raise ValueError(
            f"{THREADS_ENV} must be a whole number from 1 to {limit} (torch CPU threads per "
            f"process; {limit} = this machine's logical CPUs), got {raw!r}; unset it for the "
            f"default ({DEFAULT_THREADS})"
        )
    return threads


def use_torch_threads(env: Mapping[str, str] | None = None) -> int:
    """Set torch's intra-op threads of this process to :func:`torch_threads` and return it (a
    notebook's setup cell, a worker process's initializer, a Dask task)."""
    import torch

    threads = torch_threads(env)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
