"""The one results store: benchmark CSV shards under ``results/``, one per machine.

Every row carries its context (device, capability, torch version, threads, date, code revision)
in the columns of :data:`COLUMNS`. ``nvfp4lab bench`` appends rows (:func:`append_rows`); the
throughput study reads every shard back (:func:`read_shards`). Rows of another machine's shard
are never rewritten; a file with another header is refused.

Layouts. :data:`COLUMNS` ends with ``path`` (``eager`` | ``fused``: which nvfp4lab pipeline a row
ran; empty for rows that run none, e.g. ``copy`` or the 16-bit ``matmul``) and ``copy_fraction``
(``y.copy_(x)``'s time for the same weight shape and dtype in the same run divided by the row's
time: the share of the copy bandwidth an elementwise op reaches). Shards written before those two
columns existed (:data:`COLUMNS_V1`) stay as they are and are read as they are, their ``path``
filled in (every nvfp4lab op then ran the eager pipeline) and ``copy_fraction`` empty; new rows
are never appended to them (a file's rows always share one header): pass a new ``--out``.
"""

from __future__ import annotations

import csv
import datetime as _dt
import os
import platform
import re
import subprocess
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

try:  # POSIX advisory locks; elsewhere appends are not locked
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

from nvfp4lab.vocab import Backend

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from nvfp4lab.bench.timing import Timing

__all__ = [
    "COLUMNS",
    "COLUMNS_V1",
    "Measurement",
    "ShardWarning",
    "append_rows",
    "check_shard",
    "code_revision",
    "environment",
    "legacy_path",
    "load_average",
    "machine_name",
    "measured_row",
    "read_shards",
    "shard_path",
]

#: The header of shards written before the ``path`` and ``copy_fraction`` columns (read only).
COLUMNS_V1: tuple[str, ...] = (
    "op",
    "shape",
    "M",
    "N",
    "K",
    "dtype",
    "backend",
    "convention",
    "median_s",
    "spread_s",
    "spread_kind",
    "min_s",
    "max_s",
    "repeats",
    "number",
    "gb_s",
    "tflop_s",
    "bytes",
    "flops",
    "kind",
    "timer",
    "device",
    "device_name",
    "capability",
    "torch_version",
    "threads",
    "load_1m",
    "machine",
    "date",
    "code_revision",
    "seed",
)
#: The header every new row is written with.
COLUMNS: tuple[str, ...] = (*COLUMNS_V1, "path", "copy_fraction")


def _sanitize(text: str) -> str:
    """Lower-case ``[a-z0-9]`` words joined by ``-``."""
    return "-".join(re.findall(r"[a-z0-9]+", text.lower())) or "unknown"


def _cpu_model() -> str:
    """CPU model string (``/proc/cpuinfo`` on Linux, else :func:`platform.processor`)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _device_label(device: str) -> tuple[str, str]:
    """(device name, capability "major.minor" or "") of a torch device string."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        return torch.cuda.get_device_name(dev), f"{major}.{minor}"
    return _cpu_model(), ""


def machine_name(device: str = "cpu") -> str:
    """Shard name of this machine: OS, arch, CPU model, core count and device, sanitized.

    e.g. ``linux-x86_64-amd-epyc-2c-cpu`` or ``linux-x86_64-...-nvidia-h200``.
    """
    dev_name, _ = _device_label(device)
    cores = os.cpu_count() or 0
    parts = [platform.system(), platform.machine(), _cpu_model(), f"{cores}c"]
    parts.append("cpu" if device.startswith("cpu") else dev_name)
    return _sanitize(" ".join(parts))


_PACKAGE_DIR = Path(__file__).resolve().parent


