"""The one timing helper (nvfp4lab.timing). No assertion here is about speed."""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4lab.bench import timing
from nvfp4lab.bench.timing import (
    SPREAD_KIND,
    Timing,
    quantile,
    stopwatch,
    time_fn,
    time_interleaved,
)


def test_quantile_matches_linear_interpolation() -> None:
    data = [4.0, 1.0, 3.0, 2.0]
    assert quantile(data, 0.0) == 1.0
    assert quantile(data, 1.0) == 4.0
    assert quantile(data, 0.5) == 2.5
    assert quantile(data, 0.25) == pytest.approx(1.75)
    with pytest.raises(ValueError):
        quantile([], 0.5)
    with pytest.raises(ValueError):
        quantile(data, 1.5)


def test_timing_summary() -> None:
    t = Timing((1.0, 2.0, 3.0, 4.0, 100.0), number=1, warmup=0, method="perf_counter", device="cpu")
    assert t.repeats == 5
    assert t.median_s == 3.0
    assert t.iqr_s == pytest.approx(4.0 - 2.0)
    assert t.spread_s == t.iqr_s
    assert (t.min_s, t.max_s) == (1.0, 100.0)
    d = t.as_dict()
    assert d["spread_kind"] == SPREAD_KIND == "iqr"
    assert d["median_s"] == 3.0


def test_time_fn_counts_calls_and_reports_positive_times() -> None:
    calls = []
    t = time_fn(lambda: calls.append(1), warmup=2, repeats=5, number=3)
    assert len(calls) == 2 + 5 * 3
    assert t.repeats == 5 and t.number == 3 and t.warmup == 2
    assert t.method == "perf_counter" and t.device == "cpu"
    assert all(math.isfinite(s) and s >= 0 for s in t.samples)


def test_time_fn_calibrates_number_for_tiny_calls() -> None:
    x = torch.randn(8)
    t = time_fn(lambda: x.add(1), repeats=3, min_sample_s=2e-3)
    assert t.number > 1  # a few microseconds per call -> many calls per sample
    assert t.warmup >= 1
    assert t.median_s > 0


@pytest.mark.parametrize("kwargs", [{"repeats": 0}, {"warmup": -1}, {"number": 0}])
def test_time_fn_rejects_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        time_fn(lambda: None, **kwargs)


def test_time_interleaved_round_robin() -> None:
    order: list[str] = []
    out = time_interleaved(
        {"a": lambda: order.append("a"), "b": lambda: order.append("b")}, warmup=1, repeats=3
    )
    assert order == ["a", "b"] * 4
    assert set(out) == {"a", "b"}
    assert all(t.repeats == 3 and t.number == 1 for t in out.values())


def _fake_clock(readings: list[float]):
    it = iter(readings)
    return lambda: next(it)


def test_stopwatch_reads_both_clocks_once_each_side(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing.time, "perf_counter", _fake_clock([10.0, 12.5]))
    monkeypatch.setattr(timing.time, "process_time", _fake_clock([3.0, 7.25]))
    with stopwatch() as sw:
        assert math.isnan(sw.wall_s) and math.isnan(sw.cpu_s)  # not measured yet
    assert (sw.wall_s, sw.cpu_s) == (2.5, 4.25)


def test_stopwatch_records_a_step_that_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing.time, "perf_counter", _fake_clock([1.0, 1.75]))
    monkeypatch.setattr(timing.time, "process_time", _fake_clock([0.0, 0.5]))
    with pytest.raises(ZeroDivisionError), stopwatch() as sw:
        _ = 1 / 0
    assert (sw.wall_s, sw.cpu_s) == (0.75, 0.5)


def test_stopwatch_on_the_real_clocks() -> None:
    with stopwatch() as sw:
        sum(range(1000))
    assert math.isfinite(sw.wall_s) and sw.wall_s >= 0 and math.isfinite(sw.cpu_s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_time_fn_uses_cuda_events_on_gpu() -> None:
    a = torch.randn(256, 256, device="cuda")
    t = time_fn(lambda: a @ a, repeats=3, device="cuda")
    assert t.method == "cuda_events"
    assert t.median_s > 0
