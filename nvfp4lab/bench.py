"""Benchmark harness and results store: ``nvfp4lab bench``.

Measures, over a grid of linear shapes ``M x N x K`` (``y[M, N] = x[M, K] @ W[N, K]^T``):

- ``quantize`` (both conventions), ``dequantize`` and ``fake_quantize`` of the weight ``W[N, K]``,
  with a derived bandwidth ``gb_s`` (10^9 B/s of the logical bytes read + written);
- ``linear`` per NVFP4 backend (``emulation``, ``w4a16``, ``native`` where the device has FP4
  tensor cores) and the plain 16-bit ``matmul`` baseline (``torch.nn.functional.linear`` on the
  unquantized weight), with a derived ``tflop_s`` (10^12 FLOP/s of 2·M·N·K).

Every row is timed by :func:`nvfp4lab.timing.time_fn` (median and interquartile range) on fresh,
seeded ``randn`` inputs (never zeros), and appended to ``results/<machine>.csv``: one shard per
machine, never rewriting another machine's shard. Columns: :data:`COLUMNS`.

``--peers`` times compressed-tensors' NVFP4 quantize path (``generate_gparam`` +
``calculate_qparams`` + ``quantize_and_pack_fp4``) against ``nvfp4lab.quantize`` in both
conventions on the same tensors in the same process, on ``--device``, checks they agree bit for
bit, and prints ratios; torchao's NVFP4 (given a per-tensor scale, like CT) is timed too when it
is installed.

Settings are validated before anything runs; the CLI reports a bad value as
``nvfp4lab bench: <message>`` on stderr with exit code 2.

Library functions here return data; only :func:`main` prints (tables to stdout, progress to
stderr).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "COLUMNS",
    "LINEAR_BACKENDS",
    "OPS",
    "BenchConfig",
    "PeerResult",
    "add_arguments",
    "append_rows",
    "code_revision",
    "default_shapes",
    "environment",
    "machine_name",
    "main",
    "parse_shapes",
    "read_results",
    "resolve_device",
    "run_bench",
    "run_cli",
    "run_peers",
    "seeded_randn",
    "shard_path",
]

#: Columns of every results shard, in order. Derived metric: ``gb_s`` for the elementwise ops,
#: ``tflop_s`` for linear/matmul (the other is empty). ``spread_s`` is the IQR (``spread_kind``).
COLUMNS: tuple[str, ...] = (
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

#: Elementwise ops and the linear op; ``--ops`` picks a subset.
OPS: tuple[str, ...] = ("quantize", "dequantize", "fake_quantize", "linear", "matmul")
#: NVFP4 linear backends the harness knows (``matmul`` is the 16-bit baseline).
LINEAR_BACKENDS: tuple[str, ...] = ("emulation", "w4a16", "native")

_SHAPE_RE = re.compile(r"^\s*(\d+)\s*[xX*,]\s*(\d+)\s*[xX*,]\s*(\d+)\s*$")


# --------------------------------------------------------------------------------------------
# environment: machine name, revision, where rows go
# --------------------------------------------------------------------------------------------


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


def _load() -> str:
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


def append_rows(path: str | Path, rows: Iterable[dict[str, Any]]) -> int:
    """Append ``rows`` to the CSV at ``path`` (header written when new); returns rows written.

    An existing file must have exactly :data:`COLUMNS` as header (ValueError otherwise: use a
    new ``--out`` file rather than mixing layouts). Unknown keys in a row raise ValueError.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with path.open(newline="", encoding="utf-8") as fh:
            header = next(csv.reader(fh), [])
        if tuple(header) != COLUMNS:
            raise ValueError(
                f"{path} has columns {header}, expected {list(COLUMNS)}; "
                "write to a new file with --out"
            )
    n = 0
    with path.open("a", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="raise", restval="")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow(row)
            n += 1
    return n


