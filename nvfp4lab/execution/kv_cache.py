"""The KV cache as vLLM 0.33 writes and reads it: ``--kv-cache-dtype nvfp4 | nvfp4_4over6 | fp8``
(or ``fp8_e4m3``, vLLM's other name of ``fp8``: :data:`KIND_ALIASES`).

vLLM quantizes K and V as they are stored (K after RoPE: the model applies the rotary embedding
before ``Attention.forward``) and attention reads them back; this module computes both, so a
study can see exactly what attention sees (:func:`fake_quantize_kv`) or hold the bytes a page
holds (:func:`pack`, :func:`unpack`). The facts, with their sources, are in ``docs/kv_cache.md``;
in short:

**Scales.** One scale per side and layer, the DECODE scale vLLM keeps as ``layer._k_scale`` /
``layer._v_scale`` (float32): the checkpoint's ``k_scale`` / ``v_scale`` when it has them, else
1.0 (:func:`kv_global_scale`). Nothing is computed from the data. Every ``global_scale`` argument
here is that DECODE scale: a value is read back as ``code * block_scale * global_scale``
(NVFP4) or ``byte * global_scale`` (FP8).

**NVFP4 write** (``nvfp4``), per 16 consecutive values of one head: the ENCODE scale
``gs = f32(1 / global_scale)``; the kernel order of :mod:`nvfp4lab.orders` at ``gs``: block scale
``s = e4m3(clamp(gs * (amax * f32(1/6)), -448, 448))``, codes ``RNE_E2M1(clamp(x * (1 / (s *
(1/gs))), -6, 6))`` (0 where ``s == 0``). ``nvfp4_4over6`` also forms the candidate that maps the
block max to 4 (``amax * 0.25``) and keeps it when its squared reconstruction error is lower.

**NVFP4 read**: ``f32(f32(value * s) * global_scale)`` (``value * s`` is exact), then ``dtype``.

**FP8 write** (``fp8`` = ``fp8_e4m3``): ``e4m3(clamp(f32(x / global_scale), -448, 448))``, a true
float32 division and round-to-nearest-even, saturating; **read**: ``f32(e4m3 * global_scale)``.

**Layout.** ``nvfp4``: a page side (K or V) holds every row's codes, then every row's block
scales: ``[K data | K scale | V data | V scale]`` per page, ``head_size/2 + head_size/16`` bytes
per row on average (:func:`packed_dim`, vLLM's ``nvfp4_kv_cache_full_dim``). Two E2M1 codes per
byte, the lower-indexed element in the LOW nibble; one E4M3 byte per 16 values along
``head_size``. :func:`pack` lays a tensor out that way with dim 0 as pages (see there).
``fp8``: one E4M3 byte per value.

What is not modelled: the 4x4 swizzle vLLM's SM100 writer applies to block scales for the
trtllm-gen kernels (scales here are linear, as ``nvfp4_split_data_scale`` views them); the FP8
query (``QuantFP8``, ``x / q_scale``) that SM100 attention uses with these caches; ROCm's fnuz
scale doubling. ``docs/kv_cache.md`` says which of the 4over6 details could not be read at
v0.33.0 (the error's precision and the tie rule are nvfp4lab's stated choices).

=========================  ===================================================================
function                   does
=========================  ===================================================================
:func:`pack`               the bytes vLLM stores: uint8 ``[..., packed_dim]``
:func:`unpack`             what attention reads from those bytes: ``[..., head_size]``
:func:`fake_quantize_kv`   ``unpack(pack(x))`` in ``x.dtype``, without the bytes (the fast path)
:func:`split_packed`       codes and block scales of NVFP4 pages
:func:`kv_global_scale`    the (k, v) DECODE scales vLLM 0.33 uses, from a checkpoint's scales
:func:`kv_encode_scale`    the ENCODE scale the NVFP4 write multiplies by
:func:`kv_cache_kind`      a kind name (vLLM's aliases too) as a :class:`KVCacheKind`
:func:`packed_dim`         bytes per row of one side
=========================  ===================================================================

The slow oracle is :mod:`nvfp4lab.oracles.kv_cache` (``kv_quantize_nvfp4``, ``kv_quantize_fp8``,
``kv_read_nvfp4``, ``kv_read_fp8``, ``kv_fake_quantize``, ``kv_page_bytes``).
"""

