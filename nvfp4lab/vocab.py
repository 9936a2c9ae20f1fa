"""The one vocabulary of nvfp4lab: every named choice, declared once, checked one way.

Each vocabulary is a ``StrEnum``: members compare equal to their plain strings, so callers pass
``"emulation"`` or ``Backend.EMULATION`` alike, and :func:`check_choice` turns either into the
member or raises the one error wording, ``unknown <what> <value>; accepted values: …``.

=====================  ==============================================================  ========
vocabulary             values                                                          used by
=====================  ==============================================================  ========
:class:`Backend`       native, emulation, w4a16, q8_0 (``"auto"`` asks the dispatcher)  execution
:class:`GemmPath`      Backend's four plus bf16 and fp8 (roofline paths)               roofline
:class:`BiasMode`      output, fp32, dropped                                           execution
:class:`OrderName`    kernel, compressed-tensors, modelopt (arithmetic orders)        codec
:class:`Rounding`      rne, stochastic                                                 codec
:class:`ScaleSelection`  amax, four_over_six, mse_search                               codec
:class:`NonFinite`     raise, propagate                                                codec
:class:`QuantMethod`   rtn, gptq, mr-gptq (how quantize_model picks the weight codes)  execution
:class:`ScaleTiming`   original, updated (when GPTQ fixes a group's block scale)       execution
:class:`Platform`      cuda, rocm, xpu, cpu (vLLM's platforms)                         execution
:class:`Scheme`        NVFP4 (W4A4), NVFP4A16 (weight-only) checkpoint schemes         execution
:class:`Numerics`      Backend's four plus w4a8, q8_1 (what a kernel computes)         execution
:class:`Engine`        vllm, llama.cpp (the engines select_backend models)             execution
:class:`VllmPackage`   flashinfer, humming, b12x, fbgemm (optional kernel packages)    execution
:class:`VllmAlias`     seed, latest (named sets of vLLM rules)                         execution
:class:`CheckpointFormat`  compressed-tensors, modelopt, gguf, fp-quant (disk families) checkpoint
:class:`FusedMode`     auto, on, off (``NVFP4LAB_FUSED``: when the fused kernels run)  kernels
:class:`NativeIsa`     scalar, avx2, avx512 (``NVFP4LAB_NATIVE_ISA``: C++ vector cap)  kernels
:class:`KVCacheKind`   nvfp4, nvfp4_4over6, fp8 (vLLM's ``--kv-cache-dtype`` values)   execution
:class:`CorpusPart`    calibration, evaluation (the two parts of the LLM text)         corpus
:class:`LayerFormat`   nvfp4-rtn/-gptq/-mr-gptq, fp8, fp8-w8a16, mxfp4, q8_0, bf16     execution
=====================  ==============================================================  ========

:data:`SUPPORTED_DTYPES` are the floating dtypes NVFP4 quantizes from and computes in;
:data:`TENSOR_SCALE_STORAGE` says, per ``CheckpointFormat``, which form of the tensor scale it
stores and whether its engine shares one tensor scale across a fused group.

The overlaps, one line each (a value is written once: the later enum takes it from the earlier):

- ``Backend`` / ``GemmPath`` / ``Numerics``: what an NVFP4 layer runs / that plus the unquantized
  ``bf16`` and ``fp8`` GEMMs the roofline models / what a vLLM or llama.cpp kernel computes (that
  plus ``w4a8`` and ``q8_1``).
- ``OrderName`` / ``CheckpointFormat``: the arithmetic order in memory (``kernel`` included) /
  the disk family, named after the order its producer computes in, with its global-scale storage
  (``gguf`` is named after its file: llama.cpp's container, not an order).
- ``OrderName`` / ``Engine``: ``llama.cpp`` is ggml's quantizer order (in memory) / the engine
  whose execution path :func:`nvfp4lab.select_backend` models.
- ``GemmPath`` / ``LayerFormat``: ``bf16`` and ``fp8`` are the roofline's GEMMs / the formats a
  Linear of a mixed-precision model takes (``execution/mixed.py``).
- ``GemmPath`` / ``KVCacheKind``: ``fp8`` is the unquantized FP8 GEMM the roofline models / the
  FP8 E4M3 KV cache (vLLM spells both ``fp8``).

Values are spelled only here: the package names the members, and
``tests/test_vocabulary_guard.py`` fails on a vocabulary literal anywhere else.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

import torch

__all__ = [
    "AUTO",
    "SUPPORTED_DTYPES",
    "TENSOR_SCALE_STORAGE",
    "Backend",
    "BiasMode",
    "CheckpointFormat",
    "CorpusPart",
    "Engine",
    "FusedMode",
    "GemmPath",
    "KVCacheKind",
    "LayerFormat",
    "NativeIsa",
    "NonFinite",
    "Numerics",
    "OrderName",
    "Platform",
    "QuantMethod",
    "Rounding",
    "ScaleSelection",
    "ScaleTiming",
    "Scheme",
    "TensorScaleStorage",
    "VllmAlias",
    "VllmPackage",
    "check_choice",
    "check_dtype",
    "dtype_name",
]

#: The backend request that lets :func:`nvfp4lab.select_backend` decide.
AUTO = "auto"


class Backend(StrEnum):
    """How an NVFP4 linear layer runs (the three paths vLLM chooses between, and llama.cpp's CPU
    path)."""

    NATIVE = "native"  #: FP4 tensor cores (torch._scaled_mm), capability >= 10.0
    EMULATION = "emulation"  #: W4A4 emulated: fake-quantized activations, 16-bit GEMM
    W4A16 = "w4a16"  #: weight-only: dequantized weights, 16-bit activations
    #: llama.cpp's CPU path: activations quantized to Q8_0 (int8 per 32, fp16 scale), integer
    #: dot products per 4 values, ggml_vec_dot_nvfp4_q8_0's float32 order (execution/ggml_cpu.py)
    Q8_0 = "q8_0"


class GemmPath(StrEnum):
    """Roofline paths: the backends, plus the unquantized 16-bit and FP8 GEMMs.

    GemmPath = :class:`Backend` + ``bf16`` and ``fp8`` (GEMMs the roofline models but no NVFP4
    layer runs); its backend members take their values from :class:`Backend`.
    """

    BF16 = "bf16"
    FP8 = "fp8"
    NATIVE = Backend.NATIVE.value
    W4A16 = Backend.W4A16.value
    EMULATION = Backend.EMULATION.value
    #: llama.cpp's int8-activation GEMM (Q8_0 on CPU; MMQ's Q8_1 on a GPU, 1.125 B per value)
    Q8_0 = Backend.Q8_0.value


class BiasMode(StrEnum):
    """Where the bias enters a linear layer's output."""

    OUTPUT = "output"  #: after the GEMM output is rounded (native kernels, vLLM)
    FP32 = "fp32"  #: in float32 before the single rounding
    DROPPED = "dropped"  #: not at all: the seed's emulation bug, reproduced on purpose


