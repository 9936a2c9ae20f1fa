"""The LLM study's verdict (notebook 07's "What to use"): per family of configurations the one
with the lowest mean KL divergence from the reference, its numbers with 95 % intervals, and
which of its leads are significant.

**Families** (:func:`family`), by what a configuration quantizes, because they save different
things (weight memory, GEMM time, KV-cache memory) and are not alternatives to each other:

* ``weights only``: NVFP4 weights, float activations (W4A16), float KV cache;
* ``weights and activations``: NVFP4 weights and quantized activations (W4A4 emulation or
  native; llama.cpp's Q8_0 path too), float KV cache;
* ``KV cache only``: float weights and activations, a quantized KV cache;
* ``weights, activations and KV cache`` (W4A4 + KV) and ``weights and KV cache`` (W4A16 + KV):
  families of their own, not the KV family, since their error is mostly the weights' and
  activations' and would always lose to a KV-only cache there.

**Best and significant.** The best of a family has the lowest mean KL divergence (nats per
token); an exact tie goes to the configuration listed first, and the verdict says it ties. Each
other member is compared with the best by
:func:`~nvfp4lab.studies.llm_statistics.paired_difference` of the per-token KL divergence on
the same run (member minus best, windows as units); the best's lead is *significant* when that
difference's 95 % interval excludes 0.
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nvfp4lab.studies.llm_configs import ConfigResult, LLMConfig
from nvfp4lab.studies.llm_statistics import PairedDifference, paired_difference
from nvfp4lab.vocab import Backend

__all__ = [
    "FAMILIES",
    "KV_ONLY",
    "WEIGHTS_ACTIVATIONS",
    "WEIGHTS_ACTIVATIONS_KV",
    "WEIGHTS_KV",
    "WEIGHTS_ONLY",
    "Comparison",
    "FamilyVerdict",
    "best_per_family",
    "comparison_rows",
    "family",
    "family_rows",
    "family_table",
    "verdict_text",
    "worst_layers",
]

WEIGHTS_ONLY = "weights only"
WEIGHTS_ACTIVATIONS = "weights and activations"
KV_ONLY = "KV cache only"
WEIGHTS_KV = "weights and KV cache"
WEIGHTS_ACTIVATIONS_KV = "weights, activations and KV cache"
NOTHING = "nothing quantized"
#: The families in the order the verdict names them.
FAMILIES = (WEIGHTS_ONLY, WEIGHTS_ACTIVATIONS, KV_ONLY, WEIGHTS_KV, WEIGHTS_ACTIVATIONS_KV,
            NOTHING)
#: Backends whose activations are quantized too.
_ACTIVATIONS = frozenset({Backend.EMULATION, Backend.NATIVE, Backend.Q8_0})


def family(config: LLMConfig) -> str:
    """The family of ``config`` (see the module's docstring): one of :data:`FAMILIES`."""
    weights = config.backend is not None
    activations = config.backend in _ACTIVATIONS
    kv = config.kv_cache is not None
    if not weights:
        return KV_ONLY if kv else NOTHING
    if activations:
        return WEIGHTS_ACTIVATIONS_KV if kv else WEIGHTS_ACTIVATIONS
    return WEIGHTS_KV if kv else WEIGHTS_ONLY


@dataclass(frozen=True)
class Comparison:
    """A family member against the family's best: ``kld`` is the paired difference of mean KL
    divergence, member minus best (>= 0), with its interval; ``tie``: the same mean KLD."""

    result: ConfigResult
    kld: PairedDifference
    tie: bool


@dataclass(frozen=True)
class FamilyVerdict:
    """One family's verdict: its ``best`` configuration and every other member compared with it
    (``others``, by rising mean KLD; empty for a family of one)."""

    family: str
    best: ConfigResult
    others: tuple[Comparison, ...]


def _key(index_result: tuple[int, ConfigResult]) -> tuple[bool, float, int]:
    index, result = index_result
    kld = result.fidelity.kld_mean
    return (math.isnan(kld), kld, index)


def best_per_family(results: Sequence[ConfigResult]) -> list[FamilyVerdict]:
    """Per family present in ``results`` (in :data:`FAMILIES` order), the configuration with the
    lowest mean KLD (a tie: the first listed), every other member compared with it by the paired
    KLD difference. ``results``: :class:`~nvfp4lab.studies.llm_configs.ConfigResult` of one
    reference run (:func:`~nvfp4lab.studies.llm_configs.config_results`), distinct labels."""
    results = list(results)
    if not results:
        raise ValueError("best_per_family needs at least one ConfigResult "
                         "(llm_configs.config_results)")
    for result in results:
        if not isinstance(result, ConfigResult):
            raise TypeError(f"results must be ConfigResult (llm_configs.config_result), got "
                            f"{type(result).__name__}")
    labels = [r.label for r in results]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"configuration label(s) {', '.join(map(repr, repeated))} appear more "
                         "than once: give each configuration its own label")
    out = []
    for name in FAMILIES:
        members = sorted(((i, r) for i, r in enumerate(results) if family(r.config) == name),
                         key=_key)
        if not members:
            continue
        best = members[0][1]
        others = tuple(
            Comparison(result=r, kld=paired_difference(r.fidelity, best.fidelity, "kld"),
                       tie=r.fidelity.kld_mean == best.fidelity.kld_mean)
            for _, r in members[1:]
        )
        out.append(FamilyVerdict(family=name, best=best, others=others))
    return out


