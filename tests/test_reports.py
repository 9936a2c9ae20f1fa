"""The report runner (nvfp4lab.report.runner, its output folder nvfp4lab.report.outputs) and
the `nvfp4lab report` CLI.

Executing a notebook costs a kernel start (seconds), so the tiny notebooks run once per module.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
from pathlib import Path

import nbformat
import psutil
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from nvfp4lab import cli
from nvfp4lab.report import outputs as report_outputs
from nvfp4lab.report import runner
from nvfp4lab.report.runner import Headline, ReportResult
from nvfp4lab.report.schedule import TIMES_NAME

ROOT = Path(__file__).resolve().parent.parent

PARAMS = 'SEED = 0  # seed\nSMOKE = False  # fast\nINTERACTIVE = False  # widgets\nLABEL = "demo"'

GOOD_BODY = """
import os, sys
import matplotlib.pyplot as plt
from nvfp4lab.report import headline

fig, ax = plt.subplots()
ax.plot([0, 1, 2], [0, SEED, 1])
ax.set(title=LABEL, xlabel="x (units)", ylabel="y (units)")
headline("answer", 42.5, unit="widgets")
headline("seed", SEED)
headline("smoke", SMOKE)
headline("python", sys.executable)
headline("cwd", os.path.basename(os.getcwd()))
"""

BAD_BODY = 'raise RuntimeError("boom: <b>not bold</b>")'


def _write_notebook(path: Path, body: str, params: str = PARAMS) -> Path:
    cells = [new_markdown_cell(f"# {path.stem}")]
    if params is not None:
        cell = new_code_cell(params)
        cell.metadata["tags"] = ["parameters"]
        cells.append(cell)
    cells.append(new_code_cell(body))
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def notebook_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("nbs")
    _write_notebook(folder / "01_good.ipynb", GOOD_BODY)
    _write_notebook(folder / "02_bad.ipynb", BAD_BODY)
    (folder / "scratch.ipynb").write_text("not a report notebook")  # ignored: no NN_ prefix
    return folder


#: os.chdir calls to another folder than the process's own, made while the ``run`` fixture's
#: notebooks ran (jobs side by side, threads); papermill's file I/O re-enters the current one.
CHDIRS: list[object] = []


@pytest.fixture(scope="module")
def run(notebook_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("reports")
    with pytest.MonkeyPatch.context() as patch:
        real, here = os.chdir, Path.cwd()
        patch.setattr(os, "chdir", lambda path: (Path(path).resolve() != here.resolve()
                                                 and CHDIRS.append(path)) or real(path))
        results = runner.run_reports(
            out_dir=out, parameters={"SEED": 3}, smoke=True, notebook_dir=notebook_dir, jobs=2
        )
    return out, {r.name: r for r in results}


def test_unknown_parameter_raises_before_running(notebook_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(ValueError) as info:
        runner.run_reports(out_dir=out, parameters={"SEEED": 1}, notebook_dir=notebook_dir)
    message = str(info.value)
    assert "01_good.ipynb" in message and "SEEED" in message
    for known in ("SEED", "SMOKE", "INTERACTIVE", "LABEL"):
        assert known in message
    assert not out.exists()


def test_notebook_without_parameters_cell_is_rejected(tmp_path: Path) -> None:
    _write_notebook(tmp_path / "01_plain.ipynb", "x = 1", params=None)
    with pytest.raises(ValueError, match=r"01_plain\.ipynb.*parameters"):
        runner.run_reports(out_dir=tmp_path / "out", notebook_dir=tmp_path, smoke=True)


def test_notebook_parameters_reads_names_and_defaults(notebook_dir: Path) -> None:
    params = runner.notebook_parameters(notebook_dir / "01_good.ipynb")
    assert params == {"SEED": "0", "SMOKE": "False", "INTERACTIVE": "False", "LABEL": '"demo"'}


def test_discover_and_select(notebook_dir: Path) -> None:
    found = runner.discover_notebooks(notebook_dir)
    assert [p.name for p in found] == ["01_good.ipynb", "02_bad.ipynb"]
    for key in ("01", "01_good", "good", str(notebook_dir / "01_good.ipynb")):
        assert runner._resolve([key], notebook_dir) == [notebook_dir / "01_good.ipynb"]
    with pytest.raises(ValueError, match="matches no notebooks; available: 01_good, 02_bad"):
        runner._resolve(["03"], notebook_dir)


def test_failing_notebook_does_not_stop_the_next(run) -> None:
    out, results = run
    assert list(results) == ["01_good", "02_bad"]
    good, bad = results["01_good"], results["02_bad"]
    assert good.ok and good.error is None
    assert bad.status == "failed"
    assert "RuntimeError" in bad.error and "boom" in bad.error
    for r in (good, bad):
        assert r.html_path == out / f"{r.name}.html" and r.html_path.is_file()
        assert r.ipynb_path == out / f"{r.name}.ipynb" and r.ipynb_path.is_file()
        assert r.duration_s > 0
    # the partial notebook is rendered for diagnosis, traceback included
    assert "boom" in bad.html_path.read_text()


def test_parameters_reach_the_kernel_and_it_runs_this_python(run, notebook_dir: Path) -> None:
    _, results = run
    heads = results["01_good"].headlines
    assert heads["answer"] == Headline("answer", 42.5, "widgets")
    assert heads["seed"].value == 3
    assert heads["smoke"].value == 1  # SMOKE=True injected by smoke=True (bools stored as int)
    assert Path(heads["python"].value).resolve() == Path(sys.executable).resolve()
    assert heads["cwd"].value == notebook_dir.name  # the kernel runs in the notebook's folder
    # ... without moving the process: two jobs' threads raced on papermill's cwd= (an os.chdir)
    assert CHDIRS == []
    assert results["01_good"].parameters == {"SEED": 3, "SMOKE": True, "INTERACTIVE": False}


def test_a_cell_ending_in_headline_shows_the_headline_once(run) -> None:
    """The fixture's cell ends in a bare ``headline(...)`` call: its outputs are the five
    headline displays and the figure, with no ``Out[n]: Headline(...)`` echo after them."""
    out, _ = run
    nb = nbformat.read(out / "01_good.ipynb", as_version=4)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert [o["output_type"] for o in outputs if o["output_type"] == "execute_result"] == []
    shown = [o["data"]["text/plain"] for o in outputs if runner.HEADLINE_MIME in o.get("data", {})]
    assert len(shown) == 5 and shown[-1].startswith("headline: cwd = ")
    assert "Headline(" not in (out / "01_good.html").read_text()


def test_html_embeds_figures(run) -> None:
    _, results = run
    page = results["01_good"].html_path.read_text()
    assert "data:image/png;base64," in page
    assert "headline: answer = 42.5 widgets" in page


def test_index_lists_every_notebook_with_status(run) -> None:
    out, _ = run
    index = (out / "index.html").read_text()
    assert '<a href="01_good.html">01_good</a>' in index
    assert '<a href="02_bad.html">02_bad</a>' in index
    assert '<td class="ok">ok</td>' in index and '<td class="failed">failed</td>' in index
    assert "answer: <b>42.5 widgets</b>" in index
    assert "failed: 02_bad" in index
    assert "<b>not bold</b>" not in index  # error text is escaped
    assert "&lt;b&gt;not bold&lt;/b&gt;" in index


def test_headline_outside_ipython_only_returns(capsys: pytest.CaptureFixture[str]) -> None:
    record = runner.headline("x", float("nan"), unit="dB")
    assert record == Headline("x", "nan", "dB")
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError):
        runner.headline("  ", 1.0)
    with pytest.raises(TypeError):
        runner.headline("x", [1, 2])


# -- CLI -------------------------------------------------------------------------------------


def test_parse_assignment() -> None:
    assert cli.parse_assignment("ROWS=64") == ("ROWS", 64)
    assert cli.parse_assignment("SMOKE=True") == ("SMOKE", True)
    assert cli.parse_assignment("NAME=hello world") == ("NAME", "hello world")
    assert cli.parse_assignment("EPS=1e-3") == ("EPS", 1e-3)
    with pytest.raises(Exception, match="NAME=VALUE"):
        cli.parse_assignment("oops")


def test_cli_report_unknown_parameter_exits_2(
    notebook_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["report", "--notebook-dir", str(notebook_dir), "--out", str(tmp_path),
                     "-p", "NOPE=1"])
    assert code == 2
    assert "NOPE" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# The output folder: a run never replaces a file it did not write (a probe of the CLI found
# `--out` = the notebooks' folder overwriting the notebooks, and a user's index.html replaced).


def test_the_notebooks_own_folder_is_refused(notebook_dir: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "nbs"
    folder.mkdir()
    source = _write_notebook(folder / "01_good.ipynb", GOOD_BODY)
    before = source.read_bytes()
    for argv in ([], ["--overwrite"]):
        code = cli.main(["report", "--notebook-dir", str(folder), "--out", str(folder), *argv])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        assert "holds the notebooks being run" in err and "01_good.ipynb" in err
    assert source.read_bytes() == before and sorted(folder.iterdir()) == [source]


def test_a_users_files_are_refused_unless_overwrite(notebook_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "site"
    out.mkdir()
    (out / "index.html").write_text("<h1>my site</h1>")
    (out / "02_bad.ipynb").write_text("my notes")
    code = cli.main(["report", "--notebook-dir", str(notebook_dir), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "02_bad.ipynb, index.html" in err and "--overwrite" in err
    assert (out / "index.html").read_text() == "<h1>my site</h1>"
    assert sorted(p.name for p in out.iterdir()) == ["02_bad.ipynb", "index.html"]
    paths = runner.discover_notebooks(notebook_dir)
    report_outputs.check_outputs(out, paths, index=True, overwrite=True)  # the flag lets it through
    (out / "01_good.html").mkdir()  # a folder in the way: never replaced
    with pytest.raises(ValueError, match=r"01_good\.html is a folder"):
        report_outputs.check_outputs(out, paths, index=True, overwrite=True)


def test_an_earlier_runs_pages_are_replaced(run, notebook_dir: Path, tmp_path: Path) -> None:
    out, _ = run
    paths = runner.discover_notebooks(notebook_dir)
    names = ["01_good.html", "01_good.ipynb", "02_bad.html", "02_bad.ipynb", "index.html"]
    assert (out / report_outputs.MANIFEST_NAME).read_text().split() == names
    report_outputs.check_outputs(out, paths, index=True, overwrite=False)
    # a folder of pages written before the list existed: recognised by their content
    old = tmp_path / "old"
    old.mkdir()
    for name in names:
        (old / name).write_bytes((out / name).read_bytes())
    report_outputs.check_outputs(old, paths, index=True, overwrite=False)
    (old / "02_bad.html").write_text("<title>02_bad</title> kept by hand")  # still a page
    report_outputs.check_outputs(old, paths, index=True, overwrite=False)
    (old / "01_good.ipynb").write_text('{"metadata": {}}')  # not an executed 01_good
    with pytest.raises(ValueError, match=r"already holds 01_good\.ipynb, not written"):
        report_outputs.check_outputs(old, paths, index=True, overwrite=False)


@pytest.mark.parametrize(
    ("assignment", "expected"),
    [
        ("SMOKE=false", "parameter SMOKE is True or False (default False), got 'false'; "
                        "pass e.g. -p SMOKE=True"),
        ("SEED=abc", "parameter SEED is an integer (default 0), got 'abc'"),
        ("SEED=2.5", "parameter SEED is an integer (default 0), got 2.5"),
        ("SEED=True", "parameter SEED is an integer (default 0), got True"),
        ("LABEL=5", "parameter LABEL is a string (default \"demo\"), got 5; pass e.g. "
                    "-p LABEL='text'"),
    ],
)
def test_a_parameter_of_another_kind_is_one_line(
    notebook_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], assignment: str,
    expected: str,
) -> None:
    """A probe found `-p SMOKE=false` running smoke mode (the string 'false' is true) and
    `-p ROWS=abc` failing inside the notebook; the kind of the notebook's default decides."""
    out = tmp_path / "out"
    code = cli.main(["report", "--notebook-dir", str(notebook_dir), "--out", str(out),
                     "-p", assignment])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and expected in err and "01_good.ipynb" in err, err
    assert not out.exists()


