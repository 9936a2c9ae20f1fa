"""The table-lookup (LUT) decode: a small C++ kernel that decodes NVFP4 weights on the CPU.

``decode(packed, scales, t, dtype, rule=...)`` returns what the eager decode
(:func:`nvfp4lab.tensor.decode_blocks`, the arithmetic of every
:class:`~nvfp4lab.orders.DecodeRule`) returns, bit for bit: ``value(code)·(s / t)`` or
``value(code)·(s·t)`` in float32, one round-to-nearest-even to float32 / bfloat16 / float16.
The result depends only on the (scale byte, code) pair, so each call first computes the 256 x 16
results with exactly that float32 arithmetic (one IEEE operation per step, no fast-math, no FMA
contraction), and decoding is a gather: per 16-element block, the row of its scale byte indexed
by the 16 codes (AVX-512 ``vpermw`` / ``vpermps``, AVX2 ``pshufb`` / ``vpermps``, a scalar loop;
the path is picked at run time from the CPU's flags). The source is ``lut_decode.cpp`` beside
this module (package data).

Build. The first use on a machine builds it with :func:`torch.utils.cpp_extension.load` (the C++
compiler inductor needs too, and ninja) into ``<cache>/cpp/lut_decode-<source hash>`` under
:func:`nvfp4lab.settings.cache_dir` (0.9 s on the 2-core CPU; other processes wait on
cpp_extension's lock file); a later process finds the library there and loads it with
:mod:`ctypes` in under a millisecond. The kernel includes no torch header: it is plain C ABI
(pointers, sizes, the float32 tensor scale).
When it cannot be built (no compiler, no ninja, a build error) :func:`available` is False, ONE
WARNING line on the ``nvfp4lab.kernels`` logger says why, and callers decode with the compiled
graph or eagerly (:func:`nvfp4lab.kernels.fused_route` decides).
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

from nvfp4lab.orders import DecodeRule
from nvfp4lab.settings import cache_dir

__all__ = [
    "ISAS",
    "SOURCE",
    "RowDecoder",
    "available",
    "build_dir",
    "decode",
    "isa",
    "usable",
]

#: The C++ source (package data).
SOURCE: Path = Path(__file__).with_name("lut_decode.cpp")
#: The gather paths by the number the library uses: 0 scalar, 1 AVX2, 2 AVX-512 (F + BW).
ISAS: tuple[str, ...] = ("scalar", "avx2", "avx512")

_NAME = "nvfp4lab_lut_decode"
_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math"]
_STAMP = "built.ok"
_X86_64 = ("x86_64", "amd64")
#: A build lock older than this was left by a process that died while building: removed.
_STALE_LOCK_S = 600.0
_RULES = {DecodeRule.SCALE_OVER_ENCODE: 0, DecodeRule.SCALE_TIMES_DECODE: 1}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: Below this many blocks (64 K elements) one thread decodes (the library's own threshold too).
_PARALLEL_BLOCKS = 4096

_LOG = logging.getLogger("nvfp4lab.kernels")


def build_dir() -> Path:
    """Where the library is built: ``<cache_dir>/cpp/lut_decode-<hash>``, the hash of the
    source, the flags and torch's version (a changed source builds anew, never in place)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join([*_FLAGS, torch.__version__]).encode())
    return cache_dir() / "cpp" / f"lut_decode-{digest.hexdigest()[:16]}"