class OrderName(StrEnum):
    """The name of an arithmetic order of quantization (its steps: :mod:`nvfp4lab.orders`).

    An order = how the numbers are computed (in memory); :class:`CheckpointFormat` = which disk
    family stores them (its members share these values; ``kernel`` has no disk family).
    ``VLLM_KERNEL`` (value ``"kernel"``) is the arithmetic of vLLM's CUDA quantize kernel, the
    default; its member is also reachable as ``KERNEL`` (the name before issue 33). The value
    stays ``"kernel"``: results shards, CSV columns and the command line store it.
    """

    VLLM_KERNEL = "kernel"
    KERNEL = "kernel"  #: alias of VLLM_KERNEL (the same member)
    COMPRESSED_TENSORS = "compressed-tensors"
    MODELOPT = "modelopt"
    LLAMA_CPP = "llama.cpp"  #: ggml's ``quantize_row_nvfp4_ref``: no tensor scale


class Rounding(StrEnum):
    """Element rounding to E2M1."""

    RNE = "rne"
    STOCHASTIC = "stochastic"


class ScaleSelection(StrEnum):
    """How each block's E4M3 scale is chosen."""

    AMAX = "amax"  #: block max maps to 6
    FOUR_OVER_SIX = "four_over_six"  #: try max -> 6 and max -> 4, keep the lower error
    MSE_SEARCH = "mse_search"  #: try several targets, keep the lowest error


