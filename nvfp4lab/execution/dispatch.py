"""Backend selection for NVFP4 linear layers: what vLLM would run, what nvfp4lab runs, and why.

nvfp4lab runs its own numerics on three paths (:mod:`nvfp4lab.execution.gemm`):

``native``
    FP4 tensor cores through ``torch._scaled_mm`` (CUDA capability >= 10.0, CUDA runtime
    >= 12.8, torch exposing ``float4_e2m1fn_x2``).
``emulation``
    W4A4 emulated: activations fake-quantized, weights dequantized, a 16-bit GEMM.
``w4a16``
    weight-only: weights dequantized, activations untouched (the numerics of vLLM's Marlin).

:func:`select_backend` answers two questions at once:

1. **What would vLLM do?** The rules of one vLLM release (``vllm="0.33.0"``, any release from
   0.9.1 to 0.33.0, ``"seed"`` = the rules PR #19879 merged, first released in 0.9.2, or
   ``"latest"`` = 0.33.0, the default) on a platform (cuda, rocm, xpu, cpu) for a checkpoint
   scheme (NVFP4 or NVFP4A16), with vLLM's environment variables, ``--linear-backend`` and the
   optional packages installed. The answer is ``choice.kernel`` (the vLLM kernel class, e.g.
   ``MarlinNvFp4LinearKernel``) with its ``numerics`` class and ``bias`` handling, or
   ``kernel=None`` with ``error`` holding the load error vLLM would raise. The rules, era by
   era, with their sources: :mod:`nvfp4lab.execution.vllm_select` and
   :mod:`nvfp4lab.execution.vllm_rules`.
2. **What does nvfp4lab run?** ``choice.name``, always one of the three paths above, so that
   ``linear(..., backend="auto")`` runs everywhere (on this CPU as before: w4a16). It is the
   numerics class of vLLM's kernel when nvfp4lab can run it on the target; otherwise a
   stand-in, said in the reason: ``emulation`` when emulation was asked for in a way the release
   honours (its switch, ``--linear-backend emulation``, ``VLLM_BATCH_INVARIANT``), else
   ``w4a16``. That covers "vLLM has no kernel here" (e.g. 0.33.0 on a CPU or XPU), a native
   kernel where nvfp4lab's native path cannot run (no FP4 in torch, CUDA runtime < 12.8) and
   Humming's W4A8 (nvfp4lab has no FP8-activation path). Both answers are in every choice:
   nvfp4lab never pretends a kernel exists, and never fails for lack of one.

**llama.cpp** (``engine="llama.cpp"``): the path llama.cpp (as llama-cpp-python 0.3.36 vendors it)
takes on the device instead of vLLM's kernel: CPU NVFP4xQ8_0, CUDA MMQ with Q8_1 activations,
or the Blackwell FP4 MMA on sm_120/121 (:mod:`nvfp4lab.execution.llama_cpp_rules`, with
``GGML_CUDA_MMQ_PREC``). ``kernel`` / ``numerics`` / ``steps`` then describe llama.cpp's path and
``name`` is ``q8_0`` (llama.cpp's CPU arithmetic, bit for bit; also the stand-in for Q8_1, the
same class rounded another way) or, for the FP4 MMA, ``native`` where nvfp4lab can run it and
``emulation`` elsewhere. ``vllm`` is "" and ``era`` names the llama.cpp release.

``NVFP4LAB_BACKEND`` in {auto, native, emulation, w4a16, q8_0} overrides ``name`` whatever the rules
say (the vLLM answer is still reported). Under rules that no longer read a variable (e.g.
``VLLM_USE_NVFP4_CT_EMULATIONS`` from 0.24.0 on) setting it changes nothing and the reason says
since when it is ignored and what replaced it.

When the environment is read: at every call of :func:`select_backend` (nothing is cached),
through :func:`nvfp4lab.settings.environ`, the one place nvfp4lab reads ``os.environ``.
``linear(..., backend="auto")`` calls it once per call, and an ``NVFP4Linear`` built with
``backend="auto"`` resolves its backend at every forward; build the layer with a concrete backend
to pin it. Pass ``env=`` (any mapping) to decide from that mapping instead of ``os.environ``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from nvfp4lab import settings
from nvfp4lab.execution import llama_cpp_rules, vllm_rules, vllm_select, vllm_transform
from nvfp4lab.execution.vllm_rules import parse_emulation_switch
from nvfp4lab.settings import BACKEND_ENV, EMULATION_ENV, VLLM_ENV_VARS
from nvfp4lab.vocab import (
    AUTO,
    Backend,
    BiasMode,
    Engine,
    Numerics,
    Platform,
    Scheme,
    check_choice,
)

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

from nvfp4lab.execution import dispatch_mixed
from nvfp4lab.execution.targets import (  # noqa: F401  (re-exported)
    NATIVE_MIN_CUDA,
    BackendChoice,
    _cuda_runtime,
    _device_platform,
    _gpu_name_for,
    _resolve_device,
    _sm,
    _Target,
    _target,
    _torch_fp4_status,
    capability_of,
    known_gpus,
    native_fp4_status,
    parse_backend_override,
)


def _stand_in(outcome: vllm_select.Outcome, target: _Target) -> tuple[str, str]:
    """(nvfp4lab backend, note) for a vLLM outcome: the kernel's numerics where nvfp4lab can run
    them on the target, else the stand-in described in the module docstring."""
    fallback = Backend.EMULATION if outcome.emulation_asked else Backend.W4A16
    numerics = outcome.numerics
    if numerics is None:
        return fallback, f"nvfp4lab runs {fallback} in its place"
    if numerics == Numerics.W4A8:
        return Backend.W4A16, (
            "W4A8 (per-token FP8 activations) has no nvfp4lab path: nvfp4lab runs w4a16, the "
            "nearest")
    if numerics == Numerics.NATIVE and not target.native:
        return fallback, f"but {target.why}: nvfp4lab runs {fallback} instead"
    return str(numerics), ""


def _reason(target: _Target, outcome: vllm_select.Outcome, rel: str, era: str,
            ignored: tuple[str, ...], note: str, override: str) -> str:
    """The choice's one-paragraph explanation."""
    if outcome.kernel is not None:
        said = f"vLLM {rel} ({era}) picks {outcome.kernel} ({outcome.numerics})"
    else:
        said = (f"vLLM {rel} ({era}) selects no kernel; its load fails: "
                f"{vllm_select.no_kernel_text(outcome.error or '', target.platform)}")
    # the status names the device itself when it has no CUDA ("cuda:0: CUDA is not available")
    head = target.why if target.why.startswith(target.subject) else (
        f"{target.subject}: {target.why}")
    parts = [head, said + (f", {note}" if note else "")]
    if outcome.steps:
        parts.append("rules: " + " → ".join(outcome.steps))
    if outcome.bias == BiasMode.DROPPED:
        parts.append("this path DROPS the bias")
    if outcome.defect and outcome.defect != "bias dropped":
        parts.append(f"known defect: {outcome.defect}")
    parts.extend(ignored)
    if override != AUTO:
        warn = f" — but {target.why}, so native GEMMs will raise" if (
            override == Backend.NATIVE and not target.native) else ""
        parts.insert(0, f"{BACKEND_ENV}={override} forces it{warn}")
    return "; ".join(parts)


