"""What a given vLLM release does for an NVFP4 linear layer: :func:`decide`.

One small function per era (:data:`nvfp4lab.execution.vllm_rules.ERAS`) follows that era's code
path step by step and returns an :class:`Outcome`: the kernel vLLM would build (or None and the
error vLLM would raise at load), its numerics class, where the bias goes, and the steps taken,
each with its source. Invalid inputs that vLLM itself rejects before choosing (a bad
``VLLM_USE_NVFP4_CT_EMULATIONS`` or ``VLLM_NVFP4_GEMM_BACKEND`` value, an unknown
``--linear-backend``) raise ValueError; a valid setup without a kernel is an Outcome with
``kernel=None``. Facts and citations: :mod:`nvfp4lab.execution.vllm_rules`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from nvfp4lab.execution import vllm_rules as R
from nvfp4lab.settings import BATCH_INVARIANT_ENV, EMULATION_ENV, FBGEMM_ENV, GEMM_BACKEND_ENV
from nvfp4lab.vocab import BiasMode, Numerics, Platform, Scheme, VllmPackage

__all__ = [
    "LINEAR_BACKENDS",
    "REGISTRY",
    "Outcome",
    "Request",
    "check_linear_backend",
    "decide",
    "ignored_variables",
    "linear_backends",
    "no_kernel_text",
]

_FIC, _CUT, _MAR = "FlashInferCutlass", "Cutlass", "Marlin"
_TRT, _CUDNN, _FBG, _EMU = "FlashInferTrtllm", "FlashInferCudnn", "Fbgemm", "Emulation"
_CUTE, _FIB, _HUM, _B12 = "FlashInferCuteDsl", "FlashInferB12x", "Humming", "B12x"
_CUTE16, _B1216, _TORCH = "FlashInferCuteDslNvFp4W4A16", "B12xNvFp4W4A16", "Torch"


def _cls(short: str) -> str:
    return short + "LinearKernel" if short.endswith("W4A16") else short + "NvFp4LinearKernel"


#: CUDA priority lists (``_POSSIBLE_NVFP4_KERNELS``, kernels/linear/__init__.py@X) by release.
#: ROCm is ``[Emulation]`` from 0.20.0 (PR #35733); XPU and CPU have no entry.
REGISTRY: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("0.20.0", (_FIC, _CUT, _MAR, _TRT, _CUDNN, _FBG, _EMU)),  # FlashInferB12x excluded (0.22)
    ("0.24.0", (_CUTE, _FIC, _CUT, _MAR, _TRT, _CUDNN, _FBG, _EMU)),  # PR #42235
    ("0.25.0", (_CUTE, _FIC, _CUT, _MAR, _TRT, _CUDNN, _FBG, _EMU, _HUM)),
    ("0.28.0", (_CUTE, _FIC, _FIB, _CUT, _MAR, _TRT, _CUDNN, _FBG, _B12, _EMU, _HUM)),
    ("0.30.0", (_CUTE, _FIC, _FIB, _CUT, _CUTE16, _MAR, _TRT, _CUDNN, _FBG, _B12, _TORCH, _EMU,
                _HUM)),
    ("0.32.0", (_CUTE, _FIC, _FIB, _CUT, _CUTE16, _MAR, _TRT, _CUDNN, _FBG, _B12, _B1216, _TORCH,
                _EMU, _HUM)),
)  # fmt: skip

#: Kernels allowed for NVFP4A16 in the registry (``a16_kernels``, from 0.27.0).
_A16: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("0.27.0", (_MAR, _HUM)),
    ("0.30.0", (_CUTE16, _MAR, _HUM)),
    ("0.32.0", (_B1216, _CUTE16, _MAR, _HUM)),
)

#: vLLM's own ``--linear-backend`` names for automatic selection and for its emulation kernel.
LINEAR_BACKEND_AUTO, LINEAR_BACKEND_EMULATION = "auto", "emulation"

#: ``--linear-backend`` values (``LinearBackend`` Literal, vllm/config/kernel.py@X) by release.
LINEAR_BACKENDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("0.22.0", ("auto", "cutlass", "flashinfer_cutlass", "flashinfer_trtllm", "flashinfer_cudnn",
                "marlin", "triton", "deep_gemm", "torch", "aiter", "machete", "fbgemm", "conch",
                "exllama", "emulation")),
    ("0.24.0", ("auto", "cutlass", "flashinfer_cutlass", "flashinfer_cutedsl",
                "flashinfer_trtllm", "flashinfer_cudnn", "flashinfer_b12x", "marlin", "triton",
                "deep_gemm", "torch", "aiter", "machete", "fbgemm", "conch", "exllama",
                "emulation")),
    ("0.25.0", ("auto", "cutlass", "flashinfer_cutlass", "flashinfer_cutedsl",
                "flashinfer_trtllm", "flashinfer_cudnn", "flashinfer_b12x", "marlin", "humming",
                "triton", "deep_gemm", "torch", "aiter", "machete", "fbgemm", "conch", "exllama",
                "emulation", "xpu", "xpu_woq")),
    ("0.28.0", ("auto", "cutlass", "flashinfer_cutlass", "flashinfer_cutedsl",
                "flashinfer_trtllm", "flashinfer_cudnn", "flashinfer_b12x", "b12x", "marlin",
                "humming", "triton", "deep_gemm", "torch", "aiter", "machete", "fbgemm", "conch",
                "exllama", "emulation", "xpu", "xpu_woq")),
)  # fmt: skip

#: NVFP4 kernels of each ``--linear-backend`` value (``_LINEAR_BACKEND_KERNEL_MAP``) by release.
_BACKEND_MAP: tuple[tuple[str, dict[str, tuple[str, ...]]], ...] = (
    ("0.22.0", {"cutlass": (_CUT,), "flashinfer_cutlass": (_FIC,), "flashinfer_trtllm": (_TRT,),
                "flashinfer_cudnn": (_CUDNN,), "marlin": (_MAR,), "fbgemm": (_FBG,),
                "emulation": (_EMU,)}),
    ("0.24.0", {"cutlass": (_CUT,), "flashinfer_cutlass": (_FIC,), "flashinfer_cutedsl": (_CUTE,),
                "flashinfer_trtllm": (_TRT,), "flashinfer_cudnn": (_CUDNN,),
                "flashinfer_b12x": (_FIB,), "marlin": (_MAR,), "fbgemm": (_FBG,),
                "emulation": (_EMU,)}),
    ("0.25.0", {"cutlass": (_CUT,), "flashinfer_cutlass": (_FIC,), "flashinfer_cutedsl": (_CUTE,),
                "flashinfer_trtllm": (_TRT,), "flashinfer_cudnn": (_CUDNN,),
                "flashinfer_b12x": (_FIB,), "humming": (_HUM,), "marlin": (_MAR,),
                "fbgemm": (_FBG,), "emulation": (_EMU,)}),
    ("0.28.0", {"b12x": (_B12,), "cutlass": (_CUT,), "flashinfer_cutlass": (_FIC,),
                "flashinfer_cutedsl": (_CUTE,), "flashinfer_trtllm": (_TRT,),
                "flashinfer_cudnn": (_CUDNN,), "flashinfer_b12x": (_FIB,), "humming": (_HUM,),
                "marlin": (_MAR,), "fbgemm": (_FBG,), "emulation": (_EMU,)}),
    ("0.30.0", {"b12x": (_B12,), "cutlass": (_CUT,), "flashinfer_cutlass": (_FIC,),
                "flashinfer_cutedsl": (_CUTE, _CUTE16), "flashinfer_trtllm": (_TRT,),
                "flashinfer_cudnn": (_CUDNN,), "flashinfer_b12x": (_FIB,), "humming": (_HUM,),
                "marlin": (_MAR,), "torch": (_TORCH,), "fbgemm": (_FBG,), "emulation": (_EMU,)}),
    ("0.32.0", {"b12x": (_B12, _B1216), "cutlass": (_CUT,), "flashinfer_cutlass": (_FIC,),
                "flashinfer_cutedsl": (_CUTE, _CUTE16), "flashinfer_trtllm": (_TRT,),
                "flashinfer_cudnn": (_CUDNN,), "flashinfer_b12x": (_FIB,), "humming": (_HUM,),
                "marlin": (_MAR,), "torch": (_TORCH,), "fbgemm": (_FBG,), "emulation": (_EMU,)}),
)  # fmt: skip

#: VLLM_NVFP4_GEMM_BACKEND value -> forced kernel (``_NVFP4_BACKEND_TO_KERNEL``, 0.20-0.23).
_ENV_KERNEL = {"flashinfer-b12x": _FIB, "flashinfer-cutlass": _FIC, "cutlass": _CUT,
               "marlin": _MAR, "flashinfer-trtllm": _TRT, "flashinfer-cudnn": _CUDNN,
               "emulation": _EMU}  # fmt: skip
_NO_KERNEL = "Failed to find a kernel that can implement the NVFP4 linear layer. Reasons: \n"


def no_kernel_text(error: str, platform: str) -> str:
    """vLLM's "no kernel" error (:attr:`Outcome.error`, kept as vLLM words it) on one line; an
    empty reason list, as on a platform with no NVFP4 kernel registered, is said, not left
    blank after "Reasons:"."""
    text = " ".join(line.strip() for line in error.strip().splitlines())
    if text.endswith("Reasons:"):
        text += f" (none listed: no NVFP4 kernel is registered for {platform})"
    return text


def linear_backends(rel: str) -> tuple[str, ...]:
    """The ``--linear-backend`` values release ``rel`` accepts (empty before 0.22.0)."""
    return R.by_release(LINEAR_BACKENDS, rel) or ()  # type: ignore[return-value]


@dataclass(frozen=True)
class Request:
    """One question to vLLM's rules: release ``rel`` (normalised), ``platform``, compute
    capability ``cc`` (major*10+minor, None when the platform has none), whether the CUDA
    runtime is >= 12.8 (``cuda_ok``), the checkpoint ``scheme``, the raw environment ``env``,
    ``--linear-backend`` (None = not given) and the optional ``packages`` installed."""

    rel: str
    platform: Platform
    cc: int | None
    scheme: Scheme
    env: Mapping[str, str]
    linear_backend: str | None
    packages: frozenset[VllmPackage]
    cuda_ok: bool = True


@dataclass(frozen=True)
class Outcome:
    """vLLM's answer: ``kernel`` (class name) or None with ``error`` (the load error text);
    ``numerics`` of the kernel; ``bias`` (:class:`BiasMode` nvfp4lab uses to reproduce it);
    ``defect``: a known wrong result of this release's path; ``steps``: the reasoning, each step
    with its source; ``emulation_asked``: the release honoured a request for emulation."""

    kernel: str | None
    error: str | None = None
    steps: tuple[str, ...] = ()
    emulation_asked: bool = False
    defect: str | None = None
    numerics: Numerics | None = field(default=None)
    bias: BiasMode | None = field(default=None)


def _ok(kernel: str, steps: list[str], req: Request, **extra: object) -> Outcome:
    name = _cls(kernel) if not kernel.endswith("Kernel") else kernel
    info = R.KERNELS[name]
    numerics = info.numerics
    if name == "HummingNvFp4LinearKernel":
        numerics = R.humming_numerics(req.cc, req.scheme)
    bias = extra.pop("bias", BiasMode.OUTPUT)
    return Outcome(name, None, tuple(steps), numerics=numerics, bias=bias, **extra)  # type: ignore[arg-type]


def _fail(error: str, steps: list[str], **extra: object) -> Outcome:
    return Outcome(None, error, tuple(steps), **extra)  # type: ignore[arg-type]


def _min_capability(req: Request, need: int, steps: list[str], **extra: object) -> Outcome | None:
    """The compressed-tensors scheme check (``_check_scheme_supported``): CUDA below ``need``
    fails at load; platforms without a capability skip it (compressed_tensors.py@0.9.2 L213)."""
    if req.platform == Platform.CUDA and req.cc is not None and req.cc < need:
        return _fail(
            "Quantization scheme is not supported for the current GPU. Min capability: "
            f"{need}. Current capability: {req.cc}.", steps, **extra)
    return None


def _marlin_scheme(req: Request, steps: list[str], need: int) -> Outcome:
    """CompressedTensorsW4A16Fp4: Marlin called from the scheme (before the registry)."""
    if (bad := _min_capability(req, need, steps)) is not None:
        return bad
    if req.platform != Platform.CUDA:
        return _fail(f"Marlin FP4 is a CUDA kernel: not available on {req.platform.value} "
                     "(nvfp4lab's reading; vLLM of this era did not target this platform)", steps)
    return _ok(_MAR, steps, req)


# ---------------------------------------------------------------------------------------------
# E0 - E2: the compressed-tensors scheme decides (0.9.1 .. 0.15.1)
# ---------------------------------------------------------------------------------------------


def _e0(req: Request) -> Outcome:
    steps = ["0.9.1 reads no NVFP4 variable"]
    if req.scheme == Scheme.NVFP4A16:
        steps.append("NVFP4A16 -> CompressedTensorsW4A16Fp4 (Marlin; PR #17914), min cc 8.0")
        return _marlin_scheme(req, steps, 80)
    steps.append("NVFP4 -> CompressedTensorsW4A4Fp4, min cc 8.0 (w4a4_nvfp4.py@0.9.1 L41-44)")
    if (bad := _min_capability(req, 80, steps)) is not None:
        return bad
    if R.cutlass_fp4_ok(req.platform, req.cc, req.cuda_ok):
        return _ok(_CUT, [*steps, "cutlass_fp4_supported() -> CUTLASS"], req)
    steps.append("no CUTLASS FP4 -> 'Running emulations': apply_weights returns "
                 "run_nvfp4_emulations(x, layer) and never adds the bias "
                 "(w4a4_nvfp4.py@0.9.1 L160-178; PR #18312)")
    return _ok(_EMU, steps, req, bias=BiasMode.DROPPED, defect="bias dropped")


def _w4a4_gemm_e1(req: Request, switch: bool, steps: list[str]) -> tuple[str | None, str | None]:
    """The GEMM backend CompressedTensorsW4A4Fp4.__init__ picks (0.9.2 .. 0.15.1):
    (kernel, error)."""
    fi = VllmPackage.FLASHINFER in req.packages
    cutlass = R.cutlass_fp4_ok(req.platform, req.cc, req.cuda_ok)
    if not R.version(req.rel) >= R.version("0.10.1"):
        return _CUT, None  # 0.9.2 / 0.10.0: CUTLASS only
    if R.version(req.rel) < R.version("0.11.1"):  # w4a4_nvfp4.py@0.10.1 / @0.11.0 __init__
        if R.version(req.rel) >= R.version("0.11.0") and R.parse_flag(
                FBGEMM_ENV, req.env.get(FBGEMM_ENV)):
            if VllmPackage.FBGEMM not in req.packages:
                return None, ("Backend fbgemm requires fbgemm.f4f4bf16 operator, Please install "
                              "with: pip install fbgemm-gpu-genai")
            return _FBG, None
        return (_FIC if fi else _CUT), None
    env = R.gemm_backend(req.env, req.rel)  # w4a4_nvfp4.py@0.11.1 __init__
    if env is None:
        kernel = _FIC if fi else _CUT if cutlass else None
    elif R.parse_flag(FBGEMM_ENV, req.env.get(FBGEMM_ENV)):
        steps.append(f"{FBGEMM_ENV} is read only because {GEMM_BACKEND_ENV} is set (0.11.1 quirk)")
        kernel = _FBG if VllmPackage.FBGEMM in req.packages else None
    elif env.startswith("flashinfer-"):
        if not fi:
            return None, f"FlashInfer is required for {env}"
        kernel = _ENV_KERNEL[env]
    elif env == "cutlass":
        if not cutlass:
            return None, "Cutlass is required for cutlass"
        kernel = _CUT
    else:  # "marlin" (0.15): MO only, the CT scheme has no branch for it
        kernel = None
    if kernel is None:
        return None, "No valid NVFP4 GEMM backend found. Please check your platform capability."
    return kernel, None


def _e1(req: Request) -> Outcome:
    """0.9.2 .. 0.15.1 (E1 seed switch, E2 VLLM_NVFP4_GEMM_BACKEND)."""
    steps: list[str] = []
    if req.scheme == Scheme.NVFP4A16:
        steps.append("NVFP4A16 -> CompressedTensorsW4A16Fp4 (Marlin), min cc 8.0 "
                     "(w4a16_nvfp4.py@0.9.2 L26-28)")
        return _marlin_scheme(req, steps, 80)
    switch = R.parse_emulation_switch(req.env.get(EMULATION_ENV))
    cutlass = R.cutlass_fp4_ok(req.platform, req.cc, req.cuda_ok)
    if not (cutlass or switch):
        steps.append(f"no CUTLASS FP4 and {EMULATION_ENV} off -> 'Running "
                     "CompressedTensorsW4A16Fp4' (Marlin, weight-only; compressed_tensors.py@0.9.2 "
                     "L394-403, PR #19563)")
        return _marlin_scheme(req, steps, 80)
    why = f"{EMULATION_ENV}=1" if switch else "cutlass_fp4_supported()"
    steps.append(f"{why} -> CompressedTensorsW4A4Fp4, min cc {80 if switch else 100} "
                 "(compressed_tensors.py@0.9.2 L394-403; w4a4_nvfp4.py@0.9.2 L29-33)")
    if (bad := _min_capability(req, 80 if switch else 100, steps, emulation_asked=switch)):
        return bad
    kernel, error = _w4a4_gemm_e1(req, switch, steps)
    if error is not None:
        steps.append("the scheme picks its GEMM backend in __init__ even when emulating")
        return _fail(error, steps, emulation_asked=switch)
    if switch:
        steps.append(f"apply_weights: {EMULATION_ENV} -> run_nvfp4_emulations, then out + bias "
                     "(w4a4_nvfp4.py@0.9.2 L127-136; PR #19879)")
        return _ok(_EMU, steps, req, emulation_asked=True)
    return _ok(kernel, [*steps, f"GEMM backend: {kernel}"], req)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# E3: select_nvfp4_linear_backend (0.16.0 .. 0.19.1)
# ---------------------------------------------------------------------------------------------

_E3_MEMBERS = (("VLLM_CUTLASS", "cutlass"), ("FLASHINFER_CUTLASS", "flashinfer-cutlass"),
               ("FLASHINFER_TRTLLM", "flashinfer-trtllm"), ("FLASHINFER_CUDNN", "flashinfer-cudnn"),
               ("FBGEMM", "fbgemm"), ("MARLIN", "marlin"), ("EMULATION", "emulation"))
_E3_ENUM = "[" + ", ".join(f"<NvFp4LinearBackend.{m}: '{v}'>" for m, v in _E3_MEMBERS) + "]"
_E3_DEFECT = ("weights scaled wrongly: dequantize_to_dtype divides by the decode global scale the "
              "loader stores (nvfp4_emulation_utils.py@0.16.0; fixed in 0.20.0 by PR #35733)")


def _e3(req: Request) -> Outcome:
    steps = ["select_nvfp4_linear_backend (nvfp4_utils.py@0.16.0 L39-86; PR #33201)"]
    if req.scheme == Scheme.NVFP4A16:
        steps.append("NVFP4A16 -> CompressedTensorsW4A16Fp4 (Marlin), min cc 7.5")
        return _marlin_scheme(req, steps, 75)
    if (bad := _min_capability(req, 75, steps)) is not None:
        return bad
    switch = R.parse_emulation_switch(req.env.get(EMULATION_ENV))
    env = R.gemm_backend(req.env, req.rel)
    fi = VllmPackage.FLASHINFER in req.packages
    cutlass = R.cutlass_fp4_ok(req.platform, req.cc, req.cuda_ok)
    has_cap = req.cc is not None and req.platform in (Platform.CUDA, Platform.ROCM)
    if R.parse_flag(FBGEMM_ENV, req.env.get(FBGEMM_ENV)):
        if VllmPackage.FBGEMM not in req.packages:
            return _fail("Backend fbgemm requires fbgemm.f4f4bf16 operator, Please install with: "
                         "pip install fbgemm-gpu-genai", [*steps, f"{FBGEMM_ENV}=1"])
        return _ok(_FBG, [*steps, f"{FBGEMM_ENV}=1 -> FBGEMM"], req)
    if switch:
        return _ok(_EMU, [*steps, f"{EMULATION_ENV}=1 -> EMULATION (bias added)"], req,
                   emulation_asked=True, defect=_E3_DEFECT)
    if env is None:
        if has_cap and req.cc >= 100 and fi:  # type: ignore[operator]
            return _ok(_FIC, [*steps, "cc >= 10.0 and FlashInfer -> FLASHINFER_CUTLASS"], req)
        if cutlass:
            return _ok(_CUT, [*steps, "cutlass_fp4_supported() -> VLLM_CUTLASS"], req)
        if has_cap and req.cc >= 75:  # type: ignore[operator]
            if req.platform != Platform.CUDA:
                return _fail(f"MARLIN selected (has_device_capability(75) is true on "
                             f"{req.platform.value}) but its ops are CUDA-only (nvfp4lab's "
                             "reading: the load fails)", steps)
            return _ok(_MAR, [*steps, "is_fp4_marlin_supported() (cc >= 7.5) -> MARLIN"], req)
        return _fail(f"No NVFP4 GEMM backend selected, available backends: {_E3_ENUM}", steps)
    steps.append(f"{GEMM_BACKEND_ENV}={env}")
    kernel = _ENV_KERNEL[env]
    needs = {_FIC: fi, _TRT: fi, _CUDNN: fi, _CUT: cutlass,
             _MAR: has_cap and req.cc >= 75}  # type: ignore[operator]
    if not needs[kernel]:
        what = {_CUT: "Cutlass", _MAR: "Marlin"}.get(kernel, "FlashInfer")
        member = {_CUT: "VLLM_CUTLASS"}.get(kernel, env.upper().replace("-", "_"))
        return _fail(f"{what} is required for NvFp4LinearBackend.{member}", steps)
    return _ok(kernel, steps, req)


# ---------------------------------------------------------------------------------------------
# E4 - E6: the kernel registry (0.20.0 .. 0.33.0)
# ---------------------------------------------------------------------------------------------


def _supported(kernel: str, req: Request) -> str | None:
    return R.kernel_support(_cls(kernel), req.rel, req.platform, req.cc, req.packages,
                            req.cuda_ok)


def _forced_by_env(req: Request, steps: list[str]) -> str | None:
    """E4 (and E5 with --linear-backend auto): the deprecated variables' forced kernel."""
    if R.version(req.rel) >= R.version("0.22.0") and any(
            v in req.env for v in (FBGEMM_ENV, EMULATION_ENV, GEMM_BACKEND_ENV)):
        steps.append("the variables are deprecated: FutureWarning '... will be removed in v0.23"
                     ". Use --linear-backend ...' (envs.py@0.22.0 deprecated_env)")
    if R.parse_flag(FBGEMM_ENV, req.env.get(FBGEMM_ENV)):
        steps.append(f"{FBGEMM_ENV}=1 forces Fbgemm")
        return _FBG
    if R.parse_emulation_switch(req.env.get(EMULATION_ENV)):
        steps.append(f"{EMULATION_ENV}=1 forces Emulation")
        return _EMU
    env = R.gemm_backend(req.env, req.rel)
    if env is not None:
        steps.append(f"{GEMM_BACKEND_ENV}={env} forces {_ENV_KERNEL[env]}")
        return _ENV_KERNEL[env]
    return None


