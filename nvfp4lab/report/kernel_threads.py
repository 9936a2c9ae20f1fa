"""Inside a report kernel: torch threads that follow the runner's allotment between cells.

The report runner starts its own kernels (``kernel_name=None``) with this module as an IPython
extension (``--IPKernelApp.extra_extensions=nvfp4lab.report.kernel_threads``) and the path of a
small text file in :data:`THREADS_FILE_ENV`. The runner writes the number of cores the notebook
may use into that file (one whole number) whenever its share changes: when the other notebooks
of the run have finished, the last ones running get their cores. Before each cell the kernel
reads the file and, when the number changed, sets ``NVFP4LAB_THREADS`` in its own environment
(what :func:`nvfp4lab.settings.use_torch_threads` reads) and, once torch is imported,
``torch.set_num_threads`` (the main thread, where cells run). A cell already running keeps its
threads; a missing, empty or unreadable file changes nothing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from nvfp4lab.settings import THREADS_ENV, thread_limit

__all__ = ["THREADS_FILE_ENV", "load_ipython_extension", "read_threads", "update_threads"]

#: Environment variable of a report kernel: the file holding its current core allotment.
THREADS_FILE_ENV = "NVFP4LAB_THREADS_FILE"


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


def load_ipython_extension(ipython: Any) -> None:
    """Register the before-each-cell update (IPython's ``pre_run_cell`` event) when the kernel
    was given a threads file; otherwise do nothing."""
    path = os.environ.get(THREADS_FILE_ENV, "").strip()
    if not path:
        return

    def before_cell(*_: Any) -> None:
        update_threads(path)

    ipython.events.register("pre_run_cell", before_cell)
