"""Loss-free folder writes: what counts as foreign, the refusals, the final rename."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nvfp4lab.checkpoint.folders import (
    OWNER_MARKER,
    check_target,
    folder_entries,
    fresh_dir,
    remove_stale_dirs,
    replace_dir,
)

CHECKPOINT = frozenset({"config.json"})


def test_folder_entries_list_files_symlinks_and_empty_folders(tmp_path: Path) -> None:
    (tmp_path / "sub" / "deep").mkdir(parents=True)
    (tmp_path / "sub" / "deep" / "a.txt").write_text("a")
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "sub")  # never followed
    got = {(str(rel), kind) for rel, kind in folder_entries(tmp_path)}
    assert ("sub/deep/a.txt", "file") in got
    assert ("empty", "empty folder") in got
    assert ("link", "symlink") in got
    assert not any(rel.startswith("link/") for rel, _ in got)


def test_check_target_keeps_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "ck"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"")
    check_target(target, True, CHECKPOINT)  # only checkpoint files: may be replaced
    with pytest.raises(FileExistsError, match="not empty; pass overwrite=True"):
        check_target(target, False, CHECKPOINT)
    (target / "mydata").symlink_to(tmp_path)
    (target / "runs").mkdir()
    with pytest.raises(FileExistsError, match=r"mydata \(symlink\).*runs \(empty folder\)"):
        check_target(target, True, CHECKPOINT)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError, match="afile is a file"):
        check_target(afile / "dst", False, CHECKPOINT)


def test_replace_dir_refuses_a_target_that_changed(tmp_path: Path) -> None:
    target = tmp_path / "ck"
    tmp = fresh_dir(target, "tmp")
    (tmp / "config.json").write_text("new")
    target.mkdir()
    (target / "notes.txt").write_text("mine")  # appeared while the new folder was assembled
    with pytest.raises(FileExistsError):
        replace_dir(tmp, target, overwrite=False, checkpoint_files=CHECKPOINT)
    assert (target / "notes.txt").read_text() == "mine"
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        replace_dir(tmp, target, overwrite=True, checkpoint_files=CHECKPOINT)
    assert (target / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ck.old")) == []
    (target / "notes.txt").unlink()
    replace_dir(tmp, target, overwrite=True, checkpoint_files=CHECKPOINT)
    assert (target / "config.json").read_text() == "new" and not tmp.exists()


def test_stale_temporary_folders_of_dead_processes_are_removed(tmp_path: Path) -> None:
    target = tmp_path / "ck"
    mine = fresh_dir(target, "tmp")
    assert (mine / OWNER_MARKER).read_text().strip() == str(os.getpid())
    dead = fresh_dir(target, "tmp")
    (dead / OWNER_MARKER).write_text("999999999")  # no such process
    removed = remove_stale_dirs(target)
    assert removed == [dead] and mine.exists() and not dead.exists()
