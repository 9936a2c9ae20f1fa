"""The text of the language-model studies: CPython's own documentation topics, split once.

``pydoc_data.topics.topics`` ships with CPython (it is what ``help("while")`` prints): a dict of
topic name -> reference-manual text (prose, grammar rules and short code examples; 79 topics and
464,970 characters on CPython 3.11.7), so nothing is downloaded. It is split once, by topic, into
two parts (:class:`~nvfp4lab.vocab.CorpusPart`):

* **evaluation**: the topics whose name's SHA-256 digest (UTF-8), its first 8 bytes read as a
  big-endian integer, is divisible by :data:`EVALUATION_MODULUS` (4) (:func:`part_of`), whole;
  held out: perplexity and KL divergence are measured on it;
* **calibration**: every other topic, less each paragraph (a block between blank lines) that
  shares a run of :data:`OVERLAP_WORDS` (13) words with the evaluation part; GPTQ and activation
  scales are calibrated on it (:func:`calibration_batches`).

The second step is needed because the topics repeat each other: ``if`` and ``else`` are the same
text, ``compound`` holds the sections of ``if``, ``while``, ``for`` ..., ``assignment`` those of
``augassign``; a split by topic alone would put the same paragraphs in both parts. After it, no
run of 13 words of one part occurs in the other.

The rule reads topic names only, so a topic keeps its part when another CPython release adds or
drops topics (their texts may still be edited between releases). A part's text is its topics in
sorted name order, each ending with a newline, joined by one more newline (a blank line between
topics: :func:`pydoc_text`). On CPython 3.11.7 the evaluation part is 16 topics, 51,669
characters (12,000 SmolLM2 tokens); the calibration part 63 topics, 400,591 characters (98,228
tokens; 12,787 characters of six topics left out as shared); ``docs/llm.md`` lists them.

The same two rules split any text (:mod:`nvfp4lab.texts`: a user's file, by whole documents
keyed by their text); every split is a :class:`TextSplit`, the pydoc one included
(:func:`pydoc_split`), so the study takes one kind of object. :func:`calibration_batches` draws
windows from any calibration text; :func:`check_evaluation_tokens` refuses an evaluation text
shorter than one window.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nvfp4lab.vocab import CorpusPart, check_choice

__all__ = [
    "EVALUATION_MODULUS",
    "OVERLAP_WORDS",
    "PYDOC_SOURCE",
    "TextSplit",
    "calibration_batches",
    "check_evaluation_tokens",
    "hash_split",
    "join_documents",
    "part_of",
    "pydoc_split",
    "pydoc_text",
    "token_ids",
    "topic_names",
    "without_shared",
    "word_runs",
]

#: A topic is evaluation text when its name's hash is divisible by this (about a quarter of
#: the topics; 11 % of the characters on CPython 3.11.7).
EVALUATION_MODULUS = 4
#: A calibration paragraph sharing a run of this many words with the evaluation part is left
#: out of the calibration text (the contamination test of GPT-3's paper, Brown et al. 2020,
#: appendix C, counts 13-gram overlaps).
OVERLAP_WORDS = 13
#: The :attr:`TextSplit.source` of the pydoc split.
PYDOC_SOURCE = "CPython's pydoc topics (pydoc_data.topics)"


def _topics() -> Mapping[str, str]:
    from pydoc_data.topics import topics

    return topics


def part_of(name: str) -> CorpusPart:
    """The part topic ``name`` (or any key: :mod:`nvfp4lab.texts` keys a document by its text)
    belongs to: evaluation when
    ``int.from_bytes(sha256(name.encode()).digest()[:8], "big") % EVALUATION_MODULUS == 0``,
    else calibration."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    if int.from_bytes(digest[:8], "big") % EVALUATION_MODULUS == 0:
        return CorpusPart.EVALUATION
    return CorpusPart.CALIBRATION


def topic_names(part: CorpusPart | str) -> tuple[str, ...]:
    """The names of the topics in ``part`` (``"calibration"`` or ``"evaluation"``), sorted."""
    part = check_choice("corpus part", part, CorpusPart)
    return tuple(name for name in sorted(_topics()) if part_of(name) == part)


def word_runs(text: str, words: int = OVERLAP_WORDS) -> set[tuple[str, ...]]:
    """Every run of ``words`` consecutive whitespace-separated words of ``text``."""
    split = text.split()
    return {tuple(split[i : i + words]) for i in range(len(split) - words + 1)}