def _interval(lo: float, hi: float, digits: int) -> str:
    if math.isnan(lo) or math.isnan(hi):
        return "no interval: one window"
    return f"95 % interval {lo:.{digits}g} to {hi:.{digits}g}"


def family_rows(verdicts: Sequence[FamilyVerdict]) -> list[dict[str, Any]]:
    """One row per family: the best configuration's mean KLD (nats/token), perplexity ratio and
    top-1 agreement each with its 95 % interval (``_lo`` / ``_hi``), ``windows``, ``tokens``,
    ``build_seconds``, ``peak_rss_mb`` (NaN when not measured), and the runner-up (``next``)
    with the paired KLD difference to it, its interval and ``significant``; ``members``: the
    family's size."""
    rows = []
    for verdict in verdicts:
        best, f = verdict.best, verdict.best.fidelity
        runner = verdict.others[0] if verdict.others else None
        diff = runner.kld if runner is not None else None
        rows.append({
            "family": verdict.family, "best": best.label, "members": 1 + len(verdict.others),
            "kld_mean": f.kld_mean, "kld_lo": f.kld_ci95[0], "kld_hi": f.kld_ci95[1],
            "perplexity_ratio": f.perplexity_ratio,
            "perplexity_ratio_lo": f.perplexity_ratio_ci95[0],
            "perplexity_ratio_hi": f.perplexity_ratio_ci95[1],
            "top1_agreement": f.top1_agreement, "top1_lo": f.top1_ci95[0],
            "top1_hi": f.top1_ci95[1], "windows": f.windows, "tokens": f.tokens,
            "build_seconds": best.build_seconds,
            "peak_rss_mb": math.nan if best.peak_rss_mb is None else best.peak_rss_mb,
            "next": runner.result.label if runner is not None else "-",
            "kld_difference": diff.difference if diff is not None else math.nan,
            "difference_lo": diff.ci95[0] if diff is not None else math.nan,
            "difference_hi": diff.ci95[1] if diff is not None else math.nan,
            "significant": diff.significant if diff is not None else False,
        })
    return rows


def _with_interval(value: float, lo: float, hi: float, digits: int) -> str:
    if math.isnan(lo) or math.isnan(hi):
        return f"{value:.{digits}g} (one window: no interval)"
    return f"{value:.{digits}g} [{lo:.{digits}g}, {hi:.{digits}g}]"


