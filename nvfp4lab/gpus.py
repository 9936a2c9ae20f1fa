"""The GPU catalogue: published dense peaks with their sources, and the one FP4 predicate.

Catalogue
    ``gpus.csv`` (shipped beside this module, loaded at import) holds one row per GPU: the CUDA
    compute capability, DENSE peaks (no 2:4 sparsity) as published, memory and bandwidth, and
    one source column per figure. Ampere/Hopper/Ada datasheets print sparse numbers; those were
    halved. Units are in the field names: ``*_tflops`` (10^12 FLOP/s), ``memory_gb`` (10^9 B),
    ``bandwidth_tb_s`` (10^12 B/s). Figures a vendor does not publish are empty (``None``).

Native FP4
    :func:`has_native_fp4` is the one place that says which GPUs have NVFP4 tensor cores:
    compute capability >= 10.0 (sm_100/103/110 tcgen05, sm_120/121 mma.sync with block scales).
    Hopper (9.0), Ada (8.9), Ampere (8.x) have none.

Lookup
    :func:`get` is forgiving: case, spaces, hyphens, underscores, brackets and the words
    "NVIDIA"/"GeForce" are ignored, and a few aliases are accepted (the ``aliases`` column):
    ``"a100"`` → "A100 SXM 80GB"; ``"h100"`` → "H100 SXM" (the SXM part is the usual H100 in
    benchmarks); ``"h200"`` → "H200 SXM"; ``"4090"``/``"5090"`` → "RTX 4090"/"RTX 5090";
    ``"rtx pro 6000"``/``"rtx 6000 blackwell"`` → "RTX PRO 6000 Blackwell WS";
    ``"gb10"``/``"dgx spark"``/``"spark"`` → "DGX Spark (GB10)"; ``"hgx b200"`` → "B200";
    ``"hgx b300"`` → "B300". A full CUDA device name (``"NVIDIA H100 80GB HBM3"``) also works
    (the ``device_patterns`` / ``device_forbidden`` columns). Unknown names raise
    :class:`UnknownGPUError` (a ``KeyError`` and a ``ValueError``) listing the known names.
    :func:`by_capability` lists the entries of one compute capability; :func:`current` returns
    the entry of the visible CUDA device when it is one of them.

The roofline model built on these figures is :mod:`nvfp4lab.roofline`.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from nvfp4lab.vocab import GemmPath, check_choice

__all__ = [
    "CATALOGUE",
    "CATALOGUE_PATH",
    "FIGURES",
    "GPU",
    "NATIVE_FP4_MIN_CAPABILITY",
    "UnknownGPUError",
    "by_capability",
    "current",
    "get",
    "has_native_fp4",
    "match_device_name",
    "names",
    "normalize_name",
    "parse_capability",
    "sources_table",
]

#: FP4 tensor cores start at compute capability 10.0 (Blackwell). vLLM requires cc >= 10.0 for
#: its native NVFP4 kernels too.
NATIVE_FP4_MIN_CAPABILITY: tuple[int, int] = (10, 0)

#: The catalogue's data file.
CATALOGUE_PATH: Path = Path(__file__).with_name("gpus.csv")

FIGURES: tuple[str, ...] = (
    "capability",
    "bf16_tflops",
    "fp8_tflops",
    "nvfp4_tflops",
    "memory_gb",
    "bandwidth_tb_s",
)


def has_native_fp4(capability: tuple[int, int]) -> bool:
    """True when CUDA compute capability ``(major, minor)`` has NVFP4 tensor cores (cc >= 10.0)."""
    return tuple(capability) >= NATIVE_FP4_MIN_CAPABILITY


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
    sources: dict[str, str] = field(compare=False)
    aliases: tuple[str, ...] = ()
    notes: str = ""
    # device-name matching: any alternative whose tokens all occur (normalized), none forbidden
    device_patterns: tuple[tuple[str, ...], ...] = ()
    device_forbidden: tuple[str, ...] = ()

    @property
    def native_fp4(self) -> bool:
        """Whether this GPU has NVFP4 tensor cores (:func:`has_native_fp4`)."""
        return has_native_fp4(self.capability)

    @property
    def capability_str(self) -> str:
        """Capability as ``"major.minor"``, e.g. ``"9.0"``."""
        return f"{self.capability[0]}.{self.capability[1]}"

    def peak_tflops(self, path: str) -> float | None:
        """Dense peak (10^12 FLOP/s) of the tensor-core math a GEMM path uses, or ``None``:
        BF16 for bf16/w4a16/emulation, FP8 for fp8, NVFP4 for native (None without FP4 cores),
        None for q8_0 (INT8 math: the catalogue holds no INT8 peak)."""
        p = check_choice("path", path, GemmPath)
        if p in (GemmPath.BF16, GemmPath.W4A16, GemmPath.EMULATION):
            return self.bf16_tflops
        if p == GemmPath.FP8:
            return self.fp8_tflops
        if p == GemmPath.Q8_0:
            return None
        return self.nvfp4_tflops if self.native_fp4 else None

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


def _number(text: str) -> float | None:
    return float(text) if text.strip() else None


def _split(text: str) -> tuple[str, ...]:
    return tuple(t for t in text.split("|") if t)


def _load_catalogue(path: Path) -> tuple[GPU, ...]:
    """The rows of ``gpus.csv`` as :class:`GPU` entries, in file order."""
    with path.open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    entries = []
    for row in rows:
        major, minor = row["capability"].split(".")
        entries.append(
            GPU(
                name=row["name"],
                architecture=row["architecture"],
                capability=(int(major), int(minor)),
                bf16_tflops=_number(row["bf16_tflops"]),
                fp8_tflops=_number(row["fp8_tflops"]),
                nvfp4_tflops=_number(row["nvfp4_tflops"]),
                memory_gb=float(row["memory_gb"]),
                bandwidth_tb_s=float(row["bandwidth_tb_s"]),
                sources={fig: row[f"{fig}_source"] for fig in FIGURES},
                aliases=_split(row["aliases"]),
                notes=row["notes"],
                device_patterns=tuple(tuple(a.split("+")) for a in _split(row["device_patterns"])),
                device_forbidden=_split(row["device_forbidden"]),
            )
        )
    return tuple(entries)


_ENTRIES: tuple[GPU, ...] = _load_catalogue(CATALOGUE_PATH)

#: Canonical name -> entry, in table order (Ampere → Blackwell).
CATALOGUE: dict[str, GPU] = {g.name: g for g in _ENTRIES}


class UnknownGPUError(KeyError, ValueError):
    """A GPU name that is not in :data:`CATALOGUE` (catch as ``KeyError`` or ``ValueError``)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


_DROP_WORDS = re.compile(r"nvidia|geforce")


def normalize_name(text: str) -> str:
    """Lower case, drop 'nvidia'/'geforce' and everything that is not a letter or digit."""
    return re.sub(r"[^a-z0-9]", "", _DROP_WORDS.sub("", text.lower()))


_INDEX: dict[str, str] = {}
for _g in _ENTRIES:
    for _key in (_g.name, *_g.aliases):
        _INDEX.setdefault(normalize_name(_key), _g.name)


def names() -> list[str]:
    """Canonical names of the catalogue, in table order."""
    return list(CATALOGUE)


def match_device_name(device_name: str, capability: tuple[int, int] | None = None) -> GPU | None:
    """Catalogue entry for a CUDA device name (``torch.cuda.get_device_name()``), or ``None``.

    Matching ignores case and punctuation; when ``capability`` is given it must agree. Parts
    the catalogue does not list (e.g. "H100 NVL", "A100 40GB PCIe") return ``None``.
    """
    key = normalize_name(device_name)
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
    key = normalize_name(name)
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