def read_results(paths: str | Path | Iterable[str | Path] = "results") -> list[dict[str, str]]:
    """Rows of one shard, of every ``*.csv`` in a folder, or of several paths (merged)."""
    if isinstance(paths, str | Path):
        p = Path(paths)
        files = sorted(p.glob("*.csv")) if p.is_dir() else [p]
    else:
        files = [Path(x) for x in paths]
    rows: list[dict[str, str]] = []
    for f in files:
        with f.open(newline="", encoding="utf-8") as fh:
            rows.extend(csv.DictReader(fh))
    return rows


# --------------------------------------------------------------------------------------------
# inputs and shapes
# --------------------------------------------------------------------------------------------


def seeded_randn(
    shape: Sequence[int], dtype: torch.dtype, seed: int, device: str = "cpu"
) -> torch.Tensor:
    """Fresh ``N(0, 1)`` tensor from its own generator seeded with ``seed``; exact zeros (which
    ``randn`` can produce after rounding to 16 bit) are replaced by 1e-3 so no input is zero."""
    import torch

    gen = torch.Generator(device=device).manual_seed(int(seed))
    x = torch.randn(tuple(shape), generator=gen, dtype=torch.float32, device=device).to(dtype)
    return x.masked_fill_(x == 0, 1e-3)


def parse_shapes(specs: Iterable[str]) -> list[tuple[int, int, int]]:
    """``["16x4096x4096", "1,1024,1024"]`` → ``[(M, N, K), ...]``; K must be a multiple of 16."""
    out = []
    for spec in specs:
        for item in str(spec).split():
            m = _SHAPE_RE.match(item)
            if not m:
                raise ValueError(f"bad shape {item!r}: expected MxNxK, e.g. 16x4096x4096")
            M, N, K = (int(g) for g in m.groups())
            if min(M, N, K) < 1 or K % 16:
                raise ValueError(f"bad shape {item!r}: need M, N, K >= 1 and K % 16 == 0")
            out.append((M, N, K))
    return out


def default_shapes(mode: str) -> list[tuple[int, int, int]]:
    """Shape grids: ``tiny`` (tests), ``quick`` (CI, < 1 min on 2 CPU cores), ``full``
    (Llama-3-8B qkv/o/down layers at M = 1, 16, 256; a few minutes on 2 CPU cores)."""
    if mode == "tiny":
        return [(8, 256, 256)]
    if mode == "quick":
        return [(1, 1024, 1024), (64, 1024, 1024), (16, 2048, 1024)]
    if mode == "full":
        from nvfp4lab.gpus import linear_shapes

        layers = [s for s in linear_shapes("Llama-3-8B") if s.layer != "gate_up_proj"]
        return [(m, s.N, s.K) for s in layers for m in (1, 16, 256)]
    raise ValueError(f"unknown shape mode {mode!r}; expected tiny, quick or full")


