"""nvfp4lab.report.schedule: longest first, the cost table and the record, cores shared out."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nvfp4lab.report import schedule
from nvfp4lab.report.kernel_threads import read_threads, update_threads
from nvfp4lab.report.runner import discover_notebooks
from nvfp4lab.settings import thread_limit

ROOT = Path(__file__).resolve().parents[2]


def test_the_cost_table_covers_every_shipped_notebook() -> None:
    table = schedule.cost_table()
    stems = {p.stem for p in discover_notebooks(ROOT / "notebooks")}
    assert set(table) == stems, "measure the new notebook and add it to report/costs.json"
    assert all(seconds > 0 for seconds in table.values())
    # the shipped notebooks start longest first: 07 (the LLM study) before the rest
    paths = discover_notebooks(ROOT / "notebooks")
    expected = schedule.expected_seconds(paths, ROOT / "no-such-folder", {})
    assert schedule.launch_order(paths, expected)[0].stem == max(table, key=table.get)
    assert all(measured for _, measured in expected.values())  # defaults: the table applies


def test_the_record_wins_per_parameters_and_unknowns_default(tmp_path: Path) -> None:
    paths = [tmp_path / "01_a.ipynb", tmp_path / "02_b.ipynb", tmp_path / "03_c.ipynb"]
    table = {"01_a": 5.0, "02_b": 50.0}
    schedule.record_times(tmp_path, {"SMOKE": True}, {"01_a": 90.0, "02_b": 1.0})
    smoke = schedule.expected_seconds(paths, tmp_path, {"SMOKE": True}, table)
    assert smoke == {paths[0]: (90.0, True), paths[1]: (1.0, True),
                     paths[2]: (schedule.DEFAULT_COST_S, False)}
    assert [p.stem for p in schedule.launch_order(paths, smoke)] == ["01_a", "03_c", "02_b"]
    full = schedule.expected_seconds(paths, tmp_path, {}, table)  # not the smoke record
    assert full[paths[0]] == (5.0, True) and full[paths[1]] == (50.0, True)
    other = schedule.expected_seconds(paths, tmp_path, {"SEED": 1}, table)
    assert other[paths[1]] == (50.0, False)  # the table is of default runs: an estimate only
    # a later run adds to its own parameters' entry and keeps the others
    schedule.record_times(tmp_path, {"SMOKE": True}, {"03_c": 2.5})
    record = json.loads((tmp_path / schedule.TIMES_NAME).read_text())
    assert sorted(record[next(iter(record))]) == ["01_a", "02_b", "03_c"]
    (tmp_path / schedule.TIMES_NAME).write_text("{not json")  # a broken record is ignored
    assert schedule.expected_seconds(paths, tmp_path, {}, table)[paths[0]] == (5.0, True)


def _cores(tmp_path: Path, cores: int, jobs: int, pending: int, **kw: object
           ) -> tuple[schedule.Cores, list[tuple[str, int]]]:
    grown: list[tuple[str, int]] = []
    return schedule.Cores(cores, jobs, pending, folder=tmp_path,
                          changed=lambda s, n: grown.append((s, n)), **kw), grown


def test_cores_at_the_start_leave_one_per_notebook_starting_beside(tmp_path: Path) -> None:
    cores, grown = _cores(tmp_path, 2, 2, 7, expected={"07": 300.0})
    assert cores.take("07") == 1 and cores.take("01") == 1  # two side by side: one core each
    for before, stem in (("01", "02"), ("02", "03"), ("03", "04"), ("04", "05"), ("05", "06")):
        cores.release(before)
        assert cores.take(stem) == 1  # a notebook was left to start: the freed core is its
    assert grown == []
    cores.release("06")  # nothing left to start: 07 gets the freed core from its next cell
    assert grown == [("07", 2)] and cores.running == {"07": 2}
    assert read_threads(cores.file("07")) == 2
    alone, _ = _cores(tmp_path, 8, 1, 3)  # one at a time: every core for each
    assert alone.take("a") == 8
    many, _ = _cores(tmp_path, 16, 7, 7)  # shared out, the odd cores to the first (longest)
    assert [many.take(str(i)) for i in range(7)] == [3, 3, 2, 2, 2, 2, 2]


def test_freed_cores_go_to_the_notebook_with_most_time_left(tmp_path: Path) -> None:
    cores, grown = _cores(tmp_path, 4, 4, 4, expected={"long": 1000.0, "mid": 100.0,
                                                        "short": 5.0, "x": 1.0})
    assert [cores.take(s) for s in ("long", "mid", "short", "x")] == [1, 1, 1, 1]
    cores.release("x")
    assert grown == [("long", 2)]
    cores.release("short")
    assert grown[-1] == ("long", 3)  # 1000/2 per thread still beats 100/1
    assert cores.running == {"long": 3, "mid": 1}


def test_fixed_threads_are_never_shared_out(tmp_path: Path) -> None:
    cores, grown = _cores(tmp_path, 4, 2, 2, fixed=3)
    assert cores.take("a") == 3 and cores.take("b") == 3
    cores.release("a")
    assert grown == [] and cores.file("b") is None


def test_the_kernel_applies_the_threads_file(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    path = tmp_path / "k.threads"
    assert update_threads(path) is None  # no file yet: nothing changes
    for bad in ("", "x", "0", "100000"):
        path.write_text(bad)
        assert read_threads(path) is None
    before = torch.get_num_threads()
    target = 2 if before == 1 else 1
    if target > thread_limit():
        pytest.skip("one CPU: no other thread count to set")
    monkeypatch.setenv("NVFP4LAB_THREADS", str(before))
    try:
        path.write_text(f"{target}\n")
        assert update_threads(path) == target and torch.get_num_threads() == target
        assert os.environ["NVFP4LAB_THREADS"] == str(target)
    finally:
        torch.set_num_threads(before)
