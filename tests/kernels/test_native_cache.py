"""The native library's cache when it breaks (issue 32, case 7), in real processes.

Each test points ``NVFP4LAB_CACHE`` at a folder of its own and runs ``quantize`` in a fresh
interpreter: a ``.so`` truncated, its code overwritten with ``int3``, emptied or replaced by
garbage is never loaded (a ``dlopen`` of it crashed the process with SIGBUS / SIGTRAP, or failed
for good with the stamp still present): it is rebuilt, and the result is the eager codec's bits.
A builder killed with SIGKILL in the middle of its build blocks nobody; a live one is waited for
with one WARNING line naming it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest

from nvfp4lab.kernels import native
from tests.processes import child_env, wait_for

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the native C++ library cannot be built here"
)

#: A fresh process's quantize on the C++ block encode against the eager codec, and what it saw.
_CHILD = r"""
import json, torch, nvfp4lab
from nvfp4lab.kernels import block_encode, native
result = {"native": native.available(), "same": None}
if result["native"]:
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    fused = nvfp4lab.quantize(x, fused=True)
    eager = nvfp4lab.quantize(x, fused=False)
    fake = nvfp4lab.fake_quantize(x, fused=True)
    result["same"] = (
        torch.equal(fused.packed, eager.packed)
        and torch.equal(fused.scales.view(torch.uint8), eager.scales.view(torch.uint8))
        and torch.equal(fake, nvfp4lab.fake_quantize(x, fused=False))
    )
print(json.dumps(result))
"""

#: A process that only builds (or loads) the library.
_BUILDER = "from nvfp4lab.kernels import native; native.available()"

#: Longest a fresh process may take to build the library here (about 4 s on an idle 2-core
#: machine; the shared test machine is slower). A stale lock used to hold it for 600 s.
_BUILD_LIMIT_S = 240.0


def env_for(cache: Path) -> dict[str, str]:
    env = child_env()
    env.update({"NVFP4LAB_CACHE": str(cache), "NVFP4LAB_THREADS": "1"})
    env.pop("NVFP4LAB_NATIVE_ISA", None)
    return env


def run_child(cache: Path, timeout: float = _BUILD_LIMIT_S) -> tuple[dict[str, object], str]:
    """``_CHILD`` in a fresh interpreter: (its result, its stderr); fails on a non-zero exit."""
    run = subprocess.run([sys.executable, "-c", _CHILD], env=env_for(cache), capture_output=True,
                         text=True, timeout=timeout)
    assert run.returncode == 0, f"rc {run.returncode}: {run.stderr[-2000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def library_folder(cache: Path) -> Path:
    """The library's folder under ``cache`` (the one ``native.build_dir`` names there)."""
    folders = [p for p in (cache / "cpp").iterdir() if p.is_dir() and "." not in p.name]
    assert len(folders) == 1, folders
    return folders[0]


def the_so(folder: Path) -> Path:
    found = list(folder.glob("*.so"))
    assert len(found) == 1, found
    return found[0]


def assert_stamped(folder: Path) -> None:
    """The ``.so`` is the one the stamp describes (size and SHA-256, computed here)."""
    stamp = json.loads((folder / "built.ok").read_text())
    data = (folder / stamp["file"]).read_bytes()
    assert (len(data), hashlib.sha256(data).hexdigest()) == (stamp["size"], stamp["sha256"])


def text_section(data: bytes) -> tuple[int, int]:
    """(file offset, size) of the ELF64 little-endian ``.text`` section of ``data``."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple[int, int, int]:
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, offset, size

    _, names_at, _ = header(shstrndx)
    for i in range(shnum):
        name, offset, size = header(i)
        end = data.index(b"\0", names_at + name)
        if data[names_at + name:end] == b".text":
            return offset, size
    raise AssertionError("no .text section")


def truncate(so: Path) -> None:
    with so.open("r+b") as f:
        f.truncate(so.stat().st_size // 2)


def overwrite_code(so: Path) -> None:
    data = bytearray(so.read_bytes())
    offset, size = text_section(bytes(data))
    data[offset:offset + size] = b"\xcc" * size  # int3: SIGTRAP wherever it runs
    with so.open("r+b") as f:  # in place, as a stray write would
        f.write(data)


def empty(so: Path) -> None:
    so.write_bytes(b"")


def garbage(so: Path) -> None:
    so.write_bytes(os.urandom(so.stat().st_size))


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder holding a library built by a fresh process."""
    cache = tmp_path_factory.mktemp("native-cache")
    result, _ = run_child(cache)
    assert result == {"native": True, "same": True}
    assert_stamped(library_folder(cache))
    return cache