# --------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    """What to measure: shapes ``(M, N, K)``, ops, linear backends, dtypes (names like
    "bfloat16"), device, timing (warmup, repeats) and the base seed."""

    shapes: list[tuple[int, int, int]]
    ops: tuple[str, ...] = OPS
    backends: tuple[str, ...] = LINEAR_BACKENDS
    dtypes: tuple[str, ...] = ("bfloat16",)
    device: str = "cpu"
    warmup: int = 1
    repeats: int = 5
    seed: int = 0


@dataclass(frozen=True)
class _Case:
    op: str
    M: int
    N: int
    K: int
    dtype: str
    backend: str
    convention: str


def _dtype(name: str) -> torch.dtype:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype) or dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {name!r}; use float32, bfloat16 or float16")
    return dt


def native_available(device: str) -> tuple[bool, str]:
    """Whether the ``native`` backend can run on ``device``, and why (not)."""
    from nvfp4lab.dispatch import native_fp4_status

    return native_fp4_status(device)


def _cases(cfg: BenchConfig) -> list[_Case]:
    cases: list[_Case] = []
    seen_w: set[tuple[int, int, str]] = set()
    for dtype in cfg.dtypes:
        for M, N, K in cfg.shapes:
            if (N, K, dtype) not in seen_w:  # weight ops once per weight shape
                seen_w.add((N, K, dtype))
                if "quantize" in cfg.ops:
                    for conv in ("kernel", "compressed-tensors"):
                        cases.append(_Case("quantize", 0, N, K, dtype, "torch", conv))
                if "dequantize" in cfg.ops:
                    cases.append(_Case("dequantize", 0, N, K, dtype, "torch", "kernel"))
                if "fake_quantize" in cfg.ops:
                    cases.append(_Case("fake_quantize", 0, N, K, dtype, "torch", "kernel"))
            if "matmul" in cfg.ops:
                cases.append(_Case("matmul", M, N, K, dtype, "torch", ""))
            if "linear" in cfg.ops:
                for b in cfg.backends:
                    cases.append(_Case("linear", M, N, K, dtype, b, "kernel"))
    return cases


def _prepare(case: _Case, cfg: BenchConfig, seed: int) -> tuple[Callable[[], Any], float, float]:
    """(closure to time, logical bytes, flops) for one case, on fresh seeded inputs."""
    import torch

    from nvfp4lab.quantize import compute_global_scale, fake_quantize, quantize

    dt = _dtype(case.dtype)
    dev = cfg.device
    itemsize = torch.empty((), dtype=dt).element_size()
    w = seeded_randn((case.N, case.K), dt, seed, dev)
    nk = case.N * case.K
    packed_bytes = nk / 2 + nk / 16  # 4-bit codes + one E4M3 scale per 16
    if case.op == "quantize":
        conv = case.convention
        return (lambda: quantize(w, convention=conv)), nk * itemsize + packed_bytes, 0.0
    if case.op == "dequantize":
        q = quantize(w)
        return (lambda: q.dequantize(dt)), packed_bytes + nk * itemsize, 0.0
    if case.op == "fake_quantize":
        return (lambda: fake_quantize(w)), 2.0 * nk * itemsize, 0.0
    x = seeded_randn((case.M, case.K), dt, seed + 1, dev)
    flops = 2.0 * case.M * case.N * case.K
    if case.op == "matmul":
        return (lambda: torch.nn.functional.linear(x, w)), 0.0, flops
    if case.op == "linear":
        from nvfp4lab.linear import linear

        q = quantize(w)
        gs_x = compute_global_scale(x)  # a static (calibrated) input scale, as in checkpoints
        backend = case.backend
        return (lambda: linear(x, q, input_global_scale=gs_x, backend=backend)), 0.0, flops  # type: ignore[arg-type]
    raise ValueError(f"unknown op {case.op!r}")


def _row(
    case: _Case, timing: Any, nbytes: float, flops: float, env: dict[str, Any], seed: int
) -> dict[str, Any]:
    t = timing.median_s
    shape = f"{case.M}x{case.N}x{case.K}" if case.M else f"{case.N}x{case.K}"
    return {
        "op": case.op,
        "shape": shape,
        "M": case.M or "",
        "N": case.N,
        "K": case.K,
        "dtype": case.dtype,
        "backend": case.backend,
        "convention": case.convention,
        "median_s": f"{t:.6g}",
        "spread_s": f"{timing.spread_s:.3g}",
        "spread_kind": "iqr",
        "min_s": f"{timing.min_s:.6g}",
        "max_s": f"{timing.max_s:.6g}",
        "repeats": timing.repeats,
        "number": timing.number,
        "gb_s": f"{nbytes / t / 1e9:.4g}" if nbytes else "",
        "tflop_s": f"{flops / t / 1e12:.4g}" if flops else "",
        "bytes": int(nbytes) if nbytes else "",
        "flops": int(flops) if flops else "",
        "kind": "measured",
        "timer": timing.method,
        "load_1m": _load(),
        "seed": seed,
        **env,
    }


def run_bench(
    cfg: BenchConfig,
    *,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Measure every case of ``cfg``; returns (rows, skipped-case messages).

    ``progress`` wraps the case list (e.g. tqdm); ``on_row`` sees each row as soon as it is
    measured (the CLI appends it to the shard there, so an interrupted run keeps its rows).
    A backend that cannot run here (``native`` off an FP4 GPU) is skipped with a message.
    """
    from nvfp4lab.timing import time_fn

    env = environment(cfg.device)
    cases = _cases(cfg)
    native_ok, native_why = native_available(cfg.device)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for i, case in enumerate(progress(cases) if progress else cases):
        if case.op == "linear" and case.backend == "native" and not native_ok:
            msg = f"linear/native skipped: {native_why}"
            if msg not in skipped:
                skipped.append(msg)
            continue
        seed = cfg.seed + 1000 * i
        fn, nbytes, flops = _prepare(case, cfg, seed)
        timing = time_fn(fn, warmup=cfg.warmup, repeats=cfg.repeats, device=cfg.device)
        row = _row(case, timing, nbytes, flops, env, seed)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows, skipped


