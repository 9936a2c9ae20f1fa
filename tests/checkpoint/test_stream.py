"""checkpoint.stream: the header inventory, row reads and the task runner, against tensors the
safetensors library wrote and read."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nvfp4lab.checkpoint import FORMATS
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.checkpoint.stream import RowReader, inventory, read_scalar, run_tasks
from nvfp4lab.vocab import CheckpointFormat


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    """A two-shard compressed-tensors-named checkpoint (headers only matter here)."""
    names = FORMATS[CheckpointFormat.COMPRESSED_TENSORS].names
    gen = torch.Generator().manual_seed(0)
    first = {f"l0.{names.packed}": torch.randint(0, 255, (6, 8), generator=gen,
                                                   dtype=torch.uint8),
             f"l0.{names.tensor_scale}": torch.tensor([123.5]),
             "emb.weight": torch.randn(5, 4, generator=gen, dtype=torch.bfloat16)}
    second = {f"l1.{names.tensor_scale}": torch.tensor([7.25]),
              "norm.weight": torch.randn(4, generator=gen)}
    save_file(first, str(tmp_path / "a.safetensors"), metadata={"format": "pt"})
    save_file(second, str(tmp_path / "b.safetensors"))
    weight_map = {**dict.fromkeys(first, "a.safetensors"), **dict.fromkeys(second, "b.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path


def test_inventory_describes_every_tensor_from_the_headers(sharded: Path) -> None:
    inv = inventory(sharded, CheckpointFormat.COMPRESSED_TENSORS)
    assert inv.indexed and inv.layers == ("l0", "l1")
    assert inv.files == (sharded / "a.safetensors", sharded / "b.safetensors")
    assert inv.metadata[sharded / "a.safetensors"] == {"format": "pt"}
    loaded = {**load_file(str(sharded / "a.safetensors")),
              **load_file(str(sharded / "b.safetensors"))}
    assert set(inv.tensors) == set(loaded)
    for key, info in inv.tensors.items():
        tensor = loaded[key]
        assert info.torch_dtype == tensor.dtype and info.shape == tuple(tensor.shape)
        assert info.nbytes == tensor.numel() * tensor.element_size()
        raw = info.file.read_bytes()[info.offset:info.offset + info.nbytes]
        assert raw == tensor.contiguous().view(torch.uint8).numpy().tobytes(), key
    offsets = [t.offset for t in inv.in_file(sharded / "a.safetensors")]
    assert offsets == sorted(offsets)


def test_row_reads_and_scalars(sharded: Path) -> None:
    inv = inventory(sharded, CheckpointFormat.COMPRESSED_TENSORS)
    loaded = load_file(str(sharded / "a.safetensors"))
    packed = inv.tensors["l0.weight_packed"]
    with RowReader(packed) as reader:
        assert torch.equal(reader.rows(2, 5), loaded["l0.weight_packed"][2:5])
        assert torch.equal(reader.rows(), loaded["l0.weight_packed"])
    with RowReader(inv.tensors["emb.weight"]) as reader:
        assert torch.equal(reader.rows(1, 3), loaded["emb.weight"][1:3])
    assert read_scalar(inv.tensors["l0.weight_global_scale"]) == 123.5
    assert read_scalar(inv.tensors["l1.weight_global_scale"]) == 7.25
    with pytest.raises(CheckpointError, match="expected one value"):
        read_scalar(packed)


def test_inventory_refuses_a_stale_index(sharded: Path) -> None:
    index = sharded / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["ghost"] = "b.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="'ghost'"):
        inventory(sharded, CheckpointFormat.COMPRESSED_TENSORS)


def _square(x: int) -> int:
    return x * x


def test_run_tasks_keeps_order_and_checks_workers() -> None:
    assert run_tasks(_square, [3, 1, 2], workers=0) == [9, 1, 4]
    assert run_tasks(_square, [], workers=0) == []
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="workers must be an int"):
            run_tasks(_square, [1], workers=bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Issue 19, case A: `--dask ADDRESS` against a real `dask scheduler` and `dask worker` processes,
# with no Dask client in the calling process (as_completed used to look for a default client
# and stop with "No clients found", exit 2), for `nvfp4lab audit` and `nvfp4lab convert` run as
# commands; the results equal the in-process run's.


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ``dask scheduler`` and a ``dask worker --nworkers 2`` for the module (the address),
    shared by its Dask tests: a cluster start costs seconds of CPU, and nothing a test sends
    depends on the worker's own environment (the thread count travels with each task)."""
    from tests import processes

    with processes.dask_cluster(tmp_path_factory.mktemp("dask")) as address:
        yield address


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.checkpoint.builders import saved_checkpoint

    return saved_checkpoint(tmp_path_factory.mktemp("stream") / "ckpt", seed=6,
                            share_global_scale=None)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_audit_and_convert_commands_on_dask_scheduler_and_worker_processes(
    small_checkpoint: Path, cluster: str, tmp_path: Path
) -> None:
    from nvfp4lab.checkpoint.auditing import audit_rows, write_csv
    from nvfp4lab.checkpoint.conversion import convert
    from tests import processes

    write_csv(audit_rows(small_checkpoint, workers=0), tmp_path / "inline.csv")
    convert(small_checkpoint, tmp_path / "inline-mo", format="modelopt", workers=0)
    runs = tmp_path / "runs"
    runs.mkdir()
    relative = os.path.relpath(small_checkpoint, runs)  # tasks get absolute paths
    audit = processes.cli(["audit", relative, "--out", "report", "--dask", cluster], runs)
    conv = processes.cli(["convert", relative, "mo", "--format", "modelopt", "--dask", cluster],
                         runs)
    try:
        audit_out, audit_err = audit.communicate(timeout=180)
        _, conv_err = conv.communicate(timeout=60)
    finally:
        processes.stop(audit)
        processes.stop(conv)
    assert audit.returncode == 1, audit_err  # 1: flagged layers (unshared tensor scales)
    assert "14 quantized layers, 6 flagged" in audit_out
    assert conv.returncode == 0, conv_err
    assert (runs / "report" / "audit.csv").read_bytes() == (tmp_path / "inline.csv").read_bytes()
    assert _files(runs / "mo") == _files(tmp_path / "inline-mo")
    assert sorted(p.name for p in runs.iterdir()) == ["mo", "report"]