def _kept_paragraphs(
    text: str, shared: set[tuple[str, ...]], words: int = OVERLAP_WORDS
) -> tuple[str, int]:
    """(``text`` less every paragraph (a block between blank lines) holding one of the
    ``shared`` runs of ``words`` words, the number of paragraphs left out); the rest byte for
    byte, ending with one newline ("" when nothing is left)."""
    pieces = re.split(r"(\n\n+)", text)  # paragraph, separator, paragraph, ...
    pieces.append("")
    kept, dropped = [], 0
    for paragraph, separator in zip(pieces[::2], pieces[1::2], strict=True):
        if word_runs(paragraph, words) & shared:
            dropped += 1
        else:
            kept.append(paragraph + separator)
    joined = "".join(kept).rstrip("\n")
    return (joined + "\n" if joined else ""), dropped


def _without_shared_paragraphs(
    text: str, shared: set[tuple[str, ...]], words: int = OVERLAP_WORDS
) -> str:
    """``text`` less every paragraph (a block between blank lines) holding one of the ``shared``
    runs of ``words`` words; the rest byte for byte, ending with one newline ("" when nothing is
    left)."""
    return _kept_paragraphs(text, shared, words)[0]


def without_shared(documents: Sequence[str], evaluation: str) -> tuple[tuple[str, ...], int]:
    """(``documents`` each less its paragraphs that share a run of :data:`OVERLAP_WORDS` words
    with ``evaluation``, the ones left empty dropped; the number of paragraphs left out). The
    one overlap rule of every split."""
    shared = word_runs(evaluation)
    kept: list[str] = []
    dropped = 0
    for document in documents:
        text, n = _kept_paragraphs(document, shared)
        dropped += n
        if text:
            kept.append(text)
    return tuple(kept), dropped


def join_documents(documents: Sequence[str]) -> str:
    """The text of a part: ``documents`` in order, each ending with a newline (one is added
    where missing), joined by one more newline (a blank line between documents)."""
    return "\n".join(d if d.endswith("\n") else d + "\n" for d in documents)


@dataclass(frozen=True)
class TextSplit:
    """A text split into a calibration part and an evaluation part that share no run of
    :data:`OVERLAP_WORDS` words (:func:`pydoc_split`, :func:`nvfp4lab.texts.split_text`,
    :func:`nvfp4lab.texts.split_files`).

    ``calibration`` / ``evaluation``: the parts' texts (str, documents joined by blank lines);
    ``rule``: one sentence saying how this split was made (which rule, how many documents or
    paragraphs went where, whether a fallback was used); ``source``: where the text came from
    (paths, or :data:`PYDOC_SOURCE`); ``left_out``: the calibration paragraphs left out as shared
    with the evaluation part.
    """

    calibration: str
    evaluation: str
    rule: str
    source: str
    left_out: int = 0


