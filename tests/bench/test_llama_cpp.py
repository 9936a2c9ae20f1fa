"""``nvfp4lab bench --llama-cpp``: the emulation side on a tiny NVFP4 GGUF, the note when llama.cpp
is absent, the rows, and the validation. (llama.cpp's own side runs in
tests/peers/test_llama_cpp_model.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nvfp4lab import checkpoint
from nvfp4lab.bench import command as bench
from nvfp4lab.bench import llama_cpp as lb
from nvfp4lab.execution.whole_model import quantize_model
from nvfp4lab.vocab import Backend
from tests.checkpoint.builders import tiny_llama


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    model = tiny_llama(seed=3).float()
    quantize_model(model, backend=Backend.Q8_0)
    out = checkpoint.save_pretrained(model, tmp_path_factory.mktemp("gguf") / "tiny", format="gguf")
    return next(Path(out).glob("*.gguf")), model


def test_emulation_alone_with_a_note(
    tiny_gguf: tuple[Path, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, model = tiny_gguf
    monkeypatch.setattr(lb, "llama_cpp_missing", lambda: "llama-cpp-python is not importable")
    prompt = [1, 5, 9, 2]
    results, notes = lb.run_generation(path, prompt=prompt, new_tokens=3, warmup=0, repeats=1)
    assert notes == ["llama-cpp-python is not importable"]
    (r,) = results
    assert r.impl == "nvfp4lab[q8_0]" and r.prompt_tokens == 4 and r.new_tokens == 3
    assert r.tokens_per_s == pytest.approx(3 / r.timing.median_s)
    with torch.no_grad():  # the same greedy tokens as the in-memory model on the q8_0 backend
        want = model.generate(
            torch.tensor([prompt]), max_new_tokens=3, min_new_tokens=3, do_sample=False
        )[0, 4:]
    assert r.tokens == tuple(want.tolist())
    rows = lb.generation_rows(results, {"device": "cpu"}, seed=0)
    assert rows[0]["op"] == "generate" and rows[0]["backend"] == "nvfp4lab[q8_0]"
    assert (rows[0]["M"], rows[0]["N"]) == (4, 3)


def test_run_generation_rejects_bad_counts(tiny_gguf: tuple[Path, torch.nn.Module]) -> None:
    with pytest.raises(ValueError, match="new_tokens must be >= 1, got 0"):
        lb.run_generation(tiny_gguf[0], prompt=[1], new_tokens=0)


def test_missing_says_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lb.importlib.util, "find_spec", lambda name: None)
    note = lb.llama_cpp_missing()
    assert note is not None and "not importable" in note and "\n" not in note


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--device", "cuda"], r"--device|--llama-cpp times llama.cpp's CPU path"),
        (["--gguf", "/nonexistent.gguf"], r"--gguf '/nonexistent.gguf' is not a file"),
        (["--peers"], r"--peers and --llama-cpp are two different runs"),
        (["--repeats", "0"], r"repeats"),
    ],
)
def test_bad_llama_cpp_arguments_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], expected: str
) -> None:
    import re

    out = tmp_path / "x.csv"
    code = bench.main(["--llama-cpp", "--tiny", "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("nvfp4lab bench: ") and re.search(expected, err), err
    assert not out.exists()


def test_a_file_that_is_not_a_smollm2_gguf_is_one_line(
    tiny_gguf: tuple[Path, torch.nn.Module], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A probe of the CLI found tracebacks here: a file that is no GGUF, a truncated GGUF, and an
    NVFP4 GGUF of another model, whose vocabulary SmolLM2's prompt ids overrun (IndexError)."""
    from nvfp4lab import corpus, models

    monkeypatch.setattr(lb, "llama_cpp_missing", lambda: "llama-cpp-python is not importable")
    # the default prompt's ids, as SmolLM2's tokenizer gives them (not built here: the user's cache)
    monkeypatch.setattr(models, "smollm2_tokenizer", lambda cache=None: None)
    monkeypatch.setattr(corpus, "token_ids", lambda tokenizer, text: torch.arange(16525, 16541))
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(tiny_gguf[0].read_bytes()[:300])
    cases = [
        (text, "is not a GGUF file (no 'GGUF' magic"),
        (truncated, "cannot be benchmarked: "),
        (tiny_gguf[0], "its vocabulary has 128 tokens and the prompt's token ids run from 16525 "
                       "to 16540"),
    ]
    for path, expected in cases:
        code = bench.main(["--llama-cpp", "--tiny", "--no-save", "--gguf", str(path)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and expected in err, err
        assert err.startswith(f"nvfp4lab bench: --gguf {str(path)!r}"), err
    with pytest.raises(ValueError, match="vocabulary has 128 tokens"):  # the library call too
        lb.run_generation(tiny_gguf[0], prompt=[1, 128], new_tokens=1)
