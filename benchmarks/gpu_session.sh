#!/usr/bin/env bash
# One prepared script for a session that is lent a GPU machine (no registry there: it runs with
# that image's python3 and torch, nvfp4lab from this checkout via PYTHONPATH). Runs every GPU
# check and benchmark once and writes under $OUT (default results/): commit those files after.
#   bash benchmarks/gpu_session.sh            # or OUT=$OUT bash benchmarks/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${OUT:-results}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY -m nvfp4lab info | tee "$out/gpu_info.txt"
$PY -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_timing.py 2>&1 \
    | tee "$out/gpu_tests.txt"
$PY -m nvfp4lab bench --device cuda --out "$out"
$PY -m nvfp4lab bench --peers --device cuda --out "$out"
