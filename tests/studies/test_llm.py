"""The LLM study: token fidelity (perplexity, KL divergence, top-1 agreement) of causal LMs.

The oracle is written independently of :mod:`nvfp4lab.studies.llm`: each window run on its own,
then a plain loop over the predicted positions computing softmax, KL and NLL in float64 with
``math``-level sums, on tiny seeded random Llama models (2 layers, hidden 64). One test runs the
real SmolLM2-135M-Instruct (the ``[llm]`` extra).
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics
from typing import Any

import pytest
import torch

from nvfp4lab import corpus
from nvfp4lab.studies import llm
from tests.conftest import needs_smollm2

VOCAB = 96


def tiny_llama(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, initializer_range=0.2,  # peaked predictions, not uniform
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any]:
    """A tiny random Llama and a copy with every weight perturbed by noise (seeded)."""
    reference = tiny_llama(0)
    perturbed = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=generator))
    return reference, perturbed


def random_ids(n: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def oracle(reference: Any, quantized: Any, ids: torch.Tensor, context: int) -> dict[str, Any]:
    """Per-token KL(P‖Q), quantized NLL, reference NLL and argmax agreement by a plain loop."""
    kld, nll, ref_nll, agree, counts = [], [], [], [], []
    for start in range(0, len(ids), context):
        window = ids[start : start + context]
        if len(window) < 2:
            continue
        with torch.no_grad():
            p_logits = reference(window[None]).logits[0].double()
            q_logits = quantized(window[None]).logits[0].double()
        counts.append(len(window) - 1)
        for t in range(1, len(window)):
            p_row, q_row = p_logits[t - 1].tolist(), q_logits[t - 1].tolist()
            p_max, q_max = max(p_row), max(q_row)
            p_lse = p_max + math.log(math.fsum(math.exp(v - p_max) for v in p_row))
            q_lse = q_max + math.log(math.fsum(math.exp(v - q_max) for v in q_row))
            log_p = [v - p_lse for v in p_row]
            log_q = [v - q_lse for v in q_row]
            kld.append(math.fsum(math.exp(a) * (a - b) for a, b in zip(log_p, log_q,
                                                                       strict=True)))
            target = int(window[t])
            nll.append(-log_q[target])
            ref_nll.append(-log_p[target])
            agree.append(p_row.index(p_max) == q_row.index(q_max))
    return {"kld": kld, "nll": nll, "ref_nll": ref_nll, "agree": agree, "counts": counts}


def test_windows() -> None:
    assert llm.windows_of(10, 4) == ((0, 4), (4, 8), (8, 10))
    assert llm.windows_of(9, 4) == ((0, 4), (4, 8))  # a last window of one token predicts nothing
    assert llm.windows_of(8, 4) == ((0, 4), (4, 8))
    assert llm.windows_of(1, 4) == ()
    with pytest.raises(ValueError, match="context must be >= 2"):
        llm.windows_of(10, 1)
    windows = (*llm.windows_of(10, 4), (10, 12))
    assert llm._batches(windows, 2) == ((0, 1), (2, 3))
    assert llm._batches(llm.windows_of(11, 4), 4) == ((0, 1), (2,))  # lengths 4, 4, 3
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        llm._batches(windows, 0)


@pytest.mark.parametrize(("n", "context", "batch_size"), [(150, 64, 1), (150, 64, 3),
                                                          (129, 64, 2), (64, 64, 4)])
def test_matches_the_per_token_oracle(
    pair: tuple[Any, Any], n: int, context: int, batch_size: int
) -> None:
    """Windows that do not divide the text (150 = 64 + 64 + 22; 129 leaves a 1-token tail),
    batched or not."""
    reference, quantized = pair
    ids = random_ids(n)
    got = llm.token_fidelity(reference, quantized, ids, context=context, batch_size=batch_size,
                             progress=False)
    want = oracle(reference, quantized, ids, context)
    assert got.window_tokens == tuple(want["counts"])
    assert got.tokens == len(want["kld"]) == n - math.ceil(n / context)
    tol = {"rel": 1e-4, "abs": 1e-7}  # float32 logits of a batched vs a single-window run
    assert got.kld.tolist() == pytest.approx(want["kld"], **tol)
    assert got.nll.tolist() == pytest.approx(want["nll"], **tol)
    assert got.reference_nll.tolist() == pytest.approx(want["ref_nll"], **tol)
    assert got.kld_mean == pytest.approx(statistics.fmean(want["kld"]), **tol)
    assert got.kld_p99 == pytest.approx(float(torch.quantile(torch.tensor(want["kld"]), 0.99)),
                                        **tol)
    assert got.perplexity == pytest.approx(math.exp(statistics.fmean(want["nll"])), rel=1e-6)
    assert got.reference_perplexity == pytest.approx(
        math.exp(statistics.fmean(want["ref_nll"])), rel=1e-6)
    assert got.perplexity_ratio == pytest.approx(got.perplexity / got.reference_perplexity,
                                                 rel=1e-12)
    assert got.top1_agreement == pytest.approx(statistics.fmean(want["agree"]))
    assert 0 < got.kld_mean < got.kld_p99 and got.top1_agreement < 1  # really perturbed
    assert got.kld.dtype == got.nll.dtype == torch.float64


def test_identical_models_agree_exactly(pair: tuple[Any, Any]) -> None:
    reference, _ = pair
    got = llm.token_fidelity(reference, reference, random_ids(150), context=64, progress=False)
    assert got.kld_mean == 0.0 and got.kld_p99 == 0.0 and not got.kld.any()
    assert got.kld_ci95 == (0.0, 0.0)
    assert got.perplexity == got.reference_perplexity
    assert got.perplexity_ratio == 1.0 and got.perplexity_ratio_ci95 == (1.0, 1.0)
    assert got.top1_agreement == 1.0 and got.top1_ci95 == (1.0, 1.0)
    assert torch.equal(got.nll, got.reference_nll)


def test_confidence_intervals_over_windows(pair: tuple[Any, Any]) -> None:
    """Equal windows: the interval is mean ± 1.96 · stdev(window means) / sqrt(W)."""
    reference, quantized = pair
    context, windows = 16, 12
    got = llm.token_fidelity(reference, quantized, random_ids(context * windows),
                             context=context, batch_size=5, progress=False)
    assert got.windows == windows and set(got.window_tokens) == {context - 1}

    def interval(values: torch.Tensor) -> tuple[float, float]:
        means = values.reshape(windows, context - 1).mean(dim=1).tolist()
        half = 1.959963984540054 * statistics.stdev(means) / math.sqrt(windows)
        return (statistics.fmean(means) - half, statistics.fmean(means) + half)

    assert got.kld_ci95 == pytest.approx(interval(got.kld), rel=1e-9)
    assert got.perplexity_ci95 == pytest.approx(
        tuple(math.exp(v) for v in interval(got.nll)), rel=1e-9)
    assert got.reference_perplexity_ci95 == pytest.approx(
        tuple(math.exp(v) for v in interval(got.reference_nll)), rel=1e-9)
    assert got.perplexity_ratio_ci95 == pytest.approx(
        tuple(math.exp(v) for v in interval(got.nll - got.reference_nll)), rel=1e-9)
    assert got.top1.dtype == torch.float64 and set(got.top1.tolist()) == {0.0, 1.0}
    assert got.top1_agreement == pytest.approx(statistics.fmean(got.top1.tolist()), rel=1e-12)
    assert got.top1_ci95 == pytest.approx(interval(got.top1), rel=1e-9)
    lo, hi = got.kld_ci95
    assert lo < got.kld_mean < hi
    # the paired ratio is tighter than the ratio of the two perplexities' intervals
    ratio_width = got.perplexity_ratio_ci95[1] - got.perplexity_ratio_ci95[0]
    assert ratio_width < (got.perplexity_ci95[1] - got.perplexity_ci95[0]) / got.perplexity
    one = llm.token_fidelity(reference, quantized, random_ids(40), context=64, progress=False)
    assert one.windows == 1 and all(math.isnan(v) for v in one.kld_ci95)
    row = got.row()
    assert row["kld_lo"] == lo and row["kld_hi"] == hi and row["tokens"] == got.tokens
    assert "kld_ci95" not in row and len(row) == 19
    assert (row["top1_lo"], row["top1_hi"]) == got.top1_ci95
    old_keys = ["tokens", "windows", "context", "perplexity", "perplexity_lo", "perplexity_hi",
                "reference_perplexity", "reference_perplexity_lo", "reference_perplexity_hi",
                "perplexity_ratio", "perplexity_ratio_lo", "perplexity_ratio_hi", "kld_mean",
                "kld_lo", "kld_hi", "kld_p99", "top1_agreement"]
    assert [k for k in row if k in old_keys] == old_keys  # the old keys, in their old order


def test_a_reference_run_serves_many_comparisons(pair: tuple[Any, Any]) -> None:
    reference, quantized = pair
    ids = random_ids(150)
    direct = llm.token_fidelity(reference, quantized, ids, context=64, progress=False)
    run = llm.reference_run(reference, ids, context=64, progress=False)
    assert run.hidden is not None and run.model is None  # hidden states + a copy of the head
    assert [h.shape for h in run.hidden] == [(2, 64, 64), (1, 22, 64)]
    assert run.tokens == direct.tokens and run.perplexity == direct.reference_perplexity
    with torch.no_grad():  # the reference changes afterwards: the run does not
        reference.lm_head.weight.mul_(2.0)
    try:
        again = llm.token_fidelity(run, quantized, progress=False)
    finally:
        with torch.no_grad():
            reference.lm_head.weight.div_(2.0)
    assert again == direct
    assert torch.equal(again.kld, direct.kld) and torch.equal(again.nll, direct.nll)
    assert llm.token_fidelity(run, reference, progress=False).kld_mean == 0.0
    with pytest.raises(ValueError, match="leave out text, context"):
        llm.token_fidelity(run, quantized, ids, context=64)


def test_chunks_of_rows_match_the_oracle(pair: tuple[Any, Any],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's float64 chunks are sized by bytes (4 rows of SmolLM2's 49,152 logits, never
    fewer than 2); rows that do not divide by the chunk still match the per-token oracle."""
    assert llm._chunk_rows(torch.empty(0, 49152)) == 4
    assert llm._chunk_rows(torch.empty(0, 10**7)) == 2
    monkeypatch.setattr(llm, "_CPU_CHUNK_BYTES", 8 * VOCAB * 3)  # 3 rows: 63 + 21 rows
    assert llm._chunk_rows(torch.empty(0, VOCAB)) == 3
    reference, quantized = pair
    ids = random_ids(150)
    got = llm.token_fidelity(reference, quantized, ids, context=64, progress=False)
    want = oracle(reference, quantized, ids, 64)
    assert got.kld.tolist() == pytest.approx(want["kld"], rel=1e-4, abs=1e-7)
    assert got.nll.tolist() == pytest.approx(want["nll"], rel=1e-4, abs=1e-7)
    assert got.reference_nll.tolist() == pytest.approx(want["ref_nll"], rel=1e-4, abs=1e-7)
    assert got.top1_agreement == pytest.approx(statistics.fmean(want["agree"]))