@pytest.mark.parametrize("damage", [truncate, overwrite_code, empty, garbage],
                         ids=lambda f: f.__name__)
def test_a_damaged_library_is_rebuilt_never_loaded(
    built_cache: Path, tmp_path: Path, damage: object
) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(built_cache, cache, symlinks=True)
    folder = library_folder(cache)
    so = the_so(folder)
    damage(so)  # type: ignore[operator]
    damaged = so.stat()
    result, stderr = run_child(cache)
    assert result == {"native": True, "same": True}, stderr
    assert "unavailable" not in stderr
    rebuilt = the_so(folder)
    assert rebuilt.stat().st_ino != damaged.st_ino  # a new file, renamed into place
    assert_stamped(folder)
    # nothing left beside it but the lock file: no half-built or renamed-aside folder
    assert sorted(p.name for p in (cache / "cpp").iterdir()) == [folder.name,
                                                                folder.name + ".lock"]
    # and the next process loads the rebuilt library as it is
    result, stderr = run_child(cache)
    assert result == {"native": True, "same": True}, stderr
    assert the_so(folder).stat().st_ino == rebuilt.stat().st_ino


def test_a_builder_killed_mid_build_blocks_nobody(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    builder = subprocess.Popen([sys.executable, "-c", _BUILDER], env=env_for(cache),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        # cpp_extension's own lock file exists while the compiler runs
        wait_for(lambda: list((cache / "cpp").glob("*/lock")) if (cache / "cpp").exists()
                 else [], "the build to start", timeout=_BUILD_LIMIT_S)
        os.kill(builder.pid, signal.SIGKILL)
        builder.wait(timeout=30)
    finally:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(builder.pid, signal.SIGKILL)  # its compiler, if still running
        builder.wait(timeout=30)
    assert builder.returncode == -signal.SIGKILL
    started = time.monotonic()
    result, stderr = run_child(cache)
    took = time.monotonic() - started
    assert result == {"native": True, "same": True}, stderr
    assert took < _BUILD_LIMIT_S
    assert "waiting" not in stderr  # the dead builder holds nothing
    folder = library_folder(cache)
    assert_stamped(folder)
    assert not [p for p in (cache / "cpp").iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_a_live_builder_is_waited_for_with_one_line(tmp_path: Path, monkeypatch:
                                                   pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("NVFP4LAB_CACHE", str(cache))
    folder = native.build_dir()
    folder.parent.mkdir(parents=True)
    holder = f"process {os.getpid()} on {socket.gethostname()}"
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # this process is "building"
        lock.write(holder + "\n")
        lock.flush()
        waiter = subprocess.Popen([sys.executable, "-c", _CHILD], env=env_for(cache),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert waiter.stderr is not None
            line = waiter.stderr.readline()  # blocks until the waiter says who it waits for
            time.sleep(1.0)
            assert waiter.poll() is None  # still waiting
        except BaseException:
            waiter.kill()
            raise
    # the lock is released: the waiter builds and runs
    out, rest = waiter.communicate(timeout=_BUILD_LIMIT_S)
    assert waiter.returncode == 0, rest
    assert holder in line and "waiting for" in line and str(folder) in line
    assert "waiting" not in rest  # one line
    assert json.loads(out.strip().splitlines()[-1]) == {"native": True, "same": True}
    assert_stamped(folder)


def test_a_verified_library_that_does_not_load_falls_back_without_a_rebuild(
        tmp_path: Path) -> None:
    """A library that matches its stamp but does not load (as in a ``noexec`` cache folder, or
    without ``libgomp``) is the very file a build makes here: the next process falls back at
    once with one WARNING line naming the loader's error, and builds nothing (a rebuild would
    have cost every process a whole build, then failed the same way)."""
    cache = tmp_path / "cache"
    subprocess.run([sys.executable, "-c", _BUILDER], env=env_for(cache), check=True,
                   timeout=_BUILD_LIMIT_S)
    folder = library_folder(cache)
    so = the_so(folder)
    unloadable = b"not an ELF file, as a noexec mount makes any file look to dlopen"
    so.write_bytes(unloadable)
    stamp = json.loads((folder / "built.ok").read_text())
    stamp.update(size=len(unloadable), sha256=hashlib.sha256(unloadable).hexdigest())
    (folder / "built.ok").write_text(json.dumps(stamp))
    result, stderr = run_child(cache)
    assert result == {"native": False, "same": None}
    warnings = [line for line in stderr.splitlines() if "C++ CPU kernels" in line]
    assert len(warnings) == 1 and "OSError" in warnings[0], stderr
    assert so.read_bytes() == unloadable and library_folder(cache) == folder  # nothing rebuilt
    assert not list(cache.glob("cpp/*.tmp-*"))
