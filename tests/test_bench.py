"""Benchmark harness and results store (nvfp4lab.bench). Rows are checked for shape and sanity,
never for speed."""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from nvfp4lab import bench


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def _positive_finite(text: str) -> bool:
    value = float(text)
    return math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("bench") / "x.csv"
    code = bench.main(["--quick", "--out", str(out)])
    return out, code


def test_quick_run_writes_well_formed_rows(quick_run: tuple[Path, int]) -> None:
    out, code = quick_run
    assert code == 0
    header, rows = _read(out)
    assert tuple(header) == bench.COLUMNS
    assert rows
    assert {r["op"] for r in rows} == set(bench.OPS)
    assert {"emulation", "w4a16"} <= {r["backend"] for r in rows if r["op"] == "linear"}
    for r in rows:
        for col in ("median_s", "min_s", "max_s"):
            assert _positive_finite(r[col]), (col, r)
        assert float(r["spread_s"]) >= 0 and r["spread_kind"] == "iqr"
        derived = r["tflop_s"] if r["op"] in ("linear", "matmul") else r["gb_s"]
        assert _positive_finite(derived), r
        assert r["kind"] == "measured"
        for col in ("device", "device_name", "torch_version", "date", "code_revision", "machine"):
            assert r[col], col
        assert int(r["threads"]) >= 1
        assert r["torch_version"] == torch.__version__


def test_rows_are_appended_not_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "shard.csv"
    args = ["--tiny", "--out", str(out), "--ops", "quantize", "dequantize"]
    assert bench.main(args) == 0
    _, first = _read(out)
    assert bench.main(args) == 0
    _, second = _read(out)
    assert len(second) == 2 * len(first)
    assert out.read_text().count("median_s") == 1  # one header


def test_folder_out_writes_machine_shard_and_leaves_others(tmp_path: Path) -> None:
    other = tmp_path / "some-other-machine.csv"
    other.write_text("keep me\n")
    assert bench.main(["--tiny", "--out", str(tmp_path), "--ops", "matmul"]) == 0
    shard = tmp_path / f"{bench.machine_name()}.csv"
    assert shard.exists()
    assert other.read_text() == "keep me\n"


def test_refuses_to_mix_layouts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="columns"):
        bench.append_rows(bad, [])


def test_machine_name_is_sanitized() -> None:
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", bench.machine_name())
    assert bench.shard_path("results").name == f"{bench.machine_name()}.csv"
    assert bench.shard_path("x/y.csv") == Path("x/y.csv")


def test_code_revision_is_a_string() -> None:
    rev = bench.code_revision()
    assert rev == "unknown" or re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?", rev)


def test_parse_shapes() -> None:
    assert bench.parse_shapes(["16x4096x4096", "1,64,32"]) == [(16, 4096, 4096), (1, 64, 32)]
    with pytest.raises(ValueError):
        bench.parse_shapes(["16x4096"])
    with pytest.raises(ValueError, match="K % 16"):
        bench.parse_shapes(["1x16x17"])


