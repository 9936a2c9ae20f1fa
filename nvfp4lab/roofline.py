"""A roofline model of the NVFP4 execution paths on catalogued GPUs, and model layer shapes.

``predict(gpu, M, N, K, path)`` for ``y[M, N] = x[M, K] @ W[N, K]^T``:
``time = max(flops / (peak · eff), bytes / (bandwidth · mem_eff))`` with efficiency factors stated
per path in :data:`EFFICIENCY` (defaults cited from published measurements) and per GPU in
:data:`GPU_EFFICIENCY` where a GPU has its own published measurement (:data:`MEASUREMENTS`: B200,
B300, RTX 5090); :func:`efficiency_for` says which applies. ``peak_tflops=`` supplies a peak the
vendor does not publish. Paths are named after the backends (:class:`nvfp4lab.vocab.GemmPath`:
``bf16``, ``fp8``, ``native``, ``w4a16``, ``emulation``, ``q8_0``). The emulation path adds the
time of its separate dequantize / quant-dequant passes to the 16-bit GEMM, so it is never faster
than ``bf16``. ``q8_0`` is llama.cpp's int8-activation GEMM as its CUDA MMQ runs it on a GPU
(Q8_1 activations, 1.125 B per value, float32 in and out); it runs on INT8 math, whose peak the
catalogue does not hold, so it needs ``peak_tflops=``.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from nvfp4lab.gpus import GPU, get, normalize_name
from nvfp4lab.vocab import GemmPath, check_choice

__all__ = [
    "EFFICIENCY",
    "GPU_EFFICIENCY",
    "MEASUREMENTS",
    "MODEL_SHAPES",
    "NVFP4_BYTES_PER_WEIGHT",
    "PATHS",
    "PUBLISHED",
    "Efficiency",
    "LinearShape",
    "Measurement",
    "NotSupportedError",
    "Prediction",
    "default_m_grid",
    "efficiency_for",
    "linear_shapes",
    "predict",
    "predict_block",
    "supported_paths",
]

#: Every roofline path, in plotting order.
PATHS: tuple[str, ...] = tuple(GemmPath)

#: 4-bit element + one 8-bit E4M3 scale per 16 elements = 4.5 bits = 0.5625 bytes per element.
NVFP4_BYTES_PER_WEIGHT: float = 0.5625
#: Bytes per element of the 16-bit (bf16/fp16) activations, outputs and dequantized weights.
BYTES_16BIT: float = 2.0
#: Bytes per element of an FP8 operand.
BYTES_FP8: float = 1.0
#: Bytes per element of llama.cpp's float32 activations and outputs.
BYTES_F32: float = 4.0
#: llama.cpp's MMQ activation blocks (``block_q8_1_mmq``, ggml-cuda/mmq.cuh): 128 int8 codes and
#: four float32 scales in 144 bytes = 1.125 bytes per value.
BYTES_Q8_1_MMQ: float = 144.0 / 128.0


class NotSupportedError(ValueError):
    """A path the GPU cannot run (e.g. ``native`` without FP4 tensor cores)."""


@dataclass(frozen=True)
class Efficiency:
    """Fraction of the dense peak (``compute``) and of the memory bandwidth (``memory``) a path
    reaches, with where each number comes from."""

    compute: float
    memory: float
    compute_source: str
    memory_source: str


_MEM_EFF = 0.8
_MEM_SRC = (
    "assumption: 80% of peak DRAM bandwidth (no published bandwidth measurement is catalogued; "
    "well-tuned streaming kernels typically reach 75-90%)"
)
_BF16_EFF = 1420.0 / 2250.0
_BF16_SRC = "B200 torch BF16 GEMM 8192^3: 1,420 of 2,250 TFLOPS = 0.63 (pytorch/ao PR #2427)"

#: Default efficiency factors per path; override per call with ``efficiency=``/``mem_efficiency=``.
EFFICIENCY: dict[str, Efficiency] = {
    GemmPath.BF16: Efficiency(_BF16_EFF, _MEM_EFF, _BF16_SRC, _MEM_SRC),
    GemmPath.FP8: Efficiency(
        _BF16_EFF,
        _MEM_EFF,
        "assumed equal to BF16's 0.63 (no published FP8 GEMM measurement is catalogued)",
        _MEM_SRC,
    ),
    GemmPath.NATIVE: Efficiency(
        5370.0 / 9000.0,
        _MEM_EFF,
        "B200 torch._scaled_mm NVFP4 8192^3: 5,370 of 9,000 TFLOPS = 0.60 (pytorch/ao PR #2427); "
        "GPUs with their own measurement use it instead (GPU_EFFICIENCY)",
        _MEM_SRC,
    ),
    GemmPath.W4A16: Efficiency(
        _BF16_EFF, _MEM_EFF, "16-bit tensor-core math: BF16's 0.63 (" + _BF16_SRC + ")", _MEM_SRC
    ),
    GemmPath.EMULATION: Efficiency(
        _BF16_EFF, _MEM_EFF, "its GEMM is a BF16 GEMM: BF16's 0.63 (" + _BF16_SRC + ")", _MEM_SRC
    ),
    GemmPath.Q8_0: Efficiency(
        _BF16_EFF,
        _MEM_EFF,
        "assumed equal to BF16's 0.63 (no published llama.cpp MMQ measurement is catalogued)",
        _MEM_SRC,
    ),
}

#: Paths whose GEMM runs on the 16-bit tensor cores: a GPU's BF16 measurement applies to all.
_BF16_MATH_PATHS: tuple[str, ...] = (GemmPath.BF16, GemmPath.W4A16, GemmPath.EMULATION)


#: The published measurements, one per row, each with its source (loaded at import).
PUBLISHED_PATH: Path = Path(__file__).with_name("published.csv")


@dataclass(frozen=True)
class Measurement:
    """A published, measured rate of one GEMM path on one GPU, with its source.

    ``figure`` in ``unit``: "TFLOPS" (10^12 FLOP/s of 2·M·N·K) or "TB/s weights" (10^12 B/s
    counting only the packed FP4 weight bytes N·K/2). ``M``/``N``/``K``: the GEMM shape, None when
    the source gives none (a model's mix of GEMMs, an mma loop). ``activation_quant``: whether
    the activation quantization was inside the timed region ("yes", "no", "unknown", "" for
    unquantized paths). ``sets_efficiency``: the figure sets this GPU's own compute efficiency
    in :func:`predict` (kernel-only, large compute-bound GEMMs). ``caveat``: what to keep in mind.
    """

    gpu: str
    path: str
    M: int | None
    N: int | None
    K: int | None
    figure: float
    unit: str
    activation_quant: str
    sets_efficiency: bool
    source: str
    caveat: str = ""

    @property
    def time_s(self) -> float | None:
        """The GEMM's time (seconds) implied by the figure, or None without a shape."""
        if self.M is None or self.N is None or self.K is None:
            return None
        if self.unit == "TB/s weights":
            return self.N * self.K * 0.5 / (self.figure * 1e12)
        return 2.0 * self.M * self.N * self.K / (self.figure * 1e12)

    @property
    def tflops(self) -> float:
        """Achieved 10^12 FLOP/s (converted from a bandwidth figure through the shape)."""
        time_s = self.time_s
        if self.unit == "TFLOPS" or time_s is None:
            return self.figure
        return 2.0 * self.M * self.N * self.K / time_s / 1e12  # type: ignore[operator]

    @property
    def peak_tflops(self) -> float:
        """The catalogue's dense peak of this path's math on this GPU."""
        peak = get(self.gpu).peak_tflops(self.path)
        if peak is None:
            raise NotSupportedError(f"{self.gpu} has no published peak for path {self.path!r}")
        return peak

    @property
    def compute(self) -> float:
        """Achieved fraction of the dense peak."""
        return self.tflops / self.peak_tflops

    @property
    def summary(self) -> str:
        """One line: GPU, path, shape, the rate against the peak, and the source."""
        shape = f" {self.M}x{self.N}x{self.K}" if self.M is not None else ""
        return (
            f"{self.gpu} {self.path}{shape}: {self.tflops:,.0f} of {self.peak_tflops:,.0f} "
            f"TFLOPS = {self.compute:.2f} ({self.source})"
        )


def _optional_int(text: str) -> int | None:
    return int(text) if text.strip() else None


def _load_published(path: Path) -> tuple[Measurement, ...]:
    with path.open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    return tuple(
        Measurement(
            gpu=get(row["gpu"]).name,
            path=str(check_choice("path", row["path"], GemmPath)),
            M=_optional_int(row["M"]),
            N=_optional_int(row["N"]),
            K=_optional_int(row["K"]),
            figure=float(row["figure"]),
            unit=row["unit"],
            activation_quant=row["activation_quant"],
            sets_efficiency=row["sets_efficiency"] == "yes",
            source=row["source"],
            caveat=row["caveat"],
        )
        for row in rows
    )


#: Every published measurement of ``published.csv``: the third kind of number, beside the
#: roofline's modeled ones and the shards measured by this software.
PUBLISHED: tuple[Measurement, ...] = _load_published(PUBLISHED_PATH)

#: The published measurements that set a GPU's own compute efficiency (kernel-only figures,
#: large compute-bound GEMMs).
MEASUREMENTS: tuple[Measurement, ...] = tuple(m for m in PUBLISHED if m.sets_efficiency)


def _gpu_efficiency() -> dict[tuple[str, str], Efficiency]:
    out: dict[tuple[str, str], Efficiency] = {}
    for m in MEASUREMENTS:
        paths = _BF16_MATH_PATHS if m.path == GemmPath.BF16 else (m.path,)
        for path in paths:
            base = EFFICIENCY[path]
            src = m.summary if path == m.path else f"its GEMM is 16-bit: {m.summary}"
            out[(m.gpu, path)] = Efficiency(m.compute, base.memory, src, base.memory_source)
    return out


#: Per-(GPU, path) efficiencies from that GPU's own published measurement (:data:`MEASUREMENTS`);
#: a BF16 measurement also sets ``w4a16`` and ``emulation`` (their GEMM is a 16-bit GEMM). Pairs
#: not listed fall back to :data:`EFFICIENCY` ``[path]``.
GPU_EFFICIENCY: dict[tuple[str, str], Efficiency] = _gpu_efficiency()


def efficiency_for(gpu: str | GPU, path: str) -> Efficiency:
    """The efficiency :func:`predict` uses by default for ``path`` on ``gpu``: the GPU's own
    published measurement (:data:`GPU_EFFICIENCY`) when there is one, else the path default
    (:data:`EFFICIENCY`)."""
    path = check_choice("path", path, GemmPath)
    g = get(gpu)
    return GPU_EFFICIENCY.get((g.name, path), EFFICIENCY[path])


@dataclass(frozen=True)
class Prediction:
    """Roofline estimate for ``y[M, N] = x[M, K] @ W[N, K]^T`` on one GPU and path.

    ``time_s`` seconds; ``bound`` "compute" or "memory"; ``flops`` = 2·M·N·K; ``bytes_moved``
    bytes of DRAM traffic assumed (all passes); ``tflops`` achieved 10^12 FLOP/s = flops/time;
    ``compute_time_s``/``memory_time_s`` the two roofline legs; ``passes_time_s`` the extra
    memory-bound passes that cannot overlap the GEMM (emulation only, else 0);
    ``efficiency_source`` says where the compute efficiency came from.
    """

    gpu: str
    path: str
    M: int
    N: int
    K: int
    time_s: float
    bound: str
    flops: float
    bytes_moved: float
    tflops: float
    compute_time_s: float
    memory_time_s: float
    passes_time_s: float
    peak_tflops: float
    bandwidth_tb_s: float
    efficiency: float
    mem_efficiency: float
    efficiency_source: str = ""

    @property
    def gb_s(self) -> float:
        """Effective bandwidth, 10^9 bytes/s (bytes moved / time)."""
        return self.bytes_moved / self.time_s / 1e9

    def as_dict(self) -> dict[str, object]:
        """Fields plus ``gb_s`` as a flat dict (a table row)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["gb_s"] = self.gb_s
        return out


def _bytes(path: str, M: int, N: int, K: int, quantize_activations: bool) -> tuple[float, float]:
    """(GEMM bytes, extra-pass bytes) of DRAM traffic for one path; see :func:`predict`."""
    x16, w16, y16 = M * K * BYTES_16BIT, N * K * BYTES_16BIT, M * N * BYTES_16BIT
    if path == GemmPath.BF16:
        return x16 + w16 + y16, 0.0
    if path == GemmPath.FP8:
        x8 = M * K * BYTES_FP8
        quant = (x16 + x8) if quantize_activations else 0.0  # read bf16 x, write fp8 x
        return x8 + N * K * BYTES_FP8 + y16 + quant, 0.0
    if path == GemmPath.NATIVE:
        x4 = M * K * NVFP4_BYTES_PER_WEIGHT
        quant = (x16 + x4) if quantize_activations else 0.0
        return x4 + N * K * NVFP4_BYTES_PER_WEIGHT + y16 + quant, 0.0
    if path == GemmPath.W4A16:
        return x16 + N * K * NVFP4_BYTES_PER_WEIGHT + y16, 0.0
    if path == GemmPath.EMULATION:
        # weight dequantize pass: read packed+scales, write 16-bit W;
        # activation quant-dequant pass: read x, write x_dq (both 16-bit).
        passes = N * K * NVFP4_BYTES_PER_WEIGHT + w16
        if quantize_activations:
            passes += 2 * x16
        return x16 + w16 + y16, passes
    if path == GemmPath.Q8_0:
        # llama.cpp: float32 x read and Q8_1 x written by the quantize kernel; the GEMM reads
        # Q8_1 x and the NVFP4 blocks (36 B per 64 = 0.5625 B) and writes float32 y.
        xq = M * K * BYTES_Q8_1_MMQ
        quant = (M * K * BYTES_F32 + xq) if quantize_activations else 0.0
        return xq + N * K * NVFP4_BYTES_PER_WEIGHT + M * N * BYTES_F32 + quant, 0.0
    raise AssertionError(path)  # unreachable: every GemmPath is handled above


def predict(
    gpu: str | GPU,
    M: int,
    N: int,
    K: int,
    path: str,
    *,
    efficiency: float | None = None,
    mem_efficiency: float | None = None,
    peak_tflops: float | None = None,
    quantize_activations: bool = True,
) -> Prediction:
    """Roofline time of ``y[M, N] = x[M, K] @ W[N, K]^T`` on ``gpu`` via ``path``.

    ``time = max(2MNK / (peak · efficiency), gemm_bytes / (bandwidth · mem_efficiency))``, plus,
    for ``emulation``, ``pass_bytes / (bandwidth · mem_efficiency)`` for its separate dequantize
    passes. Bytes per path (16-bit = 2 B, FP8 = 1 B, NVFP4 = 0.5625 B per element):

    - ``bf16``: x, W and y in 16 bit.
    - ``fp8``: FP8 x and W, 16-bit y (+ a bf16→fp8 activation pass if ``quantize_activations``).
    - ``native``: NVFP4 x and W, 16-bit y (+ activation quantize pass); needs FP4 tensor
      cores, else :class:`NotSupportedError`.
    - ``w4a16``: 16-bit x and y, NVFP4 W streamed (0.5625 B/weight), 16-bit math.
    - ``emulation``: a 16-bit GEMM after a weight dequantize pass (read NVFP4, write 16-bit W) and
      an activation quant-dequant pass (read and write 16-bit x) — never faster than ``bf16``.
    - ``q8_0``: llama.cpp's MMQ: Q8_1 x (1.125 B) and NVFP4 W, float32 y (+ the quantize pass:
      read float32 x, write Q8_1 x); INT8 math, no catalogued peak: needs ``peak_tflops``.

    ``efficiency``/``mem_efficiency`` default to :func:`efficiency_for` ``(gpu, path)``: the GPU's
    own published measurement where there is one (:data:`GPU_EFFICIENCY`), else the path default
    (:data:`EFFICIENCY`). ``peak_tflops`` (10^12 FLOP/s, dense) replaces the catalogue's peak for
    the path's math — for a peak the vendor does not publish (DGX Spark's BF16/FP8) or a figure of
    your own; the efficiency still applies (pass ``efficiency=1.0`` for an achieved rate). A path
    whose peak is unpublished and not given (e.g. BF16 on DGX Spark) or absent (FP8 on A100)
    raises :class:`NotSupportedError`; so does ``native`` without FP4 tensor cores, even
    with ``peak_tflops``.
    """
    g = get(gpu)
    path = check_choice("path", path, GemmPath)
    for label, v in (("M", M), ("N", N), ("K", K)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{label} must be a positive int, got {v!r}")
    if path == GemmPath.NATIVE and not g.native_fp4:
        raise NotSupportedError(
            f"{g.name} (cc {g.capability_str}) has no FP4 tensor cores, so path 'native' "
            "cannot run there; use 'w4a16' or 'emulation' (native FP4 needs cc >= 10.0)"
        )
    if peak_tflops is not None:
        peak = float(peak_tflops)
        if not (math.isfinite(peak) and peak > 0):
            raise ValueError(f"peak_tflops must be a positive finite number, got {peak_tflops!r}")
    else:
        catalogue_peak = g.peak_tflops(path)
        if catalogue_peak is None and path == GemmPath.Q8_0:
            raise NotSupportedError(
                f"path {path.value!r} (llama.cpp's int8-activation GEMM) runs on INT8 math, whose "
                f"dense peak the catalogue does not hold for {g.name}; pass "
                "peak_tflops=<dense INT8 TOPS> to predict to model it"
            )
        if catalogue_peak is None:
            raise NotSupportedError(
                f"{g.name} has no published dense peak for path {str(path)!r} "
                f"(bf16={g.bf16_tflops}, fp8={g.fp8_tflops}, nvfp4={g.nvfp4_tflops} TFLOPS); "
                "pass peak_tflops=<dense TFLOPS> to predict to model it with a figure of your own"
            )
        peak = catalogue_peak
    eff = efficiency_for(g, path)
    e_c = eff.compute if efficiency is None else float(efficiency)
    e_src = eff.compute_source if efficiency is None else "given: efficiency argument"
    e_m = eff.memory if mem_efficiency is None else float(mem_efficiency)
    for label, e in (("efficiency", e_c), ("mem_efficiency", e_m)):
        if not 0.0 < e <= 1.0:
            raise ValueError(f"{label} must be in (0, 1], got {e}")

    flops = 2.0 * M * N * K
    gemm_bytes, pass_bytes = _bytes(path, M, N, K, quantize_activations)
    bw = g.bandwidth_tb_s * 1e12 * e_m
    t_compute = flops / (peak * 1e12 * e_c)
    t_gemm_mem = gemm_bytes / bw
    t_passes = pass_bytes / bw
    time_s = max(t_compute, t_gemm_mem) + t_passes
    bound = "compute" if t_compute > t_gemm_mem + t_passes else "memory"
    return Prediction(
        gpu=g.name,
        path=path,
        M=M,
        N=N,
        K=K,
        time_s=time_s,
        bound=bound,
        flops=flops,
        bytes_moved=gemm_bytes + pass_bytes,
        tflops=flops / time_s / 1e12,
        compute_time_s=t_compute,
        memory_time_s=t_gemm_mem + t_passes,
        passes_time_s=t_passes,
        peak_tflops=peak,
        bandwidth_tb_s=g.bandwidth_tb_s,
        efficiency=e_c,
        mem_efficiency=e_m,
        efficiency_source=e_src,
    )


def supported_paths(gpu: str | GPU) -> list[str]:
    """Paths :func:`predict` can model on ``gpu`` (those with a published peak / FP4 cores)."""
    g = get(gpu)
    return [p for p in PATHS if g.peak_tflops(p) is not None]


# --------------------------------------------------------------------------------------------
# Model linear-layer shapes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearShape:
    """One linear layer of a transformer block: ``W[N, K]`` (out_features N, in_features K).
    ``count`` is how many such layers one block has (fused q/k/v and gate/up count as one)."""

    model: str
    layer: str
    N: int
    K: int
    count: int = 1


def _llama(
    model: str, hidden: int, inter: int, heads: int, kv_heads: int
) -> tuple[LinearShape, ...]:
    head_dim = hidden // heads
    return (
        LinearShape(model, "qkv_proj", hidden + 2 * kv_heads * head_dim, hidden),
        LinearShape(model, "o_proj", hidden, hidden),
        LinearShape(model, "gate_up_proj", 2 * inter, hidden),
        LinearShape(model, "down_proj", hidden, inter),
    )


#: Fused linear layers of one transformer block, from the models' config.json
#: (hidden_size, intermediate_size, num_attention_heads, num_key_value_heads):
#: Llama-3-8B 4096/14336/32/8, Llama-3-70B 8192/28672/64/8, Llama-3.1-405B 16384/53248/128/8.
MODEL_SHAPES: dict[str, tuple[LinearShape, ...]] = {
    "Llama-3-8B": _llama("Llama-3-8B", 4096, 14336, 32, 8),
    "Llama-3-70B": _llama("Llama-3-70B", 8192, 28672, 64, 8),
    "Llama-3.1-405B": _llama("Llama-3.1-405B", 16384, 53248, 128, 8),
}
_MODEL_INDEX = {normalize_name(k): k for k in MODEL_SHAPES}


def linear_shapes(model: str) -> tuple[LinearShape, ...]:
    """The fused linear layers (q/k/v, o, gate/up, down) of one block of ``model``.

    ``model`` is matched like GPU names ("llama-3-8b", "Llama 3 70B"); unknown → ValueError.
    """
    key = normalize_name(model)
    if key not in _MODEL_INDEX:
        raise ValueError(f"unknown model {model!r}; known models: {', '.join(MODEL_SHAPES)}")
    return MODEL_SHAPES[_MODEL_INDEX[key]]


def default_m_grid(lo: int = 1, hi: int = 16384) -> list[int]:
    """Powers of two from ``lo`` to ``hi`` inclusive (tokens per forward, M)."""
    if lo < 1 or hi < lo:
        raise ValueError(f"need 1 <= lo <= hi, got lo={lo}, hi={hi}")
    return [2**i for i in range(math.ceil(math.log2(lo)), math.floor(math.log2(hi)) + 1)]


def predict_block(
    gpu: str | GPU,
    model: str,
    M: int,
    path: str,
    **kwargs: float | bool | None,
) -> Prediction:
    """Sum of :func:`predict` over the linear layers of one block of ``model`` at M tokens.

    Returns a :class:`Prediction` with ``N``/``K`` = 0 (several shapes), summed times, flops
    and bytes, and ``bound`` = the bound of the layers that take most of the time.
    """
    parts = [
        predict(gpu, M, s.N, s.K, path, **kwargs)  # type: ignore[arg-type]
        for s in linear_shapes(model)
        for _ in range(s.count)
    ]
    time_s = sum(p.time_s for p in parts)
    flops = sum(p.flops for p in parts)
    compute_share = sum(p.time_s for p in parts if p.bound == "compute")
    first = parts[0]
    return Prediction(
        gpu=first.gpu,
        path=path,
        M=M,
        N=0,
        K=0,
        time_s=time_s,
        bound="compute" if compute_share > time_s / 2 else "memory",
        flops=flops,
        bytes_moved=sum(p.bytes_moved for p in parts),
        tflops=flops / time_s / 1e12,
        compute_time_s=sum(p.compute_time_s for p in parts),
        memory_time_s=sum(p.memory_time_s for p in parts),
        passes_time_s=sum(p.passes_time_s for p in parts),
        peak_tflops=first.peak_tflops,
        bandwidth_tb_s=first.bandwidth_tb_s,
        efficiency=first.efficiency,
        mem_efficiency=first.mem_efficiency,
        efficiency_source=first.efficiency_source,
    )
