"""The block encode of every arithmetic order on each vector path, against ``copy_`` of the same
tensor, in one process (issue 38 item 2's table in docs/throughput.md).

    python benchmarks/encode_orders.py [--size 8192] [--repeats 7]

``block_encode.encode`` and ``fake_quantize`` (fresh outputs: what the codec runs after
``max |x|``) of a seeded ``size x size`` bfloat16 tensor for the kernel, modelopt and llama.cpp
orders on AVX-512 and AVX2 (``path=``, clamped to what the CPU has), interleaved with ``copy_``
(``bench.timing.time_interleaved``, the median of ``--repeats``). Prints ns per element and the
multiple of ``copy_``, with the CPU and the load average. Not a test.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch

from nvfp4lab.bench.timing import time_interleaved
from nvfp4lab.kernels import block_encode
from nvfp4lab.orders import ORDERS, ScaleForm
from nvfp4lab.vocab import NativeIsa, OrderName

ORDERS_TIMED = (OrderName.VLLM_KERNEL, OrderName.MODELOPT, OrderName.LLAMA_CPP)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = (line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name"))
            return next(names)
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    x = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    dst = torch.empty_like(x)
    encode_gs = torch.tensor([2688.0 / float(x.abs().max().float())])
    fns = {"copy_": lambda: dst.copy_(x)}
    for name in ORDERS_TIMED:
        order = ORDERS[name]
        gs = 1.0 / encode_gs if order.scale_form == ScaleForm.DECODE else encode_gs
        for path in (NativeIsa.AVX512, NativeIsa.AVX2):
            fns[f"{name} encode {path}"] = (
                lambda o=order, g=gs, p=path: block_encode.encode(x, g, o, path=p))
            fns[f"{name} fake_quantize {path}"] = (
                lambda o=order, g=gs, p=path: block_encode.fake_quantize(x, g, o, path=p))
    timings = time_interleaved(fns, warmup=2, repeats=args.repeats)
    copy = timings["copy_"].median_s
    print(f"{_cpu()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}, "
          f"{args.size}² bf16, vector path on this CPU: {block_encode.isa()}")
    for label, t in timings.items():
        print(f"{label:34s} {t.median_s / x.numel() * 1e9:6.3f} ns/element  "
              f"{t.median_s / copy:5.2f}x copy_")


if __name__ == "__main__":
    main()
