"""Peers side by side: compressed-tensors' (and torchao's, when installed) NVFP4 quantize vs
nvfp4lab on the same seeded tensors, in one process. Same as ``nvfp4lab bench --peers``.

Usage: ``python benchmarks/peers.py [--quick] [--shapes 1x4096x4096 ...] [--out FILE|DIR]``
(for ``--shapes`` only N and K of each MxNxK are used: the weight ``[N, K]`` is quantized).
"""

from __future__ import annotations

import sys

from nvfp4lab.bench import main

if __name__ == "__main__":
    sys.exit(main(["--peers", *sys.argv[1:]]))
