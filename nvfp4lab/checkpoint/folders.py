"""Loss-free, atomic folder writes for checkpoints (and every other folder nvfp4lab writes).

A folder is assembled in a hidden temporary sibling (:func:`fresh_dir`, marked with the PID of
the process writing it so a crashed run's leftovers can be told apart: :func:`remove_stale_dirs`)
and renamed into place at the end (:func:`replace_dir`). Before anything is written,
:func:`check_target` refuses a target holding anything that is not a checkpoint file (listing
files, symlinks and empty folders, :func:`folder_entries`); the final rename refuses a target that
changed meanwhile, so nothing a user put there is lost.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from pathlib import Path

__all__ = [
    "OWNER_MARKER",
    "check_target",
    "folder_entries",
    "fresh_dir",
    "remove_stale_dirs",
    "replace_dir",
]


#: Written into every temporary folder: the PID of the process assembling it.
OWNER_MARKER = ".nvfp4lab-owner"


def _sibling(target: Path, tag: str) -> Path:
    """An unused hidden sibling name ``.<name>.<tag>-<random>`` of ``target``."""
    for _ in range(100):
        candidate = target.parent / f".{target.name}.{tag}-{secrets.token_hex(4)}"
        if not candidate.exists():
            return candidate
    raise FileExistsError(f"cannot find a free temporary name next to {target}")


def fresh_dir(target: Path, tag: str) -> Path:
    """A new hidden sibling folder ``.<name>.<tag>-<random>`` of ``target`` (mode from the
    umask), marked (:data:`OWNER_MARKER`) with this process's PID so that a later save can tell
    it is stale if we die; remove the marker before the folder becomes the checkpoint."""
    candidate = _sibling(target, tag)
    candidate.mkdir()
    (candidate / OWNER_MARKER).write_text(str(os.getpid()), encoding="utf-8")
    return candidate


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_dirs(target: Path) -> list[Path]:
    """Remove the temporary siblings of ``target`` left by saves whose process died (their
    owner PID is gone); folders without the marker, or of a live process, are kept."""
    removed = []
    for candidate in target.parent.glob(f".{target.name}.*-*"):
        marker = candidate / OWNER_MARKER
        try:
            pid = int(marker.read_text(encoding="utf-8").strip())
        except (OSError, ValueError):
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(candidate, ignore_errors=True)
            removed.append(candidate)
    return removed


def _checkpoint_member(rel: Path, names: frozenset[str]) -> bool:
    text = rel.as_posix()
    return text in names or rel.suffix == ".safetensors" or text.endswith(".safetensors.index.json")


def folder_entries(folder: Path) -> list[tuple[Path, str]]:
    """Everything under ``folder`` as (relative path, kind), sorted: kind is "file", "symlink"
    (to anything: never followed) or "empty folder"; a folder that holds something is not
    listed itself. An unreadable folder raises PermissionError naming it."""
    out: list[tuple[Path, str]] = []
    try:
        children = sorted(os.scandir(folder), key=lambda e: e.name)
    except PermissionError:
        raise PermissionError(f"{folder}: permission denied reading it, so nvfp4lab cannot tell "
                              "what it holds; fix its permissions or pick another path") from None
    for child in children:
        rel = Path(child.name)
        if child.is_symlink():
            out.append((rel, "symlink"))
        elif child.is_dir():
            inner = folder_entries(Path(child.path))
            out += [(rel / r, k) for r, k in inner] if inner else [(rel, "empty folder")]
        else:
            out.append((rel, "file"))
    return out


def _foreign(folder: Path, checkpoint_files: frozenset[str]) -> list[str]:
    """What ``folder`` holds besides checkpoint files: symlinks and empty folders always
    count (as they would be lost too)."""
    return [
        str(rel) + ("" if kind == "file" else f" ({kind})")
        for rel, kind in folder_entries(folder)
        if kind == "symlink" or not _checkpoint_member(rel, checkpoint_files)
    ]


def _shown(items: list[str]) -> str:
    return ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")


def check_target(target: Path, overwrite: bool, checkpoint_files: frozenset[str]) -> None:
    """Refuse a save that would lose data: ``target`` may be missing, an empty folder, or (with
    ``overwrite``) a folder holding only checkpoint files (``checkpoint_files``, safetensors
    weights and their index). Anything else (symlinks and empty folders included) raises
    FileExistsError naming what would be lost; a parent path that is a file raises
    NotADirectoryError naming it, an unreadable folder PermissionError."""
    above = next((p for p in target.parents if os.path.lexists(p)), None)
    if above is not None and not above.is_dir():
        raise NotADirectoryError(
            f"{above} is a file, so {target} cannot be created inside it; pass a path whose "
            "parent folders are folders (the file is left as it is)"
        )
    if target.exists() and not target.is_dir():
        raise FileExistsError(
            f"{target} is a file, not a folder; a checkpoint is a folder: pass another path "
            "(the file is left as it is)"
        )
    if target.is_symlink():
        raise FileExistsError(f"{target} is a symlink; pass the folder it points to or another "
                              "path (the link is left as it is)")
    if not target.is_dir() or not folder_entries(target):
        return
    if not overwrite:
        raise FileExistsError(f"{target} exists and is not empty; pass overwrite=True to replace "
                              "the checkpoint there")
    foreign = _foreign(target, checkpoint_files)
    if foreign:
        raise FileExistsError(
            f"{target} holds files that are not part of a checkpoint ({_shown(foreign)}); "
            "overwrite=True replaces only a checkpoint folder and they would be lost: move them "
            "away or save to another path"
        )


def _changed(target: Path, what: str) -> FileExistsError:
    return FileExistsError(
        f"{target} changed while the new checkpoint was being written ({what}); it is left as it "
        "is: check that no other program or save writes there, then run again"
    )


def _rename_into(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``, which must be missing or an empty folder by now (the
    kernel's rename refuses a non-empty folder, atomically)."""
    try:
        os.rename(tmp, target)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        found = [] if not target.is_dir() else _foreign(target, frozenset())
        what = f"it now holds {_shown(found)}" if found else "it is now a file"
        raise _changed(target, what) from None


def replace_dir(tmp: Path, target: Path, *, overwrite: bool = True,
                checkpoint_files: frozenset[str] | None = None) -> None:
    """Move the finished ``tmp`` to ``target``, never destroying what appeared meanwhile.

    Without ``overwrite``, ``target`` must still be missing or an empty folder (another save
    that got there first, or a file someone put there, makes this raise FileExistsError). With
    it, the old ``target`` is moved aside first and, when ``checkpoint_files`` is given,
    checked again as :func:`check_target` does: anything else in it puts it back and raises;
    it is removed only after ``tmp`` is in place."""
    if not overwrite or not target.is_dir() or target.is_symlink():
        _rename_into(tmp, target)
        return
    old = _sibling(target, "old")
    os.rename(target, old)
    try:
        foreign = [] if checkpoint_files is None else _foreign(old, checkpoint_files)
        if foreign:
            raise _changed(target, f"it now holds files that are not part of a checkpoint: "
                                   f"{_shown(foreign)}")
        _rename_into(tmp, target)
    except BaseException:
        try:
            os.rename(old, target)
        except OSError:
            raise _changed(target, f"the folder that was there is kept as {old}") from None
        raise
    shutil.rmtree(old, ignore_errors=True)
