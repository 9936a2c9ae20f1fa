"""vLLM 0.33.0's kernel for the other layers of a mixed-precision checkpoint: FP8 and MXFP4.

:func:`nvfp4lab.select_backend` answers for two more ``scheme`` values (:class:`LayerScheme`),
the formats :mod:`nvfp4lab.execution.mixed` saves beside NVFP4 layers:

``FP8_DYNAMIC``
    llm-compressor's preset (ModelOpt's FP8_PER_CHANNEL_PER_TOKEN has the same numerics): e4m3
    weights with one float32 scale per output channel, activations quantized per token at run
    time. nvfp4lab runs it as :class:`~nvfp4lab.execution.mixed.FP8Linear` (W8A8).
``FP8_W8A16``
    FP8_DYNAMIC's weights with ``input_activations`` null (compressed-tensors has no preset for
    it): vLLM 0.33 runs it weight-only on every GPU from sm_75. nvfp4lab runs it as
    :class:`~nvfp4lab.execution.mixed.FP8Linear` with ``quantize_activations=False``
    (``fp8-w8a16``).
``MXFP4A16``
    compressed-tensors' weight-only MXFP4 (E2M1 codes, an E8M0 scale per 32 along K). nvfp4lab
    runs it as :class:`~nvfp4lab.execution.mixed.MXFP4Linear` (W4A16).

The rules, read from vLLM 0.33.0's source (paths under ``vllm/model_executor/``):

* FP8_DYNAMIC: ``CompressedTensorsConfig._get_scheme_from_parts``
  (layers/quantization/compressed_tensors/compressed_tensors.py@0.33.0 L878-912) takes
  ``CompressedTensorsW8A8Fp8`` where the capability is >= 89 (its ``get_min_capability``), else
  ``CompressedTensorsW8A16Fp8`` (min 75), which keeps the weights FP8 and ignores the
  activation quantization: activations stay 16-bit. A group without input activations takes
  ``CompressedTensorsW8A16Fp8`` on every capability (``_is_fp8_w8a16``, L915-920). W8A8
  chooses among
  ``_POSSIBLE_FP8_KERNELS[CUDA]`` (kernels/linear/__init__.py@0.33.0 L458-466): FlashInfer
  needs per-tensor scales (scaled_mm/flashinfer.py L56-65) and is skipped, CUTLASS
  (scaled_mm/cutlass.py L157-174) runs wherever the C++ probe ``cutlass_scaled_mm_supports_fp8``
  says yes. W8A16 chooses among ``_POSSIBLE_WFP8A16_KERNELS[CUDA]`` (L522-526): Humming
  (scaled_mm/humming.py L27-49, when humming-kernels is installed), then FP8 Marlin
  (scaled_mm/marlin.py L29-49).
* MXFP4A16: ``_get_scheme_from_parts`` (L811-812) takes ``CompressedTensorsW4A4Mxfp4()`` for any
  MXFP4 weight, with its default activation key ``kMxfp4Dynamic``
  (schemes/compressed_tensors_w4a4_mxfp4.py L39-47, min capability 80), whatever the checkpoint
  says about activations. ``init_mxfp4_linear_kernel`` (L1046-1097) walks
  ``_POSSIBLE_MXFP4_KERNELS[CUDA]`` (L625-632): FlashInfer (mxfp4/flashinfer.py L25-36:
  capability >= 100 and FlashInfer's CuTe-DSL; W4A4 only) quantizes the activations to MXFP4;
  Marlin (mxfp4/marlin.py L16-37) is weight-only and ignores the activation key; on sm_90
  ``prioritize_humming`` puts Humming (mxfp4/humming.py) ahead of Marlin. No kernel is
  registered for the CPU platform, so the load fails there.

What cannot be checked on a CPU is said in the choice's reason: the CUTLASS FP8 probe (C++,
assumed true from sm_89 on, as for vLLM 0.33.0's CUDA 12.8+ wheels), whether Humming quantizes
activations (``check_and_fallback_input_schema`` is in humming-kernels), and whether FlashInfer's
CuTe-DSL MXFP4 GEMM runs on sm_12x (vLLM selects it there: its check is ``>= 100``). Only
vLLM 0.33.0 on CUDA (and MXFP4 on the CPU platform) is modelled; other releases, ROCm, XPU,
``--linear-backend``, ``VLLM_DISABLED_KERNELS`` and ``VLLM_BATCH_INVARIANT`` are refused in one
line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum

from nvfp4lab.execution import vllm_rules
from nvfp4lab.execution.targets import BackendChoice, _Target, _target
from nvfp4lab.settings import BACKEND_ENV, BATCH_INVARIANT_ENV, DISABLED_KERNELS_ENV
from nvfp4lab.vocab import AUTO, BiasMode, Engine, Numerics, Platform, VllmPackage

__all__ = ["MIXED_RELEASE", "LayerScheme", "is_mixed_scheme", "select_mixed_backend"]

#: The one vLLM release whose FP8 / MXFP4 rules are modelled.
MIXED_RELEASE = "0.33.0"
_CT = "layers/quantization/compressed_tensors/compressed_tensors.py@0.33.0"
_KL = "kernels/linear/__init__.py@0.33.0"


class LayerScheme(StrEnum):
    """A non-NVFP4 layer scheme of a mixed checkpoint (compressed-tensors preset names)."""

    FP8_DYNAMIC = "FP8_DYNAMIC"  #: W8A8: e4m3 weights per channel, activations FP8 per token
    FP8_W8A16 = "FP8_W8A16"  #: FP8_DYNAMIC's weights, no activation quantization (no preset)
    MXFP4A16 = "MXFP4A16"  #: weight-only MXFP4: E2M1 + E8M0 per 32, 16-bit activations


#: nvfp4lab's own path for each scheme (``BackendChoice.name``) and the layer that runs it.
_NVFP4LAB = {LayerScheme.FP8_DYNAMIC: ("w8a8", "FP8Linear"),
             LayerScheme.FP8_W8A16: ("w8a16", "FP8Linear(quantize_activations=False)"),
             LayerScheme.MXFP4A16: (Numerics.W4A16.value, "MXFP4Linear")}


def is_mixed_scheme(scheme: object) -> bool:
    """Whether ``scheme`` names a :class:`LayerScheme` (exact spelling)."""
    return isinstance(scheme, str) and scheme in {s.value for s in LayerScheme}


def _check_request(scheme: str, vllm: str | None, engine: str, linear_backend: str | None,
                   rotation: object, variables: Mapping[str, str]) -> str:
    """The release (always 0.33.0), or a one-line ValueError for what is not modelled."""
    if engine != Engine.VLLM:
        raise ValueError(f"scheme={scheme!r} is modelled for engine='vllm' only; got "
                         f"engine={engine!r}: pass engine='vllm'")
    rel = vllm_rules.release(vllm)
    if rel != MIXED_RELEASE:
        raise ValueError(f"scheme={scheme!r} is modelled for vLLM 0.33.0 only; got vllm={vllm!r}:"
                         " pass vllm='0.33.0' (or leave it out)")
    for what, value in (("linear_backend", linear_backend), ("rotation", rotation)):
        if value is not None:
            raise ValueError(f"{what}={value!r} is not modelled for scheme={scheme!r}; drop it")
    for var, off in ((DISABLED_KERNELS_ENV, ("",)), (BATCH_INVARIANT_ENV, ("", "0"))):
        if variables.get(var, "").strip() not in off:
            raise ValueError(f"{var}={variables[var]!r} is not modelled for scheme={scheme!r}; "
                             f"unset it (env=) to get vLLM 0.33.0's default choice")
    return rel


def _fp8(cc: int, packages: frozenset[str], weight_only: bool = False
         ) -> tuple[str, str, list[str], str]:
    """(kernel, numerics, steps, note) of FP8_DYNAMIC (``weight_only``: FP8_W8A16) on CUDA
    capability ``cc`` (>= 75)."""
    if cc >= 89 and not weight_only:
        return ("CutlassFP8ScaledMMLinearKernel", "w8a8", [
            f"capability {cc} >= 89: CompressedTensorsW8A8Fp8 ({_CT} L878-904)",
            f"init_fp8_linear_kernel, registry _POSSIBLE_FP8_KERNELS[cuda] ({_KL} L458-466)",
            "skipped: FlashInferFP8ScaledMMLinearKernel: requires per tensor activation and "
            "weight scales (scaled_mm/flashinfer.py@0.33.0 L56-65)",
            "CutlassFP8ScaledMMLinearKernel: cutlass_fp8_supported() "
            "(scaled_mm/cutlass.py@0.33.0 L157-174)"],
            "per-token FP8 activations x per-channel FP8 weights, as nvfp4lab's FP8Linear; "
            "not checked on a CPU: the C++ probe cutlass_scaled_mm_supports_fp8 (taken as true "
            "from sm_89 on, with vLLM 0.33.0's CUDA 12.8+ build) and the CUTLASS epilogue's "
            "rounding order (FP8Linear follows the torch._scaled_mm kernel's)")
    first = (f"input_activations null: _is_fp8_w8a16, CompressedTensorsW8A16Fp8 ({_CT} "
             "L915-920; min capability 75)" if weight_only else
             f"capability {cc} < 89: CompressedTensorsW8A16Fp8 ({_CT} L905-912; min "
             "capability 75)")
    steps = [first, f"init_wfp8_a16_linear_kernel, registry _POSSIBLE_WFP8A16_KERNELS[cuda] "
             f"({_KL} L522-526)"]
    upcast = ("weight-only: activations stay 16-bit, as nvfp4lab's FP8Linear with "
              "quantize_activations=False (fp8-w8a16)" if weight_only else
              "weight-only fallback: activations stay 16-bit (NOT quantized), so vLLM's "
              "numerics differ from nvfp4lab's FP8Linear, which quantizes them per token")
    if VllmPackage.HUMMING in packages:
        steps.append("HummingFP8ScaledMMLinearKernel: humming installed, SM75+ "
                     "(scaled_mm/humming.py@0.33.0 L27-49)")
        return ("HummingFP8ScaledMMLinearKernel", "w8a16", steps,
                upcast + "; Humming is given no input quantization config (its default "
                "input schema, in humming-kernels, is not installed here: unverified)")
    steps += ["skipped: HummingFP8ScaledMMLinearKernel: Humming is not installed",
              "MarlinFP8ScaledMMLinearKernel: is_fp8_marlin_supported() (capability >= 75; "
              "scaled_mm/marlin.py@0.33.0 L29-49)"]
    return "MarlinFP8ScaledMMLinearKernel", "w8a16", steps, upcast


def _mxfp4(cc: int, packages: frozenset[str]) -> tuple[str, str, list[str], str]:
    """(kernel, numerics, steps, note) of MXFP4A16 on CUDA capability ``cc`` (>= 80)."""
    steps = [f"CompressedTensorsW4A4Mxfp4() with activation key kMxfp4Dynamic ({_CT} L811-812;"
             " schemes/compressed_tensors_w4a4_mxfp4.py@0.33.0 L39-47), whatever the checkpoint"
             " says about activations",
             f"init_mxfp4_linear_kernel, registry _POSSIBLE_MXFP4_KERNELS[cuda] "
             f"({_KL} L625-632, L1046-1097)"]
    if cc >= 100 and VllmPackage.FLASHINFER in packages:
        steps.append("FlashInferMxFp4LinearKernel: capability >= 100 and FlashInfer CuTe-DSL "
                     "(mxfp4/flashinfer.py@0.33.0 L25-36)")
        note = ("vLLM quantizes the activations of this weight-only checkpoint to MXFP4 "
                "(W4A4): its numerics differ from nvfp4lab's MXFP4Linear (W4A16)")
        if cc // 10 != 10:
            note += (f"; vLLM's check is capability >= 100, so it selects this on sm_{cc} too: "
                     "whether FlashInfer's CuTe-DSL MXFP4 GEMM runs there is not checked on a "
                     "CPU")
        return "FlashInferMxFp4LinearKernel", "w4a4", steps, note
    why = ("FlashInfer + >=sm_100 (Blackwell) required" if cc < 100
           else "FlashInfer is not installed")
    steps.append(f"skipped: FlashInferMxFp4LinearKernel: {why}")
    if cc == 90 and VllmPackage.HUMMING in packages:
        steps += ["sm_90: Humming moved ahead of Marlin (humming/priority.py@0.33.0 L26-48)",
                  "HummingMxFp4LinearKernel: humming installed, SM75+, kMxfp4Dynamic "
                  "accepted by quant_key_to_input_schema (mxfp4/humming.py@0.33.0 L28-62)"]
        return ("HummingMxFp4LinearKernel", "w4a16 or w4a4", steps,
                "Humming is asked for MXFP4 activations with fallback allowed; whether it "
                "falls back to 16-bit activations on sm_90 is decided in humming-kernels "
                "(check_and_fallback_input_schema, not installed here): unverified")
    steps.append("MarlinMxFp4LinearKernel: is_fp4_marlin_supported() (capability >= 75; "
                 "mxfp4/marlin.py@0.33.0 L16-37)")
    return ("MarlinMxFp4LinearKernel", Numerics.W4A16.value, steps,
            "weight-only: Marlin ignores the activation key (it warns so), 16-bit activations "
            "as in nvfp4lab's MXFP4Linear")


def _decide(scheme: LayerScheme, target: _Target,
            packages: frozenset[str]) -> tuple[str | None, str | None, list[str], str, str | None]:
    """(kernel, numerics, steps, note, error) for a modelled target; ValueError otherwise."""
    plat = target.platform
    if plat == Platform.CPU and scheme == LayerScheme.MXFP4A16:
        error = ("Failed to find a kernel that can implement the MXFP4 linear layer. "
                 "Reasons: \n")
        return None, None, [f"no MXFP4 kernel registered for cpu ({_KL} L625-641)"], (
            "its load fails: no MXFP4 kernel is registered for the CPU platform"), error
    if plat != Platform.CUDA or target.capability is None:
        raise ValueError(f"scheme={scheme.value!r} on platform={plat.value!r} is not modelled "
                         "(vLLM 0.33.0 on CUDA only); pass gpu='H100' or capability=(9, 0)")
    cc = target.capability[0] * 10 + target.capability[1]
    fp8 = scheme in (LayerScheme.FP8_DYNAMIC, LayerScheme.FP8_W8A16)
    low = 75 if fp8 else 80
    if cc < low:
        raise ValueError(f"scheme={scheme.value!r} on sm_{cc} is not modelled (vLLM 0.33.0 "
                         f"needs capability >= {low}); pass a GPU of sm_{low} or newer")
    if fp8:
        kernel, numerics, steps, note = _fp8(cc, packages, scheme == LayerScheme.FP8_W8A16)
    else:
        kernel, numerics, steps, note = _mxfp4(cc, packages)
    return kernel, numerics, steps, note, None


def select_mixed_backend(
    device: object, *, capability: tuple[int, int] | None, gpu: str | None,
    platform: str | None, scheme: str, vllm: str | None, packages: Iterable[str] | None,
    engine: str, linear_backend: str | None, rotation: object, variables: Mapping[str, str],
) -> BackendChoice:
    """:func:`nvfp4lab.select_backend` for a :class:`LayerScheme` (module docstring).

    ``kernel``: vLLM 0.33.0's kernel class (None where its load fails: ``error``);
    ``numerics``: "w8a8" (FP8 x FP8 per token), "w8a16" (FP8 weights, 16-bit activations),
    "w4a16", "w4a4" (MXFP4 activations) or "w4a16 or w4a4" (Humming decides); ``name``: what
    nvfp4lab runs ("w8a8" :class:`FP8Linear`, "w8a16" FP8Linear without activation
    quantization, "w4a16" :class:`MXFP4Linear`)."""
    layer = LayerScheme(scheme)
    rel = _check_request(layer.value, vllm, engine, linear_backend, rotation, variables)
    target = _target(device, capability, gpu, platform)  # type: ignore[arg-type]
    pkgs = (vllm_rules.default_packages(rel, target.platform) if packages is None
            else vllm_rules.check_packages(packages))
    kernel, numerics, steps, note, error = _decide(layer, target, frozenset(pkgs))
    name, runs = _NVFP4LAB[layer]
    era = vllm_rules.era_of(rel)
    said = (f"vLLM {rel} picks {kernel} ({numerics})" if kernel
            else f"vLLM {rel} selects no kernel")
    ignored = (f"{BACKEND_ENV} applies to NVFP4 layers only: ignored",) if variables.get(
        BACKEND_ENV, "").strip().lower() not in ("", AUTO) else ()
    reason = "; ".join([f"{target.subject}: {layer.value}", f"{said}, {note}",
                        f"nvfp4lab runs {runs} ({name})", "rules: " + " → ".join(steps),
                        *ignored])
    return BackendChoice(
        name=name, reason=reason, device=target.where, capability=target.capability,
        gpu_name=target.gpu_name, native_supported=target.native, vllm=rel,
        era=f"{era.key} {era.title}", platform=target.platform.value, scheme=layer.value,
        kernel=kernel, numerics=numerics, bias=BiasMode.OUTPUT.value if kernel else None,
        error=error, ignored=ignored, steps=tuple(steps),
    )
