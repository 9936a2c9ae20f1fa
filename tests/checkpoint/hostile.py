"""Running ``audit``, ``convert`` and ``load`` on hostile checkpoints as users run them: each in
a subprocess under an address-space limit (:data:`LIMIT_BYTES`) and a timeout, so a memory or
time bomb that comes back fails its test in seconds instead of eating the machine."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

from tests import processes

LIMIT_BYTES = 3 * 2**30  #: address space of each subprocess
TIMEOUT_S = 60
#: ``checkpoint.load(argv[1])`` as a program: a CheckpointError is its one stderr line
#: ("load: ..."), exit 1.
LOAD = ("import sys\nfrom nvfp4lab import checkpoint\ntry:\n    checkpoint.load(sys.argv[1])\n"
        "except checkpoint.CheckpointError as exc:\n    sys.exit(f'load: {exc}')\n")


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))


def run(*argv: str, load: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m nvfp4lab ARGV`` (or ``checkpoint.load(ARGV[0])`` with ``load``) in a
    subprocess under :data:`LIMIT_BYTES` of address space and :data:`TIMEOUT_S`."""
    command = [sys.executable, *(("-c", LOAD) if load else ("-m", "nvfp4lab")), *argv]
    return subprocess.run(command, cwd=processes.ROOT, env=processes.child_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S,
                          preexec_fn=_limited, check=False)


def one_line(result: subprocess.CompletedProcess[str], prefix: str, *needles: str) -> str:
    """The run printed exactly one stderr line, starting with ``prefix`` and holding
    ``needles``, and no traceback; returns it."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def all_refuse(path: Path, tmp_path: Path, fmt: str, *needles: str) -> None:
    """``audit`` and ``convert --format fmt`` exit 2 and ``load`` raises CheckpointError, each
    in one line naming ``path`` and ``needles``; convert writes nothing."""
    audited = run("audit", str(path))
    assert audited.returncode == 2, (audited.stdout, audited.stderr)
    one_line(audited, "nvfp4lab audit: ", str(path), *needles)
    dst = tmp_path / "out"
    converted = run("convert", str(path), str(dst), "--format", fmt)
    assert converted.returncode == 2, (converted.stdout, converted.stderr)
    one_line(converted, "nvfp4lab convert: ", str(path), *needles)
    assert not dst.exists()
    loaded = run(str(path), load=True)
    assert loaded.returncode == 1, (loaded.stdout, loaded.stderr)
    one_line(loaded, "load: ", str(path), *needles)
