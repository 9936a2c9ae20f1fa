"""nvfp4lab.execution.vllm_select, called directly (``decide`` on a ``Request``).

The registry eras (E4-E6) are checked against the facts of vllm_rules: the chosen kernel is the
first entry of the release's priority list whose ``kernel_support`` passes, its numerics are the
KERNELS table's. The earlier eras and the ``--linear-backend`` / ignored-variable helpers are
checked on documented cases that tests/execution/test_vllm_rules.py (which goes through
``select_backend``) does not cover.
"""

from __future__ import annotations

import pytest

from nvfp4lab.execution import vllm_rules as R
from nvfp4lab.execution import vllm_select as S
from nvfp4lab.settings import (
    BATCH_INVARIANT_ENV,
    DISABLED_KERNELS_ENV,
    EMULATION_ENV,
    FBGEMM_ENV,
    GEMM_BACKEND_ENV,
)
from nvfp4lab.vocab import BiasMode, Numerics, Platform, Scheme, VllmPackage

CUDA = Platform.CUDA


def request(rel: str, cc: int | None = 100, *, env: dict[str, str] | None = None,
            scheme: Scheme = Scheme.NVFP4, platform: Platform = CUDA,
            backend: str | None = None, packages: frozenset | None = None) -> S.Request:
    if packages is None:
        packages = R.default_packages(rel, platform)
    return S.Request(rel, platform, cc, scheme, env or {}, backend, packages)


def first_supported(rel: str, cc: int, packages: frozenset) -> str:
    """The registry rule from the facts: the first kernel of the list that is supported."""
    listed = R.by_release(S.REGISTRY, rel)
    for short in listed:  # type: ignore[attr-defined]
        name = S._cls(short)
        if R.kernel_support(name, rel, CUDA, cc, packages) is None:
            return name
    raise AssertionError("Emulation is always supported")


REGISTRY_RELEASES = [r for r in R.MODELLED_RELEASES if R.era_of(r).key in ("E4", "E5", "E6")]


@pytest.mark.parametrize("rel", REGISTRY_RELEASES)
def test_registry_eras_pick_the_first_supported_kernel(rel: str) -> None:
    everything = frozenset(VllmPackage)
    for cc in (75, 80, 89, 100, 103, 110, 120):
        for packages in (R.default_packages(rel, CUDA), frozenset(), everything):
            out = S.decide(request(rel, cc, packages=packages))
            want = first_supported(rel, cc, packages)
            assert out.kernel == want, (rel, cc, sorted(packages), out.steps)
            info = R.KERNELS[want]
            numerics = (R.humming_numerics(cc, Scheme.NVFP4) if want.startswith("Humming")
                        else info.numerics)
            assert out.numerics == numerics and out.bias == BiasMode.OUTPUT
            assert out.error is None and out.defect is None and not out.emulation_asked
            assert out.steps[0] == f"init_nvfp4_linear_kernel (kernels/linear/__init__.py@{rel})"


def test_disabled_kernels_fall_through_the_list_with_reasons() -> None:
    rel = "0.28.0"
    listed = [S._cls(k) for k in R.by_release(S.REGISTRY, rel)]  # type: ignore[attr-defined]
    packages = R.default_packages(rel, CUDA)
    first = first_supported(rel, 100, packages)
    out = S.decide(request(rel, 100, env={DISABLED_KERNELS_ENV: first}))
    rest = listed[listed.index(first) + 1 :]
    assert out.kernel == next(
        k for k in rest if R.kernel_support(k, rel, CUDA, 100, packages) is None)
    assert f"{first} disabled by environment variable" in out.steps[-1]
    # every kernel disabled: vLLM's error lists each, in registry order
    none = S.decide(request(rel, 100, env={DISABLED_KERNELS_ENV: ",".join(listed)}))
    assert none.kernel is None
    assert none.error == S._NO_KERNEL + "\n".join(
        f" {k} disabled by environment variable" for k in listed)


@pytest.mark.parametrize(
    ("rel", "first_step"),
    [("0.9.1", "0.9.1 reads no NVFP4 variable"),
     ("0.9.2", "cutlass_fp4_supported() -> CompressedTensorsW4A4Fp4, min cc 100"),
     ("0.15.1", "cutlass_fp4_supported() -> CompressedTensorsW4A4Fp4, min cc 100"),
     ("0.16.0", "select_nvfp4_linear_backend (nvfp4_utils.py@0.16.0 L39-86; PR #33201)"),
     ("0.19.1", "select_nvfp4_linear_backend (nvfp4_utils.py@0.16.0 L39-86; PR #33201)"),
     ("0.20.0", "init_nvfp4_linear_kernel (kernels/linear/__init__.py@0.20.0)")],
)
def test_decide_follows_the_era_of_the_release(rel: str, first_step: str) -> None:
    out = S.decide(request(rel, 100))
    assert out.steps[0].startswith(first_step)
    assert out.kernel in R.KERNELS and out.numerics == Numerics.NATIVE


