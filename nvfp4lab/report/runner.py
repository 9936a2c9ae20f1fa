"""The report runner: execute the notebooks with papermill, render HTML, write an index.

``run_reports()`` (CLI: ``nvfp4lab report``) takes every ``notebooks/NN_*.ipynb``, starts them
longest first, side by side, each kernel with its share of the cores
(:mod:`nvfp4lab.report.schedule`), tells a listener as each starts, advances and ends
(:class:`ProgressListener`; :mod:`nvfp4lab.report.talk` prints it), and for each notebook:

1. reads the cell tagged ``parameters`` and checks every parameter passed in against the names
   it assigns (papermill only warns on a typo; we raise ValueError before running anything);
2. executes the notebook with papermill in a kernel running THIS Python interpreter
   (``sys.executable``; not whatever ``python3`` kernelspec Jupyter finds first), with the
   notebook's folder as working directory;
3. writes the executed copy to ``<out>/<name>.ipynb`` and renders ``<out>/<name>.html`` with
   nbconvert (:mod:`nvfp4lab.report.pages`: one self-contained file, no external script, no
   progress bar), under partial names renamed over the previous pages once complete;
4. keeps going past a failing notebook (its partial HTML is still written for diagnosis);
5. writes ``<out>/index.html``: status, duration and headline numbers of every notebook (after
   Ctrl-C: the running one ``interrupted``, its previous page kept; the rest ``not run``).

Headline numbers
----------------
A notebook publishes a number for the index page with::

    from nvfp4lab.report import headline
    headline("SQNR N(0,1)", 20.4, unit="dB")

which displays an output carrying the MIME type :data:`HEADLINE_MIME`
(``application/vnd.nvfp4lab.headline+json``: ``{"name", "value", "unit"}``) next to a
``text/plain`` line for human readers. The runner collects these outputs from the executed
notebook (the last value wins per name). Outside IPython ``headline`` only returns the record.
"""

from __future__ import annotations

import ast
import json
import math
import numbers
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from nvfp4lab.bench.timing import stopwatch
from nvfp4lab.report import schedule
from nvfp4lab.report.index_page import write_index
from nvfp4lab.report.jupyter import DEFAULT_TIMEOUT_S, Running, error_text, execute_notebook
from nvfp4lab.report.notebook_imports import skip_iri_format_backend
from nvfp4lab.report.outputs import check_out_dir, check_outputs, record_outputs
from nvfp4lab.report.pages import render_html
from nvfp4lab.settings import THREADS_ENV, environ, torch_threads

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HEADLINE_MIME",
    "Headline",
    "ProgressListener",
    "ReportResult",
    "check_parameters",
    "default_notebook_dir",
    "discover_notebooks",
    "extract_headlines",
    "headline",
    "notebook_parameters",
    "run_reports",
    "write_index",
]

#: MIME type of a headline-number output (a JSON object ``{"name", "value", "unit"}``).
HEADLINE_MIME = "application/vnd.nvfp4lab.headline+json"

_NOTEBOOK_NAME = re.compile(r"^\d\d_[A-Za-z0-9_\-]+\.ipynb$")


@dataclass(frozen=True)
class Headline:
    """One headline number of a notebook: ``value`` is a float, int or short string."""

    name: str
    value: float | int | str | None
    unit: str = ""

    def text(self) -> str:
        value = self.value
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        return f"{shown} {self.unit}".strip()

    def _ipython_display_(self) -> None:
        """Show nothing: :func:`headline` already displayed the record, so a cell ending in a
        bare ``headline(...)`` call does not echo ``Out[n]: Headline(...)`` under it."""


@dataclass
class ReportResult:
    """Outcome of one notebook: ``status`` is ``"ok"`` or ``"failed"`` (on the index of a run
    stopped by Ctrl-C also ``"interrupted"`` / ``"not run"``); ``duration_s`` is the wall time
    of execution (kernel start included); ``error`` says what failed (``None`` when ok)."""

    name: str
    notebook: Path
    status: str
    duration_s: float
    html_path: Path | None
    ipynb_path: Path | None
    parameters: dict[str, Any] = field(default_factory=dict)
    headlines: dict[str, Headline] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# --------------------------------------------------------------------------------------------
# headline numbers (called from inside notebooks)


