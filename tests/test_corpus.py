"""The language-model text: CPython's pydoc topics, split once into calibration and evaluation."""

from __future__ import annotations

import sys
from pydoc_data.topics import topics
from typing import Any

import pytest
import torch

from nvfp4lab import corpus
from nvfp4lab.vocab import CorpusPart

#: The evaluation topics, as measured on CPython 3.11.7 when the split was made.
EVALUATION_TOPICS = (
    "assignment", "attribute-references", "bitwise", "bltin-code-objects",
    "bltin-ellipsis-object", "comparisons", "else", "global", "identifiers", "lists",
    "operator-summary", "pass", "raise", "shifting", "typesmethods", "typesseq-mutable",
)


def char_tokenizer(text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
    """A stand-in tokenizer: one token per character (its code point)."""
    assert add_special_tokens is False
    return {"input_ids": [ord(c) for c in text]}


def runs(text: str, n: int) -> set[tuple[str, ...]]:
    words = text.split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_the_parts_are_disjoint_and_cover_every_topic() -> None:
    calibration = corpus.topic_names(CorpusPart.CALIBRATION)
    evaluation = corpus.topic_names("evaluation")
    assert calibration and evaluation and not set(calibration) & set(evaluation)
    assert sorted(calibration + evaluation) == sorted(topics)
    assert list(calibration) == sorted(calibration) and list(evaluation) == sorted(evaluation)
    assert all(corpus.part_of(name) is CorpusPart.CALIBRATION for name in calibration)


def test_the_texts_share_no_run_of_13_words() -> None:
    """CPython's topics repeat each other ("if" is "else"); the calibration text leaves out
    what it would share with the evaluation text."""
    assert corpus.OVERLAP_WORDS == 13
    calibration, evaluation = corpus.pydoc_text("calibration"), corpus.pydoc_text("evaluation")
    assert topics["if"] == topics["else"] and corpus.part_of("if") != corpus.part_of("else")
    assert not runs(calibration, 13) & runs(evaluation, 13)
    assert runs(topics["if"], 13) & runs(evaluation, 13)  # a split by topic alone would share
    for name in corpus.topic_names("evaluation"):
        assert topics[name] in evaluation  # evaluation topics whole
    left_out = [n for n in corpus.topic_names("calibration") if topics[n] not in calibration]
    assert set(left_out) <= {"augassign", "compound", "id-classes", "if", "in", "typesseq"}
    assert "if" in left_out and topics["while"] in calibration
    assert calibration.endswith("\n")


def test_paragraphs_are_left_out_whole() -> None:
    assert corpus.word_runs("a b\nc  d", 3) == {("a", "b", "c"), ("b", "c", "d")}
    text = "Title\n*****\n\nfirst para one two\n\n\nsecond para\n"
    assert corpus._without_shared_paragraphs(text, set(), 2) == text  # byte for byte
    drop = corpus._without_shared_paragraphs
    assert drop(text, {("one", "two")}, 2) == "Title\n*****\n\nsecond para\n"
    assert drop(text, {("second", "para")}, 2) == "Title\n*****\n\nfirst para one two\n"
    assert drop(text, {("Title", "*****"), ("para", "one"), ("second", "para")}, 2) == ""


@pytest.mark.skipif(sys.version_info[:3] != (3, 11, 7), reason="counts measured on 3.11.7")
def test_documented_sizes() -> None:
    """The numbers docs/llm.md and the corpus docstring state."""
    assert len(topics) == 79 and sum(map(len, topics.values())) == 464_970
    assert len(corpus.topic_names("calibration")) == 63
    assert len(corpus.pydoc_text("calibration")) == 400_591
    assert len(corpus.pydoc_text("evaluation")) == 51_669


def test_text_is_the_topics_joined_by_blank_lines() -> None:
    text = corpus.pydoc_text(CorpusPart.EVALUATION)
    assert text == "\n".join(topics[name] for name in corpus.topic_names("evaluation"))
    assert text.startswith(topics["assignment"]) and text.endswith(topics["typesseq-mutable"])
    assert all(topics[name].endswith("\n") for name in topics)  # so the join is a blank line
    assert corpus.pydoc_text("evaluation") is text  # built once


def test_unknown_part() -> None:
    with pytest.raises(ValueError, match="unknown corpus part 'test'; accepted values: "
                                         "'calibration', 'evaluation'"):
        corpus.pydoc_text("test")


def test_token_ids() -> None:
    ids = corpus.token_ids(char_tokenizer, "ab c")
    assert ids.dtype == torch.int64 and ids.tolist() == [97, 98, 32, 99]


def _calibration_ids() -> torch.Tensor:
    return corpus.token_ids(char_tokenizer, corpus.pydoc_text("calibration"))


def test_calibration_batches_come_from_the_calibration_part() -> None:
    batches = corpus.calibration_batches(char_tokenizer, samples=10, length=64, batch_size=4)
    assert [b["input_ids"].shape for b in batches] == [(4, 64), (4, 64), (2, 64)]
    rows = torch.cat([b["input_ids"] for b in batches])
    assert all(torch.equal(b["attention_mask"], torch.ones_like(b["input_ids"])) for b in batches)
    assert rows.dtype == torch.int64
    ids = _calibration_ids()
    windows = ids[: ids.numel() // 64 * 64].reshape(-1, 64)
    index = {tuple(w.tolist()): i for i, w in enumerate(windows)}
    found = [index[tuple(r.tolist())] for r in rows]  # every row is one aligned window
    assert len(set(found)) == 10  # distinct, drawn without replacement
    evaluation = corpus.pydoc_text("evaluation")
    for r in rows:
        assert "".join(map(chr, r.tolist())) not in evaluation


def test_calibration_batches_are_seeded() -> None:
    def draw(seed: int) -> list[Any]:
        batches = corpus.calibration_batches(char_tokenizer, samples=6, length=32, batch_size=6,
                                             seed=seed)
        return batches[0]["input_ids"].tolist()

    assert draw(0) == draw(0)
    assert draw(0) != draw(1)


def test_calibration_batches_refuse_too_many_samples() -> None:
    windows = _calibration_ids().numel() // 4096
    corpus.calibration_batches(char_tokenizer, samples=windows, length=4096)
    with pytest.raises(ValueError, match=rf"{windows} windows of 4096 tokens, fewer than "
                                         rf"samples={windows + 1}"):
        corpus.calibration_batches(char_tokenizer, samples=windows + 1, length=4096)
    for bad in ("samples", "length", "batch_size"):
        with pytest.raises(ValueError, match=f"{bad} must be > 0"):
            corpus.calibration_batches(char_tokenizer, **{bad: 0})


def test_pydoc_split_is_pydoc_text() -> None:
    """The pydoc corpus through the API every text is split by: the same two parts."""
    split = corpus.pydoc_split()
    assert isinstance(split, corpus.TextSplit) and split.source == corpus.PYDOC_SOURCE
    assert split.calibration == corpus.pydoc_text("calibration")
    assert split.evaluation == corpus.pydoc_text("evaluation")
    assert split.rule.startswith(f"CPython's pydoc topics by name: evaluation = the "
                                 f"{len(corpus.topic_names('evaluation'))} of {len(topics)} ")
    assert split.rule.endswith(f"less {split.left_out} paragraphs sharing a run of 13 words "
                               "with the evaluation part")
    assert corpus.pydoc_split() is split  # built once


def test_split_helpers() -> None:
    assert corpus.join_documents(["a\n", "b", "c\n\n"]) == "a\n\nb\n\nc\n\n"
    keyed = [(name, topics[name]) for name in sorted(topics)]
    calibration, evaluation = corpus.hash_split(keyed)
    assert evaluation == tuple(topics[n] for n in corpus.topic_names("evaluation"))
    assert calibration == tuple(topics[n] for n in corpus.topic_names("calibration"))
    run = " ".join(f"w{i}" for i in range(13))
    kept, dropped = corpus.without_shared(
        ["keep this\n\nx " + run + " y\n", run + "\n", "none shared\n"], "a " + run + " b\n")
    assert kept == ("keep this\n", "none shared\n") and dropped == 2


@pytest.mark.skipif(sys.version_info[:3] != (3, 11, 7), reason="counts measured on 3.11.7")
def test_documented_left_out() -> None:
    assert corpus.pydoc_split().left_out == 35


def old_calibration_batches(tokenizer: Any, samples: int, length: int, batch_size: int,
                            seed: int) -> list[dict[str, torch.Tensor]]:
    """The batches as the release before ``text=`` drew them, written out as the oracle."""
    ids = torch.tensor(tokenizer(corpus.pydoc_text("calibration"),
                                 add_special_tokens=False)["input_ids"], dtype=torch.int64)
    windows = len(ids) // length
    order = torch.randperm(windows, generator=torch.Generator().manual_seed(seed))
    rows = torch.stack([ids[i * length : (i + 1) * length] for i in order[:samples].tolist()])
    return [{"input_ids": rows[i : i + batch_size],
             "attention_mask": torch.ones(len(rows[i : i + batch_size]), length,
                                          dtype=torch.int64)}
            for i in range(0, samples, batch_size)]


@pytest.mark.parametrize("seed", [0, 3])
def test_calibration_batches_old_calls_same_bits(seed: int) -> None:
    old = old_calibration_batches(char_tokenizer, 11, 96, 4, seed)
    for new in (corpus.calibration_batches(char_tokenizer, samples=11, length=96, batch_size=4,
                                           seed=seed),
                corpus.calibration_batches(char_tokenizer, text=corpus.pydoc_text("calibration"),
                                           samples=11, length=96, batch_size=4, seed=seed)):
        assert len(new) == len(old) == 3
        for a, b in zip(new, old, strict=True):
            assert a.keys() == b.keys()
            assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_calibration_batches_of_a_given_text() -> None:
    text = "".join(chr(65 + i % 26) for i in range(1000))
    batches = corpus.calibration_batches(char_tokenizer, text=text, samples=3, length=100,
                                         batch_size=2, seed=1)
    rows = torch.cat([b["input_ids"] for b in batches])
    windows = torch.tensor([ord(c) for c in text]).reshape(10, 100)
    assert all(any(torch.equal(r, w) for w in windows) for r in rows)
    with pytest.raises(ValueError) as error:
        corpus.calibration_batches(char_tokenizer, text=text[:950], samples=10, length=100)
    assert str(error.value) == (
        "the calibration text holds 950 tokens: 9 windows of 100 tokens, fewer than "
        "samples=10; ask for fewer samples (at most 9), a shorter length, or give more "
        "calibration text")
    with pytest.raises(TypeError, match="text must be the calibration text"):
        corpus.calibration_batches(char_tokenizer, text=corpus.pydoc_split())  # type: ignore
    with pytest.raises(TypeError, match=r"samples must be a whole number, got 2\.5"):
        corpus.calibration_batches(char_tokenizer, samples=2.5)  # type: ignore[arg-type]


def test_check_evaluation_tokens() -> None:
    corpus.check_evaluation_tokens(512, 512)
    corpus.check_evaluation_tokens(2, 2)
    with pytest.raises(ValueError) as error:
        corpus.check_evaluation_tokens(300, 512)
    assert str(error.value) == (
        "the evaluation text holds 300 tokens, fewer than one window of context=512 tokens; "
        "give a longer text or a shorter context (at most 300, at least 2)")
    with pytest.raises(ValueError) as error:
        corpus.check_evaluation_tokens(1, 256)
    assert str(error.value) == (
        "the evaluation text holds 1 tokens, fewer than one window of context=256 tokens (2 at "
        "the least: one to predict from); give a longer text")
    with pytest.raises(ValueError, match="context must be >= 2 tokens"):
        corpus.check_evaluation_tokens(10, 1)
    with pytest.raises(TypeError, match="n_tokens must be a whole number"):
        corpus.check_evaluation_tokens(10.0, 4)  # type: ignore[arg-type]