def test_a_run_keeps_its_logits_while_they_fit(pair: tuple[Any, Any],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's logits are kept after their first use (the head's own bits), unless all of
    the run's would exceed LOGITS_KEPT_BYTES; either way comparisons give the same result."""
    reference, quantized = pair
    ids = random_ids(150)
    run = llm.reference_run(reference, ids, context=64, progress=False)
    assert run.hidden is not None and run.head is not None
    with torch.no_grad():
        fresh = [run.head(h) for h in run.hidden]
    first = [run.logits(b) for b in range(len(run.batches))]
    assert all(torch.equal(a, b) for a, b in zip(first, fresh, strict=True))
    assert all(run.logits(b) is first[b] for b in range(len(run.batches)))  # kept
    kept = llm.token_fidelity(run, quantized, progress=False)
    per_window = 4 * 64 * VOCAB  # float32 logits of one full window
    monkeypatch.setattr(llm, "LOGITS_KEPT_BYTES", per_window * len(run.windows) - 1)
    tight = llm.reference_run(reference, ids, context=64, progress=False)
    assert tight.logits(0) is not tight.logits(0)  # computed again each time
    assert torch.equal(tight.logits(0), first[0])
    again = llm.token_fidelity(tight, quantized, progress=False)
    assert torch.equal(again.kld, kept.kld) and torch.equal(again.nll, kept.nll)
    monkeypatch.setattr(llm, "LOGITS_KEPT_BYTES", 1 << 30)
    import nvfp4lab.bench.runner as runner

    monkeypatch.setattr(runner, "available_memory_bytes",
                        lambda device: 4 * per_window * len(run.windows) - 1)  # little memory
    short = llm.reference_run(reference, ids, context=64, progress=False)
    assert short.logits(0) is not short.logits(0)


