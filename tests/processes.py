"""Real processes for the tests of what users run (issue 19): the CLI as a subprocess, a Dask
scheduler and workers started as ``dask scheduler`` / ``dask worker``, process trees and signals,
and a checkpoint big enough to keep a run busy for seconds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

import psutil
import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def child_env() -> dict[str, str]:
    """This environment with this checkout first on PYTHONPATH (the CLI, Dask workers and
    notebook kernels import the nvfp4lab under test), offline."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def cli(argv: list[str], cwd: Path, **kwargs: object) -> subprocess.Popen[str]:
    """``python -m nvfp4lab ARGV`` started in ``cwd`` (stdout / stderr piped, text)."""
    return subprocess.Popen([sys.executable, "-m", "nvfp4lab", *argv], cwd=cwd, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)  # type: ignore[call-overload]


def cli_here(argv: list[str], capfd: pytest.CaptureFixture[str]
             ) -> subprocess.CompletedProcess[str]:
    """``nvfp4lab ARGV`` through ``cli.main`` in this process, file descriptors 1 and 2 captured
    by ``capfd``: the command's code without a ~4 s interpreter start (compressed-tensors'
    import), for a test's further calls once one call has gone through ``python -m nvfp4lab``."""
    from nvfp4lab import cli as nvfp4lab_cli

    capfd.readouterr()
    code = nvfp4lab_cli.main(list(argv))
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["nvfp4lab", *argv], code, out, err)


def one_line_error(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The one stderr line of a command that refused its input (exit 2, no traceback), checked
    to hold every needle."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def wait_for(check: Callable[[], T], what: str, timeout: float = 60.0) -> T:
    """Poll ``check`` every 20 ms until it returns something true; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def pool_workers(pid: int) -> list[psutil.Process]:
    """The spawned multiprocessing workers under ``pid`` (not the resource tracker)."""
    found = []
    for proc in descendants(pid):
        try:
            line = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "multiprocessing.spawn" in line or "spawn_main" in line:
            found.append(proc)
    return found


def maps_file(pid: int, folder: Path) -> bool:
    """Whether process ``pid`` has a file of ``folder`` memory-mapped (a task reading rows)."""
    try:
        return any(str(folder) in m.path for m in psutil.Process(pid).memory_maps())
    except psutil.Error:
        return False


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out


def kill_all(procs: list[psutil.Process]) -> None:
    """SIGKILL whatever of ``procs`` still runs (a failing test leaves no orphans behind)."""
    for proc in alive(procs):
        with suppress(psutil.NoSuchProcess):
            proc.kill()


def stop(proc: subprocess.Popen[str], group: bool = False) -> None:
    """End ``proc``: SIGTERM, then SIGKILL after 10 s; with ``group``, its whole process group,
    which gets the SIGKILL in any case (whatever outlived the leader)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None and not group:
            return
        with suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def dask_cluster(folder: Path, workers: int = 2) -> Iterator[str]:
    """``dask scheduler`` on a free port and ``dask worker ADDRESS --nworkers N --nthreads 1``,
    each in a process group of its own (torn down with it); yields the scheduler address. No
    client is made in this process."""
    dask = Path(sys.executable).parent / "dask"
    if not dask.exists():
        pytest.skip("the dask command is not installed (pip install 'nvfp4lab[dask]')")
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    folder.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        with open(folder / "scheduler.log", "w") as log:
            procs.append(subprocess.Popen(
                [str(dask), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                 "--no-dashboard"], cwd=folder, env=child_env(), stdout=log, stderr=log,
                start_new_session=True))
        wait_for(lambda: procs[0].poll() is not None or _accepts(port), "the Dask scheduler")
        assert procs[0].poll() is None, (folder / "scheduler.log").read_text()
        with open(folder / "worker.log", "w") as log:
            procs.append(subprocess.Popen(
                [str(dask), "worker", address, "--nworkers", str(workers), "--nthreads", "1",
                 "--no-dashboard", "--local-directory", str(folder / "scratch")],
                cwd=folder, env=child_env(), stdout=log, stderr=log, start_new_session=True))
        yield address
    finally:
        for proc in reversed(procs):
            stop(proc, group=True)


def busy_checkpoint(small: Path, path: Path, layers: int = 8, shards: int = 4) -> Path:
    """A compressed-tensors checkpoint of ``layers`` 2048 x 4096 NVFP4 layers (random codes and
    block scales; 37 MB) in ``shards`` indexed files, with the config of the checkpoint ``small``:
    auditing it keeps a process busy for seconds."""
    rows, cols = 2048, 4096
    path.mkdir(parents=True)
    shutil.copy(small / "config.json", path / "config.json")
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    per = -(-layers // shards)
    for shard in range(shards):
        tensors = {}
        for i in range(shard * per, min(layers, (shard + 1) * per)):
            name = f"model.layers.{i}.mlp.down_proj"
            tensors[f"{name}.weight_packed"] = torch.randint(0, 256, (rows, cols // 2),
                                                             generator=gen, dtype=torch.uint8)
            tensors[f"{name}.weight_scale"] = (torch.rand(rows, cols // 16, generator=gen) * 400
                                               + 1).to(torch.float8_e4m3fn)
            tensors[f"{name}.weight_global_scale"] = torch.tensor([100.0])
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path