def _json_value(value: Any) -> float | int | str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return int(value)
    if hasattr(value, "item"):  # numpy / torch scalars
        value = value.item()
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    raise TypeError(
        f"a headline value must be a number or a short string, got {type(value).__name__}: "
        f"{value!r}"
    )


def headline(name: str, value: Any, unit: str = "") -> Headline:
    """Publish a headline number for the report index (see the module docstring).

    ``value``: int, float (non-finite becomes a string), 0-d tensor/numpy scalar or str.
    In IPython this displays the value; elsewhere it only returns the record.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a headline needs a non-empty name, got {name!r}")
    record = Headline(name=name.strip(), value=_json_value(value), unit=str(unit))
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover - IPython comes with the notebooks extra
        return record
    if get_ipython() is None:
        return record
    payload = {"name": record.name, "value": record.value, "unit": record.unit}
    display(
        {HEADLINE_MIME: payload, "text/plain": f"headline: {record.name} = {record.text()}"},
        raw=True,
    )
    return record


def extract_headlines(nb: Any) -> dict[str, Headline]:
    """Headline records found in the outputs of an executed notebook (``nbformat`` node)."""
    found: dict[str, Headline] = {}
    for cell in nb.get("cells", []):
        for output in cell.get("outputs", []) or []:
            data = output.get("data") or {}
            payload = data.get(HEADLINE_MIME)
            if payload is None:
                continue
            if isinstance(payload, str):  # some writers store JSON mime data as text
                payload = json.loads(payload)
            found[payload["name"]] = Headline(
                name=payload["name"], value=payload.get("value"), unit=payload.get("unit", "")
            )
    return found


# --------------------------------------------------------------------------------------------
# notebooks and their parameters


def default_notebook_dir() -> Path:
    """``./notebooks`` when it exists, else the ``notebooks/`` folder beside the package."""
    here = Path.cwd() / "notebooks"
    if here.is_dir():
        return here
    return Path(__file__).resolve().parents[2] / "notebooks"  # beside nvfp4lab/


def discover_notebooks(notebook_dir: str | Path | None = None) -> list[Path]:
    """The report notebooks ``NN_*.ipynb`` of ``notebook_dir``, sorted by name."""
    folder = Path(notebook_dir) if notebook_dir is not None else default_notebook_dir()
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise FileNotFoundError(f"notebook folder {folder} {what}; pass the folder of the "
                                "NN_*.ipynb notebooks")
    return sorted(p for p in folder.iterdir() if _NOTEBOOK_NAME.match(p.name))


def _resolve(selection: Sequence[str | Path], notebook_dir: str | Path | None) -> list[Path]:
    """Paths as given, or names / prefixes (``01``, ``01_format_tour``, ``format_tour``)."""
    available: list[Path] | None = None
    chosen: list[Path] = []
    for item in selection:
        path = Path(item)
        if path.suffix == ".ipynb" and path.is_file():
            chosen.append(path)
            continue
        if available is None:
            available = discover_notebooks(notebook_dir)
        key = str(item).removesuffix(".ipynb")
        matches = [
            p for p in available
            if p.stem == key or p.stem.startswith(f"{key}_") or p.stem.split("_", 1)[1] == key
        ]
        if len(matches) != 1:
            names = ", ".join(p.stem for p in available) or "(none)"
            what = "matches no" if not matches else "is ambiguous among the"
            raise ValueError(f"notebook {item!r} {what} notebooks; available: {names}")
        chosen.append(matches[0])
    return list(dict.fromkeys(chosen))


def _read_notebook(path: Path) -> Any:
    skip_iri_format_backend()
    import nbformat

    return nbformat.read(path, as_version=4)


def notebook_parameters(nb_or_path: Any) -> dict[str, str]:
    """Names assigned in the cell tagged ``parameters`` -> the source text of their default.

    Raises ValueError when the notebook has no such cell (or more than one).
    """
    nb = _read_notebook(Path(nb_or_path)) if isinstance(nb_or_path, str | Path) else nb_or_path
    cells = [
        c for c in nb.cells
        if c.cell_type == "code" and "parameters" in c.get("metadata", {}).get("tags", [])
    ]
    if len(cells) != 1:
        raise ValueError(
            f"a report notebook needs exactly one code cell tagged 'parameters', found {len(cells)}"
        )
    source = cells[0].source
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ValueError(
            f"its parameters cell is not valid Python (line {exc.lineno}: {exc.msg}: "
            f"{(exc.text or '').strip()!r}); fix the cell"
        ) from None
    names: dict[str, str] = {}
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Name):
                names[target.id] = ast.get_source_segment(source, node.value) or ""
    return names


def check_parameters(notebook: str | Path, parameters: Mapping[str, Any]) -> None:
    """Raise ValueError if a name in ``parameters`` is not assigned in the notebook's
    ``parameters`` cell (the error names the notebook, the unknown names and the known ones)."""
    path = Path(notebook)
    try:
        known = notebook_parameters(path)
    except ValueError as exc:
        raise ValueError(f"{path.name}: {exc}") from None
    unknown = [name for name in parameters if name not in known]
    if unknown:
        raise ValueError(
            f"{path.name}: unknown parameter(s) {', '.join(sorted(unknown))}; its parameters "
            f"cell defines: {', '.join(sorted(known))}"
        )
    for name, value in parameters.items():
        _check_kind(path, name, known[name], value)


def _check_kind(path: Path, name: str, default_source: str, value: Any) -> None:
    """ValueError when ``value`` is not of the kind of the parameter's literal default (a bool
    for a bool, a number for a number, a string for a string): ``-p SMOKE=false`` used to pass
    the string 'false', which is true."""
    try:
        default = ast.literal_eval(default_source)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return  # not a literal (an expression): nothing to compare with
    kinds: tuple[tuple[type, type | tuple[type, ...], str, str], ...] = (
        (bool, bool, "True or False", "True"),  # first: a bool is an int too
        (int, numbers.Integral, "an integer", default_source),  # numpy's integers too
        (float, numbers.Real, "a number", default_source),
        (str, (str, os.PathLike), "a string", "'text'"),  # a Path is written as its text
    )
    for kind, accepted, what, example in kinds:
        if isinstance(default, kind):
            if isinstance(value, accepted) and (kind is bool or not isinstance(value, bool)):
                return
            raise ValueError(
                f"{path.name}: parameter {name} is {what} (default {default_source}), got "
                f"{value!r}; pass e.g. -p {name}={example}"
            )


# --------------------------------------------------------------------------------------------
# execution


class ProgressListener(Protocol):
    """What ``run_reports(progress=...)`` tells as it goes (:class:`nvfp4lab.report.talk.Progress`
    prints it), called from the runner's threads: a notebook ``started`` with ``threads`` torch
    threads (``expected_s``: its expected seconds, None when unknown), its code ``cell`` s done
    out of ``total``, its ``threads`` grown (the others ended), ``finished`` with its result."""

    def started(self, name: str, threads: int, expected_s: float | None = None) -> None: ...

    def cell(self, name: str, done: int, total: int) -> None: ...

    def threads(self, name: str, threads: int) -> None: ...

    def finished(self, result: ReportResult) -> None: ...


@dataclass(frozen=True)
class _Launch:
    """How one notebook is run: its kernel (``kernel_name``), time limit, torch ``threads`` at
    the start and the file of its later share (None: fixed), the run's ``progress`` listener."""

    kernel_name: str | None
    timeout_s: float
    threads: int
    threads_file: Path | None
    progress: ProgressListener | None


