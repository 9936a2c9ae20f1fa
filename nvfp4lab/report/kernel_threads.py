"""Inside a report kernel: torch threads that follow the runner's allotment between cells.

The report runner starts its own kernels (``kernel_name=None``) with this module as an IPython
extension (``--IPKernelApp.extra_extensions=nvfp4lab.report.kernel_threads``) and the path of a
small text file in :data:`THREADS_FILE_ENV`. The runner writes the number of cores the notebook
may use into that file (one whole number) whenever its share changes: when the other notebooks
of the run have finished, the last ones running get their cores. The kernel then sets
``NVFP4LAB_THREADS`` in its own environment (what :func:`nvfp4lab.settings.use_torch_threads`
reads) and, once torch is imported, ``torch.set_num_threads``, in the main thread, where cells
run (torch's OpenMP and MKL thread counts belong to the thread that sets them):

* before each cell (IPython's ``pre_run_cell`` event), and
* within a running cell: a watcher thread reads the file every :data:`POLL_S` seconds and, when
  the number changed, raises :data:`SIGNAL` in the main thread (``_thread.interrupt_main``),
  whose handler applies it between two Python steps, i.e. between two torch operations: a
  notebook whose one long cell runs most of its time gets the freed cores at once.

A missing, empty or unreadable file changes nothing; a user's own handler of :data:`SIGNAL` is
left alone (then only the cell boundary applies).
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from nvfp4lab.settings import THREADS_ENV, thread_limit

__all__ = [
    "POLL_S",
    "SIGNAL",
    "THREADS_FILE_ENV",
    "load_ipython_extension",
    "read_threads",
    "update_threads",
    "watch_threads",
]

#: Environment variable of a report kernel: the file holding its current core allotment.
THREADS_FILE_ENV = "NVFP4LAB_THREADS_FILE"
#: Seconds between two reads of the threads file by a kernel's watcher thread.
POLL_S = 0.5
#: The signal the watcher raises in the kernel's main thread when the allotment changed.
SIGNAL = signal.SIGUSR1


def read_threads(path: str | Path) -> int | None:
    """The whole number in ``path`` (1 to :func:`~nvfp4lab.settings.thread_limit`), or None when
    the file is missing, being written or holds anything else."""
    try:
        threads = int(Path(path).read_text(encoding="ascii").strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return threads if 1 <= threads <= thread_limit() else None


def update_threads(path: str | Path) -> int | None:
    """Apply the allotment in ``path`` to this process (``NVFP4LAB_THREADS`` and, if torch is
    imported, its intra-op threads); the number applied, or None when there was none."""
    threads = read_threads(path)
    if threads is None:
        return None
    os.environ[THREADS_ENV] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def watch_threads(path: str | Path, *, poll_s: float = POLL_S) -> threading.Event | None:
    """From the main thread: apply ``path`` on :data:`SIGNAL` and start a daemon thread raising
    it in the main thread whenever the number in ``path`` changes. Returns the event that stops
    the watcher, or None (nothing started) when :data:`SIGNAL` already has a handler."""
    if signal.getsignal(SIGNAL) is not signal.SIG_DFL:
        return None
    signal.signal(SIGNAL, lambda signum, frame: update_threads(path))
    stop = threading.Event()

    def watch() -> None:
        seen = read_threads(path)
        while not stop.wait(poll_s):
            now = read_threads(path)
            if now is not None and now != seen:
                seen = now
                _thread.interrupt_main(SIGNAL)

    threading.Thread(target=watch, name="nvfp4lab-threads", daemon=True).start()
    return stop


def load_ipython_extension(ipython: Any) -> None:
    """When the kernel was given a threads file: the update before each cell (IPython's
    ``pre_run_cell`` event) and the watcher within cells (:func:`watch_threads`); otherwise
    nothing."""
    path = os.environ.get(THREADS_FILE_ENV, "").strip()
    if not path:
        return

    def before_cell(*_: Any) -> None:
        update_threads(path)

    ipython.events.register("pre_run_cell", before_cell)
    watch_threads(path)
