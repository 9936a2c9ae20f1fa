"""What a vLLM release does with an online rotation of an NVFP4 layer: :func:`decide_transform`.

A compressed-tensors checkpoint with a ``transform_config`` whose ``input`` transform (type
"hadamard" / "random-hadamard", ``head_dim`` = the block ``b``) rotates a linear layer's
activations online: ``x -> x · blockdiag(H, ..., H)`` with ``H`` the ``b x b`` matrix divided by
``sqrt(b)``, the weights stored already rotated. vLLM runs it on one of two paths (facts and
sources: :data:`nvfp4lab.execution.vllm_rules.TRANSFORM_ERAS`):

``qutlass``
    QuTLASS's ``fusedQuantizeNv`` rotates and quantizes in one kernel (bf16 operands, fp32
    accumulation, block scales ``E4M3(amax)``, a global scale of 6.0: the checkpoint's
    ``input_global_scale`` is NOT used), then ``flashinfer_scaled_fp4_mm`` with ``alpha =
    (1/weight_global_scale)/6``. From 0.27.0 on (read from the wheel for 0.33.0), on compute
    capability >= 10.0, for ``b`` in 16/32/64/128, when the release's NVFP4 kernel is a
    FlashInfer one.
``generic``
    ``HadamardTransform`` rotates ``x`` in the model dtype (vLLM's ``hadacore_transform`` for
    type "hadamard", a dense GEMM with the loaded matrix otherwise), then the NVFP4 kernel the
    release would pick anyway (:mod:`nvfp4lab.execution.vllm_select`) with the static
    ``input_global_scale``.

Both paths assert ``bias is None`` (a biased layer fails at its first forward) and refuse tensor
parallelism. The arithmetic of both is :mod:`nvfp4lab.execution.rotated_gemm`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TypeVar

from nvfp4lab.execution import vllm_rules as R
from nvfp4lab.execution import vllm_select
from nvfp4lab.vocab import Numerics, Platform, Scheme

__all__ = [
    "PATH_GENERIC",
    "PATH_QUTLASS",
    "ROTATION_KINDS",
    "RotationSpec",
    "TransformOutcome",
    "attach",
    "decide_transform",
    "rotation_spec",
]

_C = TypeVar("_C")
PATH_QUTLASS, PATH_GENERIC = "qutlass", "generic"
#: compressed-tensors' transform types vLLM's paths run (``TransformScheme.type``).
ROTATION_KINDS: tuple[str, ...] = ("hadamard", "random-hadamard")
_SPEC = re.compile(r"^(?:(?P<loc>[a-z_]+):)?(?P<kind>[a-z-]+?)(?:-(?P<block>\d+))?$")
_EXAMPLE = "rotation='input:hadamard-16' (or 'input:random-hadamard-128', 'input:hadamard')"


@dataclass(frozen=True)
class RotationSpec:
    """An online ``input`` transform of a linear layer: ``kind`` ("hadamard" | "random-hadamard",
    compressed-tensors' ``TransformScheme.type``) and ``block`` (its ``head_dim``: the size of
    the block-diagonal matrix's blocks; None = one rotation of all of K)."""

    kind: str = "hadamard"
    block: int | None = 16

    def __post_init__(self) -> None:
        if self.kind not in ROTATION_KINDS:
            raise ValueError(f"rotation kind {self.kind!r} is not one vLLM runs; use one of "
                             f"{ROTATION_KINDS}, e.g. {_EXAMPLE}")
        b = self.block
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 2
                              or b & (b - 1)):
            raise ValueError(f"rotation block {b!r} must be a power of two >= 2 (the transform's "
                             f"head_dim) or None for all of K, e.g. {_EXAMPLE}")

    def __str__(self) -> str:
        return f"input:{self.kind}" + ("" if self.block is None else f"-{self.block}")


