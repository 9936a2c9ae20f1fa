"""llama.cpp's NVFP4 matmul paths per device, as data with their sources.

What :func:`nvfp4lab.select_backend` answers for ``engine="llama.cpp"``. The facts are read from
llama.cpp@0c1e57098, the copy llama-cpp-python 0.3.36 vendors (:data:`RELEASE`); every path and
rule step below names its file. ggml numbers CUDA capabilities ``100 * major + 10 * minor``
(ggml-cuda.cu ``info.devices[id].cc``), so sm_120 is 1200.

=============================  ==========================================  ================
path                           activations                                 where
=============================  ==========================================  ================
:data:`CPU` NVFP4 x Q8_0       Q8_0: int8 per 32, fp16 ``d``, half to even  every CPU
:data:`CUDA_MMQ` NVFP4 x Q8_1  Q8_1: int8 per 32, ``roundf``                CUDA / HIP GPUs
:data:`BLACKWELL` FP4 MMA      NVFP4 per row: scale ``amax/2688``, block    sm_120, sm_121
                               scales searched over 5 E4M3 codes
=============================  ==========================================  ================

The Blackwell path needs the build to include an sm_120a/121a architecture
(``ggml_cuda_highest_compiled_arch``) and covers capabilities 1200 <= cc < 1300
(``GGML_CUDA_CC_BLACKWELL`` .. ``GGML_CUDA_CC_RUBIN``, common.cuh: the comment there says the
FP4 MMA of the 1200 family is used, not sm_100's). B200 / B300 (sm_100 / sm_103) take MMQ with
Q8_1. ``GGML_CUDA_MMQ_PREC`` (q4 | q8 | auto) overrides the activation precision; without it a
GGUF can keep single tensors at Q8 (``general.tensor_extra.prec_a4`` false, llama-model.cpp
``llama_prec_policy::load``). Batches of at most 8 tokens (``MMVQ_MAX_BATCH_SIZE``,
``ggml_cuda_should_use_mmvq``) take MMVQ on every GPU, whose activations are always Q8_1
(mmvq.cu ``quantize_row_q8_1_cuda``).

XPU (ggml-sycl) is not modelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nvfp4lab.settings import LLAMA_MMQ_PREC_ENV
from nvfp4lab.vocab import Numerics, Platform

__all__ = [
    "BLACKWELL",
    "BLACKWELL_CC",
    "CPU",
    "CUDA_MMQ",
    "MMQ_PRECISIONS",
    "PATHS",
    "RELEASE",
    "LlamaCppOutcome",
    "LlamaCppPath",
    "ggml_cc",
    "select",
]

#: The llama.cpp whose code these rules read.
RELEASE = "llama.cpp@0c1e57098 (llama-cpp-python 0.3.36)"

#: ggml's capability range of the native FP4 MMA: GGML_CUDA_CC_BLACKWELL <= cc < RUBIN.
BLACKWELL_CC: tuple[int, int] = (1200, 1300)

#: The values ``GGML_CUDA_MMQ_PREC`` accepts (mmq.cu ``ggml_cuda_mmq_get_prec_env``, lower-cased;
#: anything else: a warning and "auto").
MMQ_PRECISIONS: tuple[str, ...] = ("q4", "q8", "auto")


@dataclass(frozen=True)
class LlamaCppPath:
    """One way llama.cpp multiplies an NVFP4 weight: a short ``title``, the ``kernel``, the
    ``numerics`` class, how it quantizes the ``activations``, and its ``sources``."""

    title: str
    kernel: str
    numerics: Numerics
    activations: str
    sources: tuple[str, ...]


CPU = LlamaCppPath(
    "CPU NVFP4xQ8_0",
    "ggml_vec_dot_nvfp4_q8_0",
    Numerics.Q8_0,
    "Q8_0 per 32 values: d = fp16(amax/127), codes round_half_even(x * 127/amax)",
    (
        "ggml-cpu/ggml-cpu.c type_traits_cpu[GGML_TYPE_NVFP4]: vec_dot_type GGML_TYPE_Q8_0",
        "ggml-cpu/ggml-cpu.c ggml_compute_forward_mul_mat: rows -> Q8_0 by from_float, one "
        "vec_dot per output (llamafile_sgemm has no NVFP4 case)",
        "ggml-cpu/arch/x86/quants.c quantize_row_q8_0 and ggml_vec_dot_nvfp4_q8_0 (AVX2)",
    ),
)

CUDA_MMQ = LlamaCppPath(
    "CUDA MMQ NVFP4xQ8_1",
    "mul_mat_q<GGML_TYPE_NVFP4> (MMQ; mul_mat_vec_q for <= 8 tokens)",
    Numerics.Q8_1,
    "Q8_1 per 32 values: MMQ codes roundf(x * (127/amax)) with a float32 d = 1/(127/amax); "
    "MMVQ codes roundf(x / d) with d = amax/127 in half",
    (
        "ggml-cuda/mmq.cu ggml_cuda_mmq_get_prec_src1: Q8 unless NVFP4/MXFP4 on Blackwell",
        "ggml-cuda/quantize.cu quantize_mmq_q8_1 (MMQ_Q8_1_DS_LAYOUT_D4 for NVFP4, mmq.cuh) and "
        "quantize_q8_1 (MMVQ)",
    ),
)

BLACKWELL = LlamaCppPath(
    "Blackwell native FP4 MMA",
    "mul_mat_q<GGML_TYPE_NVFP4, GGML_PREC_Q4> (FP4 MMA)",
    Numerics.NATIVE,
    "NVFP4 per row: row scale amax_row/(6*448), each 16-value block scale fp8(amax/6) and the "
    "E4M3 codes -2..+2 around it, the lowest squared error kept",
    (
        "ggml-cuda/common.cuh blackwell_mma_available: 1200 <= cc < 1300, NVIDIA, compiled arch",
        "ggml-cuda/quantize.cu quantize_mmq_nvfp4 (per-row scale, test_offsets {0,-1,1,-2,2})",
    ),
)

#: Every modelled path.
PATHS: tuple[LlamaCppPath, ...] = (CPU, CUDA_MMQ, BLACKWELL)


@dataclass(frozen=True)
class LlamaCppOutcome:
    """The path llama.cpp takes (``path``), the rule ``steps`` with their sources, and the
    variables set but without effect (``ignored``), each a sentence."""

    path: LlamaCppPath
    steps: tuple[str, ...]
    ignored: tuple[str, ...] = ()


def ggml_cc(capability: tuple[int, int]) -> int:
    """ggml's number for a CUDA capability: (12, 0) -> 1200."""
    return 100 * capability[0] + 10 * capability[1]


