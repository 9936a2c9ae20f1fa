"""The benchmark runner: NVFP4 ops on a grid of linear shapes, timed, as results rows.

Measures, over shapes ``M x N x K`` (``y[M, N] = x[M, K] @ W[N, K]^T``):

- ``copy``: ``y.copy_(W)`` into a preallocated ``y`` (backend ``copy_``), the bandwidth yardstick
  of each weight shape and dtype, measured first in the same run; and ``W.clone()`` (backend
  ``clone``), the same copy into a fresh output, the floor of any op that returns a new tensor;
- ``quantize`` (both conventions), ``dequantize`` and ``fake_quantize`` of the weight ``W[N, K]``
  on each ``path`` (``eager``: the eager pipeline, ``fused``: the compiled kernels of
  :mod:`nvfp4lab.kernels`), with a derived bandwidth ``gb_s`` (10^9 B/s of the logical bytes read
  + written) and ``copy_fraction`` (copy time / op time: 0.1 = ten times slower than ``copy_``);
  the op allocates its result, ``copy_`` does not (a fresh output of 32 MiB or more costs page
  faults: ``x.clone()`` alone is ~3x ``copy_`` on the 2-core CPU);
- ``linear`` per NVFP4 backend (``emulation``, ``w4a16`` on each path, and on the ``default``
  path: ``fused=None``, what a user gets with default settings, the C++ LUT decode on a CPU where
  it is built; ``native`` where the device has FP4 tensor cores) without a cached dequantized
  weight, and the plain 16-bit ``matmul`` baseline (``torch.nn.functional.linear`` on the
  unquantized weight), with a derived ``tflop_s`` (10^12 FLOP/s of 2·M·N·K).

Every row is timed by :func:`nvfp4lab.bench.timing.time_fn` (median and interquartile range) on
fresh, seeded ``randn`` inputs (never zeros); a fused or default case is called once before
(compilation, the LUT kernel's first load and the tiled linear's exactness check are not timed);
rows go to :mod:`nvfp4lab.bench.store`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nvfp4lab.bench.store import Measurement, environment, measured_row
from nvfp4lab.bench.timing import Timing, time_fn
from nvfp4lab.kernels.graphs import supports
from nvfp4lab.orders import ORDERS
from nvfp4lab.vocab import SUPPORTED_DTYPES, Backend, OrderName, check_dtype

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "ELEMENTWISE_OPS",
    "LINEAR_BACKENDS",
    "OPS",
    "PATHS",
    "BenchConfig",
    "bench_dtype",
    "bound_ratio",
    "check_memory",
    "check_timing",
    "default_shapes",
    "logical_bytes",
    "parse_shapes",
    "run_bench",
    "seeded_randn",
]

#: The copy yardstick, elementwise ops and the linear op; ``--ops`` picks a subset.
OPS: tuple[str, ...] = ("copy", "quantize", "dequantize", "fake_quantize", "linear", "matmul")
#: Ops measured against the same run's ``copy`` (which comes with any of them).
ELEMENTWISE_OPS: tuple[str, ...] = ("quantize", "dequantize", "fake_quantize")
#: NVFP4 linear backends the harness knows (``matmul`` is the 16-bit baseline).
LINEAR_BACKENDS: tuple[str, ...] = (Backend.EMULATION, Backend.W4A16, Backend.NATIVE)
#: nvfp4lab's pipelines: ``fused=False`` / ``fused=True`` / ``fused=None`` (the default
#: settings); ``--paths`` picks a subset.
PATHS: tuple[str, ...] = ("eager", "fused", "default")
#: The ``fused=`` argument of each path.
_FUSED_ARG: dict[str, bool | None] = {"eager": False, "fused": True, "default": None}

#: Ops that compute their own global scale from amax(|x|) before any code: x is read twice.
AMAX_FIRST_OPS: tuple[str, ...] = ("quantize", "fake_quantize")


def logical_bytes(op: str, nk: int, itemsize: int, *, amax_pass: bool = False) -> float:
    """Bytes an elementwise ``op`` must move over an ``nk``-element weight of ``itemsize``-byte
    elements: what it reads plus what it writes, each once (the packed form is 0.5 byte of codes
    + 1/16 byte of E4M3 scale per element). ``copy``: read + write the tensor (2·itemsize);
    ``quantize``: read x, write the packed form; ``dequantize``: the reverse; ``fake_quantize``:
    read x, write x_hat. ``amax_pass``: add the second read of x that quantize and
    fake_quantize need when they compute the global scale themselves (amax first)."""
    packed = nk / 2 + nk / 16
    tensor = float(nk * itemsize)
    moved = {
        "copy": 2 * tensor,
        "quantize": tensor + packed,
        "dequantize": packed + tensor,
        "fake_quantize": 2 * tensor,
    }[op]
    return moved + (tensor if amax_pass and op in AMAX_FIRST_OPS else 0.0)


def bound_ratio(op: str, itemsize: int, *, amax_pass: bool = False) -> float:
    """The bandwidth bound of ``op`` as a multiple of ``y.copy_(x)`` on the same tensor: its
    :func:`logical_bytes` over copy's (bf16: quantize 0.64, dequantize 0.64, fake_quantize 1.0;
    with the amax pass 1.14 and 1.5)."""
    return logical_bytes(op, 1 << 20, itemsize, amax_pass=amax_pass) / logical_bytes(
        "copy", 1 << 20, itemsize
    )


_SHAPE_RE = re.compile(r"^\s*(\d+)\s*[xX*,]\s*(\d+)\s*[xX*,]\s*(\d+)\s*$")


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
        from nvfp4lab.roofline import linear_shapes

        layers = [s for s in linear_shapes("Llama-3-8B") if s.layer != "gate_up_proj"]
        return [(m, s.N, s.K) for s in layers for m in (1, 16, 256)]
    raise ValueError(f"unknown shape mode {mode!r}; expected tiny, quick or full")


@dataclass
class BenchConfig:
    """What to measure: shapes ``(M, N, K)``, ops, linear backends, dtypes (names like
    "bfloat16"), device, timing (warmup, repeats), the base seed and the paths."""

    shapes: list[tuple[int, int, int]]
    ops: tuple[str, ...] = OPS
    backends: tuple[str, ...] = LINEAR_BACKENDS
    dtypes: tuple[str, ...] = ("bfloat16",)
    device: str = "cpu"
    warmup: int = 1
    repeats: int = 5
    seed: int = 0
    paths: tuple[str, ...] = PATHS


@dataclass(frozen=True)
class _Case:
    op: str
    M: int
    N: int
    K: int
    dtype: str
    backend: str
    convention: str
    path: str = ""


def available_memory_bytes(device: str) -> int | None:
    """Free memory of ``device`` in bytes (CUDA: ``mem_get_info``; CPU: the OS's MemAvailable,
    else free physical pages), or None when the OS does not say."""
    import torch

    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def case_bytes(M: int, N: int, K: int, itemsize: int) -> int:
    """Peak bytes one linear case holds at once (a generous estimate): the weight, x and y in the
    input dtype, the packed weight, and a dequantized weight and float32 GEMM output."""
    return (N * K + M * K + M * N) * itemsize + N * K // 2 + N * K * 4 + M * N * 4


def check_memory(cfg: BenchConfig) -> None:
    """ValueError, before anything is allocated, for a shape that cannot fit in memory."""
    free = available_memory_bytes(cfg.device)
    if free is None:
        return
    for dtype in cfg.dtypes:
        itemsize = 4 if dtype == "float32" else 2
        for M, N, K in cfg.shapes:
            need = case_bytes(M, N, K, itemsize)
            if need > free:
                raise ValueError(
                    f"shape {M}x{N}x{K} in {dtype} needs about {need / 1e9:.3g} GB on "
                    f"{cfg.device}, but only {free / 1e9:.3g} GB is available; choose smaller "
                    "--shapes"
                )


def bench_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` ("bfloat16", ...), one of the supported dtypes."""
    import torch

    dt = getattr(torch, name, None)
    try:  # the one dtype wording, as the ValueError the command line reports
        return check_dtype(dt if dt in SUPPORTED_DTYPES else name, "--dtypes")
    except TypeError as err:
        raise ValueError(str(err)) from None


