"""Backend selection for NVFP4 linear layers: which path runs, and why.

Three execution paths exist (see :mod:`nvfp4lab.execution.gemm`):

``native``
    FP4 tensor cores through ``torch._scaled_mm`` (CUDA capability >= 10.0, CUDA runtime
    >= 12.8, torch exposing ``float4_e2m1fn_x2``).
``emulation``
    W4A4 emulated: activations fake-quantized, weights dequantized, a 16-bit GEMM.
``w4a16``
    weight-only: weights dequantized, activations untouched (the numerics of vLLM's Marlin
    fallback on GPUs without FP4 tensor cores).

Rules of :func:`select_backend`, in order (mirroring vLLM's choice, PR #19879):

1. ``NVFP4LAB_BACKEND`` in {auto, native, emulation, w4a16} forces a backend unless ``auto``.
2. ``VLLM_USE_NVFP4_CT_EMULATIONS`` truthy -> ``emulation``, even where native FP4 exists.
3. native FP4 supported -> ``native``.
4. otherwise -> ``w4a16``.

When the environment is read: at every call of :func:`select_backend` (nothing is cached),
through :func:`nvfp4lab.settings.environ`, the one place nvfp4lab reads ``os.environ``.
``linear(..., backend="auto")`` calls it once per call, and an ``NVFP4Linear`` built with
``backend="auto"`` resolves its backend at every forward; build the layer with a concrete backend
to pin it. Pass ``env=`` (any mapping) to decide from that mapping instead of ``os.environ``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nvfp4lab import gpus, settings
from nvfp4lab.settings import BACKEND_ENV, EMULATION_ENV
from nvfp4lab.vocab import AUTO, Backend, check_choice

__all__ = [
    "BACKEND_ENV",
    "EMULATION_ENV",
    "NATIVE_MIN_CUDA",
    "BackendChoice",
    "capability_of",
    "decision_table",
    "info_report",
    "known_gpus",
    "native_fp4_status",
    "parse_backend_override",
    "parse_emulation_switch",
    "select_backend",
]

#: Blackwell FP4 needs a CUDA 12.8+ runtime.
NATIVE_MIN_CUDA: tuple[int, int] = (12, 8)


@dataclass(frozen=True)
class BackendChoice:
    """The backend chosen for a device, with the human-readable reason.

    ``device``: the device the decision is for ("cuda:0", "cpu"), or "simulated" when a
    ``capability`` was passed. ``capability``: CUDA (major, minor) or None (CPU).
    ``gpu_name``: device or catalogue name when known. ``emulation_switch``: the parsed value of
    ``VLLM_USE_NVFP4_CT_EMULATIONS``. ``forced``: ``NVFP4LAB_BACKEND`` chose the backend.
    ``native_supported``: whether native FP4 would run there.
    """

    name: str
    reason: str
    device: str
    capability: tuple[int, int] | None = None
    gpu_name: str | None = None
    emulation_switch: bool = False
    forced: bool = False
    native_supported: bool = False

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}"


# ---------------------------------------------------------------------------------------------
# Environment parsing
# ---------------------------------------------------------------------------------------------


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
    """The device a decision is for: where, capability, name, a subject phrase, FP4 support."""

    where: str
    capability: tuple[int, int] | None
    gpu_name: str | None
    subject: str
    native: bool
    why: str


def _target(
    device: torch.device | str | int | None, capability: object, gpu: str | None
) -> _Target:
    """A simulated GPU (``gpu`` name or ``capability``) or a real device."""
    gpu_name: str | None = None
    if gpu is not None:
        capability, gpu_name = capability_of(gpu), gpu
    if capability is not None:
        cap = gpus.parse_capability(capability, "capability=")
        gpu_name = gpu_name or _gpu_name_for(cap)
        native, why = native_fp4_status(capability=cap)
        subject = _sm(cap) + (f" ({gpu_name})" if gpu_name else "")
        return _Target("simulated", cap, gpu_name, subject, native, why)
    dev = _resolve_device(device)
    native, why = native_fp4_status(dev)
    if dev.type == "cuda" and torch.cuda.is_available():
        cap = tuple(torch.cuda.get_device_capability(dev))
        name = torch.cuda.get_device_name(dev)
        return _Target(str(dev), cap, name, f"{dev} is {_sm(cap)} ({name})", native, why)  # type: ignore[arg-type]
    return _Target(str(dev), None, None, str(dev), native, why)


def _decide(target: _Target, override: str, switch: bool) -> tuple[str, str]:
    """(backend, reason) by the rules of the module docstring."""
    if override != AUTO:
        note = ""
        if override == Backend.NATIVE and not target.native:
            note = f" — but {target.why}, so native GEMMs will raise"
        switch_text = f"{EMULATION_ENV}={'on' if switch else 'off'}"
        forced = f"{BACKEND_ENV}={override} forces it ({target.subject}; {switch_text}){note}"
        return override, forced
    if switch:
        hw = "even though it has FP4 tensor cores" if target.native else "which has no native FP4"
        return Backend.EMULATION, (
            f"{target.subject}: {EMULATION_ENV} is on → W4A4 emulation (fake-quantized "
            f"activations, dequantized weights, 16-bit GEMM), {hw}, as vLLM does"
        )
    if target.native:
        return Backend.NATIVE, (
            f"{target.why}; {EMULATION_ENV} unset/0 → native FP4 GEMM (torch._scaled_mm)"
        )
    marlin = ""
    if target.capability is not None and target.capability < (7, 5):
        marlin = " (vLLM's Marlin kernel itself needs sm_75+; nvfp4lab's w4a16 runs anywhere)"
    return Backend.W4A16, (
        f"{target.why}; {EMULATION_ENV} unset/0 → w4a16 weight-only, as vLLM's Marlin "
        f"fallback{marlin}"
    )


def select_backend(
    device: torch.device | str | int | None = None,
    *,
    capability: tuple[int, int] | None = None,
    env: Mapping[str, str] | None = None,
    gpu: str | None = None,
) -> BackendChoice:
    """Choose the NVFP4 linear backend for ``device`` and say why (rules in the module docs).

    ``device``: default ``cuda:0`` when CUDA is available, else CPU. ``capability=(major,
    minor)`` simulates a GPU without having it (the device is then ignored); ``gpu`` names a
    catalogue GPU instead ("H100", "B200"). ``env`` replaces ``os.environ`` for the decision.
    Raises ValueError for bad values of the two environment variables. Forcing ``native`` on a
    device without FP4 is reported here (``native_supported=False``); ``linear()`` then raises.
    """
    variables = settings.environ(env)
    override = parse_backend_override(variables.get(BACKEND_ENV))
    switch = parse_emulation_switch(variables.get(EMULATION_ENV))
    target = _target(device, capability, gpu)
    name, reason = _decide(target, override, switch)
    return BackendChoice(
        name=str(name),
        reason=reason,
        device=target.where,
        capability=target.capability,
        gpu_name=target.gpu_name,
        emulation_switch=switch,
        forced=override != AUTO,
        native_supported=target.native,
    )


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------


def decision_table(env: Mapping[str, str] | None = None) -> list[dict[str, object]]:
    """For every catalogue GPU: the backend with the emulation switch off and on.

    ``NVFP4LAB_BACKEND`` is taken from ``env`` (or ``os.environ``); the switch is set to "0" and
    "1" in turn. Rows: ``{"gpu", "capability", "native_fp4", "switch_off", "switch_on"}``.
    """
    base = dict(settings.environ(env))
    rows: list[dict[str, object]] = []
    for name, cap in known_gpus():
        off = select_backend(capability=cap, env={**base, EMULATION_ENV: "0"})
        on = select_backend(capability=cap, env={**base, EMULATION_ENV: "1"})
        rows.append(
            {
                "gpu": name,
                "capability": f"{cap[0]}.{cap[1]}",
                "native_fp4": off.native_supported,
                "switch_off": off.name,
                "switch_on": on.name,
            }
        )
    return rows


def info_report(
    env: Mapping[str, str] | None = None, device: torch.device | str | int | None = None
) -> str:
    """Text for ``nvfp4lab info``: torch/CUDA, devices, the two variables, the backend selected
    for ``device`` (default: cuda:0 if available, else CPU) with its reason, and the decision
    for every catalogue GPU with the emulation switch off and on. Never raises for bad
    environment values: the error is part of the text."""
    variables = settings.environ(env)
    lines = [
        f"torch {torch.__version__}  (CUDA runtime: {torch.version.cuda or 'none (CPU build)'}, "
        f"float4_e2m1fn_x2: {'yes' if hasattr(torch, 'float4_e2m1fn_x2') else 'no'}, "
        f"_scaled_mm: {'yes' if hasattr(torch, '_scaled_mm') else 'no'})",
        "devices:",
        "  cpu",
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = tuple(torch.cuda.get_device_capability(i))
            lines.append(
                f"  cuda:{i}  {torch.cuda.get_device_name(i)}  capability {cap[0]}.{cap[1]} "
                f"({_sm(cap)})"  # type: ignore[arg-type]
            )
    else:
        lines.append("  (no CUDA device)")
    lines.append("environment:")
    for var in (BACKEND_ENV, EMULATION_ENV):
        value = variables.get(var)
        lines.append(f"  {var}={value!r}" if value is not None else f"  {var} (unset)")
    try:
        choice = select_backend(device, env=variables)
    except ValueError as err:
        lines.append(f"selected backend: ERROR: {err}")
        return "\n".join(lines)
    lines.append(f"selected backend for {choice.device}: {choice.name}")
    lines.append(f"  reason: {choice.reason}")
    lines.append("")
    lines.append("decision per known GPU (VLLM_USE_NVFP4_CT_EMULATIONS off / on):")
    rows = decision_table(variables)
    width = max(len(str(r["gpu"])) for r in rows)
    lines.append(f"  {'GPU':<{width}}  cc    FP4  off        on")
    for r in rows:
        fp4 = "yes" if r["native_fp4"] else "no"
        lines.append(
            f"  {r['gpu']!s:<{width}}  {r['capability']!s:<4}  {fp4:<3}  "
            f"{r['switch_off']!s:<9}  {r['switch_on']}"
        )
    return "\n".join(lines)
