"""The release-by-release rule table against tables derived from vLLM's own code.

Each table below was written from the released wheels (file@version cited per row) and, for
0.33.0, from the real ``init_nvfp4_linear_kernel`` run on mocked platforms (the peer test
tests/peers/test_vllm_selection.py, ``make test-peers``). They are literal expectations, not
computed by nvfp4lab.
"""

from __future__ import annotations

import pytest

from nvfp4lab.execution import vllm_rules, vllm_select
from nvfp4lab.execution.dispatch import select_backend
from nvfp4lab.settings import (
    BATCH_INVARIANT_ENV,
    DISABLED_KERNELS_ENV,
    EMULATION_ENV,
    FBGEMM_ENV,
    GEMM_BACKEND_ENV,
)

K = "NvFp4LinearKernel"
MARLIN, HUMMING, CUTLASS, EMU = f"Marlin{K}", f"Humming{K}", f"Cutlass{K}", f"Emulation{K}"
CUTE, FIC = f"FlashInferCuteDsl{K}", f"FlashInferCutlass{K}"
CUTE16 = "FlashInferCuteDslNvFp4W4A16LinearKernel"
NO_KERNEL = "Failed to find a kernel that can implement the NVFP4 linear layer. Reasons: \n"
MARLIN_FORCED = f"Forced NVFP4 kernel {MARLIN} is not supported: Marlin FP4 not available"

# vLLM 0.33.0, default install (flashinfer + humming present, b12x/fbgemm absent):
# kernels/linear/__init__.py@0.33.0 L592-613 and L1191-1309 (run in the peer test
# tests/peers/test_vllm_selection.py).
LATEST_CUDA = [
    # (cc, W4A4 kernel, NVFP4A16 kernel, W4A4 without flashinfer/humming, A16 without them)
    ((7, 5), MARLIN, MARLIN, MARLIN, MARLIN),
    ((8, 0), MARLIN, MARLIN, MARLIN, MARLIN),
    ((8, 6), MARLIN, MARLIN, MARLIN, MARLIN),
    ((8, 9), MARLIN, MARLIN, MARLIN, MARLIN),
    ((9, 0), HUMMING, HUMMING, MARLIN, MARLIN),
    ((10, 0), CUTE, CUTE16, CUTLASS, MARLIN),
    ((10, 3), CUTE, CUTE16, CUTLASS, MARLIN),
    ((11, 0), FIC, MARLIN, CUTLASS, MARLIN),
    ((12, 0), FIC, MARLIN, CUTLASS, MARLIN),
    ((12, 1), FIC, MARLIN, CUTLASS, MARLIN),
]


@pytest.mark.parametrize(("cap", "w4a4", "a16", "w4a4_bare", "a16_bare"), LATEST_CUDA)
def test_latest_cuda_table(
    cap: tuple[int, int], w4a4: str, a16: str, w4a4_bare: str, a16_bare: str
) -> None:
    assert select_backend(capability=cap, env={}).kernel == w4a4
    assert select_backend(capability=cap, env={}, scheme="NVFP4A16").kernel == a16
    bare = {"capability": cap, "env": {}, "packages": ()}
    assert select_backend(**bare).kernel == w4a4_bare  # type: ignore[arg-type]
    assert select_backend(**bare, scheme="NVFP4A16").kernel == a16_bare  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("platform", "w4a4", "a16"),
    [
        ("rocm", EMU, None),  # ROCm: [Emulation]; A16 forces Marlin, not on ROCm
        ("xpu", None, None),  # no registry entry (PRs #45779, #56060 not merged)
        ("cpu", None, None),
    ],
)
def test_latest_other_platforms(platform: str, w4a4: str | None, a16: str | None) -> None:
    cap = (9, 4) if platform == "rocm" else None
    choice = select_backend("cpu", capability=cap, env={}, platform=platform)
    assert choice.kernel == w4a4
    if w4a4 is None:
        assert choice.error == NO_KERNEL  # empty reasons list, as vLLM prints it
    a16_choice = select_backend("cpu", capability=cap, env={}, platform=platform,
                                scheme="NVFP4A16")
    assert a16_choice.kernel is None and a16_choice.error == MARLIN_FORCED


