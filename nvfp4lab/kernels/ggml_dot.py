"""llama.cpp's CPU arithmetic for NVFP4 in C++: the ``q8_0`` backend's hot path.

``ggml_dot.cpp`` (part of nvfp4lab's native library, :mod:`nvfp4lab.kernels.native`) computes
what :mod:`nvfp4lab.execution.ggml_cpu` computes eagerly, bit for bit:

* :func:`quantize_q8_0`: float32 rows ``[..., K]`` -> Q8_0 (int8 codes, float16 ``d`` per 32
  values; ``quantize_row_q8_0``'s AVX2 arithmetic: half-to-even codes, ``d`` rounded to nearest
  even);
* :func:`mul_mat`: those rows times an NVFP4 weight (packed E2M1 codes ``[N, K/2]``, UE4M3 bytes
  ``[N, K/16]``, no tensor scale) -> float32 ``[M, N]``, each output
  ``ggml_vec_dot_nvfp4_q8_0``'s AVX2 float order: 8 exact int32 lanes per Q8_0 block, one
  float32 scale product and one FMA per lane and block, ggml's ``hsum_float_8``;
* :func:`linear`: both in one call (float32 rows -> float32 ``[M, N]``), what
  :func:`nvfp4lab.execution.ggml_cpu.mul_mat` runs on the CPU.

Vector paths (:data:`nvfp4lab.kernels.native.ISAS`), picked at run time: AVX-512 (two weight
rows per 512-bit vector), AVX2 (ggml's 8 lanes as one 256-bit vector), scalar (``std::fmaf``);
``path`` forces a narrower one (tests), ``NVFP4LAB_NATIVE_ISA`` caps it. Threads (OpenMP, default
torch's intra-op threads) split the weight rows.
"""

from __future__ import annotations

import torch

from nvfp4lab.constants import BLOCK_SIZE, GGML_NVFP4_BLOCK, GGML_Q8_0_BLOCK
from nvfp4lab.kernels.native import ISAS, library, required, vector_path

__all__ = ["available", "isa", "linear", "mul_mat", "quantize_q8_0", "usable"]


def available() -> bool:
    """Whether the native library (with this kernel) works here."""
    return library() is not None


def isa() -> str:
    """The vector path the kernel runs here (an entry of :data:`ISAS`: the best this CPU has,
    AVX2 needing FMA and F16C, AVX-512 F, BW and VL besides, capped by ``NVFP4LAB_NATIVE_ISA``);
    "" when the library is unavailable."""
    lib = library()
    return "" if lib is None else ISAS[min(lib.nvfp4lab_ggml_isa(), vector_path())]


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernel can take ``tensors`` as they are: all on the CPU and contiguous, and
    the library available."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and available()


def _threads(threads: int | None) -> int:
    return torch.get_num_threads() if threads is None else threads


def _non_finite(bad: int) -> ValueError:
    return ValueError(
        f"quantize_q8_0's input holds {bad} non-finite values; ggml's Q8_0 quantizer is only "
        "modelled for finite inputs (replace NaN/Inf first, e.g. torch.nan_to_num)"
    )