def _git(*args: str, cwd: str | Path | None = None) -> str | None:
    """stdout of ``git ARGS`` run in ``cwd`` (default: the package's folder), or None when git
    cannot answer."""
    try:
        out = subprocess.run(
            ["git", *args],
            cwd=Path(cwd) if cwd is not None else _PACKAGE_DIR,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_revision(package_dir: str | Path | None = None) -> str:
    """``git rev-parse --short HEAD`` of the nvfp4lab checkout, ``+dirty`` when the package folder
    differs from that commit — uncommitted changes to tracked files or new untracked
    (not git-ignored) files in it, since either means the measured code is not exactly that
    commit — or ``"unknown"`` outside a git checkout. ``package_dir`` defaults to the folder
    of the installed ``nvfp4lab`` package; only changes under it count."""
    rev = _git("rev-parse", "--short", "HEAD", cwd=package_dir)
    if not rev:
        return "unknown"
    changes = _git("status", "--porcelain", "--untracked-files=all", "--", ".", cwd=package_dir)
    return f"{rev}+dirty" if changes else rev


def environment(device: str = "cpu") -> dict[str, str | int]:
    """The per-row context columns: device, capability, torch version, threads, date, revision."""
    import torch

    dev_name, cap = _device_label(device)
    return {
        "device": str(torch.device(device)),
        "device_name": dev_name,
        "capability": cap,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": machine_name(device),
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "code_revision": code_revision(),
    }


def load_average() -> str:
    """1-minute load average (runnable processes) when the OS reports it, else ""."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):
        return ""


def shard_path(out: str | Path | None, device: str = "cpu") -> Path:
    """Where rows go: ``out`` itself when it ends in ``.csv``, else ``<out>/<machine>.csv``.

    ``out=None`` means the folder ``results``.
    """
    target = Path("results" if out is None else out)
    if target.suffix.lower() == ".csv":
        return target
    return target / f"{machine_name(device)}.csv"


def _header_problem(path: Path) -> str | None:
    """Why rows cannot be appended to the CSV at ``path`` (its header), or None."""
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            header = next(csv.reader(fh), [])
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot be read as a CSV ({exc}); pass a new file or a folder"
    if tuple(header) == COLUMNS:
        return None
    if tuple(header) == COLUMNS_V1:
        return (
            "is a shard of the older layout (no path and copy_fraction columns); its rows stay "
            "readable as they are, but rows are never mixed into another layout: pass a new file, "
            "or a folder for <folder>/<machine>.csv"
        )
    shown = ", ".join(header[:6]) + (", …" if len(header) > 6 else "")
    return (
        f"is a CSV with another header ({shown}), not a nvfp4lab bench shard; rows are never "
        "mixed into another layout: pass a new file, or a folder (rows then go to "
        "<folder>/<machine>.csv)"
    )


def _torn_tail(path: Path) -> str | None:
    """The last line when it has no final newline (an interrupted write), else None."""
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        if size == 0:
            return None
        fh.seek(max(0, size - 65536))
        tail = fh.read()
    if tail.endswith(b"\n"):
        return None
    return tail.rsplit(b"\n", 1)[-1].decode("utf-8", errors="replace")


@contextmanager
def _locked(path: Path) -> Iterator[TextIO]:
    """``path`` opened for appending under an exclusive lock (``fcntl.flock`` where the OS has
    it), so that processes appending at once never interleave rows or write two headers."""
    with path.open("a", newline="", encoding="utf-8") as fh:
        if fcntl is not None:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        yield fh


def append_rows(path: str | Path, rows: Iterable[dict[str, Any]]) -> int:
    """Append ``rows`` to the CSV at ``path`` (header written when new); returns rows written.

    Appends are atomic with respect to one another (a file lock). An existing file must have
    exactly :data:`COLUMNS` as header (ValueError otherwise: use a new ``--out`` file rather than
    mixing layouts). A last line without its newline (an interrupted write) is completed when it
    holds a whole row and refused, naming the line, otherwise. Unknown keys raise ValueError.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with _locked(path) as fh:
        if path.stat().st_size:
            problem = _header_problem(path)
            if problem:
                raise ValueError(f"{path} {problem}")
            torn = _torn_tail(path)
            if torn is not None:
                fields = next(csv.reader([torn]), [])
                if len(fields) != len(COLUMNS):
                    line = sum(1 for _ in path.open("rb"))
                    raise ValueError(
                        f"{path}: its last line (line {line}) is cut short, {len(fields)} of "
                        f"{len(COLUMNS)} fields ({torn[:60]!r}...): an interrupted write; delete "
                        "that line and run again"
                    )
                fh.write("\n")
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="raise", restval="")
        if not path.stat().st_size:
            writer.writeheader()
        for row in rows:
            writer.writerow(row)
            n += 1
    return n