def family_table(verdicts: Sequence[FamilyVerdict], digits: int = 4) -> list[dict[str, Any]]:
    """:func:`family_rows` for reading: one row per family, each measure a string ``value [lo,
    hi]`` (95 % interval, ``digits`` significant digits), the runner-up's paired KLD difference
    likewise with ``significant`` yes / no; build seconds and peak MiB rounded."""
    out = []
    for r in family_rows(verdicts):
        has_next = r["next"] != "-"
        memory = r["peak_rss_mb"]
        out.append({
            "family": r["family"], "best": r["best"],
            "mean KLD, nats/token [95 % interval]": _with_interval(
                r["kld_mean"], r["kld_lo"], r["kld_hi"], digits),
            "perplexity / reference's": _with_interval(
                r["perplexity_ratio"], r["perplexity_ratio_lo"], r["perplexity_ratio_hi"],
                digits),
            "top-1 agreement": _with_interval(r["top1_agreement"], r["top1_lo"], r["top1_hi"],
                                              digits),
            "windows (tokens)": f"{r['windows']} ({r['tokens']})",
            "build s": f"{r['build_seconds']:.1f}",
            "peak memory, MiB": "-" if math.isnan(memory) else f"{memory:.0f}",
            "runner-up": r["next"],
            "its mean KLD - the best's": _with_interval(
                r["kld_difference"], r["difference_lo"], r["difference_hi"], digits)
            if has_next else "-",
            "lead significant": ("yes" if r["significant"] else "no") if has_next else "-",
        })
    return out


def comparison_rows(verdicts: Sequence[FamilyVerdict]) -> list[dict[str, Any]]:
    """One row per configuration that is not its family's best: ``family``, ``configuration``,
    ``best``, the paired mean-KLD difference (configuration minus best, nats/token) with its 95 %
    interval, ``significant`` and ``tie``."""
    return [{"family": v.family, "configuration": c.result.label, "best": v.best.label,
             "kld_difference": c.kld.difference, "difference_lo": c.kld.ci95[0],
             "difference_hi": c.kld.ci95[1], "significant": c.kld.significant, "tie": c.tie}
            for v in verdicts for c in v.others]


def _best_sentence(verdict: FamilyVerdict, digits: int) -> str:
    best, f = verdict.best, verdict.best.fidelity
    cost = f"built in {best.build_seconds:.1f} s"
    if best.peak_rss_mb is not None:
        cost += f", peak memory {best.peak_rss_mb:.0f} MiB"
    return (f"**{verdict.family[0].upper()}{verdict.family[1:]}**: **{best.label}** is best, "
            f"mean KLD {f.kld_mean:.{digits}g} nats/token "
            f"({_interval(*f.kld_ci95, digits)}), perplexity {f.perplexity_ratio:.4f}× the "
            f"reference's ({_interval(*f.perplexity_ratio_ci95, 4)}), top-1 agreement "
            f"{f.top1_agreement:.{digits}g} ({_interval(*f.top1_ci95, digits)}); "
            f"{f.windows} windows, {f.tokens} tokens; {cost}.")


def _lead_sentence(verdict: FamilyVerdict, digits: int) -> str:
    if not verdict.others:
        return "It is the only configuration of its family run: nothing to compare it with."
    ties = [c for c in verdict.others if c.tie]
    significant = [c for c in verdict.others if c.kld.significant and not c.tie]
    not_significant = [c for c in verdict.others if not c.kld.significant and not c.tie]
    parts = []
    if ties:
        names = ", ".join(c.result.label for c in ties)
        parts.append(f"it ties with {names} (the same mean KLD; the one listed first is named)")
    if not_significant:
        each = "; over ".join(f"{c.result.label} ({c.kld.text(digits)})" for c in not_significant)
        parts.append(f"its lead over {each} is **not significant**")
    if significant:
        each = "; over ".join(f"{c.result.label} ({c.kld.text(digits)})" for c in significant)
        parts.append(f"its lead over {each} is significant")
    sentence = "; ".join(parts)
    return sentence[0].upper() + sentence[1:] + "."


