"""The target of a backend choice and the answer's record: what :func:`~nvfp4lab.execution.
dispatch.select_backend` and :func:`~nvfp4lab.execution.dispatch_mixed.select_mixed_backend`
share. :class:`BackendChoice` (the answer), the device or simulated GPU resolved into a
:class:`_Target` (:func:`_target`: capability, platform, CUDA runtime, torch's FP4 support), the
GPU catalogue lookups (:func:`known_gpus`, :func:`capability_of`), native FP4's status
(:func:`native_fp4_status`) and ``NVFP4LAB_BACKEND``'s parser (:func:`parse_backend_override`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nvfp4lab import gpus
from nvfp4lab.execution import vllm_rules, vllm_transform
from nvfp4lab.settings import BACKEND_ENV
from nvfp4lab.vocab import (
    AUTO,
    Backend,
    Engine,
    Platform,
    Scheme,
    check_choice,
)

#: Blackwell FP4 needs a CUDA 12.8+ runtime.
NATIVE_MIN_CUDA: tuple[int, int] = (12, 8)


@dataclass(frozen=True)
class BackendChoice:
    """The backend nvfp4lab runs (``name``) and what vLLM would do, with the reason.

    ``name``: native | emulation | w4a16, what ``linear(..., backend="auto")`` runs.
    ``reason``: one paragraph saying why. ``device``: "cuda:0", "cpu", or "simulated" when a
    ``capability``/``gpu`` was passed. ``capability``: CUDA (major, minor) or None.
    ``gpu_name``: device or catalogue name when known. ``emulation_switch``: the value of
    ``VLLM_USE_NVFP4_CT_EMULATIONS`` as the applied release reads it (False where it is not
    read). ``forced``: ``NVFP4LAB_BACKEND`` chose ``name``. ``native_supported``: whether
    nvfp4lab's native path would run there.

    The vLLM side: ``vllm`` (the release whose rules were applied), ``era`` (its key and title),
    ``platform``, ``scheme``, ``linear_backend`` (normalised, "auto" when not given),
    ``kernel`` (vLLM's kernel class, or None: vLLM selects none and raises ``error`` at load),
    ``numerics`` (what that kernel computes), ``bias`` (the :class:`BiasMode` that reproduces its
    bias handling: "output", or "dropped" in 0.9.1's emulation), ``defect`` (a known wrong
    result of that release's path), ``ignored`` (variables set but not read, each a sentence),
    ``steps`` (the rule steps, each with its source). ``engine``: "vllm", or "llama.cpp" (then
    ``kernel``, ``numerics``, ``steps`` and ``ignored`` are llama.cpp's, ``vllm`` is "" and
    ``era`` the llama.cpp release; module docstring). ``transform``: vLLM's rotation path.
    """

    name: str
    reason: str
    device: str
    capability: tuple[int, int] | None = None
    gpu_name: str | None = None
    emulation_switch: bool = False
    forced: bool = False
    native_supported: bool = False
    vllm: str = vllm_rules.LATEST_MODELLED
    era: str = ""
    platform: str = Platform.CUDA.value
    scheme: str = Scheme.NVFP4.value
    linear_backend: str = AUTO
    kernel: str | None = None
    numerics: str | None = None
    bias: str | None = None
    error: str | None = None
    defect: str | None = None
    ignored: tuple[str, ...] = field(default=())
    steps: tuple[str, ...] = field(default=())
    engine: str = Engine.VLLM.value
    transform: vllm_transform.TransformOutcome | None = None

    @property
    def supported(self) -> bool:
        """Whether vLLM selects a kernel (False: it would raise :attr:`error` at load)."""
        return self.kernel is not None

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}"


def parse_backend_override(value: str | None) -> str:
    """Parse ``NVFP4LAB_BACKEND``: unset or empty -> "auto"; case and spaces ignored."""
    name = (value or "").strip().lower() or AUTO
    try:
        return str(check_choice(f"{BACKEND_ENV} value", name, Backend, extra=(AUTO,)))
    except ValueError as err:
        raise ValueError(f"{err} (unset = auto); got {BACKEND_ENV}={value!r}") from None


# ---------------------------------------------------------------------------------------------
# GPU catalogue
# ---------------------------------------------------------------------------------------------


def known_gpus() -> list[tuple[str, tuple[int, int]]]:
    """(name, capability) of every GPU in :data:`nvfp4lab.gpus.CATALOGUE`."""
    return [(g.name, g.capability) for g in gpus.CATALOGUE.values()]


def capability_of(gpu: str) -> tuple[int, int]:
    """CUDA capability of a catalogued GPU, forgiving about case/spacing: "h100" -> (9, 0).

    Unknown names raise :class:`nvfp4lab.gpus.UnknownGPUError` (a KeyError) listing the known.
    """
    return gpus.get(gpu).capability


def _sm(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def _gpu_name_for(capability: tuple[int, int]) -> str | None:
    names = [g.name for g in gpus.by_capability(capability)]
    return "/".join(names) if names else None


# ---------------------------------------------------------------------------------------------
# Native FP4 support
# ---------------------------------------------------------------------------------------------


def _cuda_runtime() -> tuple[int, int] | None:
    version = torch.version.cuda
    if not version:
        return None
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return None


def _torch_fp4_status() -> str | None:
    """None when torch has the FP4 pieces, else what is missing."""
    if not hasattr(torch, "float4_e2m1fn_x2"):
        return f"torch {torch.__version__} has no torch.float4_e2m1fn_x2 dtype"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    return None


def native_fp4_status(
    device: torch.device | str | None = None, *, capability: tuple[int, int] | None = None
) -> tuple[bool, str]:
    """Whether native FP4 GEMMs can run, and a sentence saying why (not).

    With ``capability`` the device is simulated: only the capability and torch's FP4 support
    are checked (not the CUDA runtime). Otherwise ``device`` (default: ``cuda:0`` when CUDA is
    available, else CPU) must be a CUDA device with capability >= 10.0 and torch built with
    CUDA >= 12.8.
    """
    missing = _torch_fp4_status()
    if capability is not None:
        cap = gpus.parse_capability(capability, "capability=")
        where = f"simulated {_sm(cap)}"
        if not gpus.has_native_fp4(cap):
            return False, f"{where} has no FP4 tensor cores (they start at sm_100)"
        if missing:
            return False, f"{where} has FP4 tensor cores but {missing}"
        return True, f"{where} has FP4 tensor cores"
    dev = _resolve_device(device)
    if dev.type != "cuda":
        return False, f"{dev} is not a CUDA device: no FP4 tensor cores"
    if not torch.cuda.is_available():
        return False, f"{dev}: CUDA is not available in this torch build/machine"
    cap = tuple(torch.cuda.get_device_capability(dev))
    name = torch.cuda.get_device_name(dev)
    where = f"{dev} is {_sm(cap)} ({name})"  # type: ignore[arg-type]
    if not gpus.has_native_fp4(cap):  # type: ignore[arg-type]
        return False, f"{where}: no FP4 tensor cores (they start at sm_100)"
    runtime = _cuda_runtime()
    if runtime is None or runtime < NATIVE_MIN_CUDA:
        return False, f"{where} but torch's CUDA runtime {torch.version.cuda} is older than 12.8"
    if missing:
        return False, f"{where} but {missing}"
    return True, f"{where}: FP4 tensor cores"


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return dev


# ---------------------------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    """The device a decision is for: where, capability, name, a subject phrase, FP4 support,
    vLLM's platform for it and whether its CUDA runtime is new enough for CUTLASS FP4."""

    where: str
    capability: tuple[int, int] | None
    gpu_name: str | None
    subject: str
    native: bool
    why: str
    platform: Platform
    cuda_ok: bool = True


def _device_platform(dev: torch.device) -> Platform:
    if dev.type == "cuda":
        return Platform.ROCM if getattr(torch.version, "hip", None) else Platform.CUDA
    return Platform.XPU if dev.type == "xpu" else Platform.CPU


def _target(
    device: torch.device | str | int | None, capability: object, gpu: str | None,
    platform: str | None,
) -> _Target:
    """A simulated GPU (``gpu`` name or ``capability``) or a real device, on ``platform``."""
    plat = None if platform is None else Platform(check_choice("platform", platform, Platform))
    gpu_name: str | None = None
    if gpu is not None:
        capability, gpu_name = capability_of(gpu), gpu
    if capability is not None:
        if plat in (Platform.CPU, Platform.XPU):
            raise ValueError(
                f"platform={plat.value!r} has no compute capability; drop capability=/gpu= or "
                "pass platform='cuda' or 'rocm'"
            )
        cap = gpus.parse_capability(capability, "capability=")
        gpu_name = gpu_name or _gpu_name_for(cap)
        native, why = native_fp4_status(capability=cap)
        subject = _sm(cap) + (f" ({gpu_name})" if gpu_name else "")
        return _Target("simulated", cap, gpu_name, subject, native, why, plat or Platform.CUDA)
    dev = _resolve_device(device)
    native, why = native_fp4_status(dev)
    own = _device_platform(dev)
    if plat == Platform.CUDA and own != Platform.CUDA:
        raise ValueError(
            f"platform='cuda' needs a compute capability but {dev} has none; pass "
            "capability=(major, minor) or gpu='H100', or platform='cpu'"
        )
    if dev.type == "cuda" and torch.cuda.is_available():
        cap = tuple(torch.cuda.get_device_capability(dev))
        name = torch.cuda.get_device_name(dev)
        runtime = _cuda_runtime()
        ok = runtime is not None and runtime >= NATIVE_MIN_CUDA
        return _Target(str(dev), cap, name, f"{dev} is {_sm(cap)} ({name})", native, why,  # type: ignore[arg-type]
                       plat or own, ok)
    if plat is not None and plat != own:  # e.g. an XPU modelled on this CPU: name the platform
        why = f"{plat.value} is not a CUDA device: no FP4 tensor cores"
        return _Target(str(dev), None, None, f"{plat.value} (modelled on {dev})", native, why,
                       plat)
    return _Target(str(dev), None, None, str(dev), native, why, plat or own)