# --------------------------------------------------------------------------------------------
# peers: compressed-tensors (and torchao when installed) vs nvfp4lab
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerResult:
    """One implementation's quantize time on one tensor ``[N, K]``.

    ``speedup_vs_ct`` = t(compressed-tensors) / t(this) (> 1: faster than CT); ``matches_ct``:
    packed codes and scales equal CT's bit for bit; ``code_agreement``: fraction of the 4-bit
    codes equal to CT's (the kernel order legitimately differs on a few; None: not compared).
    """

    impl: str
    shape: tuple[int, int]
    dtype: str
    median_s: float
    spread_s: float
    speedup_vs_ct: float
    matches_ct: bool | None
    code_agreement: float | None
    min_s: float = math.nan
    max_s: float = math.nan
    repeats: int = 0
    device: str = "cpu"
    timer: str = "perf_counter"


def _ct_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors 0.20's NVFP4 weight path on ``x``'s device, ``x`` ``[N, K]``:
    ``generate_gparam`` → per-16 ``calculate_qparams`` → ``quantize_and_pack_fp4``.
    Returns (packed uint8 ``[N, K/2]``, float8_e4m3fn scales ``[N, K/16]``, global scale)."""
    import torch
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = preset_name_to_scheme("NVFP4", ["Linear"]).weights
    gs = generate_gparam(*torch.aminmax(x))
    blocks = x.reshape(x.shape[0], x.shape[1] // 16, 16)
    bmin, bmax = torch.aminmax(blocks, dim=-1)
    scale, _ = calculate_qparams(bmin, bmax, args, global_scale=gs)
    packed = quantize_and_pack_fp4(x, scale, global_scale=gs, group_size=16)
    return packed, scale.to(torch.float8_e4m3fn), gs


def _torchao_quantizer() -> Callable[[torch.Tensor], Any] | None:
    """torchao's NVFP4 quantize (``NVFP4Tensor.to_nvfp4``) when torchao is installed."""
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import (  # type: ignore[import-not-found]
            NVFP4Tensor as AoNVFP4Tensor,
        )
    except ImportError:
        return None
    return AoNVFP4Tensor.to_nvfp4  # type: ignore[no-any-return]


def _torchao_closure(
    to_nvfp4: Callable[..., Any], x: torch.Tensor
) -> tuple[Callable[[], Any] | None, str | None]:
    """(closure quantizing ``x`` with torchao, note) — closure None when torchao fails on ``x``.

    compressed-tensors scales two-level (a per-tensor FP32 scale from the tensor's amax, then
    E4M3 block scales), so torchao is given a per-tensor scale too, computed inside the timed
    call like CT's: ``to_nvfp4(x, per_tensor_scale=amax / 2688)`` (torchao's DECODE convention,
    2688 = 448 · 6). A ``to_nvfp4`` without that keyword is timed with block scales only, with a
    note saying its work is then not comparable.
    """
    import inspect

    import torch

    from nvfp4lab.constants import GLOBAL_SCALE_NUMERATOR

    try:
        params = inspect.signature(to_nvfp4).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    note: str | None = None
    if "per_tensor_scale" in params:

        def fn() -> Any:
            scale = x.abs().amax().to(torch.float32) / GLOBAL_SCALE_NUMERATOR
            return to_nvfp4(x, per_tensor_scale=scale)

    else:

        def fn() -> Any:
            return to_nvfp4(x)

        note = (
            "torchao's NVFP4Tensor.to_nvfp4 has no per_tensor_scale argument in this version: "
            "it was timed with block scales only, less work than compressed-tensors' two-level "
            "scaling, so its ratio is not like for like"
        )
    try:
        fn()
    except Exception as exc:  # any failure of a third-party peer: skip it, say why
        return None, (
            f"torchao's NVFP4Tensor.to_nvfp4 failed on a {tuple(x.shape)} {x.dtype} tensor on "
            f"{x.device} ({type(exc).__name__}: {exc}); torchao was skipped"
        )
    return fn, note