def _forced(req: Request, backend: str, steps: list[str]) -> str | None:
    """The kernel forced before the registry loop, by release (init_nvfp4_linear_kernel@X)."""
    a16 = req.scheme == Scheme.NVFP4A16
    if R.parse_flag(BATCH_INVARIANT_ENV, req.env.get(BATCH_INVARIANT_ENV)):
        if R.version(req.rel) < R.version("0.22.0"):
            steps.append(f"{BATCH_INVARIANT_ENV}=1 forces Emulation (__init__.py@0.20.0)")
            return _EMU
        pick = _CUT if _supported(_CUT, req) is None else _EMU
        steps.append(f"{BATCH_INVARIANT_ENV}=1 forces {pick} (CUTLASS if supported, else "
                     "Emulation; overrides --linear-backend; __init__.py@0.22.0)")
        return pick
    if R.version(req.rel) < R.version("0.22.0"):
        return _forced_by_env(req, steps)
    if backend == LINEAR_BACKEND_AUTO and a16:
        return _forced_a16(req, steps)
    if backend == LINEAR_BACKEND_AUTO and R.version(req.rel) < R.version("0.24.0"):
        return _forced_by_env(req, steps)
    return None


def _forced_a16(req: Request, steps: list[str]) -> str | None:
    """NVFP4A16 with --linear-backend auto (0.23.0+, PR #42443; 0.30 CuTe-DSL; 0.32 Humming)."""
    v = R.version(req.rel)
    if v >= R.version("0.30.0") and req.cc in (100, 103) and _supported(_CUTE16, req) is None:
        steps.append("NVFP4A16 on sm_100/103 forces FlashInferCuteDslNvFp4W4A16 (@0.30.0)")
        return _CUTE16
    # prefers_humming(cc) with the capability given decides on any platform that reports one
    # (__init__.py@0.33.0 L1237-1248, humming/priority.py@0.33.0 L14-23; so also ROCm 9.0,
    # whose registry then has no W4A16 kernel); only the registry reordering in _candidates
    # asks the platform (prefers_humming(None) reads the device on CUDA only)
    if v >= R.version("0.32.0") and req.cc == 90:
        steps.append("NVFP4A16 on capability 9.0: nothing forced, Humming is preferred "
                     "(@0.32.0)")
        return None
    steps.append("NVFP4A16 with --linear-backend auto forces Marlin (__init__.py@0.23.0)")
    return _MAR


