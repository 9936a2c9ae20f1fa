"""`nvfp4lab report` talks while it runs: a line per notebook as it starts and ends, printed
before the command ends, progress of the running ones, and no progress bar on a page."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from nvfp4lab.report import schedule
from nvfp4lab.report.runner import Headline
from nvfp4lab.report.talk import Progress, result_line
from tests import processes

PARAMS = "SEED = 0\nGO = ''\nWAIT_FOR_GO = {}"
# 02 waits (60 s at most) for the file GO, which the test writes only once it has READ 01's
# "ok" line from the command's stdout: a runner printing at the end would leave it waiting.
BODY = """
import os, pathlib, time, torch
from tqdm import tqdm
start = time.time()
while WAIT_FOR_GO and not pathlib.Path(GO).exists() and time.time() - start < 60:
    time.sleep(0.05)
# once 01 ended, its core comes to 02 within this running cell (up to 30 s allowed)
want = min(2, len(os.sched_getaffinity(0))) if WAIT_FOR_GO else 1
while torch.get_num_threads() < want and time.time() - start < 90:
    time.sleep(0.05)
in_cell = torch.get_num_threads()
for _ in tqdm(range(3), desc="a bar no page may show"):
    pass
""", """
from nvfp4lab.report import headline
headline("saw_go", int(pathlib.Path(GO).exists()))
headline("threads", torch.get_num_threads())
headline("in_cell", in_cell)
"""


def _notebooks(folder: Path) -> Path:
    folder.mkdir()
    for name, waits in (("01_first", False), ("02_waits", True)):
        cells = [new_code_cell(PARAMS.format(waits), metadata={"tags": ["parameters"]}),
                 *(new_code_cell(body) for body in BODY)]
        nb = new_notebook(cells=cells, metadata={"kernelspec": {
            "name": "python3", "language": "python", "display_name": "Python 3"}})
        nbformat.write(nb, folder / f"{name}.ipynb")
    return folder


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_cli_prints_each_start_and_end_as_it_happens(tmp_path: Path) -> None:
    nbs, out, go = _notebooks(tmp_path / "nbs"), tmp_path / "out", tmp_path / "go"
    # 02 waits for the go; 01 is expected longer (the record), so it starts first
    out.mkdir()
    schedule.record_times(out, {"GO": str(go)}, {"01_first": 50.0, "02_waits": 5.0})
    proc = processes.cli(["report", "--notebook-dir", str(nbs), "--out", str(out),
                          "--jobs", "2", "-p", f"GO={go}"], tmp_path)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.lstrip().startswith("ok  01_first"):
                assert proc.poll() is None  # printed while 02 still runs
                go.touch()
        err = proc.stderr.read() if proc.stderr else ""
        proc.wait(60)
    finally:
        processes.stop(proc)
    assert proc.returncode == 0, (lines, err)
    starts = [i for i, s in enumerate(lines) if s.startswith("start ")]
    ends = [i for i, s in enumerate(lines) if s.lstrip().startswith("ok ")]
    assert [lines[i].split()[1] for i in starts] == ["01_first", "02_waits"]
    assert [lines[i].split()[1] for i in ends] == ["01_first", "02_waits"]
    assert starts[1] < ends[0] and "about 50 s" in lines[starts[0]]  # side by side, as recorded
    assert "saw_go = 1" in lines[ends[1]]  # 02 went on because the test read 01's line early
    assert lines[-1].startswith("2 of 2 notebooks ok in ") and err == ""
    for name in ("01_first", "02_waits"):
        executed = json.loads((out / f"{name}.ipynb").read_text())
        streams = [o for c in executed["cells"] for o in c.get("outputs", [])
                   if o.get("output_type") == "stream"]
        assert streams == [], streams  # the tqdm bar drew nothing into the page
        assert 'data-mime-type="application/vnd.jupyter.stderr"' not in (
            out / f"{name}.html").read_text()
    if schedule.available_cores() >= 2:
        # 02 ran alone at the end: the core 01 freed came to it within its running cell
        assert any(s.strip() == "02_waits: now 2 threads (the others ended)" for s in lines)
        assert "threads = 2; in_cell = 2" in lines[ends[1]], lines
    record = json.loads((out / schedule.TIMES_NAME).read_text())
    assert set(next(iter(record.values()))) == {"01_first", "02_waits"}


def _result(name: str, status: str = "ok", error: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(name=name, status=status, duration_s=12.34, error=error,
                           headlines={"h": Headline("h", 1.5, "dB")})


def test_progress_lines_off_a_terminal() -> None:
    stream = io.StringIO()
    with Progress(stream, live=False, every_s=0.05) as progress:
        progress.started("07_llm", 1, 180.0)
        progress.started("01_tour", 1)
        progress.cell("07_llm", 3, 12)
        time.sleep(0.3)
        progress.finished(_result("01_tour", "failed", "ValueError: x"))
        progress.threads("07_llm", 2)
        progress.finished(_result("07_llm"))
    lines = stream.getvalue().splitlines()
    assert lines[:2] == ["start   07_llm  (1 thread, about 180 s)", "start   01_tour  (1 thread)"]
    status = [s for s in lines if s.startswith("running: ")]
    assert status and "07_llm 3/12 cells" in status[0] and "01_tour" in status[0]
    tail = [s for s in lines if not s.startswith("running: ")][2:]
    assert tail == ["failed  01_tour    12.3 s  [h = 1.5 dB]", "        ValueError: x",
                    "        07_llm: now 2 threads (the others ended)",
                    "    ok  07_llm    12.3 s  [h = 1.5 dB]"]
    assert result_line(_result("x")) == "    ok  x    12.3 s  [h = 1.5 dB]"
    assert progress.reported == {"01_tour", "07_llm"}


def test_progress_on_a_terminal_redraws_one_status_line() -> None:
    stream = io.StringIO()
    with Progress(stream, live=True) as progress:
        assert progress.every_s == 1.0
        progress.started("07_llm", 2)
        progress.cell("07_llm", 1, 4)
        progress.finished(_result("07_llm"))
    text = stream.getvalue()
    # each event line is written over the status line (cleared first), which is redrawn
    assert text.startswith("start   07_llm  (2 threads)\nrunning: 07_llm 0 s")
    assert "\r\x1b[K    ok  07_llm" in text and text.endswith("\n")
