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
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from nvfp4lab import kernels
from nvfp4lab.bench.timing import time_interleaved
from nvfp4lab.codec import compute_global_scale, quantize
from nvfp4lab.execution.gemm import linear, vllm_dequantize
from nvfp4lab.kernels import lut_decode

SHAPES = ((4096, 4096), (4096, 14336))  # (N, K)


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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time needs --threads 1")
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
                for name in ("w4a16", "emulation")
            )
            print(
                f"M={m:>2} N={n} K={k}: F.linear {best['F.linear'] * 1e3:.2f} ms | {ratios} "
                f"| load {os.getloadavg()[0]:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
