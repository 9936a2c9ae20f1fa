"""Helpers for driving an explorer (a ``VBox`` of controls and an ``Output``) in tests."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("pandas")


def control(box: Any, description: str) -> Any:
    (found,) = [c for c in box.children if getattr(c, "description", None) == description]
    return found


def text(box: Any) -> str:
    """Everything the explorer's Output (the last child) holds, as plain text."""
    return text_of(box.children[-1].outputs)


def text_of(outputs: Any) -> str:
    """Notebook output dicts as plain text (a stream's text, else ``text/plain``)."""
    return "".join(
        o["text"] if o["output_type"] == "stream" else o["data"]["text/plain"] for o in outputs
    )
