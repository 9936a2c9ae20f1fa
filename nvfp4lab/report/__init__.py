"""The report runner: the notebooks executed into offline HTML pages and an index.

One module per job (imports only go down this list):

``runner``            ``run_reports`` (``nvfp4lab report``): parameters checked, notebooks run
                      longest first, side by side, pages and ``index.html`` written;
                      ``headline`` (called inside a notebook)
``talk``              what the CLI prints while a run goes: starts, ends, cells done
``index_page``        ``index.html``: status, duration, headline numbers per notebook
``schedule``          launch order (cost table, the folder's record) and cores per kernel
``jupyter``           one notebook in a watched Jupyter kernel; a time limit or Ctrl-C kills it
``kernel_threads``    inside a kernel: torch threads follow the runner's share, even mid-cell
``outputs``           the output folder: never replaces a file the runner did not write
``pages``             nbconvert's lab template without CDN scripts, widgets stripped
``notebook_imports``  the Jupyter stack imported without jsonschema's lark-based IRI backend

The runner's public names are handed on here (``from nvfp4lab.report import headline``). The
old module paths ``nvfp4lab.reports``, ``report_kernels``, ``report_outputs``, ``report_pages``
and ``notebook_imports`` still import, as deprecated aliases of these modules (one release).
"""

from __future__ import annotations

from nvfp4lab.report.runner import (
    DEFAULT_TIMEOUT_S,
    HEADLINE_MIME,
    Headline,
    ReportResult,
    check_parameters,
    default_notebook_dir,
    discover_notebooks,
    extract_headlines,
    headline,
    notebook_parameters,
    run_reports,
    write_index,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HEADLINE_MIME",
    "Headline",
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