def test_compare_reads_windows_in_place_and_takes_the_first_maximum() -> None:
    """_compare on windows of different rows: KL, NLL and top-1 agree with float64
    log-softmaxes and torch.argmax (the first of tied maxima), row by row, whatever the chunk."""
    g = torch.Generator().manual_seed(5)
    reference = torch.randn(3, 9, 40, generator=g) * 4
    quantized = reference + 0.5 * torch.randn(3, 9, 40, generator=g)
    reference[0, 2, [5, 30]] = 50.0  # tied maxima: the argmax is 5, not 30
    quantized[0, 2, [5, 30]] = torch.tensor([49.0, 50.0])  # the argmax is 30: no agreement
    reference[1, 4, [2, 11]] = 60.0  # tied maxima again, the first (2) agreeing this time
    quantized[1, 4, 2] = 70.0
    ids = torch.randint(0, 40, (3, 9), generator=g)
    kld, nll, agree = llm._compare(reference, quantized, ids)
    r = reference[:, :-1].reshape(-1, 40).double().log_softmax(-1)
    q = quantized[:, :-1].reshape(-1, 40).double().log_softmax(-1)
    assert kld.tolist() == pytest.approx((r.exp() * (r - q)).sum(-1).tolist(), abs=1e-12)
    want_nll = -q.gather(1, ids[:, 1:].reshape(-1, 1)).squeeze(1)
    assert nll.tolist() == pytest.approx(want_nll.tolist(), rel=1e-12)
    want_agree = (reference[:, :-1].argmax(-1) == quantized[:, :-1].argmax(-1)).reshape(-1)
    assert torch.equal(agree, want_agree) and kld.shape == (24,)
    assert not agree[2] and agree[8 + 4]
    want_reference_nll = -r.gather(1, ids[:, 1:].reshape(-1, 1)).squeeze(1)
    assert llm._nll(reference, ids).tolist() == pytest.approx(want_reference_nll.tolist(),
                                                              rel=1e-12)