def _build(folder: Path) -> Path:
    """Build (or find) the library in ``folder`` with cpp_extension; its path."""
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / SOURCE.name
    if not source.exists():
        source.write_bytes(SOURCE.read_bytes())
    lock = folder / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    from torch.utils.cpp_extension import load

    with warnings.catch_warnings():  # compiler-version notices: the build either works or not
        warnings.simplefilter("ignore")
        path = load(
            name=_NAME,
            sources=[str(source)],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )
    return Path(str(path))


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.nvfp4lab_lut_isa.argtypes = []
    lib.nvfp4lab_lut_isa.restype = ctypes.c_int
    lib.nvfp4lab_lut_decode.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.nvfp4lab_lut_decode.restype = ctypes.c_int
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The loaded library, built on first use; None (one WARNING line) when it cannot be."""
    try:
        if platform.machine().lower() not in _X86_64:
            raise RuntimeError(f"an x86-64 kernel, this CPU is {platform.machine() or 'unknown'}")
        folder = build_dir()
        built = folder / f"{_NAME}.so"
        if not ((folder / _STAMP).exists() and built.exists()):
            built = _build(folder)
            (folder / _STAMP).write_text(str(built))
        return _open(built)
    except Exception as exc:  # any failure of the build means: no LUT decode here
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        _LOG.warning(
            "nvfp4lab: the C++ LUT decode is unavailable (%s: %s); decoding with the compiled "
            "or eager path",
            type(exc).__name__,
            first,
        )
        return None


def available() -> bool:
    """Whether the LUT decode works here: its library built (or found) and loaded, once per
    process (see the module docstring)."""
    return _library() is not None


def usable(device: torch.device) -> bool:
    """Whether tensors on ``device`` can be decoded by the LUT kernel (a CPU, the library
    available)."""
    return device.type == "cpu" and available()


def isa() -> str:
    """The gather path this CPU runs (an entry of :data:`ISAS`); "" when unavailable."""
    lib = _library()
    return "" if lib is None else ISAS[lib.nvfp4lab_lut_isa()]


class RowDecoder:
    """One weight bound for decoding row ranges into buffers with one library call each (no
    per-call tensor bookkeeping: the tiles of :func:`nvfp4lab.kernels.linear.tiled_matmul`).
    ``decoder(start, stop, out)`` decodes rows ``start:stop`` into ``out`` (contiguous, at
    least that many rows, ``dtype``); the arguments are as in :func:`decode`."""

    def __init__(
        self,
        packed: torch.Tensor,
        scales: torch.Tensor,
        tensor_scale: torch.Tensor,
        dtype: torch.dtype,
        *,
        rule: DecodeRule = DecodeRule.SCALE_OVER_ENCODE,
        threads: int | None = None,
    ) -> None:
        lib = _library()
        if lib is None:
            raise RuntimeError("the C++ LUT decode is unavailable here (see the logged warning)")
        self._packed = packed.reshape(-1, packed.shape[-1]).contiguous()
        self._scales = scales.view(torch.uint8).reshape(self._packed.shape[0], -1).contiguous()
        self._call = lib.nvfp4lab_lut_decode
        self._packed_ptr = self._packed.data_ptr()
        self._scales_ptr = self._scales.data_ptr()
        self._row_bytes = self._packed.shape[1]
        self._row_blocks = self._scales.shape[1]
        self._t = (
            tensor_scale.item() if tensor_scale.dtype == torch.float32 else float(tensor_scale)
        )
        self._rule = _RULES[rule]
        self._dtype = _DTYPES[dtype]
        self._threads = torch.get_num_threads() if threads is None else threads
        self._best = len(ISAS) - 1

    def __call__(self, start: int, stop: int, out: torch.Tensor) -> None:
        nblocks = (stop - start) * self._row_blocks
        self._call(
            self._packed_ptr + start * self._row_bytes,
            self._scales_ptr + start * self._row_blocks,
            nblocks,
            self._t,
            self._rule,
            self._dtype,
            self._best,
            self._threads if nblocks >= _PARALLEL_BLOCKS else 1,
            out.data_ptr(),
        )


def decode(
    packed: torch.Tensor,
    scales: torch.Tensor,
    tensor_scale: torch.Tensor,
    dtype: torch.dtype,
    *,
    rule: DecodeRule = DecodeRule.SCALE_OVER_ENCODE,
    out: torch.Tensor | None = None,
    path: str | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Decode ``packed`` uint8 [..., K/2] with E4M3 ``scales`` [..., K/16] (float8_e4m3fn or its
    uint8 bytes) and the float32 [1] ``tensor_scale`` (ENCODE ``gs`` for ``SCALE_OVER_ENCODE``,
    DECODE ``d`` for ``SCALE_TIMES_DECODE``) to ``dtype`` (fp32/bf16/fp16) [..., K], on the CPU,
    bit for bit the eager decode. ``out``: a contiguous result buffer of that shape and dtype.
    ``path``: force a gather path of :data:`ISAS` (tests; clamped to what the CPU has; default:
    the best). ``threads``: OpenMP threads (default: torch's intra-op threads). Raises
    RuntimeError when the library is unavailable (ask :func:`available` first)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the C++ LUT decode is unavailable here (see the logged warning)")
    packed = packed.contiguous()
    raw = scales.view(torch.uint8).contiguous()
    nblocks = raw.numel()
    shape = (*packed.shape[:-1], packed.shape[-1] * 2)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    elif out.dtype != dtype or not out.is_contiguous() or out.numel() != 2 * packed.numel():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of {2 * packed.numel()} elements (shape "
            f"{shape}), got {out.dtype} {tuple(out.shape)}"
        )
    if nblocks == 0:
        return out
    t = tensor_scale.item() if tensor_scale.dtype == torch.float32 else float(tensor_scale)
    wanted = len(ISAS) - 1 if path is None else ISAS.index(path)
    workers = torch.get_num_threads() if threads is None else threads
    lib.nvfp4lab_lut_decode(
        packed.data_ptr(),
        raw.data_ptr(),
        nblocks,
        t,
        _RULES[rule],
        _DTYPES[dtype],
        wanted,
        workers if nblocks >= _PARALLEL_BLOCKS else 1,
        out.data_ptr(),
    )
    return out
