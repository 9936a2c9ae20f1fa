"""Peers side by side: compressed-tensors' (and torchao's) NVFP4 quantize against nvfp4lab.

Times compressed-tensors' NVFP4 weight path (``generate_gparam`` + ``calculate_qparams`` +
``quantize_and_pack_fp4``) against ``nvfp4lab.quantize`` in both conventions, on the eager
pipeline and on the fused kernels (``nvfp4lab[<convention>]`` / ``nvfp4lab[<convention>, fused]``),
on the same seeded tensors, in the same process, interleaved round-robin, on one device; checks
they agree bit for bit and reports ratios. torchao's ``NVFP4Tensor.to_nvfp4`` is timed too when it
is installed. The fused kernels are compiled before the timing starts.

llama.cpp's own quantizer is a peer too when llama-cpp-python is importable (its
``libggml-base.so`` through ctypes, the package itself never imported):
``ggml_quantize_chunk(GGML_TYPE_NVFP4 = 40)`` against ``nvfp4lab.quantize(convention="llama.cpp")``
on the same float32 rows (ggml reads float32 only), interleaved in the same rounds; a note gives
both in ns per element, their ratio, and whether nvfp4lab's codes and scales, laid out as ggml's
blocks (:func:`nvfp4lab.ggml_blocks.to_ggml_nvfp4`, outside the timing), equal ggml's bytes.
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nvfp4lab.bench import timing
from nvfp4lab.bench.runner import bench_dtype, check_timing, seeded_randn
from nvfp4lab.bench.store import Measurement, measured_row
from nvfp4lab.vocab import OrderName, Scheme

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["GGML_TYPE_NVFP4", "PeerResult", "ggml_nvfp4_quantizer", "peer_rows", "run_peers"]

#: The reference peer's name in the results: the compressed-tensors library (its PyPI name),
#: not nvfp4lab's convention of the same name.
_CT_PEER = "compressed-tensors"
#: ggml/include/ggml.h (llama.cpp@0c1e57098bba): the NVFP4 type.
GGML_TYPE_NVFP4 = 40
#: The ggml peer's and nvfp4lab's names in the results of that comparison.
_GGML_PEER = "ggml_quantize_chunk[nvfp4]"
_LLAMA_ORDER = "nvfp4lab[llama.cpp, fused]"


@dataclass(frozen=True)
class PeerResult:
    """One implementation's quantize time on one tensor ``[N, K]``.

    ``speedup_vs_ct`` = t(compressed-tensors) / t(this) (> 1: faster than CT); ``matches_ct``:
    packed codes and scales equal CT's bit for bit; ``code_agreement``: fraction of the 4-bit
    codes equal to CT's (the kernel order legitimately differs on a few; None: not compared).
    ``timing`` holds the samples (median, IQR, timer, device).
    """

    impl: str
    shape: tuple[int, int]
    dtype: str
    timing: timing.Timing
    speedup_vs_ct: float
    matches_ct: bool | None
    code_agreement: float | None
    path: str = ""  #: "eager" / "fused" for nvfp4lab's rows, "" for the peers

    @property
    def median_s(self) -> float:
        return self.timing.median_s

    @property
    def spread_s(self) -> float:
        return self.timing.spread_s

    @property
    def device(self) -> str:
        return self.timing.device

    @property
    def timer(self) -> str:
        return self.timing.method


def _ct_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors 0.20's NVFP4 weight path on ``x``'s device, ``x`` ``[N, K]``:
    ``generate_gparam`` → per-16 ``calculate_qparams`` → ``quantize_and_pack_fp4``.
    Returns (packed uint8 ``[N, K/2]``, float8_e4m3fn scales ``[N, K/16]``, global scale)."""
    import torch
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = preset_name_to_scheme(Scheme.NVFP4.value, ["Linear"]).weights
    gs = generate_gparam(*torch.aminmax(x))
    blocks = x.reshape(x.shape[0], x.shape[1] // 16, 16)
    bmin, bmax = torch.aminmax(blocks, dim=-1)
    scale, _ = calculate_qparams(bmin, bmax, args, global_scale=gs)
    packed = quantize_and_pack_fp4(x, scale, global_scale=gs, group_size=16)
    return packed, scale.to(torch.float8_e4m3fn), gs


def _torchao_quantizer() -> Callable[[torch.Tensor], Any] | None:
    """torchao's NVFP4 quantize (``NVFP4Tensor.to_nvfp4``) when torchao is installed."""
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import (  # type: ignore[import-not-found]
            NVFP4Tensor as AoNVFP4Tensor,
        )
    except ImportError:
        return None
    return AoNVFP4Tensor.to_nvfp4  # type: ignore[no-any-return]


def _torchao_closure(
    to_nvfp4: Callable[..., Any], x: torch.Tensor
) -> tuple[Callable[[], Any] | None, str | None]:
    """(closure quantizing ``x`` with torchao, note) — closure None when torchao fails on ``x``.

    compressed-tensors scales two-level (a per-tensor FP32 scale from the tensor's amax, then
    E4M3 block scales), so torchao is given a per-tensor scale too, computed inside the timed
    call like CT's: ``to_nvfp4(x, per_tensor_scale=amax / 2688)`` (torchao's DECODE form,
    2688 = 448 · 6). A ``to_nvfp4`` without that keyword is timed with block scales only, with a
    note saying its work is then not comparable.
    """
    import inspect

    import torch

    from nvfp4lab.constants import GLOBAL_SCALE_NUMERATOR

    try:
        params = inspect.signature(to_nvfp4).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    note: str | None = None
    if "per_tensor_scale" in params:

        def fn() -> Any:
            scale = x.abs().amax().to(torch.float32) / GLOBAL_SCALE_NUMERATOR
            return to_nvfp4(x, per_tensor_scale=scale)

    else:

        def fn() -> Any:
            return to_nvfp4(x)

        note = (
            "torchao's NVFP4Tensor.to_nvfp4 has no per_tensor_scale argument in this version: "
            "it was timed with block scales only, less work than compressed-tensors' two-level "
            "scaling, so its ratio is not like for like"
        )
    try:
        fn()
    except Exception as exc:  # any failure of a third-party peer: skip it, say why
        return None, (
            f"torchao's NVFP4Tensor.to_nvfp4 failed on a {tuple(x.shape)} {x.dtype} tensor on "
            f"{x.device} ({type(exc).__name__}: {exc}); torchao was skipped"
        )
    return fn, note


def ggml_nvfp4_quantizer() -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, str]:
    """(ggml's NVFP4 quantize, "") or (None, why not): the callable takes float32 rows
    ``[rows, K]`` (K a multiple of 64, contiguous, CPU) and returns ggml's blocks, uint8
    ``[rows, K/64*36]``, from ``ggml_quantize_chunk(GGML_TYPE_NVFP4, src, dst, 0, rows, K, NULL)``
    of llama-cpp-python's ``llama_cpp/lib/libggml-base.so`` (one thread, as ggml runs it)."""
    import torch

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None, ("llama-cpp-python is not importable: ggml's NVFP4 quantize was skipped "
                      "(`make test-peers` installs it; put its folder on PYTHONPATH)")
    path = Path(spec.origin).parent / "lib" / "libggml-base.so"
    if not path.is_file():
        return None, f"llama-cpp-python has no {path}: ggml's NVFP4 quantize was skipped"
    lib = ctypes.CDLL(str(path))
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_quantize_init.restype = None
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_init(GGML_TYPE_NVFP4)

    def quantize(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.ndim != 2 or x.shape[1] % 64 or not x.is_contiguous():
            raise ValueError(
                f"ggml's NVFP4 quantize takes contiguous float32 rows [rows, K], K a multiple of "
                f"64, got {x.dtype} {tuple(x.shape)}; pass x.float().contiguous()"
            )
        rows, k = x.shape
        dst = torch.empty((rows, lib.ggml_row_size(GGML_TYPE_NVFP4, k)), dtype=torch.uint8)
        lib.ggml_quantize_chunk(GGML_TYPE_NVFP4, x.data_ptr(), dst.data_ptr(), 0, rows, k, None)
        return dst

    return quantize, ""


def _ggml_note(
    timings: dict[str, timing.Timing], x: torch.Tensor, ggml_bytes: torch.Tensor,
    ours: Callable[[], Any],
) -> str:
    """One line: the llama.cpp order against ggml on the float32 rows ``x``, in ns per element,
    their ratio, and whether the bytes are equal."""
    import torch

    from nvfp4lab.ggml_blocks import to_ggml_nvfp4

    q = ours()
    equal = torch.equal(to_ggml_nvfp4(q.packed, q.scales), ggml_bytes)
    n = x.numel()
    t_ggml, t_ours = timings[_GGML_PEER].median_s, timings[_LLAMA_ORDER].median_s
    return (
        f"llama.cpp order vs ggml_quantize_chunk(type 40), {x.shape[0]}x{x.shape[1]} float32 "
        f"rows: nvfp4lab {t_ours * 1e9 / n:.3f} ns/element, ggml {t_ggml * 1e9 / n:.3f} "
        f"ns/element (one thread), ggml / nvfp4lab = {t_ggml / t_ours:.2f}x; "
        f"bytes {'equal' if equal else 'DIFFER'}"
    )


def run_peers(
    shapes: Sequence[tuple[int, int]],
    *,
    dtype: str = "bfloat16",
    warmup: int = 2,
    repeats: int = 7,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[list[PeerResult], list[str]]:
    """Time NVFP4 weight quantization of ``[N, K]`` tensors by compressed-tensors, nvfp4lab
    (both conventions, eager and fused) and torchao (if installed) on the same seeded tensors, in
    this process, interleaved round-robin (:func:`nvfp4lab.bench.timing.time_interleaved`).
    Returns (results, notes).

    The tensors are created on ``device`` and every implementation runs there; the one timing
    helper measures with CUDA events on a GPU and ``perf_counter`` on the CPU.
    """
    import torch

    from nvfp4lab.e2m1 import unpack_fp4

    check_timing(warmup, repeats)
    dt = bench_dtype(dtype)
    results: list[PeerResult] = []
    notes: list[str] = []
    ao = _torchao_quantizer()
    if ao is None:
        notes.append("torchao is not installed: its NVFP4Tensor was skipped")
    ggml, why = ggml_nvfp4_quantizer() if device == "cpu" else (None, "")
    if why:
        notes.append(why)
    for i, (N, K) in enumerate(shapes):
        x = seeded_randn((N, K), dt, seed + i, device)
        ref_packed, ref_scale, _ = _ct_quantize(x)
        ref_codes = unpack_fp4(ref_packed)
        impls: dict[str, Callable[[], Any]] = {_CT_PEER: lambda x=x: _ct_quantize(x)}
        impls.update(_nvfp4lab_impls(x))
        if ao is not None:
            ao_fn, ao_note = _torchao_closure(ao, x)
            if ao_note is not None and ao_note not in notes:
                notes.append(ao_note)
            if ao_fn is not None:
                impls["torchao"] = ao_fn
        rows = x.float().contiguous()  # ggml reads float32: both quantize these rows
        if ggml is not None and K % 64 == 0:
            from nvfp4lab.codec import quantize

            impls[_GGML_PEER] = lambda rows=rows: ggml(rows)
            # global_scale=1.0 is the order's own unit tensor scale (the same bytes); given, it
            # skips the codec's check for vanishing blocks (a block-max pass whenever
            # 1.0 < 1344 / amax, ordinary data in this order)
            impls[_LLAMA_ORDER] = lambda rows=rows: quantize(
                rows, 1.0, convention=OrderName.LLAMA_CPP)
        timings = timing.time_interleaved(impls, warmup=warmup, repeats=repeats, device=device)
        if _GGML_PEER in impls:
            notes.append(_ggml_note(timings, rows, ggml(rows), impls[_LLAMA_ORDER]))
        t_ct = timings[_CT_PEER].median_s
        for name, t in timings.items():
            match: bool | None = None
            agree: float | None = None
            if name in (_GGML_PEER, _LLAMA_ORDER):
                pass  # another order: compared with ggml's bytes (the note), not CT's
            elif name.startswith("nvfp4lab"):
                q = impls[name]()
                match = bool(
                    torch.equal(q.packed, ref_packed)
                    and torch.equal(q.scales.view(torch.uint8), ref_scale.view(torch.uint8))
                )
                agree = float((unpack_fp4(q.packed) == ref_codes).double().mean())
            elif name == _CT_PEER:
                match, agree = True, 1.0
            path = ""
            if name.startswith("nvfp4lab"):
                path = "fused" if name.endswith(", fused]") else "eager"
            results.append(
                PeerResult(name, (N, K), dtype, t, t_ct / t.median_s, match, agree, path)
            )
    return results, notes


def _nvfp4lab_impls(x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """nvfp4lab's quantize of ``x`` in both conventions, eager and fused (compiled here)."""
    from nvfp4lab.codec import quantize

    impls: dict[str, Callable[[], Any]] = {}
    for fused in (False, True):
        for conv in (str(OrderName.COMPRESSED_TENSORS), str(OrderName.VLLM_KERNEL)):
            name = f"nvfp4lab[{conv}{', fused' if fused else ''}]"
            impls[name] = lambda c=conv, f=fused: quantize(x, convention=c, fused=f)
            if fused:
                impls[name]()  # compile outside the timing
    return impls


def peer_rows(results: Sequence[PeerResult], env: dict[str, Any], seed: int) -> list[dict]:
    """Results rows (``op="peer_quantize"``, ``backend`` = the implementation) for the store."""
    rows = []
    for r in results:
        N, K = r.shape
        nbytes = N * K * 2 + N * K / 2 + N * K / 16
        rows.append(
            measured_row(
                Measurement(
                    op="peer_quantize", shape=f"{N}x{K}", M="", N=N, K=K, dtype=r.dtype,
                    backend=r.impl, convention="", timing=r.timing, nbytes=nbytes, path=r.path,
                ),
                env=env, seed=seed,
            )
        )
    return rows