def _llama_cpp_stand_in(path: llama_cpp_rules.LlamaCppPath, target: _Target) -> tuple[str, str]:
    """(nvfp4lab backend, note) for llama.cpp's path on the target."""
    if path.numerics == Numerics.Q8_0:
        return Backend.Q8_0, ""
    if path.numerics == Numerics.Q8_1:
        return Backend.Q8_0, (
            "nvfp4lab runs q8_0 in its place: the same class (int8 per 32 activations, integer "
            "dot products) with the CPU's rounding and float order")
    name = Backend.NATIVE if target.native else Backend.EMULATION
    return name, (
        f"nvfp4lab runs {name} in its place: FP4 activations, but with one per-tensor scale and "
        "amax block scales" + ("" if target.native else f" ({target.why})"))


def _llama_cpp_choice(
    target: _Target, variables: Mapping[str, str], override: str, scheme: str
) -> BackendChoice:
    """:func:`select_backend` for ``engine="llama.cpp"``."""
    outcome = llama_cpp_rules.select(target.platform, target.capability, variables)
    path = outcome.path
    name, note = _llama_cpp_stand_in(path, target)
    parts = [
        f"{target.subject}: {llama_cpp_rules.RELEASE} takes {path.title}: "
        f"{path.kernel} ({path.numerics})" + (f", {note}" if note else ""),
        f"activations: {path.activations}",
        "rules: " + " → ".join(outcome.steps),
        *outcome.ignored,
    ]
    if override != AUTO:
        name = override
        parts.insert(0, f"{BACKEND_ENV}={override} forces it")
    return BackendChoice(
        name=str(name),
        reason="; ".join(parts),
        device=target.where,
        capability=target.capability,
        gpu_name=target.gpu_name,
        forced=override != AUTO,
        native_supported=target.native,
        vllm="",
        era=llama_cpp_rules.RELEASE,
        platform=target.platform.value,
        scheme=Scheme(check_choice("scheme", scheme, Scheme)).value,
        kernel=path.kernel,
        numerics=str(path.numerics),
        bias=BiasMode.OUTPUT.value,
        ignored=outcome.ignored,
        steps=outcome.steps,
        engine=Engine.LLAMA_CPP.value,
    )