def check_timing(warmup: int, repeats: int) -> None:
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


def _weight_cases(cfg: BenchConfig, N: int, K: int, dtype: str) -> list[_Case]:
    """The copy yardstick and the elementwise ops of one weight shape, on each path."""
    ops = [op for op in ELEMENTWISE_OPS if op in cfg.ops]
    copies = [_Case("copy", 0, N, K, dtype, b, "") for b in ("copy_", "clone")]
    cases = copies if ops or "copy" in cfg.ops else []
    for op in ops:
        for conv in map(str, OrderName) if op == "quantize" else (str(OrderName.VLLM_KERNEL),):
            # orders the fused graphs do not implement (modelopt, llama.cpp): eager only;
            # default rows: linear only
            fusable = supports(ORDERS[OrderName(conv)])
            paths = [p for p in cfg.paths if p != "default" and (p == "eager" or fusable)]
            cases += [_Case(op, 0, N, K, dtype, "torch", conv, path) for path in paths]
    return cases


def _cases(cfg: BenchConfig) -> list[_Case]:
    cases: list[_Case] = []
    seen_w: set[tuple[int, int, str]] = set()
    for dtype in cfg.dtypes:
        for M, N, K in cfg.shapes:
            if (N, K, dtype) not in seen_w:  # weight ops once per weight shape
                seen_w.add((N, K, dtype))
                cases += _weight_cases(cfg, N, K, dtype)
            if "matmul" in cfg.ops:
                cases.append(_Case("matmul", M, N, K, dtype, "torch", ""))
            if "linear" in cfg.ops:
                for b in cfg.backends:
                    paths = ("",) if b == Backend.NATIVE else cfg.paths
                    conv = str(OrderName.VLLM_KERNEL)
                    cases += [_Case("linear", M, N, K, dtype, b, conv, p) for p in paths]
    return cases