def _run_one(path: Path, out_dir: Path, parameters: dict[str, Any], launch: _Launch,
             running: Running) -> ReportResult:
    """Execute and render one notebook into hidden partial files, renamed over the previous pages
    once the run ended (ok or failed); a KeyboardInterrupt removes them, old pages untouched."""
    name = path.stem
    out_ipynb, out_html = out_dir / f"{name}.ipynb", out_dir / f"{name}.html"
    tmp_ipynb, tmp_html = (out_dir / f".{name}.partial{ext}" for ext in (".ipynb", ".html"))
    listener = launch.progress
    on_cell = None if listener is None else (
        lambda done, total: listener.cell(name, done, total))
    try:
        with stopwatch() as took:
            error = execute_notebook(path, tmp_ipynb, parameters, launch.kernel_name,
                                     launch.timeout_s, running, threads=launch.threads,
                                     threads_file=launch.threads_file, on_cell=on_cell)
        executed = tmp_ipynb.exists()
        nb = _read_notebook(tmp_ipynb) if executed else _read_notebook(path)
        headlines = extract_headlines(nb) if executed else {}
        try:
            render_html(nb, tmp_html, name)
        except Exception as exc:
            error = error or f"HTML rendering failed: {error_text(exc)}"
            tmp_html.unlink(missing_ok=True)
    except BaseException:
        tmp_ipynb.unlink(missing_ok=True)
        tmp_html.unlink(missing_ok=True)
        raise
    for tmp, final in ((tmp_ipynb, out_ipynb), (tmp_html, out_html)):
        if tmp.exists():
            os.replace(tmp, final)
        else:  # no stale page of an earlier run next to this run's result
            final.unlink(missing_ok=True)
    return ReportResult(
        name=name,
        notebook=path,
        status="failed" if error else "ok",
        duration_s=took.wall_s,
        html_path=out_html if out_html.exists() else None,
        ipynb_path=out_ipynb if out_ipynb.exists() else None,
        parameters=dict(parameters),
        headlines=headlines,
        error=error,
    )


