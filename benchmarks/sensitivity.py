"""Direct per-layer sensitivity of SmolLM2-135M (``studies.llm_sensitivity``): time and peak
memory, in process and on a Dask cluster, and the proxy's rank correlation with it.

    nice python benchmarks/sensitivity.py [--formats nvfp4-rtn ...] [--tokens 512]
        [--layers N] [--samples 32] [--threads 1] [--dask WORKERS] [--out table.csv]

The reference run: the first ``--tokens`` tokens of the calibration windows
(``corpus.calibration_batches(tokenizer, samples=--samples, length=256, seed=0)``, the study's,
in their drawn order) in windows of 256; the Hessians of the proxy (and GPTQ) from all
``--samples`` windows. ``--layers N``: only the first N quantizable Linears (a timing sample;
the time of all 210 is then extrapolated per layer and block, and said so). ``--dask W``: a
``dask scheduler`` and ``dask worker --nworkers W --nthreads 1`` started here (torch threads
per worker: ``--threads``), the same table checked equal to the in-process one when both run.
Peak memory: this process's ``VmHWM`` (the workers' own peaks are read from ``/proc`` while they
run). Not a test: the full run takes tens of minutes on two cores.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _hwm_mb(pid: int | str = "self") -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _cluster(workers: int, threads: int, folder: Path) -> tuple[str, list[subprocess.Popen]]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dask = str(Path(sys.executable).parent / "dask")
    env = {**os.environ, "NVFP4LAB_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    procs = [subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", str(port),
                               "--no-dashboard"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=env, start_new_session=True)]
    time.sleep(3)
    procs.append(subprocess.Popen(
        [dask, "worker", f"tcp://127.0.0.1:{port}", "--nworkers", str(workers), "--nthreads",
         "1", "--no-dashboard", "--memory-limit", "0", "--local-directory", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True))
    return f"tcp://127.0.0.1:{port}", procs


def main() -> None:
    # SIGTERM (``timeout``, a CI runner) raises SystemExit here, so the ``finally`` below stops
    # the Dask scheduler and workers this script started instead of leaving them running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=["nvfp4-rtn"])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dask", type=int, default=0, metavar="WORKERS")
    parser.add_argument("--no-local", action="store_true", help="only the Dask run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from nvfp4lab import corpus
    from nvfp4lab.execution.mixed import quantizable_linears
    from nvfp4lab.models import smollm2
    from nvfp4lab.studies import llm
    from nvfp4lab.studies.llm_sensitivity import sensitivity

    model, tokenizer = smollm2()
    batches = corpus.calibration_batches(tokenizer, samples=args.samples, length=256, seed=0)
    ids = torch.cat([b["input_ids"].reshape(-1) for b in batches])[: args.tokens]
    run = llm.reference_run(model, ids, context=256, progress=False)
    names = list(quantizable_linears(model))
    layers = names[: args.layers] if args.layers else None
    print(f"SmolLM2: {len(names)} quantizable Linears, {run.tokens} predicted tokens, formats "
          f"{' '.join(args.formats)}, torch threads {args.threads}", flush=True)
    tables = {}
    if not args.no_local:
        start = time.perf_counter()
        tables["local"] = sensitivity(model, run, formats=args.formats, layers=layers,
                                      calibration=batches)
        seconds = time.perf_counter() - start
        print(f"in process: {seconds:.0f} s, peak RSS {_hwm_mb():.0f} MiB", flush=True)
    if args.dask:
        with tempfile.TemporaryDirectory() as scratch:
            address, procs = _cluster(args.dask, args.threads, Path(scratch))
            peaks: dict[int, float] = {}
            stop = threading.Event()

            def watch() -> None:
                import psutil

                while not stop.wait(0.5):
                    for child in psutil.Process(procs[1].pid).children(recursive=True):
                        peaks[child.pid] = max(peaks.get(child.pid, 0.0), _hwm_mb(child.pid))

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            try:
                start = time.perf_counter()
                tables["dask"] = sensitivity(model, run, formats=args.formats, layers=layers,
                                             calibration=batches, client=address)
                seconds = time.perf_counter() - start
            finally:
                stop.set()
                watcher.join()
                for proc in reversed(procs):
                    proc.terminate()
                    proc.wait(30)
            shown = ", ".join(f"{v:.0f}" for v in peaks.values())
            print(f"{args.dask} Dask workers: {seconds:.0f} s, this process's peak RSS "
                  f"{_hwm_mb():.0f} MiB, the workers' {shown} MiB", flush=True)
    if len(tables) == 2:
        same = [r.kld for r in tables["local"].rows] == [r.kld for r in tables["dask"].rows]
        print(f"Dask table equal to the in-process one: {same}")
    table = next(iter(tables.values()))
    for fmt in table.formats:
        print(f"{fmt}: Spearman(proxy, direct) = {table.rank_correlation(fmt):.3f} over "
              f"{sum(1 for r in table.rows if r.format == fmt)} layers")
    if layers is not None:
        per_layer = sum(r.seconds for r in table.rows) / len(table.rows)
        print(f"sample of {len(layers)} layers: {per_layer:.2f} s a pass on average (blocks "
              f"{sorted({n.split('.')[2] for n in layers})} only: passes from later blocks are "
              "shorter)")
    if args.out:
        table.save_csv(args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
