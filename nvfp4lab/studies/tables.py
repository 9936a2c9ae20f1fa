"""How the notebooks show tables with long text: whole, wrapped, never cut.

pandas cuts a string at ``display.max_colwidth`` characters and ends it with "..."; a table of
long right-aligned strings is also wider than a page. The two helpers here keep every character:

* :func:`full_text`: a pandas ``Styler`` of the frame whose text columns are left-aligned and
  wrapped at spaces (a minimum width per column), numbers formatted once;
* :func:`with_notes`: long strings that repeat down a column (a source per row) become note
  numbers ``[n]``, and the distinct strings a numbered list, :func:`notes_frame`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from pandas.io.formats.style import Styler

__all__ = ["full_text", "notes_frame", "with_notes"]

#: Strings longer than this (characters) count as text to wrap, not a label.
LONG = 24


def _text_columns(frame: pd.DataFrame) -> list[Any]:
    """Columns holding at least one string longer than :data:`LONG` characters."""
    return [c for c in frame.columns
            if frame[c].map(lambda v: isinstance(v, str) and len(v) > LONG).any()]


def full_text(
    frame: pd.DataFrame,
    *,
    float_format: str = "{:.4g}",
    min_width_em: int = 24,
) -> Styler:
    """``frame`` as a ``Styler`` that shows every string whole: text columns (any value longer
    than :data:`LONG` characters) left-aligned, wrapped at spaces, at least ``min_width_em`` em
    wide; float columns formatted with ``float_format``. Raises ValueError on a bad format."""
    try:
        float_format.format(1.5)
    except (ValueError, IndexError, KeyError) as exc:
        raise ValueError(f"full_text: float_format={float_format!r} is not a format for one "
                         f"number; use e.g. '{{:.4g}}'") from exc
    floats = [c for c in frame.columns if frame[c].dtype.kind == "f"]
    styler = frame.style.format(float_format, subset=floats, na_rep="")
    text = _text_columns(frame)
    if text:
        styler = styler.set_properties(subset=text, **{
            "text-align": "left", "white-space": "normal", "min-width": f"{min_width_em}em"})
    return styler


def with_notes(
    frame: pd.DataFrame, columns: Sequence[Any] | None = None
) -> tuple[pd.DataFrame, list[str]]:
    """A copy of ``frame`` whose string values in ``columns`` (default: every column with a
    string longer than :data:`LONG` characters) are note numbers ``"[n]"``, and the notes: the
    distinct strings in order of first appearance, ``notes[n - 1]`` being note n. Empty and
    missing values stay as they are. Raises KeyError naming a column ``frame`` lacks."""
    cols = list(_text_columns(frame) if columns is None else columns)
    missing = [c for c in cols if c not in frame.columns]
    if missing:
        raise KeyError(
            f"with_notes: no column {missing} in the frame; it has {list(frame.columns)}")
    notes: list[str] = []
    out = frame.copy()

    def number(value: Any) -> Any:
        if not isinstance(value, str) or not value:
            return value
        if value not in notes:
            notes.append(value)
        return f"[{notes.index(value) + 1}]"

    for c in cols:
        out[c] = frame[c].map(number)
    return out, notes


def notes_frame(notes: Sequence[str], title: str = "note") -> Styler:
    """The numbered notes of :func:`with_notes` as a two-column table (``[n]``, the full text,
    left-aligned and wrapped)."""
    import pandas as pd

    frame = pd.DataFrame({title: list(notes)}, index=[f"[{i}]" for i in range(1, len(notes) + 1)])
    return frame.style.set_properties(**{"text-align": "left", "white-space": "normal"}) \
        .set_table_styles([{"selector": "th.col_heading", "props": "text-align: left"}])
