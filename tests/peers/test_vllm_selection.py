"""vLLM 0.33.0's own NVFP4 kernel selection as the oracle for ``select_backend(vllm="0.33.0")``.

The function under comparison is vLLM's ``init_nvfp4_linear_kernel(use_a16=...)``
(vllm/model_executor/kernels/linear/__init__.py@0.33.0 L1191-1309), imported from the directory
``make test-peers`` installs vLLM into and run as shipped: its forced paths
(``VLLM_BATCH_INVARIANT``, the NVFP4A16 preferences), the CUDA/ROCm registry (L592-613), the W4A16
filter, ``prioritize_humming``, the ``--linear-backend`` filter and its fallback
(``_resolve_backend_kernels``, L410-442), ``VLLM_DISABLED_KERNELS``, every kernel's
``is_supported``/``can_implement`` and the kernel constructor (``NvFp4LinearKernel.__init__``
only asserts both; nothing of it touches a device) are vLLM's code. Whatever it builds or raises
is compared with nvfp4lab's choice: the kernel class name, and when vLLM raises, its whole
error message against ``choice.error``.

What is stood in for, and why that is acceptable: only the answers a machine gives, each of them
an input of ``select_backend`` rather than part of the rules it models:

* the platform: the class of ``vllm.platforms.current_platform`` gets the ``_enum`` of the
  platform under test (``is_cuda()``, ``is_cuda_alike()`` ... read it) and a
  ``get_device_capability`` answering the capability under test (``capability=``/``platform=``
  of ``select_backend``); ``has_device_capability``, ``is_device_capability_family`` and
  ``DeviceCapability.to_int`` run as shipped on top of it;
* the one C++ probe, ``torch.ops._C.cutlass_scaled_mm_supports_fp4`` (not in the wheel);
* the optional-package probes (``packages=`` of ``select_backend``): FlashInfer, Humming, FBGEMM,
  B12X;
* the engine config that carries ``--linear-backend`` (``linear_backend=``).

Torch's own FP4 pieces (``torch._scaled_mm``, ``torch.float4_e2m1fn_x2``, which
``TorchNvFp4LinearKernel.is_supported`` checks) are the installed torch's, as nvfp4lab assumes.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import types
import typing
from collections.abc import Iterable, Mapping

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from nvfp4lab.execution import vllm_rules, vllm_select
from nvfp4lab.execution.dispatch import select_backend
from nvfp4lab.settings import BATCH_INVARIANT_ENV, DISABLED_KERNELS_ENV
from nvfp4lab.vocab import Platform

try:
    VLLM_VERSION = importlib.import_module("vllm").__version__
    LINEAR = importlib.import_module("vllm.model_executor.kernels.linear")
    NVFP4_UTILS = importlib.import_module(
        "vllm.model_executor.layers.quantization.utils.nvfp4_utils"
    )
    K_FLASHINFER = importlib.import_module("vllm.model_executor.kernels.linear.nvfp4.flashinfer")
    K_HUMMING = importlib.import_module("vllm.model_executor.kernels.linear.nvfp4.humming")
    K_FBGEMM = importlib.import_module("vllm.model_executor.kernels.linear.nvfp4.fbgemm")
    K_B12X = importlib.import_module("vllm.model_executor.kernels.linear.nvfp4.b12x")
    PLATFORMS = importlib.import_module("vllm.platforms")
    PLATFORM_INTERFACE = importlib.import_module("vllm.platforms.interface")
    VLLM_CONFIG = importlib.import_module("vllm.config")
    KERNEL_CONFIG = importlib.import_module("vllm.config.kernel")
    CURRENT_PLATFORM = PLATFORMS.current_platform
except Exception as exc:  # pragma: no cover - depends on the peer install
    pytest.skip(
        f"vLLM's NVFP4 kernel registry does not import ({type(exc).__name__}: {exc}); run "
        "`make test-peers`, which installs vllm==0.33.0 and what its kernel registry imports "
        "with --no-deps into a cache directory",
        allow_module_level=True,
    )

if VLLM_VERSION != "0.33.0":  # pragma: no cover - depends on the peer install
    pytest.skip(
        f"vLLM {VLLM_VERSION} is on the path; this oracle and its stand-ins are written for "
        "vLLM 0.33.0 (`make test-peers` installs it)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.peers

REL = "0.33.0"
CUDA_CAPS = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]
#: ROCm capabilities as vLLM derives them from the GCN arch (platforms/rocm.py@0.33.0
#: L236-246): gfx90a (9.0), gfx942 (9.4), gfx950 (9.5), RDNA3 (11.0), RDNA4 (12.0).
ROCM_CAPS = [(9, 0), (9, 4), (9, 5), (11, 0), (12, 0)]
SCHEMES = ["NVFP4", "NVFP4A16"]
ALL_PACKAGES = ("flashinfer", "humming", "fbgemm", "b12x")
#: What `pip install vllm==0.33.0` brings on CUDA: flashinfer-python and humming-kernels are
#: requirements of the wheel, b12x (an extra) and fbgemm-gpu-genai are not (checked against
#: vLLM's METADATA in test_default_packages_are_vllms_requirements). None = select_backend's
#: default; the stand-ins then answer for this set.
DEFAULT = ("flashinfer", "humming")
PACKAGE_SETS: dict[str, tuple[str, ...] | None] = {
    "default": None,
    "none": (),
    "flashinfer": ("flashinfer",),
    "humming": ("humming",),
    "fbgemm": ("fbgemm",),
    "b12x": ("b12x",),
    "default+fbgemm": (*DEFAULT, "fbgemm"),
    "default+b12x": (*DEFAULT, "b12x"),
    "all": ALL_PACKAGES,
}
#: Every --linear-backend value vLLM 0.33.0 accepts (the ``LinearBackend`` Literal,
#: vllm/config/kernel.py@0.33.0 L245-267), NVFP4 kernels or not.
LINEAR_BACKENDS = list(typing.get_args(KERNEL_CONFIG.LinearBackend))
#: ``_get_linear_backend(quantization=...)`` keys (kernels/linear/__init__.py@0.33.0 L1206).
QUANT_KEY = {"NVFP4": "nvfp4_w4a4", "NVFP4A16": "nvfp4_w4a16"}


def _cutlass_scaled_mm_supports_fp4(capability: int) -> bool:
    """Stands for the C++ ``cutlass_scaled_mm_supports_fp4`` (csrc, not in the wheel):
    ``capability >= 100 && CUDA runtime >= 12.8``, with a CUDA >= 12.8 runtime assumed, as
    ``select_backend`` assumes for a simulated GPU. The other public version of the rule,
    ``100 <= capability < 130``, answers the same for every capability tested here."""
    return capability >= 100


class _Machine:
    """The machine vLLM's selection asks about, set up through ``monkeypatch`` (every stand-in
    is undone after the test)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mp = monkeypatch
        # vLLM reads both variables from os.environ at every access (envs.py@0.33.0 L638,
        # L1219-1223; its cache is enabled only once an engine has started): the cases set them
        for name in (BATCH_INVARIANT_ENV, DISABLED_KERNELS_ENV):
            monkeypatch.delenv(name, raising=False)
        # nvfp4_utils.cutlass_fp4_supported() (L53-58: is_cuda(), then the capability) runs as
        # shipped and calls the C++ probe through this module-level name
        monkeypatch.setattr(NVFP4_UTILS, "cutlass_scaled_mm_supports_fp4",
                            _cutlass_scaled_mm_supports_fp4)

    def platform(self, platform: str, capability: tuple[int, int] | None) -> None:
        """``current_platform`` (one object, bound at import by every module that selects) as
        the platform ``platform`` with ``capability``. Its class is patched, so the same holds
        whether it is vLLM's CUDA, CPU or unspecified platform on the machine running this."""
        cls = type(CURRENT_PLATFORM)
        # stands for the platform class vLLM would have resolved: is_cuda(), is_rocm(),
        # is_cuda_alike() and the registry key (current_platform._enum, L1263) all read _enum
        self.mp.setattr(cls, "_enum", getattr(PLATFORMS.PlatformEnum, platform.upper()))
        answer = None if capability is None else PLATFORM_INTERFACE.DeviceCapability(*capability)
        # stands for the device query (NVML on CUDA, the GCN arch on ROCm); XPU and CPU answer
        # None as their platforms do (platforms/xpu.py@0.33.0 L318-325, interface.py L517-528)
        self.mp.setattr(cls, "get_device_capability",
                        classmethod(lambda _cls, device_id=0: answer))

    def packages(self, installed: Iterable[str]) -> None:
        """The optional-package probes, answered for the packages ``installed``."""
        have = set(installed)
        fi = "flashinfer" in have
        # vllm.utils.flashinfer.has_flashinfer (L88-106): flashinfer-python importable, with
        # flashinfer-cubin or nvcc + ninja (nvfp4lab's "flashinfer" means exactly that)
        self.mp.setattr(K_FLASHINFER, "has_flashinfer", lambda: fi)
        # has_flashinfer_bf16_fp4 / has_flashinfer_b12x_gemm (utils/flashinfer.py L512-519,
        # L614-625): FlashInfer's CuTe-DSL with gemm.mm_bf16_fp4 / the SM120 b12x dense GEMM.
        # nvfp4lab takes both to come with the FlashInfer vLLM 0.33.0 requires
        # (flashinfer-python==0.7.2.post1), so they answer as has_flashinfer does
        self.mp.setattr(K_FLASHINFER, "has_flashinfer_bf16_fp4", lambda: fi)
        self.mp.setattr(K_FLASHINFER, "has_flashinfer_b12x_gemm", lambda: fi)
        # vllm.utils.import_utils.has_humming: humming-kernels importable
        self.mp.setattr(K_HUMMING, "has_humming", lambda: "humming" in have)
        # vllm.utils.import_utils.has_fbgemm_gpu: fbgemm-gpu-genai importable
        self.mp.setattr(K_FBGEMM, "has_fbgemm_gpu", lambda: "fbgemm" in have)
        # vllm.utils.b12x.get_b12x_blockscaled / get_b12x_intrinsics (L60-65): the b12x
        # modules when `vllm[b12x]` is installed, else None; blockscaled.is_supported() is b12x's
        # own device check, taken as true (nvfp4lab: b12x installed works on sm_12x)
        blockscaled = types.SimpleNamespace(is_supported=lambda: True) if "b12x" in have else None
        intrinsics = types.SimpleNamespace() if "b12x" in have else None
        self.mp.setattr(K_B12X, "_import_b12x_blockscaled", lambda: blockscaled)
        self.mp.setattr(K_B12X, "_import_b12x_intrinsics", lambda: intrinsics)

    def environ(self, env: Mapping[str, str]) -> None:
        for name, value in env.items():
            self.mp.setenv(name, value)

    def select(
        self, use_a16: bool, linear_backend: str | None = None,
        per_quant: dict[str, str] | None = None,
    ) -> tuple[str | None, str | None]:
        """Run vLLM's ``init_nvfp4_linear_kernel``: (kernel class name, None) or (None, the
        message of the ValueError it raises). Any other exception fails the test."""
        if linear_backend is None and per_quant is None:
            # no engine config: _get_linear_backend answers "auto" (L256-261)
            assert VLLM_CONFIG.get_current_vllm_config_or_none() is None
            return _run(use_a16)
        kernel_config = KERNEL_CONFIG.KernelConfig(
            linear_backend=linear_backend or "auto", linear_backend_per_quant=per_quant)
        # stands for the VllmConfig an engine builds from --linear-backend and
        # --kernel-config (VllmConfig itself needs a device to construct); _get_linear_backend
        # reads only .kernel_config of it (L256-268). KernelConfig is vLLM's own, with its
        # validation and normalisation of the flag's value
        engine = types.SimpleNamespace(kernel_config=kernel_config)
        with VLLM_CONFIG.set_current_vllm_config(engine):
            return _run(use_a16)


