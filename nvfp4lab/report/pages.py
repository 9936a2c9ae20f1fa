"""Report pages that work offline: one self-contained HTML file per executed notebook.

nbconvert's ``lab`` template loads require.js, MathJax, Mermaid and (when the notebook holds
widget state) the Jupyter widget manager from CDNs (cdnjs, unpkg). Offline, each of those is a
console error, and a widget output (a tqdm bar in a Jupyter kernel) renders blank. The pages of
``nvfp4lab report`` therefore:

* render through :data:`OFFLINE_TEMPLATE`, the ``lab`` template without those scripts: no
  ``<script src>`` or ``<link href>`` points anywhere, figures are embedded ``data:`` URIs, the
  CSS is inlined (nbconvert's default). The report notebooks write no LaTeX math; a ``$...$``
  in a markdown cell would show as its TeX source (MathJax is what the template left out);
* run their kernels with :func:`kernel_env` (``TQDM_DISABLE=1``): no progress bar is drawn,
  neither nvfp4lab's nor transformers' ("Loading weights") nor a converter's, so none reaches a
  page as a stderr box (the runner shows progress on the terminal instead);
* drop any remaining widget view from the executed notebook before export
  (:func:`strip_widgets`): its ``text/plain`` form stays, and without widget state the template
  emits no widget-manager script;
* write each figure's alt text (``{"image/png": {"alt": ...}}`` in the output's metadata, set by
  :func:`nvfp4lab.plots.install_alt_text`) into its ``<img alt>``: nbconvert's template writes
  none and fills in "No description has been provided for this image";
* add :data:`PAGE_CSS`: an output wider than the page (a wide table, a long printed line)
  scrolls inside its own box instead of being cut at the page's edge, and printed text wraps
  at spaces, not inside a number (the lab template's ``word-break: break-all``).

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
    "PAGE_CSS",
    "WIDGET_VIEW_MIME",
    "external_urls",
    "kernel_env",
    "render_html",
    "strip_widgets",
]

#: MIME type of a Jupyter widget's view in a cell output.
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"

#: CSS added to every page. The lab template lays an output out as a table cell in a
#: ``table-layout: fixed`` box with ``overflow: hidden``, so a table wider than the page was cut
#: off at the right edge; as a flex item with ``min-width: 0`` the output scrolls instead.
#: Printed text wraps at spaces only (the template's ``word-break: break-all`` split numbers
#: mid-digit); a single word longer than the line may still break.
PAGE_CSS = """
.jp-OutputArea-child { display: flex; }
.jp-OutputArea-prompt { flex: 0 0 auto; }
.jp-OutputArea-output { display: block; flex: 1 1 auto; min-width: 0; overflow-x: auto; }
.jp-OutputArea-output pre { white-space: pre-wrap; word-break: normal; overflow-wrap: anywhere; }
"""

#: The ``lab`` HTML template with every script block that loads from a CDN left empty, the
#: figures' alt text and :data:`PAGE_CSS`.
OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{% block extra_css %}<style type="text/css">""" + PAGE_CSS + """</style>{% endblock extra_css %}
{% block data_png scoped %}
{%- set alt = output | get_metadata('alt', 'image/png') -%}
<div class="jp-RenderedImage jp-OutputArea-output {{ extra_class }}">
<img src="data:image/png;base64,{{ output.data['image/png'] | escape_html }}"
{%- if alt %} alt="{{ alt | escape_html }}"{% endif %}>
</div>
{%- endblock data_png %}
"""
_TEMPLATE_NAME = "nvfp4lab_offline.html.j2"

# What a browser fetches by itself: any src=, a <link href=>, CSS url(...) and @import, when they
# name a network address (a link the reader may click, <a href>, is not a load).
_URL = r"""["']?((?:https?:)?//[^"'\s)>]+)"""
_EXTERNAL = re.compile(
    rf"""(?:\bsrc\s*=\s*|<link\b[^>]*?\bhref\s*=\s*|url\(\s*|@import\s+){_URL}""",
    re.IGNORECASE,
)


def kernel_env(threads: int | None = None) -> dict[str, str]:
    """Environment variables the report runner sets in its notebook kernels: no progress bars
    (``TQDM_DISABLE=1``, read by every tqdm bar, and ``HF_HUB_DISABLE_PROGRESS_BARS=1``, read
    by transformers' and the Hub's: a page showed them as stderr boxes; text bars,
    ``NVFP4LAB_TEXT_PROGRESS``, where one is still drawn), and ``threads`` (default
    :func:`~nvfp4lab.settings.torch_threads`) both as ``NVFP4LAB_THREADS`` and as
    ``OMP_NUM_THREADS`` (read by torch at start-up), so that kernels running side by side never
    start one thread per core each, even in a notebook that does not call
    :func:`~nvfp4lab.settings.use_torch_threads`."""
    count = str(torch_threads() if threads is None else threads)
    return {TEXT_PROGRESS_ENV: "1", "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            THREADS_ENV: count, "OMP_NUM_THREADS": count}


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
