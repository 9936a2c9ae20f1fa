"""The report runner's output folder: what it may write there, and what it must leave alone.

``nvfp4lab report`` writes, per notebook ``NN_name.ipynb`` it runs, ``NN_name.ipynb`` (executed)
and ``NN_name.html`` into ``--out``, and ``index.html``. Before anything runs,
:func:`check_outputs` refuses a run that would replace a file the runner did not write: a
notebook being run (``--out`` is the notebooks' own folder: always refused), a folder in a page's
place (always), or a user's file under a page's name (unless ``overwrite``). The runner's own
pages are those listed in ``<out>/.nvfp4lab-report`` (:data:`MANIFEST_NAME`, which
:func:`record_outputs` extends on every run), or, in a folder written before that list existed,
pages recognised by their content.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["MANIFEST_NAME", "check_out_dir", "check_outputs", "output_names", "record_outputs"]

#: The list, in a report folder, of the files ``nvfp4lab report`` wrote there (one name per
#: line): a later run replaces those; any other file it would replace needs ``overwrite=True``.
MANIFEST_NAME = ".nvfp4lab-report"


def check_out_dir(out_dir: str | Path) -> Path:
    """``out_dir`` as a writable folder (created if missing), or ValueError naming the problem:
    an existing file, a path under a file, or a folder this user cannot write to."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file, not a folder; pass a folder for the HTML")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(
                    f"--out {str(out)!r}: {str(parent)!r} is a file, so no folder can be made "
                    "under it; pass another folder"
                )
            break
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {str(out)!r} cannot be created ({exc.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {str(out)!r} is not writable by this user; pass another folder")
    return out


def output_names(notebooks: Iterable[Path], *, index: bool) -> list[str]:
    """The file names a run of ``notebooks`` writes into its folder, in order (the executed
    notebook and its page per notebook, then ``index.html`` when ``index``)."""
    names = [f"{p.stem}{ext}" for p in notebooks for ext in (".ipynb", ".html")]
    return names + (["index.html"] if index else [])


def _manifest(out: Path) -> set[str]:
    try:
        return set((out / MANIFEST_NAME).read_text(encoding="utf-8").split())
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return set()


def _looks_like_ours(file: Path, stems: set[str]) -> bool:
    """A page of a report folder written before :data:`MANIFEST_NAME` existed: the index's
    title, a notebook page's title, or papermill's record of the notebook it executed."""
    try:
        if file.suffix == ".ipynb":
            data = json.loads(file.read_text(encoding="utf-8"))
            executed = data.get("metadata", {}).get("papermill", {}).get("input_path")
            return isinstance(executed, str) and Path(executed).name == file.name
        head = file.read_bytes()[:4096].decode("utf-8", errors="replace")
    except (OSError, ValueError, AttributeError):
        return False
    title = "nvfp4lab reports" if file.name == "index.html" else file.stem
    return (file.name == "index.html" or file.stem in stems) and f"<title>{title}</title>" in head


def check_outputs(out: Path, notebooks: Sequence[Path], *, index: bool, overwrite: bool) -> None:
    """ValueError, before anything runs, when a run of ``notebooks`` into ``out`` would replace
    a file it did not write: a notebook being run (``out`` is its folder: never, even with
    ``overwrite``), a folder in the way, or a user's file under an output's name (unless
    ``overwrite``). The runner's own pages are recognised by :data:`MANIFEST_NAME`, or by their
    content when the folder predates it."""
    sources = {p.resolve() for p in notebooks}
    targets = [out / name for name in output_names(notebooks, index=index)]
    for target in targets:
        if target.resolve() in sources:
            raise ValueError(
                f"--out {str(out)!r} holds the notebooks being run: the executed copy would "
                f"replace {target.name} itself; pass another folder (default: reports)"
            )
        if target.is_dir():
            raise ValueError(
                f"--out {str(out)!r}: {target.name} is a folder where the report writes a file; "
                "move it or pass another folder"
            )
    if overwrite:
        return
    ours, stems = _manifest(out), {p.stem for p in notebooks}
    foreign = [t.name for t in targets if (t.exists() or t.is_symlink())
               and t.name not in ours and not _looks_like_ours(t, stems)]
    if foreign:
        raise ValueError(
            f"--out {str(out)!r} already holds {', '.join(foreign)}, not written by nvfp4lab "
            "report; pass --overwrite to replace them, or pass another folder"
        )


def record_outputs(out: Path, notebooks: Sequence[Path], *, index: bool) -> None:
    """Add the names a run of ``notebooks`` writes to ``out``'s :data:`MANIFEST_NAME` (written
    atomically)."""
    names = _manifest(out) | set(output_names(notebooks, index=index))
    tmp = out / f"{MANIFEST_NAME}.partial"
    tmp.write_text("".join(f"{n}\n" for n in sorted(names)), encoding="utf-8")
    os.replace(tmp, out / MANIFEST_NAME)