def rotation_spec(rotation: object) -> RotationSpec:
    """``rotation`` as a :class:`RotationSpec`: one already, a string ``"[input:]<kind>[-<b>]"``,
    or any object with ``kind`` and ``size`` (a :class:`nvfp4lab.hadamard.BlockRotation`).
    Raises ValueError (TypeError for another type) naming the value and the accepted forms."""
    if isinstance(rotation, RotationSpec):
        return rotation
    if isinstance(rotation, str):
        m = _SPEC.match(rotation.strip().lower())
        if m is None:
            raise ValueError(f"rotation={rotation!r} is not '[input:]<kind>[-<block>]'; pass "
                             f"{_EXAMPLE}")
        loc = m["loc"] or "input"
        if loc != "input":
            raise ValueError(
                f"rotation={rotation!r}: only an online 'input' transform reaches the linear "
                f"kernel ({loc!r} is applied offline to the stored weights, or elsewhere); pass "
                f"{_EXAMPLE}")
        return RotationSpec(m["kind"], None if m["block"] is None else int(m["block"]))
    kind, size = getattr(rotation, "kind", None), getattr(rotation, "size", None)
    if isinstance(kind, str) and isinstance(size, int):
        return RotationSpec(kind, size)
    raise TypeError(f"rotation must be a RotationSpec, a string such as 'input:hadamard-16' or a "
                    f"BlockRotation, got {type(rotation).__name__}")


@dataclass(frozen=True)
class TransformOutcome:
    """vLLM's path for a rotated NVFP4 layer: ``path`` ("qutlass" | "generic", or None: vLLM
    cannot run it and ``error`` says why), ``kernel`` (what runs, in words), ``gemm_backend``
    (the FlashInfer backend QuTLASS hands the GEMM to), ``hadacore`` (the generic path rotates
    with vLLM's hadacore kernel, not a dense GEMM), ``unrounded_scale`` (QuTLASS's SM100
    head_dim-128 kernel scales the elements by the block scale before E4M3 rounding),
    ``verified`` (read in this release's wheel, not inferred), ``steps`` (each with its
    source)."""

    rotation: str
    release: str
    path: str | None
    kernel: str | None = None
    gemm_backend: str | None = None
    error: str | None = None
    hadacore: bool = False
    unrounded_scale: bool = False
    verified: bool = False
    steps: tuple[str, ...] = ()

    def summary(self) -> str:
        """One sentence for :attr:`BackendChoice.reason`."""
        head = f"rotation {self.rotation}: vLLM {self.release}"
        tail = "" if self.verified else " (inferred from PR dates, not read from this wheel)"
        if self.path is None:
            return f"{head} cannot run it: {self.error}{tail}"
        return f"{head} takes the {self.path} path: {self.kernel}{tail}"


def _generic(req: vllm_select.Request, outcome: vllm_select.Outcome, spec: RotationSpec,
             steps: list[str], verified: bool) -> TransformOutcome:
    hadacore = spec.kind == "hadamard" and R.version(req.rel) >= R.version(R.HADACORE_FIRST)
    rotate = ("hadacore_transform (bf16 tensor-core stages of 16, rounded to the model dtype "
              "after each)" if hadacore else
              "a dense GEMM x.to(dtype) @ (M/sqrt(b)) in the model dtype")
    steps.append(f"generic: HadamardTransform.forward rotates with {rotate} "
                 f"(transform/module.py@{req.rel} forward)")
    if outcome.kernel is None:
        return TransformOutcome(str(spec), req.rel, None, error=(
            "the generic path then needs an NVFP4 kernel and this release selects none: "
            + vllm_select.no_kernel_text(outcome.error or "", req.platform.value)),
            hadacore=hadacore, verified=verified, steps=tuple(steps))
    kernel = (f"{'hadacore' if hadacore else 'dense'} rotation, then {outcome.kernel} "
              f"({outcome.numerics}) with the static input_global_scale")
    return TransformOutcome(str(spec), req.rel, PATH_GENERIC, kernel, hadacore=hadacore,
                            verified=verified, steps=tuple(steps))