# --------------------------------------------------------------------------------------------
# Issue 19, case B: SIGKILL of `audit` / `convert --workers 2` used to leave both spawned pool
# workers (a few hundred MB each) and multiprocessing's resource tracker alive, adopted by PID 1.
# Now each worker dies with its parent (prctl PR_SET_PDEATHSIG on Linux), and the tracker ends
# once no worker holds its pipe.


@pytest.fixture(scope="module")
def busy_checkpoint(small_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests import processes

    return processes.busy_checkpoint(small_checkpoint, tmp_path_factory.mktemp("busy") / "ckpt")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("command", ["audit", "convert"])
def test_sigkill_of_the_command_ends_its_pool_workers(command: str, busy_checkpoint: Path,
                                                       tmp_path: Path) -> None:
    from tests import processes

    argv = {"audit": ["audit", str(busy_checkpoint)],
            "convert": ["convert", str(busy_checkpoint), "out", "--format", "modelopt"]}[command]
    proc = processes.cli([*argv, "--workers", "2"], tmp_path)
    family: list = []
    try:
        def two_workers() -> list:
            workers = processes.pool_workers(proc.pid)
            return workers if len(workers) == 2 else []

        workers = processes.wait_for(two_workers, "two pool workers")
        if command == "audit":  # kill it mid-task: a worker is reading rows of the checkpoint
            processes.wait_for(lambda: any(processes.maps_file(w.pid, busy_checkpoint)
                                           for w in workers), "a worker reading the checkpoint")
        family = processes.descendants(proc.pid)
        assert proc.poll() is None and len(processes.alive(family)) >= 2, "finished too early"
        proc.kill()
        proc.wait(timeout=10)
        processes.wait_for(lambda: not processes.alive(family),
                           "the workers and the resource tracker to end", timeout=10)
    finally:
        processes.kill_all(family)
        processes.stop(proc)


# --------------------------------------------------------------------------------------------
# Issue 20: torch threads per process come from settings (NVFP4LAB_THREADS, default 1) in local
# pool workers and in Dask tasks alike (a worker used to take cores // workers).


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("threads", [None, "2"])
def test_pool_workers_and_dask_tasks_run_the_settings_thread_count(
    threads: str | None, cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import operator

    from nvfp4lab import settings

    if threads is not None and int(threads) > settings.thread_limit():
        pytest.skip(f"{threads} threads are more than this machine's CPUs (refused, issue 32)")
    if threads is None:
        monkeypatch.delenv(settings.THREADS_ENV, raising=False)
    else:
        monkeypatch.setenv(settings.THREADS_ENV, threads)
    expected = [settings.torch_threads()] * 2
    assert expected == [1, 1] if threads is None else [2, 2]
    tasks = [torch.get_num_threads] * 2  # each task reports its process's torch threads
    assert run_tasks(operator.call, tasks, workers=2) == expected
    assert run_tasks(operator.call, tasks, dask=cluster) == expected
