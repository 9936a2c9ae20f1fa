"""The Jupyter stack (nbformat, papermill, nbconvert) imported without jsonschema's slowest
optional backend.

nbformat validates notebooks with jsonschema, whose format module imports, when first imported,
every optional format-checker backend it finds. Where JupyterLab is installed (jupyter-events
asks for ``jsonschema[format-nongpl]``) that includes ``rfc3987-syntax``, which builds about 35
Earley parsers with lark as it is imported: 1-4 s on the 2-core machine (``python -X
importtime``: 4.2 s of a 16.6 s test collection), in every process that imports nbformat, for
the ``iri`` / ``iri-reference`` formats that no notebook schema uses (format checks are opt-in in
jsonschema; python-jsonschema/jsonschema#1428). nvfp4lab's report code calls
:func:`skip_iri_format_backend` before it imports any of the three.
"""

from __future__ import annotations

import sys

__all__ = ["skip_iri_format_backend"]

_BACKEND = "rfc3987_syntax"
_FORMATS = "jsonschema._format"


def skip_iri_format_backend() -> None:
    """Import ``jsonschema._format`` (once per process) with ``rfc3987_syntax`` hidden, so that
    jsonschema registers no ``iri`` / ``iri-reference`` checker in this process; every other
    format checker is registered as usual, and ``rfc3987_syntax`` itself stays importable
    afterwards. Does nothing when jsonschema's format module (or that backend) is already
    imported, or jsonschema is not installed."""
    if _FORMATS in sys.modules or _BACKEND in sys.modules:
        return
    sys.modules[_BACKEND] = None  # type: ignore[assignment]  # `import` raises ImportError
    try:
        __import__(_FORMATS)
    except ImportError:
        pass
    finally:
        if _BACKEND in sys.modules and sys.modules[_BACKEND] is None:
            del sys.modules[_BACKEND]