def _run(use_a16: bool) -> tuple[str | None, str | None]:
    try:
        kernel = LINEAR.init_nvfp4_linear_kernel(use_a16=use_a16)
    except ValueError as err:
        return None, str(err)
    return type(kernel).__name__, None


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> _Machine:
    return _Machine(monkeypatch)


def _compare(
    machine: _Machine, *, platform: str = "cuda", cap: tuple[int, int] | None,
    scheme: str = "NVFP4", packages: tuple[str, ...] | None = None,
    env: Mapping[str, str] | None = None, linear_backend: str | None = None,
    per_quant: dict[str, str] | None = None, nvfp4lab_backend: str | None = None,
) -> tuple[str | None, str | None]:
    """Set the machine up, run vLLM and nvfp4lab, assert they agree; vLLM's answer.

    ``nvfp4lab_backend``: the --linear-backend nvfp4lab is given, when it differs from the
    engine's ``linear_backend`` (a per-quantization override)."""
    env = dict(env or {})
    machine.platform(platform, cap)
    machine.packages(
        (DEFAULT if platform == "cuda" else ()) if packages is None else packages)
    machine.environ(env)
    kernel, error = machine.select(scheme == "NVFP4A16", linear_backend, per_quant)
    choice = select_backend(
        None if cap is not None else "cpu", capability=cap, platform=platform, vllm=REL,
        scheme=scheme, packages=packages, env=env,
        linear_backend=linear_backend if nvfp4lab_backend is None else nvfp4lab_backend,
    )
    where = (f"{platform} {cap} {scheme} packages={packages} env={env} "
             f"--linear-backend={linear_backend} per_quant={per_quant}")
    assert choice.kernel == kernel, f"{where}: vLLM {kernel or error!r}"
    if kernel is None:
        assert choice.error == error, where
    return kernel, error


