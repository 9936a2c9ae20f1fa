"""llama.cpp's CPU arithmetic for NVFP4 weights (ggml type 40), bit for bit: the ``q8_0`` backend.

What llama.cpp computes for ``y = W x`` with an NVFP4 weight on a CPU (llama.cpp@0c1e57098, the
copy llama-cpp-python 0.3.36 vendors; its wheel is built with ``GGML_NATIVE=OFF, GGML_AVX2=ON,
GGML_FMA=ON, GGML_F16C=ON``, so the AVX2 branches below are the code that runs on x86):

1. **The dot type.** ``type_traits_cpu[GGML_TYPE_NVFP4]`` has ``vec_dot =
   ggml_vec_dot_nvfp4_q8_0`` and ``vec_dot_type = GGML_TYPE_Q8_0`` (ggml-cpu/ggml-cpu.c).
   ``ggml_compute_forward_mul_mat`` converts every activation row (F32) with
   ``type_traits_cpu[Q8_0].from_float`` and then calls ``vec_dot`` once per output value over the
   whole row (``nrows = 1``; ``ggml_compute_forward_mul_mat_one_chunk``). ``llamafile_sgemm``
   (ggml-cpu/llamafile/sgemm.cpp) has no NVFP4 case and the CPU repack buffers none, so nothing
   else takes the product.
2. **Q8_0 activations** (:func:`quantize_q8_0`; ``quantize_row_q8_0`` in
   ggml-cpu/arch/x86/quants.c, AVX/AVX2 branch), per 32 values in float32: ``amax = max|x|``,
   ``d = amax / 127.f`` stored as fp16 (``_cvtss_sh(d, 0)``: round to nearest even),
   ``id = 127.f / amax`` (0 when amax is 0), codes ``_mm256_round_ps(x * id,
   _MM_ROUND_NEAREST)`` (round half to even), packed to int8 with saturation. This is NOT
   ``quantize_row_q8_0_ref`` (ggml-quants.c: ``id = 1/d`` and ``roundf``, half away from zero),
   which ``ggml_quantize_chunk(GGML_TYPE_Q8_0, ...)`` and the generic (non-x86) build use.
3. **The dot** (:func:`vec_dot_nvfp4_q8_0`; ``ggml_vec_dot_nvfp4_q8_0`` in
   ggml-cpu/arch/x86/quants.c, ``__AVX2__`` branch). Per 64-value block ``ib`` and each of its
   two Q8_0 blocks: the weight codes become ``kvalues`` (E2M1 doubled: 0, 1, 2, 3, 4, 6, 8, 12
   with sign), ``mul_add_epi8`` + ``_mm256_madd_epi16`` give 8 int32 lanes, lane ``l`` the exact
   sum of the 4 products of values ``4l .. 4l+3`` of that Q8_0 block; lanes 0-3 take the scale of
   the first 16-value sub-block, lanes 4-7 of the second, each scale ``s = UE4M3(d_sub) * d_q8``
   (one float32 product; ``GGML_CPU_UE4M3_TO_FP32`` is the halved UE4M3 value, ggml-impl.h
   ``ggml_ue4m3_to_fp32``), and ``accum[l] = fma(s, (float) lane, accum[l])`` (one rounding),
   first block then second, ``ib`` in order. At the end ``hsum_float_8``:
   ``((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))``.

   The generic version (``ggml_vec_dot_nvfp4_q8_0_generic``, ggml-cpu/quants.c, used by builds
   without a native one) sums in another order: one integer sum per 16-value sub-block and
   ``sumf += dy * d * sumi`` sub-block after sub-block. :mod:`nvfp4lab.oracles.ggml` has both;
   this module follows the AVX2 one, the code the wheel runs.
4. **The tensor scale** is not in the blocks: the graph multiplies the product by the
   ``<name>.scale`` sidecar in float32 (``build_lora_mm``: ``ggml_mul(res, w_s)``,
   src/llama-graph.cpp). ``<name>.input_scale`` is loaded and never used (src/llama-model.cpp):
   activations are quantized per 32 values whatever the checkpoint says.

How this module reproduces it: integer sums per 4 values are exact in any order (float64
``bmm``); the scales are float32 products as in C; ``fma`` is computed exactly (the float64 sum
rounded to odd, then to float32: one rounding of the exact ``s * lane + acc``, Boldo & Melquiond's
emulation of FMA); the 8 lanes and the final horizontal sum follow the source's order. The result
equals ``ggml_vec_dot_nvfp4_q8_0`` bit for bit (tests/peers/test_llama_cpp_cpu.py) and the slow
oracle in :mod:`nvfp4lab.oracles.ggml` (tests/execution/test_ggml_cpu.py).

**The native path.** That torch code is the readable reference, and slow (exact FMAs from float64
tensors). Where nvfp4lab's native library builds and the tensors are CPU and contiguous,
:func:`quantize_q8_0`, :func:`vec_dot_nvfp4_q8_0` and :func:`mul_mat` run the same arithmetic in
C++ instead (:mod:`nvfp4lab.kernels.ggml_dot`: ggml's lane order and FMAs, AVX-512 / AVX2 /
scalar picked at run time), bit for bit the torch code's (tests/kernels/test_ggml_dot.py). Each
takes ``native``: None (default) picks it where usable, False runs the torch reference, True
insists (ValueError where it cannot run).
"""

