"""The results store: shards, machine names, code revisions."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from nvfp4lab.bench import store


def _git_in(repo: Path, *args: str) -> str:
    import subprocess

    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    cmd += ["-c", "commit.gpgsign=false", *args]
    env = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1", "PATH": os.environ["PATH"]}
    return subprocess.run(
        cmd, cwd=repo, env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_refuses_to_mix_layouts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="another header"):
        store.append_rows(bad, [])


def test_machine_name_is_sanitized() -> None:
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", store.machine_name())
    assert store.shard_path("results").name == f"{store.machine_name()}.csv"
    assert store.shard_path("x/y.csv") == Path("x/y.csv")


def test_code_revision_is_a_string() -> None:
    rev = store.code_revision()
    assert rev == "unknown" or re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?", rev)


def test_code_revision_counts_untracked_files(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, ...]] = []
    status = {"out": ""}

    def fake_git(*args: str, cwd: object = None) -> str | None:
        calls.append(args)
        if args[0] == "rev-parse":
            return "abc1234"
        return status["out"]

    monkeypatch.setattr(store, "_git", fake_git)
    assert store.code_revision() == "abc1234"
    status["out"] = "?? nvfp4lab/new_module.py"  # a new file git does not track yet
    assert store.code_revision() == "abc1234+dirty"
    status["out"] = " M nvfp4lab/bench/store.py"
    assert store.code_revision() == "abc1234+dirty"
    st = [c for c in calls if c[0] == "status"]
    assert st and all("--untracked-files=no" not in c for c in st)
    assert all(c[-2:] == ("--", ".") for c in st)  # only the package folder counts


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_code_revision_in_a_temp_git_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    repo = tmp_path / "repo"
    pkg = repo / "nvfp4lab"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("__pycache__/\n")
    _git_in(repo, "init", "-q")
    _git_in(repo, "add", ".")
    _git_in(repo, "commit", "-q", "-m", "init")
    rev = _git_in(repo, "rev-parse", "--short", "HEAD")
    assert store.code_revision(pkg) == rev
    (repo / "notes.txt").write_text("outside the package\n")  # does not count
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "x.pyc").write_bytes(b"\0")  # git-ignored: does not count
    assert store.code_revision(pkg) == rev
    (pkg / "sub").mkdir()
    (pkg / "sub" / "new.py").write_text("y = 2\n")  # untracked, in the package
    assert store.code_revision(pkg) == f"{rev}+dirty"
    assert store.code_revision(tmp_path / "nowhere") == "unknown"


def _v1_shard(path: Path) -> None:
    import csv

    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=store.COLUMNS_V1)
        w.writeheader()
        for op, backend in [("quantize", "torch"), ("matmul", "torch"), ("linear", "w4a16"),
                            ("linear", "native"), ("peer_quantize", "nvfp4lab[kernel]"),
                            ("peer_quantize", "compressed-tensors")]:
            w.writerow({c: "" for c in store.COLUMNS_V1} | {"op": op, "backend": backend,
                                                           "median_s": "0.5"})


def test_older_layout_is_read_and_never_appended_to(tmp_path: Path) -> None:
    """A shard written before the path/copy_fraction columns: read as it is (every nvfp4lab op
    then ran eagerly), refused as a target for new rows, left byte for byte unchanged."""
    old = tmp_path / "old.csv"
    _v1_shard(old)
    before = old.read_bytes()
    frame = store.read_shards(tmp_path)
    assert list(frame["path"]) == ["eager", "", "eager", "", "eager", ""]
    assert frame["copy_fraction"].isna().all() and (frame["median_s"] == 0.5).all()
    with pytest.raises(ValueError, match=r"older layout.*never mixed.*new file"):
        store.append_rows(old, [])
    with pytest.raises(ValueError, match="older layout"):
        store.check_shard(old)
    assert old.read_bytes() == before
    assert store.COLUMNS[: len(store.COLUMNS_V1)] == store.COLUMNS_V1


def test_committed_shards_read_with_a_path_for_every_row() -> None:
    results = Path(__file__).resolve().parents[2] / "results"
    frame = store.read_shards(results)
    assert not frame.empty and frame["path"].notna().all()
    elementwise = frame[frame["op"].isin(["quantize", "dequantize", "fake_quantize"])]
    assert set(elementwise["path"]) <= {"eager", "fused"}


def test_measured_row_takes_a_measurement_or_the_older_keywords(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``measured_row(Measurement(...))`` and the older keyword form give the same row, whose
    derived columns follow from the record; a case given both ways is refused."""
    from nvfp4lab.bench.timing import Timing

    monkeypatch.setattr(store, "load_average", lambda: "0.5")
    timing = Timing(samples=(2e-3, 1e-3, 4e-3), number=3, warmup=1, method="perf_counter",
                    device="cpu")
    case = dict(op="linear", shape="64x128", M=8, N=64, K=128, dtype="bfloat16",
                backend="w4a16", convention="kernel", timing=timing, nbytes=4e6, flops=2e9,
                path="fused", copy_s=5e-4)
    env = {"device": "cpu", "threads": 1}
    row = store.measured_row(store.Measurement(**case), env=env, seed=7)
    assert row == store.measured_row(**case, env=env, seed=7)
    assert set(row) == set(store.COLUMNS) - {"device_name", "capability", "torch_version",
                                              "machine", "date", "code_revision"}
    assert (row["median_s"], row["gb_s"], row["tflop_s"], row["copy_fraction"]) == (
        "0.002", "2", "1", "0.25")
    assert (row["bytes"], row["flops"], row["repeats"], row["seed"]) == (4_000_000, 2e9, 3, 7)
    bare = store.measured_row(store.Measurement(**{**case, "nbytes": 0.0, "flops": 0.0,
                                                   "copy_s": None}), env=env, seed=7)
    assert (bare["gb_s"], bare["tflop_s"], bare["bytes"], bare["copy_fraction"]) == ("",) * 4
    with pytest.raises(TypeError, match="not both"):
        store.measured_row(store.Measurement(**case), env=env, seed=7, path="eager")
    with pytest.raises(TypeError, match="unexpected keyword argument 'nbyte'"):
        store.measured_row(**{**case, "nbyte": 1.0}, env=env, seed=7)
