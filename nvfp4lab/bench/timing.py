"""The one timing helper of nvfp4lab: warm-up, repeats, median and spread.

:func:`time_fn` calls ``fn()`` ``warmup`` times untimed, then takes ``repeats`` samples. Each
sample times ``number`` back-to-back calls and records the mean per call, so very short calls are
not swamped by timer resolution (``number`` is calibrated during warm-up to make a sample last at
least ``min_sample_s``). On CUDA the samples are measured with CUDA events (after a device
synchronize) and on CPU with :func:`time.perf_counter`.

Reported: the **median** per-call time, and as the spread the **interquartile range**
(``iqr_s = q3_s - q1_s``, linear-interpolated quartiles of the samples); ``min_s``/``max_s`` are
kept too. Everything is in seconds. Nothing here asserts on speed: timings are measurements,
never pass/fail tests.

:func:`stopwatch` is the one-shot form, for "how long did this step take" (a notebook run, a
model quantization): ``with stopwatch() as sw: ...`` then ``sw.wall_s`` and ``sw.cpu_s`` (this
process's CPU seconds, all threads), set when the block ends, also when it raises.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SPREAD_KIND",
    "Stopwatch",
    "Timing",
    "format_seconds",
    "quantile",
    "stopwatch",
    "time_fn",
    "time_interleaved",
]

#: What :attr:`Timing.spread_s` measures.
SPREAD_KIND = "iqr"


def quantile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q``-quantile (0 <= q <= 1) of ``samples`` (numpy's default rule)."""
    if not samples:
        raise ValueError("quantile of no samples")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    ordered = sorted(samples)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Timing:
    """Per-call times (seconds) of one measured function.

    ``samples`` are per-call means of each repeat (each repeat ran ``number`` calls);
    ``method`` is ``"cuda_events"`` or ``"perf_counter"``; ``device`` the torch device string.
    """

    samples: tuple[float, ...]
    number: int
    warmup: int
    method: str
    device: str

    @property
    def repeats(self) -> int:
        """Number of timed samples."""
        return len(self.samples)

    @property
    def median_s(self) -> float:
        """Median per-call time, seconds."""
        return statistics.median(self.samples)

    @property
    def q1_s(self) -> float:
        """First quartile of the per-call times, seconds."""
        return quantile(self.samples, 0.25)

    @property
    def q3_s(self) -> float:
        """Third quartile of the per-call times, seconds."""
        return quantile(self.samples, 0.75)

    @property
    def iqr_s(self) -> float:
        """Interquartile range ``q3_s - q1_s``, seconds."""
        return self.q3_s - self.q1_s

    @property
    def spread_s(self) -> float:
        """The spread nvfp4lab reports: the interquartile range (see :data:`SPREAD_KIND`)."""
        return self.iqr_s

    @property
    def min_s(self) -> float:
        """Fastest per-call sample, seconds."""
        return min(self.samples)

    @property
    def max_s(self) -> float:
        """Slowest per-call sample, seconds."""
        return max(self.samples)

    def as_dict(self) -> dict[str, Any]:
        """Summary fields (no raw samples) as a flat dict."""
        return {
            "median_s": self.median_s,
            "spread_s": self.spread_s,
            "spread_kind": SPREAD_KIND,
            "q1_s": self.q1_s,
            "q3_s": self.q3_s,
            "min_s": self.min_s,
            "max_s": self.max_s,
            "repeats": self.repeats,
            "number": self.number,
            "warmup": self.warmup,
            "timer": self.method,
        }


def _device_type(device: Any) -> tuple[str, str]:
    """(type, str) of a device given as None/str/int/torch.device."""
    if device is None:
        return "cpu", "cpu"
    import torch

    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return dev.type, str(dev)


def time_fn(
    fn: Callable[[], Any],
    *,
    warmup: int = 3,
    repeats: int = 10,
    number: int | None = None,
    min_sample_s: float = 1e-3,
    max_number: int = 1000,
    device: Any = None,
) -> Timing:
    """Time ``fn()`` (no arguments; close over seeded inputs) and return a :class:`Timing`.

    ``warmup`` untimed calls (at least 1 when ``number`` is calibrated), then ``repeats`` samples
    of ``number`` calls each. ``number=None`` calibrates it from the warm-up so that one sample
    lasts about ``min_sample_s`` seconds (capped at ``max_number``). ``device``: where ``fn``
    runs (``None``/"cpu" → perf_counter; a CUDA device → CUDA events on the current stream).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if number is not None and number < 1:
        raise ValueError(f"number must be >= 1 or None, got {number}")
    dev_type, dev_str = _device_type(device)
    cuda = dev_type == "cuda"
    if cuda:
        import torch

        sync: Callable[[], None] = lambda: torch.cuda.synchronize(device)  # noqa: E731
    else:
        sync = lambda: None  # noqa: E731

    n_warm = max(warmup, 1) if number is None else warmup
    last = 0.0
    for _ in range(n_warm):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        last = time.perf_counter() - t0
    if number is None:
        number = 1 if last <= 0 else max(1, min(max_number, math.ceil(min_sample_s / last)))

    samples: list[float] = []
    if cuda:
        import torch

        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            sync()
            start.record()
            for _ in range(number):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / number)
        method = "cuda_events"
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            samples.append((time.perf_counter() - t0) / number)
        method = "perf_counter"
    return Timing(tuple(samples), number, n_warm, method, dev_str)


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    *,
    warmup: int = 2,
    repeats: int = 10,
    device: Any = None,
) -> dict[str, Timing]:
    """Time several functions round-robin (A, B, C, A, B, C, ...): one sample of each per round.

    For side-by-side comparisons on a shared or noisy machine: slow phases of the machine hit
    every function alike, so their ratios are steadier than with back-to-back :func:`time_fn`
    calls. Each sample is one call (``number`` = 1); ``warmup`` untimed rounds come first.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    samples: dict[str, list[Timing]] = {name: [] for name in fns}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(time_fn(fn, warmup=0, repeats=1, number=1, device=device))
    return {
        name: Timing(tuple(t.samples[0] for t in ts), 1, warmup, ts[0].method, ts[0].device)
        for name, ts in samples.items()
    }


@dataclass
class Stopwatch:
    """Seconds one ``with stopwatch()`` block took: ``wall_s`` (:func:`time.perf_counter`) and
    ``cpu_s`` (:func:`time.process_time`); NaN until the block ends."""

    wall_s: float = math.nan
    cpu_s: float = math.nan


@contextmanager
def stopwatch() -> Iterator[Stopwatch]:
    """Time the body of a ``with`` block once (no warm-up, no repeats): see :class:`Stopwatch`."""
    watch = Stopwatch()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield watch
    finally:
        watch.wall_s = time.perf_counter() - wall
        watch.cpu_s = time.process_time() - cpu


def format_seconds(t: float) -> str:
    """``t`` seconds for a table column, 11 characters: µs below 1 ms, ms below 1 s, else s."""
    if t < 1e-3:
        return f"{t * 1e6:8.1f} us"
    if t < 1:
        return f"{t * 1e3:8.2f} ms"
    return f"{t:8.3f} s "
