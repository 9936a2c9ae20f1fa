"""nvfp4lab's native CPU library: hand-written C++ kernels, built once per machine, called with
:mod:`ctypes`.

Five sources beside this module (package data, with the header ``native.h`` they share) make one
library:

* ``lut_decode.cpp``: the table-lookup decode of packed NVFP4 weights
  (:mod:`nvfp4lab.kernels.lut_decode`);
* ``block_encode.cpp``: the quantize and quantize-dequantize of the ENCODE-form orders
  (:mod:`nvfp4lab.kernels.block_encode`);
* ``gptq_columns.cpp``: GPTQ's column loop within one group (:mod:`nvfp4lab.kernels.gptq_columns`);
* ``ggml_dot.cpp``: llama.cpp's CPU Q8_0 quantize and NVFP4 x Q8_0 dot, bit for bit
  (:mod:`nvfp4lab.kernels.ggml_dot`, the ``q8_0`` backend's hot path);
* ``hessian_products.cpp``: GPTQ's Hessian products in a defined order: the float64 Gram sum of
  float32 rows and the block rotation ``Qᵀ H Q``
  (:mod:`nvfp4lab.kernels.hessian_products`).

All are plain C ABI (pointers, sizes, float32 scalars; no torch header), compiled without
fast-math and without FMA contraction (each float32 step one IEEE operation, as in the eager
pipeline) and pick their vector path (AVX-512, AVX2, a scalar loop) at run time from the CPU's
flags.

Build. The first use on a machine builds the library with
:func:`torch.utils.cpp_extension.load` (the C++ compiler inductor needs too, and ninja) into
``<cache>/cpp/native-<hash of the sources, flags and torch version>`` under
:func:`nvfp4lab.settings.cache_dir` (about 4 s on the 2-core CPU); a later process finds it there
and loads it in about a millisecond. The cache is checked, never trusted:

* its stamp ``built.ok`` records the size and SHA-256 of the ``.so`` it built; every process
  compares them before it loads the file, and never loads one that differs (truncated,
  overwritten, emptied, replaced: a ``dlopen`` of such a file crashed the process with SIGBUS
  or SIGTRAP, or failed and left the slow path for good);
* one that differs is rebuilt once (one that matches but does not load, e.g. in a ``noexec``
  folder, is the file a build would make again: that error falls back at once): into a fresh sibling
  folder (``native-<hash>.tmp-<pid>-<token>``), verified, then renamed into place (the broken
  folder renamed aside and deleted first), so no process ever sees a half-written library and
  none that has the old one mapped sees it change;
* builders take an exclusive ``flock`` on ``native-<hash>.lock`` beside the folder, which the
  kernel releases when its process dies (a builder killed with SIGKILL blocks nobody; its
  half-built ``.tmp-`` folder is swept by the next builder); a process that finds the lock held
  by a live builder logs ONE WARNING line naming it (pid and host, which the holder writes into
  the lock file) and waits for it, up to :data:`BUILD_WAIT_S`.

When it cannot be built (not an x86-64 CPU, no compiler, no ninja, a build error) :func:`available`
is False, ONE WARNING line on the ``nvfp4lab.kernels`` logger says why, and every caller runs the
compiled graphs or the eager pipeline instead (:func:`nvfp4lab.kernels.fused_route` decides).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import secrets
import shutil
import socket
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from nvfp4lab.settings import cache_dir, native_isa
from nvfp4lab.vocab import NativeIsa, check_choice

__all__ = [
    "BUILD_WAIT_S",
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
    Path(__file__).with_name("ggml_dot.cpp"),
    Path(__file__).with_name("hessian_products.cpp"),
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
#: Longest a process waits for a live builder holding the build lock (the build takes ~4 s on
#: the 2-core CPU); then it runs without the library (one WARNING line).
BUILD_WAIT_S = 600.0
#: The stamp is a few dozen bytes of JSON; anything longer is not one of ours.
_STAMP_MAX_BYTES = 4096

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
    "nvfp4lab_ggml_isa": ([], _int),
    "nvfp4lab_q8_0_quantize": ([_ptr, _i64, _int, _int, _ptr, _ptr], _i64),
    "nvfp4lab_nvfp4_q8_0_mul_mat": (
        [_ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _int, _int, _ptr], _int),
    "nvfp4lab_nvfp4_q8_0_linear": ([_ptr, _i64, _ptr, _ptr, _i64, _i64, _int, _int, _ptr], _i64),
    "nvfp4lab_gram_isa": ([], _int),
    "nvfp4lab_gram_add": ([_ptr, _i64, _i64, _i64, _int, _int, _ptr], _int),
    "nvfp4lab_block_congruence": ([_ptr, _i64, _ptr, _i64, _int, _int], _int),
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
    """Build the library in the fresh ``folder`` with cpp_extension; the ``.so``'s path."""
    folder.mkdir(parents=True)
    copies = []
    for source in (*SOURCES, *HEADERS):
        copy = folder / source.name
        copy.write_bytes(source.read_bytes())
        if source in SOURCES:
            copies.append(str(copy))
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


