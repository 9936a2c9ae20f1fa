"""The report runner: execute the notebooks with papermill, render HTML, write an index.

``run_reports()`` (CLI: ``nvfp4lab report``) takes every ``notebooks/NN_*.ipynb`` in order and:

1. reads the cell tagged ``parameters`` and checks every parameter passed in against the names
   it assigns (papermill only warns on a typo; we raise ValueError before running anything);
2. executes the notebook with papermill in a kernel running THIS Python interpreter
   (``sys.executable``; not whatever ``python3`` kernelspec Jupyter finds first), with the
   notebook's folder as working directory;
3. writes the executed copy to ``<out>/<name>.ipynb`` and renders ``<out>/<name>.html`` with
   nbconvert (:mod:`nvfp4lab.report_pages`: one self-contained file, no external script, progress
   bars as text), under partial names renamed over the previous pages once complete;
4. keeps going past a failing notebook (its partial HTML is still written for diagnosis);
5. writes ``<out>/index.html``: status, duration and headline numbers of every notebook (after
   Ctrl-C: the running one ``interrupted``, its previous page kept; the rest ``not run``).

Headline numbers
----------------
A notebook publishes a number for the index page with::

    from nvfp4lab.reports import headline
    headline("SQNR N(0,1)", 20.4, unit="dB")

which displays an output carrying the MIME type :data:`HEADLINE_MIME`
(``application/vnd.nvfp4lab.headline+json``: ``{"name", "value", "unit"}``) next to a
``text/plain`` line for human readers. The runner collects these outputs from the executed
notebook (the last value wins per name). Outside IPython ``headline`` only returns the record.
"""

from __future__ import annotations

import ast
import html
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nvfp4lab.bench.timing import stopwatch
from nvfp4lab.report_pages import kernel_env, render_html
from nvfp4lab.settings import environ

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HEADLINE_MIME",
    "Headline",
    "ReportResult",
    "check_out_dir",
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
    return Path(__file__).resolve().parent.parent / "notebooks"


def discover_notebooks(notebook_dir: str | Path | None = None) -> list[Path]:
    """The report notebooks ``NN_*.ipynb`` of ``notebook_dir``, sorted by name."""
    folder = Path(notebook_dir) if notebook_dir is not None else default_notebook_dir()
    if not folder.is_dir():
        raise FileNotFoundError(f"notebook folder {folder} does not exist")
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


# --------------------------------------------------------------------------------------------
# execution


class _KernelWatch:
    """The kernels a report run started, so that a notebook past its time limit can be stopped
    (its kernel killed: nbclient then fails the notebook within about a second)."""

    def __init__(self) -> None:
        self.managers: list[Any] = []
        self.expired = False

    def kill(self) -> None:
        self.expired = True
        for km in self.managers:
            process = getattr(getattr(km, "provisioner", None), "process", None)
            if process is not None and process.poll() is None:
                process.kill()


