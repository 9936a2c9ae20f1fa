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
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from typing import Any

import torch

from nvfp4lab.vocab import CorpusPart, check_choice

__all__ = [
    "EVALUATION_MODULUS",
    "OVERLAP_WORDS",
    "calibration_batches",
    "part_of",
    "pydoc_text",
    "token_ids",
    "topic_names",
    "word_runs",
]

#: A topic is evaluation text when its name's hash is divisible by this (about a quarter of
#: the topics; 11 % of the characters on CPython 3.11.7).
EVALUATION_MODULUS = 4
#: A calibration paragraph sharing a run of this many words with the evaluation part is left
#: out of the calibration text (the contamination test of GPT-3's paper, Brown et al. 2020,
#: appendix C, counts 13-gram overlaps).
OVERLAP_WORDS = 13


def _topics() -> Mapping[str, str]:
    from pydoc_data.topics import topics

    return topics


def part_of(name: str) -> CorpusPart:
    """The part topic ``name`` belongs to: evaluation when
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


def _without_shared_paragraphs(
    text: str, shared: set[tuple[str, ...]], words: int = OVERLAP_WORDS
) -> str:
    """``text`` less every paragraph (a block between blank lines) holding one of the ``shared``
    runs of ``words`` words; the rest byte for byte, ending with one newline ("" when nothing is
    left)."""
    pieces = re.split(r"(\n\n+)", text)  # paragraph, separator, paragraph, ...
    pieces.append("")
    kept = "".join(
        paragraph + separator
        for paragraph, separator in zip(pieces[::2], pieces[1::2], strict=True)
        if not word_runs(paragraph, words) & shared
    )
    kept = kept.rstrip("\n")
    return kept + "\n" if kept else ""


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
    samples: int = 32,
    length: int = 512,
    batch_size: int = 8,
    seed: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """``samples`` sequences of ``length`` tokens from the calibration part only, as model inputs
    in batches of ``batch_size``: each ``{"input_ids": int64 [B, length], "attention_mask": int64
    ones [B, length]}`` (the ``calibration=`` of ``quantize_model(method="gptq")``; the last
    batch may be smaller).

    The calibration text is tokenized once (:func:`token_ids`) and cut into consecutive,
    non-overlapping windows of ``length`` tokens (a tail shorter than ``length`` is dropped);
    ``samples`` distinct windows are drawn without replacement by a ``torch.Generator`` seeded
    with ``seed``, in the drawn order. Raises ValueError when the part has fewer windows than
    ``samples`` (about 197 of 512 tokens with SmolLM2's tokenizer).
    """
    for what, value in (("samples", samples), ("length", length), ("batch_size", batch_size)):
        if value <= 0:
            raise ValueError(f"{what} must be > 0, got {value}")
    ids = token_ids(tokenizer, pydoc_text(CorpusPart.CALIBRATION))
    windows = ids.numel() // length
    if samples > windows:
        raise ValueError(
            f"the calibration part holds {windows} windows of {length} tokens, fewer than "
            f"samples={samples}"
        )
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(windows, generator=generator)[:samples]
    rows = ids[: windows * length].reshape(windows, length)[chosen]
    return [
        {"input_ids": rows[i : i + batch_size].clone(),
         "attention_mask": torch.ones_like(rows[i : i + batch_size])}
        for i in range(0, samples, batch_size)
    ]
