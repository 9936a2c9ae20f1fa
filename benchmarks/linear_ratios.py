"""The uncached NVFP4 linear against bf16 ``F.linear`` of its dequantized weight, interleaved.

    python benchmarks/linear_ratios.py [--threads T] [--repeats N] [--cpu-time]

Issue 23's measurement: W4A16 and W4A4-emulation ``linear`` without a cached dequantized weight,
with default settings (``fused=None``), at M = 1 and 16 on a 4096² and a 4096×14336 (N×K,
Llama-3-8B's down_proj) bf16 weight, each timed round-robin with bf16 ``F.linear`` on the
dequantized weight in this process (``nvfp4lab.bench.timing.time_interleaved``; so every call
reads its weight after the others ran, as layers of a model do, where ``nvfp4lab bench`` repeats
one op back to back and its ``F.linear`` may read a weight left in cache). Before each case
``auto``'s ledger is emptied, as in a fresh process. Prints best-of-N and median ratios and the
machine's load. ``--cpu-time`` (one thread only) times this thread's CPU time instead of the
wall clock: steadier on a shared machine, where a preempted call would count its wait.

``--floor`` also runs the W4A16 path at other tile sizes, and times the two parts it is made of
at the default tile (``kernels.linear.LUT_TILE_BYTES`` per thread): torch's GEMM calls alone, on
one tile decoded beforehand and hot in cache (as if decoding were free), and the LUT decode
calls alone. The GEMM must stay torch's for the output to stay bit-exact; where oneDNN repacks a
bf16 weight for every call (AMX CPUs: about 0.13 ns per weight element and thread, hot in L2 or
not), those GEMM calls alone cost about as much as ``F.linear`` itself.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nvfp4lab import kernels
from nvfp4lab.bench.timing import time_interleaved
from nvfp4lab.codec import compute_global_scale, quantize
from nvfp4lab.execution.gemm import linear, vllm_decode_scale, vllm_dequantize
from nvfp4lab.kernels import linear as kernel_linear
from nvfp4lab.kernels import lut_decode
from nvfp4lab.kernels.compiled import balanced
from nvfp4lab.orders import DecodeRule
from nvfp4lab.tensor import NVFP4Tensor

SHAPES = ((4096, 4096), (4096, 14336))  # (N, K)
#: Decoded weight per thread and tile (MiB) that ``--floor`` also runs the W4A16 path at.
FLOOR_TILES = (0.5, 1, 2, 8)


def floor_parts(x: torch.Tensor, q: NVFP4Tensor) -> dict[str, Callable[[], object]]:
    """The uncached W4A16 path at other tile sizes (:data:`FLOOR_TILES` MiB of decoded weight
    per thread), and the two parts it is made of at the default tile: torch's GEMM calls alone
    on one tile decoded beforehand (hot in cache, as if decoding were free and left its tile
    there), and the LUT decode calls alone into one tile buffer."""
    w = kernel_linear.EncodedWeight(
        q.packed, q.scales, vllm_decode_scale(q), DecodeRule.SCALE_TIMES_DECODE
    )
    n, k = q.shape
    rows = max(kernel_linear.LUT_MIN_ROWS,
               kernel_linear.LUT_TILE_BYTES * torch.get_num_threads() // (k * x.element_size()))
    parts = list(balanced(n, rows))
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    buf = torch.empty(rows, k, dtype=x.dtype)
    decoder = kernel_linear.row_decoder(w, x.dtype)
    decoder(0, rows, buf)

    def gemms() -> None:
        for part in parts:
            torch.matmul(x, buf[: part.stop - part.start].T, out=out[:, part])

    def decodes() -> None:
        for part in parts:
            decoder(part.start, part.stop, buf[: part.stop - part.start])

    fns: dict[str, Callable[[], object]] = {
        f"w4a16 @{mib} MiB": lambda mib=mib: kernel_linear.tiled_matmul(
            x, w, tile_bytes=int(mib * (1 << 20)) * torch.get_num_threads())
        for mib in FLOOR_TILES
    }
    return {**fns, "GEMMs alone (hot tile)": gemms, "decode alone": decodes}


def cpu_times(fns: dict, repeats: int) -> dict[str, list[float]]:
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.thread_time()
            fn()
            samples[name].append(time.thread_time() - t0)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--cpu-time", action="store_true")
    parser.add_argument("--floor", action="store_true",
                        help="also run W4A16 at other tile sizes, and time its GEMM calls alone "
                        "(on a hot tile) and its decode alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time needs --threads 1")
    if args.floor and not lut_decode.isa():
        parser.error("--floor needs the native library (the LUT decode) on this machine")
    print(
        f"load {os.getloadavg()[0]:.2f}, {torch.get_num_threads()} thread(s), LUT decode: "
        f"{lut_decode.isa() or 'unavailable'}, clock: {'cpu' if args.cpu_time else 'wall'}"
    )
    for n, k in SHAPES:
        gen = torch.Generator().manual_seed(0)
        q = quantize(torch.randn(n, k, generator=gen).to(torch.bfloat16))
        w = vllm_dequantize(q, torch.bfloat16)
        for m in (1, 16):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            gs = compute_global_scale(x)
            kernels._EAGER_WORK.clear()  # auto's ledger as in a fresh process
            fns = {
                "F.linear": lambda x=x, w=w: F.linear(x, w),
                "w4a16": lambda x=x, gs=gs, q=q: linear(
                    x, q, input_global_scale=gs, backend="w4a16"
                ),
                "emulation": lambda x=x, gs=gs, q=q: linear(
                    x, q, input_global_scale=gs, backend="emulation"
                ),
            }
            if args.floor:
                fns.update(floor_parts(x, q))
            if args.cpu_time:
                samples = cpu_times(fns, args.repeats)
            else:
                timed = time_interleaved(fns, warmup=1, repeats=args.repeats)
                samples = {name: list(t.samples) for name, t in timed.items()}
            best = {name: min(v) for name, v in samples.items()}
            med = {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
            ratios = " | ".join(
                f"{name} {best[name] / best['F.linear']:.2f}x "
                f"(median {med[name] / med['F.linear']:.2f}x)"
                for name in fns if name != "F.linear"
            )
            print(
                f"M={m:>2} N={n} K={k}: F.linear {best['F.linear'] * 1e3:.2f} ms | {ratios} "
                f"| load {os.getloadavg()[0]:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
