"""Work on checkpoints larger than memory: an inventory read from the weight files' headers
alone, tensors read a few rows at a time from memory-mapped files, and tasks run on a local
process pool or an existing Dask cluster.

Nothing here builds a model or holds a whole checkpoint: :func:`inventory` reads only headers
(through the format's ``read_weights``); :class:`RowReader` (``files``, re-exported here) maps
one tensor's byte range (``numpy.memmap``) and copies out the rows asked for, or reads them
through the tensor's view; :func:`run_tasks` sends picklable tasks (a shard, a layer or a fused
group each) to ``concurrent.futures.ProcessPoolExecutor`` (spawned workers, ``workers`` of them;
0 runs them in this process) or to ``dask.distributed.Client(address)``, with a tqdm bar on
stderr when asked. Pool workers die with the process that started them (even by SIGKILL) and
leave Ctrl-C to it; the Dask client is passed to every call (it is never the process's default
client), and tasks name files by absolute path (a Dask worker runs in a folder of its own).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from nvfp4lab.checkpoint.folders import hf_snapshot
from nvfp4lab.checkpoint.formats import detect_format, format_spec, registered_format
from nvfp4lab.checkpoint.records import TensorInfo
from nvfp4lab.checkpoint.rows import RowReader, read_scalar
from nvfp4lab.settings import torch_threads, tqdm_class
from nvfp4lab.vocab import CheckpointFormat

__all__ = [
    "DEFAULT_WORKERS",
    "Inventory",
    "RowReader",
    "TensorInfo",
    "check_workers",
    "inventory",
    "read_scalar",
    "run_tasks",
]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Inventory:
    """A checkpoint described from its headers: ``tensors`` (name -> :class:`TensorInfo`, in
    file and byte order, under nvfp4lab's names), the weight ``files``, each file's metadata,
    and ``layers``: the names of the quantized Linears (those with a tensor-scale tensor of the
    format, and, in a format whose tensor scale is optional, those with block scales)."""

    directory: Path
    fmt: CheckpointFormat
    tensors: dict[str, TensorInfo]
    files: tuple[Path, ...]
    metadata: dict[Path, dict[str, str]]
    layers: tuple[str, ...]
    indexed: bool
    path: Path | None = None

    def get(self, key: str) -> TensorInfo | None:
        return self.tensors.get(key)

    def in_file(self, file: Path) -> list[TensorInfo]:
        return [t for t in self.tensors.values() if t.file == file]


def _layers(tensors: dict[str, TensorInfo], fmt: CheckpointFormat) -> tuple[str, ...]:
    spec = format_spec(fmt)
    names = spec.names
    suffix = "." + names.tensor_scale
    out = dict.fromkeys(k.removesuffix(suffix) for k in tensors if k.endswith(suffix))
    if spec.optional_tensor_scale is not None:
        block = "." + names.block_scale
        out.update(dict.fromkeys(k.removesuffix(block) for k in tensors if k.endswith(block)))
    return tuple(out)


def inventory(path: str | os.PathLike[str], fmt: str | None = None) -> Inventory:
    """Describe the checkpoint at ``path`` (a folder, or the file of a one-file format) from its
    configuration and headers (the format's ``read_weights``).

    ``fmt``: the format, default detected (:func:`~nvfp4lab.checkpoint.formats.detect_format`).
    With an index, each tensor comes from the file its ``weight_map`` names; without one, a
    tensor stored in two files is an error naming both.
    """
    where = hf_snapshot(Path(path))  # a Hugging Face cache models--* folder: its snapshot
    form = registered_format(fmt) if fmt is not None else detect_format(where)
    stored = format_spec(form).read_weights(where)
    return Inventory(stored.directory, form, stored.tensors, stored.files, stored.metadata,
                     _layers(stored.tensors, form), stored.indexed, where)


#: Local worker processes by default: none. The tasks are light (a few rows each) and torch
#: already uses every core in this process; measured on a 2.71 GB checkpoint with 2 cores, audit
#: in-process took 10.3 s at 0.72 GB peak RSS against 11.9 s and 1.5 GB (summed) with 2 workers.
#: Pass ``workers=N`` (``--workers N``) on many-core machines, or a Dask cluster.
DEFAULT_WORKERS = 0


def _bar(total: int, desc: str, progress: bool) -> Any:
    tqdm = tqdm_class()
    return tqdm(total=total, desc=desc, unit="task", file=sys.stderr,
                disable=None if progress else True)


def _in_dask_worker(fn: Callable[[T], R], threads: int, task: T) -> R:
    """``fn(task)`` in a Dask worker with torch's threads set to ``threads`` (the client's
    :func:`~nvfp4lab.settings.torch_threads`): a worker runs ``--nthreads`` tasks at once, and
    each should not also start one torch thread per core."""
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return fn(task)


def _run_dask(fn: Callable[[T], R], tasks: Sequence[T], address: str, bar: Any) -> list[R]:
    """The tasks on the cluster at ``address``, through a client of our own that is never the
    process's default: every call gets it explicitly (``as_completed`` would otherwise look up a
    default client and find none: "No clients found")."""
    try:
        from distributed import Client, as_completed
    except ImportError:
        raise ImportError("--dask needs dask.distributed: pip install 'nvfp4lab[dask]'") from None
    try:
        client = Client(address, timeout="20s", set_as_default=False)
    except OSError as exc:
        raise ConnectionError(f"cannot reach the Dask scheduler at {address!r} ({exc})") from None
    with client:
        futures = client.map(functools.partial(_in_dask_worker, fn, torch_threads()),
                             list(tasks), pure=False)
        try:
            for _ in as_completed(futures, loop=client.loop):
                bar.update(1)
            return list(client.gather(futures))
        except BaseException:
            client.cancel(futures)
            raise


#: ``prctl`` option: the signal a process gets when its parent dies (linux/prctl.h).
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """End this pool worker when ``parent`` (the process that ran :func:`run_tasks`) dies, even by
    SIGKILL, which leaves it no chance to stop its pool: otherwise the workers (a few hundred MB
    each) and multiprocessing's resource tracker would live on, adopted by PID 1.

    On Linux the kernel does it: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (immediate, no thread; the
    pool spawns its workers from the calling thread, which outlives the pool). Elsewhere a daemon
    thread polls ``os.getppid()`` once a second. Either way a parent already gone by the time
    this runs is caught by comparing ``os.getppid()``.
    """
    import signal

    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent:
                os._exit(1)
            return
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="nvfp4lab-parent-watch", daemon=True).start()


def _init_worker(threads: int, parent: int | None = None) -> None:
    """Each pool worker runs ``threads`` torch threads (the parent's
    :func:`~nvfp4lab.settings.torch_threads`): by default every process would start one thread
    per core and the pool would oversubscribe them. It
    exits when ``parent`` dies (:func:`_die_with_parent`) and ignores SIGINT: Ctrl-C reaches the
    whole process group, and the parent, not each worker, stops the work (one message, no
    traceback per worker)."""
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # born with SIGINT held (_sigint_held): drop it
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if parent is not None:
        _die_with_parent(parent)
    torch.set_num_threads(threads)


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold SIGINT back in this thread while it spawns pool workers: they inherit the mask, so a
    Ctrl-C before their initializer ignores it (while they import torch) cannot make each print
    a traceback; here it is delivered as soon as the spawning is done."""
    import signal

    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _stop_pool(pool: Any) -> None:
    """Cancel what has not started and end the workers now (an interrupted run: waiting for the
    running tasks could take long, and the caller removes what they write once we return)."""
    pool.shutdown(wait=False, cancel_futures=True)
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        process.kill()
    for process in processes:
        process.join(timeout=10)


