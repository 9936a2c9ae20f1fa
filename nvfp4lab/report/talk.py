"""What ``nvfp4lab report`` says while it runs: a line per notebook as it starts and ends, and
the progress of the notebooks running.

:class:`Progress` is the runner's listener (``run_reports(progress=...)``), called from the
runner's worker threads: :meth:`~Progress.started` (threads, expected seconds),
:meth:`~Progress.cell` (code cells done / total), :meth:`~Progress.threads` (a running
notebook's share of the cores grew) and :meth:`~Progress.finished` (its result). It prints to
one stream (the CLI's stdout), a whole line at a time:

* ``start   07_llm_study  (1 thread, about 180 s)``, and when it ends
  ``    ok  07_llm_study   181.4 s  [headline = value; ...]`` (an error on the next line);
* on a terminal, a status line redrawn in place every second:
  ``running: 07_llm_study 5/12 cells 95 s | 03_throughput 7/15 cells 12 s``; elsewhere (a pipe,
  a log file) the same as a plain ``running: ...`` line every ``every_s`` seconds.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

__all__ = ["Progress", "result_line"]


def result_line(result: Any) -> str:
    """``status  name  seconds  [headlines]``, and the error on a second line."""
    heads = "; ".join(f"{h.name} = {h.text()}" for h in result.headlines.values())
    line = f"{result.status:>6}  {result.name}  {result.duration_s:6.1f} s"
    line += f"  [{heads}]" if heads else ""
    return line + (f"\n        {result.error}" if result.error else "")


class Progress:
    """Prints the run's progress to ``stream`` (default: stdout): see the module docstring.
    ``live``: redraw a status line in place (default: whether ``stream`` is a terminal);
    ``every_s``: seconds between status lines (1 when live). Use as a context manager (the
    status thread runs inside) or call :meth:`close`."""

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None,
                 every_s: float = 30.0) -> None:
        self.stream = stream if stream is not None else sys.stdout
        if live is None:
            isatty = getattr(self.stream, "isatty", None)
            live = bool(isatty and isatty())
        self.live = live
        self.every_s = 1.0 if live else float(every_s)
        self.reported: set[str] = set()
        self._running: dict[str, list[float]] = {}  # name -> [started, done, total]
        self._lock = threading.Lock()
        self._status = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the listener ---------------------------------------------------------------------

    def started(self, name: str, threads: int, expected_s: float | None = None) -> None:
        about = f", about {expected_s:.0f} s" if expected_s is not None else ""
        with self._lock:
            self._running[name] = [time.monotonic(), 0, 0]
            self._say(f"start   {name}  ({threads} thread{'s' * (threads != 1)}{about})")
        self._ensure_thread()

    def cell(self, name: str, done: int, total: int) -> None:
        with self._lock:
            if name in self._running:
                self._running[name][1:] = [done, total]

    def threads(self, name: str, threads: int) -> None:
        with self._lock:
            self._say(f"        {name}: now {threads} threads (the others ended)")

    def finished(self, result: Any) -> None:
        with self._lock:
            self._running.pop(result.name, None)
            self.reported.add(result.name)
            self._say(result_line(result))

    # -- printing ---------------------------------------------------------------------------

    def _line(self) -> str:
        now = time.monotonic()
        parts = []
        for name, (start, done, total) in self._running.items():
            cells = f" {done:.0f}/{total:.0f} cells" if total else ""
            parts.append(f"{name}{cells} {now - start:.0f} s")
        return ("running: " + " | ".join(parts)) if parts else ""

    def _say(self, text: str) -> None:
        """Print ``text`` (lock held): on a terminal, over the status line, which is redrawn."""
        if self.live and self._status:
            self.stream.write("\r\x1b[K")
        self.stream.write(text + "\n")
        if self.live:
            self._status = self._line()
            self.stream.write(self._status)
        self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            with self._lock:
                line = self._line()
                if not line:
                    continue
                if self.live:
                    self.stream.write("\r\x1b[K" + line)
                    self._status = line
                else:
                    self.stream.write(line + "\n")
                self.stream.flush()

    def _ensure_thread(self) -> None:
        if self._thread is None and self.every_s > 0:
            self._thread = threading.Thread(target=self._tick, name="nvfp4lab-report-progress",
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the status line (cleared on a terminal)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self.live and self._status:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
            self._status = ""

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
