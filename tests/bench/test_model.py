"""``nvfp4lab bench --model``: SmolLM2's forward pass timed float / W4A16 / W4A4 (the runner on
the session's SmolLM2, its rows in the store, and the command line around it)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from nvfp4lab.bench import command, store
from nvfp4lab.bench import model as bench_model
from nvfp4lab.bench.timing import Timing
from nvfp4lab.execution.layers import NVFP4Linear


def test_forward_of_the_three_copies(
    smollm2: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("NVFP4LAB_FUSED", raising=False)
    model, tokenizer = smollm2
    results = bench_model.run_forward(
        tokens=8, warmup=0, repeats=1, model=model, tokenizer=tokenizer
    )
    assert [r.impl for r in results] == list(bench_model.MODEL_IMPLS)
    linear_elements = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    for r in results:
        assert r.tokens == 8 and r.dtype == "float32" and r.timing.repeats == 1
        assert r.path == ("" if r.impl == bench_model.FLOAT_IMPL else "default")
        assert r.flops == 2 * 8 * linear_elements
        assert r.tokens_per_s == pytest.approx(8 / r.timing.median_s)
    # the caller's model is copied, never quantized in place
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())
    shard = tmp_path / "x.csv"
    store.append_rows(shard, bench_model.forward_rows(results, store.environment(), seed=3))
    frame = store.read_shards(tmp_path)
    assert list(frame["op"]) == ["forward"] * 3
    assert list(frame["backend"]) == list(bench_model.MODEL_IMPLS)
    assert set(frame["shape"]) == {"smollm2-135m+8"} and set(frame["M"]) == {8}
    assert list(frame["path"].fillna("")) == ["", "default", "default"]
    with pytest.raises(ValueError, match="fewer than tokens=10000000"):
        bench_model.run_forward(tokens=10_000_000, model=model, tokenizer=tokenizer)


def test_settings_path_follows_the_fused_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for mode, path in (("auto", "default"), ("on", "fused"), ("off", "eager")):
        monkeypatch.setenv("NVFP4LAB_FUSED", mode)
        assert bench_model.settings_path() == path


def fake_results(**kwargs: Any) -> list[bench_model.ForwardResult]:
    times = {"torch": 1.0, "w4a16": 1.25, "emulation": 1.5}
    return [
        bench_model.ForwardResult(
            name,
            kwargs["tokens"],
            kwargs["dtype"],
            "" if name == "torch" else "default",
            1e9,
            Timing((t, t), 1, 0, "perf_counter", "cpu"),
        )
        for name, t in times.items()
    ]


def test_command_prints_ratios_and_appends_rows(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(command, "run_forward", fake_results)
    out = tmp_path / "m.csv"
    assert command.main(["--model", "--quick", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "smollm2-135m forward of 128 tokens on cpu" in text
    assert "1.25x" in text and "1.50x" in text and "appended 3 rows" in text
    frame = store.read_shards(tmp_path)
    assert list(frame["median_s"]) == [1.0, 1.25, 1.5]


def test_command_refuses_bad_settings(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = str(tmp_path / "m.csv")
    for argv, message in (
        (["--model", "--peers"], "two different runs"),
        (["--model", "--dtypes", "int8"], "--dtypes"),
        (["--model", "--repeats", "0"], "--repeats 0"),
    ):
        assert command.main([*argv, "--out", out]) == 2
        assert message in capsys.readouterr().err
    assert not Path(out).exists()
    assert command.run_cli(argparse.Namespace(model=True, peers=True)) == 2
