"""Backend selection: the rule table, environment parsing, simulated GPUs, the info report.

The seed's rules (``vllm="seed"``, PR #19879 as released in 0.9.2) keep the tests this module had
before version-aware dispatch; the default (latest, 0.33.0) rules are checked against a table
derived from vLLM 0.33.0's ``init_nvfp4_linear_kernel`` (see ``LATEST`` below). The release-by-
release rule table is tested in ``test_vllm_rules.py``.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from nvfp4lab.execution import dispatch
from nvfp4lab.execution.dispatch import (
    BACKEND_ENV,
    EMULATION_ENV,
    BackendChoice,
    info_report,
    parse_backend_override,
    parse_emulation_switch,
    select_backend,
)
from nvfp4lab.settings import (
    BATCH_INVARIANT_ENV,
    GEMM_BACKEND_ENV,
    VLLM_ENV_VARS,
)

CAPABILITIES = [(7, 5), (8, 0), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0)]
SWITCH_VALUES = [None, "0", "1", "2", "00", " 1 ", "-1"]
OVERRIDES = [None, "", "auto", "native", "emulation", "w4a16", "AUTO", " Emulation "]


def _expected(cap: tuple[int, int], switch: str | None, override: str | None) -> tuple[str, bool]:
    """The seed's rules (PR #19879, as the seed modelled them), written out independently:
    (backend, forced). Below cc 8.0 vLLM itself refuses the checkpoint ("Min capability: 80",
    compressed_tensors.py@0.9.2); nvfp4lab then runs the path that was asked for."""
    forced = override is not None and override.strip().lower() not in ("", "auto")
    if forced:
        return override.strip().lower(), True  # type: ignore[union-attr]
    if switch is not None and int(switch) != 0:
        return "emulation", False
    if cap >= (10, 0):
        return "native", False
    return "w4a16", False


def _env(switch: str | None, override: str | None) -> dict[str, str]:
    """The seed's switch and nvfp4lab's override as environment entries (None: unset)."""
    env = {}
    if switch is not None:
        env[EMULATION_ENV] = switch
    if override is not None:
        env[BACKEND_ENV] = override
    return env


@pytest.mark.parametrize(
    ("cap", "switch", "override"), list(itertools.product(CAPABILITIES, SWITCH_VALUES, OVERRIDES))
)
def test_selection_table(
    cap: tuple[int, int], switch: str | None, override: str | None
) -> None:
    choice = select_backend(capability=cap, env=_env(switch, override), vllm="seed")
    name, forced = _expected(cap, switch, override)
    assert choice.name == name
    assert choice.forced is forced
    assert choice.capability == cap
    assert choice.native_supported is (cap >= (10, 0))
    assert choice.emulation_switch is (switch is not None and int(switch) != 0)
    assert choice.reason  # always explained
    assert f"sm_{cap[0]}{cap[1]}" in choice.reason


# vLLM 0.33.0 (the default rules), default install, from kernels/linear/__init__.py@0.33.0
# L592-613 and the real init_nvfp4_linear_kernel (run in tests/peers/test_vllm_selection.py):
# cc 7.5-8.9 Marlin (w4a16), 9.0 Humming (W4A8 -> nvfp4lab w4a16), 10.x FlashInferCuteDsl,
# 12.x FlashInferCutlass (native). VLLM_USE_NVFP4_CT_EMULATIONS is not read (envs.py@0.24.0+).
LATEST_KERNEL = {(7, 5): "Marlin", (8, 0): "Marlin", (8, 9): "Marlin", (9, 0): "Humming",
                 (10, 0): "FlashInferCuteDsl", (10, 3): "FlashInferCuteDsl",
                 (12, 0): "FlashInferCutlass"}


@pytest.mark.parametrize(
    ("cap", "switch", "override"), list(itertools.product(CAPABILITIES, SWITCH_VALUES, OVERRIDES))
)
def test_selection_table_latest(
    cap: tuple[int, int], switch: str | None, override: str | None
) -> None:
    choice = select_backend(capability=cap, env=_env(switch, override))
    forced = override is not None and override.strip().lower() not in ("", "auto")
    name = override.strip().lower() if forced else (  # type: ignore[union-attr]
        "native" if cap >= (10, 0) else "w4a16")
    assert choice.name == name and choice.forced is forced
    assert choice.kernel == LATEST_KERNEL[cap] + "NvFp4LinearKernel"
    assert choice.vllm == "0.33.0" and not choice.emulation_switch
    assert (EMULATION_ENV + " is ignored" in choice.reason) is (switch is not None)


def test_reasons_are_specific() -> None:
    hopper = select_backend(capability=(9, 0), env={}, vllm="seed")
    assert hopper.name == "w4a16" and hopper.kernel == "MarlinNvFp4LinearKernel"
    assert "no FP4 tensor cores" in hopper.reason and "Marlin" in hopper.reason
    assert EMULATION_ENV in hopper.reason and "0.9.2" in hopper.reason
    blackwell_emu = select_backend(capability=(10, 0), env={EMULATION_ENV: "1"}, vllm="seed")
    assert blackwell_emu.name == "emulation"
    assert "has FP4 tensor cores" in blackwell_emu.reason
    assert blackwell_emu.kernel == "EmulationNvFp4LinearKernel" and blackwell_emu.bias == "output"
    forced = select_backend(capability=(8, 9), env={BACKEND_ENV: "native"})
    assert forced.name == "native" and forced.forced and not forced.native_supported
    assert "will raise" in forced.reason and BACKEND_ENV in forced.reason
    turing = select_backend(capability=(7, 5), env={}, vllm="seed")
    assert "sm_75" in turing.reason and turing.kernel is None
    assert "Min capability: 80" in turing.error  # type: ignore[operator]


def test_reasons_read_whole_off_cuda() -> None:
    """A probe of `nvfp4lab info` found "Reasons:," (vLLM's empty list on a platform without an
    NVFP4 kernel) and, for a CUDA device on a CPU-only torch, "cuda:0: cuda:0: ..."."""
    cpu = select_backend("cpu", env={})
    assert cpu.kernel is None and cpu.error is not None and cpu.error.rstrip().endswith(
        "Reasons:")  # vLLM's own words are kept as they are
    assert "Reasons: (none listed: no NVFP4 kernel is registered for cpu)" in cpu.reason
    assert "Reasons:," not in cpu.reason and "\n" not in cpu.reason
    if not torch.cuda.is_available():
        cuda = select_backend("cuda:0", env={})
        assert cuda.reason.startswith("cuda:0: CUDA is not available"), cuda.reason
        assert "cuda:0: cuda:0" not in cuda.reason


@pytest.mark.parametrize("value", ["true", "True", "yes", "on", "", "1.0", "0x1", "enabled"])
def test_bad_emulation_switch_values(value: str) -> None:
    with pytest.raises(ValueError) as err:
        select_backend(capability=(10, 0), env={EMULATION_ENV: value}, vllm="seed")
    msg = str(err.value)
    assert EMULATION_ENV in msg and repr(value) in msg and "accepted values" in msg
    # 0.24.0+ no longer reads the variable: any value is ignored, and the reason says so
    latest = select_backend(capability=(10, 0), env={EMULATION_ENV: value})
    assert latest.name == "native" and not latest.emulation_switch
    assert f"{EMULATION_ENV} is ignored: vLLM has not read it since 0.24.0" in latest.reason


@pytest.mark.parametrize("value", ["gpu", "marlin", "fp4", "cuda", "native2"])
def test_bad_backend_override_values(value: str) -> None:
    with pytest.raises(ValueError) as err:
        select_backend(capability=(10, 0), env={BACKEND_ENV: value})
    msg = str(err.value)
    assert BACKEND_ENV in msg and repr(value) in msg
    for name in ("auto", "native", "emulation", "w4a16", "q8_0"):
        assert name in msg


def test_switch_parsing_matches_vllm() -> None:
    # vLLM: bool(int(os.getenv(name, "0")))
    for value in ["0", "1", "2", "-1", "01", " 3", "+1", "00"]:
        assert parse_emulation_switch(value) is bool(int(value))
    assert parse_emulation_switch(None) is False
    assert parse_backend_override(None) == "auto"
    assert parse_backend_override("  W4A16 ") == "w4a16"


def test_environment_is_read_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (EMULATION_ENV, BACKEND_ENV, *VLLM_ENV_VARS):
        monkeypatch.delenv(var, raising=False)
    assert select_backend(capability=(10, 0), vllm="seed").name == "native"
    monkeypatch.setenv(EMULATION_ENV, "1")
    assert select_backend(capability=(10, 0), vllm="seed").name == "emulation"
    assert select_backend(capability=(10, 0)).name == "native"  # ignored by 0.33.0
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")  # 0.33.0: CUTLASS where supported
    assert select_backend(capability=(10, 0)).kernel == "CutlassNvFp4LinearKernel"
    monkeypatch.setenv(BACKEND_ENV, "w4a16")
    assert select_backend(capability=(10, 0), vllm="seed").name == "w4a16"
    # an explicit env mapping replaces os.environ entirely
    assert select_backend(capability=(10, 0), env={}, vllm="seed").name == "native"


def test_cpu_device() -> None:
    # seed: nvfp4lab's CPU behaviour as before (w4a16; emulation with the switch)
    choice = select_backend("cpu", env={}, vllm="seed")
    assert choice.name == "w4a16" and choice.device == "cpu" and choice.capability is None
    assert select_backend("cpu", env={EMULATION_ENV: "1"}, vllm="seed").name == "emulation"
    assert select_backend(torch.device("cpu"), env={BACKEND_ENV: "native"}).name == "native"
    # latest: vLLM 0.33.0 has no NVFP4 kernel on its CPU platform (no registry entry,
    # kernels/linear/__init__.py@0.33.0 L592-613); nvfp4lab still runs w4a16 there
    latest = select_backend("cpu", env={})
    assert latest.platform == "cpu" and latest.kernel is None and not latest.supported
    assert latest.error.startswith("Failed to find a kernel that can implement")  # type: ignore[union-attr]
    assert latest.name == "w4a16" and "nvfp4lab runs w4a16 in its place" in latest.reason
    # only VLLM_BATCH_INVARIANT reaches a kernel there (forced Emulation; vLLM's own selection
    # on its CPU platform agrees, tests/peers/test_vllm_selection.py)
    batch = select_backend("cpu", env={BATCH_INVARIANT_ENV: "1"})
    assert batch.kernel == "EmulationNvFp4LinearKernel" and batch.name == "emulation"
    # --linear-backend emulation does not help: the CPU list is empty
    flag = select_backend("cpu", env={}, linear_backend="emulation")
    assert flag.kernel is None and flag.name == "emulation"


def test_named_gpus() -> None:
    assert select_backend(gpu="H100", env={}).name == "w4a16"
    assert select_backend(gpu="H100", env={}, vllm="seed").kernel == "MarlinNvFp4LinearKernel"
    b200 = select_backend(gpu="B200", env={})
    assert b200.name == "native" and b200.capability == (10, 0) and b200.gpu_name == "B200"
    assert dispatch.capability_of("h200") == (9, 0)
    with pytest.raises(KeyError):
        dispatch.capability_of("no such gpu")
    names = [name for name, _ in dispatch.known_gpus()]
    assert any("H100" in n for n in names) and any("B200" in n for n in names)


#: llama.cpp's path per catalogue GPU and platform (llama_cpp_rules' module docstring, read from
#: llama.cpp@0c1e57098): (kernel prefix, numerics, nvfp4lab's backend).
LLAMA_CPP = {
    "H100 SXM": ("mul_mat_q<GGML_TYPE_NVFP4> (MMQ", "q8_1", "q8_0"),
    "B200": ("mul_mat_q<GGML_TYPE_NVFP4> (MMQ", "q8_1", "q8_0"),  # sm_100: no FP4 MMA path
    "RTX 5090": ("mul_mat_q<GGML_TYPE_NVFP4, GGML_PREC_Q4>", "native", "native"),
    "DGX Spark": ("mul_mat_q<GGML_TYPE_NVFP4, GGML_PREC_Q4>", "native", "native"),
}


@pytest.mark.parametrize("gpu", list(LLAMA_CPP))
def test_llama_cpp_engine_per_gpu(gpu: str) -> None:
    kernel, numerics, name = LLAMA_CPP[gpu]
    choice = select_backend(gpu=gpu, env={}, engine="llama.cpp")
    assert choice.kernel.startswith(kernel) and choice.numerics == numerics  # type: ignore[union-attr]
    assert choice.name == name and choice.engine == "llama.cpp" and choice.vllm == ""
    assert choice.era.startswith("llama.cpp@0c1e57098") and choice.bias == "output"
    assert choice.steps and all("." in step or "cc" in step for step in choice.steps)
    major, minor = dispatch.capability_of(gpu)
    assert f"ggml cc {100 * major + 10 * minor} (CUDA)" in choice.reason


def test_llama_cpp_engine_on_cpu_and_platforms() -> None:
    cpu = select_backend("cpu", env={}, engine="llama.cpp")
    assert (cpu.kernel, cpu.numerics, cpu.name) == ("ggml_vec_dot_nvfp4_q8_0", "q8_0", "q8_0")
    assert "quants.c" in cpu.reason and "vec_dot_type GGML_TYPE_Q8_0" in cpu.reason
    rocm = select_backend(capability=(9, 4), platform="rocm", env={}, engine="llama.cpp")
    assert rocm.numerics == "q8_1" and "HIP" in rocm.reason
    # the FP4 MMA runs only on NVIDIA: a HIP cc in the range still takes MMQ
    assert select_backend(capability=(12, 0), platform="rocm", env={},
                          engine="llama.cpp").numerics == "q8_1"
    with pytest.raises(ValueError, match=r"'xpu' \(ggml-sycl\) is not modelled"):
        select_backend("cpu", platform="xpu", env={}, engine="llama.cpp")
    with pytest.raises(ValueError, match=r"vllm, packages are vLLM's"):
        select_backend("cpu", vllm="0.33.0", packages=(), engine="llama.cpp")
    with pytest.raises(ValueError, match=r"unknown engine 'sglang'; accepted values: 'vllm'"):
        select_backend("cpu", engine="sglang")


def test_llama_cpp_engine_reads_its_variable() -> None:
    q8 = select_backend(gpu="RTX 5090", env={"GGML_CUDA_MMQ_PREC": "Q8"}, engine="llama.cpp")
    assert q8.numerics == "q8_1" and q8.name == "q8_0" and not q8.ignored
    q4 = select_backend(gpu="H100", env={"GGML_CUDA_MMQ_PREC": "q4"}, engine="llama.cpp")
    assert q4.numerics == "q8_1" and "q4 has no effect" in q4.ignored[0]
    odd = select_backend(gpu="RTX 5090", env={"GGML_CUDA_MMQ_PREC": "fast"}, engine="llama.cpp")
    assert odd.numerics == "native" and "keeps auto" in odd.ignored[0]
    forced = select_backend(gpu="H100", env={BACKEND_ENV: "w4a16"}, engine="llama.cpp")
    assert forced.name == "w4a16" and forced.forced and forced.numerics == "q8_1"
    # without FP4 in torch the FP4 MMA's stand-in is the emulation
    spark = select_backend(gpu="DGX Spark", env={}, engine="llama.cpp")
    assert spark.name == ("native" if spark.native_supported else "emulation")


def test_choice_is_frozen() -> None:
    choice = select_backend(capability=(9, 0), env={}, vllm="seed")
    assert isinstance(choice, BackendChoice)
    with pytest.raises(dataclasses.FrozenInstanceError):
        choice.name = "native"  # type: ignore[misc]
    assert str(choice).startswith("w4a16: ")


def test_torch_without_fp4_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "float4_e2m1fn_x2")
    choice = select_backend(capability=(10, 0), env={})
    assert choice.name == "w4a16" and "float4_e2m1fn_x2" in choice.reason


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, cap: tuple[int, int], runtime: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FakeGPU")
    monkeypatch.setattr(torch.version, "cuda", runtime)


@pytest.mark.parametrize(
    ("cap", "runtime", "expected"),
    [
        ((10, 0), "12.8", "native"),
        ((12, 0), "13.0", "native"),
        ((10, 0), "12.4", "w4a16"),  # Blackwell but an old CUDA runtime
        ((9, 0), "12.8", "w4a16"),
    ],
)
def test_real_device_branch(
    monkeypatch: pytest.MonkeyPatch, cap: tuple[int, int], runtime: str, expected: str
) -> None:
    _fake_cuda(monkeypatch, cap, runtime)
    choice = select_backend("cuda:0", env={})
    assert choice.name == expected
    assert choice.device == "cuda:0" and choice.capability == cap
    assert "FakeGPU" in choice.reason
    if runtime == "12.4":
        assert "12.4" in choice.reason and "12.8" in choice.reason


def test_info_report() -> None:
    text = info_report(env={EMULATION_ENV: "1"})
    assert torch.__version__ in text
    assert BACKEND_ENV in text and EMULATION_ENV in text
    assert "selected backend" in text and "reason" in text
    assert "B200" in text and "H100" in text
    assert "vLLM rules applied: 0.33.0 (E6 flag-only registry" in text
    assert "ignored: vLLM has not read it since 0.24.0" in text
    seed = info_report(env={EMULATION_ENV: "1"}, vllm="seed")
    assert "vLLM rules applied: 0.9.2 (E1 seed switch" in seed
    text_bad = info_report(env={EMULATION_ENV: "true"}, vllm="seed")
    assert "ERROR" in text_bad and "'true'" in text_bad
    assert "ERROR" not in info_report(env={EMULATION_ENV: "true"})  # not read by 0.33.0


def test_decision_table() -> None:
    rows = dispatch.decision_table(env={}, vllm="seed")
    by_cc = {r["capability"]: r for r in rows}
    assert by_cc["9.0"]["switch_off"] == "w4a16" and by_cc["9.0"]["switch_on"] == "emulation"
    assert by_cc["10.0"]["switch_off"] == "native" and by_cc["10.0"]["switch_on"] == "emulation"
    assert by_cc["10.0"]["kernel_off"] == "CutlassNvFp4LinearKernel"
    forced = dispatch.decision_table(env={BACKEND_ENV: "w4a16"}, vllm="seed")
    assert {r["switch_on"] for r in forced} == {"w4a16"}
    latest = {r["capability"]: r for r in dispatch.decision_table(env={})}
    assert latest["10.0"]["switch_on"] == "native"  # the switch is ignored by 0.33.0
    assert latest["9.0"]["kernel_off"] == latest["9.0"]["kernel_on"] == "HummingNvFp4LinearKernel"
    assert {r["vllm"] for r in latest.values()} == {"0.33.0"}


def test_cli_info(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:

    from nvfp4lab.cli import main

    for var in (BACKEND_ENV, *VLLM_ENV_VARS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(EMULATION_ENV, "1")
    assert main(["info", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "selected backend for cpu: w4a16" in out and "B200" in out
    assert "vLLM rules applied: 0.33.0" in out and "ignored" in out
    monkeypatch.setenv(GEMM_BACKEND_ENV, "bogus")  # not read by 0.33.0 either
    assert main(["info"]) == 0
    monkeypatch.setenv(BACKEND_ENV, "gpu")
    assert main(["info"]) == 2
    assert "ERROR" in capsys.readouterr().out
