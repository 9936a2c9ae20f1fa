"""Importing the Jupyter stack the way nvfp4lab's reports do leaves out jsonschema's lark-based
IRI backend (seconds of import) and nothing else (checked in a fresh interpreter)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types

import pytest

_CHILD = """
import sys, time
from nvfp4lab.report.notebook_imports import skip_iri_format_backend
skip_iri_format_backend()
import nbformat
from jsonschema import FormatChecker
checkers = FormatChecker().checkers
assert "rfc3987_syntax" not in sys.modules
assert "iri" not in checkers and "iri-reference" not in checkers, sorted(checkers)
assert {"email", "ipv4", "date-time", "regex"} <= set(checkers), sorted(checkers)
nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
nbformat.validate(nb)
import rfc3987_syntax  # still importable by anyone who wants it
skip_iri_format_backend()  # a second call: nothing to do
print("ok")
"""


@pytest.mark.skipif(
    importlib.util.find_spec("rfc3987_syntax") is None or importlib.util.find_spec("rfc3987"),
    reason="jsonschema would not import rfc3987_syntax here anyway",
)
def test_nbformat_imports_without_the_iri_backend() -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_once_jsonschema_formats_are_imported_it_does_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nvfp4lab.report.notebook_imports import skip_iri_format_backend

    formats = types.ModuleType("jsonschema._format")
    monkeypatch.setitem(sys.modules, "jsonschema._format", formats)
    monkeypatch.delitem(sys.modules, "rfc3987_syntax", raising=False)
    skip_iri_format_backend()
    assert sys.modules["jsonschema._format"] is formats and "rfc3987_syntax" not in sys.modules