def test_latest_overrides() -> None:
    # VLLM_BATCH_INVARIANT: CUTLASS where cutlass_fp4_supported(), else Emulation; A16 raises
    bi = {BATCH_INVARIANT_ENV: "1"}
    assert select_backend(capability=(10, 0), env=bi).kernel == CUTLASS
    assert select_backend(capability=(9, 0), env=bi).kernel == EMU
    hopper_a16 = select_backend(capability=(9, 0), env=bi, scheme="NVFP4A16")
    assert hopper_a16.error == f"{EMU} does not support W4A16"
    # --linear-backend filters the list; with no kernel for it, automatic selection (0.28+)
    assert select_backend(capability=(10, 0), env={}, linear_backend="marlin").kernel == MARLIN
    assert select_backend(capability=(9, 0), env={}, linear_backend="Emulation").kernel == EMU
    assert select_backend(capability=(9, 0), env={}, linear_backend="triton").kernel == HUMMING
    # VLLM_DISABLED_KERNELS: exact class names, split on "," without stripping
    off = {DISABLED_KERNELS_ENV: f"{HUMMING},{MARLIN}"}
    trt = select_backend(capability=(9, 0), env=off)
    assert trt.kernel == f"FlashInferTrtllm{K}"  # capability-blind (flashinfer.py@0.33.0)
    spaced = select_backend(capability=(9, 0), env={DISABLED_KERNELS_ENV: f"{HUMMING}, {MARLIN}"})
    assert spaced.kernel == MARLIN  # " MarlinNvFp4LinearKernel" matches no class
    # the three variables 0.24.0 stopped reading change nothing
    for var, value in ((EMULATION_ENV, "1"), (GEMM_BACKEND_ENV, "cutlass"), (FBGEMM_ENV, "1")):
        choice = select_backend(capability=(9, 0), env={var: value})
        assert choice.kernel == HUMMING
        assert f"{var} is ignored: vLLM has not read it since 0.24.0" in choice.reason
    assert "--linear-backend emulation" in select_backend(
        capability=(9, 0), env={EMULATION_ENV: "1"}).reason


