"""select_backend for the FP8 / MXFP4 layers of a mixed checkpoint (issue 36 item 3): vLLM
0.33.0's kernel per GPU with its reason, what is refused, and the audit's kernel columns.

The table is read from vLLM 0.33.0's source (nvfp4lab/execution/dispatch_mixed.py names the
lines); tests/peers/test_vllm_selection.py runs vLLM's own FP8 chooser against it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint.auditing import DEFAULT_GPUS, audit_rows
from nvfp4lab.execution.dispatch import select_backend
from nvfp4lab.execution.mixed import apply_mix
from tests.checkpoint.builders import tiny_llama

GPUS = {"A100": (8, 0), "L40S": (8, 9), "H100": (9, 0), "B200": (10, 0), "RTX 5090": (12, 0)}
#: (gpu, scheme) -> (vLLM 0.33.0 kernel, numerics, words the reason must hold), default install
#: (flashinfer + humming).
TABLE = {
    ("A100", "FP8_DYNAMIC"): ("HummingFP8ScaledMMLinearKernel", "w8a16",
                              ("capability 80 < 89: CompressedTensorsW8A16Fp8",
                               "activations stay 16-bit")),
    ("L40S", "FP8_DYNAMIC"): ("CutlassFP8ScaledMMLinearKernel", "w8a8",
                              ("capability 89 >= 89: CompressedTensorsW8A8Fp8",
                               "requires per tensor activation and weight scales")),
    ("H100", "FP8_DYNAMIC"): ("CutlassFP8ScaledMMLinearKernel", "w8a8",
                              ("capability 90 >= 89", "cutlass_fp8_supported()")),
    ("B200", "FP8_DYNAMIC"): ("CutlassFP8ScaledMMLinearKernel", "w8a8",
                              ("capability 100 >= 89", "not checked on a CPU")),
    ("RTX 5090", "FP8_DYNAMIC"): ("CutlassFP8ScaledMMLinearKernel", "w8a8",
                                  ("capability 120 >= 89",)),
    ("A100", "FP8_W8A16"): ("HummingFP8ScaledMMLinearKernel", "w8a16",
                            ("input_activations null: _is_fp8_w8a16",
                             "as nvfp4lab's FP8Linear with quantize_activations=False")),
    ("H100", "FP8_W8A16"): ("HummingFP8ScaledMMLinearKernel", "w8a16",
                            ("CompressedTensorsW8A16Fp8", "activations stay 16-bit")),
    ("B200", "FP8_W8A16"): ("HummingFP8ScaledMMLinearKernel", "w8a16", ("L915-920",)),
    ("A100", "MXFP4A16"): ("MarlinMxFp4LinearKernel", "w4a16",
                           ("FlashInfer + >=sm_100 (Blackwell) required", "weight-only")),
    ("L40S", "MXFP4A16"): ("MarlinMxFp4LinearKernel", "w4a16", ("is_fp4_marlin_supported",)),
    ("H100", "MXFP4A16"): ("HummingMxFp4LinearKernel", "w4a16 or w4a4",
                           ("Humming moved ahead of Marlin", "unverified")),
    ("B200", "MXFP4A16"): ("FlashInferMxFp4LinearKernel", "w4a4",
                           ("quantizes the activations of this weight-only checkpoint",)),
    ("RTX 5090", "MXFP4A16"): ("FlashInferMxFp4LinearKernel", "w4a4",
                               ("capability >= 100, so it selects this on sm_120 too",)),
}


@pytest.mark.parametrize(("gpu", "scheme"), list(TABLE))
def test_table(gpu: str, scheme: str) -> None:
    kernel, numerics, words = TABLE[gpu, scheme]
    for choice in (select_backend(gpu=gpu, scheme=scheme, env={}),
                   select_backend(capability=GPUS[gpu], scheme=scheme, vllm="0.33.0", env={})):
        assert (choice.kernel, choice.numerics, choice.vllm) == (kernel, numerics, "0.33.0")
        assert choice.name == {"FP8_DYNAMIC": "w8a8", "FP8_W8A16": "w8a16"}.get(scheme, "w4a16")
        assert choice.scheme == scheme and choice.error is None and choice.supported
        assert f"picks {kernel} ({numerics})" in choice.reason
        for word in words:
            assert word in choice.reason, (gpu, scheme, word)
        assert all("@0.33.0" in step for step in choice.steps[:2]), choice.steps


def test_fp8_on_sm80_is_weight_only_fallback() -> None:
    """Ampere has no FP8 tensor cores: vLLM runs the W8A8 checkpoint weight-only, activations
    stay 16-bit, numerics unlike nvfp4lab's FP8Linear (which quantizes them)."""
    for packages in (None, ()):
        c = select_backend(gpu="A100", scheme="FP8_DYNAMIC", packages=packages, env={})
        assert c.numerics == "w8a16" and c.name == "w8a8"
        assert "activations stay 16-bit (NOT quantized)" in c.reason
        assert "numerics differ from nvfp4lab's FP8Linear" in c.reason
    assert c.kernel == "MarlinFP8ScaledMMLinearKernel"  # without humming-kernels: Marlin
    assert "skipped: HummingFP8ScaledMMLinearKernel: Humming is not installed" in c.steps
    l40s = select_backend(gpu="L40S", scheme="FP8_DYNAMIC", env={})
    assert "16-bit" not in l40s.reason and l40s.numerics == "w8a8"
    weight_only = select_backend(gpu="H100", scheme="FP8_W8A16", packages=(), env={})
    assert weight_only.kernel == "MarlinFP8ScaledMMLinearKernel"
    assert weight_only.numerics == "w8a16" and "NOT quantized" not in weight_only.reason