class NonFinite(StrEnum):
    """What quantization does with NaN/Inf inputs."""

    RAISE = "raise"
    PROPAGATE = "propagate"


class QuantMethod(StrEnum):
    """How :func:`nvfp4lab.quantize_model` chooses a weight's codes."""

    RTN = "rtn"  #: round to nearest, each weight on its own (no data needed)
    GPTQ = "gptq"  #: GPTQ: column by column, rounding errors fed forward through calibration data
    #: GPTQ on block-Hadamard-rotated weights and Hessians (MR-GPTQ, arXiv 2509.23202); the layer
    #: rotates its inputs at run time
    MR_GPTQ = "mr-gptq"


class ScaleTiming(StrEnum):
    """When GPTQ fixes a 16-column group's block scale (:mod:`nvfp4lab.execution.gptq`)."""

    ORIGINAL = "original"  #: up front, from the original weights (llm-compressor >= 0.4)
    UPDATED = "updated"  #: at the group's first column, from the error-updated weights


class Platform(StrEnum):
    """A vLLM platform (``vllm.platforms.PlatformEnum``) the dispatcher can model."""

    CUDA = "cuda"
    ROCM = "rocm"
    XPU = "xpu"
    CPU = "cpu"


class Scheme(StrEnum):
    """An NVFP4 checkpoint scheme (compressed-tensors preset names)."""

    NVFP4 = "NVFP4"  #: W4A4: FP4 weights and FP4 activations (input_global_scale stored)
    NVFP4A16 = "NVFP4A16"  #: weight-only: FP4 weights, 16-bit activations


class Numerics(StrEnum):
    """What a vLLM or llama.cpp NVFP4 kernel computes (the numerics class of a kernel).

    Numerics = :class:`Backend`'s four (values taken from it) + ``w4a8`` + ``q8_1``: the first
    four are paths nvfp4lab runs; ``w4a8`` is not (nvfp4lab has no FP8-activation path and runs
    ``w4a16`` in its place), nor is ``q8_1`` (nvfp4lab runs ``q8_0``, the same class with
    another rounding, in its place).
    """

    NATIVE = Backend.NATIVE.value  #: W4A4: FP4 x FP4 block-scaled products, fp32 accumulation
    EMULATION = Backend.EMULATION.value  #: W4A4 fake-quantized in 16 bits, then a 16-bit GEMM
    W4A16 = Backend.W4A16.value  #: weight-only: FP4 weights decoded, 16-bit activations
    W4A8 = "w4a8"  #: FP4 weights, activations quantized per token to FP8 E4M3 (Humming sm_89/90)
    #: FP4 weights x llama.cpp's CPU Q8_0 activations (int8 per 32, fp16 scale, round half even)
    Q8_0 = Backend.Q8_0.value
    #: FP4 weights x Q8_1 activations (int8 per 32, roundf): llama.cpp's CUDA MMQ / MMVQ
    Q8_1 = "q8_1"


class Engine(StrEnum):
    """An inference engine whose NVFP4 path :func:`nvfp4lab.select_backend` models."""

    VLLM = "vllm"  #: vLLM, release by release (execution/vllm_rules.py, vllm_select.py)
    #: llama.cpp as llama-cpp-python 0.3.36 vendors it (execution/llama_cpp_rules.py); the value
    #: is OrderName's: the engine and its own quantizer's order share the name
    LLAMA_CPP = OrderName.LLAMA_CPP.value


class VllmPackage(StrEnum):
    """Optional packages whose presence changes vLLM's NVFP4 kernel choice."""

    FLASHINFER = "flashinfer"  #: flashinfer-python (with cubins or nvcc)
    HUMMING = "humming"  #: humming-kernels
    B12X = "b12x"  #: b12x (``pip install vllm[b12x]``)
    FBGEMM = "fbgemm"  #: fbgemm-gpu-genai