# Earlier eras. (release, cc, env, linear_backend, scheme, kernel or error start), each from the
# cited code; packages are each release's default install.
ERA_TABLE = [
    # E0, compressed_tensors_w4a4_nvfp4.py@0.9.1: CUTLASS, else emulation (bias dropped)
    ("0.9.1", (10, 0), {}, None, "NVFP4", CUTLASS),
    ("0.9.1", (9, 0), {}, None, "NVFP4", EMU),
    ("0.9.1", (7, 5), {}, None, "NVFP4", "Quantization scheme is not supported"),
    ("0.9.1", (9, 0), {}, None, "NVFP4A16", MARLIN),
    # E1, compressed_tensors.py@0.9.2 L394-403: switch or CUTLASS -> W4A4, else Marlin
    ("0.9.2", (9, 0), {}, None, "NVFP4", MARLIN),
    ("0.9.2", (9, 0), {EMULATION_ENV: "1"}, None, "NVFP4", EMU),
    ("0.9.2", (10, 0), {}, None, "NVFP4", CUTLASS),
    ("0.9.2", (7, 5), {EMULATION_ENV: "1"}, None, "NVFP4", "Quantization scheme is not"),
    ("0.10.1", (10, 0), {}, None, "NVFP4", CUTLASS),  # flashinfer an extra: absent
    # E2, compressed_tensors_w4a4_nvfp4.py@0.11.1 __init__ (flashinfer a hard dependency)
    ("0.11.1", (10, 0), {}, None, "NVFP4", FIC),
    ("0.11.1", (10, 0), {GEMM_BACKEND_ENV: "cutlass"}, None, "NVFP4", CUTLASS),
    ("0.11.1", (10, 0), {GEMM_BACKEND_ENV: "flashinfer-trtllm"}, None, "NVFP4",
     f"FlashInferTrtllm{K}"),
    ("0.15.0", (10, 0), {GEMM_BACKEND_ENV: "marlin"}, None, "NVFP4", "No valid NVFP4 GEMM"),
    ("0.14.0", (8, 9), {EMULATION_ENV: "1"}, None, "NVFP4", EMU),
    ("0.14.0", (8, 9), {}, None, "NVFP4", MARLIN),
    # E3, nvfp4_utils.py@0.16.0 select_nvfp4_linear_backend
    ("0.16.0", (9, 0), {}, None, "NVFP4", MARLIN),
    ("0.16.0", (7, 5), {}, None, "NVFP4", MARLIN),  # min cc now 7.5
    ("0.16.0", (10, 0), {}, None, "NVFP4", FIC),
    ("0.19.1", (10, 0), {EMULATION_ENV: "1"}, None, "NVFP4", EMU),
    ("0.19.1", (9, 0), {GEMM_BACKEND_ENV: "cutlass"}, None, "NVFP4",
     "Cutlass is required for NvFp4LinearBackend.VLLM_CUTLASS"),
    ("0.16.0", (10, 0), {FBGEMM_ENV: "1"}, None, "NVFP4", "Backend fbgemm requires"),
    # E4, kernels/linear/__init__.py@0.20.0
    ("0.20.0", (9, 0), {}, None, "NVFP4", MARLIN),
    ("0.20.0", (10, 0), {BATCH_INVARIANT_ENV: "1"}, None, "NVFP4", EMU),
    ("0.20.0", (9, 0), {GEMM_BACKEND_ENV: "cutlass"}, None, "NVFP4",
     f"Forced NVFP4 kernel {CUTLASS} is not supported: CUTLASS FP4 kernels not available"),
    ("0.21.0", (12, 0), {EMULATION_ENV: "1"}, None, "NVFP4", EMU),
    # E5, __init__.py@0.22.0: env vars only with --linear-backend auto; flag filters
    ("0.22.0", (10, 0), {BATCH_INVARIANT_ENV: "1"}, None, "NVFP4", CUTLASS),
    ("0.22.0", (10, 0), {EMULATION_ENV: "1"}, "marlin", "NVFP4", MARLIN),
    ("0.22.0", (10, 0), {EMULATION_ENV: "1"}, None, "NVFP4", EMU),
    ("0.23.0", (9, 0), {}, "triton", "NVFP4",
     "--linear-backend=triton was requested but no 'triton' kernel exists for NVFP4 layers."),
    ("0.23.0", (10, 0), {EMULATION_ENV: "1"}, None, "NVFP4A16", MARLIN),  # #42443
    # E6
    ("0.24.0", (10, 0), {}, None, "NVFP4", CUTE),
    ("0.24.0", (9, 0), {}, None, "NVFP4", MARLIN),
    ("0.25.0", (9, 0), {}, None, "NVFP4", MARLIN),  # Humming appended after Emulation
    ("0.30.0", (9, 0), {}, None, "NVFP4A16", MARLIN),  # Humming priority only from 0.32.0
    ("0.30.0", (10, 0), {}, None, "NVFP4A16", CUTE16),
    ("0.32.0", (9, 0), {}, None, "NVFP4", HUMMING),
]


@pytest.mark.parametrize(("rel", "cap", "env", "flag", "scheme", "want"), ERA_TABLE)
def test_era_table(
    rel: str, cap: tuple[int, int], env: dict[str, str], flag: str | None, scheme: str, want: str
) -> None:
    choice = select_backend(capability=cap, env=env, vllm=rel, linear_backend=flag,
                            scheme=scheme)
    if want.endswith("LinearKernel"):
        assert choice.kernel == want, choice.reason
    else:
        assert choice.kernel is None and choice.error.startswith(want), choice.reason  # type: ignore[union-attr]


