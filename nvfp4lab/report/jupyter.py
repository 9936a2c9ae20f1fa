"""Running one report notebook in a watched Jupyter kernel (the report runner's engine).

:func:`execute_notebook` runs a notebook with papermill in a kernel started by an async kernel
manager of our own (:func:`_kernel_manager_class`: this interpreter, text progress bars) and
registered with a :class:`Running` registry. The registry is how a run stops its kernels: a
notebook past its time limit has its kernel killed (nbclient then fails it within about a
second), and one Ctrl-C in the main thread kills every kernel running at that moment, however
many notebooks run side by side (:meth:`Running.on_ctrl_c`).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nvfp4lab.report.kernel_threads import THREADS_FILE_ENV
from nvfp4lab.report.notebook_imports import skip_iri_format_backend
from nvfp4lab.report.pages import kernel_env
from nvfp4lab.settings import environ

__all__ = ["DEFAULT_TIMEOUT_S", "KernelWatch", "Running", "error_text", "execute_notebook"]

#: Default time limit of one notebook (seconds): generous, so that only a stuck notebook hits it.
DEFAULT_TIMEOUT_S: float = 1800.0


class KernelWatch:
    """The kernel(s) one notebook's run started, so that it can be stopped (killed)."""

    def __init__(self) -> None:
        self.managers: list[Any] = []
        self.expired = False

    def kill(self) -> None:
        for km in self.managers:
            process = getattr(getattr(km, "provisioner", None), "process", None)
            if process is not None and process.poll() is None:
                process.kill()

    def expire(self) -> None:
        """The time limit passed: kill, and remember why (the error says "timed out")."""
        self.expired = True
        self.kill()


class Running:
    """The notebooks of one report run that are executing now (one, or several side by side)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: set[KernelWatch] = set()
        self.stopped = threading.Event()

    @contextlib.contextmanager
    def watching(self, watch: KernelWatch) -> Iterator[None]:
        with self._lock:
            self._watches.add(watch)
        try:
            yield
        finally:
            with self._lock:
                self._watches.discard(watch)

    def stop(self) -> None:
        """Ctrl-C: mark the run stopped and kill every running kernel (they run in sessions of
        their own, so the terminal's SIGINT never reaches them)."""
        self.stopped.set()
        with self._lock:
            watches = list(self._watches)
        for watch in watches:
            watch.kill()

    @contextlib.contextmanager
    def on_ctrl_c(self) -> Iterator[None]:
        """While inside, SIGINT stops the run (:meth:`stop`, kernels first: a kernel shut down
        mid-cell prints tracebacks on our stderr) and raises KeyboardInterrupt in the main
        thread. A no-op off the main thread or under a handler installed by someone else."""
        ours = (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        if not ours:
            yield
            return

        def interrupted(signum: int, frame: Any) -> None:
            self.stop()
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, interrupted)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)


#: The IPython extension our own kernels load: torch threads follow the runner's threads file.
THREADS_EXTENSION = "nvfp4lab.report.kernel_threads"


def _kernel_manager_class(kernel_name: str | None, watch: KernelWatch, threads: int | None = None,
                          threads_file: Path | None = None) -> type:
    """An ASYNC jupyter kernel manager (nbclient must poll the kernel's liveness while a cell runs;
    a blocking client waits forever on a dead kernel) that registers itself with ``watch``.

    ``kernel_name=None``: the kernel is ``sys.executable -m ipykernel_launcher``, with the folder
    holding this ``nvfp4lab`` first on its PYTHONPATH so the notebook imports the same package as
    the runner, even without an install. Otherwise the installed kernelspec of that name; both
    with :func:`nvfp4lab.report.pages.kernel_env` (no progress bars; ``threads`` torch threads)
    added to their environment. ``threads_file``: our kernel loads :data:`THREADS_EXTENSION`,
    which applies the number in that file before each cell (a named kernelspec keeps
    ``threads``).
    """
    import os

    import zmq
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    package_root = str(Path(__file__).resolve().parents[2])  # the folder holding nvfp4lab/
    pythonpath = os.pathsep.join(p for p in (package_root, environ().get("PYTHONPATH")) if p)
    # Encrypt the kernel's local TCP channels when pyzmq can (CurveZMQ); ipykernel warns otherwise.
    curve = bool(zmq.has("curve"))
    named = kernel_name is not None
    env = kernel_env(threads)
    extension: list[str] = []
    if threads_file is not None:
        env[THREADS_FILE_ENV] = str(threads_file)
        extension = [f"--IPKernelApp.extra_extensions={THREADS_EXTENSION}"]

    class ThisPythonKernelSpecManager(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
            if named:  # an installed kernelspec, with the report pages' variables added
                spec = super().get_kernel_spec(kernel_name)
                spec.env = {**spec.env, **env}
                return spec
            return KernelSpec(
                argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                      *extension],
                display_name=f"Python ({sys.executable})",
                language="python",
                env={"PYTHONPATH": pythonpath, **env},
                metadata={"supported_encryption": ["curve"]} if curve else {},
                resource_dir="",
            )

    class WatchedKernelManager(AsyncKernelManager):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            watch.managers.append(self)

        @default("kernel_spec_manager")
        def _default_ksm(self) -> KernelSpecManager:
            return ThisPythonKernelSpecManager()

        async def _async_interrupt_kernel(self) -> None:
            # jupyter_client sends SIGINT before every shutdown. nbclient shuts a kernel down
            # once its notebook is done (the cells ran, one raised, or the watchdog killed it),
            # so the signal stops nothing; it only made an idle ipykernel log "ERROR |
            # KeyboardInterrupt caught in kernel." on the runner's stderr. An interrupt asked
            # for outside a shutdown is sent as before.
            if not self.shutting_down:
                await super()._async_interrupt_kernel()

        if not named:

            @default("transport_encryption")
            def _default_encryption(self) -> str:
                return "auto" if curve else "disabled"

    return WatchedKernelManager


