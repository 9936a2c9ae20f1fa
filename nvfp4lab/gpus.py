"""GPU catalogue, a roofline model of the NVFP4 execution paths, and model linear-layer shapes.

Catalogue
    Every figure is a DENSE peak (no 2:4 sparsity) as published, with the source it came from
    (``GPU.sources``). Ampere/Hopper/Ada datasheets print sparse numbers; those were halved.
    Units are in the field names: ``*_tflops`` (10^12 FLOP/s), ``memory_gb`` (10^9 B),
    ``bandwidth_tb_s`` (10^12 B/s). Figures a vendor does not publish are ``None``.

Lookup
    :func:`get` is forgiving: case, spaces, hyphens, underscores, brackets and the words
    "NVIDIA"/"GeForce" are ignored, and a few aliases are accepted. Documented aliases:
    ``"a100"`` → "A100 SXM 80GB"; ``"h100"`` → "H100 SXM" (the SXM part is the usual H100 in
    benchmarks); ``"h200"`` → "H200 SXM"; ``"4090"``/``"5090"`` → "RTX 4090"/"RTX 5090";
    ``"rtx pro 6000"``/``"rtx 6000 blackwell"`` → "RTX PRO 6000 Blackwell WS";
    ``"gb10"``/``"dgx spark"``/``"spark"`` → "DGX Spark (GB10)"; ``"hgx b200"`` → "B200";
    ``"hgx b300"`` → "B300". A full CUDA device name (``"NVIDIA H100 80GB HBM3"``) also works.
    Unknown names raise :class:`UnknownGPUError` (a ``KeyError`` and a ``ValueError``) listing
    the known names. :func:`by_capability` lists the entries of one compute capability;
    :func:`current` returns the entry of the visible CUDA device when it is one of them.

Roofline
    ``predict(gpu, M, N, K, path)`` for ``y[M, N] = x[M, K] @ W[N, K]^T``:
    ``time = max(flops / (peak · eff), bytes / (bandwidth · mem_eff))`` with efficiency factors
    stated per path in :data:`EFFICIENCY` (defaults cited from published measurements) and per
    GPU in :data:`GPU_EFFICIENCY` where a GPU has its own published measurement
    (:data:`MEASUREMENTS`: B200, B300, RTX 5090); :func:`efficiency_for` says which applies.
    ``peak_tflops=`` supplies a peak the vendor does not publish. The emulation path
    adds the time of its separate dequantize / quant-dequant passes to the 16-bit GEMM, so it is
    never faster than ``bf16``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "CATALOGUE",
    "EFFICIENCY",
    "FIGURES",
    "GPU",
    "GPU_EFFICIENCY",
    "MEASUREMENTS",
    "MODEL_SHAPES",
    "NATIVE_FP4_CAPABILITIES",
    "NVFP4_BYTES_PER_WEIGHT",
    "PATHS",
    "Efficiency",
    "LinearShape",
    "Measurement",
    "NotSupportedError",
    "Prediction",
    "UnknownGPUError",
    "by_capability",
    "current",
    "default_m_grid",
    "efficiency_for",
    "get",
    "has_native_fp4",
    "linear_shapes",
    "match_device_name",
    "names",
    "parse_capability",
    "predict",
    "predict_block",
    "sources_table",
    "supported_paths",
]

Path = Literal["bf16", "fp8", "nvfp4_native", "w4a16", "emulation"]
PATHS: tuple[str, ...] = ("bf16", "fp8", "nvfp4_native", "w4a16", "emulation")

#: 4-bit element + one 8-bit E4M3 scale per 16 elements = 4.5 bits = 0.5625 bytes per element.
NVFP4_BYTES_PER_WEIGHT: float = 0.5625
#: Bytes per element of the 16-bit (bf16/fp16) activations, outputs and dequantized weights.
BYTES_16BIT: float = 2.0
#: Bytes per element of an FP8 operand.
BYTES_FP8: float = 1.0

#: Compute capabilities with NVFP4 tensor cores (tcgen05 on 10.x/11.0, mma.sync with block
#: scales on 12.x). Source: gpu-datasheets.md notes; vLLM requires cc >= 10.0 for native FP4.
NATIVE_FP4_CAPABILITIES: frozenset[tuple[int, int]] = frozenset(
    {(10, 0), (10, 3), (11, 0), (12, 0), (12, 1)}
)


def has_native_fp4(capability: tuple[int, int]) -> bool:
    """True when CUDA compute capability ``(major, minor)`` has NVFP4 tensor cores (cc >= 10.0)."""
    return tuple(capability) >= (10, 0)


# --------------------------------------------------------------------------------------------
# Catalogue
# --------------------------------------------------------------------------------------------

FIGURES: tuple[str, ...] = (
    "capability",
    "bf16_tflops",
    "fp8_tflops",
    "nvfp4_tflops",
    "memory_gb",
    "bandwidth_tb_s",
)


@dataclass(frozen=True)
class GPU:
    """One GPU's published dense peaks.

    ``capability`` is the CUDA compute capability ``(major, minor)``; ``*_tflops`` are dense
    peaks in 10^12 FLOP/s (``None`` = no such tensor cores or unpublished); ``memory_gb`` in
    10^9 bytes; ``bandwidth_tb_s`` in 10^12 bytes/s. ``sources`` maps each figure name of
    :data:`FIGURES` to where it came from; ``notes`` says what was adjusted (halved sparse
    figures, fp32-accumulate rates, usable memory).
    """

    name: str
    architecture: str
    capability: tuple[int, int]
    bf16_tflops: float | None
    fp8_tflops: float | None
    nvfp4_tflops: float | None
    memory_gb: float
    bandwidth_tb_s: float
    native_fp4: bool
    sources: dict[str, str] = field(compare=False)
    aliases: tuple[str, ...] = ()
    notes: str = ""
    # device-name matching: any alternative whose tokens all occur (normalized), none forbidden
    device_patterns: tuple[tuple[str, ...], ...] = ()
    device_forbidden: tuple[str, ...] = ()

    @property
    def capability_str(self) -> str:
        """Capability as ``"major.minor"``, e.g. ``"9.0"``."""
        return f"{self.capability[0]}.{self.capability[1]}"

    def peak_tflops(self, path: str) -> float | None:
        """Dense peak (10^12 FLOP/s) of the tensor-core math a path uses, or ``None``."""
        if path in ("bf16", "w4a16", "emulation"):
            return self.bf16_tflops
        if path == "fp8":
            return self.fp8_tflops
        if path == "nvfp4_native":
            return self.nvfp4_tflops if self.native_fp4 else None
        raise ValueError(f"unknown path {path!r}; expected one of {PATHS}")

    def as_dict(self) -> dict[str, object]:
        """The figures as a flat dict (for tables), capability as ``"major.minor"``."""
        return {
            "name": self.name,
            "architecture": self.architecture,
            "capability": self.capability_str,
            "native_fp4": self.native_fp4,
            "bf16_tflops": self.bf16_tflops,
            "fp8_tflops": self.fp8_tflops,
            "nvfp4_tflops": self.nvfp4_tflops,
            "memory_gb": self.memory_gb,
            "bandwidth_tb_s": self.bandwidth_tb_s,
            "notes": self.notes,
        }


def _src(default: str, **overrides: str) -> dict[str, str]:
    out = dict.fromkeys(FIGURES, default)
    out.update(overrides)
    return out


_CC_SRC = "CUDA compute capability table (developer.nvidia.com/cuda-gpus)"

_ENTRIES: tuple[GPU, ...] = (
    GPU(
        name="A100 SXM 80GB",
        architecture="Ampere",
        capability=(8, 0),
        bf16_tflops=312.0,
        fp8_tflops=None,
        nvfp4_tflops=None,
        memory_gb=80.0,
        bandwidth_tb_s=2.039,
        native_fp4=False,
        sources=_src(
            "NVIDIA A100 datasheet",
            capability=_CC_SRC,
            bf16_tflops="NVIDIA A100 datasheet: 624 TFLOPS with sparsity, halved to dense",
            fp8_tflops="NVIDIA A100 datasheet: no FP8 tensor cores",
            nvfp4_tflops="NVIDIA A100 datasheet: no FP4 tensor cores",
        ),
        aliases=("a100", "a100 sxm", "a100 sxm4", "a100 80gb", "a100 sxm4 80gb"),
        notes="sparse BF16 figure halved",
        device_patterns=(("a100", "sxm"),),
        device_forbidden=("40gb", "pcie"),
    ),
    GPU(
        name="L40S",
        architecture="Ada",
        capability=(8, 9),
        bf16_tflops=362.0,
        fp8_tflops=733.0,
        nvfp4_tflops=None,
        memory_gb=48.0,
        bandwidth_tb_s=0.864,
        native_fp4=False,
        sources=_src(
            "NVIDIA L40S datasheet",
            capability=_CC_SRC,
            bf16_tflops="NVIDIA L40S datasheet: 733 TFLOPS with sparsity, halved",
            fp8_tflops="NVIDIA L40S datasheet: 1466 TFLOPS with sparsity, halved",
            nvfp4_tflops="NVIDIA L40S datasheet: no FP4 tensor cores",
        ),
        aliases=("l40s",),
        notes="sparse figures halved",
        device_patterns=(("l40s",),),
    ),
    GPU(
        name="L4",
        architecture="Ada",
        capability=(8, 9),
        bf16_tflops=121.0,
        fp8_tflops=242.0,
        nvfp4_tflops=None,
        memory_gb=24.0,
        bandwidth_tb_s=0.300,
        native_fp4=False,
        sources=_src(
            "NVIDIA L4 datasheet",
            capability=_CC_SRC,
            bf16_tflops="NVIDIA L4 datasheet: 242 TFLOPS with sparsity, halved",
            fp8_tflops="NVIDIA L4 datasheet: 485 TFLOPS with sparsity, halved",
            nvfp4_tflops="NVIDIA L4 datasheet: no FP4 tensor cores",
        ),
        aliases=("l4",),
        notes="sparse figures halved",
        device_patterns=(("l4",),),
        device_forbidden=("l40",),
    ),
    GPU(
        name="RTX 4090",
        architecture="Ada",
        capability=(8, 9),
        bf16_tflops=165.2,
        fp8_tflops=330.3,
        nvfp4_tflops=None,
        memory_gb=24.0,
        bandwidth_tb_s=1.008,
        native_fp4=False,
        sources=_src(
            "NVIDIA Ada GPU architecture whitepaper, appendix A",
            capability=_CC_SRC,
            bf16_tflops="NVIDIA Ada whitepaper, appendix A: dense BF16 with FP32 accumulate",
            nvfp4_tflops="NVIDIA Ada whitepaper: no FP4 tensor cores",
        ),
        aliases=("4090", "rtx4090", "geforce rtx 4090"),
        notes="BF16 is the FP32-accumulate rate (GeForce halves it vs FP16 accumulate)",
        device_patterns=(("4090",),),
        device_forbidden=("4090d", "laptop"),
    ),
    GPU(
        name="H100 SXM",
        architecture="Hopper",
        capability=(9, 0),
        bf16_tflops=989.0,
        fp8_tflops=1979.0,
        nvfp4_tflops=None,
        memory_gb=80.0,
        bandwidth_tb_s=3.35,
        native_fp4=False,
        sources=_src(
            "NVIDIA H100 datasheet; NVIDIA/exemplar-performance README",
            capability=_CC_SRC,
            bf16_tflops="NVIDIA H100 datasheet: 1979 TFLOPS with sparsity, halved",
            fp8_tflops="NVIDIA H100 datasheet: 3958 TFLOPS with sparsity, halved",
            nvfp4_tflops="NVIDIA H100 datasheet: no FP4 tensor cores",
        ),
        aliases=("h100", "h100 sxm5", "h100 80gb hbm3", "h100 hbm3"),
        notes="sparse figures halved; 'h100' means this SXM part",
        device_patterns=(("h100", "hbm3"), ("h100", "sxm")),
        device_forbidden=("pcie", "nvl", "gh100"),
    ),
    GPU(
        name="H100 PCIe",
        architecture="Hopper",
        capability=(9, 0),
        bf16_tflops=756.0,
        fp8_tflops=1513.0,
        nvfp4_tflops=None,
        memory_gb=80.0,
        bandwidth_tb_s=2.0,
        native_fp4=False,
        sources=_src(
            "NVIDIA H100 datasheet",
            capability=_CC_SRC,
            bf16_tflops="NVIDIA H100 datasheet: 1513 TFLOPS with sparsity, halved",
            fp8_tflops="NVIDIA H100 datasheet: 3026 TFLOPS with sparsity, halved",
            nvfp4_tflops="NVIDIA H100 datasheet: no FP4 tensor cores",
        ),
        aliases=("h100 pcie",),
        notes="sparse figures halved",
        device_patterns=(("h100", "pcie"),),
    ),
    GPU(
        name="H200 SXM",
        architecture="Hopper",
        capability=(9, 0),
        bf16_tflops=989.0,
        fp8_tflops=1979.0,
        nvfp4_tflops=None,
        memory_gb=141.0,
        bandwidth_tb_s=4.8,
        native_fp4=False,
        sources=_src(
            "NVIDIA H200 datasheet",
            capability=_CC_SRC,
            bf16_tflops="NVIDIA H200 datasheet: 1979 TFLOPS with sparsity, halved",
            fp8_tflops="NVIDIA H200 datasheet: 3958 TFLOPS with sparsity, halved",
            nvfp4_tflops="NVIDIA H200 datasheet: no FP4 tensor cores",
        ),
        aliases=("h200", "h200 sxm5", "h200 141gb"),
        notes="sparse figures halved",
        device_patterns=(("h200",),),
        device_forbidden=("gh200", "nvl"),
    ),
    GPU(
        name="B200",
        architecture="Blackwell",
        capability=(10, 0),
        bf16_tflops=2250.0,
        fp8_tflops=4500.0,
        nvfp4_tflops=9000.0,
        memory_gb=180.0,
        bandwidth_tb_s=7.7,
        native_fp4=True,
        sources=_src(
            "NVIDIA/exemplar-performance README 'Peak Theoretical Throughput'; "
            "NVIDIA HGX B200 datasheet",
            capability=_CC_SRC,
        ),
        aliases=("b200 hgx", "hgx b200", "b200 (hgx)", "dgx b200"),
        notes="HGX B200 (1000 W) dense figures",
        device_patterns=(("b200",),),
        device_forbidden=("gb200",),
    ),
    GPU(
        name="GB200",
        architecture="Blackwell",
        capability=(10, 0),
        bf16_tflops=2500.0,
        fp8_tflops=5000.0,
        nvfp4_tflops=10000.0,
        memory_gb=186.0,
        bandwidth_tb_s=8.0,
        native_fp4=True,
        sources=_src(
            "NVIDIA GB200 NVL72 datasheet, per GPU (exemplar-performance uses 2450/4900/9800)",
            capability=_CC_SRC,
        ),
        aliases=("gb200 per gpu", "gb200 nvl72"),
        notes="per GPU of a GB200 superchip",
        device_patterns=(("gb200",),),
    ),
    GPU(
        name="B300",
        architecture="Blackwell Ultra",
        capability=(10, 3),
        bf16_tflops=2250.0,
        fp8_tflops=4500.0,
        nvfp4_tflops=13500.0,
        memory_gb=288.0,
        bandwidth_tb_s=8.0,
        native_fp4=True,
        sources=_src(
            "NVIDIA/exemplar-performance README; NVIDIA HGX B300 page",
            capability=_CC_SRC,
            nvfp4_tflops="NVIDIA/exemplar-performance README: dense FP4 as published "
            "(Blackwell Ultra's sparse FP4 is not 2x dense)",
            memory_gb="NVIDIA HGX B300 page: 288 GB (about 270 GB usable)",
        ),
        aliases=("b300 hgx", "hgx b300", "b300 (hgx)", "dgx b300"),
        notes="288 GB HBM3e of which ~270 GB usable",
        device_patterns=(("b300",),),
        device_forbidden=("gb300",),
    ),
    GPU(
        name="GB300",
        architecture="Blackwell Ultra",
        capability=(10, 3),
        bf16_tflops=2500.0,
        fp8_tflops=5000.0,
        nvfp4_tflops=15000.0,
        memory_gb=279.0,
        bandwidth_tb_s=8.0,
        native_fp4=True,
        sources=_src(
            "NVIDIA/exemplar-performance README (2450/4900/14700 there); GB300 NVL72 page",
            capability=_CC_SRC,
        ),
        aliases=("gb300 per gpu", "gb300 nvl72"),
        notes="per GPU of a GB300 superchip",
        device_patterns=(("gb300",),),
    ),
    GPU(
        name="RTX 5090",
        architecture="Blackwell (consumer)",
        capability=(12, 0),
        bf16_tflops=209.5,
        fp8_tflops=419.0,
        nvfp4_tflops=1676.0,
        memory_gb=32.0,
        bandwidth_tb_s=1.792,
        native_fp4=True,
        sources=_src(
            "NVIDIA RTX Blackwell GPU architecture whitepaper, table 3",
            capability=_CC_SRC,
            bf16_tflops="RTX Blackwell whitepaper, table 3: dense BF16 with FP32 accumulate",
            fp8_tflops="RTX Blackwell whitepaper, table 3: dense FP8 with FP32 accumulate",
            nvfp4_tflops="RTX Blackwell whitepaper, table 3: 3352 sparse FP4, halved",
        ),
        aliases=("5090", "rtx5090", "geforce rtx 5090"),
        notes="BF16/FP8 are FP32-accumulate rates (GeForce)",
        device_patterns=(("5090",),),
        device_forbidden=("5090d", "laptop"),
    ),
    GPU(
        name="RTX PRO 6000 Blackwell WS",
        architecture="Blackwell (workstation)",
        capability=(12, 0),
        bf16_tflops=503.8,
        fp8_tflops=1008.0,
        nvfp4_tflops=2015.0,
        memory_gb=96.0,
        bandwidth_tb_s=1.792,
        native_fp4=True,
        sources=_src(
            "NVIDIA RTX PRO Blackwell GPU architecture whitepaper",
            capability=_CC_SRC,
            fp8_tflops="RTX PRO Blackwell whitepaper: ~1008 dense (approximate)",
            nvfp4_tflops="RTX PRO Blackwell whitepaper: 4000 'AI TOPS' is sparse FP4; "
            "~2015 dense (approximate)",
        ),
        aliases=(
            "rtx pro 6000",
            "rtx pro 6000 blackwell",
            "rtx 6000 blackwell",
            "rtx pro 6000 workstation",
            "rtx pro 6000 blackwell workstation edition",
        ),
        notes="workstation edition; FP8/FP4 approximate",
        device_patterns=(("rtxpro6000",),),
        device_forbidden=("maxq",),
    ),
    GPU(
        name="DGX Spark (GB10)",
        architecture="Blackwell (GB10)",
        capability=(12, 1),
        bf16_tflops=None,
        fp8_tflops=None,
        nvfp4_tflops=500.0,
        memory_gb=128.0,
        bandwidth_tb_s=0.273,
        native_fp4=True,
        sources=_src(
            "NVIDIA DGX Spark product page",
            capability=_CC_SRC,
            bf16_tflops="NVIDIA DGX Spark product page: unpublished",
            fp8_tflops="NVIDIA DGX Spark product page: unpublished",
            nvfp4_tflops="NVIDIA DGX Spark product page: '1 PFLOP FP4 with sparsity', "
            "~500 dense (approximate)",
            memory_gb="NVIDIA DGX Spark product page: 128 GB unified LPDDR5x",
        ),
        aliases=("gb10", "dgx spark", "spark", "dgx spark gb10"),
        notes="unified memory shared with the CPU; BF16/FP8 peaks unpublished",
        device_patterns=(("gb10",),),
        device_forbidden=("gb100",),
    ),
)

#: Canonical name -> entry, in table order (Ampere → Blackwell).
CATALOGUE: dict[str, GPU] = {g.name: g for g in _ENTRIES}


class UnknownGPUError(KeyError, ValueError):
    """A GPU name that is not in :data:`CATALOGUE` (catch as ``KeyError`` or ``ValueError``)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class NotSupportedError(ValueError):
    """A path the GPU cannot run (e.g. ``nvfp4_native`` without FP4 tensor cores)."""


