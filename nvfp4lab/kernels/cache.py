"""The fused kernels' persistent cache: where inductor keeps them, and what it already holds.

Inductor caches what it compiles on disk (FX graphs, AOTAutograd results, the C++ libraries) and
a later process loads them instead of compiling again: the first fused call of a process costs
seconds either way (importing dynamo and inductor, checking the CPU's vector ISAs), but ~4x less
with a warm cache than with a cold one (docs/throughput.md, "Fused kernels"). Two things make that
usable:

* the directory (:func:`prepare`, before the first compilation of a process): inductor's default
  is ``/tmp/torchinductor_<user>``, which does not survive a reboot or a tmp cleaner; nvfp4lab
  points it at ``<cache_dir>/inductor/<cpu signature>`` (:func:`nvfp4lab.settings.use_kernel_cache`:
  one folder per instruction set and ``ATEN_CPU_CAPABILITY``, since inductor's own keys do not
  tell them apart and its AVX-512 code ran under AVX2 computed wrong values; a
  ``TORCHINDUCTOR_CACHE_DIR`` the user set wins);
* the marker (:func:`warm`): after a fused call has run, ``<kernel cache>/nvfp4lab/<key>.json``
  records its device type, dtype and graph kinds, ``key`` naming everything that decides
  whether inductor's entries can be reused (torch and Python versions, the machine, the source
  of :mod:`~nvfp4lab.kernels.graphs` and :mod:`~nvfp4lab.kernels.compiled`). The ``auto``
  policy (:func:`nvfp4lab.kernels.auto_decision`) reads it: a warm cache makes compiling cheap
  enough to do at once for large tensors. The marker lives inside the cache it describes, so
  deleting that directory (or pointing ``TORCHINDUCTOR_CACHE_DIR`` elsewhere) makes the machine
  cold again. Writing it is best effort (atomic replace; a read-only disk only loses the hint).

It also remembers, per process, the device types on which a fused call has run (:func:`started`):
there the one-time start-up is paid and the policy compiles any large call.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from nvfp4lab.settings import kernel_cache_dir, use_kernel_cache

__all__ = [
    "MARKER_DIR",
    "marker_path",
    "note_ran",
    "prepare",
    "started",
    "warm",
]

#: The marker's folder inside inductor's cache directory.
MARKER_DIR = "nvfp4lab"

_LOG = logging.getLogger(__name__)
_STARTED: set[str] = set()
#: (device type, dtype name, graph kind) this process has recorded (or read from the marker).
_NOTED: set[tuple[str, str, str]] = set()


@functools.cache
def prepare() -> Path:
    """Point inductor at the kernel cache (once per process, before anything compiles) and
    return its directory; see :func:`nvfp4lab.settings.use_kernel_cache`. Says which directory
    and why in one INFO line on the ``nvfp4lab.kernels.cache`` logger."""
    chosen = kernel_cache_dir()[1]
    path = use_kernel_cache()
    why = "TORCHINDUCTOR_CACHE_DIR, which wins" if chosen else "nvfp4lab's default"
    _LOG.info("nvfp4lab: compiled kernels are cached in %s (%s)", path, why)
    return path


@functools.cache
def _key() -> str:
    """What must match for inductor's cached entries to be reusable, hashed (16 hex digits)."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for part in (torch.__version__, sys.version, platform.machine(), platform.system()):
        digest.update(part.encode() + b"\0")
    for name in ("graphs.py", "compiled.py"):
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


def marker_path(directory: Path | None = None) -> Path:
    """The marker file of this torch / Python / machine / kernel source in ``directory``
    (default: the kernel cache directory this process uses or will use)."""
    base = directory if directory is not None else kernel_cache_dir()[0]
    return base / MARKER_DIR / f"{_key()}.json"


@functools.cache
def _read(path: Path) -> frozenset[tuple[str, str, str]]:
    """The entries of the marker at ``path`` when this process first asked (none if absent or
    unreadable)."""
    try:
        entries = json.loads(path.read_text())["ran"]
        return frozenset((str(d), str(t), str(k)) for d, t, k in entries)
    except (OSError, ValueError, KeyError, TypeError):
        return frozenset()


def warm(device_type: str, dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel cache already holds fused graphs for ``device_type`` (and ``dtype``,
    when given): recorded by a process that ran them, or by this one."""
    entries = _NOTED | _read(marker_path())
    want = None if dtype is None else str(dtype).removeprefix("torch.")
    return any(d == device_type and (want is None or t == want) for d, t, _ in entries)


def started(device_type: str) -> bool:
    """Whether a fused call has run on ``device_type`` in this process (start-up paid)."""
    return device_type in _STARTED


def note_ran(device_type: str, dtype: torch.dtype, kinds: tuple[str, ...]) -> None:
    """Record that graphs ``kinds`` ran on ``device_type`` for ``dtype``: in this process, and
    in the marker when they are new to it. Cheap when already recorded (a set lookup)."""
    name = str(dtype).removeprefix("torch.")
    new = {(device_type, name, k) for k in kinds} - _NOTED
    _STARTED.add(device_type)
    if not new:
        return
    _NOTED.update(new)
    path = marker_path(prepare())
    if new <= _read(path):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            current = json.loads(path.read_text()).get("ran", [])
        except (OSError, ValueError, AttributeError):
            current = []
        entries = sorted({tuple(e) for e in current} | _NOTED)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".marker-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump({"torch": torch.__version__, "ran": entries}, fh)
        os.replace(tmp, path)
    except OSError as exc:  # the marker is a hint: a read-only cache only loses it
        _LOG.debug("nvfp4lab: kernel cache marker not written (%s)", exc)