def _candidates(req: Request, backend: str, steps: list[str]) -> list[str] | str:
    """The registry list after the W4A16, Humming and --linear-backend filters (or an error)."""
    v = R.version(req.rel)
    if req.platform == Platform.CUDA:
        possible = list(R.by_release(REGISTRY, req.rel))  # type: ignore[call-overload]
    else:
        possible = [_EMU] if req.platform == Platform.ROCM else []
    steps.append(f"registry for {req.platform.value}: {possible or 'none'}")
    if req.scheme == Scheme.NVFP4A16 and v >= R.version("0.27.0"):
        allowed = R.by_release(_A16, req.rel)
        possible = [k for k in possible if k in allowed]  # type: ignore[operator]
    if (v >= R.version("0.32.0") and req.platform == Platform.CUDA and req.cc == 90
            and _HUM in possible and _MAR in possible):
        possible.remove(_HUM)
        possible.insert(possible.index(_MAR), _HUM)
        steps.append("sm_90: Humming moved ahead of Marlin (humming/priority.py@0.32.0)")
    if backend == LINEAR_BACKEND_AUTO:
        return possible
    mapped = R.by_release(_BACKEND_MAP, req.rel).get(backend, ())  # type: ignore[attr-defined]
    filtered = [k for k in possible if k in mapped]
    if filtered:
        return filtered
    if v < R.version("0.28.0"):
        return (f"--linear-backend={backend} was requested but no '{backend}' kernel exists for "
                "NVFP4 layers.")
    steps.append(f"--linear-backend={backend} has no kernel here: automatic selection "
                 "(warning; __init__.py@0.28.0 _resolve_backend_kernels)")
    return possible


