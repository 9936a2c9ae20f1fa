#!/usr/bin/env bash
# One prepared script for a session that is lent a GPU machine (no registry there: it runs with
# that image's python3 and torch, nvfp4lab from this checkout via PYTHONPATH). Runs every GPU
# check and benchmark once and writes under $OUT (default results/): commit those files after.
#   bash benchmarks/gpu_session.sh            # or OUT=$OUT bash benchmarks/gpu_session.sh
# About 10 minutes on an H200 (Triton compiles the fused kernels once: ~1-2 minutes of it).
#  1. tests/test_cuda.py: CUDA bits equal the CPU's, for the eager pipeline AND the fused kernels
#     compiled to Triton (quantize, fake_quantize, dequantize in both decode orders, every dtype,
#     both conventions; the fused linear equals the eager linear on the GPU); the timing helper.
#  2. nvfp4lab bench: every op eager and fused with a y.copy_(x) row per weight shape, so each
#     row's copy_fraction is its share of the GPU's copy bandwidth (Llama-3-8B layer shapes, then
#     4096^2 and 8192^2 weights in bf16 and fp32); rows go to $OUT/<machine>.csv.
#  3. nvfp4lab bench --peers: compressed-tensors' quantize (and torchao's, if importable) against
#     nvfp4lab eager and fused at 4096^2 and 8192^2.
# Each step has a time limit, so one hang cannot eat the session; a failed step does not stop the
# others (the logs say which failed).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${OUT:-results}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NVFP4LAB_FUSED=auto  # the bench and the tests choose their path per call
$PY -m nvfp4lab info | tee "$out/gpu_info.txt"
timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/bench/test_timing.py \
    2>&1 | tee "$out/gpu_tests.txt"
timeout 300 $PY -m nvfp4lab bench --device cuda --out "$out" 2>&1 | tee "$out/gpu_bench.txt"
timeout 120 $PY -m nvfp4lab bench --device cuda --out "$out" \
    --shapes 16x4096x4096 16x8192x8192 --ops copy quantize dequantize fake_quantize \
    --dtypes bfloat16 float32 2>&1 | tee "$out/gpu_bench_elementwise.txt"
timeout 120 $PY -m nvfp4lab bench --peers --device cuda --out "$out" 2>&1 \
    | tee "$out/gpu_peers.txt"