def hash_split(keyed: Sequence[tuple[str, str]]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(calibration documents, evaluation documents) of ``keyed`` ``(key, document)`` pairs, in
    their order: a document is evaluation when :func:`part_of` its key is
    :attr:`CorpusPart.EVALUATION` (the pydoc topics are keyed by name, a user's documents by
    their text); whole, nothing left out yet (:func:`without_shared` does that)."""
    calibration: list[str] = []
    evaluation: list[str] = []
    for key, document in keyed:
        (evaluation if part_of(key) is CorpusPart.EVALUATION else calibration).append(document)
    return tuple(calibration), tuple(evaluation)


@functools.cache
def _text(part: CorpusPart) -> str:
    topics = _topics()
    evaluation = "\n".join(topics[name] for name in topic_names(CorpusPart.EVALUATION))
    if part is CorpusPart.EVALUATION:
        return evaluation
    shared = word_runs(evaluation)
    kept = (_without_shared_paragraphs(topics[name], shared)
            for name in topic_names(CorpusPart.CALIBRATION))
    return "\n".join(text for text in kept if text)


def pydoc_text(part: CorpusPart | str) -> str:
    """The text of ``part``: its topics (:func:`topic_names`) in sorted name order, joined by
    blank lines; the calibration part without its paragraphs that share a run of
    :data:`OVERLAP_WORDS` words with the evaluation part (see the module's docstring)."""
    return _text(check_choice("corpus part", part, CorpusPart))


@functools.cache
def pydoc_split() -> TextSplit:
    """The pydoc corpus as a :class:`TextSplit`, made by the rules every text is split by
    (:func:`hash_split` keyed by topic name, then :func:`without_shared`): its parts equal
    :func:`pydoc_text`'s."""
    topics = _topics()
    calibration, evaluation = hash_split([(name, topics[name]) for name in sorted(topics)])
    evaluation_text = join_documents(evaluation)
    kept, dropped = without_shared(calibration, evaluation_text)
    rule = (f"CPython's pydoc topics by name: evaluation = the {len(evaluation)} of "
            f"{len(topics)} topics whose name's SHA-256 (first 8 bytes, big-endian) is "
            f"divisible by {EVALUATION_MODULUS}, whole; calibration = the other "
            f"{len(calibration)}, less {dropped} paragraphs sharing a run of {OVERLAP_WORDS} "
            f"words with the evaluation part")
    return TextSplit(calibration=join_documents(kept), evaluation=evaluation_text, rule=rule,
                     source=PYDOC_SOURCE, left_out=dropped)


def token_ids(tokenizer: Any, text: str) -> torch.Tensor:
    """``text`` tokenized once, without special tokens (no BOS is spliced in): int64 ``[N]``.

    ``tokenizer``: a transformers tokenizer, or any callable ``tokenizer(text,
    add_special_tokens=False)`` returning a mapping with ``"input_ids"`` (a list of ints).
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.as_tensor(ids, dtype=torch.int64).reshape(-1)


def calibration_batches(
    tokenizer: Any,
    *,
    text: str | None = None,
    samples: int = 32,
    length: int = 512,
    batch_size: int = 8,
    seed: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """``samples`` sequences of ``length`` tokens from the calibration text only, as model
    inputs in batches of ``batch_size``: each ``{"input_ids": int64 [B, length],
    "attention_mask": int64 ones [B, length]}`` (the ``calibration=`` of
    ``quantize_model(method="gptq")``; the last batch may be smaller).

    ``text``: the calibration text (a :class:`TextSplit`'s ``calibration``); default the pydoc
    calibration part (``pydoc_text("calibration")``, the batches of earlier releases, bit for
    bit). It is tokenized once (:func:`token_ids`) and cut into consecutive, non-overlapping
    windows of ``length`` tokens (a tail shorter than ``length`` is dropped); ``samples``
    distinct windows are drawn without replacement by a ``torch.Generator`` seeded with
    ``seed``, in the drawn order. Raises ValueError when the text has fewer windows than
    ``samples`` (the pydoc part: about 191 of 512 tokens with SmolLM2's tokenizer), naming the
    tokens found and the fix.
    """
    for what, value in (("samples", samples), ("length", length), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{what} must be a whole number, got {value!r}")
        if value <= 0:
            raise ValueError(f"{what} must be > 0, got {value}")
    if text is None:
        text = pydoc_text(CorpusPart.CALIBRATION)
    elif not isinstance(text, str):
        raise TypeError(f"text must be the calibration text (str), got {type(text).__name__}")
    ids = token_ids(tokenizer, text)
    windows = ids.numel() // length
    if samples > windows:
        raise ValueError(
            f"the calibration text holds {ids.numel()} tokens: {windows} windows of {length} "
            f"tokens, fewer than samples={samples}; ask for fewer samples (at most {windows}), "
            f"a shorter length, or give more calibration text"
        )
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(windows, generator=generator)[:samples]
    rows = ids[: windows * length].reshape(windows, length)[chosen]
    return [
        {"input_ids": rows[i : i + batch_size].clone(),
         "attention_mask": torch.ones_like(rows[i : i + batch_size])}
        for i in range(0, samples, batch_size)
    ]


def check_evaluation_tokens(n_tokens: int, context: int) -> None:
    """Refuse an evaluation text shorter than one window: ValueError naming the tokens found,
    the context and the fix when ``n_tokens < context`` (``context``: tokens per window, at
    least 2, one to predict from); TypeError for numbers that are not whole."""
    for what, value in (("n_tokens", n_tokens), ("context", context)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{what} must be a whole number, got {value!r}")
    if context < 2:
        raise ValueError(f"context must be >= 2 tokens (one to predict from), got {context}")
    if n_tokens < context:
        raise ValueError(
            f"the evaluation text holds {n_tokens} tokens, fewer than one window of "
            f"context={context} tokens; give a longer text or a shorter context (at most "
            f"{max(n_tokens, 2)}, at least 2)"
            if n_tokens >= 2 else
            f"the evaluation text holds {n_tokens} tokens, fewer than one window of "
            f"context={context} tokens (2 at the least: one to predict from); give a longer text"
        )