def _probe_writable(path: Path) -> str | None:
    """Why ``path`` cannot be appended to (trying it, without leaving anything), or None."""
    try:
        if path.exists():
            with path.open("a", encoding="utf-8"):
                return None
        parent = next(p for p in path.parents if p.exists())
        with tempfile.TemporaryFile(dir=parent):
            return None
    except OSError as exc:
        return f"cannot be written ({exc.strerror or exc}); pass another file or folder"


def check_shard(path: Path) -> None:
    """ValueError unless rows can be appended to ``path``, checked before anything is measured:
    a folder, a path under a file, an unwritable place, an unreadable file or a CSV whose
    header is not :data:`COLUMNS` is refused, naming the path and what to pass instead."""
    if path.is_dir():
        raise ValueError(
            f"--out {str(path)!r} is a folder whose name ends in .csv; pass a file path or "
            "another folder"
        )
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(
                    f"--out {str(path)!r}: {str(parent)!r} is a file, not a folder; "
                    "pass a path inside a folder"
                )
            break
    problem = _probe_writable(path)
    if problem is None and path.exists() and path.stat().st_size:
        problem = _header_problem(path)
    if problem:
        raise ValueError(f"--out {str(path)!r} {problem}")


@dataclass(frozen=True)
class Measurement:
    """One timed case, what :func:`measured_row` builds a shard row from.

    ``op``, ``shape``, ``M`` (or "" where the op has no M), ``N``, ``K``, ``dtype``,
    ``backend``, ``convention``: the case's columns. ``timing``: its samples (seconds per call).
    ``nbytes``: bytes per call (0: no ``gb_s``); ``flops``: FLOP per call (0: no ``tflop_s``);
    ``path``: the pipeline it ran ("" for none); ``copy_s``: the same run's ``copy_`` time of
    the same weight, seconds (None: no ``copy_fraction``).
    """

    op: str
    shape: str
    M: int | str
    N: int
    K: int
    dtype: str
    backend: str
    convention: str
    timing: Timing
    nbytes: float = 0.0
    flops: float = 0.0
    path: str = ""
    copy_s: float | None = None


def measured_row(
    measurement: Measurement | None = None, /, *, env: dict[str, Any], seed: int, **case: Any
) -> dict[str, Any]:
    """One shard row of ``measurement``: the case, the timing summary, derived ``gb_s`` (10^9
    B/s of ``nbytes``) or ``tflop_s`` (10^12 FLOP/s of ``flops``), the context columns ``env``,
    the ``seed``, the ``path`` and, given ``copy_s``, ``copy_fraction = copy_s / median_s``.

    The older form, the case's fields as keywords (``measured_row(op=..., ..., env=...,
    seed=...)``), still works: they build the :class:`Measurement`.
    """
    if measurement is None:
        measurement = Measurement(**case)
    elif case:
        raise TypeError(
            f"measured_row: pass the case as a Measurement or as keywords, not both "
            f"(got {', '.join(sorted(case))} beside a Measurement)"
        )
    m, timing = measurement, measurement.timing
    t = timing.median_s
    return {
        "op": m.op,
        "shape": m.shape,
        "M": m.M,
        "N": m.N,
        "K": m.K,
        "dtype": m.dtype,
        "backend": m.backend,
        "convention": m.convention,
        "median_s": f"{t:.6g}",
        "spread_s": f"{timing.spread_s:.3g}",
        "spread_kind": "iqr",
        "min_s": f"{timing.min_s:.6g}",
        "max_s": f"{timing.max_s:.6g}",
        "repeats": timing.repeats,
        "number": timing.number,
        "gb_s": f"{m.nbytes / t / 1e9:.4g}" if m.nbytes else "",
        "tflop_s": f"{m.flops / t / 1e12:.4g}" if m.flops else "",
        "bytes": int(m.nbytes) if m.nbytes else "",
        "flops": int(m.flops) if m.flops else "",
        "kind": "measured",
        "timer": timing.method,
        "load_1m": load_average(),
        "seed": seed,
        "path": m.path,
        "copy_fraction": f"{m.copy_s / t:.4g}" if m.copy_s else "",
        **env,
    }


