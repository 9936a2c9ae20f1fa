"""GPTQ and MR-GPTQ of SmolLM2 with notebook 07's calibration (32 x 256 tokens), and the Hessian
products against BLAS on the same operands, in one process (issue 38 item 3's figures in the
README's speed table).

    python benchmarks/gptq_speed.py [--runs 3] [--repeats 7]

1. The Hessian products, interleaved with their BLAS peers (``bench.timing.time_interleaved``,
   median of ``--repeats``): ``hessian_products.gram_add`` (lower triangle, rows in order) against
   ``addmm`` of the full float64 product (what ``Hessian.add`` ran before) on 2,048 seeded rows of
   K = 576 and 1,536, and ``block_congruence`` against the dense ``Qᵀ H Q``.
2. ``quantize_model(backend="w4a16", method="gptq" / "mr-gptq")`` on SmolLM2 float32, ``--runs``
   times each (a fresh copy each run): median and range of the wall time, whether every run gave
   the same state dict, and the peak RSS.

Prints the CPU, the threads, the vector path and the load average. Not a test.
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics

import torch

from nvfp4lab import corpus, quantize_model
from nvfp4lab.bench.store import environment, load_average
from nvfp4lab.bench.timing import format_seconds, stopwatch, time_interleaved
from nvfp4lab.hadamard import rotation_matrix, rotation_matrix_blocks
from nvfp4lab.kernels import hessian_products
from nvfp4lab.local_models import load_decoder, resolve_model
from nvfp4lab.studies.llm_study import DEFAULTS
from nvfp4lab.vocab import QuantMethod


def products(repeats: int) -> None:
    """Part 1: each native product and its BLAS peer, same operands, interleaved."""
    g = torch.Generator().manual_seed(0)
    for k in (576, 1536):
        rows = torch.randn(2048, k, generator=g)
        total = torch.zeros(k, k, dtype=torch.float64)
        h = rows.double().T @ rows.double()
        rotation = rotation_matrix(k, 0, dtype=torch.float64)
        blocks = rotation_matrix_blocks(k, 0, dtype=torch.float64)

        def blas_gram(total: torch.Tensor = total, rows: torch.Tensor = rows) -> None:
            wide = rows.to(torch.float64)
            total.addmm_(wide.T, wide)

        fns = {
            "gram_add (lower, rows in order)": lambda t=total, r=rows: hessian_products.gram_add(
                t, r),
            "addmm, full float64 product": blas_gram,
            "block_congruence": lambda h=h, b=blocks: hessian_products.block_congruence(
                h.clone(), b),
            "dense Q^T H Q": lambda h=h, q=rotation: q.T @ h @ q,
        }
        timings = time_interleaved(fns, warmup=1, repeats=repeats)
        labels = list(timings)
        for ours, peer in ((labels[0], labels[1]), (labels[2], labels[3])):
            a, b = timings[ours].median_s, timings[peer].median_s
            print(f"K={k:5d} {ours:32s} {format_seconds(a)}  {peer:28s} {format_seconds(b)}  "
                  f"{b / a:5.2f}x faster")


def whole_model(runs: int) -> None:
    """Part 2: GPTQ and MR-GPTQ of SmolLM2, ``runs`` times each."""
    model, tokenizer = load_decoder(resolve_model(None), dtype="float32")
    batches = corpus.calibration_batches(tokenizer, text=corpus.pydoc_split().calibration,
                                         samples=DEFAULTS["samples"], length=DEFAULTS["length"],
                                         seed=0)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    print(f"SmolLM2-135M float32, {tokens} calibration tokens in {len(batches)} batches")
    for method in (QuantMethod.GPTQ, QuantMethod.MR_GPTQ):
        seconds, states = [], []
        for _ in range(runs):
            copied = copy.deepcopy(model)
            with stopwatch() as watch:
                quantize_model(copied, backend="w4a16", method=method, calibration=batches)
            seconds.append(watch.wall_s)
            states.append(copied.state_dict())
        same = all(torch.equal(s[n], states[0][n]) for s in states[1:] for n in states[0])
        print(f"{method.value:8s} median {statistics.median(seconds):6.1f} s "
              f"(min {min(seconds):.1f}, max {max(seconds):.1f}, {runs} runs; every run the "
              f"same bits: {same})")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of the process {peak:,.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"{environment()['device_name']}, {torch.get_num_threads()} threads, vector path "
          f"{hessian_products.isa()}, load {load_average()}")
    products(args.repeats)
    whole_model(args.runs)


if __name__ == "__main__":
    main()