from __future__ import annotations

import torch

from nvfp4lab.constants import BLOCK_SIZE, GGML_NVFP4_BLOCK, GGML_Q8_0_BLOCK
from nvfp4lab.kernels import ggml_dot

__all__ = [
    "KVALUES",
    "LANES",
    "fma_f32",
    "mul_mat",
    "q8_0_blocks",
    "quantize_q8_0",
    "ue4m3_values",
    "vec_dot_nvfp4_q8_0",
]

#: ggml's ``kvalues_mxfp4`` (ggml-common.h): the E2M1 code (sign in bit 3) -> twice its value.
KVALUES: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
#: Float lanes of the AVX2 accumulator (one ``__m256``).
LANES: int = 8
#: Values whose products one int32 lane sums (``_mm256_madd_epi16`` of ``maddubs`` pairs).
_GROUP: int = 4
#: Values of x per chunk of the dot product: bounds the [M, N, K/4] intermediates (~64 MiB).
_CHUNK_ELEMENTS: int = 1 << 23


def _check_finite(x: torch.Tensor, what: str) -> None:
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        raise ValueError(
            f"{what} holds {bad} non-finite values; ggml's Q8_0 quantizer is only modelled for "
            "finite inputs (replace NaN/Inf first, e.g. torch.nan_to_num)"
        )


def _native(native: bool | None, *tensors: torch.Tensor) -> bool:
    """Whether to run :mod:`nvfp4lab.kernels.ggml_dot` (module docstring, "The native path")."""
    if native is None:
        return ggml_dot.usable(*tensors)
    if native and not ggml_dot.usable(*tensors):
        where = ", ".join(f"{t.device.type}{'' if t.is_contiguous() else ' strided'}"
                          for t in tensors)
        raise ValueError(
            f"native=True needs the native library and CPU contiguous tensors, got {where} "
            f"(library available: {ggml_dot.available()}); pass native=None or False"
        )
    return native


