"""The kernel cache and the ``auto`` policy: the rule as a pure function of its state, the warm
marker, the huge-page hint on large outputs, and one fresh process per cache state (warm: fused
from the first large call; cold: eager) asserting on the path that ran, never on time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nvfp4lab import kernels, settings
from nvfp4lab.codec import quantize
from nvfp4lab.kernels import AutoState, auto_decision, cache, native
from nvfp4lab.kernels import compiled as fused

ROOT = Path(__file__).resolve().parents[2]
MIN, CALL, WORK, COLD = (
    kernels.AUTO_MIN_ELEMENTS,
    kernels.AUTO_WARM_CALL_ELEMENTS,
    kernels.AUTO_WARM_WORK_ELEMENTS,
    kernels.AUTO_WORK_ELEMENTS,
)


def test_thresholds_are_ordered() -> None:
    assert MIN < CALL < WORK < COLD


@pytest.mark.parametrize(
    ("numel", "ledger", "started", "warm", "fused_"),
    [
        (MIN - 1, COLD, True, True, False),  # small calls always stay eager
        (MIN, 0, True, False, True),  # start-up paid in this process: any large call
        (CALL, 0, False, True, True),  # warm cache: one call this large compiles at once
        (CALL - 1, 0, False, True, False),
        (MIN, WORK - MIN, False, True, True),  # warm: the ledger with this call reaches it
        (MIN, WORK - MIN - 1, False, True, False),
        (1 << 40, COLD - 1, False, False, False),  # cold: ski rental, however large the call
        (MIN, COLD, False, False, True),
    ],
)
def test_auto_decision(numel: int, ledger: int, started: bool, warm: bool, fused_: bool) -> None:
    assert auto_decision(numel, AutoState(ledger, started, warm)) is fused_


def test_use_fused_counts_eager_work_and_reads_the_state(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, auto = torch.device("cpu"), {settings.FUSED_ENV: "auto"}
    monkeypatch.setattr(kernels, "_EAGER_WORK", {})
    monkeypatch.setattr(cache, "_STARTED", set())
    warm: dict[str, bool] = {"cpu": False}
    monkeypatch.setattr(cache, "warm", lambda device_type, dtype=None: warm[device_type])
    monkeypatch.setattr(kernels, "compiler_available", lambda device_type: True)
    assert not kernels.use_fused(CALL, cpu, env=auto, dtype=torch.bfloat16)
    assert kernels.eager_work("cpu") == CALL
    assert not kernels.use_fused(MIN - 1, cpu, env=auto)
    assert kernels.eager_work("cpu") == CALL  # too small to count
    warm["cpu"] = True
    assert kernels.use_fused(CALL, cpu, env=auto, dtype=torch.bfloat16)
    assert kernels.auto_state("cpu") == AutoState(CALL, False, True)


def test_the_marker_records_what_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "prepare", lambda: tmp_path)
    monkeypatch.setattr(cache, "_NOTED", set())
    monkeypatch.setattr(cache, "_STARTED", set())
    monkeypatch.setenv(settings.INDUCTOR_CACHE_ENV, str(tmp_path))
    path = cache.marker_path(tmp_path)
    assert path.parent == tmp_path / cache.MARKER_DIR and not path.exists()
    assert not cache.warm("cpu") and not cache.started("cpu")
    cache.note_ran("cpu", torch.bfloat16, ("stats", "codes"))
    assert cache.started("cpu") and not cache.started("cuda")
    assert cache.warm("cpu", torch.bfloat16) and not cache.warm("cpu", torch.float32)
    assert json.loads(path.read_text())["ran"] == [
        ["cpu", "bfloat16", "codes"],
        ["cpu", "bfloat16", "stats"],
    ]
    # another process's entries are kept when this one adds its own
    path.write_text(json.dumps({"ran": [["cuda", "float16", "decode"]]}))
    cache.note_ran("cpu", torch.float32, ("decode",))
    ran = json.loads(path.read_text())["ran"]
    assert ["cuda", "float16", "decode"] in ran and ["cpu", "float32", "decode"] in ran
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_a_broken_marker_reads_as_cold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "_NOTED", set())
    monkeypatch.setenv(settings.INDUCTOR_CACHE_ENV, str(tmp_path))
    path = cache.marker_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert not cache.warm("cpu")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise hint: Linux only")
def test_large_outputs_are_advised_huge_pages() -> None:
    """The VMA of a large fresh output carries ``hg`` (MADV_HUGEPAGE) in /proc/self/smaps."""

    def vm_flags(address: int) -> list[str]:
        inside = False
        for line in Path("/proc/self/smaps").read_text().splitlines():
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
        raise AssertionError(f"no mapping holds {address:#x}")

    cpu = torch.device("cpu")
    big = fused.fresh((fused.HUGE_OUTPUT_BYTES // 2,), torch.bfloat16, cpu)
    assert big.shape == (fused.HUGE_OUTPUT_BYTES // 2,) and big.dtype == torch.bfloat16
    middle = big.data_ptr() + big.numel()  # a byte in the 2 MiB-aligned interior
    assert "hg" in vm_flags(middle)
    small = fused.fresh((1024,), torch.float32, cpu)
    assert "hg" not in vm_flags(small.data_ptr())


_CHILD = """
import json, sys, torch
from nvfp4lab import kernels
from nvfp4lab.kernels import cache, compiled, native
from nvfp4lab.codec import quantize
native.available = lambda: False  # a CPU without the native library: the graphs' auto rule
kernels.AUTO_WARM_CALL_ELEMENTS = kernels.AUTO_MIN_ELEMENTS  # "large" at test size
ran = []
stats = compiled.block_stats
compiled.block_stats = lambda *a: ran.append(1) or stats(*a)
x = torch.randn(256, 256).to(torch.bfloat16)
q = quantize(x)
assert q == quantize(x, fused=False)
print(json.dumps({"fused": len(ran), "eager": kernels.eager_work("cpu"),
                  "cache": __import__("os").environ.get("TORCHINDUCTOR_CACHE_DIR")}))
