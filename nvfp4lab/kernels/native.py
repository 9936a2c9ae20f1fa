"""nvfp4lab's native CPU library: hand-written C++ kernels, built once per machine, called with
:mod:`ctypes`.

Three sources beside this module (package data, with the header ``native.h`` they share) make one
library:

* ``lut_decode.cpp``: the table-lookup decode of packed NVFP4 weights
  (:mod:`nvfp4lab.kernels.lut_decode`);
* ``block_encode.cpp``: the quantize and quantize-dequantize of the ENCODE-form orders
  (:mod:`nvfp4lab.kernels.block_encode`);
* ``gptq_columns.cpp``: GPTQ's column loop within one group (:mod:`nvfp4lab.kernels.gptq_columns`).

All are plain C ABI (pointers, sizes, float32 scalars; no torch header), compiled without
fast-math and without FMA contraction (each float32 step one IEEE operation, as in the eager
pipeline) and pick their vector path (AVX-512, AVX2, a scalar loop) at run time from the CPU's
flags.

Build. The first use on a machine builds the library with
:func:`torch.utils.cpp_extension.load` (the C++ compiler inductor needs too, and ninja) into
``<cache>/cpp/native-<hash of the sources, flags and torch version>`` under
:func:`nvfp4lab.settings.cache_dir` (about 4 s on the 2-core CPU; other processes wait on
cpp_extension's lock file); a later process finds it there and loads it in under a millisecond.
When it cannot be built (not an x86-64 CPU, no compiler, no ninja, a build error) :func:`available`
is False, ONE WARNING line on the ``nvfp4lab.kernels`` logger says why, and every caller runs the
compiled graphs or the eager pipeline instead (:func:`nvfp4lab.kernels.fused_route` decides).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import platform
import time
import warnings
from pathlib import Path

import torch

from nvfp4lab.settings import cache_dir, native_isa
from nvfp4lab.vocab import NativeIsa, check_choice

__all__ = [
    "DTYPE_CODES",
    "HEADERS",
    "ISAS",
    "SOURCES",
    "available",
    "build_dir",
    "library",
    "required",
    "usable",
    "vector_path",
]

#: The C++ sources (package data), compiled into one library.
SOURCES: tuple[Path, ...] = (
    Path(__file__).with_name("lut_decode.cpp"),
    Path(__file__).with_name("block_encode.cpp"),
    Path(__file__).with_name("gptq_columns.cpp"),
)
#: The header they share (its ISA and dtype numbers, the E2M1 table, bit casts).
HEADERS: tuple[Path, ...] = (Path(__file__).with_name("native.h"),)

#: The vector paths by the number the library uses (``native.h``): 0 the scalar / x86-64 baseline
#: loop, 1 AVX2, 2 AVX-512; each kernel reports the one it runs here (the best this CPU has for
#: it, capped by ``NVFP4LAB_NATIVE_ISA``: :func:`vector_path`).
ISAS: tuple[str, ...] = tuple(isa.value for isa in NativeIsa)
#: The element dtypes by the number the library uses (``native.h``).
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_NAME = "nvfp4lab_native"
_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math"]
_STAMP = "built.ok"
_X86_64 = ("x86_64", "amd64")
#: A build lock older than this was left by a process that died while building: removed.
_STALE_LOCK_S = 600.0

_LOG = logging.getLogger("nvfp4lab.kernels")

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
#: Each exported function: (argument types, result type).
_SIGNATURES: dict[str, tuple[list[type], type]] = {
    "nvfp4lab_lut_isa": ([], _int),
    "nvfp4lab_lut_decode": ([_ptr, _ptr, _i64, _f32, _int, _int, _int, _int, _ptr], _int),
    "nvfp4lab_encode_isa": ([], _int),
    "nvfp4lab_abs_max": ([_ptr, _i64, _int, _int, _int], ctypes.c_uint32),
    "nvfp4lab_encode": (
        [_ptr, _i64, _int, _int, _f32, _f32, _int, _int, _int, _ptr, _ptr, _ptr], _int),
    "nvfp4lab_gptq_columns": (
        [_ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr], None),
}


def vector_path(path: str | None = None) -> int:
    """The vector path (its :data:`ISAS` number) a kernel call asks the library for: ``path``
    (tests; default: the widest), capped by ``NVFP4LAB_NATIVE_ISA``
    (:func:`nvfp4lab.settings.native_isa`, read at every call); the library then clamps it to
    what this CPU has. ValueError for an unknown ``path`` or setting, naming the accepted ones."""
    wanted = len(ISAS) - 1 if path is None else ISAS.index(
        check_choice("native vector path", path, NativeIsa))
    cap = native_isa()
    return wanted if cap is None else min(wanted, ISAS.index(cap))


def build_dir() -> Path:
    """Where the library is built: ``<cache_dir>/cpp/native-<hash>``, the hash of the sources,
    the flags and torch's version (a changed source builds anew, never in place)."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    digest.update(" ".join([*_FLAGS, torch.__version__]).encode())
    return cache_dir() / "cpp" / f"native-{digest.hexdigest()[:16]}"


def _build(folder: Path) -> Path:
    """Build (or find) the library in ``folder`` with cpp_extension; its path."""
    folder.mkdir(parents=True, exist_ok=True)
    copies = []
    for source in (*SOURCES, *HEADERS):
        copy = folder / source.name
        if not copy.exists():
            copy.write_bytes(source.read_bytes())
        if source in SOURCES:
            copies.append(str(copy))
    lock = folder / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    from torch.utils.cpp_extension import load

    with warnings.catch_warnings():  # compiler-version notices: the build either works or not
        warnings.simplefilter("ignore")
        path = load(
            name=_NAME,
            sources=copies,
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )
    return Path(str(path))


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (arguments, result) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = arguments
        function.restype = result
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, built on first use; None (one WARNING line) when it cannot be."""
    try:
        if platform.machine().lower() not in _X86_64:
            raise RuntimeError(f"x86-64 kernels, this CPU is {platform.machine() or 'unknown'}")
        folder = build_dir()
        built = folder / f"{_NAME}.so"
        if not ((folder / _STAMP).exists() and built.exists()):
            built = _build(folder)
            (folder / _STAMP).write_text(str(built))
        return _open(built)
    except Exception as exc:  # any failure of the build means: no native kernels here
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        _LOG.warning(
            "nvfp4lab: the C++ CPU kernels (LUT decode, block encode) are unavailable (%s: %s); "
            "running the compiled or eager path",
            type(exc).__name__,
            first,
        )
        return None


def required() -> ctypes.CDLL:
    """The loaded library; RuntimeError when it cannot be built here (ask :func:`available`
    first: its one WARNING line says why)."""
    lib = library()
    if lib is None:
        raise RuntimeError("the C++ CPU kernels are unavailable here (see the logged warning)")
    return lib


def available() -> bool:
    """Whether the native library works here: built (or found) and loaded, once per process."""
    return library() is not None


def usable(device: torch.device) -> bool:
    """Whether tensors on ``device`` can run the native kernels (a CPU, the library available)."""
    return device.type == "cpu" and available()
