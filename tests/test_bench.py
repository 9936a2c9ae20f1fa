"""Benchmark harness and results store (nvfp4lab.bench). Rows are checked for shape and sanity,
never for speed."""

from __future__ import annotations

import argparse
import csv
import math
import re
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
