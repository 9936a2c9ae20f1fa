"""``linear(x, weight, bias)`` with an NVFP4 weight on four execution paths.

Shapes: ``x`` is ``[..., K]`` (float32, bfloat16 or float16), ``weight`` an
:class:`~nvfp4lab.tensor.NVFP4Tensor` of shape ``[N, K]``, ``bias`` ``[N]`` or None. The output
is ``[..., N]`` in ``x.dtype``. Leading dims are flattened: the GEMM always runs on a 2-D
``[M, K]`` activation, as vLLM does (quantization is per row along K, so flattening changes no
code or scale).

Backends (``backend="auto"`` asks :func:`nvfp4lab.execution.dispatch.select_backend` for
``x.device``):

``"emulation"`` (W4A4), exactly vLLM's ``run_nvfp4_emulations`` followed by the bias::

    x_dq = fake_quantize(x2d, gs_x, convention="kernel")   # value*(s/gs_x) in f32 -> x.dtype
    w_dq = vllm_dequantize(weight, x.dtype)                 # value*(s*(1/gs_w)) in f32 -> x.dtype
    out  = torch.matmul(x_dq, w_dq.T)                       # in x.dtype
    out  = out + bias.to(x.dtype)                           # bias_mode="output"

  The weight is decoded as vLLM does, NOT by ``weight.dequantize``: vLLM's compressed-tensors
  loader inverts the ENCODE global scale once (``1.0 / weight_global_scale``,
  compressed_tensors_w4a4_nvfp4.py@0.33.0 L111-112) and ``dequantize_to_dtype`` multiplies by
  it (nvfp4_emulation_utils.py@0.33.0 L621), where ``dequantize`` divides. In float32 the two
  differ by one ulp in many blocks (the only cause of the fp32 mismatch with vLLM; bf16/fp16
  rounding hides it almost always); tests/peers/test_vllm.py checks both bit for bit.

  ``gs_x`` is ``input_global_scale`` (ENCODE form, 2688/amax, e.g. a calibrated
  ``input_global_scale`` of a compressed-tensors checkpoint); when None it is computed from THIS
  call's ``x`` (all leading dims together), ``compute_global_scale(x)`` — dynamic per-tensor
  activation scaling.

``"w4a16"`` (weight-only): ``torch.matmul(x2d, w_dq.T)`` in ``x.dtype``, then the bias the same
  way, with ``w_dq`` decoded in the same vLLM order (vLLM hands every kernel the inverted decode
  scale). The numerics of vLLM's Marlin fallback up to the kernel's own arithmetic (Marlin
  applies the scales in the activation dtype inside its GEMM; we do not ship Marlin).

``"native"``: activations quantized (kernel order), then ``torch._scaled_mm`` with FP4 operands
  and swizzled E4M3 block scales, fp32 output, ``alpha = 1/(gs_x * gs_w)`` applied in fp32, one
  rounding to ``x.dtype``, then the bias. Needs a CUDA device with native FP4 (capability >= 10.0,
  CUDA >= 12.8); anywhere else it raises RuntimeError naming the device and capability (never
  a silent fallback). :func:`native_scaled_mm_args` builds the exact arguments, and
  :func:`reference_scaled_mm` evaluates them on any device (a CPU model of the kernel).

``"q8_0"``: llama.cpp's CPU path, bit for bit (:mod:`nvfp4lab.execution.ggml_cpu`)::

    q8, d = quantize_q8_0(x2d.float())                      # int8 per 32, fp16 d, half to even
    out   = vec_dot_nvfp4_q8_0(codes, scales, q8, d)        # ggml's AVX2 order, float32
    out   = out * d_w                                       # the <name>.scale sidecar, float32
    out   = out.to(x.dtype) + bias.to(x.dtype)              # bias_mode="output"

  ``d_w`` is the weight's DECODE tensor scale as :func:`vllm_decode_scale` gives it (the GGUF
  sidecar). ``input_global_scale`` is not used: llama.cpp quantizes activations per 32 values.
  K must be a multiple of 64 (llama.cpp's NVFP4 block), the weight's block size 16.

Fused (``fused=``, default None = the ``NVFP4LAB_FUSED`` setting, see :mod:`nvfp4lab.kernels`):
without a ``dequantized_weight``, the emulation and w4a16 paths of a weight with 16-element blocks
and K % 16 == 0 decode it with the fused kernel tile by tile inside the GEMM
(:func:`nvfp4lab.kernels.linear.tiled_matmul`: no full-size dequantized weight) and fake-quantize
the emulation's activations with the fused kernels: bit for bit the results above.

Bias epilogue (``bias_mode``):

``"output"`` (default)
    the GEMM result is rounded to ``x.dtype`` first, then ``+ bias.to(x.dtype)`` in ``x.dtype``
    (two roundings), as vLLM's native FP4 path (CUTLASS GEMM, then ``out + bias``) does.
``"fp32"``
    ``(matmul(x_dq.float(), w_dq.float().T) + bias.float()).to(x.dtype)``: the product
    accumulated and the bias added in float32, one final rounding (what a fused fp32 epilogue
    would do; the most accurate variant).
``"dropped"``
    no bias at all: the seed's original emulation bug, reproduced for the bias study. Every call
    that receives a bias warns with :class:`DroppedBiasWarning`.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nvfp4lab import kernels, settings
from nvfp4lab.codec import compute_global_scale, fake_quantize, quantize
from nvfp4lab.constants import BLOCK_SIZE, GGML_NVFP4_BLOCK
from nvfp4lab.e2m1 import decode_e2m1, unpack_fp4
from nvfp4lab.execution import ggml_cpu
from nvfp4lab.execution.dispatch import native_fp4_status, select_backend
from nvfp4lab.kernels.linear import EncodedWeight, tiled_matmul
from nvfp4lab.layout import swizzle_scales, unswizzle_scales
from nvfp4lab.orders import DecodeRule
from nvfp4lab.scales import as_global_scale
from nvfp4lab.settings import BACKEND_ENV
from nvfp4lab.tensor import NVFP4Tensor
from nvfp4lab.vocab import AUTO, Backend, BiasMode, OrderName, check_choice, check_dtype

__all__ = [
    "DroppedBiasWarning",
    "ScaledMMArgs",
    "linear",
    "native_scaled_mm_args",
    "reference_scaled_mm",
    "vllm_decode_scale",
    "vllm_dequantize",
]

# torch._scaled_mm operand constraints for FP4 on CUDA (torch/_meta_registrations.py,
# _check_scaled_mm_sizes): mat_a.size(1) % 16 == 0 (packed K/2, so K % 32), both dims of mat_b
# % 16 == 0 (so N % 16). We zero-pad K and N to satisfy them; zero codes with zero scales add 0.
_NATIVE_K_MULTIPLE = 32
_NATIVE_N_MULTIPLE = 16


class DroppedBiasWarning(UserWarning):
    """``bias_mode="dropped"`` discarded a bias (the seed's emulation bug, on purpose)."""


# ---------------------------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------------------------


def _check_args(
    x: torch.Tensor, weight: NVFP4Tensor, bias: torch.Tensor | None, bias_mode: str
) -> BiasMode:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_dtype(x.dtype, "x (dtype)")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension [..., K], got a 0-d tensor")
    if not isinstance(weight, NVFP4Tensor):
        raise TypeError(
            f"weight must be an NVFP4Tensor (see nvfp4lab.quantize), got {type(weight).__name__}"
        )
    if weight.transform is not None:
        raise ValueError(
            f"weight holds a transformed tensor ({weight.transform}), not W itself; rotate the "
            "activations the same way (nvfp4lab.hadamard.rotate_gemm_operands) and decode with "
            "dequantize_rotated(), or quantize W without the transform"
        )
    if len(weight.shape) != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(
            f"x has K={x.shape[-1]} (shape {tuple(x.shape)}) but weight is [N, K] = [{n}, {k}]"
        )
    if weight.device != x.device:
        raise ValueError(f"x is on {x.device} but the weight is on {weight.device}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(
            f"bias must be a torch.Tensor of shape [{n}] or None, got {type(bias).__name__}; "
            "convert it with torch.as_tensor(bias, dtype=x.dtype)"
        )
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != n):
        raise ValueError(f"bias must have shape [{n}], got {tuple(bias.shape)}")
    return check_choice("bias_mode", bias_mode, BiasMode)  # type: ignore[return-value]


