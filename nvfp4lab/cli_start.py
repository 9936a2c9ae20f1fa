"""Ctrl-C while the ``nvfp4lab`` command line starts: one line and exit status 130, never a
traceback.

``nvfp4lab/__init__.py`` imports torch and the numerics (1–2 s, more on a busy machine) before
:func:`nvfp4lab.cli.main` can catch anything, and both entry points (the ``nvfp4lab`` console
script, ``python -m nvfp4lab``) run that import first. So the package imports this module before
anything else, and importing it calls :func:`guard`: in a process that is the command line, and
only there, it installs a SIGINT handler that prints ``nvfp4lab <command>: interrupted while
starting; nothing was done`` and ends the process with :data:`INTERRUPTED_EXIT`.
:func:`nvfp4lab.cli.main` calls :func:`release` as its command starts, which puts Python's own
handler back (the command's ``KeyboardInterrupt`` handling and cleanup take over), and
:func:`finished` as it returns: a Ctrl-C while Python then exits ends the process at once with
the command's exit status (it used to print a traceback from an ``atexit`` callback, or, during
the 0.4–1 s torch takes to tear down, kill the process silently), and a command stopped by
Ctrl-C exits 130 once the ``atexit`` callbacks ran (:func:`_last_at_exit`).
``import nvfp4lab`` anywhere else (a script, a notebook, a pool worker, the tests) changes
nothing.

A SIGINT before the interpreter has run any of nvfp4lab's code (its own start and ``site``, about
30 ms) cannot be caught here. Standard library only: it runs before anything else is imported.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

__all__ = [
    "INTERRUPTED_EXIT", "finished", "guard", "is_command_line", "release", "starting_line",
]

#: Exit status of a command stopped by Ctrl-C (SIGINT), as shells report it: 128 + 2.
INTERRUPTED_EXIT = 130

#: The names the console script may have (``[project.scripts]`` in pyproject.toml).
SCRIPT_NAMES = frozenset({"nvfp4lab", "nvfp4lab.exe"})


def is_command_line(argv: Sequence[str], orig_argv: Sequence[str]) -> bool:
    """Whether this process was started as the ``nvfp4lab`` command line, from ``sys.argv`` and
    ``sys.orig_argv`` as they are while the package is first imported: the console script
    (``argv[0]`` is the script, named ``nvfp4lab``), or ``python -m nvfp4lab`` (``argv[0]`` is
    ``"-m"`` while runpy imports the package, the module name just before ``argv[1:]`` in the
    interpreter's own arguments). A spawned pool worker inherits its parent's ``argv`` but not
    its ``orig_argv`` (``-c ... --multiprocessing-fork``), so it is not one."""
    if not argv or len(orig_argv) < len(argv) + 1:
        return False
    started = orig_argv[len(orig_argv) - len(argv):]
    if list(started[1:]) != list(argv[1:]):
        return False
    if argv[0] == "-m":
        return started[0] in ("nvfp4lab", "-mnvfp4lab")
    return started[0] == argv[0] and os.path.basename(argv[0]) in SCRIPT_NAMES


def starting_line(argv: Sequence[str]) -> str:
    """The one line a Ctrl-C while the command line starts prints, naming the command (the
    first argument that is not an option) when there is one."""
    command = next((a for a in argv[1:] if a and not a.startswith("-")), None)
    where = f"nvfp4lab {command}" if command is not None else "nvfp4lab"
    return f"{where}: interrupted while starting; nothing was done"


#: Whether :func:`guard` installed its handler: this process is the command line.
_guarded = False
#: The exit status a Ctrl-C after the command returned ends the process with (:func:`finished`).
_exit_code: int | None = None


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """The SIGINT handler :func:`guard` installs: the one line, then exit 130 at once (nothing
    has been written or started yet; the interpreter's exit would first finish tearing down
    half-imported extension modules)."""
    try:
        sys.stdout.flush()
        print(starting_line(sys.argv), file=sys.stderr, flush=True)
    finally:
        os._exit(INTERRUPTED_EXIT)


def _exit_now(signum: int, frame: FrameType | None) -> None:
    """The SIGINT handler :func:`finished` installs: the command is done, so end the process
    now with its exit status (what it printed is flushed first)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(INTERRUPTED_EXIT if _exit_code is None else _exit_code)


def _last_at_exit() -> None:
    """The last ``atexit`` callback (registered by :func:`guard` before any other). Python
    stops running signal handlers after the ``atexit`` callbacks and tears down its modules
    (torch's take 0.4–1 s), when a SIGINT would kill the process silently (status -2): ignore
    it instead, so the status stays the command's. And a command stopped by Ctrl-C ends here,
    with status 130: its cleanup has run, and CPython (3.11) would otherwise turn the status
    of ``python -m nvfp4lab`` into death by SIGINT (-2) whenever the KeyboardInterrupt had
    passed through a nested ``PyRun_*`` call (an extension module running Python code), which
    marks it "unhandled" even though the command handled it (seen once in ~100 interrupts of
    ``audit``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _exit_code == INTERRUPTED_EXIT:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(INTERRUPTED_EXIT)


def guard() -> None:
    """Install :func:`_interrupted` for SIGINT when this process is the command line
    (:func:`is_command_line`) and Python's own handler is the one in place (a caller's own
    handler, or SIGINT ignored, is left alone)."""
    if not is_command_line(sys.argv, getattr(sys, "orig_argv", ())):
        return
    global _guarded
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    try:
        signal.signal(signal.SIGINT, _interrupted)
    except ValueError:  # not the main thread: its caller owns signal handling
        return
    atexit.register(_last_at_exit)
    _guarded = True


def release() -> None:
    """Put Python's own SIGINT handler back if :func:`guard` installed one (Ctrl-C raises
    KeyboardInterrupt again: the command's own handling). Anything else is left alone."""
    if signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def finished(code: int) -> None:
    """The command returned exit status ``code``: in the command line's process (where
    :func:`guard` acted), a Ctrl-C from now on, while Python exits (threads joined, ``atexit``
    callbacks), ends the process at once with ``code``, never with a traceback. Elsewhere (a
    test calling :func:`nvfp4lab.cli.main`) nothing changes."""
    global _exit_code
    if _guarded and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        _exit_code = code
        signal.signal(signal.SIGINT, _exit_now)


guard()  # on import: nvfp4lab/__init__.py imports this module before anything heavy