def test_seeded_inputs_are_reproducible_and_nonzero() -> None:
    a = bench.seeded_randn((64, 64), torch.bfloat16, 3)
    b = bench.seeded_randn((64, 64), torch.bfloat16, 3)
    c = bench.seeded_randn((64, 64), torch.bfloat16, 4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (a != 0).all()


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    assert bench.main(["--tiny", "--out", str(tmp_path / "x.csv"), "--backends", "marlin"]) == 2
    assert bench.main(["--tiny", "--out", str(tmp_path / "x.csv"), "--shapes", "1x2"]) == 2


def test_run_cli_accepts_a_minimal_namespace(tmp_path: Path) -> None:
    # the CLI hook may pass only --quick/--out; the rest takes defaults
    ns = argparse.Namespace(
        quick=False, out=str(tmp_path / "y.csv"), shapes=["4x64x64"], ops=["matmul"]
    )
    assert bench.run_cli(ns) == 0
    _, rows = _read(tmp_path / "y.csv")
    assert [r["shape"] for r in rows] == ["4x64x64"]


def test_peers_prints_ratios_and_matches_compressed_tensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "peers.csv"
    assert bench.main(["--peers", "--tiny", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "compressed-tensors" in text and "speedup" in text
    _, rows = _read(out)
    impls = {r["backend"] for r in rows}
    assert {"compressed-tensors", "nvfp4lab[compressed-tensors]", "nvfp4lab[kernel]"} <= impls
    assert all(r["op"] == "peer_quantize" and _positive_finite(r["median_s"]) for r in rows)


def test_run_peers_is_bit_exact_with_ct_convention() -> None:
    results, notes = bench.run_peers([(32, 64)], repeats=1)
    by = {r.impl: r for r in results}
    assert by["nvfp4lab[compressed-tensors]"].matches_ct is True
    assert by["compressed-tensors"].speedup_vs_ct == 1.0
    assert 0.9 < by["nvfp4lab[kernel]"].code_agreement <= 1.0
    assert all(r.median_s > 0 for r in results)
    assert isinstance(notes, list)


# -- code revision ---------------------------------------------------------------------------


def test_code_revision_counts_untracked_files(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, ...]] = []
    status = {"out": ""}

    def fake_git(*args: str, cwd: object = None) -> str | None:
        calls.append(args)
        if args[0] == "rev-parse":
            return "abc1234"
        return status["out"]

    monkeypatch.setattr(bench, "_git", fake_git)
    assert bench.code_revision() == "abc1234"
    status["out"] = "?? nvfp4lab/new_module.py"  # a new file git does not track yet
    assert bench.code_revision() == "abc1234+dirty"
    status["out"] = " M nvfp4lab/bench.py"
    assert bench.code_revision() == "abc1234+dirty"
    st = [c for c in calls if c[0] == "status"]
    assert st and all("--untracked-files=no" not in c for c in st)
    assert all(c[-2:] == ("--", ".") for c in st)  # only the package folder counts


def _git_in(repo: Path, *args: str) -> str:
    import subprocess

    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    cmd += ["-c", "commit.gpgsign=false", *args]
    env = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1", "PATH": os.environ["PATH"]}
    return subprocess.run(
        cmd, cwd=repo, env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


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
    assert bench.code_revision(pkg) == rev
    (repo / "notes.txt").write_text("outside the package\n")  # does not count
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "x.pyc").write_bytes(b"\0")  # git-ignored: does not count
    assert bench.code_revision(pkg) == rev
    (pkg / "sub").mkdir()
    (pkg / "sub" / "new.py").write_text("y = 2\n")  # untracked, in the package
    assert bench.code_revision(pkg) == f"{rev}+dirty"
    assert bench.code_revision(tmp_path / "nowhere") == "unknown"


# -- CLI validation: a clear one-line message and exit code 2, no traceback ---------------------


def _cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = bench.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("nvfp4lab bench: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize("peers", [False, True], ids=["bench", "peers"])
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--repeats", "0"], r"--repeats 0.*--repeats 1 or more"),
        (["--warmup", "-1"], r"--warmup -1.*--warmup 0 or more"),
        (["--device", "xyz"], r"--device 'xyz' is not a torch device.*--device cpu"),
        (["--device", "mps"], r"--device 'mps'.*only cpu and cuda.*--device cpu"),
    ],
)
def test_bad_values_are_reported_not_raised(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    peers: bool,
    extra: list[str],
    expected: str,
) -> None:
    out = tmp_path / "x.csv"
    argv = ["--tiny", "--out", str(out), "--ops", "matmul", *extra] + (["--peers"] if peers else [])
    assert re.search(expected, _cli_error(capsys, argv))
    assert not out.exists()  # nothing measured, nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")
@pytest.mark.parametrize("peers", [False, True], ids=["bench", "peers"])
def test_cuda_on_cpu_only_torch_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], peers: bool
) -> None:
    argv = ["--tiny", "--out", str(tmp_path / "x.csv"), "--device", "cuda"]
    err = _cli_error(capsys, argv + (["--peers"] if peers else []))
    assert "--device 'cuda'" in err and "CUDA is not usable" in err and "--device cpu" in err


def test_resolve_device() -> None:
    assert bench.resolve_device("cpu") == "cpu"
    assert bench.resolve_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="cuda"):
        bench.resolve_device(f"cuda:{torch.cuda.device_count() + 3}")