def test_e0_drops_the_bias() -> None:
    out = S.decide(request("0.9.1", 90))
    assert out.kernel == "EmulationNvFp4LinearKernel" and out.numerics == Numerics.EMULATION
    assert out.bias == BiasMode.DROPPED and out.defect == "bias dropped"
    assert "PR #18312" in out.steps[-1]
    # the same GPU without the CUDA 12.8 runtime: no CUTLASS FP4, emulation again
    b200 = S.Request("0.9.1", CUDA, 100, Scheme.NVFP4, {}, None, frozenset(), cuda_ok=False)
    assert S.decide(b200).kernel == "EmulationNvFp4LinearKernel"


def test_e1_e2_fbgemm_cases() -> None:
    # 0.11.0 reads VLLM_USE_FBGEMM: without the package the scheme fails at load
    fb = {FBGEMM_ENV: "1"}
    out = S.decide(request("0.11.0", 100, env=fb))
    assert out.kernel is None and out.error.startswith("Backend fbgemm requires")  # type: ignore[union-attr]
    with_pkg = S.decide(request("0.11.0", 100, env=fb, packages=frozenset({VllmPackage.FBGEMM})))
    assert with_pkg.kernel == "FbgemmNvFp4LinearKernel"
    # 0.11.1 quirk: VLLM_USE_FBGEMM is read only when VLLM_NVFP4_GEMM_BACKEND is set
    assert S.decide(request("0.11.1", 100, env=fb)).kernel == "FlashInferCutlassNvFp4LinearKernel"
    both = {**fb, GEMM_BACKEND_ENV: "cutlass"}
    quirk = S.decide(request("0.11.1", 100, env=both,
                             packages=frozenset({VllmPackage.FLASHINFER, VllmPackage.FBGEMM})))
    assert quirk.kernel == "FbgemmNvFp4LinearKernel"
    assert any("0.11.1 quirk" in s for s in quirk.steps)
    missing = S.decide(request("0.11.1", 100, env=both))
    assert missing.error == ("No valid NVFP4 GEMM backend found. Please check your platform "
                             "capability.")


def test_e1_emulation_switch_still_needs_a_gemm_backend() -> None:
    env = {EMULATION_ENV: "1", GEMM_BACKEND_ENV: "flashinfer-cutlass"}
    out = S.decide(request("0.12.0", 90, env=env, packages=frozenset()))
    assert out.kernel is None and out.error == "FlashInfer is required for flashinfer-cutlass"
    assert out.emulation_asked
    assert out.steps[-1] == "the scheme picks its GEMM backend in __init__ even when emulating"


def test_e3_marlin_off_cuda_and_the_emulation_defect() -> None:
    rocm = S.decide(request("0.17.0", 94, platform=Platform.ROCM))
    assert rocm.kernel is None and rocm.error.startswith("MARLIN selected")  # type: ignore[union-attr]
    emu = S.decide(request("0.17.0", 90, env={EMULATION_ENV: "1"}))
    assert emu.kernel == "EmulationNvFp4LinearKernel" and emu.emulation_asked
    assert emu.defect == S._E3_DEFECT and "PR #35733" in emu.defect
    none = S.decide(request("0.18.0", None, platform=Platform.CPU))
    assert none.error.startswith("No NVFP4 GEMM backend selected, available backends: "  # type: ignore[union-attr]
                                 "[<NvFp4LinearBackend.VLLM_CUTLASS: 'cutlass'>")


def test_batch_invariant_before_and_after_0_22() -> None:
    bi = {BATCH_INVARIANT_ENV: "1"}
    # 0.20: always Emulation; 0.22+: CUTLASS when supported, overriding --linear-backend
    assert S.decide(request("0.21.0", 120, env=bi)).kernel == "EmulationNvFp4LinearKernel"
    out = S.decide(request("0.25.0", 120, env=bi, backend="marlin"))
    assert out.kernel == "CutlassNvFp4LinearKernel"
    assert "overrides --linear-backend" in out.steps[-1]


def test_linear_backends_and_their_check() -> None:
    assert S.linear_backends("0.21.0") == ()
    assert S.linear_backends("0.22.0") == S.LINEAR_BACKENDS[0][1]
    assert S.linear_backends("0.27.1") == S.LINEAR_BACKENDS[2][1]  # 0.25.0's list
    assert "b12x" not in S.linear_backends("0.27.1") and "b12x" in S.linear_backends("0.33.0")
    assert S.check_linear_backend(None, "0.9.1") == "auto"
    assert S.check_linear_backend("auto", "0.21.0") == "auto"
    assert S.check_linear_backend("FlashInfer-Cutlass", "0.22.0") == "flashinfer_cutlass"
    with pytest.raises(ValueError, match=r"linear_backend='marlin': vLLM 0.21.0 has no "
                                         r"--linear-backend \(added in 0.22.0 by PR #39538\)"):
        S.check_linear_backend("marlin", "0.21.0")
    with pytest.raises(ValueError, match=r"unknown --linear-backend 'b12x' for vLLM 0.27.1; "
                                         r"accepted values: 'auto', 'cutlass'"):
        S.check_linear_backend("b12x", "0.27.1")