def test_bias_and_defect_windows() -> None:
    dropped = select_backend(gpu="H100", env={}, vllm="0.9.1")
    assert dropped.bias == "dropped" and dropped.name == "emulation"
    assert "DROPS the bias" in dropped.reason
    for rel in ("0.9.2", "0.15.1", "0.20.0", "0.33.0"):
        kept = select_backend(gpu="H100", env={EMULATION_ENV: "1", BATCH_INVARIANT_ENV: "1"},
                              vllm=rel)
        assert kept.kernel == EMU and kept.bias == "output" and kept.defect is None, rel
    wrong = select_backend(gpu="H100", env={EMULATION_ENV: "1"}, vllm="0.18.0")
    assert wrong.kernel == EMU and "#35733" in (wrong.defect or "")


def test_releases_and_eras() -> None:
    assert vllm_rules.release(None) == vllm_rules.release("latest") == "0.33.0"
    assert vllm_rules.release("seed") == "0.9.2"
    assert vllm_rules.release("v0.20") == "0.20.0"
    assert vllm_rules.release("0.10.1.1") == "0.10.1.1"
    for bad in ("0.9.0", "0.34.0", "1.0", "latest-ish", ""):
        with pytest.raises(ValueError, match="vllm="):
            vllm_rules.release(bad)
    keys = [vllm_rules.era_of(r).key for r in vllm_rules.MODELLED_RELEASES]
    assert keys == sorted(keys)  # eras are contiguous and ordered
    assert {e.key for e in vllm_rules.ERAS} == set(keys)
    assert vllm_rules.era_of("0.23.0").key == "E5" and vllm_rules.era_of("0.24.0").key == "E6"


def test_bad_values_vllm_rejects() -> None:
    with pytest.raises(ValueError, match="Invalid value 'CUTLASS' for VLLM_NVFP4_GEMM_BACKEND"):
        select_backend(gpu="B200", env={GEMM_BACKEND_ENV: "CUTLASS"}, vllm="0.20.0")
    with pytest.raises(ValueError, match="no --linear-backend"):
        select_backend(gpu="B200", env={}, vllm="0.21.0", linear_backend="marlin")
    with pytest.raises(ValueError, match="unknown --linear-backend 'humming'"):
        select_backend(gpu="B200", env={}, vllm="0.24.0", linear_backend="humming")
    with pytest.raises(ValueError, match="unknown platform"):
        select_backend(gpu="B200", env={}, platform="tpu")
    with pytest.raises(ValueError, match="unknown scheme"):
        select_backend(gpu="B200", env={}, scheme="nvfp4")
    with pytest.raises(ValueError, match="unknown package"):
        select_backend(gpu="B200", env={}, packages=["cutlass"])
    with pytest.raises(ValueError, match="needs a compute capability"):
        select_backend("cpu", env={}, platform="cuda")


def test_every_kernel_has_numerics_and_source() -> None:
    names = {vllm_select._cls(k) for _, ks in vllm_select.REGISTRY for k in ks}
    assert names == set(vllm_rules.KERNELS)
    for kernel in vllm_rules.KERNELS.values():
        assert kernel.source and kernel.bias and kernel.numerics
    # Humming: W4A8 on sm_89/90, FP4 activations on 12.x, 16-bit elsewhere (humming_numerics)
    assert [str(vllm_rules.humming_numerics(cc, "NVFP4")) for cc in (80, 89, 90, 100, 120)] == [
        "w4a16", "w4a8", "w4a8", "w4a16", "native"]
    assert vllm_rules.humming_numerics(90, "NVFP4A16") == "w4a16"


def test_transform_eras_cover_every_modelled_release_once() -> None:
    from nvfp4lab.execution import vllm_rules as R

    for rel in R.MODELLED_RELEASES:
        assert sum(era.contains(rel) for era in R.TRANSFORM_ERAS) == 1, rel
    firsts = [R.version(e.first) for e in R.TRANSFORM_ERAS]
    assert firsts == sorted(firsts) and R.TRANSFORM_ERAS[-1].last == R.LATEST_MODELLED
    assert set(R.QUTLASS_GEMM_BACKENDS) <= set(R.KERNELS)
    assert set(R.QUTLASS_UNROUNDED_SCALE_BLOCKS) <= set(R.QUTLASS_BLOCKS)
    assert all(R.transform_era_of(r).verified is False for r in ("0.10.2", "0.27.0"))
