"""Shared plumbing of the ipywidgets explorers (the ``if INTERACTIVE:`` cell of each notebook).

Each study module builds its own explorer: it imports ipywidgets inside itself (the
``notebooks`` extra), builds its controls, and hands them with a ``render`` function to
:func:`explorer`, which returns ``VBox(controls + [Output])``. Every update goes through a plain
text/table function that tests call without a kernel. Updates replace ``Output.outputs``
directly, so nothing is printed and the result is visible outside a live kernel too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import ipywidgets
    import pandas as pd

__all__ = ["Outputs", "explorer", "stream_output", "table_output"]

Outputs = tuple[dict[str, Any], ...]


def stream_output(text: str, name: str = "stdout") -> dict[str, Any]:
    """One notebook stream output (what ``print`` would have produced)."""
    return {"output_type": "stream", "name": name, "text": text.rstrip("\n") + "\n"}


def table_output(frame: pd.DataFrame, float_format: str = "{:.4g}") -> dict[str, Any]:
    """One notebook display output holding ``frame`` as plain text and HTML."""
    fmt = float_format.format
    return {
        "output_type": "display_data",
        "data": {
            "text/plain": frame.to_string(float_format=fmt),
            "text/html": frame.to_html(float_format=fmt),
        },
        "metadata": {},
    }


def explorer(
    widgets: Any, controls: Sequence[ipywidgets.Widget], render: Callable[[], Outputs]
) -> ipywidgets.VBox:
    """``VBox(controls + [Output])``; ``render()`` fills the Output now and on every change.

    An exception from ``render`` is shown in the Output (stderr) instead of being lost in the
    widget callback.
    """
    out = widgets.Output()

    def refresh(_change: object = None) -> None:
        try:
            out.outputs = render()
        except Exception as exc:  # shown to the user, not raised into the comm handler
            out.outputs = (stream_output(f"{type(exc).__name__}: {exc}", "stderr"),)

    for control in controls:
        control.observe(refresh, names="value")
    refresh()
    return widgets.VBox([*controls, out])