def _input_scale(x: torch.Tensor, input_global_scale: torch.Tensor | float | None) -> torch.Tensor:
    if input_global_scale is None:
        return compute_global_scale(x, convention=OrderName.VLLM_KERNEL)
    return as_global_scale(input_global_scale, x.device)


def _epilogue(
    out: torch.Tensor | None,
    out_f32: torch.Tensor | None,
    bias: torch.Tensor | None,
    bias_mode: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Apply the bias epilogue. ``out``: GEMM output in ``dtype``; ``out_f32``: in float32."""
    if bias_mode == BiasMode.FP32:
        assert out_f32 is not None
        if bias is not None:
            out_f32 = out_f32 + bias.to(torch.float32)
        return out_f32.to(dtype)
    if out is None:
        assert out_f32 is not None
        out = out_f32.to(dtype)
    if bias is None:
        return out
    if bias_mode == BiasMode.DROPPED:
        warnings.warn(
            "bias_mode='dropped': the bias is ignored (reproducing the seed's emulation bug); "
            "use bias_mode='output' for correct results",
            DroppedBiasWarning,
            stacklevel=3,
        )
        return out
    return out + bias.to(dtype)


# ---------------------------------------------------------------------------------------------
# Emulation and weight-only
# ---------------------------------------------------------------------------------------------


def _gemm(
    a: torch.Tensor,
    w_dq: torch.Tensor | EncodedWeight,
    bias: torch.Tensor | None,
    bias_mode: str,
) -> torch.Tensor:
    """``a [M, K] @ w_dq[N, K].T`` (both in the output dtype) with the bias epilogue; an
    :class:`EncodedWeight` is decoded tile by tile by the fused kernel (the same product)."""
    fp32 = bias_mode == BiasMode.FP32
    if isinstance(w_dq, EncodedWeight):
        product = tiled_matmul(a, w_dq, fp32=fp32)
    elif fp32:
        product = torch.matmul(a.to(torch.float32), w_dq.to(torch.float32).T)
    else:
        product = torch.matmul(a, w_dq.T)
    if fp32:
        return _epilogue(None, product, bias, bias_mode, a.dtype)
    return _epilogue(product, None, bias, bias_mode, a.dtype)


def _weight_operand(
    weight: NVFP4Tensor, x: torch.Tensor, fused: bool | None
) -> torch.Tensor | EncodedWeight:
    """The weight as the emulation and w4a16 paths multiply it: :func:`vllm_dequantize` to
    ``x.dtype``, or, when the fused kernels run (the one rule,
    :func:`nvfp4lab.kernels.fused_route`), encoded for a tiled decode in the same order."""
    n, k = weight.shape
    if kernels.fused_route(
        n * k, k, x.dtype, x.device, fused, block_size=weight.block_size, native=True
    ):
        return EncodedWeight(
            weight.packed, weight.scales, vllm_decode_scale(weight), DecodeRule.SCALE_TIMES_DECODE
        )
    return vllm_dequantize(weight, x.dtype, fused=fused)


def vllm_decode_scale(weight: NVFP4Tensor) -> torch.Tensor:
    """vLLM's stored DECODE multiplier of ``weight`` (float32 [1]): the exact
    ``weight.decode_scale`` when it carries one (a ModelOpt ``weight_scale_2``), else ``1/gs``
    (vLLM inverts a compressed-tensors ENCODE scale once at load)."""
    if weight.decode_scale is not None:
        return weight.decode_scale
    return torch.reciprocal(weight.global_scale.to(torch.float32))


def vllm_dequantize(
    weight: NVFP4Tensor,
    dtype: torch.dtype,
    *,
    decode: torch.Tensor | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """``weight`` decoded with vLLM's arithmetic: ``value * (scale * d)`` in float32, then
    ``dtype``, where ``d`` is vLLM's stored DECODE scale: the exact ``weight.decode_scale`` when
    the weight carries one (a ModelOpt checkpoint's ``weight_scale_2``), else ``1/gs`` (vLLM
    inverts a compressed-tensors ENCODE scale at load). ``decode``: another float32 decode
    multiplier to use instead (e.g. a merged one, :mod:`nvfp4lab.execution.shared_scales`).
    ``fused``: as
    in :meth:`NVFP4Tensor.dequantize`.

    ``NVFP4Tensor.dequantize`` of a weight without a decode scale computes ``value * (scale /
    gs)`` instead (the compressed-tensors/reference order), which differs by an ulp in float32
    for some scales.
    """
    if decode is None:
        decode = vllm_decode_scale(weight)
    as_vllm = dataclasses.replace(weight, decode_scale=decode, check_scales=False)
    return as_vllm.dequantize(dtype, fused=fused)


def _emulation(
    x2d: torch.Tensor,
    w_dq: torch.Tensor | EncodedWeight,
    bias: torch.Tensor | None,
    gs_x: torch.Tensor,
    bias_mode: str,
    fused: bool | None,
) -> torch.Tensor:
    pad = x2d.shape[-1] % BLOCK_SIZE != 0  # a weight quantized with pad=True
    # The activations take the same route rule as every tensor (kernels.fused_route): the
    # weight's and theirs are decided apart, and either route gives the same bits.
    x_dq = fake_quantize(x2d, gs_x, convention=OrderName.VLLM_KERNEL, pad=pad, fused=fused)
    return _gemm(x_dq, w_dq, bias, bias_mode)


# ---------------------------------------------------------------------------------------------
# Native: the torch._scaled_mm call, built explicitly so it can be checked on CPU
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScaledMMArgs:
    """The exact arguments of the native FP4 GEMM, plus the epilogue around it.

    The call is ``torch._scaled_mm(mat_a, mat_b, scale_a, scale_b, out_dtype=torch.float32)``,
    then ``alpha`` (fp32), slicing to ``[m, n]``, one rounding to ``output_dtype`` and the bias.

    * ``mat_a``: ``float4_e2m1fn_x2 [M, Kp/2]``, row-major (quantized activations).
    * ``mat_b``: ``float4_e2m1fn_x2 [Kp/2, Np]``, column-major: the transpose VIEW of the packed
      weight ``[Np, Kp/2]`` (no copy).
    * ``scale_a`` / ``scale_b``: ``float8_e4m3fn``, the 128x4 blocked ("swizzled") layout of the
      plain ``[M, Kp/16]`` / ``[Np, Kp/16]`` block scales, 2-D ``[ceil(rows/128)*128,
      ceil(Kp/16/4)*4]``, contiguous, zero padded.
    * ``alpha``: float32 ``[1]`` = ``1 / (gs_x * gs_w)`` (ENCODE-form global scales).
    * ``Kp`` = K rounded up to a multiple of 32, ``Np`` = N rounded up to 16 (zero padding).
    """

    mat_a: torch.Tensor
    mat_b: torch.Tensor
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    alpha: torch.Tensor
    bias: torch.Tensor | None
    m: int
    n: int
    k: int
    output_dtype: torch.dtype
    out_dtype: torch.dtype = torch.float32

    def scaled_mm_kwargs(self) -> dict[str, object]:
        """Keyword arguments of the ``torch._scaled_mm`` call (bias/alpha applied after it)."""
        return {
            "scale_a": self.scale_a,
            "scale_b": self.scale_b,
            "out_dtype": self.out_dtype,
        }


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    raw = F.pad(raw, (0, 0, 0, rows - t.shape[0]))
    return raw.view(t.dtype) if t.dtype != torch.uint8 else raw


def _pad_cols(t: torch.Tensor, cols: int) -> torch.Tensor:
    if t.shape[-1] == cols:
        return t
    raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    raw = F.pad(raw, (0, cols - t.shape[-1]))
    return raw.view(t.dtype) if t.dtype != torch.uint8 else raw


def native_scaled_mm_args(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    bias: torch.Tensor | None = None,
    *,
    input_global_scale: torch.Tensor | float | None = None,
) -> ScaledMMArgs:
    """Quantize ``x [..., K]`` and build the ``torch._scaled_mm`` arguments (any device).

    Calling convention of ``torch._scaled_mm`` for NVFP4 (torch >= 2.8, unchanged through 2.13):
    from ``_check_scaled_mm_sizes`` in ``torch/_meta_registrations.py`` (torch 2.13): both
    operands 2-D of dtype ``float4_e2m1fn_x2`` with K counted in packed pairs, ``mat_a``
    row-major and ``mat_b`` column-major on CUDA, ``mat_a.size(1) % 16 == 0`` and both dims of
    ``mat_b`` multiples of 16; block scales of dtype ``float8_e4m3fn`` select the NVFP4 recipe
    (block 16), each contiguous with exactly ``round_up(rows, 128) * round_up(K/16, 4)`` elements
    (the 128x4 blocked layout; 1-D or 2-D both pass). The per-tensor scale cannot be passed
    (``scale_result`` is unsupported for FP4) and cuBLAS rejects a bias with fp32 output, so, as
    torchao's ``_addmm_nvfp4_dispatch`` (pytorch/ao, torchao/prototype/mx_formats/
    nvfp4_tensor.py) does, the product scale is applied after the call and the bias after that.
    We request fp32 output so that alpha is applied before the single rounding to the output
    dtype, as vLLM's CUTLASS FP4 GEMM applies alpha in its fp32 epilogue.
    """
    _check_args(x, weight, bias, BiasMode.OUTPUT)
    if weight.block_size != BLOCK_SIZE:
        raise ValueError(f"native NVFP4 needs block size 16, the weight has {weight.block_size}")
    n, k = weight.shape
    x2d = x.reshape(-1, k)
    m = x2d.shape[0]
    kp = -(-k // _NATIVE_K_MULTIPLE) * _NATIVE_K_MULTIPLE
    np_ = -(-n // _NATIVE_N_MULTIPLE) * _NATIVE_N_MULTIPLE
    gs_x = _input_scale(x2d, input_global_scale)
    xq = quantize(x2d, gs_x, convention=OrderName.VLLM_KERNEL, pad=k % BLOCK_SIZE != 0)
    a_packed = _pad_cols(xq.packed, kp // 2).contiguous()
    a_scales = _pad_cols(xq.scales, kp // BLOCK_SIZE)
    w_packed = _pad_cols(_pad_rows(weight.packed, np_), kp // 2).contiguous()
    w_scales = _pad_cols(_pad_rows(weight.scales, np_), kp // BLOCK_SIZE)
    fp4 = torch.float4_e2m1fn_x2
    alpha = torch.reciprocal(gs_x * weight.global_scale.to(x.device))
    return ScaledMMArgs(
        mat_a=a_packed.view(fp4),
        mat_b=w_packed.view(fp4).t(),
        scale_a=swizzle_scales(a_scales).contiguous(),
        scale_b=swizzle_scales(w_scales).contiguous(),
        alpha=alpha,
        bias=bias,
        m=m,
        n=n,
        k=k,
        output_dtype=x.dtype,
    )


def _finish_native(
    raw: torch.Tensor, args: ScaledMMArgs, bias_mode: str
) -> torch.Tensor:
    """fp32 ``[M, Np]`` raw product -> alpha -> slice -> epilogue in the output dtype."""
    out_f32 = (raw.to(torch.float32) * args.alpha)[:, : args.n]
    return _epilogue(None, out_f32, args.bias, bias_mode, args.output_dtype)


def reference_scaled_mm(args: ScaledMMArgs) -> torch.Tensor:
    """CPU/any-device model of the blockwise-scaled FP4 GEMM: float32 ``[M, Np]``.

    Un-swizzles both scale matrices, decodes the FP4 codes, multiplies each 16-block by its
    E4M3 scale (exact in float32), and accumulates the products in float64 (rounded once to
    float32): the exact sum, which a tensor core's fp32 accumulation approximates. ``alpha`` is
    NOT applied (the kernel returns the unscaled product).
    """

    def decode(fp4: torch.Tensor, scales_blocked: torch.Tensor, rows: int) -> torch.Tensor:
        codes = unpack_fp4(fp4.contiguous().view(torch.uint8))  # [rows, Kp]
        kp = codes.shape[-1]
        scales = unswizzle_scales(scales_blocked, rows, kp // BLOCK_SIZE).to(torch.float64)
        values = decode_e2m1(codes, torch.float32).to(torch.float64)
        values = values.reshape(rows, kp // BLOCK_SIZE, BLOCK_SIZE) * scales.unsqueeze(-1)
        return values.reshape(rows, kp)

    a = decode(args.mat_a, args.scale_a, args.mat_a.shape[0])
    b = decode(args.mat_b.t(), args.scale_b, args.mat_b.shape[1])  # [Np, Kp]
    return torch.matmul(a, b.T).to(torch.float32)


def _native(
    x2d: torch.Tensor,
    weight: NVFP4Tensor,
    bias: torch.Tensor | None,
    input_global_scale: torch.Tensor | float | None,
    bias_mode: str,
) -> torch.Tensor:
    ok, why = native_fp4_status(x2d.device)
    if not ok:
        cap = (
            "capability {}.{}".format(*torch.cuda.get_device_capability(x2d.device))
            if x2d.device.type == "cuda" and torch.cuda.is_available()
            else "no CUDA capability"
        )
        env = settings.environ().get(BACKEND_ENV)
        fix = (
            f"The environment variable {BACKEND_ENV}={env!r} forces it wherever backend='auto' "
            f"(NVFP4Linear's default): unset {BACKEND_ENV} or set it to auto, emulation or "
            "w4a16; a layer built with backend='native' needs backend='emulation' or 'w4a16'"
            if (env or "").strip().lower() == Backend.NATIVE
            else "Use backend='emulation' (W4A4 numerics) or 'w4a16', or backend='auto' to let "
            "select_backend choose"
        )
        raise RuntimeError(
            f"backend='native' needs native FP4 (CUDA capability >= 10.0, CUDA >= 12.8), but x is "
            f"on {x2d.device} ({cap}): {why}. {fix}"
        )
    args = native_scaled_mm_args(x2d, weight, bias, input_global_scale=input_global_scale)
    raw = torch._scaled_mm(args.mat_a, args.mat_b, **args.scaled_mm_kwargs())  # type: ignore[arg-type]
    return _finish_native(raw, args, bias_mode)


# ---------------------------------------------------------------------------------------------
# llama.cpp's CPU path
# ---------------------------------------------------------------------------------------------


def _llama_cpu(
    x2d: torch.Tensor, weight: NVFP4Tensor, bias: torch.Tensor | None, bias_mode: str
) -> torch.Tensor:
    """Q8_0 activations, ``ggml_vec_dot_nvfp4_q8_0``, the sidecar tensor scale (module
    docstring); float32 throughout like ggml, then the epilogue in ``x.dtype``."""
    k = weight.shape[1]
    if weight.block_size != BLOCK_SIZE or k % GGML_NVFP4_BLOCK:
        raise ValueError(
            f"backend={Backend.Q8_0.value!r} runs llama.cpp's NVFP4 blocks (64 values, block "
            f"scales per {BLOCK_SIZE}); the weight has K={k} and block size {weight.block_size}: "
            f"K must be a multiple of {GGML_NVFP4_BLOCK} and the block size {BLOCK_SIZE}; use "
            "backend='emulation' or 'w4a16' for it"
        )
    out = ggml_cpu.mul_mat(x2d.to(torch.float32), weight.packed, weight.scales)
    out = out * vllm_decode_scale(weight).to(device=out.device, dtype=torch.float32)
    return _epilogue(None, out, bias, bias_mode, x2d.dtype)


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------


def linear(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    bias: torch.Tensor | None = None,
    *,
    input_global_scale: torch.Tensor | float | None = None,
    backend: str = AUTO,
    bias_mode: str = BiasMode.OUTPUT,
    dequantized_weight: torch.Tensor | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T + bias`` with an NVFP4 weight; output ``[..., N]`` in x.dtype.

    ``input_global_scale``: ENCODE form (2688/amax) for the activations (emulation and
    native); None computes it from this ``x``. ``backend``: "auto" | "native" | "emulation" |
    "w4a16" | "q8_0" (llama.cpp's CPU path); ``bias_mode``: "output" | "fp32" | "dropped". The
    exact arithmetic of each is in the module docstring. ``dequantized_weight``:
    ``vllm_dequantize(weight, x.dtype)`` when the caller already holds it (e.g. a cache); used as
    given by the emulation and w4a16 paths.
    ``fused``: True/False forces the fused kernels on/off for this call, None follows
    ``NVFP4LAB_FUSED`` (module docstring). Raises RuntimeError for ``backend="native"`` off an
    FP4 GPU.
    """
    mode = _check_args(x, weight, bias, bias_mode)
    if input_global_scale is not None:  # validated on every path, also where it is unused
        input_global_scale = as_global_scale(input_global_scale, x.device)
    chosen = check_choice("backend", backend, Backend, extra=(AUTO,))
    if chosen == AUTO:
        chosen = select_backend(x.device).name
    n, k = weight.shape
    x2d = x.reshape(-1, k)
    if chosen == Backend.NATIVE:
        out = _native(x2d, weight, bias, input_global_scale, mode)
    elif chosen == Backend.Q8_0:
        out = _llama_cpu(x2d, weight, bias, mode)
    else:
        w_dq = dequantized_weight
        if w_dq is None:
            w_dq = _weight_operand(weight, x, fused)
        if chosen == Backend.EMULATION:
            gs_x = _input_scale(x2d, input_global_scale)
            out = _emulation(x2d, w_dq, bias, gs_x, mode, fused)
        else:
            out = _gemm(x2d, w_dq, bias, mode)
    return out.reshape(*x.shape[:-1], n)