_DROP_WORDS = re.compile(r"nvidia|geforce")


def _norm(text: str) -> str:
    """Lower case, drop 'nvidia'/'geforce' and everything that is not a letter or digit."""
    return re.sub(r"[^a-z0-9]", "", _DROP_WORDS.sub("", text.lower()))


_INDEX: dict[str, str] = {}
for _g in _ENTRIES:
    for _key in (_g.name, *_g.aliases):
        _INDEX.setdefault(_norm(_key), _g.name)


def names() -> list[str]:
    """Canonical names of the catalogue, in table order."""
    return list(CATALOGUE)


def match_device_name(device_name: str, capability: tuple[int, int] | None = None) -> GPU | None:
    """Catalogue entry for a CUDA device name (``torch.cuda.get_device_name()``), or ``None``.

    Matching ignores case and punctuation; when ``capability`` is given it must agree. Parts
    the catalogue does not list (e.g. "H100 NVL", "A100 40GB PCIe") return ``None``.
    """
    key = _norm(device_name)
    for g in _ENTRIES:
        if capability is not None and tuple(capability) != g.capability:
            continue
        if any(bad in key for bad in g.device_forbidden):
            continue
        if any(all(tok in key for tok in alt) for alt in g.device_patterns):
            return g
    return None


def get(name: str | GPU) -> GPU:
    """Catalogue entry by name, alias or CUDA device name (case/spacing/hyphen-insensitive).

    Raises :class:`UnknownGPUError` (a ``KeyError`` and ``ValueError``) listing the known names.
    """
    if isinstance(name, GPU):
        return name
    if not isinstance(name, str):
        raise TypeError(f"GPU name must be a str, got {type(name).__name__}")
    key = _norm(name)
    if key in _INDEX:
        return CATALOGUE[_INDEX[key]]
    matched = match_device_name(name)
    if matched is not None and key:
        return matched
    raise UnknownGPUError(
        f"unknown GPU {name!r}; known GPUs: {', '.join(CATALOGUE)} "
        "(case, spaces and hyphens are ignored; e.g. 'h100' means 'H100 SXM')"
    )


