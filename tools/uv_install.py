"""`uv pip install` with what pip's own configuration tells pip: the Makefile's fast installer.

Run by the venv's python before nvfp4lab is installed (a plain script, standard library only):
``python tools/uv_install.py [--compile-bytecode] PIP_INSTALL_ARGS...``. It installs ``ARGS`` into
that python's environment with ``python -m uv pip install``, after reading pip's configuration
(``python -m pip config list``: the configuration files and the ``PIP_*`` environment) and
handing uv what decides where packages come from, since uv reads none of it:

* ``index-url``, ``extra-index-url``, ``find-links``, ``constraint``, ``no-index`` become uv's
  options of the same name, and ``cert`` becomes ``SSL_CERT_FILE``; uv then picks the best
  version across all indexes as pip does (``--index-strategy unsafe-best-match``, not uv's
  default of the first index that has the package);
* settings that change nothing about which files are installed (timeouts, the version check,
  progress bars, the cache) are left out;
* anything else, or one setting given different values by two sources, exits 3 with one line
  naming it, without installing: the Makefile then installs with pip, which follows it.

Exit status: uv's own (0 when installed), 3 as above, 4 when uv does not run here. The Makefile
installs with pip after any non-zero status, so a uv failure costs time, never a wrong venv.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

#: pip setting -> the uv option taking each of its values (whitespace-separated lists).
PASSED_ON = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
#: pip settings with nothing to hand on: they do not change which files are installed.
HARMLESS = frozenset({
    "timeout", "default-timeout", "retries", "disable-pip-version-check", "progress-bar",
    "no-cache-dir", "cache-dir", "quiet", "verbose", "no-color", "root-user-action",
    "no-warn-script-location", "no-input", "log", "require-virtualenv",
})
#: Exit status: pip's configuration holds a setting uv would not follow.
UNFOLLOWED = 3
#: Exit status: ``python -m uv`` does not run.
NO_UV = 4


def pip_settings(listing: str) -> dict[str, str]:
    """``key -> value`` from ``pip config list`` output (``section.key='value'`` lines; the
    ``:env:`` section holds the ``PIP_*`` variables). ValueError names a key that two sources
    set to different values, or a line that is not a setting."""
    found: dict[str, str] = {}
    for line in listing.splitlines():
        if not line.strip():
            continue
        name, sep, quoted = line.partition("=")
        if not sep or "." not in name:
            raise ValueError(f"unreadable line of pip config list: {line!r}")
        key = name.rsplit(".", 1)[1].strip().lower().replace("_", "-")
        try:
            value = ast.literal_eval(quoted.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"unreadable line of pip config list: {line!r}") from None
        if key in found and found[key] != value:
            raise ValueError(f"pip's configuration sets {key} twice, to {found[key]!r} and "
                             f"{value!r}")
        found[key] = str(value)
    return found


def uv_options(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(uv options, environment additions) that follow ``settings``; ValueError names the first
    setting uv would not follow."""
    options = ["--index-strategy", "unsafe-best-match"]
    environment: dict[str, str] = {}
    for key, value in sorted(settings.items()):
        if key in PASSED_ON:
            for item in value.split():
                options += [PASSED_ON[key], item]
        elif key == "no-index":
            if value.strip().lower() in ("1", "true", "yes", "on"):
                options.append("--no-index")
        elif key == "cert":
            environment["SSL_CERT_FILE"] = value
        elif key not in HARMLESS:
            raise ValueError(f"pip's configuration sets {key}={value!r}, which uv does not follow")
    return options, environment


def main(argv: list[str]) -> int:
    compile_flag = ["--compile-bytecode"] if argv[:1] == ["--compile-bytecode"] else []
    args = argv[len(compile_flag):]
    python = sys.executable
    if subprocess.run([python, "-m", "uv", "--version"], capture_output=True).returncode:
        print("uv does not run here", file=sys.stderr)
        return NO_UV
    listing = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True,
                             text=True)
    try:
        if listing.returncode:
            raise ValueError(f"pip config list failed: {listing.stderr.strip()[-200:]}")
        options, environment = uv_options(pip_settings(listing.stdout))
    except ValueError as error:
        print(f"uv: {error}", file=sys.stderr)
        return UNFOLLOWED
    print("uv pip install " + " ".join(args), flush=True)
    command = [python, "-m", "uv", "pip", "install", "-q", "--python", python, *options,
               *compile_flag, *args]
    return subprocess.run(command, env={**os.environ, **environment}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
