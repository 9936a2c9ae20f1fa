"""Report pages that work offline (nvfp4lab.report.pages), through the report runner.

One small notebook runs once for the module: a figure, nvfp4lab's progress bar, transformers'
"Loading weights" bar as nvfp4lab.models loads a model, and a raw ipywidget.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from nvfp4lab.report import runner
from nvfp4lab.report.pages import (
    WIDGET_VIEW_MIME,
    external_urls,
    kernel_env,
    render_html,
    strip_widgets,
)
from nvfp4lab.settings import TEXT_PROGRESS_ENV

BODY = """
import os
import matplotlib.pyplot as plt
import ipywidgets
from IPython.display import display
from nvfp4lab.models import _transformers_progress
from nvfp4lab.report import headline
from nvfp4lab.settings import tqdm_class

fig, ax = plt.subplots()
ax.plot([0, 1], [0, 1])
plt.show()
for _ in tqdm_class()(range(5), desc="nvfp4lab bar"):
    pass
with _transformers_progress():
    from transformers.utils import logging as hf_logging
    for _ in hf_logging.tqdm(range(7), desc="Loading weights"):
        pass
display(ipywidgets.IntSlider(value=3, description="a widget"))
headline("progress env", os.environ.get("NVFP4LAB_TEXT_PROGRESS", "unset"))
"""

CDN_HOSTS = ("cdnjs", "unpkg", "jsdelivr", "cdn.", "googleapis", "mathjax")


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, runner.ReportResult]:
    folder = tmp_path_factory.mktemp("nbs")
    cells = [new_markdown_cell("# offline\n\nA [link](https://example.org) is not a load.")]
    params = new_code_cell("SEED = 0\nSMOKE = False\nINTERACTIVE = False")
    params.metadata["tags"] = ["parameters"]
    nb = new_notebook(cells=[*cells, params, new_code_cell(BODY)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, folder / "01_offline.ipynb")
    out = tmp_path_factory.mktemp("reports")
    (result,) = runner.run_reports(out_dir=out, notebook_dir=folder)
    assert result.ok, result.error
    return out, result


def test_pages_load_nothing_from_the_network(pages) -> None:
    out, result = pages
    for path in (result.html_path, out / "index.html"):
        page = path.read_text()
        assert external_urls(page) == [], path.name
        assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.IGNORECASE), path.name
        lowered = page.lower()
        assert [h for h in CDN_HOSTS if h in lowered] == [], path.name
    page = result.html_path.read_text()
    assert "data:image/png;base64," in page  # the figure is embedded
    assert 'href="https://example.org"' in page  # a link to click stays


def test_no_progress_bar_reaches_the_page(pages) -> None:
    _, result = pages
    assert result.headlines["progress env"].value == "1"  # the runner's kernel got the variable
    page = result.html_path.read_text()
    # issue 37: bars drawn as text showed as pink stderr boxes; the runner's kernels draw none
    assert "nvfp4lab bar" in page and "Loading weights" in page  # in the cell's source only
    assert not re.search(r"nvfp4lab bar: +\d+%", page)
    assert not re.search(r"Loading weights: +\d+%", page)  # transformers' bar neither
    assert 'data-mime-type="application/vnd.jupyter.stderr"' not in page
    assert WIDGET_VIEW_MIME not in page
    assert "IntSlider(value=3" in page  # a widget shows its text form, not a blank


def test_strip_widgets_keeps_text_and_drops_state() -> None:
    view = {"model_id": "abc", "version_major": 2, "version_minor": 0}
    only_view = new_output("display_data", data={WIDGET_VIEW_MIME: view})
    both = new_output("display_data", data={WIDGET_VIEW_MIME: view, "text/plain": "Bar(0%)"})
    nb = new_notebook(cells=[new_code_cell("x", outputs=[only_view, both])])
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    clean = strip_widgets(nb)
    assert "widgets" not in clean.metadata
    assert [o["data"] for o in clean.cells[0].outputs] == [{"text/plain": "Bar(0%)"}]
    assert "widgets" in nb.metadata and len(nb.cells[0].outputs) == 2  # the input is untouched


def test_render_html_omits_cdn_scripts_even_with_widget_state(tmp_path: Path) -> None:
    nb = new_notebook(cells=[new_markdown_cell("$x^2$ stays TeX")])
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    page = render_html(nb, tmp_path / "p.html", "p").read_text()
    assert external_urls(page) == []
    assert "require" not in page and "embed-amd" not in page
    assert "x^2" in page


def test_external_urls_finds_loads_not_links() -> None:
    page = (
        '<script src="https://cdn.x/a.js"></script><link rel="stylesheet" href="//f.g/x.css">'
        '<a href="https://github.com">x</a><img src="data:image/png;base64,AA">'
        '<style>@import "http://a/b.css"; .x { background: url(https://q/r.png) }</style>'
    )
    assert external_urls(page) == [
        "https://cdn.x/a.js", "//f.g/x.css", "http://a/b.css", "https://q/r.png",
    ]


def test_kernel_env_asks_for_text_progress_and_the_settings_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NVFP4LAB_THREADS", raising=False)
    assert kernel_env() == {TEXT_PROGRESS_ENV: "1", "TQDM_DISABLE": "1",
                            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "NVFP4LAB_THREADS": "1",
                            "OMP_NUM_THREADS": "1"}
    assert kernel_env(2)["NVFP4LAB_THREADS"] == kernel_env(2)["OMP_NUM_THREADS"] == "2"
    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # 3 threads are allowed on any machine
    monkeypatch.setenv("NVFP4LAB_THREADS", "3")
    assert kernel_env()["OMP_NUM_THREADS"] == "3"
