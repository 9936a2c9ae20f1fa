"""vLLM's NVFP4 linear-kernel rules as data: releases, eras, kernels, their support conditions.

Everything here was read in the released vLLM wheels (``vllm/*.py`` of every PyPI release from
0.9.1 to 0.33.0); a citation ``path@X`` names a file of release X, relative to
``vllm/model_executor`` unless it starts with ``vllm/``. PR numbers come from the PR threads and
are matched to the first wheel that shows their code. The rules model a **compressed-tensors**
checkpoint (ModelOpt differs before 0.16: the emulation switch never reached it). The selection
itself, era by era, is :mod:`nvfp4lab.execution.vllm_select`; this module holds the facts it
uses and imports nothing from torch.

What is NOT known from the wheels (said again where it matters):

* ``cutlass_scaled_mm_supports_fp4`` is C++ (not in the wheel). Two public versions exist:
  ``cap >= 100 && CUDA runtime >= 12.8`` and ``100 <= cap < 130``; which ships in which release
  is unverified. Every catalogued GPU gives the same answer under both; nvfp4lab uses the first.
* The PR that stopped reading the three deprecated variables (first release without them:
  0.24.0) was not identified; the 0.28 fallback-instead-of-raise and the 0.32 Humming priority
  are known from the code only.
* Non-CUDA platforms before the 0.20 registry: vLLM did not target NVFP4 there; the model says
  what the code paths imply (the Marlin fallback is a CUDA kernel), not what was run.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from nvfp4lab.settings import (
    BATCH_INVARIANT_ENV,
    DISABLED_KERNELS_ENV,
    EMULATION_ENV,
    FBGEMM_ENV,
    GEMM_BACKEND_ENV,
)
from nvfp4lab.vocab import Numerics, Platform, Scheme, VllmAlias, VllmPackage, check_choice

__all__ = [
    "ERAS",
    "FIRST_MODELLED",
    "HADACORE_FIRST",
    "KERNELS",
    "LATEST_MODELLED",
    "MODELLED_RELEASES",
    "QUTLASS_BLOCKS",
    "QUTLASS_GEMM_BACKENDS",
    "QUTLASS_UNROUNDED_SCALE_BLOCKS",
    "SEED_RELEASE",
    "TRANSFORM_ERAS",
    "TRANSFORM_VERIFIED",
    "VARIABLES",
    "Era",
    "Kernel",
    "TransformEra",
    "Variable",
    "default_packages",
    "era_of",
    "humming_numerics",
    "kernel_support",
    "parse_emulation_switch",
    "parse_flag",
    "release",
    "transform_era_of",
    "version",
]

Version = tuple[int, ...]

FIRST_MODELLED = "0.9.1"
LATEST_MODELLED = "0.33.0"
#: PR #19879 (the seed's rules: VLLM_USE_NVFP4_CT_EMULATIONS) first shipped in 0.9.2.
SEED_RELEASE = "0.9.2"

#: Every PyPI release in the modelled range (the wheels the rules were read from).
MODELLED_RELEASES: tuple[str, ...] = (
    "0.9.1", "0.9.2", "0.10.0", "0.10.1", "0.10.1.1", "0.10.2", "0.11.0", "0.11.1", "0.11.2",
    "0.12.0", "0.13.0", "0.14.0", "0.14.1", "0.15.0", "0.15.1", "0.16.0", "0.17.0", "0.17.1",
    "0.18.0", "0.18.1", "0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0",
    "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0",
    "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
)  # fmt: skip

_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.(\d+))?$")


def version(text: str) -> Version:
    """``"0.10.1.1"`` -> ``(0, 10, 1, 1)``; a missing patch counts as 0 (``"0.33"`` = 0.33.0)."""
    m = _VERSION.match(text.strip())
    if not m:
        raise ValueError(
            f"vllm={text!r} is not a release number; pass one such as '0.33.0', or "
            f"{VllmAlias.SEED.value!r} / {VllmAlias.LATEST.value!r}"
        )
    parts = [int(p) for p in m.groups() if p is not None]
    return tuple(parts + [0] * (3 - len(parts)))


def release(vllm: str | None) -> str:
    """The release whose rules apply: None/"latest" -> 0.33.0, "seed" -> 0.9.2, else ``vllm``
    normalised (``"v0.20"`` -> ``"0.20.0"``). Raises ValueError outside 0.9.1..0.33.0."""
    if vllm is None or vllm == VllmAlias.LATEST:
        return LATEST_MODELLED
    if vllm == VllmAlias.SEED:
        return SEED_RELEASE
    if not isinstance(vllm, str):
        raise ValueError(f"vllm must be a release string such as '0.33.0', got {vllm!r}")
    v = version(vllm)
    if not version(FIRST_MODELLED) <= v <= version(LATEST_MODELLED):
        raise ValueError(
            f"vllm={vllm!r} is outside the modelled releases {FIRST_MODELLED}..{LATEST_MODELLED}; "
            "pass a release in that range, 'seed' or 'latest'"
        )
    return ".".join(str(p) for p in v)


def _at_least(rel: str, first: str) -> bool:
    return version(rel) >= version(first)


# ---------------------------------------------------------------------------------------------
# Eras
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Era:
    """A range of releases that choose the kernel the same way. ``first``/``last``: releases."""

    key: str
    first: str
    last: str
    title: str
    rule: str
    source: str

    def contains(self, rel: str) -> bool:
        return version(self.first) <= version(rel) <= version(self.last)


ERAS: tuple[Era, ...] = (
    Era("E0", "0.9.1", "0.9.1", "bias-dropping fallback",
        "CUTLASS on cc >= 10.0, else automatic W4A4 emulation that DROPS the bias",
        "compressed_tensors_w4a4_nvfp4.py@0.9.1 L46-72, L160-178; PR #18312"),
    Era("E1", "0.9.2", "0.11.0", "seed switch",
        f"{EMULATION_ENV}=1 -> emulation, else CUTLASS on cc >= 10.0, else Marlin (W4A16)",
        "compressed_tensors.py@0.9.2 L394-403; envs.py@0.9.2 L955; PRs #19563, #19879"),
    Era("E2", "0.11.1", "0.15.1", f"{GEMM_BACKEND_ENV} per scheme",
        f"as E1; the W4A4 GEMM is chosen by {GEMM_BACKEND_ENV} (default flashinfer-cutlass)",
        "compressed_tensors_w4a4_nvfp4.py@0.11.1 __init__; envs.py@0.11.1; PR #26107"),
    Era("E3", "0.16.0", "0.19.1", "central selector",
        "select_nvfp4_linear_backend: FBGEMM, switch, FlashInfer, CUTLASS, Marlin (cc >= 7.5); "
        "its emulation divides by the decode global scale (wrong weights)",
        "layers/quantization/utils/nvfp4_utils.py@0.16.0; PR #33201"),
    Era("E4", "0.20.0", "0.21.0", "kernel registry",
        "forced by variables (batch-invariant, FBGEMM, switch, GEMM backend), else the first "
        "supported kernel of the platform's list (ROCm: emulation)",
        "kernels/linear/__init__.py@0.20.0 init_nvfp4_linear_kernel; PRs #39129, #35733"),
    Era("E5", "0.22.0", "0.23.0", "--linear-backend",
        "--linear-backend filters the registry; the three variables are deprecated and read only "
        "with --linear-backend auto",
        "kernels/linear/__init__.py@0.22.0; envs.py@0.22.0 L1639-1696; PRs #39538, #42443"),
    Era("E6", "0.24.0", "0.33.0", "flag-only registry",
        f"{EMULATION_ENV}, {GEMM_BACKEND_ENV} and {FBGEMM_ENV} are no longer read; "
        "--linear-backend and the registry decide",
        "kernels/linear/__init__.py@0.24.0..0.33.0; envs.py@0.24.0 (variables gone)"),
)  # fmt: skip


def era_of(rel: str) -> Era:
    """The era whose range holds release ``rel`` (a normalised release string)."""
    for era in ERAS:
        if era.contains(rel):
            return era
    raise ValueError(f"no era holds vLLM {rel}; modelled: {FIRST_MODELLED}..{LATEST_MODELLED}")


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernel:
    """A vLLM NVFP4 linear kernel (the registry's class name; earlier releases ran the same
    kernel from the scheme). ``numerics``: what it computes; ``bias``: where the bias enters;
    ``package``: the optional package it needs; ``source``: where that was read."""

    name: str
    numerics: Numerics
    bias: str
    package: VllmPackage | None
    source: str


_AFTER = "added after the GEMM, in the output dtype (out = out + bias)"
_MARLIN_BIAS = "passed to the Marlin GEMM (0.9.x: output.add_(bias) after it; later b_bias)"
_FI = VllmPackage.FLASHINFER

KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel("FlashInferCuteDslNvFp4LinearKernel", Numerics.NATIVE, _AFTER, _FI,
               "kernels/linear/nvfp4/flashinfer.py@0.24.0; PR #42235"),
        Kernel("FlashInferCutlassNvFp4LinearKernel", Numerics.NATIVE, _AFTER, _FI,
               "flashinfer.py@0.20.0 (as a CT backend since 0.10.1)"),
        Kernel("FlashInferB12xNvFp4LinearKernel", Numerics.NATIVE, _AFTER, _FI,
               "flashinfer.py@0.22.0 (auto only from 0.28.0)"),
        Kernel("CutlassNvFp4LinearKernel", Numerics.NATIVE, _AFTER, None,
               "kernels/linear/nvfp4/cutlass.py@0.20.0 (cutlass_scaled_fp4_mm since 0.9.1)"),
        Kernel("FlashInferCuteDslNvFp4W4A16LinearKernel", Numerics.W4A16, _AFTER, _FI,
               "flashinfer.py@0.30.0 (BF16 x FP4 GEMM)"),
        Kernel("MarlinNvFp4LinearKernel", Numerics.W4A16, _MARLIN_BIAS, None,
               "marlin_utils_fp4.py apply_fp4_marlin_linear; kernels/linear/nvfp4/marlin.py"),
        Kernel("FlashInferTrtllmNvFp4LinearKernel", Numerics.NATIVE, _AFTER, _FI,
               "flashinfer.py@0.20.0 (CT backend flashinfer-trtllm since 0.10.1)"),
        Kernel("FlashInferCudnnNvFp4LinearKernel", Numerics.NATIVE, _AFTER, _FI,
               "flashinfer.py@0.20.0 (CT backend flashinfer-cudnn since 0.11.1)"),
        Kernel("FbgemmNvFp4LinearKernel", Numerics.NATIVE, _AFTER, VllmPackage.FBGEMM,
               "kernels/linear/nvfp4/fbgemm.py@0.20.0 (f4f4bf16 since 0.11.0)"),
        Kernel("B12xNvFp4LinearKernel", Numerics.NATIVE, _AFTER, VllmPackage.B12X,
               "kernels/linear/nvfp4/b12x.py@0.28.0"),
        Kernel("B12xNvFp4W4A16LinearKernel", Numerics.W4A16, _AFTER, VllmPackage.B12X,
               "b12x.py@0.32.0"),
        Kernel("TorchNvFp4LinearKernel", Numerics.NATIVE, _AFTER, None,
               "kernels/linear/nvfp4/pytorch.py@0.30.0 (torch._scaled_mm); PR #53319"),
        Kernel("EmulationNvFp4LinearKernel", Numerics.EMULATION, _AFTER, None,
               "kernels/linear/nvfp4/emulation.py@0.20.0..0.33.0 L33-49"),
        Kernel("HummingNvFp4LinearKernel", Numerics.W4A8, "passed to humming_forward (epilogue)",
               VllmPackage.HUMMING,
               "kernels/linear/nvfp4/humming.py@0.25.0; see humming_numerics()"),
    )
}  # fmt: skip


def humming_numerics(cc: int | None, scheme: Scheme) -> Numerics:
    """What Humming computes for an NVFP4 layer on compute capability ``cc`` (major*10+minor).

    vLLM hands Humming the NVFP4 activation schema (``kNvfp4Dynamic``,
    ``kernels/linear/nvfp4/humming.py@0.33.0``) and lets ``check_and_fallback_input_schema``
    (``layers/quantization/utils/humming/schema.py@0.33.0`` L261-363) fall back when the
    installed humming-kernels (0.1.19 for vLLM 0.33.0, ``humming/schema/humming.py``
    ``is_humming_schema_compatible``) rejects it. FP4 activations need sm_100+, and vLLM marks
    FP4/FP8 activations "deprecated" (slow) on 10.0 <= cc < 12.0, so: cc >= 12.0 keeps FP4
    activations (W4A4, native class); 8.9 <= cc < 10.0 falls back to per-token FP8 E4M3
    activations (W4A8); elsewhere to 16-bit activations (W4A16). An NVFP4A16 checkpoint is W4A16
    everywhere. Read from the sources, not run on hardware.
    """
    if scheme == Scheme.NVFP4A16 or cc is None:
        return Numerics.W4A16
    if cc >= 120:
        return Numerics.NATIVE
    if 89 <= cc < 100:
        return Numerics.W4A8
    return Numerics.W4A16


def default_packages(rel: str, platform: Platform) -> frozenset[VllmPackage]:
    """Optional packages a plain ``pip install vllm==rel`` brings on ``platform``.

    flashinfer-python is a hard dependency from 0.11.1 (an extra before; METADATA), humming-
    kernels from 0.22.0; b12x (``vllm[b12x]``) and fbgemm-gpu-genai never. From 0.28 the wheel no
    longer pulls flashinfer-cubin, so vLLM's ``has_flashinfer()`` also needs nvcc and ninja
    (``vllm/utils/flashinfer.py@0.33.0`` L88-106): "present" assumes either. Off CUDA: none.
    """
    if platform != Platform.CUDA:
        return frozenset()
    found = set()
    if _at_least(rel, "0.11.1"):
        found.add(VllmPackage.FLASHINFER)
    if _at_least(rel, "0.22.0"):
        found.add(VllmPackage.HUMMING)
    return frozenset(found)


def cutlass_fp4_ok(platform: Platform, cc: int | None, cuda_ok: bool) -> bool:
    """``cutlass_fp4_supported()``: CUDA, cc >= 10.0 and a CUDA >= 12.8 runtime (C++ rule)."""
    return platform == Platform.CUDA and cc is not None and cc >= 100 and cuda_ok


def kernel_support(
    name: str,
    rel: str,
    platform: Platform,
    cc: int | None,
    packages: frozenset[VllmPackage],
    cuda_ok: bool = True,
) -> str | None:
    """None when kernel ``name``'s ``is_supported()`` passes in release ``rel``, else vLLM's
    reason text. Conditions: ``kernels/linear/nvfp4/*.py@0.20.0..0.33.0`` (each kernel's
    ``is_supported``), checked against vLLM 0.33.0's own selection by
    ``tests/peers/test_vllm_selection.py``."""
    cuda = platform == Platform.CUDA
    fi = VllmPackage.FLASHINFER in packages
    family = None if cc is None or platform in (Platform.CPU, Platform.XPU) else cc // 10
    cutlass = cutlass_fp4_ok(platform, cc, cuda_ok)
    at_least = cc is not None and platform in (Platform.CUDA, Platform.ROCM)
    checks: dict[str, tuple[bool, str]] = {
        "CutlassNvFp4LinearKernel": (cutlass, "CUTLASS FP4 kernels not available"),
        "FlashInferCutlassNvFp4LinearKernel": (
            cutlass and fi, "FlashInfer + >=sm_100 required"),
        "FlashInferTrtllmNvFp4LinearKernel": (fi, "FlashInfer required"),
        "FlashInferCudnnNvFp4LinearKernel": (fi, "FlashInfer required"),
        "FbgemmNvFp4LinearKernel": (VllmPackage.FBGEMM in packages, "fbgemm_gpu required"),
        "MarlinNvFp4LinearKernel": (cuda and at_least and cc >= 75, "Marlin FP4 not available"),
        "EmulationNvFp4LinearKernel": (True, ""),
        "FlashInferB12xNvFp4LinearKernel": (
            at_least and cc >= 120 and fi,
            "FlashInfer b12x requires SM120+ and FlashInfer with Sm120BlockScaledDenseGemmKernel"),
        "TorchNvFp4LinearKernel": (family == 10, "Torch NVFP4 requires sm_10x (Blackwell)"),
    }  # fmt: skip
    if name == "FlashInferCuteDslNvFp4W4A16LinearKernel":
        # flashinfer.py@0.30.0..0.33.0 (L39-56 @0.33.0): the capability first, then FlashInfer's
        # BF16 x FP4 GEMM, each with its own reason
        if not cuda:
            return "FlashInfer CuTe-DSL W4A16 requires CUDA"
        if cc is None:
            return "CUDA compute capability is unavailable"
        if cc not in (100, 103) and not 120 <= cc < 130:
            return "FlashInfer CuTe-DSL W4A16 requires sm_100 or sm_12x"
        return None if fi else "FlashInfer CuTe-DSL BF16 x FP4 GEMM is unavailable"
    if name == "FlashInferCuteDslNvFp4LinearKernel":
        if family != 10:
            return "FlashInfer cutedsl requires sm_10x"
        return None if fi else "FlashInfer required"
    if name in ("B12xNvFp4LinearKernel", "B12xNvFp4W4A16LinearKernel"):
        if not cuda:
            return "B12X NVFP4 kernels are only available on CUDA"
        if family != 12:
            return "B12X NVFP4 kernels require a Blackwell 12x device"
        b12x = VllmPackage.B12X in packages
        return None if b12x else "Install the B12X backend with `pip install vllm[b12x]`"
    if name == "HummingNvFp4LinearKernel":
        if not cuda:
            return "Humming only supported on CUDA"
        if _at_least(rel, "0.28.0") and VllmPackage.HUMMING not in packages:
            return "Humming is not installed"
        return None if at_least and cc >= 75 else "Humming only supported on SM75+"
    ok, reason = checks[name]
    return None if ok else reason


# ---------------------------------------------------------------------------------------------
# Variables
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variable:
    """When vLLM's NVFP4 selection reads an environment variable, and what replaced it."""

    name: str
    first: str
    last: str | None
    replacement: str
    source: str

    def read_by(self, rel: str) -> bool:
        v = version(rel)
        return version(self.first) <= v and (self.last is None or v <= version(self.last))


VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable(EMULATION_ENV, "0.9.2", "0.23.0", "--linear-backend emulation",
                 "envs.py@0.9.2 L955-956; deprecated envs.py@0.22.0 L1639-1644"),
        Variable(GEMM_BACKEND_ENV, "0.11.1", "0.23.0", "--linear-backend <backend>",
                 "envs.py@0.11.1 L1348-1357; deprecated envs.py@0.22.0 L1679-1696"),
        Variable(FBGEMM_ENV, "0.11.0", "0.23.0", "--linear-backend fbgemm",
                 "compressed_tensors_w4a4_nvfp4.py@0.11.0; deprecated envs.py@0.22.0 L1850"),
        Variable(BATCH_INVARIANT_ENV, "0.20.0", None, "",
                 "kernels/linear/__init__.py@0.20.0 init_nvfp4_linear_kernel"),
        Variable(DISABLED_KERNELS_ENV, "0.20.0", None, "",
                 "kernels/linear/__init__.py@0.20.0 (registry loop)"),
    )
}  # fmt: skip

#: Accepted values of VLLM_NVFP4_GEMM_BACKEND (env_with_choices, case-sensitive), by release.
GEMM_BACKEND_CHOICES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("0.11.1", ("flashinfer-cudnn", "flashinfer-trtllm", "flashinfer-cutlass", "cutlass")),
    ("0.15.0", ("flashinfer-cudnn", "flashinfer-trtllm", "flashinfer-cutlass", "cutlass",
                "marlin")),
    ("0.20.0", ("flashinfer-cudnn", "flashinfer-trtllm", "flashinfer-cutlass", "cutlass",
                "marlin", "emulation")),
    ("0.22.0", ("flashinfer-b12x", "flashinfer-cudnn", "flashinfer-trtllm", "flashinfer-cutlass",
                "cutlass", "marlin", "emulation")),
)  # fmt: skip


def by_release(table: tuple[tuple[str, object], ...], rel: str) -> object:
    """The value of the last row of ``table`` (first release, value) that ``rel`` reaches."""
    found: object = None
    for first, value in table:
        if _at_least(rel, first):
            found = value
    return found


def parse_emulation_switch(value: str | None) -> bool:
    """Parse ``VLLM_USE_NVFP4_CT_EMULATIONS`` like vLLM: ``bool(int(value))``, unset -> off.

    vLLM crashes on values such as "true"; nvfp4lab raises a ValueError that names the
    variable, the value and the accepted values.
    """
    if value is None:
        return False
    try:
        return bool(int(value))
    except (TypeError, ValueError):
        raise ValueError(
            f"{EMULATION_ENV}={value!r} is not an integer. vLLM parses it as bool(int(value)) "
            "(and would crash on this value); accepted values: an integer, 0 = off (the default "
            "when unset), any nonzero integer such as 1 = on. Example: "
            f"export {EMULATION_ENV}=1"
        ) from None


def parse_flag(name: str, value: str | None) -> bool:
    """``VLLM_USE_FBGEMM`` / ``VLLM_BATCH_INVARIANT``: ``bool(int(value))`` as vLLM; unset = off."""
    if value is None:
        return False
    try:
        return bool(int(value))
    except (TypeError, ValueError):
        raise ValueError(
            f"{name}={value!r} is not an integer (vLLM parses it as bool(int(value))); "
            f"accepted values: 0 (off, the default) or a nonzero integer such as 1"
        ) from None


def gemm_backend(env: Mapping[str, str], rel: str) -> str | None:
    """``VLLM_NVFP4_GEMM_BACKEND`` validated against release ``rel``'s choices (case-sensitive,
    ``envs.py env_with_choices``: the same ValueError text as vLLM's)."""
    value = env.get(GEMM_BACKEND_ENV)
    if value is None:
        return None
    choices = list(by_release(GEMM_BACKEND_CHOICES, rel))  # type: ignore[call-overload]
    if value not in choices:
        raise ValueError(
            f"Invalid value '{value}' for {GEMM_BACKEND_ENV}. Valid options: {choices}."
        )
    return value


def disabled_kernels(env: Mapping[str, str]) -> tuple[str, ...]:
    """``VLLM_DISABLED_KERNELS`` split on "," exactly as vLLM does (no stripping)."""
    value = env.get(DISABLED_KERNELS_ENV)
    return () if value is None else tuple(value.split(","))


def check_packages(packages: object) -> frozenset[VllmPackage]:
    """An iterable of package names as a frozenset of :class:`VllmPackage`."""
    if isinstance(packages, str):
        packages = [packages]
    return frozenset(
        VllmPackage(check_choice("package", p, VllmPackage)) for p in packages  # type: ignore[attr-defined]
    )


# ---------------------------------------------------------------------------------------------
# Online transforms (compressed-tensors ``transform_config``): the rotated NVFP4 path
# ---------------------------------------------------------------------------------------------

_CT_TF = "layers/quantization/compressed_tensors/transform/"


@dataclass(frozen=True)
class TransformEra:
    """Releases that treat an online ``input`` transform of an NVFP4 W4A4 layer the same way.
    ``verified``: the rule was read in that era's wheel (else inferred from PR merge dates)."""

    key: str
    first: str
    last: str
    title: str
    rule: str
    source: str
    verified: bool

    def contains(self, rel: str) -> bool:
        return version(self.first) <= version(rel) <= version(self.last)


TRANSFORM_ERAS: tuple[TransformEra, ...] = (
    TransformEra("T0", "0.9.1", "0.10.1.1", "no transforms",
                 "transform_config is not read: the stored rotated weights W·Q meet unrotated "
                 "activations (wrong outputs, no error)",
                 "PR #22486 (opened 2025-08-08) added transforms; first release inferred from "
                 "its merge date", False),
    TransformEra("T1", "0.10.2", "0.26.0", "generic transforms, QuTLASS stub",
                 "HadamardTransform rotates x (hadacore for type 'hadamard' from 0.11.0, PR "
                 "#24106; else a dense GEMM in the model dtype), then the release's NVFP4 kernel "
                 "with the static input_global_scale; a single-partition layer with head_dim 16 "
                 "takes the QuTLASS stub, whose apply is not implemented (the first forward fails)",
                 _CT_TF + "linear.py, module.py, schemes/linear_qutlass_nvfp4.py (stub); PRs "
                 "#22486, #24106", False),
    TransformEra("T2", "0.27.0", "0.33.0", "QuTLASS NVFP4 path",
                 "cc >= 10.0 and every partition's head_dim in 16/32/64/128: fusedQuantizeNv "
                 "(rotate + quantize, block scales = amax, global scale 6.0) then "
                 "flashinfer_scaled_fp4_mm with alpha = (1/weight_global_scale)/6; else T1's "
                 "generic path (hadacore / dense GEMM + the NVFP4 kernel)",
                 _CT_TF + "linear.py@0.33.0 L51-57, schemes/linear_qutlass_nvfp4.py@0.33.0 "
                 "L210-334; PR #43229 (merged in the week ending 2026-07-31; 0.27.0 is the first "
                 "release after it, read from the wheel only for 0.33.0)", False),
)  # fmt: skip

#: Releases whose transform rules were read in the wheel itself.
TRANSFORM_VERIFIED: tuple[str, ...] = ("0.33.0",)
#: The first release running vLLM's ``hadacore_transform`` for type "hadamard" (PR #24106).
HADACORE_FIRST = "0.11.0"
#: Block sizes (``TransformScheme.head_dim``) QuTLASS's fusedQuantizeNv implements for NVFP4
#: (linear_qutlass_nvfp4.py@0.33.0 L210-223; qutlass bindings.cpp fusedQuantizeNvAbsMax).
QUTLASS_BLOCKS: tuple[int, ...] = (16, 32, 64, 128)
#: The registry kernels the QuTLASS path can hand its GEMM to, with the FlashInfer backend name
#: it passes (``_get_flashinfer_gemm_backend``, linear_qutlass_nvfp4.py@0.33.0 L254-270: the
#: ``flashinfer_*`` keys of ``_LINEAR_BACKEND_KERNEL_MAP``, "cutedsl" spelled "cute-dsl"); any
#: other kernel fails at load with "QutlassNvFP4 transform requires a FlashInfer kernel".
QUTLASS_GEMM_BACKENDS: dict[str, str] = {
    "FlashInferCutlassNvFp4LinearKernel": "cutlass",
    "FlashInferCuteDslNvFp4LinearKernel": "cute-dsl",
    "FlashInferCuteDslNvFp4W4A16LinearKernel": "cute-dsl",  # same map key (from 0.30.0)
    "FlashInferTrtllmNvFp4LinearKernel": "trtllm",
    "FlashInferCudnnNvFp4LinearKernel": "cudnn",
    "FlashInferB12xNvFp4LinearKernel": "b12x",
}
#: QuTLASS's fusedQuantizeNvAbsMax for head_dim 128 runs its SM100 kernel when vLLM builds it
#: with TARGET_CUDA_ARCH=100 (cmake: any 10.x arch in the build; the 0.33.0 wheel's
#: _qutlass_C names ``-arch sm_100f``), whose epilogue scales the elements by the UNROUNDED
#: block scale (sm100_visitor_store_tma_warpspecialized.hpp L127-150, L570); the other sizes run
#: the SM80-style epilogue, which rounds the scale to E4M3 first (epilogue_quant.h L1674-1678).
QUTLASS_UNROUNDED_SCALE_BLOCKS: tuple[int, ...] = (128,)


def transform_era_of(rel: str) -> TransformEra:
    """The :data:`TRANSFORM_ERAS` entry holding release ``rel`` (normalised)."""
    for era in TRANSFORM_ERAS:
        if era.contains(rel):
            return era
    raise ValueError(f"no transform era holds vLLM {rel}")
