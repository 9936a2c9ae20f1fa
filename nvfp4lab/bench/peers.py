"""Peers side by side: compressed-tensors' (and torchao's) NVFP4 quantize against nvfp4lab.

Times compressed-tensors' NVFP4 weight path (``generate_gparam`` + ``calculate_qparams`` +
``quantize_and_pack_fp4``) against ``nvfp4lab.quantize`` in both conventions, on the eager
pipeline and on the fused kernels (``nvfp4lab[<convention>]`` / ``nvfp4lab[<convention>, fused]``),
on the same seeded tensors, in the same process, interleaved round-robin, on one device; checks
they agree bit for bit and reports ratios. torchao's ``NVFP4Tensor.to_nvfp4`` is timed too when it
is installed. The fused kernels are compiled before the timing starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nvfp4lab.bench import timing
from nvfp4lab.bench.runner import bench_dtype, check_timing, seeded_randn
from nvfp4lab.bench.store import Measurement, measured_row
from nvfp4lab.vocab import OrderName, Scheme

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["PeerResult", "peer_rows", "run_peers"]

#: The reference peer's name in the results: the compressed-tensors library (its PyPI name),
#: not nvfp4lab's convention of the same name.
_CT_PEER = "compressed-tensors"


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
        timings = timing.time_interleaved(impls, warmup=warmup, repeats=repeats, device=device)
        t_ct = timings[_CT_PEER].median_s
        for name, t in timings.items():
            match: bool | None = None
            agree: float | None = None
            if name.startswith("nvfp4lab"):
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