# ---------------------------------------------------------------------------------------------
# The flag's values and the default install
# ---------------------------------------------------------------------------------------------


def test_linear_backend_values_are_vllms() -> None:
    assert set(vllm_select.linear_backends(REL)) == set(LINEAR_BACKENDS)
    for spelling in ("Flashinfer-Cutlass", "MARLIN", "flashinfer-cutedsl", "xpu-woq", "auto"):
        ours = vllm_select.check_linear_backend(spelling, REL)
        assert ours == KERNEL_CONFIG.KernelConfig(linear_backend=spelling).linear_backend


def test_default_packages_are_vllms_requirements() -> None:
    """DEFAULT (what the stand-ins answer for ``packages=None``) is nvfp4lab's default install
    and what vLLM 0.33.0's METADATA requires; b12x comes only with the ``b12x`` extra."""
    assert vllm_rules.default_packages(REL, Platform.CUDA) == set(DEFAULT)
    plain, extras = set(), set()
    for text in importlib.metadata.requires("vllm") or ():
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            extras.add(name)
        else:
            plain.add(name)
    assert {"flashinfer-python", "humming-kernels"} <= plain
    assert "b12x" in extras
    assert not {"b12x", "fbgemm-gpu-genai", "fbgemm-gpu"} & plain


# ---------------------------------------------------------------------------------------------
# CUDA: capabilities x schemes x installed packages
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packages", list(PACKAGE_SETS))
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("cap", CUDA_CAPS)
def test_cuda(machine: _Machine, cap, scheme, packages) -> None:
    _compare(machine, cap=cap, scheme=scheme, packages=PACKAGE_SETS[packages])


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
@pytest.mark.parametrize("packages", ["default", "none", "all"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("cap", CUDA_CAPS)
def test_cuda_linear_backend(machine: _Machine, cap, scheme, packages, backend) -> None:
    _compare(machine, cap=cap, scheme=scheme, packages=PACKAGE_SETS[packages],
             linear_backend=backend)


@pytest.mark.parametrize("backend", ["cutlass", "humming", "marlin", "flashinfer_cutedsl"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("cap", [(8, 9), (9, 0), (10, 0), (12, 0)])
def test_cuda_linear_backend_per_quant(machine: _Machine, cap, scheme, backend) -> None:
    """``--kernel-config.linear_backend_per_quant`` (L262-267): the entry for the layer's own
    quantization overrides --linear-backend; an entry for the other NVFP4 scheme is ignored.
    nvfp4lab's ``linear_backend`` is the value the NVFP4 layer sees."""
    own, other = QUANT_KEY[scheme], QUANT_KEY["NVFP4A16" if scheme == "NVFP4" else "NVFP4"]
    _compare(machine, cap=cap, scheme=scheme, linear_backend="emulation",
             per_quant={own: backend}, nvfp4lab_backend=backend)
    _compare(machine, cap=cap, scheme=scheme, linear_backend=None,
             per_quant={own: backend}, nvfp4lab_backend=backend)
    _compare(machine, cap=cap, scheme=scheme, linear_backend="emulation",
             per_quant={other: backend})


@pytest.mark.parametrize("backend", [None, "auto", "cutlass", "emulation", "marlin"])
@pytest.mark.parametrize("packages", ["default", "none"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("cap", CUDA_CAPS)
def test_cuda_batch_invariant(machine: _Machine, cap, scheme, packages, backend) -> None:
    _compare(machine, cap=cap, scheme=scheme, packages=PACKAGE_SETS[packages],
             env={BATCH_INVARIANT_ENV: "1"}, linear_backend=backend)


@pytest.mark.parametrize("value", ["0", "2"])
@pytest.mark.parametrize("cap", [(9, 0), (10, 0)])
def test_cuda_batch_invariant_values(machine: _Machine, cap, value) -> None:
    _compare(machine, cap=cap, env={BATCH_INVARIANT_ENV: value})


@pytest.mark.parametrize("backend", [None, "marlin", "flashinfer_cutedsl"])
@pytest.mark.parametrize("packages", ["default", "none", "all"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("cap", CUDA_CAPS)
def test_cuda_disabled_kernels_cascade(cap, scheme, packages, backend) -> None:
    """Disable vLLM's pick, then the next one, ... until vLLM raises or picks a kernel already
    disabled (a forced path, which VLLM_DISABLED_KERNELS does not reach); every step compared."""
    disabled: list[str] = []
    for _ in range(len(LINEAR._POSSIBLE_NVFP4_KERNELS[PLATFORMS.PlatformEnum.CUDA]) + 1):
        env = {DISABLED_KERNELS_ENV: ",".join(disabled)} if disabled else {}
        with pytest.MonkeyPatch.context() as mp:
            kernel, _ = _compare(_Machine(mp), cap=cap, scheme=scheme,
                                 packages=PACKAGE_SETS[packages], env=env,
                                 linear_backend=backend)
        if kernel is None or kernel in disabled:
            return
        disabled.append(kernel)
    raise AssertionError(f"vLLM kept picking kernels after disabling {disabled}")


@pytest.mark.parametrize(
    "value",
    [
        "",  # [""]: nothing disabled
        "MarlinNvFp4LinearKernel, HummingNvFp4LinearKernel",  # no stripping: Humming stays
        " MarlinNvFp4LinearKernel",  # no stripping: Marlin stays
        "marlinnvfp4linearkernel",  # case-sensitive: Marlin stays
        "MarlinNvFp4LinearKernel,HummingNvFp4LinearKernel,EmulationNvFp4LinearKernel",
    ],
)
@pytest.mark.parametrize("cap", [(8, 0), (9, 0)])
def test_cuda_disabled_kernels_spelling(machine: _Machine, cap, value) -> None:
    _compare(machine, cap=cap, env={DISABLED_KERNELS_ENV: value})


# ---------------------------------------------------------------------------------------------
# ROCm, XPU, CPU
# ---------------------------------------------------------------------------------------------

OTHER = [("rocm", cap) for cap in ROCM_CAPS] + [("xpu", None), ("cpu", None)]


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("backend", [None, "emulation", "marlin", "xpu"])
@pytest.mark.parametrize("packages", ["default", "all"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("platform", "cap"), OTHER)
def test_other_platforms(
    machine: _Machine, platform, cap, scheme, packages, backend, batch_invariant
) -> None:
    env = {BATCH_INVARIANT_ENV: "1"} if batch_invariant else {}
    kernel, error = _compare(machine, platform=platform, cap=cap, scheme=scheme,
                             packages=PACKAGE_SETS[packages], env=env, linear_backend=backend)
    if platform != "rocm" and not batch_invariant:
        assert kernel is None and error  # XPU and CPU: no NVFP4 kernel, vLLM raises


def test_grid_reaches_every_cuda_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grid above is not vacuous: each kernel of the CUDA registry is vLLM's pick in some
    case of it (run again here, collecting vLLM's answers only)."""
    seen: set[str] = set()
    names = [k.__name__ for k in LINEAR._POSSIBLE_NVFP4_KERNELS[PLATFORMS.PlatformEnum.CUDA]]
    for cap, scheme, packages, backend in itertools.product(
        CUDA_CAPS, SCHEMES, ["default", "none", "all"], LINEAR_BACKENDS
    ):
        with pytest.MonkeyPatch.context() as mp:
            m = _Machine(mp)
            m.platform("cuda", cap)
            m.packages(PACKAGE_SETS[packages] or (DEFAULT if packages == "default" else ()))
            kernel, _ = m.select(scheme == "NVFP4A16", backend)
        if kernel is not None:
            seen.add(kernel)
    assert set(names) <= seen, sorted(set(names) - seen)


# ---------------------------------------------------------------------------------------------
# FP8_DYNAMIC layers of a mixed checkpoint (nvfp4lab/execution/dispatch_mixed.py)
# ---------------------------------------------------------------------------------------------
#
# vLLM 0.33.0's own steps for an llm-compressor FP8_DYNAMIC layer, run as shipped: the scheme
# branch ``CompressedTensorsConfig._check_scheme_supported(89, error=False)`` (W8A8 from 89 on,
# else W8A16: compressed_tensors.py@0.33.0 L896-912), then ``init_fp8_linear_kernel`` with the
# scheme's keys (dynamic per-token activations, per-channel weights) or
# ``init_wfp8_a16_linear_kernel`` with W8A16's (schemes/compressed_tensors_w8a16_fp8.py L46-49,
# L112). Stood in for, as above: the platform and capability, and the probes: the C++
# ``cutlass_scaled_mm_supports_fp8`` (capability >= 89, the CUDA 12.4+ answer), FlashInfer,
# Humming and b12x's tensor FP8 GEMM.


def _fp8_vllm(mp: pytest.MonkeyPatch, cap: tuple[int, int],
              packages: tuple[str, ...], weight_only: bool = False) -> str:
    """vLLM's FP8_DYNAMIC kernel class name on CUDA ``cap`` with ``packages``
    (``weight_only``: a group without input activations, always CompressedTensorsW8A16Fp8)."""
    ct = importlib.import_module(
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors")
    ct_utils = importlib.import_module(
        "vllm.model_executor.layers.quantization.compressed_tensors.utils")
    quant = importlib.import_module("vllm.model_executor.layers.quantization.utils.quant_utils")
    w8a8 = importlib.import_module("vllm.model_executor.layers.quantization.utils.w8a8_utils")
    scaled = "vllm.model_executor.kernels.linear.scaled_mm."
    machine = _Machine(mp)
    machine.platform("cuda", cap)
    mp.setattr(w8a8.ops, "cutlass_scaled_mm_supports_fp8", lambda c: c >= 89, raising=False)
    mp.setattr(importlib.import_module(scaled + "flashinfer"), "has_flashinfer",
               lambda: "flashinfer" in packages)
    mp.setattr(importlib.import_module(scaled + "humming"), "has_humming",
               lambda: "humming" in packages)
    tensor_fp8 = types.SimpleNamespace(is_supported=lambda: True) if "b12x" in packages else None
    mp.setattr(importlib.import_module(scaled + "b12x"), "_import_b12x_tensor_fp8",
               lambda: tensor_fp8)
    import torch

    channel = ct_utils.STRATEGY_TO_WEIGHT_QUANT_KEY[ct_utils.QuantizationStrategy.CHANNEL]
    w8a8 = not weight_only and ct.CompressedTensorsConfig._check_scheme_supported(89, error=False)
    config = LINEAR.FP8ScaledMMLinearLayerConfig(
        weight_quant_key=channel,
        activation_quant_key=quant.kFp8DynamicTokenSym if w8a8 else quant.kFp8DynamicTensorSym,
        input_dtype=torch.bfloat16, out_dtype=torch.bfloat16, weight_shape=(256, 512))
    # the chooser the init_* functions call (L810-815, L1170-1175), without their constructor
    # (QuantFP8, a CustomOp, needs an engine config): it returns the class they build
    kernel = LINEAR.choose_scaled_mm_linear_kernel(
        config, LINEAR._POSSIBLE_FP8_KERNELS if w8a8 else LINEAR._POSSIBLE_WFP8A16_KERNELS,
        quantization="fp8_w8a8" if w8a8 else "w8a16_fp8")
    return kernel.__name__


@pytest.mark.parametrize("packages", ["default", "none", "all"])
@pytest.mark.parametrize("cap", [c for c in CUDA_CAPS if c >= (7, 5)])
def test_fp8_dynamic_kernel_is_vllms(monkeypatch: pytest.MonkeyPatch, cap, packages) -> None:
    installed = DEFAULT if packages == "default" else PACKAGE_SETS[packages]
    kernel = _fp8_vllm(monkeypatch, cap, installed)
    choice = select_backend(capability=cap, scheme="FP8_DYNAMIC", vllm=REL, env={},
                            packages=PACKAGE_SETS[packages])
    assert choice.kernel == kernel, (cap, packages)
    assert choice.numerics == ("w8a8" if cap >= (8, 9) else "w8a16")
    weight_only = select_backend(capability=cap, scheme="FP8_W8A16", vllm=REL, env={},
                                 packages=PACKAGE_SETS[packages])
    assert weight_only.kernel == _fp8_vllm(monkeypatch, cap, installed, weight_only=True)
    assert weight_only.numerics == "w8a16"
