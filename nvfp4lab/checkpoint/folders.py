"""Loss-free, atomic folder writes for checkpoints (and every other folder nvfp4lab writes).

A folder is assembled in a hidden temporary sibling (:func:`fresh_dir`, marked with the PID of
the process writing it so a crashed run's leftovers can be told apart: :func:`remove_stale_dirs`)
and renamed into place at the end (:func:`replace_dir`). Before anything is written,
:func:`check_target` refuses a target holding anything that is not a checkpoint file (listing
files, symlinks and empty folders, :func:`folder_entries`); the final rename refuses a target that
changed meanwhile, so nothing a user put there is lost.

What nvfp4lab reads from a checkpoint folder obeys one rule (:func:`unsafe_entries`): regular
files whose real path lies inside the folder, or, for a Hugging Face cache snapshot
(``models--<org>--<name>/snapshots/<rev>``, :func:`hf_blobs`), inside its repository's ``blobs/``
folder, where huggingface_hub's relative links ``../../blobs/<hash>`` point. A link elsewhere
(``README.md -> /etc/hostname``) would pull a local file into a folder the user may upload; a
FIFO, a device (``-> /dev/zero``), a folder, a dangling link or a link loop cannot be read as a
file. :func:`hf_snapshot` turns a ``models--*`` folder into the snapshot ``refs/main`` names;
:func:`lfs_pointer` tells an un-fetched git-LFS pointer file from the file it stands for.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "LFS_POINTER_NOTE",
    "OWNER_MARKER",
    "check_target",
    "folder_entries",
    "fresh_dir",
    "hf_blobs",
    "hf_snapshot",
    "lfs_pointer",
    "remove_stale_dirs",
    "replace_dir",
    "unsafe_entries",
    "unsafe_message",
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


# ---------------------------------------------------------------------------------------------
# what may be read from a checkpoint folder


#: The first line of a git-LFS pointer file (the text git leaves where ``git lfs pull`` has not
#: fetched the real file).
LFS_POINTER_HEAD = b"version https://git-lfs.github.com/spec/v1"

#: How an LFS pointer read as a checkpoint file is named, after its path.
LFS_POINTER_NOTE = ("is an un-fetched git-LFS pointer (a small text file standing for the real "
                    "one); run git lfs pull in its repository (or download the file) and try "
                    "again")


def lfs_pointer(file: Path) -> bool:
    """Whether the regular file ``file`` starts as a git-LFS pointer does (False when it
    cannot be read; never opens anything but a regular file, which could block)."""
    try:
        if not stat.S_ISREG(os.stat(file).st_mode):
            return False
        with open(file, "rb") as handle:
            return handle.read(len(LFS_POINTER_HEAD)) == LFS_POINTER_HEAD
    except OSError:
        return False


#: A Hugging Face cache repository folder: ``models--<org>--<name>`` (huggingface_hub's
#: ``repo_folder_name``).
HF_REPO_PREFIX = "models--"


def hf_blobs(folder: Path) -> Path | None:
    """The ``blobs/`` folder (resolved) of the Hugging Face cache repository whose snapshot
    ``folder`` is or lies in (``models--*/snapshots/<rev>[/sub]``, symlinks resolved), else
    None."""
    real = folder.resolve()
    for inner in (real, *real.parents):
        snapshots = inner.parent
        if snapshots.name == "snapshots" and snapshots.parent.name.startswith(HF_REPO_PREFIX):
            return (snapshots.parent / "blobs").resolve()
    return None


_REVISION = re.compile(r"[0-9A-Za-z._-]+")


def hf_snapshot(path: Path) -> Path:
    """``path``, or, when it is a Hugging Face cache repository folder (``models--*`` holding
    ``snapshots/`` and no ``config.json``), the snapshot its ``refs/main`` names; ValueError
    naming the folders to pass when ``refs/main`` is missing, unreadable or names no
    snapshot."""
    if not (path.name.startswith(HF_REPO_PREFIX) and (path / "snapshots").is_dir()
            and not (path / "config.json").exists()):
        return path
    snapshots = sorted(p.name for p in (path / "snapshots").iterdir() if p.is_dir())
    choices = ", ".join(str(path / "snapshots" / name) for name in snapshots[:3]) or "none"
    ref = path / "refs" / "main"
    try:
        revision = ref.read_text(encoding="ascii").strip() if ref.is_file() else ""
    except (OSError, UnicodeDecodeError):
        revision = ""
    if (not _REVISION.fullmatch(revision) or revision in (".", "..")
            or not (path / "snapshots" / revision).is_dir()):
        raise ValueError(
            f"{path} is a Hugging Face cache folder whose refs/main names no snapshot "
            f"({revision[:60]!r}); pass one of its snapshot folders ({choices})")
    return path / "snapshots" / revision


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _not_a_file(path: Path) -> str | None:
    """What ``path`` (links followed) is when it is not a regular file, else None."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a dangling link, pointing to nothing"
    except OSError as exc:
        return "a symlink loop" if exc.errno == errno.ELOOP else f"unreadable ({exc.strerror})"
    return next((kind for test, kind in _KINDS if test(mode)), None)


def unsafe_entries(folder: Path, paths: Iterable[Path]) -> list[str]:
    """Each of ``paths`` (inside ``folder``, absolute or relative to it) that nvfp4lab must not
    read, described in a few words (``README.md -> /etc/hostname (outside the checkpoint
    folder)``, ``zero -> /dev/zero (outside the checkpoint folder; a character device)``,
    ``pipe (a named pipe)``): those whose real path lies outside ``folder`` (and
    outside the ``blobs/`` folder of a Hugging Face cache snapshot, :func:`hf_blobs`), and
    those that are not regular files. Empty when all may be read."""
    base = folder.absolute()
    root = base.resolve()
    blobs = hf_blobs(base)
    out: list[str] = []
    for given in paths:
        path = base / given
        rel = path.relative_to(base) if path.is_relative_to(base) else path
        problems = []
        real = Path(os.path.realpath(path))
        if not (real.is_relative_to(root) or (blobs is not None and real.parent == blobs)):
            problems.append("outside the checkpoint folder")
        kind = _not_a_file(path)
        if kind is not None:
            problems.append(kind)
        if not problems:
            continue
        if path.is_symlink():
            target = os.readlink(path)
            shown = f"{rel} -> {target}"
            if not os.path.isabs(target) and kind is None:
                shown += f" = {real}"
        else:
            shown = str(rel) if real == path else f"{rel} (= {real})"
        out.append(f"{shown} ({'; '.join(problems)})")
    return out


def unsafe_message(folder: Path, found: list[str]) -> str:
    """The one-line refusal of what :func:`unsafe_entries` found in ``folder``."""
    return (
        f"{folder}: {len(found)} entr{'y' if len(found) == 1 else 'ies'} nvfp4lab will not read "
        f"({_shown(found)}); it reads and copies only regular files inside the checkpoint "
        "folder (and a Hugging Face cache snapshot's links into its blobs/ folder), so that no "
        "other file of this machine ends up in a checkpoint: replace each with a regular file "
        "(a copy of what it should hold), or remove it"
    )
