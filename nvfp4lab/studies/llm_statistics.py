"""The LLM study's statistics: means with 95 % intervals, the windows as the units
(:class:`TokenFidelity`, made by :func:`nvfp4lab.studies.llm.token_fidelity`), and the paired
difference of two configurations scored on the same reference run (:func:`paired_difference`).

**Confidence intervals.** The tokens of one window are not independent samples: they share a
context, and neighbouring positions carry similar errors, so an interval over tokens as if they
were would be too narrow. The windows are the independent units instead (consecutive windows of
one text are still a little correlated, which this ignores): a mean over tokens is the ratio
``m = Σ_w s_w / Σ_w n_w`` of the windows' sums ``s_w`` and token counts ``n_w``, its standard
error the cluster-robust (ratio-estimator) one, ``SE² = W/(W-1) · Σ_w (s_w - m n_w)² / (Σ_w n_w)²``
over W windows (with equal windows: the standard error of the W window means), and the interval
``m ± 1.96 SE``, a normal approximation (NaN with fewer than 2 windows). Perplexity's interval is
``exp`` of the mean NLL's. The ratio of perplexities quantized / reference is ``exp`` of the mean
of the per-token NLL difference, paired over the same tokens, so its interval is much narrower
than either perplexity's: compare configurations with it, or with the KL divergence. Top-1
agreement is the mean of a per-token 0/1 value, with its interval the same way.

**Paired differences.** Two configurations scored on the same run predict the same tokens, so
their per-token difference (KL divergence, NLL, top-1 agreement) is paired: its mean and
interval come from the same estimator over the differences, and the interval is narrower than
either configuration's own whenever their errors move together from window to window (they do:
hard text is hard for both). A difference is *significant* when its 95 % interval excludes 0.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "METRICS",
    "Z95",
    "PairedDifference",
    "TokenFidelity",
    "fidelity_of",
    "mean_ci",
    "paired_difference",
]

#: Two-sided 95 % quantile of the standard normal distribution.
Z95 = statistics.NormalDist().inv_cdf(0.975)

#: The per-token measures :func:`paired_difference` compares, and the TokenFidelity field each
#: reads: KL divergence (nats), NLL (nats; its mean difference is a log perplexity ratio), top-1
#: agreement (0/1).
METRICS: dict[str, str] = {"kld": "kld", "nll": "nll", "top1": "top1"}


def mean_ci(values: torch.Tensor, counts: Sequence[int]) -> tuple[float, tuple[float, float]]:
    """Mean of ``values`` (float64 ``[Σ counts]``, window after window, ``counts[w]`` values of
    window ``w``) and its 95 % interval with the windows as the independent units
    (cluster-robust ratio estimator; see the module's docstring); the interval is NaN with fewer
    than two windows."""
    sums = torch.stack([chunk.sum() for chunk in values.split(list(counts))])
    n = torch.tensor(counts, dtype=torch.float64)
    mean = float(sums.sum() / n.sum())
    windows = len(counts)
    if windows < 2:
        return mean, (math.nan, math.nan)
    spread = float(((sums - mean * n) ** 2).sum())
    se = math.sqrt(windows / (windows - 1) * spread) / float(n.sum())
    return mean, (mean - Z95 * se, mean + Z95 * se)


def _exp_ci(ci: tuple[float, float]) -> tuple[float, float]:
    return (math.exp(ci[0]), math.exp(ci[1]))


@dataclass(frozen=True)
class TokenFidelity:
    """A quantized causal LM against its reference on one text
    (:func:`nvfp4lab.studies.llm.token_fidelity`, or :func:`fidelity_of` from per-token values).

    ``tokens``: predicted tokens scored (over ``windows`` windows of at most ``context``).
    ``perplexity`` / ``reference_perplexity``: ``exp(mean NLL)`` of the quantized model and the
    reference; ``perplexity_ratio``: quantized / reference, ``exp`` of the mean per-token NLL
    difference. ``kld_mean``, ``kld_p99``: mean and 99th percentile (linear interpolation) of the
    per-token KL(reference ‖ quantized), nats. ``top1_agreement``: fraction of positions where
    both models' most likely next token is the same. ``*_ci95``: 95 % confidence intervals,
    windows as the independent units (see the module's docstring). ``kld``, ``nll``,
    ``reference_nll``: the per-token values, float64 ``[tokens]`` in window order, CPU; ``top1``:
    the per-token agreement, float64 0/1 ``[tokens]``; ``window_tokens``: predicted tokens per
    window.
    """

    tokens: int
    windows: int
    context: int
    perplexity: float
    perplexity_ci95: tuple[float, float]
    reference_perplexity: float
    reference_perplexity_ci95: tuple[float, float]
    perplexity_ratio: float
    perplexity_ratio_ci95: tuple[float, float]
    kld_mean: float
    kld_ci95: tuple[float, float]
    kld_p99: float
    top1_agreement: float
    top1_ci95: tuple[float, float]
    window_tokens: tuple[int, ...] = field(repr=False)
    kld: torch.Tensor = field(repr=False, compare=False)
    nll: torch.Tensor = field(repr=False, compare=False)
    reference_nll: torch.Tensor = field(repr=False, compare=False)
    top1: torch.Tensor = field(repr=False, compare=False)

    def row(self) -> dict[str, float | int]:
        """The scalars as one table row, an interval as its ``_lo`` / ``_hi`` bounds (top-1's as
        ``top1_lo`` / ``top1_hi``, after ``top1_agreement``)."""
        out: dict[str, float | int] = {}
        for name in ("tokens", "windows", "context", "perplexity", "perplexity_ci95",
                     "reference_perplexity", "reference_perplexity_ci95", "perplexity_ratio",
                     "perplexity_ratio_ci95", "kld_mean", "kld_ci95", "kld_p99",
                     "top1_agreement", "top1_ci95"):
            value = getattr(self, name)
            if isinstance(value, tuple):
                stem = name.removesuffix("_ci95")
                out[f"{stem}_lo"], out[f"{stem}_hi"] = value
            else:
                out[name] = value
        return out


def fidelity_of(
    kld: torch.Tensor, nll: torch.Tensor, reference_nll: torch.Tensor, top1: torch.Tensor,
    window_tokens: Sequence[int], context: int,
) -> TokenFidelity:
    """A :class:`TokenFidelity` from per-token values, each ``[Σ window_tokens]`` in window order:
    ``kld`` KL(reference ‖ quantized), ``nll`` / ``reference_nll`` -log P(true next token) of the
    quantized model and the reference (float64, nats), ``top1`` whether their argmaxes agree
    (bool or 0/1; kept as float64). ``window_tokens``: predicted tokens per window (each >= 1);
    ``context``: tokens per window the run used."""
    counts = tuple(int(c) for c in window_tokens)
    if not counts or min(counts) < 1:
        raise ValueError(f"window_tokens must be one or more counts >= 1, got {counts}")
    total = sum(counts)
    given = {"kld": kld, "nll": nll, "reference_nll": reference_nll, "top1": top1}
    for name, values in given.items():
        if not isinstance(values, torch.Tensor) or values.shape != (total,):
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values)
            raise ValueError(f"{name} must be a tensor of shape ({total},) (one value per "
                             f"predicted token of window_tokens), got {shape}")
    kld, nll = kld.double().cpu(), nll.double().cpu()
    reference_nll, top1 = reference_nll.double().cpu(), top1.double().cpu()
    kld_mean, kld_ci = mean_ci(kld, counts)
    nll_mean, nll_ci = mean_ci(nll, counts)
    ref_mean, ref_ci = mean_ci(reference_nll, counts)
    diff_mean, diff_ci = mean_ci(nll - reference_nll, counts)
    top1_mean, top1_ci = mean_ci(top1, counts)
    return TokenFidelity(
        tokens=total, windows=len(counts), context=int(context),
        perplexity=math.exp(nll_mean), perplexity_ci95=_exp_ci(nll_ci),
        reference_perplexity=math.exp(ref_mean), reference_perplexity_ci95=_exp_ci(ref_ci),
        perplexity_ratio=math.exp(diff_mean), perplexity_ratio_ci95=_exp_ci(diff_ci),
        kld_mean=kld_mean, kld_ci95=kld_ci, kld_p99=float(torch.quantile(kld, 0.99)),
        top1_agreement=top1_mean, top1_ci95=top1_ci,
        window_tokens=counts, kld=kld, nll=nll, reference_nll=reference_nll, top1=top1,
    )


@dataclass(frozen=True)
class PairedDifference:
    """``metric`` of configuration a minus configuration b on the same run
    (:func:`paired_difference`): ``difference``, the mean of the per-token differences (nats for
    ``kld`` and ``nll``, where it is ``log(perplexity_a / perplexity_b)``; a fraction for
    ``top1``), its 95 % interval ``ci95`` (windows as units; NaN with one window), over
    ``windows`` windows and ``tokens`` tokens."""

    metric: str
    difference: float
    ci95: tuple[float, float]
    windows: int
    tokens: int

    @property
    def significant(self) -> bool:
        """Whether the 95 % interval excludes 0 (False when it is NaN: one window)."""
        lo, hi = self.ci95
        return bool(lo > 0.0 or hi < 0.0)

    def text(self, digits: int = 3) -> str:
        """``difference 0.004, 95 % interval -0.002 to 0.010, 8 windows`` (``digits``
        significant digits)."""
        lo, hi = self.ci95
        interval = ("no interval: one window" if math.isnan(lo) else
                    f"95 % interval {lo:.{digits}g} to {hi:.{digits}g}")
        return (f"difference {self.difference:.{digits}g}, {interval}, {self.windows} "
                f"window{'s' if self.windows != 1 else ''}")


def paired_difference(a: TokenFidelity, b: TokenFidelity, metric: str = "kld"
                      ) -> PairedDifference:
    """``metric`` of ``a`` minus ``b``, paired token by token, with its 95 % interval over the
    windows (the estimator of :func:`mean_ci` applied to the per-token differences).

    ``metric``: ``"kld"`` (mean KL divergence, nats), ``"nll"`` (mean NLL difference, nats: the
    log of ``a``'s perplexity over ``b``'s) or ``"top1"`` (top-1 agreement). ``a`` and ``b`` must
    be scored on the same reference run (same windows and reference NLL); ValueError otherwise.
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(map(repr, METRICS))}, got {metric!r}")
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, TokenFidelity):
            raise TypeError(f"{name} must be a TokenFidelity (studies.llm.token_fidelity), got "
                            f"{type(value).__name__}")
    if (a.tokens, a.window_tokens, a.context) != (b.tokens, b.window_tokens, b.context) or \
            not torch.allclose(a.reference_nll, b.reference_nll, rtol=1e-5, atol=1e-6):
        raise ValueError(
            f"a and b are not scored on the same run (a: {a.tokens} tokens in {a.windows} "
            f"windows of context {a.context}; b: {b.tokens} tokens in {b.windows} windows of "
            f"context {b.context}, or another reference / text): score both with one "
            "ReferenceRun"
        )
    field_name = METRICS[metric]
    values = getattr(a, field_name) - getattr(b, field_name)
    mean, ci = mean_ci(values, a.window_tokens)
    return PairedDifference(metric=metric, difference=mean, ci95=ci, windows=a.windows,
                            tokens=a.tokens)