def _kernel_manager_class(kernel_name: str | None, watch: _KernelWatch) -> type:
    """An ASYNC jupyter kernel manager (nbclient must poll the kernel's liveness while a cell runs;
    a blocking client waits forever on a dead kernel) that registers itself with ``watch``.

    ``kernel_name=None``: the kernel is ``sys.executable -m ipykernel_launcher``, with the folder
    holding this ``nvfp4lab`` first on its PYTHONPATH so the notebook imports the same package as
    the runner, even without an install. Otherwise the installed kernelspec of that name; both
    with :func:`report_pages.kernel_env` (text progress bars) added to their environment.
    """
    import os

    import zmq
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    package_root = str(Path(__file__).resolve().parent.parent)
    pythonpath = os.pathsep.join(p for p in (package_root, environ().get("PYTHONPATH")) if p)
    # Encrypt the kernel's local TCP channels when pyzmq can (CurveZMQ); ipykernel warns otherwise.
    curve = bool(zmq.has("curve"))
    named = kernel_name is not None

    class ThisPythonKernelSpecManager(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
            if named:  # an installed kernelspec, with the report pages' variables added
                spec = super().get_kernel_spec(kernel_name)
                spec.env = {**spec.env, **kernel_env()}
                return spec
            return KernelSpec(
                argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                display_name=f"Python ({sys.executable})",
                language="python",
                env={"PYTHONPATH": pythonpath, **kernel_env()},
                metadata={"supported_encryption": ["curve"]} if curve else {},
                resource_dir="",
            )

    class WatchedKernelManager(AsyncKernelManager):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            watch.managers.append(self)

        @default("kernel_spec_manager")
        def _default_ksm(self) -> KernelSpecManager:
            return ThisPythonKernelSpecManager()

        if not named:

            @default("transport_encryption")
            def _default_encryption(self) -> str:
                return "auto" if curve else "disabled"

    return WatchedKernelManager


def _error_text(exc: BaseException, timed_out: float | None = None) -> str:
    if timed_out is not None:
        return (
            f"timed out: still running after the {timed_out:g} s limit (--timeout); its kernel "
            "was stopped"
        )
    if type(exc).__name__ == "DeadKernelError":
        return (
            "kernel died: the notebook's Python process ended while a cell ran (killed, e.g. by "
            "the out-of-memory killer, or os._exit); run the notebook alone to see where"
        )
    ename = getattr(exc, "ename", None)
    if ename:  # papermill.PapermillExecutionError
        cell = getattr(exc, "exec_count", None)
        where = f" (cell [{cell}])" if cell is not None else ""
        return f"{ename}: {getattr(exc, 'evalue', '')}{where}"
    return f"{type(exc).__name__}: {exc}"


#: Default time limit of one notebook (seconds): generous, so that only a stuck notebook hits it.
DEFAULT_TIMEOUT_S: float = 1800.0


def _execute(
    path: Path, out_ipynb: Path, parameters: dict[str, Any], kernel_name: str | None,
    timeout_s: float,
) -> str | None:
    """Run one notebook with papermill; the error text, or None when it ran through.

    A watchdog kills the notebook's kernel once ``timeout_s`` has passed; each cell is also
    limited to ``timeout_s`` (nbclient's own execution timeout).
    """
    import signal
    import threading

    import papermill

    watch = _KernelWatch()
    timer = threading.Timer(timeout_s, watch.kill)
    timer.daemon = True
    timer.start()
    ours = (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)

    def interrupted(signum: int, frame: Any) -> None:  # Ctrl-C (the kernel has its own session)
        watch.kill()  # first: a kernel shut down mid-cell prints tracebacks on our stderr
        raise KeyboardInterrupt

    if ours:
        signal.signal(signal.SIGINT, interrupted)
    try:
        papermill.execute_notebook(
            str(path),
            str(out_ipynb),
            parameters=parameters or None,
            kernel_name=kernel_name or "python3",
            kernel_manager_class=_kernel_manager_class(kernel_name, watch),
            execution_timeout=timeout_s,
            cwd=str(path.parent),
            progress_bar=False,
            log_output=False,
        )
    except Exception as exc:  # keep going: the index and the partial HTML show what failed
        return _error_text(exc, timeout_s if watch.expired else None)
    finally:
        timer.cancel()
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    return None


def _run_one(
    path: Path,
    out_dir: Path,
    parameters: dict[str, Any],
    kernel_name: str | None,
    timeout_s: float,
) -> ReportResult:
    """Execute and render one notebook into hidden partial files, renamed over the previous pages
    once the run ended (ok or failed); a KeyboardInterrupt removes them, old pages untouched."""
    name = path.stem
    out_ipynb, out_html = out_dir / f"{name}.ipynb", out_dir / f"{name}.html"
    tmp_ipynb, tmp_html = (out_dir / f".{name}.partial{ext}" for ext in (".ipynb", ".html"))
    try:
        with stopwatch() as took:
            error = _execute(path, tmp_ipynb, parameters, kernel_name, timeout_s)
        executed = tmp_ipynb.exists()
        nb = _read_notebook(tmp_ipynb) if executed else _read_notebook(path)
        headlines = extract_headlines(nb) if executed else {}
        try:
            render_html(nb, tmp_html, name)
        except Exception as exc:
            error = error or f"HTML rendering failed: {_error_text(exc)}"
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


def check_out_dir(out_dir: str | Path) -> Path:
    """``out_dir`` as a writable folder (created if missing), or ValueError naming the problem:
    an existing file, a path under a file, or a folder this user cannot write to."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file, not a folder; pass a folder for the HTML")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(
                    f"--out {str(out)!r}: {str(parent)!r} is a file, so no folder can be made "
                    "under it; pass another folder"
                )
            break
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {str(out)!r} cannot be created ({exc.strerror})") from None
    import os

    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {str(out)!r} is not writable by this user; pass another folder")
    return out


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
) -> list[ReportResult]:
    """Execute report notebooks into ``out_dir`` (HTML + executed ``.ipynb`` + ``index.html``).

    ``notebooks``: paths, or names/prefixes of notebooks in ``notebook_dir`` (default: all
    ``NN_*.ipynb`` of :func:`default_notebook_dir`). ``parameters`` are injected into every
    notebook; ``smoke=True`` adds ``SMOKE=True``. Every name is checked against each notebook's
    ``parameters`` cell, and ``out_dir`` for writability, before anything runs (ValueError).
    ``kernel_name=None`` runs the notebooks in this interpreter; a name picks an installed Jupyter
    kernelspec. ``timeout_s``: wall-clock limit per notebook (seconds). ``index=False`` skips
    ``index.html`` (one rendered notebook, e.g. ``nvfp4lab audit``). Failures do not raise: a
    failing cell, a dead kernel ("kernel died") or a timeout is the result's ``status`` and
    ``error``, and the next notebook still runs.
    """
    if not (isinstance(timeout_s, int | float) and timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"--timeout must be a positive number of seconds, got {timeout_s!r}")
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
    out = check_out_dir(out_dir)
    results: list[ReportResult] = []
    try:
        for path in paths:
            results.append(_run_one(path, out, params, kernel_name, float(timeout_s)))
    except KeyboardInterrupt:
        if index:
            write_index(results + _not_finished(paths[len(results):], out, params),
                        out / "index.html")
        raise
    if index:
        write_index(results, out / "index.html")
    return results


def _not_finished(paths: Sequence[Path], out: Path, params: dict[str, Any]) -> list[ReportResult]:
    """Index rows of the notebook Ctrl-C stopped and the rest, with their earlier pages."""
    pages = [p if (p := out / f"{path.stem}.html").exists() else None for path in paths]
    return [ReportResult(path.stem, path, status := "not run" if i else "interrupted", 0.0, page,
                         None, dict(params), error=f"{status} (Ctrl-C); " + (
                             "the page linked is from an earlier run" if page else "no page"))
            for i, (path, page) in enumerate(zip(paths, pages, strict=True))]


# --------------------------------------------------------------------------------------------
# index page

_INDEX_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; }
table { border-collapse: collapse; } th, td { padding: .35rem .8rem; border-bottom: 1px solid #ddd;
  text-align: left; vertical-align: top; } th { background: #f4f4f4; }
.ok { color: #08660f; font-weight: bold; } .num { font-variant-numeric: tabular-nums; }
.failed, .interrupted, .not { color: #b00020; font-weight: bold; }
.err { font-family: monospace; font-size: .9em; }
"""


def write_index(results: Sequence[ReportResult], path: str | Path) -> Path:
    """Write the index page for ``results`` (status, duration, headline numbers, errors)."""
    esc = html.escape
    rows = []
    for r in results:
        link = (
            f'<a href="{esc(r.html_path.name)}">{esc(r.name)}</a>' if r.html_path else esc(r.name)
        )
        heads = "<br>".join(f"{esc(h.name)}: <b>{esc(h.text())}</b>" for h in r.headlines.values())
        params = ", ".join(f"{esc(k)}={esc(repr(v))}" for k, v in r.parameters.items())
        rows.append(
            f'<tr><td>{link}</td><td class="{esc(r.status)}">{esc(r.status)}</td>'
            f'<td class="num">{r.duration_s:.1f} s</td><td>{heads or "—"}</td>'
            f"<td>{params or '—'}</td>"
            f'<td class="err">{esc(r.error) if r.error else ""}</td></tr>'
        )
    failed = [r.name for r in results if not r.ok]
    summary = (
        f"{len(results) - len(failed)} of {len(results)} notebooks ran"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>nvfp4lab reports</title>
<style>{_INDEX_CSS}</style></head>
<body><h1>nvfp4lab reports</h1>
<p>{esc(summary)}. Generated {stamp} with Python {esc(sys.version.split()[0])}.</p>
<table><thead><tr><th>notebook</th><th>status</th><th>duration</th><th>headline numbers</th>
<th>parameters</th><th>error</th></tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody></table></body></html>
"""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)  # a reader never sees half a page
    return out