def _prepare(case: _Case, cfg: BenchConfig, seed: int) -> tuple[Callable[[], Any], float, float]:
    """(closure to time, logical bytes, flops) for one case, on fresh seeded inputs."""
    import torch

    from nvfp4lab.codec import compute_global_scale, fake_quantize, quantize

    dt = bench_dtype(case.dtype)
    dev = cfg.device
    itemsize = torch.empty((), dtype=dt).element_size()
    w = seeded_randn((case.N, case.K), dt, seed, dev)
    nk = case.N * case.K
    fused = _FUSED_ARG.get(case.path, False)
    if case.op == "copy":
        y = torch.empty_like(w)
        fn = (lambda: y.copy_(w)) if case.backend == "copy_" else w.clone
        return fn, logical_bytes(case.op, nk, itemsize), 0.0
    if case.op == "quantize":
        conv = case.convention
        fn = lambda: quantize(w, convention=conv, fused=fused)  # noqa: E731
        return fn, logical_bytes(case.op, nk, itemsize), 0.0
    if case.op == "dequantize":
        q = quantize(w)
        return (lambda: q.dequantize(dt, fused=fused)), logical_bytes(case.op, nk, itemsize), 0.0
    if case.op == "fake_quantize":
        return (lambda: fake_quantize(w, fused=fused)), logical_bytes(case.op, nk, itemsize), 0.0
    x = seeded_randn((case.M, case.K), dt, seed + 1, dev)
    flops = 2.0 * case.M * case.N * case.K
    if case.op == "matmul":
        return (lambda: torch.nn.functional.linear(x, w)), 0.0, flops
    if case.op == "linear":
        from nvfp4lab.execution.gemm import linear

        q = quantize(w)
        gs_x = compute_global_scale(x)  # a static (calibrated) input scale, as in checkpoints
        backend = case.backend
        return (
            lambda: linear(x, q, input_global_scale=gs_x, backend=backend, fused=fused)
        ), 0.0, flops
    raise ValueError(f"unknown op {case.op!r}")


def _measure(case: _Case, cfg: BenchConfig, seed: int) -> tuple[Timing, float, float]:
    """(timing, logical bytes, flops) of one case; a fused or default case is called once
    first."""
    fn, nbytes, flops = _prepare(case, cfg, seed)
    if case.path in ("fused", "default"):
        fn()  # compilation, the LUT kernel's load and the tiled linear's check are not timed
    timing = time_fn(fn, warmup=cfg.warmup, repeats=cfg.repeats, device=cfg.device)
    return timing, nbytes, flops


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
    from nvfp4lab.execution.dispatch import native_fp4_status

    env = environment(cfg.device)
    cases = _cases(cfg)
    native_ok, native_why = native_fp4_status(cfg.device)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    copy_s: dict[tuple[int, int, str], float] = {}
    for i, case in enumerate(progress(cases) if progress else cases):
        if case.op == "linear" and case.backend == Backend.NATIVE and not native_ok:
            msg = f"linear/native skipped: {native_why}"
            if msg not in skipped:
                skipped.append(msg)
            continue
        seed = cfg.seed + 1000 * i
        timing, nbytes, flops = _measure(case, cfg, seed)
        weight = (case.N, case.K, case.dtype)
        if case.op == "copy" and case.backend == "copy_":
            copy_s[weight] = timing.median_s
        shape = f"{case.M}x{case.N}x{case.K}" if case.M else f"{case.N}x{case.K}"
        measurement = Measurement(
            op=case.op, shape=shape, M=case.M or "", N=case.N, K=case.K, dtype=case.dtype,
            backend=case.backend, convention=case.convention, timing=timing, nbytes=nbytes,
            flops=flops, path=case.path,
            copy_s=copy_s.get(weight) if case.op in ("copy", *ELEMENTWISE_OPS) else None,
        )
        row = measured_row(measurement, env=env, seed=seed)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows, skipped