def select_backend(
    device: torch.device | str | int | None = None,
    *,
    capability: tuple[int, int] | None = None,
    env: Mapping[str, str] | None = None,
    gpu: str | None = None,
    vllm: str | None = None,
    platform: str | None = None,
    linear_backend: str | None = None,
    scheme: str = Scheme.NVFP4,
    packages: Iterable[str] | None = None,
    engine: str = Engine.VLLM,
    rotation: object = None,
) -> BackendChoice:
    """Choose the NVFP4 linear backend and say what vLLM (or llama.cpp) would do (see the module
    docstring).

    ``device``: default ``cuda:0`` when CUDA is available, else CPU. ``capability=(major,
    minor)`` simulates a GPU (the device is then ignored); ``gpu`` names a catalogue GPU instead
    ("H100", "B200"). ``env`` replaces ``os.environ``. ``vllm``: a release "0.9.1".."0.33.0",
    "seed" or "latest" (None = latest). ``platform``: cuda | rocm | xpu | cpu; None = cuda for a
    simulated GPU or CUDA device, the device's own platform otherwise. ``linear_backend``:
    vLLM's ``--linear-backend`` (0.22.0+; None = not given). ``scheme``: "NVFP4" (W4A4) or
    "NVFP4A16" (weight-only); "FP8_DYNAMIC" / "MXFP4A16" (vLLM 0.33.0 only:
    :mod:`~nvfp4lab.execution.dispatch_mixed`). ``packages``: the optional packages installed
    (flashinfer, humming, b12x, fbgemm); None = what ``pip install vllm`` of that release brings.
    ``engine``: "vllm" (default) or "llama.cpp" (llama.cpp's path on the device; ``vllm``,
    ``linear_backend`` and ``packages`` are vLLM's and must stay None; llama.cpp quantizes
    activations whatever the ``scheme``). ``rotation`` ("input:hadamard-16"): ``transform``.
    Raises ValueError for values vLLM itself rejects (a bad variable the release reads, an
    unknown ``--linear-backend``) and for a bad ``NVFP4LAB_BACKEND``.
    """
    variables = settings.environ(env)
    if dispatch_mixed.is_mixed_scheme(scheme):  # FP8 / MXFP4 layers of a mixed checkpoint
        return dispatch_mixed.select_mixed_backend(
            device, capability=capability, gpu=gpu, platform=platform, scheme=scheme, vllm=vllm,
            packages=packages, engine=engine, linear_backend=linear_backend, rotation=rotation,
            variables=variables)
    override = parse_backend_override(variables.get(BACKEND_ENV))
    if check_choice("engine", engine, Engine) == Engine.LLAMA_CPP:
        given = [k for k, v in (("vllm", vllm), ("linear_backend", linear_backend),
                                ("packages", packages), ("rotation", rotation)) if v is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} vLLM's; "
                "engine='llama.cpp' takes none of them: drop them or pass engine='vllm'")
        return _llama_cpp_choice(_target(device, capability, gpu, platform), variables,
                                 override, scheme)
    rel = vllm_rules.release(vllm)
    era = vllm_rules.era_of(rel)
    target = _target(device, capability, gpu, platform)
    plat = target.platform
    cc = None if target.capability is None or plat in (Platform.CPU, Platform.XPU) else (
        target.capability[0] * 10 + target.capability[1])
    req = vllm_select.Request(
        rel=rel, platform=plat, cc=cc,
        scheme=Scheme(check_choice("scheme", scheme, Scheme)),
        env={k: variables[k] for k in VLLM_ENV_VARS if k in variables},
        linear_backend=linear_backend,
        packages=vllm_rules.default_packages(rel, plat) if packages is None
        else vllm_rules.check_packages(packages),
        cuda_ok=target.cuda_ok,
    )
    outcome = vllm_select.decide(req)
    ignored = vllm_select.ignored_variables(req)
    name, note = _stand_in(outcome, target)
    if override != AUTO:
        name = override
    reads_switch = not any(s.startswith(EMULATION_ENV) for s in ignored) and (
        vllm_rules.VARIABLES[EMULATION_ENV].read_by(rel))
    return vllm_transform.attach(BackendChoice(
        name=str(name),
        reason=_reason(target, outcome, rel, f"{era.key} {era.title}", ignored, note, override),
        device=target.where,
        capability=target.capability,
        gpu_name=target.gpu_name,
        emulation_switch=reads_switch and parse_emulation_switch(variables.get(EMULATION_ENV)),
        forced=override != AUTO,
        native_supported=target.native,
        vllm=rel,
        era=f"{era.key} {era.title}",
        platform=plat.value,
        scheme=req.scheme.value,
        linear_backend=vllm_select.check_linear_backend(linear_backend, rel),
        kernel=outcome.kernel,
        numerics=None if outcome.numerics is None else str(outcome.numerics),
        bias=None if outcome.bias is None else str(outcome.bias),
        error=outcome.error,
        defect=outcome.defect,
        ignored=ignored,
        steps=outcome.steps,
    ), req, outcome, rotation)


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------