def run_reports(
    notebooks: Sequence[str | Path] | None = None,
    out_dir: str | Path = "reports",
    parameters: Mapping[str, Any] | None = None,
    smoke: bool = False,
    kernel_name: str | None = None,
    *,
    notebook_dir: str | Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    index: bool = True,
    jobs: int | None = None,
    overwrite: bool = False,
    progress: ProgressListener | None = None,
) -> list[ReportResult]:
    """Execute report notebooks into ``out_dir`` (HTML + executed ``.ipynb`` + ``index.html``).

    ``notebooks``: paths, or names/prefixes of notebooks in ``notebook_dir`` (default: all
    ``NN_*.ipynb`` of :func:`default_notebook_dir`). ``parameters`` are injected into every
    notebook; ``smoke=True`` adds ``SMOKE=True``. Every name is checked against each notebook's
    ``parameters`` cell, ``out_dir`` for writability and ``NVFP4LAB_THREADS``
    (:func:`~nvfp4lab.settings.torch_threads`) before anything runs (ValueError).
    ``kernel_name=None`` runs the notebooks in this interpreter; a name picks an installed Jupyter
    kernelspec. ``timeout_s``: wall-clock limit per notebook (seconds). ``index=False`` skips
    ``index.html`` (one rendered notebook, e.g. ``nvfp4lab audit``). A notebook with an
    ``INTERACTIVE`` parameter runs with ``INTERACTIVE=False`` unless ``parameters`` sets it (its
    explorer cell needs a live session). Failures do not raise: a
    failing cell, a dead kernel ("kernel died") or a timeout is the result's ``status`` and
    ``error``, and the next notebook still runs.

    ``jobs``: notebooks run side by side, each in its own kernel (default: one per core, at most
    one per notebook). They start longest first (:mod:`nvfp4lab.report.schedule`: the durations
    recorded in ``out_dir`` by the previous run with the same parameters, else the shipped cost
    table) and each kernel gets the cores no other running notebook uses; once none is left to
    start, the cores of those that ended go to those still running, from their next cell (our
    own kernels only). ``NVFP4LAB_THREADS`` set in the environment fixes every kernel's threads
    instead. Results and index keep the notebooks' order either way. ``progress``: told of
    each start, cell and end (:class:`ProgressListener`; the CLI prints them).
    ``out_dir`` may hold an earlier run's pages, which are replaced; a file of the same name that
    the runner did not write is refused before anything runs unless ``overwrite``
    (:func:`nvfp4lab.report.outputs.check_outputs`; the notebooks' own folder is always
    refused).
    """
    if not (isinstance(timeout_s, int | float) and timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"--timeout must be a positive number of seconds, got {timeout_s!r}")
    fixed = torch_threads() if environ().get(THREADS_ENV, "").strip() else None
    paths = (
        _resolve(notebooks, notebook_dir)
        if notebooks is not None
        else discover_notebooks(notebook_dir)
    )
    if not paths:
        where = notebook_dir if notebook_dir is not None else default_notebook_dir()
        raise ValueError(f"no report notebooks (NN_*.ipynb) to run in {where}")
    params: dict[str, Any] = dict(parameters or {})
    if smoke:
        params["SMOKE"] = True
    for path in paths:
        check_parameters(path, params)
    jobs = _check_jobs(jobs, len(paths))
    out = check_out_dir(out_dir)
    check_outputs(out, paths, index=index, overwrite=overwrite)
    record_outputs(out, paths, index=index)
    expected = schedule.expected_seconds(paths, out, params)
    running = Running()
    done: dict[Path, ReportResult] = {}
    started: set[Path] = set()
    with tempfile.TemporaryDirectory(prefix="nvfp4lab-report-") as scratch:
        cores = schedule.Cores(
            schedule.available_cores(), jobs, len(paths), fixed=fixed,
            folder=Path(scratch) if kernel_name is None else None,
            expected={p.stem: seconds for p, (seconds, _) in expected.items()},
            changed=None if progress is None else progress.threads)

        def run(path: Path) -> None:
            if running.stopped.is_set():  # Ctrl-C before its turn: "not run"
                return
            started.add(path)
            threads = cores.take(path.stem)
            if progress is not None:
                seconds, measured = expected[path]
                progress.started(path.stem, threads, seconds if measured else None)
            launch = _Launch(kernel_name, float(timeout_s), threads, cores.file(path.stem),
                             progress)
            try:
                done[path] = _run_one(path, out, _headless(path, params), launch, running)
                if progress is not None:
                    progress.finished(done[path])
            finally:
                cores.release(path.stem)

        try:
            with running.on_ctrl_c():
                order = schedule.launch_order(paths, expected)
                if jobs == 1:
                    for path in order:
                        run(path)
                else:
                    _side_by_side(run, order, jobs, running)
        except KeyboardInterrupt:
            if index:
                write_index([done.get(p) or _not_finished(p, p in started, out, params)
                             for p in paths], out / "index.html")
            raise
    results = [done[p] for p in paths]
    schedule.record_times(out, params, {r.name: r.duration_s for r in results if r.ok})
    if index:
        write_index(results, out / "index.html")
    return results


