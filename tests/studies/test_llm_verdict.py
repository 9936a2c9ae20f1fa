"""The LLM study's verdict: paired differences against a numpy computation by hand from the
per-window sums, the best of each family on constructed results (ties, a family of one), the
verdict's text, and the worst layers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nvfp4lab.studies import llm, llm_layers
from nvfp4lab.studies import llm_configs as lc
from nvfp4lab.studies import llm_verdict as lv
from nvfp4lab.studies.llm_statistics import fidelity_of, paired_difference
from nvfp4lab.vocab import Backend, KVCacheKind, QuantMethod
from tests.execution.test_attention import IDS, tiny_llama

Z = 1.959963984540054  # the two-sided 95 % normal quantile, written out
COUNTS = (5, 7, 3, 9, 6, 4)  # unequal windows
REFERENCE_NLL = torch.linspace(1.0, 3.0, sum(COUNTS), dtype=torch.float64)


def synthetic(seed: int, kld_level: float, counts: tuple[int, ...] = COUNTS,
              reference_nll: torch.Tensor = REFERENCE_NLL) -> llm.TokenFidelity:
    """A fidelity with seeded per-token values: KL divergence around ``kld_level`` varying by
    window, NLL = reference + KLD-ish noise, top-1 agreement 0/1."""
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    level = torch.rand(len(counts), generator=g, dtype=torch.float64)
    window_level = torch.repeat_interleave(level, torch.tensor(counts))
    kld = kld_level * (0.5 + window_level) * torch.rand(n, generator=g, dtype=torch.float64) * 2
    nll = reference_nll + kld + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    top1 = torch.rand(n, generator=g) > kld_level
    return fidelity_of(kld, nll, reference_nll, top1, counts, context=max(counts) + 1)


def by_hand(values: np.ndarray, counts: tuple[int, ...]) -> tuple[float, float, float]:
    """Mean and 95 % interval of per-token ``values`` with the windows as units: the ratio of the
    window sums to the token counts, its cluster-robust standard error, loop by loop."""
    sums, start = [], 0
    for c in counts:
        sums.append(sum(float(v) for v in values[start : start + c]))
        start += c
    total = float(sum(counts))
    mean = sum(sums) / total
    w = len(counts)
    spread = sum((s - mean * c) ** 2 for s, c in zip(sums, counts, strict=True))
    se = math.sqrt(w / (w - 1) * spread) / total
    return mean, mean - Z * se, mean + Z * se


@pytest.mark.parametrize("metric", ["kld", "nll", "top1"])
def test_paired_difference_matches_the_window_sums_by_hand(metric: str) -> None:
    a, b = synthetic(1, 0.3), synthetic(2, 0.2)
    got = paired_difference(a, b, metric)
    field = {"kld": "kld", "nll": "nll", "top1": "top1"}[metric]
    values = getattr(a, field).numpy() - getattr(b, field).numpy()
    mean, lo, hi = by_hand(values, COUNTS)
    assert got.difference == pytest.approx(mean, rel=1e-12, abs=1e-15)
    assert got.ci95 == pytest.approx((lo, hi), rel=1e-12, abs=1e-15)
    assert (got.windows, got.tokens, got.metric) == (len(COUNTS), sum(COUNTS), metric)
    assert got.significant == (lo > 0 or hi < 0)
    if metric == "nll":  # the mean NLL difference is the log of the perplexity ratio
        assert got.difference == pytest.approx(math.log(a.perplexity / b.perplexity), rel=1e-9)
    if metric == "top1":
        assert got.difference == pytest.approx(a.top1_agreement - b.top1_agreement, abs=1e-12)


def test_paired_difference_with_equal_windows_is_the_window_means_interval() -> None:
    counts = (8,) * 6
    ref = torch.zeros(48, dtype=torch.float64)
    a, b = synthetic(3, 0.4, counts, ref), synthetic(4, 0.1, counts, ref)
    got = paired_difference(a, b)
    means = (a.kld - b.kld).numpy().reshape(6, 8).mean(axis=1)
    half = Z * means.std(ddof=1) / math.sqrt(6)
    assert got.ci95 == pytest.approx((means.mean() - half, means.mean() + half), rel=1e-9)
    assert got.significant and got.difference > 0  # 0.4 against 0.1: clearly apart
    assert "6 windows" in got.text() and f"{got.difference:.3g}" in got.text()


def test_significance_follows_the_interval() -> None:
    a = synthetic(5, 0.3)
    shifted = fidelity_of(a.kld + 0.05, a.nll, a.reference_nll, a.top1, COUNTS, a.context)
    up = paired_difference(shifted, a)  # the same tokens 0.05 worse everywhere
    assert up.difference == pytest.approx(0.05) and up.ci95 == pytest.approx((0.05, 0.05))
    assert up.significant
    same = paired_difference(a, a)
    assert same.difference == 0.0 and same.ci95 == (0.0, 0.0) and not same.significant
    g = torch.Generator().manual_seed(6)
    noise = 0.01 * torch.randn(a.tokens, generator=g, dtype=torch.float64)
    noisy = fidelity_of(a.kld + noise - noise.mean(), a.nll, a.reference_nll, a.top1, COUNTS,
                        a.context)
    flat = paired_difference(noisy, a)  # zero-mean noise: the interval holds 0
    assert flat.ci95[0] < 0 < flat.ci95[1] and not flat.significant
    one = [sum(COUNTS)]
    single = fidelity_of(a.kld, a.nll, a.reference_nll, a.top1, one, 64)
    lone = paired_difference(single, single)
    assert math.isnan(lone.ci95[0]) and not lone.significant and "one window" in lone.text()


def test_paired_difference_refuses_other_runs() -> None:
    a = synthetic(1, 0.3)
    other_windows = synthetic(2, 0.3, (6, 6, 3, 9, 6, 4))  # 34 tokens too
    with pytest.raises(ValueError, match=r"not scored on the same run.*one ReferenceRun"):
        paired_difference(a, other_windows)
    other_text = synthetic(2, 0.3, COUNTS, REFERENCE_NLL + 0.5)
    with pytest.raises(ValueError, match="not scored on the same run"):
        paired_difference(a, other_text)
    with pytest.raises(ValueError, match="metric must be one of 'kld', 'nll', 'top1', got 'ppl'"):
        paired_difference(a, a, "ppl")
    with pytest.raises(TypeError, match="b must be a TokenFidelity"):
        paired_difference(a, a.row())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"top1 must be a tensor of shape \(34,\)"):
        fidelity_of(a.kld, a.nll, a.reference_nll, a.top1[:5], COUNTS, 10)


# ---------------------------------------------------------------------------------------------
# The best of each family
# ---------------------------------------------------------------------------------------------

W4A16, W4A4 = Backend.W4A16, Backend.EMULATION
CONFIGS = {
    "W4A16 RTN": lc.LLMConfig("W4A16 RTN", W4A16),
    "W4A16 GPTQ": lc.LLMConfig("W4A16 GPTQ", W4A16, QuantMethod.GPTQ),
    "W4A16 MR-GPTQ": lc.LLMConfig("W4A16 MR-GPTQ", W4A16, QuantMethod.GPTQ, rotation=True),
    "W4A4 RTN, dynamic": lc.LLMConfig("W4A4 RTN, dynamic", W4A4),
    "KV nvfp4": lc.LLMConfig("KV nvfp4", None, kv_cache=KVCacheKind.NVFP4),
    "KV fp8": lc.LLMConfig("KV fp8", None, kv_cache=KVCacheKind.FP8),
    "W4A4 + KV nvfp4": lc.LLMConfig("W4A4 + KV nvfp4", W4A4, kv_cache=KVCacheKind.NVFP4),
}


def results() -> list[lc.ConfigResult]:
    """RTN worst of the weights-only family; GPTQ and MR-GPTQ tied exactly (identical
    per-token values, MR-GPTQ listed first); one W4A4; two KV caches far apart."""
    tied = synthetic(11, 0.1)
    fid = {"W4A16 RTN": synthetic(10, 0.2), "W4A16 MR-GPTQ": tied, "W4A16 GPTQ": tied,
           "W4A4 RTN, dynamic": synthetic(12, 0.4), "KV nvfp4": synthetic(13, 0.15),
           "KV fp8": synthetic(14, 0.01), "W4A4 + KV nvfp4": synthetic(15, 0.5)}
    order = ["W4A4 + KV nvfp4", "KV nvfp4", "W4A16 RTN", "W4A16 MR-GPTQ", "W4A16 GPTQ",
             "KV fp8", "W4A4 RTN, dynamic"]
    return [lc.ConfigResult(CONFIGS[label], fid[label], 1.5 + i, 100.0 * (i + 1) if i else None)
            for i, label in enumerate(order)]


def test_families() -> None:
    assert lv.family(CONFIGS["W4A16 GPTQ"]) == lv.WEIGHTS_ONLY
    assert lv.family(CONFIGS["W4A4 RTN, dynamic"]) == lv.WEIGHTS_ACTIVATIONS
    assert lv.family(CONFIGS["KV fp8"]) == lv.KV_ONLY
    assert lv.family(CONFIGS["W4A4 + KV nvfp4"]) == lv.WEIGHTS_ACTIVATIONS_KV
    assert lv.family(lc.LLMConfig("x", W4A16, kv_cache="fp8")) == lv.WEIGHTS_KV
    assert lv.family(lc.LLMConfig("q8", Backend.Q8_0)) == lv.WEIGHTS_ACTIVATIONS
    assert {lv.family(c) for c in lc.configurations()} == {
        lv.WEIGHTS_ONLY, lv.WEIGHTS_ACTIVATIONS, lv.KV_ONLY, lv.WEIGHTS_ACTIVATIONS_KV}


def test_best_per_family_picks_the_lowest_mean_kld() -> None:
    given = results()
    verdicts = lv.best_per_family(given)
    by_family = {v.family: v for v in verdicts}
    assert [v.family for v in verdicts] == [lv.WEIGHTS_ONLY, lv.WEIGHTS_ACTIVATIONS, lv.KV_ONLY,
                                            lv.WEIGHTS_ACTIVATIONS_KV]
    for verdict in verdicts:  # the oracle: the minimum over the family's members
        members = [r for r in given if lv.family(r.config) == verdict.family]
        lowest = min(r.fidelity.kld_mean for r in members)
        assert verdict.best.fidelity.kld_mean == lowest
        assert len(verdict.others) == len(members) - 1
        assert [c.result.fidelity.kld_mean for c in verdict.others] == sorted(
            r.fidelity.kld_mean for r in members if r is not verdict.best)
        for c in verdict.others:
            want = paired_difference(c.result.fidelity, verdict.best.fidelity)
            assert c.kld == want and c.kld.difference >= 0
    weights = by_family[lv.WEIGHTS_ONLY]
    assert weights.best.label == "W4A16 MR-GPTQ"  # tied with GPTQ, listed first
    tie, rtn = weights.others
    assert tie.result.label == "W4A16 GPTQ" and tie.tie and not tie.kld.significant
    assert rtn.result.label == "W4A16 RTN" and not rtn.tie
    assert by_family[lv.WEIGHTS_ACTIVATIONS].others == ()  # a family of one
    kv = by_family[lv.KV_ONLY]
    assert kv.best.label == "KV fp8" and kv.others[0].kld.significant
    swapped = lv.best_per_family([given[4], given[3]])  # GPTQ first now: GPTQ is named
    assert swapped[0].best.label == "W4A16 GPTQ"


def test_best_per_family_refuses_bad_results() -> None:
    with pytest.raises(ValueError, match="at least one ConfigResult"):
        lv.best_per_family([])
    with pytest.raises(TypeError, match="results must be ConfigResult"):
        lv.best_per_family([{"label": "x"}])  # type: ignore[list-item]
    one = results()[0]
    with pytest.raises(ValueError, match="'W4A4 \\+ KV nvfp4' appear more than once"):
        lv.best_per_family([one, one])


def test_rows_and_verdict_text_carry_the_numbers() -> None:
    verdicts = lv.best_per_family(results())
    rows = {r["family"]: r for r in lv.family_rows(verdicts)}
    kv = rows[lv.KV_ONLY]
    best = next(v for v in verdicts if v.family == lv.KV_ONLY).best
    f = best.fidelity
    assert (kv["best"], kv["members"], kv["next"]) == ("KV fp8", 2, "KV nvfp4")
    assert (kv["kld_lo"], kv["kld_hi"]) == f.kld_ci95
    assert (kv["perplexity_ratio_lo"], kv["top1_hi"]) == (f.perplexity_ratio_ci95[0],
                                                          f.top1_ci95[1])
    assert (kv["windows"], kv["tokens"], kv["build_seconds"]) == (6, 34, best.build_seconds)
    assert kv["peak_rss_mb"] == best.peak_rss_mb and kv["significant"]
    assert math.isnan(rows[lv.WEIGHTS_ACTIVATIONS]["kld_difference"])
    assert math.isnan(rows[lv.WEIGHTS_ACTIVATIONS_KV]["peak_rss_mb"])  # not measured
    table = {r["family"]: r for r in lv.family_table(verdicts)}
    assert table[lv.KV_ONLY]["mean KLD, nats/token [95 % interval]"] == \
        f"{f.kld_mean:.4g} [{f.kld_ci95[0]:.4g}, {f.kld_ci95[1]:.4g}]"
    assert table[lv.KV_ONLY]["top-1 agreement"] == \
        f"{f.top1_agreement:.4g} [{f.top1_ci95[0]:.4g}, {f.top1_ci95[1]:.4g}]"
    assert table[lv.KV_ONLY]["windows (tokens)"] == "6 (34)"
    assert table[lv.KV_ONLY]["lead significant"] == "yes"
    assert table[lv.WEIGHTS_ACTIVATIONS]["runner-up"] == "-"
    assert table[lv.WEIGHTS_ACTIVATIONS_KV]["peak memory, MiB"] == "-"
    comparisons = lv.comparison_rows(verdicts)
    assert [c["configuration"] for c in comparisons] == ["W4A16 GPTQ", "W4A16 RTN", "KV nvfp4"]

    text = lv.verdict_text(verdicts)
    assert f"**KV fp8** is best, mean KLD {f.kld_mean:.3g} nats/token" in text
    assert f"95 % interval {f.kld_ci95[0]:.3g} to {f.kld_ci95[1]:.3g}" in text
    assert f"perplexity {f.perplexity_ratio:.4f}× the reference's" in text
    assert f"top-1 agreement {f.top1_agreement:.3g} (95 % interval {f.top1_ci95[0]:.3g}" in text
    assert f"6 windows, 34 tokens; built in {best.build_seconds:.1f} s, peak memory " \
           f"{best.peak_rss_mb:.0f} MiB" in text
    kv_lead = next(v for v in verdicts if v.family == lv.KV_ONLY).others[0].kld
    assert f"Its lead over KV nvfp4 ({kv_lead.text()}) is significant." in text
    assert "It ties with W4A16 GPTQ" in text and "only configuration of its family" in text
    rtn = next(v for v in verdicts if v.family == lv.WEIGHTS_ONLY).others[1].kld
    assert f"W4A16 RTN ({rtn.text()}) is " + ("significant" if rtn.significant else
                                            "**not significant**") in text
    with pytest.raises(ValueError, match="at least one FamilyVerdict"):
        lv.verdict_text([])


def test_worst_layers() -> None:
    model = tiny_llama()
    rows = llm_layers.linear_rows(model, IDS[:1])
    worst = lv.worst_layers(rows, 3)
    want = sorted(rows, key=lambda r: r["weight_nmse"], reverse=True)[:3]
    assert [w["short"] for w in worst] == [r["short"] for r in want]
    assert [w["rank"] for w in worst] == [1, 2, 3] and worst[0]["by"] == "weight_nmse"
    by_input = lv.worst_layers(rows, 2, by="activation_nmse")
    assert by_input[0]["activation_nmse"] == max(r["activation_nmse"] for r in rows)
    assert len(lv.worst_layers(rows, 10_000)) == len(rows)
    values = sorted(r["weight_nmse"] for r in rows)
    middle = len(values) // 2
    median = values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
    assert worst[0]["median"] == median and worst[0]["layers"] == len(rows)
    text = lv.verdict_text(lv.best_per_family(results()), worst=worst)
    assert f"Worst layers by NVFP4 weight NMSE: `{worst[0]['short']}` " \
           f"({worst[0]['weight_nmse']:.3g})" in text
    assert f"the median over all {len(rows)} layers is {median:.3g}, so the worst is " \
           f"{worst[0]['weight_nmse'] / median:.2f}× the median." in text
    with pytest.raises(ValueError, match="n must be a whole number >= 1"):
        lv.worst_layers(rows, 0)
    with pytest.raises(ValueError, match="by must be one of"):
        lv.worst_layers(rows, by="crest")
    with pytest.raises(ValueError, match="linear_rows lack"):
        lv.worst_layers([{"short": "0.q_proj"}])