def parse_capability(capability: object, what: str = "by_capability") -> tuple[int, int]:
    """``(major, minor)`` from a pair of ints or a ``"major.minor"`` string (``"9"`` = 9.0);
    anything else raises ValueError naming ``what`` and the expected forms."""
    expected = (
        'expects a compute capability as (major, minor), e.g. (9, 0), or "major.minor", e.g. "9.0"'
    )
    if isinstance(capability, str):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\.\s*(\d+))?\s*", capability)
        if m is None:
            raise ValueError(f"{what} {expected}; got {capability!r}")
        return int(m.group(1)), int(m.group(2) or 0)
    try:
        major, minor = capability  # type: ignore[misc]
        if isinstance(major, bool) or isinstance(minor, bool):
            raise TypeError
        out = (int(major), int(minor))
        if out != (major, minor):
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"{what} {expected}; got {capability!r}") from None
    if min(out) < 0:
        raise ValueError(f"{what} {expected}; got {capability!r}")
    return out


def by_capability(capability: tuple[int, int] | str) -> list[GPU]:
    """All entries with CUDA compute capability ``(major, minor)`` (or ``"9.0"``); may be empty.

    Anything else (``"abc"``, ``(9,)``, ``"9.0.1"``) raises ``ValueError`` saying what is expected.
    """
    cc = parse_capability(capability)
    return [g for g in _ENTRIES if g.capability == cc]