from __future__ import annotations

import math
import numbers

import torch

from nvfp4lab.blocks import block_scales_from_blocks, encode_blocks
from nvfp4lab.constants import BLOCK_SIZE, E2M1_MAX, E4M3_MAX
from nvfp4lab.e2m1 import decode_e2m1, pack_fp4, unpack_fp4
from nvfp4lab.orders import KERNEL_MAX_GLOBAL_SCALE
from nvfp4lab.vocab import SUPPORTED_DTYPES, KVCacheKind, OrderName, check_choice

__all__ = [
    "FOUR_OVER_SIX_TARGET",
    "KIND_ALIASES",
    "KV_BLOCK_SIZE",
    "fake_quantize_kv",
    "kv_cache_kind",
    "kv_encode_scale",
    "kv_global_scale",
    "pack",
    "packed_dim",
    "split_packed",
    "unpack",
]

#: Values per E4M3 block scale along ``head_size``.
KV_BLOCK_SIZE: int = BLOCK_SIZE
#: The value ``nvfp4_4over6``'s second candidate maps a block max to (the first maps it to 6).
FOUR_OVER_SIX_TARGET: float = 4.0
#: Data bytes + scale bytes per 16 values of an NVFP4 row: 8 + 1.
_NVFP4_BYTES_PER_BLOCK = KV_BLOCK_SIZE // 2 + 1

_NVFP4_KINDS = (KVCacheKind.NVFP4, KVCacheKind.NVFP4_4OVER6)

#: Other names vLLM 0.33's ``--kv-cache-dtype`` gives a modelled kind (``CacheDType`` in
#: ``vllm/config/cache.py`` lists ``fp8`` and ``fp8_e4m3``: both are the E4M3 cache on CUDA).
KIND_ALIASES: dict[str, KVCacheKind] = {"fp8_e4m3": KVCacheKind.FP8}


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------


def kv_cache_kind(kind: str, what: str = "KV cache kind") -> KVCacheKind:
    """``kind`` as a :class:`~nvfp4lab.vocab.KVCacheKind`: one of its values, or a name of
    :data:`KIND_ALIASES` (``fp8_e4m3`` -> ``fp8``). Anything else raises ValueError
    ``unknown <what> ...`` listing the accepted names."""
    if isinstance(kind, str) and kind in KIND_ALIASES:
        return KIND_ALIASES[kind]
    try:
        return check_choice(what, kind, KVCacheKind)  # type: ignore[return-value]
    except ValueError as err:
        aliases = ", ".join(f"{a!r} (= {k.value!r})" for a, k in KIND_ALIASES.items())
        raise ValueError(f"{err}, or vLLM's alias {aliases}") from None


