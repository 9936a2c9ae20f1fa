"""``benchmarks/gpu_session.sh``, checked where there is no GPU: its syntax, every step it would
run (a dry run: each ``nvfp4lab bench`` command line parses with the bench's own options, each
test file exists), and its guards (an unknown step, no CUDA device)."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nvfp4lab.bench import command

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
STEPS = ("tests", "bench", "elementwise", "decode", "model", "peers")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")


def run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, **env},
    )


def test_syntax() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_dry_run_lists_valid_steps(tmp_path: Path) -> None:
    done = run(tmp_path, DRY_RUN="1")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("+ [")]
    assert {line[3:].split(",")[0] for line in lines} == set(STEPS)
    parser = argparse.ArgumentParser(exit_on_error=False)
    command.add_arguments(parser)
    benches = 0
    for line in lines:
        words = shlex.split(line.split("] ", 1)[1].rsplit(" > ", 1)[0])
        words = [w for w in words if "=" not in w or w.startswith("-")]  # VAR=value prefixes
        if words[1:4] == ["-m", "nvfp4lab", "bench"]:
            args = parser.parse_args(words[4:])  # every option exists and takes its values
            assert args.device == "cuda"
            benches += 1
        else:
            assert words[1:3] == ["-m", "pytest"]
            files = [w for w in words[3:] if w.endswith(".py")]
            assert files and all((ROOT / name).is_file() for name in files), files
    assert benches == 7
    only = run(tmp_path, DRY_RUN="1", STEPS="decode model")
    assert {line[3:].split(",")[0] for line in only.stdout.splitlines()} == {"decode", "model"}


def test_guards(tmp_path: Path) -> None:
    bad = run(tmp_path, DRY_RUN="1", STEPS="decode typo")
    assert bad.returncode == 2 and "unknown step 'typo'" in bad.stderr
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the script would run for real")
    none = run(tmp_path)
    assert none.returncode == 2 and "no usable CUDA device" in none.stderr
    assert not list((tmp_path / "out").iterdir())  # nothing ran, nothing was written
