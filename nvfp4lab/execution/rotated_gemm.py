"""vLLM's rotated NVFP4 linear layer, emulated in its arithmetic order (QuTLASS and generic paths).

Which path a vLLM release takes is :mod:`nvfp4lab.execution.vllm_transform`; this module computes
what each path computes, on any device. Shapes: ``x [..., K]``, ``weight`` an
:class:`~nvfp4lab.tensor.NVFP4Tensor` ``[N, K]`` holding ``W·R`` (the rotated weight, as the
checkpoint stores it), the rotation's stored matrix ``M`` ``[b, b]`` (±1, unnormalized, as
compressed-tensors saves it); output ``[..., N]`` in ``x.dtype``.

The matrix vLLM holds (:func:`vllm_rotation_matrix`): ``M`` loaded in the model dtype, then
divided in place by ``sqrt(b)`` (``HadamardTransform.process_weights_after_loading``,
transform/module.py@0.33.0 L75-84): bf16(±1/sqrt(b)), exact for b = 16, 64, rounded for 32, 128.

**QuTLASS path** (:func:`qutlass_linear`; linear_qutlass_nvfp4.py@0.33.0 L272-334, QuTLASS
``fusedQuantizeNvAbsMax``: bindings.cpp, epilogue_quant.h ``op_16`` .. ``op_128``,
sm100_visitor_store_tma_warpspecialized.hpp)::

    y     = x_bf16[b-blocks] @ H_bf16          # tensor cores: exact products, fp32 sum -> fp32
    amax  = max |y| per 16                     # fp32
    sf    = 6.0 * (amax * rcp(6.0))            # fp32; the global scale is the constant 6.0
    sf_q  = E4M3(sf)                           # RNE, satfinite (448): the stored block scale
    s     = rcp(sf_q * rcp(6.0))               # 0 where sf_q == 0 (SM100 kernel, b = 128: sf)
    codes = E2M1(y * s)                        # RNE, satfinite (6)
    out   = (sum codes*sf_q * w_codes*sf_w) * alpha -> x.dtype,  alpha = (1/gs_w) / 6.0

The checkpoint's ``input_global_scale`` is not used; ``x`` must be bf16 (QuTLASS checks "A must
be bf16") and the layer must have no bias (vLLM asserts ``bias is None``).

**Generic path** (:func:`generic_linear`; transform/module.py@0.33.0 L89-124): ``x`` rotated in
the model dtype, then the ordinary NVFP4 linear (:func:`nvfp4lab.execution.gemm.linear`, any
backend) with the static ``input_global_scale``. Type "hadamard" runs vLLM's hadacore kernel
(:func:`hadacore_rotate`: a 16-point stage with entries ±0.25, then for b > 16 a (b/16)-point stage
with entries ±bf16(1/sqrt(b/16)), each an MMA with an fp32 sum rounded to bf16); other types a
dense GEMM ``x @ H`` (``x @ Hᵀ`` when the transform's ``inverse``), fp32 sum rounded to the
model dtype (:func:`dense_rotate`).

**Modelled, not checked on a GPU** (docs/rotations.md): ``rcp.approx.ftz.f32`` is taken as the
correctly rounded reciprocal (PTX guarantees 1 ulp); a tensor core's fp32 sum as the exact sum
rounded once to fp32 (here a float64 product, exact for these operands' bit widths); the FP4
GEMM as the exact sum rounded to fp32 before alpha (as :func:`~nvfp4lab.execution.gemm.
reference_scaled_mm`). Which QuTLASS kernel a wheel runs for b = 128 on SM120 is read from
vLLM's build files, not seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nvfp4lab.constants import BLOCK_SIZE
from nvfp4lab.e2m1 import decode_e2m1, pack_fp4, round_to_e2m1_codes, unpack_fp4
from nvfp4lab.execution import vllm_rules
from nvfp4lab.execution.dispatch import select_backend
from nvfp4lab.execution.gemm import linear, vllm_decode_scale
from nvfp4lab.execution.vllm_transform import PATH_GENERIC, PATH_QUTLASS, rotation_spec
from nvfp4lab.tensor import NVFP4Tensor
from nvfp4lab.vocab import Backend

__all__ = [
    "HADACORE_STAGE_ENTRY",
    "QUTLASS_GLOBAL_SCALE",
    "VllmRotationPlan",
    "dense_rotate",
    "generic_linear",
    "hadacore_rotate",
    "layer_forward",
    "plan_for",
    "qutlass_linear",
    "qutlass_quantize",
    "use_vllm_rotation",
    "vllm_rotation_matrix",
]

#: fusedQuantizeNv's global scale as vLLM passes it (``fused_global_scale = [6.0]``).
QUTLASS_GLOBAL_SCALE: float = 6.0
_E4M3_MAX = 448.0
#: hadacore's bf16 stage entries by stage size (hadamard_transform_cuda.cu ``bf16_1p``:
#: 0x3F35, 0x3F00, 0x3EB5, 0x3E80): bf16(1/sqrt(m)), NOT exactly 1/sqrt(m) for m = 2, 8.
HADACORE_STAGE_ENTRY: dict[int, float] = {2: 0.70703125, 4: 0.5, 8: 0.353515625, 16: 0.25}


def _sylvester(n: int) -> torch.Tensor:
    """The ±1 Sylvester Hadamard matrix, float64 ``[n, n]``."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def vllm_rotation_matrix(stored: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                         ) -> torch.Tensor:
    """The ``[b, b]`` matrix vLLM multiplies by: ``stored`` (±1) in ``dtype`` divided in place by
    ``sqrt(b)`` (one rounding to ``dtype``), as ``process_weights_after_loading`` does."""
    if not isinstance(stored, torch.Tensor) or stored.ndim != 2 or (
            stored.shape[0] != stored.shape[1]):
        raise ValueError("the transform matrix must be a square [b, b] tensor, got "
                         f"{tuple(stored.shape) if isinstance(stored, torch.Tensor) else stored!r}")
    m = stored.detach().to(dtype=dtype).clone()
    return m.div_(math.sqrt(m.shape[0]))