def error_text(exc: BaseException, timed_out: float | None = None) -> str:
    """One line on why a notebook run failed (time limit, dead kernel, the cell's exception)."""
    if timed_out is not None:
        return (
            f"timed out: still running after the {timed_out:g} s limit (--timeout); its kernel "
            "was stopped"
        )
    if type(exc).__name__ == "DeadKernelError":
        return (
            "kernel died: the notebook's Python process ended while a cell ran (killed, e.g. by "
            "the out-of-memory killer, or os._exit); run the notebook alone to see where"
        )
    ename = getattr(exc, "ename", None)
    if ename:  # papermill.PapermillExecutionError
        cell = getattr(exc, "exec_count", None)
        where = f" (cell [{cell}])" if cell is not None else ""
        return f"{ename}: {getattr(exc, 'evalue', '')}{where}"
    return f"{type(exc).__name__}: {exc}"



def _cell_hooks(on_cell: Callable[[int, int], None]) -> dict[str, Callable[..., None]]:
    """nbclient's hooks calling ``on_cell(done, total)`` after each code cell that ran."""
    count = {"done": 0, "total": 0}

    def notebook_start(notebook: Any, **_: Any) -> None:
        count["total"] = sum(1 for c in notebook.cells
                             if c.cell_type == "code" and c.source.strip())
        on_cell(0, count["total"])

    def cell_executed(**_: Any) -> None:
        count["done"] += 1
        on_cell(count["done"], count["total"])

    return {"on_notebook_start": notebook_start, "on_cell_executed": cell_executed}


def execute_notebook(
    path: Path, out_ipynb: Path, parameters: dict[str, Any], kernel_name: str | None,
    timeout_s: float, running: Running, *, threads: int | None = None,
    threads_file: Path | None = None, on_cell: Callable[[int, int], None] | None = None,
) -> str | None:
    """Run one notebook with papermill into ``out_ipynb``; the error text, or None when it ran
    through. Raises KeyboardInterrupt when ``running`` was stopped (Ctrl-C) meanwhile.

    A watchdog kills the notebook's kernel once ``timeout_s`` has passed; each cell is also
    limited to ``timeout_s`` (nbclient's own execution timeout). ``threads``: the kernel's torch
    threads at its start (default :func:`~nvfp4lab.settings.torch_threads`); ``threads_file``:
    where the runner writes its later share (see :func:`_kernel_manager_class`);
    ``on_cell(done, total)`` is called after each code cell ran (nonempty code cells).
    """
    import logging

    skip_iri_format_backend()
    import papermill

    # papermill's logger would print nbclient's "Kernel died while waiting for execute reply."
    # (Python's last-resort handler) under the runner's own one-line error; a user's logging
    # configuration still receives its records.
    papermill_log = logging.getLogger("papermill")
    if not papermill_log.handlers:
        papermill_log.addHandler(logging.NullHandler())
    watch = KernelWatch()
    hooks = _cell_hooks(on_cell) if on_cell is not None else {}
    timer = threading.Timer(timeout_s, watch.expire)
    timer.daemon = True
    timer.start()
    try:
        with running.watching(watch):
            if running.stopped.is_set():
                raise KeyboardInterrupt
            papermill.execute_notebook(
                str(path),
                str(out_ipynb),
                parameters=parameters or None,
                kernel_name=kernel_name or "python3",
                language="python",  # parameters are injected as Python, whatever the metadata
                kernel_manager_class=_kernel_manager_class(kernel_name, watch, threads,
                                                           threads_file),
                execution_timeout=timeout_s,
                # The kernel starts in the notebook's folder (nbclient's resources path), never
                # through papermill's cwd=, an os.chdir of the whole process for the run: with
                # --jobs the threads raced on it, a kernel could start in another folder and the
                # process could end in the notebooks' folder.
                resources={"metadata": {"path": str(path.parent)}},
                progress_bar=False,
                log_output=False,
                **hooks,
            )
    except Exception as exc:  # keep going: the index and the partial HTML show what failed
        if running.stopped.is_set():
            raise KeyboardInterrupt from None
        return error_text(exc, timeout_s if watch.expired else None)
    finally:
        timer.cancel()
    if running.stopped.is_set():
        raise KeyboardInterrupt
    return None