def _mmq_precision(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(``GGML_CUDA_MMQ_PREC`` as llama.cpp reads it: "q4", "q8" or None for auto, a sentence
    when the value is not one it knows)."""
    raw = env.get(LLAMA_MMQ_PREC_ENV)
    if raw is None:
        return None, None
    value = raw.lower()
    if value not in MMQ_PRECISIONS:
        return None, (
            f"{LLAMA_MMQ_PREC_ENV}={raw!r} is not q4, q8 or auto: llama.cpp warns and keeps auto "
            "(mmq.cu ggml_cuda_mmq_get_prec_env)"
        )
    return (None if value == MMQ_PRECISIONS[2] else value), None


def select(
    platform: Platform, capability: tuple[int, int] | None, env: Mapping[str, str]
) -> LlamaCppOutcome:
    """The path llama.cpp takes for an NVFP4 matmul of more than 8 tokens on ``platform``
    (``capability`` for CUDA / ROCm), with ``env``'s ``GGML_CUDA_MMQ_PREC``.

    ValueError for XPU (ggml-sycl is not modelled) and for CUDA without a capability.
    """
    if platform == Platform.XPU:
        raise ValueError(
            "engine='llama.cpp' models llama.cpp's CPU and CUDA/HIP backends; platform 'xpu' "
            "(ggml-sycl) is not modelled: pass platform='cpu', 'cuda' or 'rocm'"
        )
    if platform == Platform.CPU:
        return LlamaCppOutcome(CPU, CPU.sources)
    if capability is None:
        raise ValueError(
            f"platform={platform.value!r} needs a compute capability for engine='llama.cpp'; "
            "pass capability=(major, minor) or gpu='H100'"
        )
    cc = ggml_cc(capability)
    precision, bad = _mmq_precision(env)
    ignored = (bad,) if bad else ()
    steps = [f"ggml cc {cc} ({'HIP' if platform == Platform.ROCM else 'CUDA'})"]
    native = platform == Platform.CUDA and BLACKWELL_CC[0] <= cc < BLACKWELL_CC[1]
    if not native:
        steps.append(
            "not 1200 <= cc < 1300 on NVIDIA: activations stay Q8_1 "
            "(common.cuh blackwell_mma_available)"
        )
        if precision == MMQ_PRECISIONS[0]:
            ignored += (
                f"{LLAMA_MMQ_PREC_ENV}=q4 has no effect: 4-bit activations need the Blackwell "
                "FP4 MMA (mmq.cu ggml_cuda_mmq_get_prec_src1)",
            )
        return LlamaCppOutcome(CUDA_MMQ, (*steps, *CUDA_MMQ.sources), ignored)
    if precision == MMQ_PRECISIONS[1]:
        steps.append(f"{LLAMA_MMQ_PREC_ENV}=q8 keeps activations at Q8_1 (mmq.cu)")
        return LlamaCppOutcome(CUDA_MMQ, (*steps, *CUDA_MMQ.sources), ignored)
    steps.append(
        "1200 <= cc < 1300: 4-bit activations by default, when the build includes sm_120a "
        "(a GGUF may keep single tensors at Q8: general.tensor_extra.prec_a4)"
    )
    return LlamaCppOutcome(BLACKWELL, (*steps, *BLACKWELL.sources), ignored)