def _rcp(v: torch.Tensor) -> torch.Tensor:
    """``rcp.approx.ftz.f32`` modelled as the correctly rounded float32 reciprocal."""
    return torch.reciprocal(v.to(torch.float32))


def _blocks_times(x2d: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``x`` per block of ``b`` times ``matrix``: exact products summed in float64, rounded once
    to float32 (the tensor-core sum model). ``[M, K]`` float32."""
    b = matrix.shape[0]
    y = x2d.to(torch.float64).reshape(-1, b) @ matrix.to(torch.float64)
    return y.to(torch.float32).reshape(x2d.shape)


def _check_rotation_args(x: torch.Tensor, matrix: torch.Tensor, what: str) -> int:
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        raise TypeError(f"{what}: x must be a tensor [..., K], got {type(x).__name__}")
    if not isinstance(matrix, torch.Tensor) or matrix.ndim != 2 or (
            matrix.shape[0] != matrix.shape[1]):
        raise ValueError(f"{what}: the rotation matrix must be square [b, b]")
    b = matrix.shape[0]
    if x.shape[-1] % b:
        raise ValueError(f"{what}: K = {x.shape[-1]} is not a multiple of the rotation block {b}")
    return b


def qutlass_quantize(x2d: torch.Tensor, matrix: torch.Tensor, *, unrounded_scale: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """QuTLASS's ``fusedQuantizeNvAbsMax(x, H, [6.0])`` (module docstring): ``x2d`` bf16
    ``[M, K]``, ``matrix`` bf16 ``[b, b]`` with b in 16/32/64/128. Returns the packed E2M1 codes
    uint8 ``[M, K/2]`` and the E4M3 block scales ``[M, K/16]`` (plain layout; vLLM swizzles
    them). ``unrounded_scale``: the SM100 kernel's order (elements scaled by the fp32 block scale
    before its E4M3 rounding; vLLM's b = 128 on a TARGET_CUDA_ARCH=100 build)."""
    b = _check_rotation_args(x2d, matrix, "qutlass_quantize")
    if x2d.dtype != torch.bfloat16 or matrix.dtype != torch.bfloat16:
        raise ValueError(
            f"QuTLASS's fusedQuantizeNv takes bf16 only (TORCH_CHECK 'A must be bf16', 'B must be "
            f"bf16'); got x {x2d.dtype} and the matrix {matrix.dtype}: cast the model to bfloat16")
    if b not in vllm_rules.QUTLASS_BLOCKS:
        raise ValueError(f"QuTLASS implements rotation blocks {vllm_rules.QUTLASS_BLOCKS}, got {b}")
    if x2d.ndim != 2:
        raise ValueError(f"qutlass_quantize takes x as [M, K], got shape {tuple(x2d.shape)}")
    if x2d.numel() and not bool(torch.isfinite(x2d).all()):
        raise ValueError("x holds NaN or Inf: QuTLASS's block maximum would be undefined; "
                         "check the activations")
    m, k = x2d.shape
    y = _blocks_times(x2d, matrix).reshape(m, k // BLOCK_SIZE, BLOCK_SIZE)
    r6 = _rcp(torch.tensor(QUTLASS_GLOBAL_SCALE))
    gs = torch.tensor(QUTLASS_GLOBAL_SCALE, dtype=torch.float32)
    sf = gs * (y.abs().amax(-1) * r6)
    sf_q = sf.clamp(max=_E4M3_MAX).to(torch.float8_e4m3fn)
    used = sf if unrounded_scale else sf_q.to(torch.float32)
    scale = torch.where(used != 0, _rcp(used * _rcp(gs)), torch.zeros((), dtype=torch.float32))
    codes = round_to_e2m1_codes(y * scale.unsqueeze(-1))
    return pack_fp4(codes.reshape(m, k)), sf_q


def _decoded(packed: torch.Tensor, scales: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    values = decode_e2m1(unpack_fp4(packed)[:, :k], torch.float32).to(torch.float64)
    values = values.reshape(rows, k // BLOCK_SIZE, BLOCK_SIZE)
    return (values * scales.to(torch.float64).unsqueeze(-1)).reshape(rows, k)


def qutlass_linear(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    matrix: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    unrounded_scale: bool | None = None,
) -> torch.Tensor:
    """vLLM's ``QutlassNvFP4LinearMethod.apply``: ``x [..., K]`` bf16, ``weight`` ``[N, K]`` (of
    ``W·R``), ``matrix`` the bf16 ``[b, b]`` matrix vLLM holds (:func:`vllm_rotation_matrix`) ->
    ``[..., N]`` bf16. ``unrounded_scale`` None: the kernel vLLM 0.33.0's wheel runs for this b
    (:data:`~nvfp4lab.execution.vllm_rules.QUTLASS_UNROUNDED_SCALE_BLOCKS`). ``bias`` must be
    None: vLLM asserts it (a biased layer fails); ValueError otherwise."""
    if bias is not None:
        raise ValueError("vLLM's transform paths assert bias is None (linear_qutlass_nvfp4.py@"
                         "0.33.0 L304): a rotated layer with a bias fails in vLLM; fold the bias "
                         "elsewhere or leave this layer unrotated")
    if not isinstance(weight, NVFP4Tensor) or len(weight.shape) != 2:
        raise TypeError(f"weight must be a 2-D NVFP4Tensor [N, K], got {type(weight).__name__}")
    n, k = weight.shape
    if x.shape[-1] != k or weight.block_size != BLOCK_SIZE:
        raise ValueError(f"x has K={x.shape[-1]}, the weight is [{n}, {k}] with block size "
                         f"{weight.block_size}: K must match and the block size be 16")
    b = matrix.shape[0] if isinstance(matrix, torch.Tensor) else 0
    if unrounded_scale is None:
        unrounded_scale = b in vllm_rules.QUTLASS_UNROUNDED_SCALE_BLOCKS
    x2d = x.reshape(-1, k)
    packed, scales = qutlass_quantize(x2d, matrix, unrounded_scale=unrounded_scale)
    a = _decoded(packed, scales, x2d.shape[0], k)
    w = _decoded(weight.packed, weight.scales, n, k).to(a.device)
    raw = (a @ w.T).to(torch.float32)
    alpha = vllm_decode_scale(weight).to(device=raw.device, dtype=torch.float32) / torch.tensor(
        QUTLASS_GLOBAL_SCALE, dtype=torch.float32)
    return (raw * alpha).to(x.dtype).reshape(*x.shape[:-1], n)


def hadacore_rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """vLLM's ``hadacore_transform`` over blocks of ``block`` (16..256, a power of two) of a bf16
    ``x [..., K]``: the 16-point stage on each run of 16 (entries ±0.25), then for ``block`` > 16
    the (block/16)-point stage across them (entries :data:`HADACORE_STAGE_ENTRY`), each an fp32
    sum rounded to float32 then bf16. Same shape, bf16."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"hadacore is emulated for bf16 (its fp16 MMA sums in fp16); x is "
                         f"{x.dtype}")
    if not isinstance(block, int) or block < 16 or block > 256 or block & (block - 1):
        raise ValueError(f"hadacore's emulation covers blocks 16..256 (powers of two), got {block}")
    if x.shape[-1] % block:
        raise ValueError(f"K = {x.shape[-1]} is not a multiple of the rotation block {block}")
    groups = block // 16
    v = x.reshape(-1, groups, 16).to(torch.float64)
    v = (v @ (_sylvester(16) * HADACORE_STAGE_ENTRY[16])).to(torch.float32).to(torch.bfloat16)
    if groups > 1:
        stage = _sylvester(groups) * HADACORE_STAGE_ENTRY[groups]
        v = (stage @ v.to(torch.float64)).to(torch.float32).to(torch.bfloat16)
    return v.reshape(x.shape)


def dense_rotate(x: torch.Tensor, matrix: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """``HadamardTransform``'s dense path: ``x.to(matrix.dtype)`` per block times ``matrix``
    (``matrix.T`` when ``inverse``), an fp32 sum rounded to the matrix dtype, then ``x.dtype``."""
    _check_rotation_args(x, matrix, "dense_rotate")
    m = matrix.T if inverse else matrix
    v = x.to(matrix.dtype).reshape(-1, x.shape[-1])
    return _blocks_times(v, m).to(matrix.dtype).to(x.dtype).reshape(x.shape)


def generic_linear(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    matrix: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    hadacore: bool,
    inverse: bool = False,
    input_global_scale: torch.Tensor | float | None = None,
    backend: str = Backend.EMULATION,
) -> torch.Tensor:
    """vLLM's ``CompressedTensorsLinearTransformMethod.apply``: ``x`` rotated
    (:func:`hadacore_rotate` when ``hadacore``, else :func:`dense_rotate` with ``matrix``, the
    one vLLM holds), then :func:`~nvfp4lab.execution.gemm.linear` on ``backend`` with the static
    ``input_global_scale``. ``bias`` must be None (vLLM asserts it)."""
    if bias is not None:
        raise ValueError("vLLM's transform paths assert bias is None (transform/linear.py@0.33.0 "
                         "L159): a rotated layer with a bias fails in vLLM")
    xr = hadacore_rotate(x, matrix.shape[0]) if hadacore else dense_rotate(x, matrix,
                                                                           inverse=inverse)
    return linear(xr, weight, None, input_global_scale=input_global_scale, backend=backend)


# ---------------------------------------------------------------------------------------------
# NVFP4Linear's rotated layers
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmRotationPlan:
    """How a rotated :class:`~nvfp4lab.execution.layers.NVFP4Linear` runs vLLM's path: ``path``
    ("qutlass" | "generic"), ``hadacore``, ``unrounded_scale`` (the transform's facts) and
    ``backend``, the nvfp4lab backend standing in for the generic path's NVFP4 kernel."""

    path: str
    hadacore: bool = False
    unrounded_scale: bool = False
    backend: str = Backend.EMULATION


def plan_for(rotation: object, **select: object) -> VllmRotationPlan:
    """The plan for an NVFP4 layer rotated by ``rotation`` under ``select_backend(**select)``
    (``gpu=``, ``vllm=``, ...). ValueError when that vLLM cannot run it (its reason)."""
    choice = select_backend(rotation=rotation_spec(rotation), **select)  # type: ignore[arg-type]
    t = choice.transform
    assert t is not None
    if t.path is None:
        raise ValueError(f"vLLM {t.release} cannot run rotation {t.rotation}: {t.error}")
    return VllmRotationPlan(t.path, t.hadacore, t.unrounded_scale, choice.name)


def layer_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``NVFP4Linear.forward`` of a layer whose ``vllm_rotation`` is a plan: vLLM's path on its
    buffers (``W·R``) and its rotation ``layer.hadamard`` (a ``BlockRotation``: ``kind``,
    ``size``, ``matrix()``)."""
    plan: VllmRotationPlan = layer.vllm_rotation  # type: ignore[assignment]
    rotation = layer.hadamard
    if not callable(getattr(rotation, "matrix", None)):
        raise ValueError("vllm_rotation needs a layer rotated by a compressed-tensors "
                         f"BlockRotation (nvfp4lab.hadamard.ct_rotation), not {rotation!r}")
    weight = layer._gemm_weight()  # type: ignore[operator]
    stored = rotation.matrix(torch.float32, x.device)
    if plan.path == PATH_QUTLASS:
        return qutlass_linear(x, weight, vllm_rotation_matrix(stored, torch.bfloat16),
                              layer.bias, unrounded_scale=plan.unrounded_scale)  # type: ignore[arg-type]
    assert plan.path == PATH_GENERIC
    return generic_linear(x, weight, vllm_rotation_matrix(stored, x.dtype), layer.bias,  # type: ignore[arg-type]
                          hadacore=plan.hadacore, input_global_scale=layer.input_global_scale,  # type: ignore[arg-type]
                          backend=plan.backend)


def use_vllm_rotation(model: torch.nn.Module, **select: object) -> dict[str, VllmRotationPlan]:
    """Make every NVFP4Linear of ``model`` rotated by a ``BlockRotation`` run vLLM's rotated path
    as :func:`~nvfp4lab.execution.dispatch.select_backend` ``(**select)`` reports it (e.g.
    ``gpu="B200", vllm="0.33.0"``). Returns the plans by module name; ``vllm_rotation = None``
    on a layer restores nvfp4lab's own order. ValueError when vLLM cannot run one of them."""
    plans: dict[str, VllmRotationPlan] = {}
    for name, module in model.named_modules():
        rotation = getattr(module, "hadamard", None)
        if hasattr(module, "vllm_rotation") and callable(getattr(rotation, "matrix", None)):
            plans[name] = plan_for(rotation, **select)
    for name, plan in plans.items():
        model.get_submodule(name).vllm_rotation = plan
    return plans
