"""Shared plumbing of the ipywidgets explorers (the ``if INTERACTIVE:`` cell of each notebook).

Each study module builds its own explorer: it imports ipywidgets inside itself (the
``notebooks`` extra), builds its controls, and hands them with a ``render`` function to
:func:`explorer`, which returns ``VBox(controls + [Output])``. Every update goes through a plain
text/table function that tests call without a kernel. Updates replace ``Output.outputs``
directly, so nothing is printed into the cell.

What the reader sees: each output names what it shows (:func:`text_output` and
:func:`table_output` take a ``title``, drawn in bold above it); printed text wraps only at
spaces, never inside a number (JupyterLab's output CSS says ``word-break: break-all``, which cut
"9.968e-01" into "9.968e-0" / "1"); and a render that takes more than :data:`BUSY_AFTER_S`
(a configuration built on first pick: seconds to a minute) clears the old result and shows
:data:`BUSY_TEXT` until the new one is there.

Every control with a description gets ``description_width: initial``, so a label such as
"block scale s" is shown whole instead of being cut to the default width. Every dropdown is at
least the usual widget width (``--jp-widgets-inline-width``, 300 px) and otherwise as wide as
its label and longest option (``width: max-content``): in the fixed 300 px, 06's scenario
"VLLM_USE_NVFP4_CT_EMULATIONS=1" showed as "VLLM_USE_NVFP4_CT_EMULATIO". ``make test-browser``
checks both in JupyterLab (tests/browser/test_lab.py).

Outside a live kernel a widget needs its saved state to draw. When the box is displayed, its
mime bundle also carries a static snapshot of the readout at that moment (``text/plain`` and
``text/html``), which nbconvert HTML, nbviewer and GitHub show when no widget state was saved,
instead of ``VBox(children=...)``. JupyterLab draws widgets only from a live kernel or from widget
state saved with the notebook (Settings → Save Widget State Automatically); without either it
shows the widget's placeholder, not the snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import ipywidgets
    import pandas as pd

__all__ = [
    "BUSY_AFTER_S",
    "BUSY_TEXT",
    "Outputs",
    "busy_output",
    "explorer",
    "snapshot",
    "stream_output",
    "table_output",
    "text_output",
]

Outputs = tuple[dict[str, Any], ...]

#: Seconds a render may take before the explorer clears its output and shows it is busy.
BUSY_AFTER_S = 0.5
#: What the explorer shows while a slow render runs.
BUSY_TEXT = "⏳ computing … (the result of this pick is not ready yet)"
# Inline style of printed text: wrap at spaces only (JupyterLab's `pre` CSS breaks anywhere).
_PRE_STYLE = "white-space: pre-wrap; word-break: normal; overflow-wrap: normal; margin: 0"
_TITLE_CLASS = "nvfp4lab-output-title"


def stream_output(text: str, name: str = "stdout") -> dict[str, Any]:
    """One notebook stream output (what ``print`` would have produced)."""
    return {"output_type": "stream", "name": name, "text": text.rstrip("\n") + "\n"}


def _title_html(title: str) -> str:
    import html

    return f'<p class="{_TITLE_CLASS}"><strong>{html.escape(title)}</strong></p>' if title else ""


def text_output(text: str, title: str = "") -> dict[str, Any]:
    """One notebook display output holding ``text`` (``text/plain``: the text with one trailing
    newline, as :func:`stream_output`; ``text/html``: ``title`` in bold over the text in a
    ``<pre>`` that wraps at spaces only, so no number is split across lines)."""
    import html

    body = text.rstrip("\n")
    return {
        "output_type": "display_data",
        "data": {
            "text/plain": body + "\n",
            "text/html": f'{_title_html(title)}<pre style="{_PRE_STYLE}">{html.escape(body)}</pre>',
        },
        "metadata": {},
    }


def table_output(
    frame: pd.DataFrame, float_format: str = "{:.4g}", title: str = ""
) -> dict[str, Any]:
    """One notebook display output holding ``frame`` as plain text and HTML (``title`` in bold
    above the HTML table)."""
    fmt = float_format.format
    return {
        "output_type": "display_data",
        "data": {
            "text/plain": frame.to_string(float_format=fmt),
            "text/html": _title_html(title) + frame.to_html(float_format=fmt),
        },
        "metadata": {},
    }


def busy_output() -> dict[str, Any]:
    """The output an explorer shows while a slow render runs (:data:`BUSY_TEXT`)."""
    return text_output(BUSY_TEXT)


def explorer(
    widgets: Any,
    controls: Sequence[ipywidgets.Widget],
    render: Callable[[], Outputs],
    *,
    busy_after_s: float = BUSY_AFTER_S,
) -> ipywidgets.VBox:
    """``VBox(controls + [Output])``; ``render()`` fills the Output now and on every change.

    A render still running after ``busy_after_s`` seconds has the Output cleared and
    :func:`busy_output` shown (from a timer thread; the result replaces it when ready). An
    exception from ``render`` is shown in the Output (stderr) instead of being lost in the
    widget callback.
    """
    import threading

    out = widgets.Output()

    def refresh(_change: object = None) -> None:
        lock, done = threading.Lock(), threading.Event()

        def show_busy() -> None:
            with lock:
                if not done.is_set():
                    out.outputs = (busy_output(),)

        timer = threading.Timer(busy_after_s, show_busy)
        timer.daemon = True
        timer.start()
        try:
            result = tuple(render())
        except Exception as exc:  # shown to the user, not raised into the comm handler
            result = (stream_output(f"{type(exc).__name__}: {exc}", "stderr"),)
        with lock:
            done.set()
            timer.cancel()
            out.outputs = result

    for control in controls:
        if getattr(control, "description", ""):
            control.style.description_width = "initial"
        if isinstance(control, widgets.Dropdown):
            # at max-content a <select> is as wide as its longest option
            control.layout.width = "max-content"
            control.layout.min_width = "var(--jp-widgets-inline-width)"
        control.observe(refresh, names="value")
    refresh()
    box = widgets.VBox([*controls, out])
    widget_bundle = box._repr_mimebundle_

    def bundle(**kwargs: Any) -> dict[str, Any]:
        data = dict(widget_bundle(**kwargs) or {})
        data.update(snapshot(controls, out.outputs))
        return data

    box._repr_mimebundle_ = bundle
    return box


def snapshot(controls: Sequence[Any], outputs: Outputs) -> dict[str, str]:
    """``text/plain`` and ``text/html`` of the controls' values and ``outputs`` (the static copy
    of an explorer that viewers without a kernel or widget state show)."""
    import html

    settings = ", ".join(
        f"{getattr(c, 'description', '') or type(c).__name__} = {_shown(c)}" for c in controls
    )
    head = f"Explorer (static snapshot; move the controls in a live kernel): {settings}"
    texts, pages = [head], [f"<p><em>{html.escape(head)}</em></p>"]
    for o in outputs:
        if o["output_type"] == "stream":
            texts.append(o["text"].rstrip("\n"))
            pages.append(f"<pre>{html.escape(o['text'].rstrip())}</pre>")
        else:
            data = o.get("data", {})
            texts.append(str(data.get("text/plain", "")))
            if "text/html" in data:
                pages.append(str(data["text/html"]))
            elif "image/png" in data:
                alt = html.escape(str(o.get("metadata", {}).get("image/png", {}).get(
                    "alt", "Figure")), quote=True)
                pages.append(f'<img src="data:image/png;base64,{data["image/png"]}" alt="{alt}"/>')
            else:
                pages.append(f"<pre>{html.escape(str(data.get('text/plain', '')))}</pre>")
    return {"text/plain": "\n".join(texts), "text/html": "\n".join(pages)}


def _shown(control: Any) -> str:
    label = getattr(control, "label", None)  # selection widgets: the shown option
    return str(label if label is not None else getattr(control, "value", ""))
