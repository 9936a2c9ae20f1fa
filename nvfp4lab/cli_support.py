"""What every ``nvfp4lab`` subcommand shares, below :mod:`nvfp4lab.cli` and the subcommands
kept in their own modules (:mod:`nvfp4lab.cli_study`): a path argument that may not be empty,
the one-line error (``nvfp4lab <command>: <message>`` on stderr, exit status 2) and what a bad
input raises. Standard library only."""

from __future__ import annotations

import argparse
import re
import sys

__all__ = ["INPUT_ERRORS", "as_flag", "error_line", "path_text"]

#: What a bad input raises in audit / convert / study (reported in one line, never a traceback).
INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, ImportError, KeyError)


def path_text(text: str) -> str:
    """A path argument as given; an empty one is an error (``Path("")`` is the current folder,
    which ``audit ""`` used to audit)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; pass a folder or file")
    return text


def error_line(command: str, exc: BaseException) -> int:
    """Print ``nvfp4lab <command>: <message>`` (one line) on stderr; exit status 2."""
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    print(f"nvfp4lab {command}: {str(text).splitlines()[0] if text else type(exc).__name__}",
          file=sys.stderr)
    return 2


def as_flag(exc: BaseException, keyword: str, flag: str) -> BaseException:
    """``exc`` with the library's ``keyword='value'`` said as the command's ``flag value``."""
    text = re.sub(rf"\b{keyword}='([^']*)'", rf"{flag} \1", str(exc))
    return exc if text == str(exc) else type(exc)(text)