class VllmAlias(StrEnum):
    """Named vLLM rule sets accepted where a release string is."""

    SEED = "seed"  #: the rules as PR #19879 merged them (first released in 0.9.2)
    LATEST = "latest"  #: the newest modelled release


class CheckpointFormat(StrEnum):
    """An NVFP4 checkpoint family, by how it stores the per-tensor (global) scale.

    CheckpointFormat = the disk family; :class:`OrderName` = the arithmetic order. A
    safetensors family is named after the convention its producer computes in, so those values
    are OrderName's; ``gguf`` is named after its file format.
    """

    #: ENCODE scale, 2688/amax (weight_global_scale)
    COMPRESSED_TENSORS = OrderName.COMPRESSED_TENSORS.value
    MODELOPT = OrderName.MODELOPT.value  #: DECODE scale, amax/2688 (weight_scale_2)
    #: llama.cpp's file: DECODE scale, amax/2688, in a ``<name>.scale`` sidecar (no arithmetic
    #: order of its own here: GGUF is a container, whatever order made the codes)
    GGUF = "gguf"
    #: FP-Quant's own format (``quant_method: "fp_quant"``, transformers' and vLLM's
    #: ``FPQuantConfig``): ENCODE scale, 2688/amax (weight_global_scale), per-layer Hadamard
    #: matrices; named after its producer (no arithmetic order of that name here)
    FP_QUANT = "fp-quant"


@dataclass(frozen=True)
class TensorScaleStorage:
    """How a checkpoint format stores a quantized layer's tensor (global) scale, and how the
    engine that runs it reads a fused group's.

    ``decode``: True for the DECODE form on disk (amax/2688), False for ENCODE (2688/amax);
    ``shared_in_fused_groups``: whether that engine keeps ONE tensor scale for a fused group
    (q/k/v, gate/up: vLLM, the ``max`` of the stored values), else one per tensor (llama.cpp).
    """

    decode: bool
    shared_in_fused_groups: bool


#: Each checkpoint format's :class:`TensorScaleStorage`: the one statement of these facts, which
#: the format specs (``checkpoint/formats``) and ``execution/shared_scales`` both read.
TENSOR_SCALE_STORAGE: dict[CheckpointFormat, TensorScaleStorage] = {
    CheckpointFormat.COMPRESSED_TENSORS: TensorScaleStorage(decode=False,
                                                            shared_in_fused_groups=True),
    CheckpointFormat.MODELOPT: TensorScaleStorage(decode=True, shared_in_fused_groups=True),
    CheckpointFormat.GGUF: TensorScaleStorage(decode=True, shared_in_fused_groups=False),
    CheckpointFormat.FP_QUANT: TensorScaleStorage(decode=False, shared_in_fused_groups=True),
}


class FusedMode(StrEnum):
    """When the fused kernels (:mod:`nvfp4lab.kernels`) replace the eager pipeline."""

    AUTO = "auto"  #: large tensors, once this process's eager work has paid for compilation
    ON = "on"  #: every eligible call (tests, benchmarks)
    OFF = "off"  #: never: the eager pipeline only


class NativeIsa(StrEnum):
    """A vector path of nvfp4lab's C++ kernels (:mod:`nvfp4lab.kernels.native`), narrowest first:
    what ``NVFP4LAB_NATIVE_ISA`` caps them at."""

    SCALAR = "scalar"  #: the x86-64 baseline loops
    AVX2 = "avx2"  #: AVX2 (with F16C where the kernel converts float16)
    AVX512 = "avx512"  #: AVX-512 (F, BW; VL for the block encode)


class KVCacheKind(StrEnum):
    """A quantized KV-cache format, by the name vLLM's ``--kv-cache-dtype`` gives it (the ones
    :mod:`nvfp4lab.execution.kv_cache` models; docs/kv_cache.md has the facts and sources)."""

    NVFP4 = "nvfp4"  #: E2M1 codes and one E4M3 scale per 16 values, block max -> 6
    #: the NVFP4 layout; per 16 values the lower squared error of block max -> 6 and -> 4
    NVFP4_4OVER6 = "nvfp4_4over6"
    FP8 = GemmPath.FP8.value  #: one FP8 E4M3 byte per value, ``x / scale``, saturating