def run_peers(
    shapes: Sequence[tuple[int, int]],
    *,
    dtype: str = "bfloat16",
    warmup: int = 2,
    repeats: int = 7,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[list[PeerResult], list[str]]:
    """Time NVFP4 weight quantization of ``[N, K]`` tensors by compressed-tensors, nvfp4lab
    (both conventions) and torchao (if installed) on the same seeded tensors, in this process,
    interleaved round-robin (:func:`nvfp4lab.timing.time_interleaved`). (results, notes).

    The tensors are created on ``device`` and every implementation runs there; the one timing
    helper measures with CUDA events on a GPU and ``perf_counter`` on the CPU.
    """
    import torch

    from nvfp4lab.e2m1 import unpack_fp4
    from nvfp4lab.quantize import quantize
    from nvfp4lab.timing import time_interleaved

    _check_timing(warmup, repeats)
    dt = _dtype(dtype)
    results: list[PeerResult] = []
    notes: list[str] = []
    ao = _torchao_quantizer()
    if ao is None:
        notes.append("torchao is not installed: its NVFP4Tensor was skipped")
    for i, (N, K) in enumerate(shapes):
        x = seeded_randn((N, K), dt, seed + i, device)
        ref_packed, ref_scale, _ = _ct_quantize(x)
        ref_codes = unpack_fp4(ref_packed)
        impls: dict[str, Callable[[], Any]] = {
            "compressed-tensors": lambda x=x: _ct_quantize(x),
            "nvfp4lab[compressed-tensors]": lambda x=x: quantize(
                x, convention="compressed-tensors"
            ),
            "nvfp4lab[kernel]": lambda x=x: quantize(x, convention="kernel"),
        }
        if ao is not None:
            ao_fn, ao_note = _torchao_closure(ao, x)
            if ao_note is not None and ao_note not in notes:
                notes.append(ao_note)
            if ao_fn is not None:
                impls["torchao"] = ao_fn
        timings = time_interleaved(impls, warmup=warmup, repeats=repeats, device=device)
        t_ct = timings["compressed-tensors"].median_s
        for name, t in timings.items():
            match: bool | None = None
            agree: float | None = None
            if name.startswith("nvfp4lab"):
                q = impls[name]()
                match = bool(
                    torch.equal(q.packed, ref_packed)
                    and torch.equal(q.scales.view(torch.uint8), ref_scale.view(torch.uint8))
                )
                agree = float((unpack_fp4(q.packed) == ref_codes).double().mean())
            elif name == "compressed-tensors":
                match, agree = True, 1.0
            results.append(
                PeerResult(
                    name,
                    (N, K),
                    dtype,
                    t.median_s,
                    t.spread_s,
                    t_ct / t.median_s,
                    match,
                    agree,
                    t.min_s,
                    t.max_s,
                    t.repeats,
                    t.device,
                    t.method,
                )
            )
    return results, notes


def _peer_rows(results: Sequence[PeerResult], env: dict[str, Any], seed: int) -> list[dict]:
    rows = []
    for r in results:
        N, K = r.shape
        nbytes = N * K * 2 + N * K / 2 + N * K / 16
        rows.append(
            {
                "op": "peer_quantize",
                "shape": f"{N}x{K}",
                "M": "",
                "N": N,
                "K": K,
                "dtype": r.dtype,
                "backend": r.impl,
                "convention": "",
                "median_s": f"{r.median_s:.6g}",
                "spread_s": f"{r.spread_s:.3g}",
                "spread_kind": "iqr",
                "min_s": f"{r.min_s:.6g}",
                "max_s": f"{r.max_s:.6g}",
                "repeats": r.repeats,
                "number": 1,
                "gb_s": f"{nbytes / r.median_s / 1e9:.4g}",
                "tflop_s": "",
                "bytes": int(nbytes),
                "flops": "",
                "kind": "measured",
                "timer": r.timer,
                "load_1m": _load(),
                "seed": seed,
                **env,
            }
        )
    return rows


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _csv_list(text: str) -> list[str]:
    return [t for t in re.split(r"[,\s]+", text.strip()) if t]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``nvfp4lab bench``'s options to ``parser`` (used by :mod:`nvfp4lab.cli`)."""
    parser.add_argument("--quick", action="store_true", help="a short run (< 1 min on 2 cores)")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests
    parser.add_argument(
        "--out",
        default=None,
        help="results CSV file, or a folder for <folder>/<machine>.csv (default: results/)",
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        metavar="MxNxK",
        help="linear shapes y[M,N] = x[M,K] W[N,K]^T (default: a grid per mode)",
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        default=None,
        metavar="NAME",
        help=f"linear backends among {', '.join(LINEAR_BACKENDS)} (default: all that can run)",
    )
    parser.add_argument(
        "--ops", nargs="+", default=None, metavar="OP", help=f"subset of {', '.join(OPS)}"
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=None,
        metavar="DTYPE",
        help="input dtypes: bfloat16 (default), float16, float32",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    parser.add_argument("--repeats", type=int, default=None, help="timed samples per case")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per case")
    parser.add_argument("--seed", type=int, default=0, help="base seed of the inputs")
    parser.add_argument(
        "--peers",
        action="store_true",
        help="time compressed-tensors' (and torchao's) NVFP4 quantize against nvfp4lab instead",
    )
    parser.add_argument("--no-save", action="store_true", help="measure but write no CSV")


def resolve_device(name: str | None) -> str:
    """The torch device string to measure on: ``name`` checked, or ``"cuda"`` when CUDA is
    usable and ``"cpu"`` otherwise (``name=None``).

    Raises ValueError, naming the value and what to pass instead, for a string torch does not
    parse, a device type the harness does not time (only ``cpu`` and ``cuda[:N]``), CUDA on a
    torch without a usable GPU, or a CUDA index beyond the visible devices.
    """
    import torch

    if name is None or not str(name).strip():
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(str(name).strip())
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(
            f"--device {name!r} is not a torch device; use --device cpu or --device cuda[:N]"
        ) from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise ValueError(
            f"--device {name!r}: the bench times only cpu and cuda devices; "
            "use --device cpu or --device cuda[:N]"
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"--device {name!r}: CUDA is not usable here (torch {torch.__version__}, "
            "torch.cuda.is_available() is False); use --device cpu, or run on a machine with an "
            "NVIDIA GPU and a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(
            f"--device {name!r}: only {count} CUDA device(s) are visible; "
            f"use --device cuda:0 … cuda:{count - 1}"
        )
    return str(dev)


def _check_timing(warmup: int, repeats: int) -> None:
    """ValueError naming the bad ``--warmup``/``--repeats`` value and the fix."""
    if repeats < 1:
        raise ValueError(
            f"--repeats {repeats}: need at least one timed sample per case; pass --repeats 1 "
            "or more (or leave it out for the default)"
        )
    if warmup < 0:
        raise ValueError(
            f"--warmup {warmup}: the number of untimed calls cannot be negative; pass --warmup 0 "
            "or more (or leave it out for the default)"
        )


def _check_shard(path: Path) -> None:
    """ValueError unless rows can be appended to ``path``: a folder, an unreadable file or a CSV
    whose header is not :data:`COLUMNS` is refused before anything is measured."""
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
    if not path.exists() or path.stat().st_size == 0:
        return
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            header = next(csv.reader(fh), [])
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"--out {str(path)!r} cannot be read as a CSV ({exc}); pass a new file or a folder"
        ) from None
    if tuple(header) != COLUMNS:
        shown = ", ".join(header[:6]) + (", …" if len(header) > 6 else "")
        raise ValueError(
            f"--out {str(path)!r} is a CSV with another header ({shown}), not a nvfp4lab bench "
            "shard; rows are never mixed into another layout: pass a new file, or a folder "
            "(rows then go to <folder>/<machine>.csv)"
        )


def _split(values: Sequence[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [t for v in values for t in _csv_list(v)]


def _config(args: argparse.Namespace) -> BenchConfig:
    mode = "tiny" if getattr(args, "tiny", False) else ("quick" if args.quick else "full")
    shapes = parse_shapes(_split(args.shapes)) if args.shapes else default_shapes(mode)
    device = resolve_device(args.device)
    ops = tuple(_split(args.ops) or OPS)
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ValueError(f"unknown op(s) {bad}; choose from {OPS}")
    backends = tuple(_split(args.backends) or LINEAR_BACKENDS)
    bad = [b for b in backends if b not in LINEAR_BACKENDS]
    if bad:
        raise ValueError(f"unknown backend(s) {bad}; choose from {LINEAR_BACKENDS}")
    dtypes = tuple(_split(args.dtypes) or ("bfloat16",))
    for d in dtypes:
        _dtype(d)
    quickish = mode != "full"
    warmup = args.warmup if args.warmup is not None else 1
    repeats = args.repeats if args.repeats is not None else (3 if quickish else 5)
    _check_timing(warmup, repeats)
    return BenchConfig(
        shapes=shapes,
        ops=ops,
        backends=backends,
        dtypes=dtypes,
        device=device,
        warmup=warmup,
        repeats=repeats,
        seed=args.seed,
    )


def _fmt_time(t: float) -> str:
    if t < 1e-3:
        return f"{t * 1e6:8.1f} us"
    if t < 1:
        return f"{t * 1e3:8.2f} ms"
    return f"{t:8.3f} s "


def _print_rows(rows: Sequence[dict[str, Any]]) -> None:
    print(
        f"{'op':<14} {'shape':<18} {'dtype':<9} {'backend':<10} {'conv':<19} "
        f"{'median':>11} {'IQR':>9}  derived"
    )
    for r in rows:
        derived = f"{r['gb_s']} GB/s" if r["gb_s"] else f"{r['tflop_s']} TFLOP/s"
        print(
            f"{r['op']:<14} {r['shape']:<18} {r['dtype']:<9} {r['backend']:<10} "
            f"{r['convention']:<19} {_fmt_time(float(r['median_s']))} "
            f"{float(r['spread_s']) * 1e3:7.3f}ms  {derived}"
        )


@dataclass(frozen=True)
class _PeersPlan:
    shapes: list[tuple[int, int]]
    dtypes: list[str]
    device: str
    warmup: int
    repeats: int
    path: Path | None


def _peers_plan(args: argparse.Namespace) -> _PeersPlan:
    """Validated ``--peers`` settings (ValueError naming a bad value and the fix)."""
    if args.tiny:
        shapes = [(256, 256)]
    elif args.quick:
        shapes = [(1024, 1024)]
    elif args.shapes:
        shapes = [(n, k) for _, n, k in parse_shapes(_split(args.shapes))]
    else:
        shapes = [(1024, 1024), (4096, 4096), (6144, 4096)]
    dtypes = _split(args.dtypes) or ["bfloat16"]
    for d in dtypes:
        _dtype(d)
    device = resolve_device(args.device)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick or args.tiny else 7)
    warmup = args.warmup if args.warmup is not None else 2
    _check_timing(warmup, repeats)
    path = None if args.no_save else shard_path(args.out, device)
    if path is not None:
        _check_shard(path)
    return _PeersPlan(shapes, dtypes, device, warmup, repeats, path)


def _run_peers_cli(plan: _PeersPlan, seed: int) -> int:
    all_results: list[PeerResult] = []
    notes: list[str] = []
    for d in plan.dtypes:
        res, msgs = run_peers(
            plan.shapes,
            dtype=d,
            warmup=plan.warmup,
            repeats=plan.repeats,
            seed=seed,
            device=plan.device,
        )
        all_results.extend(res)
        notes.extend(m for m in msgs if m not in notes)
    timer = all_results[0].timer if all_results else ""
    print(f"NVFP4 weight quantize on {plan.device} ({timer}), same seeded tensors, same process")
    print("speedup = t(compressed-tensors) / t(impl), medians of interleaved samples;")
    print("exact = packed codes and scales equal CT's bit for bit; codes = share of equal codes")
    print(
        f"{'impl':<30} {'shape':<11} {'dtype':<9} {'median':>11} {'IQR':>10} "
        f"{'speedup':>8}  exact  codes"
    )
    for r in all_results:
        match = "-" if r.matches_ct is None else str(r.matches_ct)
        agree = "-" if r.code_agreement is None else f"{r.code_agreement:.4%}"
        print(
            f"{r.impl:<30} {f'{r.shape[0]}x{r.shape[1]}':<11} {r.dtype:<9} {_fmt_time(r.median_s)} "
            f"{r.spread_s * 1e3:8.3f}ms {r.speedup_vs_ct:7.2f}x  {match:<5}  {agree}"
        )
    for m in notes:
        print(f"note: {m}")
    if plan.path is not None:
        n = append_rows(plan.path, _peer_rows(all_results, environment(plan.device), seed))
        print(f"appended {n} rows to {plan.path}")
    return 0


def _fail(message: object) -> int:
    print(f"nvfp4lab bench: {message}", file=sys.stderr)
    return 2


def run_cli(args: argparse.Namespace) -> int:
    """Run ``nvfp4lab bench`` from parsed arguments (see :func:`add_arguments`); exit code.

    Missing attributes take their defaults, so a parser with only ``--quick``/``--out`` works.
    Every setting is checked before anything is measured: a bad value (``--repeats 0``,
    ``--warmup -1``, an unusable ``--device``, an ``--out`` CSV with another header, …) prints
    ``nvfp4lab bench: <what is wrong and what to pass>`` to stderr and returns 2. A run that
    measures nothing (every case skipped) says so on stderr and returns 1.
    """
    defaults = argparse.Namespace()
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    parser.parse_args([], namespace=defaults)
    for k, v in vars(defaults).items():
        if not hasattr(args, k):
            setattr(args, k, v)
    try:
        if args.peers:
            plan = _peers_plan(args)
        else:
            cfg = _config(args)
            path = None if args.no_save else shard_path(args.out, cfg.device)
            if path is not None:
                _check_shard(path)
    except (ValueError, ImportError, OSError) as exc:
        return _fail(exc)
    if args.peers:
        try:
            return _run_peers_cli(plan, args.seed)
        except ImportError as exc:
            return _fail(f"{exc} (the peers comparison needs compressed-tensors installed)")
    from tqdm.auto import tqdm

    def progress(cases: Iterable[Any]) -> Iterable[Any]:
        return tqdm(
            list(cases),
            desc="nvfp4lab bench",
            unit="case",
            file=sys.stderr,
            disable=None,
            leave=False,
        )

    def save(row: dict[str, Any]) -> None:
        if path is not None:
            append_rows(path, [row])

    rows, skipped = run_bench(cfg, progress=progress, on_row=save)
    if not rows:
        why = "; ".join(skipped) if skipped else "the selection has no cases"
        print(
            f"nvfp4lab bench: nothing was measured on {cfg.device} ({why}); nothing was written. "
            "Choose ops/backends that run here, e.g. --backends emulation w4a16 or --ops matmul",
            file=sys.stderr,
        )
        return 1
    _print_rows(rows)
    for msg in skipped:
        print(f"note: {msg}")
    if path is not None:
        print(f"appended {len(rows)} rows to {path}")
    bad = [r for r in rows if not math.isfinite(float(r["median_s"]))]
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``nvfp4lab bench [--quick] [--out FILE|DIR] [--shapes …] [--backends …] [--peers]``."""
    parser = argparse.ArgumentParser(
        prog="nvfp4lab bench", description="benchmark NVFP4 ops and append results to results/"
    )
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
