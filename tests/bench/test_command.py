"""``nvfp4lab bench``: runs, rows, validation. Rows are checked for shape and sanity, never for
speed."""

from __future__ import annotations

import argparse
import csv
import math
import re
from pathlib import Path

import pytest
import torch

from nvfp4lab.bench import command as bench
from nvfp4lab.bench import runner, store
from nvfp4lab.execution.dispatch import native_fp4_status


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def _positive_finite(text: str) -> bool:
    value = float(text)
    return math.isfinite(value) and value > 0


def _cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = bench.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("nvfp4lab bench: ") and "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("bench") / "x.csv"
    code = bench.main(["--quick", "--out", str(out)])
    return out, code


def test_quick_run_writes_well_formed_rows(quick_run: tuple[Path, int]) -> None:
    out, code = quick_run
    assert code == 0
    header, rows = _read(out)
    assert tuple(header) == store.COLUMNS
    assert rows
    assert {r["op"] for r in rows} == set(runner.OPS)
    assert {"emulation", "w4a16"} <= {r["backend"] for r in rows if r["op"] == "linear"}
    for op in ("quantize", "dequantize", "fake_quantize"):
        assert {r["path"] for r in rows if r["op"] == op} == {"eager", "fused"}, op
    # the linear also on the default settings' path (fused=None: the LUT decode on the CPU)
    assert {r["path"] for r in rows if r["op"] == "linear"} == {"eager", "fused", "default"}
    assert {r["path"] for r in rows if r["op"] in ("copy", "matmul")} == {""}
    assert {r["backend"] for r in rows if r["op"] == "copy"} == {"copy_", "clone"}
    copy_s = {r["shape"]: float(r["median_s"]) for r in rows if r["backend"] == "copy_"}
    for r in rows:  # copy_fraction: the same run's copy_ time over the row's time
        if r["op"] in runner.ELEMENTWISE_OPS or r["op"] == "copy":
            expected = copy_s[r["shape"]] / float(r["median_s"])
            assert float(r["copy_fraction"]) == pytest.approx(expected, rel=1e-3), r
        else:
            assert r["copy_fraction"] == ""
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
    shard = tmp_path / f"{store.machine_name()}.csv"
    assert shard.exists()
    assert other.read_text() == "keep me\n"


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    assert bench.main(["--tiny", "--out", str(tmp_path / "x.csv"), "--backends", "marlin"]) == 2
    assert bench.main(["--tiny", "--out", str(tmp_path / "x.csv"), "--shapes", "1x2"]) == 2
    assert bench.main(["--tiny", "--out", str(tmp_path / "x.csv"), "--paths", "jit"]) == 2


def test_one_path_and_the_relative_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.csv"
    argv = ["--tiny", "--out", str(out), "--paths", "fused", "--ops", "dequantize", "linear",
            "matmul", "--backends", "w4a16"]
    assert bench.main(argv) == 0
    _, rows = _read(out)
    assert [(r["op"], r["backend"], r["path"]) for r in rows] == [
        ("copy", "copy_", ""), ("copy", "clone", ""), ("dequantize", "torch", "fused"),
        ("matmul", "torch", ""), ("linear", "w4a16", "fused"),
    ]
    text = capsys.readouterr().out
    assert re.search(r"^dequantize .* fused .*x copy_$", text, re.M)
    assert re.search(r"^linear .* fused .*x matmul$", text, re.M)
    # the bound section: bytes moved (256x256 bf16: 2.5625 B an element) and the 0.64x bound
    assert re.search(r"^dequantize +256x256 +bfloat16 .* fused +0\.2 +0\.64x +\d", text, re.M)


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
    paths = {r["backend"]: r["path"] for r in rows}
    assert {
        "compressed-tensors": "",
        "nvfp4lab[compressed-tensors]": "eager",
        "nvfp4lab[kernel]": "eager",
        "nvfp4lab[compressed-tensors, fused]": "fused",
        "nvfp4lab[kernel, fused]": "fused",
    }.items() <= paths.items()
    assert all(r["op"] == "peer_quantize" and _positive_finite(r["median_s"]) for r in rows)
    exact = re.findall(r"^(nvfp4lab\[compressed-tensors(?:, fused)?\]) .* True ", text, re.M)
    assert len(exact) == 2  # bit for bit compressed-tensors' own bytes, on both paths


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
    argv = ["--tiny", "--out", str(out), *extra] + (["--peers"] if peers else ["--ops", "matmul"])
    assert re.search(expected, _cli_error(capsys, argv))
    assert not out.exists()  # nothing measured, nothing written


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--gguf", "x.gguf"], "--gguf does not apply without --llama-cpp; leave it out"),
        (["--peers", "--ops", "linear"], "--ops does not apply to --peers runs"),
        (["--peers", "--backends", "w4a16"], "--backends does not apply to --peers runs"),
        (["--model", "--shapes", "1x16x16"], "--shapes does not apply to --model runs"),
        (["--model", "--gguf", "x.gguf"], "--gguf does not apply to --model runs"),
        (["--llama-cpp", "--dtypes", "float32"], "--dtypes does not apply to --llama-cpp runs"),
        (["--llama-cpp", "--paths", "eager"], "--paths does not apply to --llama-cpp runs"),
    ],
)
def test_an_option_the_run_does_not_use_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    """A probe found these ignored with exit 0 (`--peers --shapes 16x16x16 --ops linear` timed
    1024² quantize)."""
    out = tmp_path / "x.csv"
    err = _cli_error(capsys, ["--tiny", "--out", str(out), *argv])
    assert expected in err and err.count("\n") == 1, err
    assert not out.exists()


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
    argv = ["--tiny", "--out", str(other)] + (["--peers"] if peers else ["--ops", "matmul"])
    err = _cli_error(capsys, argv)
    assert str(other) in err and "another header" in err and "name, value" in err
    assert "new file" in err
    assert other.read_text() == "name,value\na,1\n"


def test_nothing_measured_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if native_fp4_status("cpu")[0]:
        pytest.skip("native FP4 runs here")
    out = tmp_path / "x.csv"
    code = bench.main(["--tiny", "--out", str(out), "--backends", "native", "--ops", "linear"])
    err = capsys.readouterr().err
    assert code != 0
    assert "nothing was measured" in err and "linear/native skipped" in err
    assert "--backends emulation" in err
    assert not out.exists()


def test_unknown_backend_lists_plain_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """issue 19: the accepted backends print as plain strings, never enum reprs."""
    err = _cli_error(capsys, ["--tiny", "--out", str(tmp_path / "x.csv"), "--backends", "bogus"])
    assert "unknown backend(s) 'bogus'; accepted values: 'emulation', 'w4a16', 'native'" in err
    assert "Backend." not in err and "<" not in err