"""


def _child(env: dict[str, str]) -> dict[str, object]:
    env = {k: v for k, v in env.items() if k != settings.FUSED_ENV}  # auto
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif('not kernels.compiler_available("cpu")', reason="torch.compile does not work")
def test_a_fresh_process_with_a_warm_cache_goes_fused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled graphs' ``auto`` rule, in processes without the native library (where it
    is built, the C++ block encode runs from the first call and nothing compiles)."""
    monkeypatch.setattr(native, "available", lambda: False)
    quantize(torch.randn(64, 64).to(torch.bfloat16), fused=True)  # warms this process's cache
    here = os.environ[settings.INDUCTOR_CACHE_ENV]
    assert cache.warm("cpu", torch.bfloat16) and cache.marker_path(Path(here)).is_file()
    warm = _child(dict(os.environ))
    assert warm == {"fused": 1, "eager": 0, "cache": here}
    # the same call with an empty cache directory stays eager (and nothing compiles)
    cold = _child({**os.environ, settings.INDUCTOR_CACHE_ENV: str(tmp_path)})
    assert cold == {"fused": 0, "eager": 256 * 256, "cache": str(tmp_path)}
    assert not any(tmp_path.iterdir())


def test_prepare_says_which_directory_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(settings.INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    cache.prepare.cache_clear()
    try:
        with caplog.at_level("INFO", logger="nvfp4lab.kernels.cache"):
            assert cache.prepare() == tmp_path / "mine"
        assert os.environ[settings.INDUCTOR_CACHE_ENV] == str(tmp_path / "mine")  # untouched
        assert [r.getMessage() for r in caplog.records] == [
            f"nvfp4lab: compiled kernels are cached in {tmp_path / 'mine'} "
            "(TORCHINDUCTOR_CACHE_DIR, which wins)"
        ]
    finally:
        cache.prepare.cache_clear()


_CROSS_ISA_SCRIPT = """
import torch
torch.set_num_threads(1)
from nvfp4lab import kernels, settings
from nvfp4lab.codec import dequantize, quantize
from nvfp4lab.kernels import native
native.available = lambda: False  # the compiled graphs, as on a CPU without the C++ library
ok = kernels.compiler_available("cpu")
bad = 0
x = torch.randn((32,), generator=torch.Generator().manual_seed(0))
q = quantize(x, fused=False)
got, want = dequantize(q, torch.bfloat16, fused=True), dequantize(q, torch.bfloat16, fused=False)
bad += int((got.view(torch.uint8) != want.view(torch.uint8)).sum())
print(ok, bad, settings.kernel_cache_dir()[0])
"""


@pytest.mark.skipif('not kernels.compiler_available("cpu")',
                    reason="torch.compile does not work here")
def test_kernels_cached_for_one_instruction_set_never_run_under_another(tmp_path: Path) -> None:
    """One cache, two capabilities (the CPU's best, then ``ATEN_CPU_CAPABILITY=avx2``, as a
    machine sharing the home folder would be): each process compiles into its own folder and
    computes the eager bits. With one shared folder, inductor's cached AVX-512 code ran under
    AVX2 (its keys do not tell them apart): on an AVX-512 CPU the avx2 process's probe graph
    computed wrong values (fused kernels off) and its graphs wrong bits."""
    env = {k: v for k, v in os.environ.items()
           if k not in (settings.INDUCTOR_CACHE_ENV, settings.CPU_CAPABILITY_ENV)}
    env.update({settings.CACHE_ENV: str(tmp_path), settings.FUSED_ENV: "on"})
    folders = []
    for capability in (None, "avx2"):
        run_env = env if capability is None else {**env, settings.CPU_CAPABILITY_ENV: capability}
        done = subprocess.run([sys.executable, "-c", _CROSS_ISA_SCRIPT], env=run_env, cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        ok, bad, folder = done.stdout.split()[-3:]
        assert (ok, bad) == ("True", "0"), (capability, done.stderr[-2000:])
        folders.append(folder)
    assert folders[0] != folders[1]
    assert all(Path(f).parent == tmp_path / settings.KERNEL_CACHE_SUBDIR for f in folders)