class LayerFormat(StrEnum):
    """The format of one Linear layer in a mixed-precision model (:mod:`nvfp4lab.execution.mixed`,
    the per-layer sensitivity and search of :mod:`nvfp4lab.studies.llm_sensitivity`)."""

    NVFP4_RTN = "nvfp4-rtn"  #: NVFP4 weights rounded to nearest, float activations (W4A16)
    NVFP4_GPTQ = "nvfp4-gptq"  #: NVFP4 weights by GPTQ, float activations (W4A16)
    #: NVFP4 weights of W·Q by GPTQ (MR-GPTQ: compressed-tensors' random-hadamard 16), the
    #: inputs rotated at run time, float activations (W4A16)
    NVFP4_MR_GPTQ = "nvfp4-mr-gptq"
    #: FP8 E4M3 weights (per-channel scales) and dynamic per-token FP8 activations (W8A8)
    FP8 = GemmPath.FP8.value
    #: FP8 E4M3 weights (per-channel scales), float activations (W8A16: vLLM's Marlin FP8)
    FP8_W8A16 = "fp8-w8a16"
    MXFP4 = "mxfp4"  #: MXFP4 weights (E2M1, E8M0 scale per 32), float activations (W4A16)
    #: llama.cpp's Q8_0 weights (int8, float16 scale per 32) and Q8_0 activations (GGUF mixes)
    Q8_0 = GemmPath.Q8_0.value
    BF16 = GemmPath.BF16.value  #: left float (counted as 16 bits a weight)


class CorpusPart(StrEnum):
    """A part of the language-model text (:mod:`nvfp4lab.corpus`); the two never overlap."""

    CALIBRATION = "calibration"  #: calibrates quantization (GPTQ, activation scales)
    EVALUATION = "evaluation"  #: held out: perplexity and KL divergence are measured on it


#: Floating dtypes NVFP4 quantizes from and computes in.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

E = TypeVar("E", bound=StrEnum)


def check_choice(
    what: str, value: object, vocabulary: type[E], *, extra: Iterable[str] = ()
) -> E | str:
    """``value`` as a member of ``vocabulary`` (or one of ``extra``, returned as the string).

    Raises ValueError ``unknown <what> <value>; accepted values: 'a', 'b', …`` otherwise.
    """
    extras = tuple(extra)
    if isinstance(value, str):
        if value in extras:
            return value
        try:
            return vocabulary(value)
        except ValueError:
            pass
    accepted = ", ".join(repr(v) for v in (*extras, *(m.value for m in vocabulary)))
    raise ValueError(f"unknown {what} {value!r}; accepted values: {accepted}")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def check_dtype(dtype: object, what: str = "dtype") -> torch.dtype:
    """``dtype`` if it is one of :data:`SUPPORTED_DTYPES`, else TypeError naming ``what``."""
    if dtype not in SUPPORTED_DTYPES:
        hint = ""
        if isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex):
            hint = " (convert with .float())"
        raise TypeError(
            f"{what} must be float32, bfloat16 or float16, got {dtype}{hint}"
        )
    return dtype  # type: ignore[return-value]


#: Names renamed by issue 33 ("one word per idea"), kept one release as deprecated aliases:
#: old name -> (the object, its new name).
_RENAMED: dict[str, tuple[object, str]] = {"Convention": (OrderName, "OrderName")}


def __getattr__(name: str) -> object:
    """The deprecated aliases of :data:`_RENAMED` (they warn, and go in the next release)."""
    if name in _RENAMED:
        import warnings

        value, new = _RENAMED[name]
        warnings.warn(f"nvfp4lab.vocab.{name} is deprecated: use {new}", DeprecationWarning,
                      stacklevel=2)
        return value
    raise AttributeError(f"module 'nvfp4lab.vocab' has no attribute {name!r}")