def decide_transform(req: vllm_select.Request, outcome: vllm_select.Outcome,
                     rotation: object) -> TransformOutcome:
    """vLLM ``req.rel``'s path for an NVFP4 linear layer with the online input ``rotation``
    (anything :func:`rotation_spec` takes), given ``outcome``, the release's kernel choice for
    the same layer without rotation (:func:`nvfp4lab.execution.vllm_select.decide`)."""
    spec = rotation_spec(rotation)
    era = R.transform_era_of(req.rel)
    verified = req.rel in R.TRANSFORM_VERIFIED
    steps = [f"{era.key} {era.title} ({era.source})"]
    if era.key == "T0":
        return TransformOutcome(str(spec), req.rel, None, error=(
            f"vLLM {req.rel} does not read transform_config (transforms came with PR #22486): it "
            "would multiply the unrotated activations by the rotated weights (wrong outputs, "
            "no error)"), steps=tuple(steps))
    w4a4_class = req.scheme == Scheme.NVFP4 or R.version(req.rel) >= R.version("0.23.0")
    if era.key == "T1":
        if w4a4_class and spec.block == 16:
            steps.append("is_qutlass_fp4_scheme: CompressedTensorsW4A4Fp4 with one input "
                         "transform of head_dim 16 (o_proj, down_proj) -> QutlassNvFP4LinearMethod")
            return TransformOutcome(str(spec), req.rel, None, error=(
                "its QuTLASS stub takes every single-partition layer (o_proj, down_proj) with "
                "head_dim 16 and does not implement apply: the first forward fails"),
                steps=tuple(steps))
        return _generic(req, outcome, spec, steps, verified)
    cap_ok = req.platform in (Platform.CUDA, Platform.ROCM) and (req.cc or 0) >= 100
    eligible = w4a4_class and spec.block in R.QUTLASS_BLOCKS
    steps.append(f"is_qutlass_fp4_scheme: W4A4Fp4 class {w4a4_class}, head_dim {spec.block} in "
                 f"{R.QUTLASS_BLOCKS}: {eligible}; has_device_capability(100): {cap_ok} "
                 "(transform/linear.py@0.33.0 L51-54)")
    if not (eligible and cap_ok):
        return _generic(req, outcome, spec, steps, verified)
    if req.scheme == Scheme.NVFP4A16:
        steps.append("NVFP4A16 is CompressedTensorsW4A4Fp4(use_a16=True) since 0.23.0: QuTLASS "
                     "quantizes its activations to FP4 too (W4A4 numerics for a W4A16 checkpoint)")
    if outcome.kernel is None:
        return TransformOutcome(str(spec), req.rel, None, error=(
            "the scheme selects no NVFP4 kernel: "
            + vllm_select.no_kernel_text(outcome.error or "", req.platform.value)),
            verified=verified, steps=tuple(steps))
    backend = R.QUTLASS_GEMM_BACKENDS.get(outcome.kernel)
    if backend is None:
        return TransformOutcome(str(spec), req.rel, None, error=(
            f"QutlassNvFP4 transform requires a FlashInfer kernel, got {outcome.kernel} (load "
            "fails; linear_qutlass_nvfp4.py@0.33.0 L254-270)"), verified=verified,
            steps=tuple(steps))
    unrounded = spec.block in R.QUTLASS_UNROUNDED_SCALE_BLOCKS
    if R.KERNELS[outcome.kernel].numerics != Numerics.NATIVE:
        steps.append(f"{outcome.kernel} prepared the weights for its BF16 x FP4 GEMM; QuTLASS "
                     "hands them to the FP4 x FP4 GEMM as they are (layout match not verified)")
    epilogue = ("SM100 kernel, elements scaled by the unrounded block scale" if unrounded
                else "SM80-style epilogue")
    steps.append(f"QutlassNvFP4LinearMethod: fusedQuantizeNv(x, H, 6.0) ({epilogue}), "
                 f"flashinfer_scaled_fp4_mm(backend={backend!r}), alpha = (1/gs_w)/6 "
                 "(linear_qutlass_nvfp4.py@0.33.0 L272-334)")
    kernel = (f"fusedQuantizeNv (bf16 only, no bias) + flashinfer_scaled_fp4_mm({backend!r}) "
              f"after {outcome.kernel}'s weight layout")
    return TransformOutcome(str(spec), req.rel, PATH_QUTLASS, kernel, gemm_backend=backend,
                            unrounded_scale=unrounded, verified=verified, steps=tuple(steps))


def attach(choice: _C, req: vllm_select.Request, outcome: vllm_select.Outcome,
           rotation: object) -> _C:
    """``choice`` (a :class:`~nvfp4lab.execution.dispatch.BackendChoice`) with its
    ``transform`` set and the transform's sentence appended to its reason; unchanged when
    ``rotation`` is None."""
    if rotation is None:
        return choice
    found = decide_transform(req, outcome, rotation)
    reason = f"{choice.reason}; {found.summary()}"  # type: ignore[attr-defined]
    return dataclasses.replace(choice, transform=found, reason=reason)  # type: ignore[type-var,misc]