def _check_x(x: torch.Tensor, kind: KVCacheKind) -> None:
    """ValueError unless ``x`` is a finite fp32/bf16/fp16 tensor ``[..., head_size]``."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor [..., head_size], got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"x must be float32, bfloat16 or float16, got {x.dtype}; convert it with .float()"
        )
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension (head_size), got a 0-d tensor")
    head_size = x.shape[-1]
    if kind in _NVFP4_KINDS and (head_size == 0 or head_size % KV_BLOCK_SIZE):
        raise ValueError(
            f"an NVFP4 KV cache needs head_size a multiple of {KV_BLOCK_SIZE}, got head_size "
            f"{head_size} (shape {tuple(x.shape)}); pad the head dimension"
        )
    if x.numel() and not bool(torch.isfinite(x).all()):
        bad = ~torch.isfinite(x)
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"x holds {int(bad.sum())} NaN/Inf value(s), first at index {first} (value "
            f"{x[first].item()}); the cache write has no defined result for them: clean x first"
        )


def _decode_scale(
    global_scale: float | torch.Tensor, kind: KVCacheKind, device: torch.device, writing: bool
) -> torch.Tensor:
    """``global_scale`` (the DECODE scale) as a float32 ``[1]`` tensor on ``device``, checked."""
    if isinstance(global_scale, torch.Tensor):
        if global_scale.numel() != 1:
            raise ValueError(
                f"global_scale must hold one element (one scale per side and layer), got shape "
                f"{tuple(global_scale.shape)}; pass k_scale or v_scale"
            )
        value = float(global_scale.detach().reshape(()).to("cpu", torch.float64))
    elif isinstance(global_scale, numbers.Real) and not isinstance(global_scale, bool):
        value = float(global_scale)
    else:
        raise ValueError(
            f"global_scale must be a real number or a one-element tensor, got "
            f"{type(global_scale).__name__}"
        )
    d = torch.tensor([value], dtype=torch.float32, device=device)
    f32 = float(d)
    if not (math.isfinite(f32) and f32 > 0):
        raise ValueError(
            f"global_scale must be a finite DECODE scale > 0 (vLLM's k_scale / v_scale; 1.0 "
            f"when the checkpoint has none), got {value}"
        )
    if writing and kind in _NVFP4_KINDS and kv_encode_scale(f32) > KERNEL_MAX_GLOBAL_SCALE:
        raise ValueError(
            f"global_scale {value} is too small for an NVFP4 write: its ENCODE scale 1/{value} "
            f"exceeds 2**116; pass a DECODE scale >= 2**-116"
        )
    return d


# --------------------------------------------------------------------------------------------
# scales
# --------------------------------------------------------------------------------------------


def packed_dim(head_size: int, kind: str = KVCacheKind.NVFP4) -> int:
    """Bytes per row (one head of one token) of one side: ``head_size/2 + head_size/16`` for the
    NVFP4 kinds (vLLM's ``nvfp4_kv_cache_full_dim``), ``head_size`` for ``fp8``."""
    k = kv_cache_kind(kind)
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size <= 0:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    if k is KVCacheKind.FP8:
        return head_size
    if head_size % KV_BLOCK_SIZE:
        raise ValueError(
            f"an NVFP4 KV cache needs head_size a multiple of {KV_BLOCK_SIZE}, got {head_size}"
        )
    return head_size // 2 + head_size // KV_BLOCK_SIZE


def _scale_value(
    name: str, scale: float | torch.Tensor | None, kind: KVCacheKind | None = None
) -> float | None:
    """``scale`` (a checkpoint's ``k_scale`` / ``v_scale``, None: absent) as a float32 value,
    checked: one element, finite, > 0, its float32 reciprocal finite (what the cache write
    divides by) and, for an NVFP4 ``kind``, that reciprocal within the write's 2**116."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"{name} must be one per-tensor scale, got shape {tuple(scale.shape)}; vLLM "
                "0.33 supports per-tensor KV scales only"
            )
        scale = float(scale.detach().reshape(()).to("cpu", torch.float64))
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"{name} must be a real number or None, got {type(scale).__name__}")
    value = float(torch.tensor(float(scale), dtype=torch.float32))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{name} must be finite and > 0, got {scale}; leave it None when the checkpoint "
            "has none (vLLM then uses 1.0)"
        )
    inverse = kv_encode_scale(value)  # f32(1 / f32(value)): what the write multiplies by
    if not math.isfinite(inverse):
        raise ValueError(
            f"{name} {scale} is too small: its reciprocal (what the cache write multiplies or "
            "divides by) overflows float32; pass a DECODE scale >= 2**-127"
        )
    if kind in _NVFP4_KINDS and inverse > KERNEL_MAX_GLOBAL_SCALE:
        raise ValueError(
            f"{name} {scale} is too small for an {kind.value} KV cache: its ENCODE scale "
            f"1/{scale} exceeds 2**116; pass a DECODE scale >= 2**-116"
        )
    return value


def kv_global_scale(
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    kind: str | None = None,
) -> tuple[float, float]:
    """The (K, V) DECODE scales vLLM 0.33 writes and reads the cache with, as float32 values.

    ``k_scale`` / ``v_scale``: a checkpoint's per-tensor scales of one attention layer (None:
    absent). vLLM (``BaseKVCacheMethod.process_weights_after_loading``,
    ``model_executor/layers/quantization/kv_cache.py``) uses them as they are; with neither, 1.0
    for both; a single ``kv_scale`` (loaded as ``k_scale``) serves both sides. It computes no
    scale from the data. A ``v_scale`` without a ``k_scale`` fails vLLM's assertion and raises
    ValueError here. The NVFP4 write multiplies by :func:`kv_encode_scale` of these; ROCm's fnuz
    doubling is not modelled. Each scale must be finite, > 0 and have a finite float32
    reciprocal; with ``kind`` (a cache kind), also one that kind can be written with (NVFP4: an
    ENCODE scale within 2**116). ValueError otherwise, naming the scale and its value.
    """
    cache_kind = None if kind is None else kv_cache_kind(kind)
    k = _scale_value("k_scale", k_scale, cache_kind)
    v = _scale_value("v_scale", v_scale, cache_kind)
    if k is None and v is None:
        return 1.0, 1.0
    if k is None:
        raise ValueError(
            "a v_scale without a k_scale: vLLM 0.33 asserts k_scale > 0 here; pass k_scale too "
            "(a checkpoint's single kv_scale is loaded as k_scale)"
        )
    return (k, k) if v is None else (k, v)


def kv_encode_scale(global_scale: float | torch.Tensor) -> float:
    """The ENCODE scale an NVFP4 write multiplies by: ``f32(1 / f32(global_scale))`` (the CUDA
    writer's ``1.0f / *k_scale_ptr``); ``global_scale`` is the DECODE scale."""
    d = _decode_scale(global_scale, KVCacheKind.FP8, torch.device("cpu"), writing=False)
    return float(torch.ones_like(d) / d)


# --------------------------------------------------------------------------------------------
# the arithmetic
# --------------------------------------------------------------------------------------------


def _nvfp4_read(codes: torch.Tensor, scales: torch.Tensor, decode: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., nb, 16]``: ``f32(f32(value * s) * decode)`` (``value * s`` is exact)."""
    values = decode_e2m1(codes, torch.float32)
    values *= scales.unsqueeze(-1)
    values *= decode
    return values


def _block_errors(
    blocks: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, decode: torch.Tensor
) -> torch.Tensor:
    """float32 ``[..., nb]``: per block ``sum (x - read)**2``, each step rounded to float32 and
    the 16 terms added in element order (the oracle's order, so ties are decided alike)."""
    diff = blocks.to(torch.float32) - _nvfp4_read(codes, scales, decode)
    squares = diff.mul_(diff)
    err = squares[..., 0].clone()
    for i in range(1, KV_BLOCK_SIZE):
        err += squares[..., i]
    return err


def _nvfp4_write(
    x: torch.Tensor, decode: torch.Tensor, four_over_six: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 ``[..., nb, 16]``, float32 E4M3 block scales ``[..., nb]``) of ``x``."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // KV_BLOCK_SIZE, KV_BLOCK_SIZE)
    encode = torch.ones_like(decode) / decode  # f32(1/d): the writer's 1.0f / k_scale
    scales = block_scales_from_blocks(blocks, encode, OrderName.VLLM_KERNEL, target=E2M1_MAX)
    codes = encode_blocks(blocks, scales, encode, OrderName.VLLM_KERNEL)
    if not four_over_six:
        return codes, scales
    scales4 = block_scales_from_blocks(blocks, encode, OrderName.VLLM_KERNEL,
                                       target=FOUR_OVER_SIX_TARGET)
    codes4 = encode_blocks(blocks, scales4, encode, OrderName.VLLM_KERNEL)
    use4 = _block_errors(blocks, codes4, scales4, decode) < _block_errors(
        blocks, codes, scales, decode
    )
    return torch.where(use4.unsqueeze(-1), codes4, codes), torch.where(use4, scales4, scales)


def _fp8_write(x: torch.Tensor, decode: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn ``e4m3(clamp(f32(x / decode), -448, 448))`` (true division, RNE)."""
    return (x.to(torch.float32) / decode).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


# --------------------------------------------------------------------------------------------
# page layout
# --------------------------------------------------------------------------------------------


def _to_pages(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., D/2 + D/16]``: per page (dim 0) every row's data, then every row's scales."""
    if data.ndim == 1:
        return torch.cat((data, scales))
    pages = data.shape[0]  # sizes spelled out: a reshape to -1 is ambiguous with no rows
    flat = torch.cat((data.reshape(pages, math.prod(data.shape[1:])),
                      scales.reshape(pages, math.prod(scales.shape[1:]))), dim=1)
    return flat.reshape(*data.shape[:-1], data.shape[-1] + scales.shape[-1])


def _from_pages(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(data uint8 ``[..., D/2]``, scale bytes uint8 ``[..., D/16]``) of NVFP4 pages."""
    full = packed.shape[-1]
    data_dim = full // _NVFP4_BYTES_PER_BLOCK * (KV_BLOCK_SIZE // 2)
    lead = packed.shape[:-1]
    rows = math.prod(lead[1:]) if packed.ndim > 1 else 1
    pages = packed.reshape(1, full) if packed.ndim == 1 else packed.reshape(lead[0], rows * full)
    data = pages[:, : rows * data_dim].reshape(*lead, data_dim)
    scales = pages[:, rows * data_dim :].reshape(*lead, full - data_dim)
    return data, scales


def _check_packed(packed: torch.Tensor, kind: KVCacheKind) -> None:
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        got = packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise ValueError(f"packed must be a uint8 tensor (what pack returns), got {got}")
    if packed.ndim == 0:
        raise ValueError("packed must have at least one dimension, got a 0-d tensor")
    full = packed.shape[-1]
    if kind in _NVFP4_KINDS and (full == 0 or full % _NVFP4_BYTES_PER_BLOCK):
        raise ValueError(
            f"NVFP4 KV rows are head_size/2 + head_size/16 = {_NVFP4_BYTES_PER_BLOCK} bytes per "
            f"16 values, got a last dim of {full}; pass what pack returned for this kind"
        )


def split_packed(
    packed: torch.Tensor, kind: str = KVCacheKind.NVFP4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes uint8 ``[..., head_size]`` (4-bit, unpacked) and block scales float8_e4m3fn
    ``[..., head_size/16]`` of NVFP4 pages laid out as :func:`pack` writes them."""
    k = kv_cache_kind(kind)
    if k not in _NVFP4_KINDS:
        raise ValueError(f"split_packed reads NVFP4 pages, got kind {k.value!r}; fp8 has no scales")
    _check_packed(packed, k)
    data, scale_bytes = _from_pages(packed)
    return unpack_fp4(data), scale_bytes.view(torch.float8_e4m3fn)


# --------------------------------------------------------------------------------------------
# the public write / read
# --------------------------------------------------------------------------------------------


def pack(x: torch.Tensor, kind: str, global_scale: float | torch.Tensor) -> torch.Tensor:
    """The bytes vLLM 0.33 stores for ``x``: uint8 ``[..., packed_dim(head_size, kind)]``.

    ``x``: float32/bfloat16/float16 ``[..., head_size]``, finite; for the NVFP4 kinds
    ``head_size`` is a multiple of 16. ``kind``: a :class:`~nvfp4lab.vocab.KVCacheKind` value.
    ``global_scale``: the DECODE scale of this side (vLLM's ``k_scale`` or ``v_scale``, see
    :func:`kv_global_scale`), a number or a one-element tensor.

    ``fp8``: one E4M3 byte per value, same leading shape. NVFP4 kinds: dim 0 indexes pages of
    one side (K or V) and the dims between it and ``head_size`` are the page's rows in memory
    order (``[pages, block_size, heads, head_size]`` gives vLLM's NHD page, ``[pages, heads,
    block_size, head_size]`` its HND page); each page holds every row's packed codes (two per
    byte, lower index in the low nibble), then every row's E4M3 block-scale bytes, so
    ``out[p].reshape(-1)`` is the page side's bytes and ``out`` has the shape of vLLM's
    ``kv_cache[:, 0]`` view. A 2-d ``[rows, head_size]`` is one row per page (``[data |
    scales]`` per row); a 1-d ``x`` is one row. Scales are linear (not swizzled). Leading dims
    may be 0 (no pages, or pages of no rows): the result is as empty, and :func:`unpack` of it
    too.
    """
    k = kv_cache_kind(kind)
    _check_x(x, k)
    decode = _decode_scale(global_scale, k, x.device, writing=True)
    if k is KVCacheKind.FP8:
        return _fp8_write(x, decode).view(torch.uint8)
    codes, scales = _nvfp4_write(x, decode, four_over_six=k is KVCacheKind.NVFP4_4OVER6)
    data = pack_fp4(codes.reshape(x.shape))
    return _to_pages(data, scales.to(torch.float8_e4m3fn).view(torch.uint8))


def unpack(
    packed: torch.Tensor,
    kind: str,
    global_scale: float | torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """What attention reads from ``packed`` (as :func:`pack` lays it out): ``dtype``
    ``[..., head_size]``, the float32 read (``f32(f32(value * s) * global_scale)`` for NVFP4,
    ``f32(e4m3 * global_scale)`` for fp8) rounded once to ``dtype``. ``global_scale``: the
    DECODE scale the bytes were written with."""
    k = kv_cache_kind(kind)
    _check_packed(packed, k)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"dtype must be float32, bfloat16 or float16, got {dtype}; pass dtype=torch.float32"
        )
    decode = _decode_scale(global_scale, k, packed.device, writing=False)
    if k is KVCacheKind.FP8:
        return (packed.view(torch.float8_e4m3fn).to(torch.float32) * decode).to(dtype)
    codes, scales = split_packed(packed, k)
    blocks = codes.reshape(*codes.shape[:-1], codes.shape[-1] // KV_BLOCK_SIZE, KV_BLOCK_SIZE)
    read = _nvfp4_read(blocks, scales.to(torch.float32), decode)
    return read.reshape(codes.shape).to(dtype)


def fake_quantize_kv(
    x: torch.Tensor, kind: str, global_scale: float | torch.Tensor
) -> torch.Tensor:
    """What attention reads back after vLLM 0.33 writes ``x`` to a ``kind`` KV cache, in
    ``x.dtype`` and ``x``'s shape: ``unpack(pack(x, kind, s), kind, s, dtype=x.dtype)`` without
    building the bytes. Arguments as :func:`pack` (``global_scale`` is the DECODE scale)."""
    k = kv_cache_kind(kind)
    _check_x(x, k)
    decode = _decode_scale(global_scale, k, x.device, writing=True)
    if k is KVCacheKind.FP8:
        return (_fp8_write(x, decode).to(torch.float32) * decode).to(x.dtype)
    codes, scales = _nvfp4_write(x, decode, four_over_six=k is KVCacheKind.NVFP4_4OVER6)
    return _nvfp4_read(codes, scales, decode).reshape(x.shape).to(x.dtype)