def decision_table(
    env: Mapping[str, str] | None = None, *, vllm: str | None = None
) -> list[dict[str, object]]:
    """For every catalogue GPU: the backend with the emulation switch off and on, under the rules
    of ``vllm`` (default latest). ``NVFP4LAB_BACKEND`` and the other variables come from ``env``
    (or ``os.environ``); the switch is set to "0" and "1" in turn. Rows: ``{"gpu",
    "capability", "native_fp4", "switch_off", "switch_on", "kernel_off", "kernel_on",
    "vllm"}`` (a kernel is None where vLLM selects none)."""
    base = dict(settings.environ(env))
    rows: list[dict[str, object]] = []
    for name, cap in known_gpus():
        off = select_backend(capability=cap, env={**base, EMULATION_ENV: "0"}, vllm=vllm)
        on = select_backend(capability=cap, env={**base, EMULATION_ENV: "1"}, vllm=vllm)
        rows.append(
            {
                "gpu": name,
                "capability": f"{cap[0]}.{cap[1]}",
                "native_fp4": off.native_supported,
                "switch_off": off.name,
                "switch_on": on.name,
                "kernel_off": off.kernel,
                "kernel_on": on.kernel,
                "vllm": off.vllm,
            }
        )
    return rows


def _env_lines(variables: Mapping[str, str]) -> list[str]:
    lines = ["environment:"]
    for var in (BACKEND_ENV, *VLLM_ENV_VARS):
        value = variables.get(var)
        lines.append(f"  {var}={value!r}" if value is not None else f"  {var} (unset)")
    return lines


def info_report(
    env: Mapping[str, str] | None = None,
    device: torch.device | str | int | None = None,
    *,
    vllm: str | None = None,
) -> str:
    """Text for ``nvfp4lab info``: torch/CUDA, devices, the variables, the vLLM rules applied
    (release and era), the backend selected for ``device`` (default: cuda:0 if available, else
    CPU) with vLLM's kernel and the reason, and the decision for every catalogue GPU with the
    emulation switch off and on. Never raises for bad environment values: the error is part of
    the text."""
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
    lines.extend(_env_lines(variables))
    try:
        rel = vllm_rules.release(vllm)
        era = vllm_rules.era_of(rel)
        lines.append(f"vLLM rules applied: {rel} ({era.key} {era.title}: {era.rule})")
        choice = select_backend(device, env=variables, vllm=vllm)
        rows = decision_table(variables, vllm=vllm)
    except ValueError as err:
        lines.append(f"selected backend: ERROR: {err}")
        return "\n".join(lines)
    lines.append(f"selected backend for {choice.device}: {choice.name}")
    lines.append(f"  vLLM {choice.vllm} on {choice.platform}: "
                 f"{choice.kernel or 'no kernel (' + (choice.error or '').strip() + ')'}")
    lines.append(f"  reason: {choice.reason}")
    lines.append("")
    lines.append(f"decision per known GPU under vLLM {rel} ({EMULATION_ENV} off / on):")
    width = max(len(str(r["gpu"])) for r in rows)
    lines.append(f"  {'GPU':<{width}}  cc    FP4  off        on         vLLM kernel (off)")
    for r in rows:
        fp4 = "yes" if r["native_fp4"] else "no"
        lines.append(
            f"  {r['gpu']!s:<{width}}  {r['capability']!s:<4}  {fp4:<3}  "
            f"{r['switch_off']!s:<9}  {r['switch_on']!s:<9}  {r['kernel_off'] or 'none'}"
        )
    return "\n".join(lines)