def quantize_q8_0(
    x: torch.Tensor, *, native: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` float32 ``[..., K]`` (K a multiple of 32, finite) -> ggml's Q8_0 on x86 AVX2.

    Returns ``codes`` int8 ``[..., K]`` and ``scales`` float16 ``[..., K/32]`` (the stored ``d``):
    per 32 values ``d = fp16(amax / 127)``, codes ``round_half_even(x * (127 / amax))`` in float32
    (module docstring, step 2). TypeError for another dtype (convert with ``.float()``: ggml's
    activations are F32), ValueError for K or non-finite values. ``native``: the C++ kernel
    (None: where usable; False: this torch code).
    """
    if x.dtype != torch.float32:
        raise TypeError(
            f"quantize_q8_0 expects float32 activations (ggml's F32 rows), got {x.dtype}; "
            "convert with .float()"
        )
    if x.ndim == 0 or x.shape[-1] % GGML_Q8_0_BLOCK:
        raise ValueError(
            f"quantize_q8_0 needs [..., K] with K a multiple of {GGML_Q8_0_BLOCK}, got shape "
            f"{tuple(x.shape)}"
        )
    if _native(native, x):
        return ggml_dot.quantize_q8_0(x)
    _check_finite(x, "quantize_q8_0's input")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // GGML_Q8_0_BLOCK, GGML_Q8_0_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # tensor / tensor: one IEEE division (``127 / tensor`` in torch is reciprocal-then-multiply)
    d = torch.div(amax, torch.full_like(amax, 127.0))
    inv = torch.where(amax != 0, torch.div(torch.full_like(amax, 127.0), amax), 0.0)
    codes = torch.round(blocks * inv.unsqueeze(-1)).clamp_(-128, 127).to(torch.int8)
    return codes.reshape(x.shape), d.to(torch.float16)


def q8_0_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(codes int8 ``[..., K]``, scales float16 ``[..., K/32]``) -> ggml ``block_q8_0`` bytes
    uint8 ``[..., K/32 * 34]``: per block the fp16 ``d`` (little-endian) then the 32 codes."""
    lead = codes.shape[:-1]
    n = codes.shape[-1] // GGML_Q8_0_BLOCK
    d = scales.contiguous().view(torch.uint8).reshape(*lead, n, 2)
    qs = codes.contiguous().view(torch.uint8).reshape(*lead, n, GGML_Q8_0_BLOCK)
    return torch.cat((d, qs), dim=-1).reshape(*lead, n * (GGML_Q8_0_BLOCK + 2))


def _ue4m3_bit_rule(b: torch.Tensor) -> torch.Tensor:
    """``ggml_ue4m3_to_fp32`` of int32 bytes ``b`` by its bit rule (float32)."""
    exp, man = (b >> 3) & 0xF, (b & 0x7).to(torch.float32)
    normal = torch.ldexp(1.0 + man / 8.0, (exp - 7).to(torch.float32))
    raw = torch.where(exp == 0, man * 2.0**-9, normal)
    return torch.where((b == 0) | (b == 0x7F), 0.0, raw) * 0.5


#: ``ggml_table_f32_ue4m3`` (ggml-cpu.c fills it in ``ggml_cpu_init``): every byte's value.
_UE4M3_TABLE: torch.Tensor = _ue4m3_bit_rule(torch.arange(256, dtype=torch.int32))
#: A packed code byte (low nibble = first value) -> its two kvalues, float64 [256, 2].
_KVALUE_PAIRS: torch.Tensor = torch.tensor(
    [[KVALUES[b & 0xF], KVALUES[b >> 4]] for b in range(256)], dtype=torch.float64
)


def ue4m3_values(scales: torch.Tensor) -> torch.Tensor:
    """ggml's ``ggml_ue4m3_to_fp32`` of each scale byte (float32, same shape): the UE4M3 value
    HALVED (the codes are doubled), bytes 0 and 0x7F read as 0 and the sign bit ignored.

    ``scales``: ``torch.float8_e4m3fn`` (the bytes are used) or uint8.
    """
    b = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    return _UE4M3_TABLE.to(b.device)[b.long()]


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded ONCE to float32 (an IEEE fused multiply-add), for float32 tensors
    whose product ``a * b`` is exact in float64 (``b`` an integer below 2^29 here).

    The float64 sum is rounded to odd (its error found exactly by TwoSum, the last bit set when
    inexact) and then to float32: with 53 >= 24 + 2 bits that equals rounding the exact sum once
    (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums", IEEE TC 2008).
    """
    p = a.to(torch.float64) * b.to(torch.float64)
    q = c.to(torch.float64)
    t = p + q
    bp = t - p
    err = (p - (t - bp)) + (q - bp)
    even = (t.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(torch.float64)
    t = torch.where((err != 0) & even, torch.nextafter(t, toward), t)
    return t.to(torch.float32)


def _weight_operands(
    codes: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kvalues float64 [N, K], halved UE4M3 float32 [N, K/16]) of a packed NVFP4 weight."""
    pairs = _KVALUE_PAIRS.to(codes.device)[codes.long()]  # [N, K/2, 2]: elements 2i, 2i + 1
    return pairs.reshape(codes.shape[0], 2 * codes.shape[1]), ue4m3_values(scales)


def _dot_chunk(
    kv: torch.Tensor, sub: torch.Tensor, q8: torch.Tensor, dy: torch.Tensor
) -> torch.Tensor:
    """The AVX2 dot for activation rows ``q8`` int8 [M, K] (scales ``dy`` float32 [M, K/32])
    against every weight row: float32 [M, N]."""
    n, k = kv.shape
    m, nb = q8.shape[0], k // GGML_NVFP4_BLOCK
    groups = k // _GROUP
    # exact integer sums of 4 products: [K/4, M, N], group g = 16 ib + 8 half + lane
    lane_sums = torch.bmm(
        q8.to(torch.float64).reshape(m, groups, _GROUP).transpose(0, 1),
        kv.reshape(n, groups, _GROUP).permute(1, 2, 0),
    ).reshape(nb, 2, LANES, m, n)
    # lane l of half h of block ib takes sub-block 2h + l // 4; s = UE4M3 * d_q8 in float32
    per_lane = sub.reshape(n, nb, 2, 2).repeat_interleave(LANES // 2, dim=-1)  # [N, nb, 2, 8]
    acc = torch.zeros(m, n, LANES, dtype=torch.float32, device=kv.device)
    dy = dy.reshape(m, nb, 2)
    for ib in range(nb):
        for half in range(2):
            s = per_lane[:, ib, half].unsqueeze(0) * dy[:, ib, half].reshape(m, 1, 1)
            acc = fma_f32(s, lane_sums[ib, half].permute(1, 2, 0), acc)
    pairs = acc[..., 4:] + acc[..., :4]  # hsum_float_8: (a4+a0), (a5+a1), (a6+a2), (a7+a3)
    return (pairs[..., 0] + pairs[..., 2]) + (pairs[..., 1] + pairs[..., 3])


def _check_weight(codes: torch.Tensor, scales: torch.Tensor) -> int:
    if codes.dtype != torch.uint8 or codes.ndim != 2:
        raise TypeError(
            f"NVFP4 weight codes must be uint8 [N, K/2], got {codes.dtype} {tuple(codes.shape)}"
        )
    k = 2 * codes.shape[1]
    if tuple(scales.shape) != (codes.shape[0], k // BLOCK_SIZE) or k % BLOCK_SIZE:
        raise ValueError(
            f"NVFP4 weight scales must be [N, K/16] = [{codes.shape[0]}, {k // BLOCK_SIZE}], got "
            f"{tuple(scales.shape)}"
        )
    if k % GGML_NVFP4_BLOCK:
        raise ValueError(
            f"llama.cpp's NVFP4 blocks hold {GGML_NVFP4_BLOCK} values: K={k} is not a multiple "
            f"of {GGML_NVFP4_BLOCK}, so llama.cpp cannot hold this weight as NVFP4; run it on "
            "another backend (emulation, w4a16)"
        )
    return k


def vec_dot_nvfp4_q8_0(
    codes: torch.Tensor, scales: torch.Tensor, q8: torch.Tensor, q8_scales: torch.Tensor, *,
    native: bool | None = None,
) -> torch.Tensor:
    """``ggml_vec_dot_nvfp4_q8_0`` (AVX2) of every activation row with every weight row.

    ``codes`` uint8 ``[N, K/2]`` (nvfp4lab's packing) and ``scales`` E4M3 ``[N, K/16]``: the
    weight without its tensor scale; ``q8`` int8 ``[M, K]`` and ``q8_scales`` float16
    ``[M, K/32]`` from :func:`quantize_q8_0`. Returns float32 ``[M, N]``, bit for bit what ggml
    writes (module docstring, step 3). K must be a multiple of 64. ``native``: as in
    :func:`quantize_q8_0`.
    """
    k = _check_weight(codes, scales)
    if q8.dtype != torch.int8 or q8.ndim != 2 or q8.shape[1] != k:
        raise ValueError(f"q8 must be int8 [M, {k}], got {q8.dtype} {tuple(q8.shape)}")
    if (q8_scales.dtype != torch.float16
            or tuple(q8_scales.shape) != (q8.shape[0], k // GGML_Q8_0_BLOCK)):
        raise ValueError(
            f"q8_scales must be float16 [M, K/32] = [{q8.shape[0]}, {k // GGML_Q8_0_BLOCK}] "
            f"(ggml's stored d, as quantize_q8_0 gives it), got {q8_scales.dtype} "
            f"{tuple(q8_scales.shape)}"
        )
    if _native(native, codes, scales, q8, q8_scales):
        return ggml_dot.mul_mat(q8, q8_scales, codes, scales.view(torch.uint8))
    kv, sub = _weight_operands(codes, scales)
    dy = q8_scales.to(torch.float32)
    rows = max(1, _CHUNK_ELEMENTS // max(1, codes.shape[0] * k // _GROUP))
    parts = [
        _dot_chunk(kv, sub, q8[i : i + rows], dy[i : i + rows]) for i in range(0, q8.shape[0], rows)
    ]
    if not parts:
        return torch.zeros(0, codes.shape[0], dtype=torch.float32, device=codes.device)
    return torch.cat(parts)


def mul_mat(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, native: bool | None = None
) -> torch.Tensor:
    """llama.cpp's CPU ``ggml_mul_mat`` of an NVFP4 weight (no tensor scale) with F32 rows:
    ``x`` float32 ``[M, K]`` -> Q8_0 -> :func:`vec_dot_nvfp4_q8_0`: float32 ``[M, N]``.
    ``native``: the C++ kernels for both steps (None: where usable, i.e. every tensor on the CPU
    and contiguous; False: the torch reference)."""
    _check_weight(codes, scales)
    if _native(native, x, codes, scales) and x.dtype == torch.float32 and x.ndim == 2:
        return ggml_dot.linear(x, codes, scales.view(torch.uint8))
    q8, d = quantize_q8_0(x, native=native)
    return vec_dot_nvfp4_q8_0(codes, scales, q8, d, native=native)