def test_a_parameter_of_the_defaults_kind_passes(notebook_dir: Path, tmp_path: Path) -> None:
    path = notebook_dir / "01_good.ipynb"
    runner.check_parameters(path, {"SMOKE": True, "SEED": 7, "LABEL": "x", "INTERACTIVE": False})
    timed = _write_notebook(tmp_path / "03_timed.ipynb", "pass", TIMED_PARAMS)
    runner.check_parameters(timed, {"WAIT": 2})  # an int where the default is a float


def test_cli_report_names_failed_notebooks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = {}

    def fake_run_reports(**kwargs):
        seen.update(kwargs)
        return [
            ReportResult("01_a", tmp_path / "01_a.ipynb", "ok", 1.0, None, None,
                         headlines={"h": Headline("h", 1.5, "dB")}),
            ReportResult("02_b", tmp_path / "02_b.ipynb", "failed", 2.0, None, None,
                         error="ValueError: x"),
        ]

    monkeypatch.setattr(runner, "run_reports", fake_run_reports)
    code = cli.main(["report", "--smoke", "-p", "ROWS=8", "--only", "01", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 1
    assert "failed notebooks: 02_b" in captured.err
    assert "h = 1.5 dB" in captured.out
    assert seen["smoke"] is True and seen["parameters"] == {"ROWS": 8}
    assert seen["notebooks"] == ["01"]


# --------------------------------------------------------------------------------------------
# Issue 19, case D (issue case 11): Ctrl-C during `nvfp4lab report` used to delete the previous
# page first, leave a partial notebook, keep an index saying "ok" that linked the deleted page,
# and print a 72-line traceback. Now pages are renamed into place only once complete: the old
# page stays, the index says "interrupted", no partial file, one line, exit 130.

SLOW_PARAMS = "SEED = 0\nSMOKE = False\nINTERACTIVE = False\nWAIT = 0\nMARKER = ''"
SLOW_BODY = """
import os, pathlib, time
if MARKER:
    pathlib.Path(MARKER).write_text(str(os.getpid()))
time.sleep(WAIT)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_keeps_the_previous_page_and_the_index_says_interrupted(tmp_path: Path) -> None:
    import os
    import signal

    from tests import processes

    nbs, out = tmp_path / "nbs", tmp_path / "out"
    nbs.mkdir()
    _write_notebook(nbs / "01_slow.ipynb", SLOW_BODY, SLOW_PARAMS)
    (first,) = runner.run_reports(notebook_dir=nbs, out_dir=out)
    assert first.ok, first.error
    pages = ("index.html", report_outputs.MANIFEST_NAME, TIMES_NAME)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name not in pages}
    assert sorted(before) == ["01_slow.html", "01_slow.ipynb"]
    marker = tmp_path / "kernel.pid"
    proc = processes.cli(["report", "--notebook-dir", str(nbs), "--out", str(out), "-p",
                          "WAIT=120", "-p", f"MARKER={marker}"], tmp_path, start_new_session=True)
    try:
        processes.wait_for(marker.exists, "the notebook's cell to run", timeout=120)
        kernel = int(processes.wait_for(marker.read_text, "the kernel's pid"))
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C (the kernel has its own)
        _, err = proc.communicate(timeout=60)
    finally:
        processes.stop(proc)
    assert proc.returncode == 130, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvfp4lab report: interrupted"), err
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.name not in pages}
    assert after == before  # the previous pages, untouched; no partial file
    index = (out / "index.html").read_text()
    assert '<td class="interrupted">interrupted</td>' in index and ">ok<" not in index
    assert 'href="01_slow.html"' in index and "from an earlier run" in index
    processes.wait_for(lambda: not psutil.pid_exists(kernel), "the kernel to end", timeout=20)


# --------------------------------------------------------------------------------------------
# Issue 20: notebooks side by side (`--jobs`, default one per core), each kernel with the
# settings' torch threads; the index keeps the notebooks' order; one Ctrl-C stops them all.

TIMED_PARAMS = ("SEED = 0\nSMOKE = False\nINTERACTIVE = False\nWAIT = 0.0\nSTAMPS = ''\n"
                "PARTNERS = 0")
TIMED_BODY = """
import os, pathlib, time, torch
from nvfp4lab.report import headline
start, ended = time.time(), 0
if STAMPS:  # <pid>.start now; wait until PARTNERS notebooks have started; <pid>.end at the end
    stamps = pathlib.Path(STAMPS)
    ended = len(list(stamps.glob("*.end")))
    (stamps / f"{os.getpid()}.start").write_text(str(start))
    deadline = start + 60
    while len(list(stamps.glob("*.start"))) < PARTNERS and time.time() < deadline:
        time.sleep(0.01)
time.sleep(WAIT)
headline("threads", torch.get_num_threads())
headline("window", f"{start} {time.time()}")
headline("ended_before", ended)
if STAMPS:
    (stamps / f"{os.getpid()}.end").touch()
"""


def _timed_notebooks(folder: Path, count: int) -> Path:
    folder.mkdir()
    for i in range(1, count + 1):
        _write_notebook(folder / f"{i:02d}_timed.ipynb", TIMED_BODY, TIMED_PARAMS)
    return folder


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_jobs_run_notebooks_side_by_side_in_order(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVFP4LAB_THREADS", "1")
    nbs, stamps = _timed_notebooks(tmp_path / "nbs", 3), tmp_path / "stamps"
    stamps.mkdir()
    # 01 and 02 each wait (up to 60 s) until two notebooks have started: only side by side do
    # they see each other at once; 03 counts the notebooks that had ended when it started
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        results = runner.run_reports(notebook_dir=nbs, out_dir=tmp_path / "out", jobs=2,
                                     parameters={"WAIT": 0.2, "STAMPS": str(stamps),
                                                 "PARTNERS": 2})
        gc.collect()  # each job thread's asyncio loop is closed, not left to the collector
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], caught
    assert [r.name for r in results] == ["01_timed", "02_timed", "03_timed"]
    assert all(r.ok for r in results), [r.error for r in results]
    assert {r.headlines["threads"].value for r in results} == {1}
    windows = [tuple(map(float, r.headlines["window"].value.split())) for r in results]
    (s1, e1), (s2, e2), (s3, _) = windows
    assert s2 < e1 and s1 < e2  # 01 and 02 ran at the same time
    assert e1 - s1 < 30 and e2 - s2 < 30  # and found each other, not the 60 s deadline
    ended = [r.headlines["ended_before"].value for r in results]
    assert ended[:2] == [0, 0] and ended[2] >= 1  # 03 waited for a free job (2 at most)
    assert s3 >= min(e1, e2) - 0.5
    index = (tmp_path / "out" / "index.html").read_text()
    assert index.index("01_timed") < index.index("02_timed") < index.index("03_timed")


def test_bad_jobs_is_one_line_before_anything_runs(tmp_path: Path) -> None:
    nbs = _timed_notebooks(tmp_path / "nbs", 1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"--jobs must be a whole number >= 1.*got"):
            runner.run_reports(notebook_dir=nbs, out_dir=tmp_path / "out", jobs=bad)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_stops_every_notebook_running_side_by_side(tmp_path: Path) -> None:
    import os
    import signal

    from tests import processes

    nbs, out, stamps = _timed_notebooks(tmp_path / "nbs", 3), tmp_path / "out", tmp_path / "s"
    stamps.mkdir()
    proc = processes.cli(["report", "--notebook-dir", str(nbs), "--out", str(out), "--jobs", "2",
                          "-p", "WAIT=120", "-p", f"STAMPS={stamps}"], tmp_path,
                         start_new_session=True)
    try:
        processes.wait_for(lambda: len(list(stamps.glob("*.start"))) == 2,
                           "two notebooks to run", timeout=120)
        kernels = [int(p.stem) for p in stamps.glob("*.start")]
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        processes.stop(proc)
    assert proc.returncode == 130, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvfp4lab report: interrupted"), err
    index = (out / "index.html").read_text()
    assert index.count('<td class="interrupted">interrupted</td>') == 2
    assert index.count("not run") >= 1 and ">ok<" not in index
    # no partial file left; the folder's list of the runner's files stays
    assert sorted(p.name for p in out.iterdir()) == [report_outputs.MANIFEST_NAME, "index.html"]
    for pid in kernels:
        processes.wait_for(lambda pid=pid: not psutil.pid_exists(pid), "a kernel to end",
                           timeout=20)


@pytest.mark.slow
def test_report_runs_turn_explorers_off_unless_asked(tmp_path: Path) -> None:
    """Notebooks default to ``INTERACTIVE = True`` (a live session shows the explorer after the
    setup cell); the runner passes False unless the caller sets it."""
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    _write_notebook(nbs / "01_live.ipynb", 'from nvfp4lab.report import headline\n'
                    'headline("interactive", INTERACTIVE)', "INTERACTIVE = True  # explorer\n")
    (off,) = runner.run_reports(notebook_dir=nbs, out_dir=tmp_path / "a")
    (on,) = runner.run_reports(notebook_dir=nbs, out_dir=tmp_path / "b",
                               parameters={"INTERACTIVE": True})
    assert off.headlines["interactive"].value == 0 and on.headlines["interactive"].value == 1
    assert off.parameters == {"INTERACTIVE": False}


def test_the_default_notebooks_are_the_folder_beside_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run from a folder without ``notebooks/``, ``nvfp4lab report`` finds the checkout's own
    (it looked inside ``nvfp4lab/`` once the runner moved into ``nvfp4lab/report/``)."""
    monkeypatch.chdir(tmp_path)
    assert runner.default_notebook_dir() == ROOT / "notebooks"
    assert [p.name for p in runner.discover_notebooks()] == sorted(
        p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_every_notebook_explorer_is_on_for_a_live_session() -> None:
    for path in runner.discover_notebooks(ROOT / "notebooks"):
        assert runner.notebook_parameters(path).get("INTERACTIVE") == "True", path.name


_OLD_PATHS = """
import importlib, json, warnings
moved = {"reports": "runner", "report_kernels": "jupyter", "report_outputs": "outputs",
         "report_pages": "pages", "notebook_imports": "notebook_imports"}
found = {}
for old, new in moved.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = importlib.import_module("nvfp4lab." + old)
    module = importlib.import_module("nvfp4lab.report." + new)
    names = [n for n in vars(module) if not n.startswith("__")]
    found[old] = {
        "warned": [str(w.message) for w in caught if w.category is DeprecationWarning
                   and "nvfp4lab." + old in str(w.message)],
        "all": alias.__all__ == module.__all__,
        "differ": [n for n in names if getattr(alias, n) is not getattr(module, n)],
    }
print(json.dumps(found))
"""


def test_the_old_module_paths_are_deprecated_aliases_of_the_moved_ones() -> None:
    """``nvfp4lab.reports``, ``report_kernels``, ``report_outputs``, ``report_pages`` and
    ``notebook_imports`` (the runner's homes before ``nvfp4lab/report/``) still import, warn that
    they are deprecated, and hand on every name of the moved module, private ones included (a
    fresh interpreter, so that each import is a first one)."""
    import json
    import subprocess

    done = subprocess.run([sys.executable, "-c", _OLD_PATHS], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    moved = {"reports": "runner", "report_kernels": "jupyter", "report_outputs": "outputs",
             "report_pages": "pages", "notebook_imports": "notebook_imports"}
    assert set(found) == set(moved)
    for old, new in moved.items():
        assert found[old]["warned"] == [
            f"nvfp4lab.{old} is deprecated: import nvfp4lab.report.{new}"], old
        assert found[old]["all"] and found[old]["differ"] == [], (old, found[old])
