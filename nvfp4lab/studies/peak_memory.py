"""Peak resident memory of this process (Linux ``/proc``; None elsewhere): :func:`rss_bytes`
(now, or the kernel's high-water mark) and :class:`PeakRSS` (the peak inside a ``with`` block),
as the study's rows report it (``peak_rss_mb``)."""

from __future__ import annotations

import os
import threading


def rss_bytes(field_name: str | None = None) -> int | None:
    """This process's resident set size now (``field_name`` None, from ``/proc/self/statm``) or
    its high-water mark (``"VmHWM"`` of ``/proc/self/status``), bytes; None off Linux."""
    try:
        if field_name is None:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(f"{field_name}:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


class PeakRSS:
    """Peak resident memory of this process inside a ``with`` block, MiB (``mb``; None off
    Linux): the kernel's exact high-water mark when the block raised it, else the largest
    resident size sampled every ``interval`` seconds by a background thread."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.mb: float | None = None
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        now = rss_bytes()
        if now is not None:
            self._peak = max(self._peak, now)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> PeakRSS:
        self._hwm = rss_bytes("VmHWM")
        if self._hwm is not None:
            self._sample()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._sample()
        hwm = rss_bytes("VmHWM")
        peak = hwm if hwm is not None and hwm > (self._hwm or 0) else self._peak
        self.mb = peak / 2**20
