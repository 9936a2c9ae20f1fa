"""What :func:`~nvfp4lab.execution.whole_model.quantize_model` did, as records: the layers it
replaced (:class:`ReplacedLayer`) and skipped (:class:`SkippedLayer`, with the reason), the
KV cache it set, and their rendering as text and table rows (:class:`QuantizeReport`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from nvfp4lab.execution.attention import KVCacheLayer
from nvfp4lab.hadamard import BlockRotation
from nvfp4lab.vocab import QuantMethod

__all__ = ["IgnoreSpec", "QuantizeReport", "ReplacedLayer", "SkippedLayer"]

#: An ``ignore`` entry: an exact name, a dotted suffix, ``"re:<regex>"``, or a compiled pattern.
IgnoreSpec = str | re.Pattern[str]


def _rotation_text(rotation: int | BlockRotation) -> str:
    """How the report names a weight's rotation."""
    if isinstance(rotation, BlockRotation):
        return f"{rotation.kind} rotation, block {rotation.size} (compressed-tensors)"
    return f"hadamard seed {rotation}"


@dataclass(frozen=True)
class ReplacedLayer:
    """A Linear replaced by an NVFP4Linear. ``weight_global_scale``: ENCODE form."""

    name: str
    in_features: int
    out_features: int
    bias: bool
    weight_global_scale: float
    shared_with: tuple[str, ...] = ()
    #: "rtn", "gptq" or "mr-gptq"; "rtn (gptq fallback: <why>)" when GPTQ could not run on it
    method: str = QuantMethod.RTN
    #: the rotation the weight was rotated by: a block Hadamard's seed or a BlockRotation
    #: (compressed-tensors' matrix); None: not rotated
    hadamard: int | BlockRotation | None = None


@dataclass(frozen=True)
class SkippedLayer:
    """A module left as it was, and why."""

    name: str
    type: str
    reason: str


@dataclass
class QuantizeReport:
    """What :func:`quantize_model` replaced and skipped (and why), and the KV cache it set."""

    replaced: list[ReplacedLayer] = field(default_factory=list)
    skipped: list[SkippedLayer] = field(default_factory=list)
    shared_groups: list[tuple[str, ...]] = field(default_factory=list)
    #: ``ignore`` entries that matched no Linear layer
    unmatched_ignore: list[IgnoreSpec] = field(default_factory=list)
    #: attention layers reading K / V from a quantized KV cache: kind and DECODE k/v scales each
    #: (empty with ``kv_cache=None``)
    kv_cache: list[KVCacheLayer] = field(default_factory=list)

    @property
    def replaced_names(self) -> list[str]:
        return [r.name for r in self.replaced]

    @property
    def skipped_names(self) -> list[str]:
        return [s.name for s in self.skipped]

    def rows(self) -> list[dict[str, object]]:
        """One dict per layer (for a pandas DataFrame)."""
        out: list[dict[str, object]] = [
            {
                "name": r.name,
                "action": "replaced",
                "shape": f"{r.out_features}x{r.in_features}",
                "weight_global_scale": r.weight_global_scale,
                "detail": "; ".join(
                    ([f"shared with {', '.join(r.shared_with)}"] if r.shared_with else [])
                    + ([_rotation_text(r.hadamard)] if r.hadamard is not None else [])
                ),
                "method": str(r.method),
            }
            for r in self.replaced
        ]
        out += [
            {"name": s.name, "action": "skipped", "shape": "", "weight_global_scale": None,
             "detail": f"{s.type}: {s.reason}"}
            for s in self.skipped
        ]
        out += [
            {"name": k.name, "action": "kv cache", "shape": f"{k.kv_heads}x{k.head_dim}",
             "weight_global_scale": None,
             "detail": f"{k.kind}, k_scale={k.k_scale:.6g} v_scale={k.v_scale:.6g} (DECODE, "
                       f"{k.scales_from})"}
            for k in self.kv_cache
        ]
        return out

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} Linear layer(s), skipped {len(self.skipped)}"]
        for r in self.replaced:
            shared = (
                f"  (global scale shared with {', '.join(r.shared_with)})" if r.shared_with else ""
            )
            rotated = f" hadamard={r.hadamard}" if r.hadamard is not None else ""
            lines.append(
                f"  + {r.name}: [{r.out_features}, {r.in_features}] gs={r.weight_global_scale:.6g}"
                f" {r.method}{rotated}{shared}"
            )
        lines += [f"  - {s.name} ({s.type}): {s.reason}" for s in self.skipped]
        lines += [f"  ! ignore entry {s!r} matched no Linear layer" for s in self.unmatched_ignore]
        if self.kv_cache:
            kind = self.kv_cache[0].kind
            lines.append(f"KV cache {kind} on {len(self.kv_cache)} attention layer(s)")
            lines += [f"  ~ {k}" for k in self.kv_cache]
        return "\n".join(lines)