def _registry(req: Request, backend: str) -> Outcome:
    steps = [f"init_nvfp4_linear_kernel (kernels/linear/__init__.py@{req.rel})"]
    a16 = req.scheme == Scheme.NVFP4A16
    if a16 and R.version(req.rel) < R.version("0.23.0"):
        steps.append("NVFP4A16 -> CompressedTensorsW4A16Fp4 (Marlin), min cc 7.5 (@0.22.0)")
        return _marlin_scheme(req, steps, 75)
    if (bad := _min_capability(req, 75, steps)) is not None:
        return bad
    forced = _forced(req, backend, steps)
    asked = forced == _EMU
    if forced is not None:
        if a16 and R.version(req.rel) >= R.version("0.27.0") and forced in (_CUT, _EMU, _FBG):
            return _fail(f"{_cls(forced)} does not support W4A16", steps)
        reason = _supported(forced, req)
        if reason is not None:
            return _fail(f"Forced NVFP4 kernel {_cls(forced)} is not supported: {reason}", steps,
                         emulation_asked=asked)
        return _ok(forced, steps, req, emulation_asked=asked)
    possible = _candidates(req, backend, steps)
    asked_emulation = backend == LINEAR_BACKEND_EMULATION
    if isinstance(possible, str):
        return _fail(possible, steps)
    disabled = R.disabled_kernels(req.env)
    reasons: list[str] = []
    for kernel in possible:
        if _cls(kernel) in disabled:
            reasons.append(f" {_cls(kernel)} disabled by environment variable")
            continue
        why = _supported(kernel, req)
        if why is not None:
            reasons.append(f"{_cls(kernel)}: {why}")
            continue
        if reasons:
            steps.append("skipped: " + "; ".join(r.strip() for r in reasons))
        return _ok(kernel, steps, req, emulation_asked=kernel == _EMU and asked_emulation)
    return _fail(_NO_KERNEL + "\n".join(reasons), steps, emulation_asked=asked_emulation)


