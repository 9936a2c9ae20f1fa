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