@pytest.mark.parametrize(
    ("rel", "env", "scheme", "backend", "note"),
    [
        ("0.10.0", {GEMM_BACKEND_ENV: "cutlass"}, Scheme.NVFP4, None,
         f"{GEMM_BACKEND_ENV} is ignored: vLLM reads it only from 0.11.1"),
        ("0.19.1", {BATCH_INVARIANT_ENV: "1"}, Scheme.NVFP4, None,
         f"{BATCH_INVARIANT_ENV} is ignored: vLLM reads it only from 0.20.0"),
        ("0.24.0", {FBGEMM_ENV: "1"}, Scheme.NVFP4, None,
         f"{FBGEMM_ENV} is ignored: vLLM has not read it since 0.24.0; use --linear-backend "
         "fbgemm instead"),
        ("0.20.0", {EMULATION_ENV: "1"}, Scheme.NVFP4A16, None,
         f"{EMULATION_ENV} is ignored for an NVFP4A16 checkpoint (the weight-only path never "
         "reads it)"),
        ("0.20.0", {DISABLED_KERNELS_ENV: "X"}, Scheme.NVFP4A16, None,
         f"{DISABLED_KERNELS_ENV} is ignored for an NVFP4A16 checkpoint before 0.23.0 (the "
         "weight-only scheme calls Marlin directly)"),
        ("0.22.0", {EMULATION_ENV: "1"}, Scheme.NVFP4, "marlin",
         f"{EMULATION_ENV} is ignored: with --linear-backend=marlin vLLM 0.22.0 reads it only "
         "under --linear-backend auto (deprecated; use --linear-backend emulation instead)"),
    ],
)
def test_ignored_variables(rel: str, env: dict, scheme: Scheme, backend: str | None,
                           note: str) -> None:
    req = request(rel, 100, env=env, scheme=scheme, backend=backend)
    assert S.ignored_variables(req) == (note,)


def test_variables_that_are_read_are_not_reported() -> None:
    env = {EMULATION_ENV: "1", GEMM_BACKEND_ENV: "cutlass", FBGEMM_ENV: "0"}
    assert S.ignored_variables(request("0.21.0", 100, env=env)) == ()
    assert S.ignored_variables(request("0.33.0", 100, env={BATCH_INVARIANT_ENV: "0"})) == ()
    # the facts table says who reads what: every variable is in it
    assert set(R.VARIABLES) == {EMULATION_ENV, GEMM_BACKEND_ENV, FBGEMM_ENV,
                                BATCH_INVARIANT_ENV, DISABLED_KERNELS_ENV}


def test_rotation_paths_by_release_device_and_scheme() -> None:
    import pytest

    from nvfp4lab.execution.dispatch import select_backend

    def t(**kw):
        return select_backend(rotation=kw.pop("rotation", "input:hadamard-16"), **kw).transform

    b200 = t(gpu="B200", vllm="0.33.0")
    assert (b200.path, b200.gemm_backend, b200.verified) == ("qutlass", "cute-dsl", True)
    assert t(gpu="B200", vllm="0.33.0", rotation="input:hadamard-256").path == "generic"
    assert t(gpu="B200", vllm="0.33.0", rotation="input:hadamard").path == "generic"
    h100 = t(gpu="H100", vllm="0.33.0", rotation="input:random-hadamard-16")
    assert h100.path == "generic" and not h100.hadacore
    # NVFP4A16 on sm_120: Marlin is forced, and QuTLASS needs a FlashInfer kernel
    a16 = t(gpu="RTX 5090", vllm="0.33.0", scheme="NVFP4A16")
    assert a16.path is None and "requires a FlashInfer kernel" in a16.error
    a16_b200 = t(gpu="B200", vllm="0.33.0", scheme="NVFP4A16")
    assert a16_b200.path == "qutlass" and any("W4A4 numerics" in s for s in a16_b200.steps)
    stub = t(gpu="B200", vllm="0.20.0")
    assert stub.path is None and "stub" in stub.error
    old = t(gpu="B200", vllm="0.10.1")
    assert old.path is None and "does not read transform_config" in old.error
    assert t(gpu="B200", vllm="0.10.2", rotation="input:hadamard-32").hadacore is False
    assert t(gpu="B200", vllm="0.11.0", rotation="input:hadamard-32").hadacore is True
    cpu = select_backend("cpu", vllm="0.33.0", rotation="input:hadamard-16").transform
    assert cpu.path is None and "no kernel" not in cpu.rotation
    with pytest.raises(ValueError, match="rotation"):
        select_backend(engine="llama.cpp", rotation="input:hadamard-16")
    assert select_backend(gpu="B200").transform is None