@pytest.mark.parametrize(("gpu", "packages", "kernel"), [
    ("H100", (), "MarlinMxFp4LinearKernel"),  # no Humming: Marlin
    ("B200", (), "MarlinMxFp4LinearKernel"),  # no FlashInfer: Marlin, weight-only
    ("B200", ("humming",), "MarlinMxFp4LinearKernel"),  # Humming preferred on sm_90 only
    ("A100", ("flashinfer", "humming"), "MarlinMxFp4LinearKernel"),
])
def test_mxfp4_packages(gpu: str, packages: tuple[str, ...], kernel: str) -> None:
    c = select_backend(gpu=gpu, scheme="MXFP4A16", packages=packages, env={})
    assert (c.kernel, c.numerics) == (kernel, "w4a16")


def test_mxfp4_on_cpu_platform_fails_to_load() -> None:
    c = select_backend("cpu", scheme="MXFP4A16", env={})
    assert c.kernel is None and not c.supported and c.name == "w4a16"
    assert c.error == ("Failed to find a kernel that can implement the MXFP4 linear layer. "
                       "Reasons: \n")


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"scheme": "FP8"}, r"scheme"),
    ({"scheme": "fp8_dynamic"}, r"scheme"),
    ({"scheme": "FP8_DYNAMIC", "vllm": "0.30.0"}, r"modelled for vLLM 0\.33\.0 only"),
    ({"scheme": "MXFP4A16", "vllm": "seed"}, r"modelled for vLLM 0\.33\.0 only"),
    ({"scheme": "FP8_DYNAMIC", "engine": "llama.cpp"}, r"engine='vllm' only"),
    ({"scheme": "FP8_DYNAMIC", "linear_backend": "marlin"}, r"linear_backend='marlin' is not"),
    ({"scheme": "MXFP4A16", "platform": "rocm"}, r"platform='rocm' is not modelled"),
    ({"scheme": "FP8_DYNAMIC", "platform": "cpu", "gpu": None}, r"platform='cpu' is not"),
    ({"scheme": "FP8_DYNAMIC", "env": {"VLLM_DISABLED_KERNELS": "CutlassFP8ScaledMMLinearKernel"}},
     r"VLLM_DISABLED_KERNELS=.* is not modelled"),
    ({"scheme": "FP8_DYNAMIC", "env": {"VLLM_BATCH_INVARIANT": "1"}},
     r"VLLM_BATCH_INVARIANT='1' is not modelled"),
    ({"scheme": "MXFP4A16", "capability": (7, 5), "gpu": None}, r"sm_75 is not modelled"),
])
def test_refused_in_one_line(kwargs: dict, pattern: str) -> None:
    args = {"gpu": "H100", "env": {}} | kwargs
    if args.get("gpu") is None:
        args.pop("gpu")
    with pytest.raises(ValueError, match=pattern) as info:
        select_backend(**args)
    assert "\n" not in str(info.value)


