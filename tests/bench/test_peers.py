"""Peers: compressed-tensors / torchao quantize timed beside nvfp4lab, bit-exact checks."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from nvfp4lab.bench import command as bench
from nvfp4lab.bench import peers, runner, store


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def test_run_peers_is_bit_exact_with_ct_convention() -> None:
    results, notes = peers.run_peers([(32, 64)], repeats=1)
    by = {r.impl: r for r in results}
    assert by["nvfp4lab[compressed-tensors]"].matches_ct is True
    assert by["compressed-tensors"].speedup_vs_ct == 1.0
    assert 0.9 < by["nvfp4lab[kernel]"].code_agreement <= 1.0
    assert all(r.median_s > 0 for r in results)
    assert isinstance(notes, list)


def test_peers_time_on_the_requested_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from nvfp4lab.bench import timing

    seen: list[object] = []
    real = timing.time_interleaved

    def spy(fns: dict, **kwargs: object) -> dict:
        seen.append(kwargs.get("device"))
        return real(fns, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(timing, "time_interleaved", spy)
    results, _ = peers.run_peers([(32, 64)], repeats=1, device="cpu")
    assert seen == ["cpu"]
    assert {r.device for r in results} == {"cpu"} and {r.timer for r in results} == {"perf_counter"}
    rows = peers.peer_rows(results, store.environment("cpu"), 0)
    assert {r["timer"] for r in rows} == {"perf_counter"} and {r["device"] for r in rows} == {"cpu"}
    with pytest.raises(ValueError, match="--repeats 0"):
        peers.run_peers([(32, 64)], repeats=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peers_on_cuda_use_cuda_events(tmp_path: Path) -> None:
    results, _ = peers.run_peers([(256, 256)], repeats=2, device="cuda")
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

    monkeypatch.setattr(peers, "_torchao_quantizer", lambda: to_nvfp4)
    results, notes = peers.run_peers([(32, 64)], repeats=2, warmup=0)
    assert "torchao" in {r.impl for r in results}
    x = runner.seeded_randn((32, 64), torch.bfloat16, 0)
    expected = x.abs().amax().float() / 2688.0
    assert scales and all(s is not None and torch.equal(s, expected) for s in scales)
    assert not any("torchao" in n for n in notes)


def test_torchao_without_per_tensor_scale_or_failing_is_noted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(peers, "_torchao_quantizer", lambda: lambda data_hp: data_hp)
    results, notes = peers.run_peers([(32, 64)], repeats=1)
    assert "torchao" in {r.impl for r in results}
    assert any("no per_tensor_scale" in n and "not like for like" in n for n in notes)

    def broken(data_hp: torch.Tensor, per_tensor_scale: object = None) -> object:
        raise NotImplementedError("no CPU kernel")

    monkeypatch.setattr(peers, "_torchao_quantizer", lambda: broken)
    results, notes = peers.run_peers([(32, 64)], repeats=1)
    assert "torchao" not in {r.impl for r in results}
    assert any("failed" in n and "no CPU kernel" in n and "skipped" in n for n in notes)
