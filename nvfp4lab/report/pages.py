"""Report pages that work offline: one self-contained HTML file per executed notebook.

nbconvert's ``lab`` template loads require.js, MathJax, Mermaid and (when the notebook holds
widget state) the Jupyter widget manager from CDNs (cdnjs, unpkg). Offline, each of those is a
console error, and a widget output (a tqdm bar in a Jupyter kernel) renders blank. The pages of
``nvfp4lab report`` therefore:

* render through :data:`OFFLINE_TEMPLATE`, the ``lab`` template without those scripts: no
  ``<script src>`` or ``<link href>`` points anywhere, figures are embedded ``data:`` URIs, the
  CSS is inlined (nbconvert's default). The report notebooks write no LaTeX math; a ``$...$``
  in a markdown cell would show as its TeX source (MathJax is what the template left out);
* run their kernels with :func:`kernel_env` (``NVFP4LAB_TEXT_PROGRESS=1``): nvfp4lab's progress
  bars and transformers' ("Loading weights", through :mod:`nvfp4lab.models`) are plain text on
  stderr, which the page shows as the bar's last state;
* drop any remaining widget view from the executed notebook before export
  (:func:`strip_widgets`): its ``text/plain`` form stays, and without widget state the template
  emits no widget-manager script.

:func:`external_urls` lists what a page would fetch from the network (the tests' check).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

from nvfp4lab.report.notebook_imports import skip_iri_format_backend
from nvfp4lab.settings import TEXT_PROGRESS_ENV, THREADS_ENV, torch_threads

__all__ = [
    "OFFLINE_TEMPLATE",
    "WIDGET_VIEW_MIME",
    "external_urls",
    "kernel_env",
    "render_html",
    "strip_widgets",
]

#: MIME type of a Jupyter widget's view in a cell output.
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"

#: The ``lab`` HTML template with every script block that loads from a CDN left empty.
OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""
_TEMPLATE_NAME = "nvfp4lab_offline.html.j2"

# What a browser fetches by itself: any src=, a <link href=>, CSS url(...) and @import, when they
# name a network address (a link the reader may click, <a href>, is not a load).
_URL = r"""["']?((?:https?:)?//[^"'\s)>]+)"""
_EXTERNAL = re.compile(
    rf"""(?:\bsrc\s*=\s*|<link\b[^>]*?\bhref\s*=\s*|url\(\s*|@import\s+){_URL}""",
    re.IGNORECASE,
)


def kernel_env() -> dict[str, str]:
    """Environment variables the report runner sets in its notebook kernels: text progress bars,
    and :func:`~nvfp4lab.settings.torch_threads` both as ``NVFP4LAB_THREADS`` and as
    ``OMP_NUM_THREADS`` (read by torch at start-up), so that kernels running side by side never
    start one thread per core each, even in a notebook that does not call
    :func:`~nvfp4lab.settings.use_torch_threads`."""
    threads = str(torch_threads())
    return {TEXT_PROGRESS_ENV: "1", THREADS_ENV: threads, "OMP_NUM_THREADS": threads}


def strip_widgets(nb: Any) -> Any:
    """A copy of the ``nbformat`` notebook ``nb`` with no widget in it: each output's widget
    view is removed (an output left with no data at all is dropped) and the notebook's widget
    state (``metadata.widgets``) deleted, so the page needs no widget manager."""
    nb = copy.deepcopy(nb)
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb.get("cells", []):
        outputs = cell.get("outputs")
        if not outputs:
            continue
        kept = []
        for output in outputs:
            data = output.get("data")
            if data is not None and WIDGET_VIEW_MIME in data:
                del data[WIDGET_VIEW_MIME]
                if not data:
                    continue
            kept.append(output)
        cell["outputs"] = kept
    return nb


def render_html(nb: Any, out_path: str | Path, title: str) -> Path:
    """Write ``nb`` as one self-contained HTML page (see the module docstring)."""
    import jinja2

    skip_iri_format_backend()
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(
        template_name="lab",
        extra_loaders=[jinja2.DictLoader({_TEMPLATE_NAME: OFFLINE_TEMPLATE})],
    )
    exporter.template_file = _TEMPLATE_NAME
    exporter.embed_images = True  # markdown images as data: URIs too
    resources = {"metadata": {"name": title}}
    body, _ = exporter.from_notebook_node(strip_widgets(nb), resources=resources)
    out = Path(out_path)
    out.write_text(body, encoding="utf-8")
    return out


def external_urls(page: str) -> list[str]:
    """Every network address ``page`` (HTML text) would load by itself: ``src`` attributes,
    ``<link href>``, CSS ``url()`` / ``@import`` with an ``http(s)://`` or ``//`` target."""
    return _EXTERNAL.findall(page)