def test_nvfp4_choices_unchanged_and_switches_ignored() -> None:
    """The NVFP4 schemes still go through the release rules; NVFP4LAB_BACKEND does not touch an
    FP8 layer's path (it is said so)."""
    assert select_backend(gpu="H100", env={}).kernel == "HummingNvFp4LinearKernel"
    c = select_backend(gpu="H100", scheme="FP8_DYNAMIC", env={"NVFP4LAB_BACKEND": "native"})
    assert c.name == "w8a8" and not c.forced
    assert c.ignored == ("NVFP4LAB_BACKEND applies to NVFP4 layers only: ignored",)
    unset = select_backend(gpu="H100", scheme="FP8_DYNAMIC", env={"VLLM_BATCH_INVARIANT": "0"})
    assert unset.kernel == "CutlassFP8ScaledMMLinearKernel" and unset.ignored == ()


L0, L1 = "model.layers.0.", "model.layers.1."
MIX = {L0 + "self_attn.q_proj": "nvfp4-rtn", L0 + "self_attn.o_proj": "fp8",
       L1 + "mlp.gate_proj": "mxfp4", L1 + "mlp.up_proj": "mxfp4", L1 + "mlp.down_proj": "fp8"}


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_llama()
    apply_mix(model, MIX)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return checkpoint.save_pretrained(model, tmp_path_factory.mktemp("mix") / "ckpt")


def test_audit_names_the_kernels(mixed_path: Path) -> None:
    rows = {r["layer"]: r for r in audit_rows(mixed_path)}
    expect = {"fp8": {"A100 SXM 80GB": "w8a16 (HummingFP8ScaledMMLinearKernel)",
                      "H100 SXM": "w8a8 (CutlassFP8ScaledMMLinearKernel)",
                      "B200": "w8a8 (CutlassFP8ScaledMMLinearKernel)",
                      "RTX 5090": "w8a8 (CutlassFP8ScaledMMLinearKernel)"},
              "mxfp4": {"A100 SXM 80GB": "w4a16 (MarlinMxFp4LinearKernel)",
                        "H100 SXM": "w4a16 or w4a4 (HummingMxFp4LinearKernel)",
                        "B200": "w4a4 (FlashInferMxFp4LinearKernel)",
                        "RTX 5090": "w4a4 (FlashInferMxFp4LinearKernel)"}}
    assert set(DEFAULT_GPUS) == set(expect["fp8"])
    for name, fmt in MIX.items():
        row = rows[name]
        columns = {gpu: row[f"vllm 0.33.0 on {gpu}"] for gpu in DEFAULT_GPUS}
        if fmt == "nvfp4-rtn":
            assert columns["A100 SXM 80GB"] == "w4a16 (MarlinNvFp4LinearKernel)"
        else:
            assert columns == expect[fmt], name
        assert not any("not modelled" in str(v) for v in row.values()), name


def test_audit_other_release_says_not_modelled(mixed_path: Path) -> None:
    rows = {r["layer"]: r for r in audit_rows(mixed_path, vllm="0.30.0", gpus=("H100 SXM",))}
    fp8 = rows[L0 + "self_attn.o_proj"]["vllm 0.30.0 on H100 SXM"]
    assert fp8.startswith("not modelled: scheme='FP8_DYNAMIC' is modelled for vLLM 0.33.0 only")
    assert "Kernel" in rows[L0 + "self_attn.q_proj"]["vllm 0.30.0 on H100 SXM"]