#: The parameter of a notebook's explorer cell: on by default for a live Jupyter session, off in
#: a report run (nothing to interact with) unless the caller sets it.
INTERACTIVE_PARAMETER = "INTERACTIVE"


def _headless(path: Path, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with ``INTERACTIVE=False`` added where ``path`` has that parameter and the
    caller did not set it."""
    if INTERACTIVE_PARAMETER in params or INTERACTIVE_PARAMETER not in notebook_parameters(path):
        return params
    return {INTERACTIVE_PARAMETER: False, **params}


def _check_jobs(jobs: object, notebooks: int) -> int:
    """``jobs`` checked (an int >= 1; None: one per core, at most ``notebooks``)."""
    if jobs is None:
        return max(1, min(notebooks, os.cpu_count() or 1))
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs must be a whole number >= 1 (notebooks run side by side), "
                         f"got {jobs!r}")
    return jobs


def _closing_its_loop(run: Any, path: Path) -> Any:
    """``run(path)`` on a worker thread, then close the asyncio loop that jupyter's ``run_sync``
    made for this thread (it would otherwise be left to the garbage collector, unclosed, with
    its two sockets: a ResourceWarning at some later, unrelated moment)."""
    import asyncio

    try:
        return run(path)
    finally:
        policy = asyncio.get_event_loop_policy()
        try:
            loop = policy.get_event_loop()
        except RuntimeError:  # this thread never made one
            loop = None
        if loop is not None and not loop.is_running():
            loop.close()
            policy.set_event_loop(None)


def _side_by_side(run: Any, paths: Sequence[Path], jobs: int, running: Running) -> None:
    """``run(path)`` for every path on ``jobs`` threads (each drives one kernel). Ctrl-C stops
    ``running`` (every kernel), waits for the threads to clean up, and raises
    KeyboardInterrupt; another error of ``run`` (a bug, not a failed notebook) is raised."""
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="nvfp4lab-report") as pool:
        futures = [pool.submit(_closing_its_loop, run, path) for path in paths]
        try:
            finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        except KeyboardInterrupt:
            running.stop()
            for future in futures:
                future.cancel()
            wait(futures)
            raise
        for future in finished:
            if future.exception() is not None:
                running.stop()
                wait(futures)
                raise future.exception()  # type: ignore[misc]


def _not_finished(path: Path, started: bool, out: Path, params: dict[str, Any]) -> ReportResult:
    """The index row of a notebook Ctrl-C stopped (``started``) or kept from running, with its
    earlier page."""
    page = p if (p := out / f"{path.stem}.html").exists() else None
    status = "interrupted" if started else "not run"
    return ReportResult(path.stem, path, status, 0.0, page, None, dict(params),
                        error=f"{status} (Ctrl-C); " + (
                            "the page linked is from an earlier run" if page else "no page"))