#: Columns read back as numbers.
NUMERIC_COLUMNS: tuple[str, ...] = (
    "M",
    "N",
    "K",
    "median_s",
    "spread_s",
    "min_s",
    "max_s",
    "gb_s",
    "tflop_s",
    "threads",
    "load_1m",
    "copy_fraction",
)


def legacy_path(op: str, backend: str) -> str:
    """The ``path`` of a row written before the column existed: ``eager`` for every op that ran
    nvfp4lab's pipeline (there was no other then), ``""`` for the rest (matmul, native)."""
    if op in ("quantize", "dequantize", "fake_quantize"):
        return "eager"
    if op == "linear" and backend in (Backend.EMULATION, Backend.W4A16):
        return "eager"
    return "eager" if op == "peer_quantize" and backend.startswith("nvfp4lab") else ""


def _shard_files(results: str | Path | Iterable[str | Path]) -> list[Path]:
    if isinstance(results, str | Path):
        p = Path(results)
        return sorted(p.glob("*.csv")) if p.is_dir() else ([p] if p.exists() else [])
    return [Path(f) for f in results]


class ShardWarning(UserWarning):
    """A results shard holds lines that are not rows (cut short, or a repeated header)."""


def _shard_rows(path: Path) -> list[list[str]]:
    """The data rows of one shard; malformed lines are skipped with a :class:`ShardWarning`
    naming the file, the line and what is wrong with it."""
    with path.open(newline="", encoding="utf-8") as fh:
        lines = list(csv.reader(fh))
    if not lines:
        return []
    header, rows, bad = lines[0], [], []
    for number, fields in enumerate(lines[1:], start=2):
        if fields == header:
            bad.append(f"line {number} repeats the header")
        elif len(fields) != len(header):
            bad.append(f"line {number} has {len(fields)} fields, not {len(header)}")
        else:
            rows.append(fields)
    if bad:
        warnings.warn(
            f"{path}: skipped {len(bad)} malformed line(s): {'; '.join(bad[:5])}",
            ShardWarning,
            stacklevel=3,
        )
    return [header, *rows]


def read_shards(results: str | Path | Iterable[str | Path] = "results") -> pd.DataFrame:
    """All rows of every ``*.csv`` shard in a folder (or the given files), merged, with a
    ``source="measured"`` column and a ``shard`` column (file stem); numeric columns converted;
    shards of the older layout (:data:`COLUMNS_V1`) get their ``path`` filled in
    (:func:`legacy_path`). Malformed lines are skipped with a :class:`ShardWarning` that names
    them. An empty frame when there is no shard."""
    import pandas as pd

    frames = []
    for f in _shard_files(results):
        table = _shard_rows(f)
        if table:
            frame = pd.DataFrame(table[1:], columns=table[0]).assign(shard=f.stem)
            if tuple(table[0]) == COLUMNS_V1:
                pairs = zip(frame["op"], frame["backend"], strict=True)
                frame["path"] = [legacy_path(o, b) for o, b in pairs]
                frame["copy_fraction"] = ""
            frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=["source", "shard"])
    df = pd.concat(frames, ignore_index=True)
    for col in NUMERIC_COLUMNS:
        if col in df:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    df.insert(0, "source", "measured")
    return df