@pytest.mark.parametrize("shape, step", [((5, 2, 8), 2), ((3, 9, 8), 3), ((2, 7, 8), 4),
                                         ((1, 1, 8), 2), ((4, 3, 8), 5)])
def test_row_chunks_are_the_flattened_rows_chunks(shape: tuple[int, int, int], step: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """_row_chunks gives the chunks _chunks gives the flattened predicting rows (so one-row
    windows, T = 2, still never make a one-row chunk), as views of one window where they lie in
    one, with the same values."""
    monkeypatch.setattr(llm, "_CPU_CHUNK_BYTES", 8 * shape[-1] * step)
    logits = torch.randn(shape)
    flat = logits[:, :-1].reshape(-1, shape[-1])
    got = list(llm._row_chunks(logits))
    assert [(a, b) for a, b, _ in got] == list(llm._chunks(flat))
    per = shape[1] - 1
    for start, stop, rows in got:
        assert torch.equal(rows, flat[start:stop])
        inside = start // per == (stop - 1) // per
        assert (rows.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()) == inside


def test_chunks_never_leave_one_row_alone() -> None:
    for n, step_rows in ((765, 4), (9, 4), (8, 4), (1, 4), (5, 2), (3, 2)):
        rows = torch.empty(n, 8 * 1024)
        assert llm._chunk_rows(rows) == 24  # 1.5 MiB of float64 rows of 8,192
        bounds = list(llm._chunks(rows[:, : (3 << 19) // (8 * step_rows)]))
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
        assert all(stop - start >= 2 for start, stop in bounds) or n == 1


def test_float64_logits_are_kept_unchanged_and_not_pickled(pair: tuple[Any, Any]) -> None:
    """A float64 reference's kept logits are not changed by a comparison (it works on a copy),
    so comparing twice gives the same result; a pickled run leaves the kept logits behind."""
    import pickle

    reference, quantized = (copy.deepcopy(m).double() for m in pair)
    ids = random_ids(150)
    run = llm.reference_run(reference, ids, context=64, batch_size=1, progress=False)
    kept = [run.logits(b).clone() for b in range(len(run.batches))]
    first = llm.token_fidelity(run, quantized, progress=False)
    again = llm.token_fidelity(run, quantized, progress=False)
    assert torch.equal(first.kld, again.kld) and first.kld_mean > 0
    assert all(torch.equal(run.logits(b), kept[b]) for b in range(len(run.batches)))
    restored = pickle.loads(pickle.dumps(run))
    assert restored._kept_logits == {} and run._kept_logits
    assert torch.equal(llm.token_fidelity(restored, quantized, progress=False).kld, first.kld)


class ScaledLogits(torch.nn.Module):
    """A causal LM whose logits are not its head's output (scaled after it)."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.inner.lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=input_ids).logits * 0.5


def test_a_reference_without_a_usable_head_is_run_again(pair: tuple[Any, Any]) -> None:
    reference, quantized = pair
    ids = random_ids(100)
    scaled = ScaledLogits(reference)
    run = llm.reference_run(scaled, ids, context=32, batch_size=2, progress=False)
    assert run.hidden is None and run.head is None and run.model is scaled
    got = llm.token_fidelity(run, quantized, progress=False)
    want = oracle(lambda x: type("Out", (), {"logits": scaled(x)}), quantized, ids, 32)
    assert got.kld.tolist() == pytest.approx(want["kld"], rel=1e-4, abs=1e-7)
    plain = lambda input_ids: reference(input_ids=input_ids)  # noqa: E731  (no head to find)
    assert llm.reference_run(plain, ids, context=32, progress=False).model is plain


def test_text_and_tokenizer(pair: tuple[Any, Any]) -> None:
    reference, quantized = pair

    def tokenizer(text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % VOCAB for c in text]}

    text = "Each window predicts its own tokens. " * 5
    got = llm.token_fidelity(reference, quantized, text, tokenizer=tokenizer, context=64,
                             progress=False)
    by_ids = llm.token_fidelity(reference, quantized, corpus.token_ids(tokenizer, text),
                                context=64, progress=False)
    assert got == by_ids and got.tokens == len(text) - 3
    capped = llm.token_fidelity(reference, quantized, text, tokenizer=tokenizer, context=64,
                                max_tokens=100, progress=False)
    assert capped.tokens == 99 - 1 and capped.window_tokens == (63, 35)
    with pytest.raises(TypeError, match="1-D integer tensor"):
        llm.token_fidelity(reference, quantized, torch.rand(10))
    with pytest.raises(ValueError, match="nothing to predict"):
        llm.token_fidelity(reference, quantized, torch.tensor([3]), progress=False)


def test_progress_bars_count_windows(pair: tuple[Any, Any], capsys: pytest.CaptureFixture,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from nvfp4lab import settings

    reference, quantized = pair
    bars: list[Any] = []
    text_bar = settings.tqdm_class({settings.TEXT_PROGRESS_ENV: "1"})

    def recording(*args: Any, **kwargs: Any) -> Any:
        bars.append(text_bar(*args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(llm, "tqdm_class", lambda: recording)
    llm.token_fidelity(reference, quantized, random_ids(150), context=64, progress=True)
    assert [(b.desc, b.total, b.n) for b in bars] == [("reference", 3, 3), ("quantized", 3, 3)]


@needs_smollm2
def test_smollm2_perplexity_on_the_evaluation_text(smollm2: tuple[Any, Any]) -> None:
    """The first 512 tokens of the evaluation part: one window, 511 predictions, checked
    against transformers' own loss (``model(ids, labels=ids).loss``, float32)."""
    model, tokenizer = smollm2
    got = llm.token_fidelity(model, model, tokenizer=tokenizer, max_tokens=512, progress=False)
    assert (got.tokens, got.windows) == (511, 1)
    assert got.kld_mean == 0.0 and got.top1_agreement == 1.0
    ids = corpus.token_ids(tokenizer, corpus.pydoc_text("evaluation"))[:512][None]
    with torch.no_grad():
        loss = float(model(ids, labels=ids).loss)
    assert got.reference_perplexity == pytest.approx(math.exp(loss), rel=1e-5)
    assert 15.8 < got.reference_perplexity < 16.2  # measured 15.994 (CPU, float32)


# ---------------------------------------------------------------------------------------------
# Issue 32: a tokenizer whose ids exceed the model's vocabulary raised torch's IndexError, a
# model that is not a causal LM an AttributeError (or, with logits, gave a silent answer), and
# context=2.5 a TypeError from range(). Each is now one clear error before anything runs.
# ---------------------------------------------------------------------------------------------


def _bert(head: str) -> Any:
    from transformers import BertConfig, BertForMaskedLM, BertModel

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    return (BertModel if head == "base" else BertForMaskedLM)(config).eval()


def _counting(model: Any, calls: list[int]) -> Any:
    """``model`` as a plain callable that counts its forward passes."""
    def forward(input_ids: torch.Tensor) -> Any:
        calls.append(len(input_ids))
        return model(input_ids=input_ids)
    return forward


def test_token_ids_beyond_the_vocabulary_are_named(pair: tuple[Any, Any]) -> None:
    reference, quantized = pair

    def wide(text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}  # 'a' = 97 > VOCAB - 1

    text = "abc " * 20
    with pytest.raises(ValueError, match=r"^token id 97 at position 0 is out of range \(the "
                       r"reference model's vocabulary is ids 0\.\.95; 60 id\(s\) out of range\): "
                       r"the token ids are not the model's; tokenize the text with the model's "
                       r"own tokenizer$"):
        llm.token_fidelity(reference, quantized, text, tokenizer=wide, context=32,
                           progress=False)
    ids = random_ids(80)
    ids[41] = -3
    with pytest.raises(ValueError, match=r"^token id -3 at position 41 is out of range"):
        llm.reference_run(reference, ids, context=32, progress=False)
    # a plain callable reveals no vocabulary until its logits: named there, not IndexError
    ids[41] = VOCAB + 5
    with pytest.raises(ValueError, match=r"^token id 101 at position \(1, 9\) is out of range "
                       r"\(the function model's vocabulary is ids 0\.\.95"):
        llm.reference_run(lambda input_ids: torch.zeros(*input_ids.shape, VOCAB), ids,
                          context=32, progress=False)


def test_models_with_other_vocabularies_are_refused_before_running(
    pair: tuple[Any, Any]
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    reference, _ = pair
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    small = LlamaForCausalLM(config).eval()
    calls: list[int] = []
    small.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(ValueError, match=r"^the reference model has a vocabulary of 96 tokens, "
                       r"the quantized model 64"):
        llm.token_fidelity(reference, small, random_ids(80), context=32, progress=False)
    run = llm.reference_run(reference, random_ids(80), context=32, progress=False)
    with pytest.raises(ValueError, match=r"^token id \d+ at position \d+ is out of range \(the "
                       r"quantized model's vocabulary is ids 0\.\.63"):
        llm.token_fidelity(run, small, progress=False)
    assert calls == []


@pytest.mark.parametrize("head", ["base", "masked-lm"])
@pytest.mark.parametrize("role", ["reference", "quantized"])
def test_a_model_that_is_not_a_causal_lm_is_refused(head: str, role: str,
                                                    pair: tuple[Any, Any]) -> None:
    """BertModel has no logits (AttributeError before); BertForMaskedLM has logits that see the
    whole window, so its 'next-token' scores were silently meaningless."""
    reference, quantized = pair
    bert = _bert(head)
    calls: list[int] = []
    name = "BertModel" if head == "base" else "BertForMaskedLM"
    models = (bert, quantized) if role == "reference" else (_counting(reference, calls), bert)
    with pytest.raises(TypeError, match=rf"^the {role} model is a {name} \(bert\), not a decoder "
                       r"that predicts the next token; token_fidelity needs a causal language "
                       r"model: model\(input_ids=int64 \[B, T\]\) returning \.logits"):
        llm.token_fidelity(*models, random_ids(80), context=32, progress=False)
    assert calls == []  # refused before the reference ran


def test_a_callable_without_logits_is_refused(pair: tuple[Any, Any]) -> None:
    reference, _ = pair
    hidden = lambda input_ids: reference.model(input_ids=input_ids)  # noqa: E731  (no head)
    with pytest.raises(TypeError, match=r"^function returned a BaseModelOutputWithPast without "
                       r"logits; token_fidelity needs a causal language model"):
        llm.token_fidelity(reference, hidden, random_ids(80), context=32, progress=False)


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"context": 2.5}, TypeError, r"^context must be a whole number >= 2 \(tokens per "
                                      r"window, one to predict from\), got 2\.5 \(float\); pass "
                                      r"an int$"),
        ({"context": "32"}, TypeError, r"^context must be a whole number >= 2 .* got '32' \(str\)"),
        ({"context": True}, TypeError, r"^context must be a whole number .* got True \(bool\)"),
        ({"context": 1}, ValueError, r"^context must be >= 2 \(tokens per window, one to "
                                     r"predict from\), got 1$"),
        ({"batch_size": 1.5}, TypeError, r"^batch_size must be a whole number >= 1 \(windows "
                                         r"per forward pass\), got 1\.5"),
        ({"batch_size": 0}, ValueError, r"^batch_size must be >= 1 .* got 0$"),
        ({"max_tokens": 10.5}, TypeError, r"^max_tokens must be a whole number >= 2 \(tokens "
                                          r"scored\), got 10\.5"),
        ({"max_tokens": 1}, ValueError, r"^max_tokens must be >= 2 \(tokens scored\), got 1$"),
    ],
)
def test_bad_counts_are_one_clear_error_before_anything_runs(
    arguments: dict[str, Any], error: type[Exception], match: str, pair: tuple[Any, Any]
) -> None:
    reference, quantized = pair
    calls: list[int] = []
    with pytest.raises(error, match=match):
        llm.token_fidelity(_counting(reference, calls), quantized, random_ids(80),
                           progress=False, **arguments)
    assert calls == []
    with pytest.raises(error, match=match):
        llm.reference_run(reference, random_ids(80), progress=False, **arguments)


def test_which_transformers_models_count_as_causal() -> None:
    """The structural rule behind the refusal: decoders pass, BERT only as a decoder."""
    from transformers import (
        BertConfig,
        BertLMHeadModel,
        GPT2Config,
        GPT2LMHeadModel,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaModel,
    )

    small = {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
    for model in (tiny_llama(0), GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2)),
                  GPTNeoXForCausalLM(GPTNeoXConfig(num_hidden_layers=1, **small)),
                  BertLMHeadModel(BertConfig(num_hidden_layers=1, is_decoder=True, **small))):
        llm._check_causal_lm(model, "reference")  # no error
    as_in_transformers_4 = tiny_llama(0)  # every v4 config holds both, False
    as_in_transformers_4.config.is_decoder = as_in_transformers_4.config.add_cross_attention = False
    llm._check_causal_lm(as_in_transformers_4, "reference")  # no error
    for model in (LlamaModel(tiny_llama(0).config),
                  BertLMHeadModel(BertConfig(num_hidden_layers=1, **small))):  # bidirectional
        with pytest.raises(TypeError, match="not a decoder that predicts the next token"):
            llm._check_causal_lm(model, "reference")