def _digest(path: Path) -> tuple[int, str]:
    """(size in bytes, SHA-256 hex digest) of the file at ``path``."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _verified(folder: Path) -> Path | None:
    """The library in ``folder`` when its size and SHA-256 are those its stamp recorded at build
    time; None when the stamp or the file is missing, unreadable or different."""
    try:
        with (folder / _STAMP).open("rb") as f:
            stamp = json.loads(f.read(_STAMP_MAX_BYTES))
        name, size, sha256 = stamp["file"], stamp["size"], stamp["sha256"]
        if not isinstance(name, str) or Path(name).name != name or not isinstance(size, int):
            return None
        built = folder / name
        if not built.is_file() or built.is_symlink() or built.stat().st_size != size:
            return None
        return built if _digest(built) == (size, sha256) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _holder(lock: Path) -> str:
    """Who holds the build lock, as its holder wrote it ("process PID on HOST")."""
    with contextlib.suppress(OSError):
        with lock.open("rb") as f:
            text = f.read(200).decode(errors="replace").strip()
        if text:
            return text
    return "another process"


def _try_lock(fd: int) -> bool:
    """Take the exclusive ``flock`` on ``fd`` if free; False while another process holds it. True
    also where the file system has no ``flock`` (some network file systems): the build then goes
    on unlocked, and the rename into place still keeps every reader safe."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
    return True


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Hold the exclusive build lock of ``folder`` (an ``flock`` on ``<folder>.lock``, released by
    the kernel when the holder dies). A live holder is waited for, with one WARNING line naming
    it, up to :data:`BUILD_WAIT_S` (then TimeoutError)."""
    lock = folder.with_name(folder.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the compiler's processes
    try:
        if not _try_lock(fd):
            holder = _holder(lock)
            _LOG.warning(
                "nvfp4lab: waiting for %s, which is building the C++ CPU kernels in %s "
                "(up to %.0f s)", holder, folder, BUILD_WAIT_S,
            )
            deadline = time.monotonic() + BUILD_WAIT_S
            while not _try_lock(fd):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{holder} has held the build lock {lock} for {BUILD_WAIT_S:.0f} s"
                    )
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _rebuild(folder: Path) -> None:
    """Build the library into a fresh sibling of ``folder``, stamp it with its size and SHA-256,
    and rename it into place (the old ``folder`` renamed aside, then deleted). Called with the
    build lock held: any ``.tmp-`` / ``.old-`` sibling is a dead builder's, removed first."""
    for stale in (*folder.parent.glob(folder.name + ".tmp-*"),
                  *folder.parent.glob(folder.name + ".old-*")):
        shutil.rmtree(stale, ignore_errors=True)
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    fresh = folder.with_name(f"{folder.name}.tmp-{token}")
    try:
        built = _build(fresh)
        canonical = fresh / f"{_NAME}.so"
        if built != canonical:  # cpp_extension numbers a second build in one process (_v1)
            os.replace(built, canonical)
        size, sha256 = _digest(canonical)
        stamp = {"file": canonical.name, "size": size, "sha256": sha256}
        (fresh / _STAMP).write_text(json.dumps(stamp))
        if folder.exists() or folder.is_symlink():
            old = folder.with_name(f"{folder.name}.old-{token}")
            os.rename(folder, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(fresh, folder)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)  # a failed build's leftovers


def _load(folder: Path) -> ctypes.CDLL:
    """The library of ``folder``, loaded only once verified against its stamp; built (or
    rebuilt, once) where it is missing or differs from its stamp. A verified library that does
    not load (a ``noexec`` cache folder, a missing ``libgomp``) is the very file a build makes
    here: its error is raised at once (the caller falls back) instead of every process paying a
    build that would fail the same way."""
    found = _verified(folder)
    if found is not None:
        return _open(found)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder):
        found = _verified(folder)  # another process may have built it meanwhile
        if found is not None:
            return _open(found)
        _rebuild(folder)
        found = _verified(folder)
        if found is None:
            raise RuntimeError(f"the library built in {folder} does not match its stamp")
        return _open(found)


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
        return _load(build_dir())
    except Exception as exc:  # any failure of the build means: no native kernels here
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        _LOG.warning(
            "nvfp4lab: the C++ CPU kernels (LUT decode, block encode, GPTQ column loop, q8_0 "
            "dot) are unavailable (%s: %s); running the compiled or eager path",
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