def decide(req: Request) -> Outcome:
    """vLLM ``req.rel``'s outcome for one NVFP4 linear layer (see the module docstring)."""
    era = R.era_of(req.rel).key
    backend = check_linear_backend(req.linear_backend, req.rel)
    if era == "E0":
        return _e0(req)
    if era in ("E1", "E2"):
        return _e1(req)
    if era == "E3":
        return _e3(req)
    return _registry(req, backend)


def check_linear_backend(value: str | None, rel: str) -> str:
    """``--linear-backend`` normalised as ``KernelConfig`` does (``lower().replace("-", "_")``,
    vllm/config/kernel.py@0.33.0); None -> "auto". ValueError for a value release ``rel`` does
    not accept, or for any explicit value before 0.22.0 (the flag came with PR #39538)."""
    if value is None:
        return LINEAR_BACKEND_AUTO
    name = value.lower().replace("-", "_")
    accepted = linear_backends(rel)
    if not accepted:
        if name == LINEAR_BACKEND_AUTO:
            return name
        raise ValueError(
            f"linear_backend={value!r}: vLLM {rel} has no --linear-backend (added in 0.22.0 by "
            "PR #39538); pass linear_backend=None, or vllm='0.22.0' or later"
        )
    if name not in accepted:
        raise ValueError(
            f"unknown --linear-backend {value!r} for vLLM {rel}; accepted values: "
            + ", ".join(repr(a) for a in accepted)
        )
    return name