def current(device: object = None) -> GPU | None:
    """Entry of the visible CUDA device (``device`` index/str/torch.device), or ``None``.

    ``None`` when CUDA is unavailable or the device is not one of the catalogue's parts.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda") if device is None else torch.device(device)  # type: ignore[arg-type]
    if dev.type != "cuda":
        return None
    return match_device_name(
        torch.cuda.get_device_name(dev), tuple(torch.cuda.get_device_capability(dev))
    )


# --------------------------------------------------------------------------------------------
# Roofline model
# --------------------------------------------------------------------------------------------


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
    "assumption: 80% of peak DRAM bandwidth (no bandwidth measurement in gpu-datasheets.md; "
    "well-tuned streaming kernels typically reach 75-90%)"
)
_BF16_EFF = 1420.0 / 2250.0
_BF16_SRC = "B200 torch BF16 GEMM 8192^3: 1,420 of 2,250 TFLOPS = 0.63 (pytorch/ao PR #2427)"

#: Default efficiency factors per path; override per call with ``efficiency=``/``mem_efficiency=``.
EFFICIENCY: dict[str, Efficiency] = {
    "bf16": Efficiency(_BF16_EFF, _MEM_EFF, _BF16_SRC, _MEM_SRC),
    "fp8": Efficiency(
        _BF16_EFF,
        _MEM_EFF,
        "assumed equal to BF16's 0.63 (no FP8 GEMM measurement in gpu-datasheets.md)",
        _MEM_SRC,
    ),
    "nvfp4_native": Efficiency(
        5370.0 / 9000.0,
        _MEM_EFF,
        "B200 torch._scaled_mm NVFP4 8192^3: 5,370 of 9,000 TFLOPS = 0.60 (pytorch/ao PR #2427); "
        "GPUs with their own measurement use it instead (GPU_EFFICIENCY)",
        _MEM_SRC,
    ),
    "w4a16": Efficiency(
        _BF16_EFF, _MEM_EFF, "16-bit tensor-core math: BF16's 0.63 (" + _BF16_SRC + ")", _MEM_SRC
    ),
    "emulation": Efficiency(
        _BF16_EFF, _MEM_EFF, "its GEMM is a BF16 GEMM: BF16's 0.63 (" + _BF16_SRC + ")", _MEM_SRC
    ),
}

#: Paths whose GEMM runs on the 16-bit tensor cores: a GPU's BF16 measurement applies to all.
_BF16_MATH_PATHS: tuple[str, ...] = ("bf16", "w4a16", "emulation")


@dataclass(frozen=True)
class Measurement:
    """A published achieved rate (10^12 FLOP/s) of one path on one GPU, against the dense peak
    it is a fraction of, with its source. ``compute`` = ``tflops / peak_tflops``."""

    gpu: str
    path: str
    tflops: float
    peak_tflops: float
    source: str

    @property
    def compute(self) -> float:
        """Achieved fraction of the dense peak."""
        return self.tflops / self.peak_tflops


#: Published measurements of gpu-datasheets.md ("Published measurements worth overlaying") that
#: set a GPU's own compute efficiency (kernel-only figures, large compute-bound GEMMs).
MEASUREMENTS: tuple[Measurement, ...] = (
    Measurement(
        "B200",
        "nvfp4_native",
        5370.0,
        9000.0,
        "B200 torch._scaled_mm NVFP4 8192^3: 5,370 of 9,000 TFLOPS = 0.60 (pytorch/ao PR #2427)",
    ),
    Measurement(
        "B200",
        "bf16",
        1420.0,
        2250.0,
        "B200 torch BF16 GEMM 8192^3: 1,420 of 2,250 TFLOPS = 0.63 (pytorch/ao PR #2427)",
    ),
    Measurement(
        "B300",
        "nvfp4_native",
        5100.0,
        13500.0,
        "B300 5B-model GEMMs, NVFP4 kernel-only: ~5,100 of 13,500 TFLOPS = 0.38 "
        "(Transformer Engine GEMM-profiling tutorial)",
    ),
    Measurement(
        "B300",
        "bf16",
        1500.0,
        2250.0,
        "B300 5B-model GEMMs, BF16: ~1,500 of 2,250 TFLOPS = 0.67 "
        "(Transformer Engine GEMM-profiling tutorial)",
    ),
    Measurement(
        "RTX 5090",
        "nvfp4_native",
        1464.0,
        1676.0,
        "RTX 5090 NVFP4 mma peak loop: 1,464 of 1,676 TFLOPS = 0.87 (mmapeak microbenchmark)",
    ),
)


def _gpu_efficiency() -> dict[tuple[str, str], Efficiency]:
    out: dict[tuple[str, str], Efficiency] = {}
    for m in MEASUREMENTS:
        paths = _BF16_MATH_PATHS if m.path == "bf16" else (m.path,)
        for path in paths:
            base = EFFICIENCY[path]
            src = m.source if path == m.path else f"its GEMM is 16-bit: {m.gpu}'s BF16 ({m.source})"
            out[(m.gpu, path)] = Efficiency(m.compute, base.memory, src, base.memory_source)
    return out


#: Per-(GPU, path) efficiencies from that GPU's own published measurement (:data:`MEASUREMENTS`);
#: a BF16 measurement also sets ``w4a16`` and ``emulation`` (their GEMM is a 16-bit GEMM). Pairs
#: not listed fall back to :data:`EFFICIENCY` ``[path]``.
GPU_EFFICIENCY: dict[tuple[str, str], Efficiency] = _gpu_efficiency()


def efficiency_for(gpu: str | GPU, path: str) -> Efficiency:
    """The efficiency :func:`predict` uses by default for ``path`` on ``gpu``: the GPU's own
    measurement (:data:`GPU_EFFICIENCY`) when the datasheet notes give one, else the path
    default (:data:`EFFICIENCY`)."""
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; expected one of {PATHS}")
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
    if path == "bf16":
        return x16 + w16 + y16, 0.0
    if path == "fp8":
        x8 = M * K * BYTES_FP8
        quant = (x16 + x8) if quantize_activations else 0.0  # read bf16 x, write fp8 x
        return x8 + N * K * BYTES_FP8 + y16 + quant, 0.0
    if path == "nvfp4_native":
        x4 = M * K * NVFP4_BYTES_PER_WEIGHT
        quant = (x16 + x4) if quantize_activations else 0.0
        return x4 + N * K * NVFP4_BYTES_PER_WEIGHT + y16 + quant, 0.0
    if path == "w4a16":
        return x16 + N * K * NVFP4_BYTES_PER_WEIGHT + y16, 0.0
    if path == "emulation":
        # weight dequantize pass: read packed+scales, write 16-bit W;
        # activation quant-dequant pass: read x, write x_dq (both 16-bit).
        passes = N * K * NVFP4_BYTES_PER_WEIGHT + w16
        if quantize_activations:
            passes += 2 * x16
        return x16 + w16 + y16, passes
    raise ValueError(f"unknown path {path!r}; expected one of {PATHS}")


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
    - ``nvfp4_native``: NVFP4 x and W, 16-bit y (+ activation quantize pass); needs FP4 tensor
      cores, else :class:`NotSupportedError`.
    - ``w4a16``: 16-bit x and y, NVFP4 W streamed (0.5625 B/weight), 16-bit math.
    - ``emulation``: a 16-bit GEMM after a weight dequantize pass (read NVFP4, write 16-bit W) and
      an activation quant-dequant pass (read and write 16-bit x) — never faster than ``bf16``.

    ``efficiency``/``mem_efficiency`` default to :func:`efficiency_for` ``(gpu, path)``: the GPU's
    own published measurement where there is one (:data:`GPU_EFFICIENCY`), else the path default
    (:data:`EFFICIENCY`). ``peak_tflops`` (10^12 FLOP/s, dense) replaces the catalogue's peak for
    the path's math — for a peak the vendor does not publish (DGX Spark's BF16/FP8) or a figure of
    your own; the efficiency still applies (pass ``efficiency=1.0`` for an achieved rate). A path
    whose peak is unpublished and not given (e.g. BF16 on DGX Spark) or absent (FP8 on A100)
    raises :class:`NotSupportedError`; so does ``nvfp4_native`` without FP4 tensor cores, even
    with ``peak_tflops``.
    """
    g = get(gpu)
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; expected one of {PATHS}")
    for label, v in (("M", M), ("N", N), ("K", K)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{label} must be a positive int, got {v!r}")
    if path == "nvfp4_native" and not g.native_fp4:
        raise NotSupportedError(
            f"{g.name} (cc {g.capability_str}) has no FP4 tensor cores, so path 'nvfp4_native' "
            "cannot run there; use 'w4a16' or 'emulation' (native FP4 needs cc >= 10.0)"
        )
    if peak_tflops is not None:
        peak = float(peak_tflops)
        if not (math.isfinite(peak) and peak > 0):
            raise ValueError(f"peak_tflops must be a positive finite number, got {peak_tflops!r}")
    else:
        catalogue_peak = g.peak_tflops(path)
        if catalogue_peak is None:
            raise NotSupportedError(
                f"{g.name} has no published dense peak for path {path!r} "
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
_MODEL_INDEX = {_norm(k): k for k in MODEL_SHAPES}


def linear_shapes(model: str) -> tuple[LinearShape, ...]:
    """The fused linear layers (q/k/v, o, gate/up, down) of one block of ``model``.

    ``model`` is matched like GPU names ("llama-3-8b", "Llama 3 70B"); unknown → ValueError.
    """
    key = _norm(model)
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


def sources_table(gpus: Iterable[str | GPU] | None = None) -> list[dict[str, str]]:
    """One row per (GPU, figure) with its source string — for provenance tables."""
    rows = []
    for g in (get(x) for x in (gpus if gpus is not None else CATALOGUE)):
        for fig in FIGURES:
            rows.append(
                {
                    "gpu": g.name,
                    "figure": fig,
                    "value": str(getattr(g, fig)),
                    "source": g.sources[fig],
                }
            )
    return rows
