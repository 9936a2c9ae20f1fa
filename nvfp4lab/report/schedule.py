"""Which report notebook starts first, and how many cores each kernel gets.

A report run is as long as its longest notebook allows (notebook 07 alone takes more than the
other six together), so the runner:

* starts the notebooks longest first (:func:`launch_order`), by the seconds they are expected to
  take (:func:`expected_seconds`): the previous run's duration recorded in the output folder
  (:data:`TIMES_NAME`, written by :func:`record_times` after each run, kept per set of
  parameters), else the cost table shipped with the package (:data:`COSTS_PATH`: full runs
  measured on a 2-core AMD EPYC machine, one torch thread each), else :data:`DEFAULT_COST_S`;
* gives each kernel the cores no other running notebook uses (:class:`Cores`): at its start,
  its share of the free cores with the notebooks starting beside it (at least one), and, once no
  notebook is left to start, the cores of every notebook that ended go to those still running
  (written to each kernel's threads file; :mod:`nvfp4lab.report.kernel_threads` applies it
  before the kernel's next cell). ``NVFP4LAB_THREADS`` set by the user fixes every kernel's
  threads instead.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "COSTS_PATH",
    "DEFAULT_COST_S",
    "TIMES_NAME",
    "Cores",
    "available_cores",
    "cost_table",
    "expected_seconds",
    "launch_order",
    "record_times",
]

#: Seconds each shipped notebook takes in a full run (``nvfp4lab report``, default parameters,
#: one torch thread, one notebook at a time) on a 2-core AMD EPYC machine: ``{stem: seconds}``.
COSTS_PATH: Path = Path(__file__).with_name("costs.json")
#: The record, in a report folder, of how long each notebook took, per set of parameters.
TIMES_NAME = ".nvfp4lab-report-times.json"
#: Expected seconds of a notebook found in neither the record nor the table.
DEFAULT_COST_S = 60.0


def available_cores() -> int:
    """The CPUs this process may run on (its affinity where the OS tells, else the count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def cost_table(path: str | Path = COSTS_PATH) -> dict[str, float]:
    """The shipped cost table, ``{notebook stem: seconds}`` (empty when unreadable)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.get("seconds", {}).items()}


def _run_key(parameters: Mapping[str, Any]) -> str:
    """The record's key of a run's parameters (order-free, any value as its repr)."""
    return json.dumps({k: repr(v) for k, v in sorted(parameters.items())}, sort_keys=True)


def _read_record(out: Path) -> dict[str, dict[str, float]]:
    try:
        data = json.loads((out / TIMES_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def expected_seconds(
    paths: Sequence[Path], out: Path, parameters: Mapping[str, Any],
    table: Mapping[str, float] | None = None,
) -> dict[Path, tuple[float, bool]]:
    """Per notebook ``(seconds, measured)``: the duration recorded in ``out`` for the same
    ``parameters`` (``measured`` True), else the cost table's full-run figure (True only when
    ``parameters`` are the defaults: nothing set but ``INTERACTIVE``), else
    :data:`DEFAULT_COST_S` (False)."""
    table = cost_table() if table is None else table
    before = _read_record(out).get(_run_key(parameters), {})
    defaults = set(parameters) <= {"INTERACTIVE"}
    found: dict[Path, tuple[float, bool]] = {}
    for path in paths:
        seconds = before.get(path.stem)
        if isinstance(seconds, int | float) and seconds > 0:
            found[path] = (float(seconds), True)
        elif path.stem in table:
            found[path] = (table[path.stem], defaults)
        else:
            found[path] = (DEFAULT_COST_S, False)
    return found


def launch_order(paths: Sequence[Path], expected: Mapping[Path, tuple[float, bool]]
                 ) -> list[Path]:
    """``paths`` longest expected first (ties: by name)."""
    return sorted(paths, key=lambda p: (-expected[p][0], p.name))


def record_times(out: Path, parameters: Mapping[str, Any], seconds: Mapping[str, float]) -> None:
    """Add ``{stem: seconds}`` of the notebooks that ran through to ``out``'s record under
    ``parameters`` (written atomically; a record that cannot be written is skipped: it only
    orders the next run)."""
    record = _read_record(out)
    mine = record.setdefault(_run_key(parameters), {})
    mine.update({k: round(float(v), 1) for k, v in seconds.items()})
    tmp = out / f"{TIMES_NAME}.partial"
    try:
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, out / TIMES_NAME)
    except OSError:
        tmp.unlink(missing_ok=True)


class Cores:
    """The cores of one report run, shared out among the notebooks' kernels.

    ``cores``: the CPUs to share; ``jobs``: notebooks at most side by side; ``pending``: the
    notebooks to start; ``fixed``: every kernel's threads when the user set them (no sharing);
    ``folder``: where each kernel's threads file is written (None: threads fixed at the start);
    ``expected``: seconds per notebook stem (the longest still running gets a freed core first);
    ``changed(stem, threads)`` is called when a running notebook's share grows.
    """

    def __init__(self, cores: int, jobs: int, pending: int, *, fixed: int | None = None,
                 folder: Path | None = None, expected: Mapping[str, float] | None = None,
                 changed: Callable[[str, int], None] | None = None) -> None:
        self.cores, self.jobs, self.pending, self.fixed = cores, jobs, pending, fixed
        self.folder = folder
        self.expected = dict(expected or {})
        self.changed = changed
        self.running: dict[str, int] = {}
        self._started: dict[str, float] = {}
        self._lock = threading.Lock()

    def file(self, stem: str) -> Path | None:
        """The threads file of notebook ``stem`` (None when shares are fixed)."""
        if self.folder is None or self.fixed is not None:
            return None
        return self.folder / f"{stem}.threads"

    def _write(self, stem: str, threads: int) -> None:
        path = self.file(stem)
        if path is not None:
            tmp = path.with_suffix(".partial")
            tmp.write_text(str(threads), encoding="ascii")
            os.replace(tmp, path)  # the kernel never reads half a number

    def take(self, stem: str) -> int:
        """Threads for notebook ``stem``, starting now: its share of the free cores with the
        notebooks that start beside it (rounded up: the first, longest, gets the odd core), at
        least 1 (``fixed`` when set)."""
        with self._lock:
            self.pending -= 1
            if self.fixed is not None:
                threads = self.fixed
            else:
                free = self.cores - sum(self.running.values())
                beside = max(0, min(self.pending, self.jobs - len(self.running) - 1))
                threads = max(1, -(-free // (beside + 1)))  # ceil: the first, longest, more
            self.running[stem] = threads
            self._started[stem] = time.monotonic()
            self._write(stem, threads)
            return threads

    def release(self, stem: str) -> None:
        """Notebook ``stem`` ended: once nothing is left to start, its cores go to the notebooks
        still running, one at a time to the one with the most expected time left."""
        grown: dict[str, int] = {}
        with self._lock:
            self.running.pop(stem, None)
            if self.fixed is not None or self.folder is None or self.pending > 0:
                return
            free = self.cores - sum(self.running.values())
            now = time.monotonic()
            while free > 0 and self.running:
                left = {s: self.expected.get(s, DEFAULT_COST_S) - (now - self._started[s])
                        for s in self.running}
                # most time left per thread it has: adding a core there helps the run's end most
                target = max(self.running, key=lambda s: (left[s] / self.running[s], s))
                self.running[target] += 1
                grown[target] = self.running[target]
                free -= 1
            for name, threads in grown.items():
                self._write(name, threads)
        if self.changed is not None:
            for name, threads in grown.items():
                self.changed(name, threads)