def _first_without(last: str) -> str:
    later = [r for r in R.MODELLED_RELEASES if R.version(r) > R.version(last)]
    return later[0] if later else "a later release"


def ignored_variables(req: Request) -> tuple[str, ...]:
    """One sentence for each modelled vLLM variable set in ``req.env`` that release ``req.rel``
    does not read for this layer (so it leaves the choice unchanged), with what to use instead."""
    backend = check_linear_backend(req.linear_backend, req.rel)
    v = R.version(req.rel)
    notes = []
    for name, var in R.VARIABLES.items():
        if name not in req.env:
            continue
        instead = f"; use {var.replacement} instead" if var.replacement else ""
        if v < R.version(var.first):
            notes.append(f"{name} is ignored: vLLM reads it only from {var.first}")
        elif not var.read_by(req.rel):
            notes.append(f"{name} is ignored: vLLM has not read it since "
                         f"{_first_without(var.last)}{instead}")  # type: ignore[arg-type]
        elif req.scheme == Scheme.NVFP4A16 and var.replacement and (
                v < R.version("0.23.0") or backend == LINEAR_BACKEND_AUTO):
            notes.append(f"{name} is ignored for an NVFP4A16 checkpoint (the weight-only path "
                         "never reads it)")
        elif req.scheme == Scheme.NVFP4A16 and v < R.version("0.23.0"):
            notes.append(f"{name} is ignored for an NVFP4A16 checkpoint before 0.23.0 (the "
                         "weight-only scheme calls Marlin directly)")
        elif var.replacement and v >= R.version("0.22.0") and backend != LINEAR_BACKEND_AUTO:
            notes.append(f"{name} is ignored: with --linear-backend={backend} vLLM {req.rel} "
                         f"reads it only under --linear-backend auto (deprecated{instead})")
    return tuple(notes)