def verdict_text(verdicts: Sequence[FamilyVerdict], *, worst: Sequence[dict[str, Any]] = (),
                 digits: int = 3) -> str:
    """Markdown: one paragraph per family naming its best configuration with mean KLD,
    perplexity ratio and top-1 agreement, each with its 95 % interval, the windows and tokens,
    build seconds and peak memory, then which of its leads over the other members are
    significant (paired KLD differences, member minus best) and which are not; ``worst``
    (:func:`worst_layers`' rows) adds the per-layer worst offenders. ``digits``: significant
    digits."""
    if not verdicts:
        raise ValueError("verdict_text needs at least one FamilyVerdict (best_per_family)")
    lines = ["Per family, the configuration with the lowest mean KL divergence from the "
             "reference; differences are paired over the same tokens with the windows as "
             "units, and a lead is significant when its 95 % interval excludes 0.", ""]
    for verdict in verdicts:
        lines += [f"- {_best_sentence(verdict, digits)} {_lead_sentence(verdict, digits)}"]
    if worst:
        by = worst[0].get("by", "weight_nmse")
        each = ", ".join(f"`{r['short']}` ({r[by]:.{digits}g})" for r in worst)
        spread = ""
        median, layers = worst[0].get("median"), worst[0].get("layers")
        if median is not None and layers is not None and median > 0:
            spread = (f"; the median over all {layers} layers is {median:.{digits}g}, so the "
                      f"worst is {worst[0][by] / median:.2f}× the median")
        lines += ["", f"Worst layers by {_RANKS[by]}: {each}{spread}."]
    return "\n".join(lines)


#: The columns :func:`worst_layers` ranks by.
_RANKS = {"weight_nmse": "NVFP4 weight NMSE", "activation_nmse": "NVFP4 input-activation NMSE"}


def worst_layers(linear_rows: Sequence[dict[str, Any]], n: int = 5, *,
                 by: str = "weight_nmse") -> list[dict[str, Any]]:
    """The ``n`` worst Linear layers of :func:`~nvfp4lab.studies.llm_layers.linear_rows`,
    worst first, ranked by ``by``: ``"weight_nmse"`` (default: the error every configuration
    with NVFP4 weights shares, a property of the weights alone) or ``"activation_nmse"`` (what
    W4A4 adds, measured on the rows' one window). Each row: ``rank``, ``by``, ``short``,
    ``layer``, ``k``, ``n``, ``weight_nmse``, ``activation_nmse``, ``channel_ratio``, and
    ``median`` / ``layers``: the median of ``by`` over all the rows and their number (for
    SmolLM2 the NVFP4 weight NMSE is nearly the same in every layer, 0.0085 to 0.0091: the
    worst are barely worse than the median, which the verdict says)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n must be a whole number >= 1 (layers to list), got {n!r}")
    if by not in _RANKS:
        raise ValueError(f"by must be one of {', '.join(map(repr, _RANKS))}, got {by!r}")
    rows = list(linear_rows)
    if not rows:
        raise ValueError("linear_rows is empty: pass llm_layers.linear_rows(model, ids)")
    keys = ("short", "layer", "k", "n", "weight_nmse", "activation_nmse", "channel_ratio")
    missing = [k for k in keys if k not in rows[0]]
    if missing:
        raise ValueError(f"linear_rows lack {', '.join(missing)}: pass "
                         "llm_layers.linear_rows(model, ids)")
    ranked = sorted(rows, key=lambda r: -r[by])[: int(n)]
    median = statistics.median(r[by] for r in rows)
    return [{"rank": i + 1, "by": by, **{k: r[k] for k in keys}, "median": median,
             "layers": len(rows)} for i, r in enumerate(ranked)]