def check_workers(workers: object) -> None:
    """ValueError unless ``workers`` is None or an int >= 0 (the local pool's size; 0 = in this
    process)."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or workers < 0):
        raise ValueError(f"workers must be an int >= 0 (0 = in this process), got {workers!r}")


def run_tasks(
    fn: Callable[[T], R],
    tasks: Sequence[T],
    *,
    workers: int | None = None,
    dask: str | None = None,
    progress: bool = False,
    desc: str = "",
) -> list[R]:
    """``[fn(t) for t in tasks]``, in order, run where asked.

    ``dask``: the address of a running Dask scheduler (tasks go to its workers); else
    ``workers`` local processes (default :data:`DEFAULT_WORKERS`: 0, in this process).
    ``fn`` must be a module-level function and the tasks picklable. ``progress``: a tqdm bar on
    stderr (hidden when stderr is not a terminal).
    """
    check_workers(workers)
    count = DEFAULT_WORKERS if workers is None else workers
    with _bar(len(tasks), desc, progress) as bar:
        if dask is not None:
            return _run_dask(fn, tasks, dask, bar)
        if count == 0 or len(tasks) <= 1:
            out = []
            for task in tasks:
                out.append(fn(task))
                bar.update(1)
            return out
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        context = multiprocessing.get_context("spawn")
        count = min(count, len(tasks))
        threads = torch_threads()
        with ProcessPoolExecutor(max_workers=count, mp_context=context,
                                 initializer=_init_worker, initargs=(threads, os.getpid())) as pool:
            try:
                with _sigint_held():  # submit spawns the workers
                    futures = [pool.submit(fn, task) for task in tasks]
                for _ in as_completed(futures):
                    bar.update(1)
                return [f.result() for f in futures]
            except BaseException:
                _stop_pool(pool)
                raise
