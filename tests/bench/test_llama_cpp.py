"""``nvfp4lab bench --llama-cpp``: the emulation side (prefill and generation) on a tiny NVFP4 GGUF,
the note when llama.cpp is absent, the printed lines and rows (fake timings), and the validation.
(llama.cpp's own side runs in tests/peers/test_llama_cpp_model.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nvfp4lab import checkpoint
from nvfp4lab.bench import command as bench
from nvfp4lab.bench import llama_cpp as lb
from nvfp4lab.bench import timing
from nvfp4lab.bench.store import read_shards
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


def test_prefill_emulation_alone_is_one_forward(
    tiny_gguf: tuple[Path, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The nvfp4lab side of prefill is one forward over the P ids (use_cache, last logits only):
    counted forwards, the ids it saw and the tokens/s of its timing."""
    path, _ = tiny_gguf
    monkeypatch.setattr(lb, "llama_cpp_missing", lambda: "llama-cpp-python is not importable")
    seen: list[tuple[list[int], dict[str, object]]] = []
    real_load = checkpoint.load

    def load(*args: object, **kwargs: object) -> torch.nn.Module:
        model = real_load(*args, **kwargs)
        forward = model.forward

        def spy(input_ids: torch.Tensor, **kw: object) -> object:
            kept = {k: kw[k] for k in ("use_cache", "logits_to_keep")}
            seen.append((input_ids[0].tolist(), kept))
            return forward(input_ids=input_ids, **kw)

        model.forward = spy
        return model

    monkeypatch.setattr(checkpoint, "load", load)
    prompt = [1, 5, 9, 2, 7]
    results, notes = lb.run_prefill(path, prompt=prompt, warmup=1, repeats=2)
    assert notes == ["llama-cpp-python is not importable"]
    (r,) = results
    assert r.impl == "nvfp4lab[q8_0]" and r.prompt_tokens == 5 and r.timing.repeats == 2
    assert r.tokens_per_s == pytest.approx(5 / r.timing.median_s)
    assert seen == [(prompt, {"use_cache": True, "logits_to_keep": 1})] * 3  # warmup + 2


def test_run_prefill_rejects_bad_input(tiny_gguf: tuple[Path, torch.nn.Module]) -> None:
    with pytest.raises(ValueError, match="prompt_tokens must be >= 1, got 0"):
        lb.run_prefill(tiny_gguf[0], prompt_tokens=0)
    with pytest.raises(ValueError, match="vocabulary has 128 tokens"):
        lb.run_prefill(tiny_gguf[0], prompt=[3, 128])


def _fake(*samples: float) -> timing.Timing:
    return timing.Timing(samples, 1, 1, "perf_counter", "cpu")


def test_cli_prints_and_stores_prefill_and_generation(
    tiny_gguf: tuple[Path, torch.nn.Module], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With fake timings: both phases' tokens/s and ratios printed, their rows in the store."""
    calls: dict[str, dict[str, object]] = {}

    def prefill(gguf: Path, **kw: object) -> tuple[list[lb.PrefillResult], list[str]]:
        calls["prefill"] = {"gguf": gguf, **kw}
        return [lb.PrefillResult("llama.cpp", 16, _fake(0.5, 0.1, 0.2)),
                lb.PrefillResult("nvfp4lab[q8_0]", 16, _fake(0.8, 0.9, 0.1))], ["same note"]

    def generation(gguf: Path, **kw: object) -> tuple[list[lb.GenerationResult], list[str]]:
        calls["generation"] = {"gguf": gguf, **kw}
        return [lb.GenerationResult("llama.cpp", 16, 2, _fake(0.04, 0.05, 0.06), (1, 2)),
                lb.GenerationResult("nvfp4lab[q8_0]", 16, 2, _fake(0.25, 0.5, 0.1), (1, 2))], [
                    "same note"]

    monkeypatch.setattr(bench, "run_prefill", prefill)
    monkeypatch.setattr(bench, "run_generation", generation)
    out = tmp_path / "r.csv"
    code = bench.main(["--llama-cpp", "--tiny", "--out", str(out), "--gguf", str(tiny_gguf[0])])
    text = capsys.readouterr().out
    assert code == 0
    assert calls["prefill"] == {"gguf": tiny_gguf[0], "prompt_tokens": 16, "warmup": 1,
                                "repeats": 2}
    assert calls["generation"] == {"gguf": tiny_gguf[0], "new_tokens": 2, "warmup": 1,
                                   "repeats": 2}
    lines = text.splitlines()
    assert lines[0].startswith("prefill of a 16-token prompt on cpu")
    # prefill medians 0.2 s and 0.8 s: 80 and 20 tokens/s, 4.0x; generation 0.05 / 0.25 s:
    # 40 and 8 tokens/s, 5.0x
    assert lines[2].split()[0] == "llama.cpp" and float(lines[2].split()[-1]) == 80.0
    assert lines[3].split()[0] == "nvfp4lab[q8_0]" and float(lines[3].split()[-1]) == 20.0
    assert lines[4] == "ratio: tokens/s llama.cpp / nvfp4lab[q8_0] = 4.0x"
    assert lines[5].startswith("greedy generation of 2 tokens after a 16-token prompt on cpu")
    assert float(lines[7].split()[-1]) == 40.0 and float(lines[8].split()[-1]) == 8.0
    assert lines[9] == "ratio: tokens/s llama.cpp / nvfp4lab[q8_0] = 5.0x"
    assert text.count("note: same note") == 1
    rows = read_shards(out)
    got = [(r.op, r.shape, r.M, r.N, r.backend, r.median_s) for r in rows.itertuples()]
    assert got == [
        ("prefill", "smollm2-135m+16", 16, 0, "llama.cpp", 0.2),
        ("prefill", "smollm2-135m+16", 16, 0, "nvfp4lab[q8_0]", 0.8),
        ("generate", "smollm2-135m+16+2", 16, 2, "llama.cpp", 0.05),
        ("generate", "smollm2-135m+16+2", 16, 2, "nvfp4lab[q8_0]", 0.25),
    ]