def quantize_q8_0(
    x: torch.Tensor, *, path: str | None = None, threads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 of CPU float32 ``x`` ``[..., K]`` (K a multiple of 32, finite): codes int8
    ``[..., K]`` and ``d`` float16 ``[..., K/32]``, bit for bit
    :func:`nvfp4lab.execution.ggml_cpu.quantize_q8_0`. ``path``: a vector path of :data:`ISAS`
    (clamped to the CPU and ``NVFP4LAB_NATIVE_ISA``); ``threads``: OpenMP threads. ValueError for
    another dtype or device, K, or non-finite values."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(
            f"the native Q8_0 quantize reads CPU float32, got {x.dtype} on {x.device}; convert "
            "with .float().cpu()"
        )
    if x.ndim == 0 or x.shape[-1] % GGML_Q8_0_BLOCK:
        raise ValueError(
            f"quantize_q8_0 needs [..., K] with K a multiple of {GGML_Q8_0_BLOCK}, got shape "
            f"{tuple(x.shape)}"
        )
    x = x.detach().contiguous()
    codes = torch.empty(x.shape, dtype=torch.int8)
    d = torch.empty((*x.shape[:-1], x.shape[-1] // GGML_Q8_0_BLOCK), dtype=torch.float16)
    bad = required().nvfp4lab_q8_0_quantize(
        x.data_ptr(), x.numel() // GGML_Q8_0_BLOCK, vector_path(path), _threads(threads),
        codes.data_ptr(), d.data_ptr())
    if bad:
        raise _non_finite(bad)
    return codes, d


def mul_mat(
    q8: torch.Tensor, d: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *,
    path: str | None = None, threads: int | None = None,
) -> torch.Tensor:
    """``ggml_vec_dot_nvfp4_q8_0`` of every Q8_0 row with every NVFP4 weight row: float32
    ``[M, N]``, bit for bit :func:`nvfp4lab.execution.ggml_cpu.vec_dot_nvfp4_q8_0`.

    ``q8`` int8 ``[M, K]`` and ``d`` float16 ``[M, K/32]`` (:func:`quantize_q8_0`); ``codes``
    uint8 ``[N, K/2]`` (element 2i in the low nibble of byte i) and ``scales`` E4M3 / uint8
    ``[N, K/16]``, no tensor scale; K a multiple of 64; all on the CPU. ``path``, ``threads``:
    as in :func:`quantize_q8_0`. ValueError for other dtypes, shapes or devices."""
    n, k = (codes.shape[0], 2 * codes.shape[1]) if codes.ndim == 2 else (-1, -1)
    m = q8.shape[0] if q8.ndim == 2 else -1
    if codes.dtype != torch.uint8 or n < 0 or k % GGML_NVFP4_BLOCK:
        raise ValueError(
            f"codes must be uint8 [N, K/2] with K a multiple of {GGML_NVFP4_BLOCK}, got "
            f"{codes.dtype} {tuple(codes.shape)}"
        )
    if tuple(scales.shape) != (n, k // BLOCK_SIZE) or scales.element_size() != 1:
        raise ValueError(
            f"scales must be one byte each, [N, K/16] = [{n}, {k // BLOCK_SIZE}], got "
            f"{scales.dtype} {tuple(scales.shape)}"
        )
    if q8.dtype != torch.int8 or m < 0 or q8.shape[1] != k:
        raise ValueError(f"q8 must be int8 [M, {k}], got {q8.dtype} {tuple(q8.shape)}")
    if d.dtype != torch.float16 or tuple(d.shape) != (m, k // GGML_Q8_0_BLOCK):
        raise ValueError(
            f"d must be float16 [M, K/32] = [{m}, {k // GGML_Q8_0_BLOCK}], got {d.dtype} "
            f"{tuple(d.shape)}"
        )
    tensors = (q8, d, codes, scales)
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("the native NVFP4 x Q8_0 dot reads CPU tensors; move them with .cpu()")
    q8, d, codes, scales = (t.detach().contiguous() for t in tensors)
    out = torch.empty((m, n), dtype=torch.float32)
    if m and n:
        required().nvfp4lab_nvfp4_q8_0_mul_mat(
            q8.data_ptr(), d.data_ptr(), m, codes.data_ptr(), scales.data_ptr(), n, k,
            vector_path(path), _threads(threads), out.data_ptr())
    return out


def linear(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, path: str | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """llama.cpp's CPU ``ggml_mul_mat``: CPU float32 ``x`` ``[M, K]`` -> Q8_0 -> the dot with
    the weight (``codes`` uint8 ``[N, K/2]``, ``scales`` one byte each ``[N, K/16]``, no tensor
    scale; K a multiple of 64): float32 ``[M, N]``, bit for bit :func:`quantize_q8_0` then
    :func:`mul_mat`, in one library call (the ``q8_0`` backend's per-Linear call: few checks).
    ValueError for other dtypes, shapes, devices, or non-finite ``x``."""
    m, k = x.shape if x.ndim == 2 else (-1, -1)
    n = codes.shape[0] if codes.ndim == 2 else -1
    if (x.dtype != torch.float32 or codes.dtype != torch.uint8 or scales.element_size() != 1
            or k < 0 or k % GGML_NVFP4_BLOCK or codes.shape != (n, k // 2)
            or scales.shape != (n, k // BLOCK_SIZE)):
        raise ValueError(
            f"linear needs x float32 [M, K] (K a multiple of {GGML_NVFP4_BLOCK}), codes uint8 "
            f"[N, K/2] and one-byte scales [N, K/16]; got x {x.dtype} {tuple(x.shape)}, codes "
            f"{codes.dtype} {tuple(codes.shape)}, scales {scales.dtype} {tuple(scales.shape)}"
        )
    if x.device.type != "cpu" or codes.device.type != "cpu" or scales.device.type != "cpu":
        raise ValueError("the native NVFP4 x Q8_0 linear reads CPU tensors; move them with .cpu()")
    x, codes, scales = x.contiguous(), codes.contiguous(), scales.contiguous()
    out = torch.empty((m, n), dtype=torch.float32)
    if m and n:
        bad = required().nvfp4lab_nvfp4_q8_0_linear(
            x.data_ptr(), m, codes.data_ptr(), scales.data_ptr(), n, k, vector_path(path),
            _threads(threads), out.data_ptr())
        if bad:
            raise _non_finite(bad)
    return out
