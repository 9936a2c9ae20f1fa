"""Benchmarks: the timing helper, the results store, the runner, peers, a whole model and
``nvfp4lab bench``.

=============  =========================================================================
A new measured op goes into ``runner`` (its case and closure); a new peer into ``peers``.
"""

from __future__ import annotations

from nvfp4lab.bench.command import main, resolve_device, run_cli
from nvfp4lab.bench.peers import PeerResult, run_peers
from nvfp4lab.bench.runner import BenchConfig, run_bench
from nvfp4lab.bench.store import COLUMNS, append_rows, read_shards, shard_path

__all__ = [
    "COLUMNS",
    "BenchConfig",
    "PeerResult",
    "append_rows",
    "main",
    "read_shards",
    "resolve_device",
    "run_bench",
    "run_cli",
    "run_peers",
    "shard_path",
]