@pytest.mark.parametrize("peers", [False, True], ids=["bench", "peers"])
def test_out_with_another_header_is_reported_and_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], peers: bool
) -> None:
    other = tmp_path / "other.csv"
    other.write_text("name,value\na,1\n")
    argv = ["--tiny", "--out", str(other), "--ops", "matmul"] + (["--peers"] if peers else [])
    err = _cli_error(capsys, argv)
    assert str(other) in err and "another header" in err and "name, value" in err
    assert "new file" in err
    assert other.read_text() == "name,value\na,1\n"


def test_nothing_measured_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if bench.native_available("cpu")[0]:
        pytest.skip("native FP4 runs here")
    out = tmp_path / "x.csv"
    code = bench.main(["--tiny", "--out", str(out), "--backends", "native", "--ops", "linear"])
    err = capsys.readouterr().err
    assert code != 0
    assert "nothing was measured" in err and "linear/native skipped" in err
    assert "--backends emulation" in err
    assert not out.exists()


# -- peers on --device, torchao given a per-tensor scale -------------------------------------


def test_peers_time_on_the_requested_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from nvfp4lab import timing

    seen: list[object] = []
    real = timing.time_interleaved

    def spy(fns: dict, **kwargs: object) -> dict:
        seen.append(kwargs.get("device"))
        return real(fns, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(timing, "time_interleaved", spy)
    results, _ = bench.run_peers([(32, 64)], repeats=1, device="cpu")
    assert seen == ["cpu"]
    assert {r.device for r in results} == {"cpu"} and {r.timer for r in results} == {"perf_counter"}
    rows = bench._peer_rows(results, bench.environment("cpu"), 0)
    assert {r["timer"] for r in rows} == {"perf_counter"} and {r["device"] for r in rows} == {"cpu"}
    with pytest.raises(ValueError, match="--repeats 0"):
        bench.run_peers([(32, 64)], repeats=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peers_on_cuda_use_cuda_events(tmp_path: Path) -> None:
    results, _ = bench.run_peers([(256, 256)], repeats=2, device="cuda")
    assert {r.timer for r in results} == {"cuda_events"}
    assert {r.device for r in results} == {"cuda"}
    by = {r.impl: r for r in results}
    assert by["nvfp4lab[compressed-tensors]"].matches_ct is True
    out = tmp_path / "p.csv"
    assert bench.main(["--peers", "--tiny", "--device", "cuda", "--out", str(out)]) == 0
    _, rows = _read(out)
    assert {r["timer"] for r in rows} == {"cuda_events"}
    assert all(r["capability"] for r in rows)


def test_torchao_gets_a_decode_convention_per_tensor_scale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scales: list[torch.Tensor | None] = []

    def to_nvfp4(data_hp: torch.Tensor, block_size: int = 16, per_tensor_scale=None) -> object:
        scales.append(per_tensor_scale)
        return data_hp

    monkeypatch.setattr(bench, "_torchao_quantizer", lambda: to_nvfp4)
    results, notes = bench.run_peers([(32, 64)], repeats=2, warmup=0)
    assert "torchao" in {r.impl for r in results}
    x = bench.seeded_randn((32, 64), torch.bfloat16, 0)
    expected = x.abs().amax().float() / 2688.0
    assert scales and all(s is not None and torch.equal(s, expected) for s in scales)
    assert not any("torchao" in n for n in notes)


def test_torchao_without_per_tensor_scale_or_failing_is_noted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench, "_torchao_quantizer", lambda: lambda data_hp: data_hp)
    results, notes = bench.run_peers([(32, 64)], repeats=1)
    assert "torchao" in {r.impl for r in results}
    assert any("no per_tensor_scale" in n and "not like for like" in n for n in notes)

    def broken(data_hp: torch.Tensor, per_tensor_scale: object = None) -> object:
        raise NotImplementedError("no CPU kernel")

    monkeypatch.setattr(bench, "_torchao_quantizer", lambda: broken)
    results, notes = bench.run_peers([(32, 64)], repeats=1)
    assert "torchao" not in {r.impl for r in results}
    assert any("failed" in n and "no CPU kernel" in n and "skipped" in n for n in notes)
