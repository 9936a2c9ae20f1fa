"""Compiled NVFP4 graphs and the thin calls around them (no validation: internal API).

Each graph of :mod:`nvfp4lab.kernels.graphs` is compiled once per (kind, static configuration,
device type) with ``torch.compile(dynamic=True, fullgraph=True)``: dynamic in the number of blocks
NB, so a new shape never recompiles (a new dtype does, once). The callers in
:mod:`nvfp4lab.codec` and :mod:`nvfp4lab.tensor` have checked the inputs; here tensors are only
viewed as blocks, graphs run, and results are shaped back::

    block_stats(x, order)                  -> BlockStats (x as blocks, statistic, amax)
    (caller)  amax -> NaN/Inf check, global scale gs (the codec's own rules)
    encode(stats, gs, order)               -> packed uint8 [..., K/2], scales e4m3 [..., K/16]
    fake_quantize(stats, gs, order)        -> x_hat, x.dtype [..., K]
    decode(packed, scales, t, dtype, rule) -> value·(s/t) or value·(s·t), dtype [..., K]

``order`` is an :class:`~nvfp4lab.orders.ArithmeticOrder` the graphs support
(:func:`nvfp4lab.kernels.graphs.supports`), ``rule`` a :class:`~nvfp4lab.orders.DecodeRule`.

Inductor options are scoped to each compiled function (``torch.compile(options=...)``), never set
globally. CPU: 256-bit vectors for the compare/select-heavy float graphs (inductor's 512-bit code
moves masks between k-registers and vectors around every ``where`` and ran up to 2x slower),
the default width for the integer packing and the decode (1.8-3.5x faster there). Every CPU graph
is compiled thread-count independent (``cpp.dynamic_threads``): otherwise inductor specializes
each kernel, and its cache entry, on ``torch.get_num_threads()``, and the notebooks (1 thread)
and a 2-thread process would each compile, and cache, their own copy (measured: no difference
in speed at 1 thread, 8192² bf16). CUDA: Triton
divides with ``div.full.f32`` (approximate) and flushes denormals by default; eager CUDA divides
with IEEE rounding and keeps denormals, so every graph asks for ``div_rn`` and no flush to zero.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from nvfp4lab.constants import BLOCK_SIZE, E2M1_MAX
from nvfp4lab.kernels import cache
from nvfp4lab.kernels.graphs import GRAPHS
from nvfp4lab.orders import ArithmeticOrder, DecodeRule

__all__ = [
    "CHUNK_BLOCKS",
    "CPU_OPTIONS",
    "GPU_OPTIONS",
    "HUGE_OUTPUT_BYTES",
    "BlockStats",
    "balanced",
    "block_stats",
    "compiled",
    "decode",
    "encode",
    "fake_quantize",
    "fresh",
]

#: Blocks per compiled call on the CPU: bounds quantize's code-byte intermediate to 16 MiB, under
#: glibc's 32 MiB mmap threshold, so it is reused from the heap instead of page-faulted in on
#: every call. Smaller chunks measured slower (each call costs ~35 us of guards and launch).
CHUNK_BLOCKS: int = 1 << 20

#: Inductor options per graph kind on the CPU (see the module docstring).
CPU_OPTIONS: dict[str, dict[str, Any]] = {
    "stats": {"cpp.simdlen": 256, "cpp.dynamic_threads": True},
    "codes": {"cpp.simdlen": 256, "cpp.dynamic_threads": True},
    "fake": {"cpp.simdlen": 256, "cpp.dynamic_threads": True},
    "pack": {"cpp.dynamic_threads": True},
    "decode": {"cpp.dynamic_threads": True},
}

#: Inductor options of every graph on CUDA (Triton): eager's division rounding and denormals.
GPU_OPTIONS: dict[str, Any] = {
    "eager_numerics.division_rounding": True,
    "eager_numerics.disable_ftz": True,
}

#: CPU outputs of at least this many bytes get the transparent-huge-page hint (:func:`fresh`):
#: glibc's largest mmap threshold, so with the default allocator every such block is a fresh
#: mapping of its own, never part of the heap.
HUGE_OUTPUT_BYTES: int = 1 << 25

_HALF = BLOCK_SIZE // 2
_HUGE_PAGE = 1 << 21


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` (Linux with ``MADV_HUGEPAGE``), else None."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def fresh(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape)`` for a fused call's output. On a Linux CPU, an output of at least
    :data:`HUGE_OUTPUT_BYTES` is first advised ``MADV_HUGEPAGE`` on its 2 MiB-aligned interior
    (the hint torch itself gives with ``THP_MEM_ALLOC_ENABLE=1``), before anything touches it:
    the kernel then faults it in 2 MiB pages, 64 faults instead of 32,768 for 128 MiB. A fresh
    8192² bf16 output measured 2.8x ``copy_`` with 4 KiB pages and 1.2x with the hint on this
    2-core VM (THP ``madvise`` mode). Where THP is off the hint does nothing."""
    out = torch.empty(shape, dtype=dtype, device=device)
    advise = _madvise() if out.device.type == "cpu" else None
    nbytes = out.numel() * out.element_size()
    if advise is not None and nbytes >= HUGE_OUTPUT_BYTES:
        start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        stop = (out.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if stop > start:
            advise(start, stop - start, mmap.MADV_HUGEPAGE)  # a refusal only loses the hint
    return out


def _static_name(value: object) -> str:
    """A static argument's part of a compiled function's name (an order's or a rule's name)."""
    return str(getattr(value, "name", value)).lower()


@functools.cache
def compiled(kind: str, static: tuple[Any, ...], device_type: str) -> Callable[..., Any]:
    """Graph ``kind`` compiled for ``device_type``, its static trailing arguments ``static``.

    Each (kind, static, device type) gets its own function *and code object*: dynamo's
    recompile limit (8 per code object) then only counts the dtypes of one configuration. Every
    call runs under ``torch.no_grad()`` (the graphs compute codes, scales and decoded values, never
    gradients): dynamo guards on the grad mode, and the three dtypes called with grad on, under
    ``no_grad`` and under ``inference_mode`` were nine variants, past the limit (the ninth call
    raised ``FailOnRecompileLimitHit``); now they are at most six.
    """
    base = GRAPHS[kind]

    def graph(*tensors: torch.Tensor) -> Any:
        return base(*tensors, *static)

    name = "_".join([kind, *map(_static_name, static), device_type]).replace("-", "_")
    graph.__code__ = graph.__code__.replace(co_name=f"nvfp4_{name}")
    cache.prepare()  # inductor's cache directory, before anything compiles
    options = dict(CPU_OPTIONS[kind]) if device_type == "cpu" else dict(GPU_OPTIONS)
    compiled_graph = torch.compile(graph, dynamic=True, fullgraph=True, options=options or None)

    @functools.wraps(graph)
    def run(*tensors: torch.Tensor) -> Any:
        with torch.no_grad():
            return compiled_graph(*tensors)

    return run


def balanced(total: int, most: int) -> Iterator[slice]:
    """``range(total)`` in equal-as-possible parts of at most ``most``; for ``total >= 2`` and
    ``most >= 3`` no part has size 1 (inductor would compile a separate size-1 specialization)."""
    parts = -(-total // max(most, 1))
    for i in range(parts):
        yield slice(total * i // parts, total * (i + 1) // parts)


def _chunks(nb: int, device: torch.device) -> Iterator[slice]:
    """Block ranges of one compiled call each (one call for the whole tensor off the CPU)."""
    return balanced(nb, CHUNK_BLOCKS if device.type == "cpu" else nb)


def _blocks(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as ``[-1, width]`` without a ``_base``: a graph input that is a view makes dynamo
    guard on its base's sizes (one recompile per base shape); ``detach()`` drops the base."""
    return t.reshape(-1, width).detach()


class BlockStats(NamedTuple):
    """The first pass over ``x``: its blocks, their statistic and the tensor's amax."""

    blocks: torch.Tensor  #: x as [NB, 16], x.dtype
    stat: torch.Tensor  #: [NB], x.dtype: block amax, or amax/6 in x.dtype (see graphs)
    amax: torch.Tensor  #: 0-d, x.dtype: max |x| (NaN/Inf propagate)
    shape: torch.Size  #: the shape of x [..., K], K a multiple of 16


def block_stats(x: torch.Tensor, order: ArithmeticOrder) -> BlockStats:
    """Block statistics of ``x`` [..., K] (fp32/bf16/fp16, K % 16 == 0, non-empty)."""
    xb = _blocks(x, BLOCK_SIZE)
    divisor = torch.full((1,), E2M1_MAX, dtype=x.dtype, device=x.device)
    stat, amax = compiled("stats", (order,), x.device.type)(xb, divisor)
    cache.note_ran(x.device.type, x.dtype, ("stats",))
    return BlockStats(xb, stat, amax, x.shape)


def encode(
    stats: BlockStats, global_scale: torch.Tensor, order: ArithmeticOrder
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., K/2], float8_e4m3fn scales [..., K/16]) of ``stats``' tensor with the
    float32 [1] ENCODE ``global_scale``; bit for bit the eager codec's."""
    xb, dev = stats.blocks, stats.blocks.device
    lead, k = stats.shape[:-1], stats.shape[-1]
    packed = fresh((*lead, k // 2), torch.uint8, dev)
    scales = fresh((*lead, k // BLOCK_SIZE), torch.uint8, dev)
    packed_b, scales_b = _blocks(packed.view(torch.int32), 2), scales.view(-1).detach()
    codes_graph = compiled("codes", (order,), dev.type)
    pack_graph = compiled("pack", (), dev.type)
    rgs = torch.reciprocal(global_scale)
    codes = torch.empty((min(xb.shape[0], CHUNK_BLOCKS), BLOCK_SIZE), dtype=torch.uint8, device=dev)
    for part in _chunks(xb.shape[0], dev):
        c = codes[: part.stop - part.start].detach()
        codes_graph(xb[part].detach(), stats.stat[part].detach(), global_scale, rgs, c,
                    scales_b[part].detach())
        pack_graph(c, packed_b[part].detach())
    cache.note_ran(dev.type, xb.dtype, ("codes", "pack"))
    return packed, scales.view(torch.float8_e4m3fn)


def fake_quantize(
    stats: BlockStats,
    global_scale: torch.Tensor,
    order: ArithmeticOrder,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dequantize(quantize(x))`` of ``stats``' tensor in x.dtype and x.shape (into ``out``, a
    contiguous tensor of that shape and dtype, when given)."""
    xb = stats.blocks
    if out is None:
        out = fresh(tuple(stats.shape), xb.dtype, xb.device)
    out_b = _blocks(out, BLOCK_SIZE)
    graph = compiled("fake", (order,), xb.device.type)
    rgs = torch.reciprocal(global_scale)
    for part in _chunks(xb.shape[0], xb.device):
        graph(xb[part].detach(), stats.stat[part].detach(), global_scale, rgs,
              out_b[part].detach())
    cache.note_ran(xb.device.type, xb.dtype, ("fake",))
    return out


def decode(
    packed: torch.Tensor,
    scales: torch.Tensor,
    tensor_scale: torch.Tensor,
    dtype: torch.dtype,
    *,
    rule: DecodeRule = DecodeRule.SCALE_OVER_ENCODE,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode ``packed`` uint8 [..., K/2] with E4M3 ``scales`` [..., K/16] (float8_e4m3fn or
    its uint8 bytes) to ``dtype`` [..., K]: ``value(code)·(s / t)`` (``SCALE_OVER_ENCODE``, ``t``
    the float32 [1] ENCODE global scale) or ``value(code)·(s·t)`` (``SCALE_TIMES_DECODE``, ``t`` a
    DECODE scale) in float32, one rounding to ``dtype``. ``out``: a contiguous result buffer."""
    if out is None:
        out = fresh((*packed.shape[:-1], packed.shape[-1] * 2), dtype, packed.device)
    packed_b = _blocks(packed, _HALF)
    bytes_b = scales.view(torch.uint8).reshape(-1).detach()
    out_b = _blocks(out, BLOCK_SIZE)
    t = tensor_scale.detach().to(device=packed.device, dtype=torch.float32).reshape(1)
    graph = compiled("decode", (rule,), packed.device.type)
    for part in _chunks(packed_b.shape[0], packed.device):
        graph(packed_b[part].detach(), bytes_b[part].detach(), t, out_b[part].detach())
    cache.note_ran(packed.device.type, out.dtype, ("decode",))
    return out
