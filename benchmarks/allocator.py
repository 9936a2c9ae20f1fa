"""How much of the gap to ``copy_`` is the allocator's: the same ops under glibc's default and
with large allocations kept in the heap.

glibc's ``malloc`` serves a request of 32 MiB or more (its largest dynamic mmap threshold on
64-bit Linux) with a fresh ``mmap`` and returns it with ``munmap`` on free, so every op that
returns a new tensor that large pays a page fault per 4 KiB page on EVERY call; ``y.copy_(x)``
into a preallocated ``y`` does not. ``MALLOC_MMAP_MAX_=0`` (no mmap) with a large
``MALLOC_TRIM_THRESHOLD_`` (no trimming) keeps freed pages in the heap for the next call, as
tcmalloc or jemalloc (PyTorch's CPU tuning guide recommends either) do by design.

This script runs ``nvfp4lab bench`` twice in subprocesses, once per setting, into a temporary
folder (nothing is added to ``results/``), and prints each op's time as a multiple of the same
run's ``copy_``. It changes no library behaviour: the setting is the process environment's.

Usage: ``python benchmarks/allocator.py [--shapes 16x8192x8192 ...] [--dtypes bfloat16 ...]
[--paths fused ...] [--repeats N]``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from nvfp4lab.bench.store import read_shards

#: The environment that keeps large freed blocks in glibc's heap (no mmap, no trim).
KEEP_PAGES = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
SETTINGS = {"glibc default": {}, "heap, no mmap": KEEP_PAGES}
OPS = ("copy", "quantize", "dequantize", "fake_quantize")


def run_bench(out: Path, extra_env: dict[str, str], args: argparse.Namespace) -> None:
    """One ``nvfp4lab bench`` subprocess writing its rows to ``out``."""
    env = {k: v for k, v in os.environ.items() if k not in KEEP_PAGES} | extra_env
    cmd = [sys.executable, "-m", "nvfp4lab", "bench", "--out", str(out), "--ops", *OPS,
           "--shapes", *args.shapes, "--dtypes", *args.dtypes, "--paths", *args.paths,
           "--repeats", str(args.repeats)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["16x4096x4096", "16x8192x8192"])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--paths", nargs="+", default=["fused"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    tables = []
    with tempfile.TemporaryDirectory(prefix="nvfp4lab-allocator-") as tmp:
        for label, extra_env in SETTINGS.items():
            out = Path(tmp) / f"{len(tables)}.csv"
            print(f"running nvfp4lab bench with {label} ...", file=sys.stderr)
            run_bench(out, extra_env, args)
            rows = read_shards([out])
            rows = rows[(rows["op"] != "copy") | (rows["backend"] == "clone")]
            rows = rows.assign(setting=label, x_copy=1.0 / rows["copy_fraction"])
            tables.append(rows)
    import pandas as pd

    both = pd.concat(tables)
    both["case"] = both["op"] + " " + both["path"].fillna("").astype(str)
    table = both.pivot_table(index=["case"], columns=["setting", "dtype", "shape"],
                             values="x_copy", aggfunc="median")
    print("time as a multiple of the same run's y.copy_(x) (copy row: x.clone())")
    print(table.round(2).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
