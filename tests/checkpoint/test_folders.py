"""Loss-free folder writes: what counts as foreign, the refusals, the final rename; what may be
read from a checkpoint folder (links, devices, FIFOs, the Hugging Face cache layout)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nvfp4lab.checkpoint.folders import (
    OWNER_MARKER,
    check_target,
    folder_entries,
    fresh_dir,
    hf_blobs,
    hf_snapshot,
    lfs_pointer,
    remove_stale_dirs,
    replace_dir,
    unsafe_entries,
    unsafe_message,
)
from tests.checkpoint.hf_cache import LFS_POINTER, hf_cache_layout

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


# --------------------------------------------------------------------------------------------
# issue 32: what may be read from a checkpoint folder (one rule), the Hugging Face cache layout


def test_issue32_the_one_rule_names_links_out_devices_fifos_and_loops(tmp_path: Path) -> None:
    """Cases 1 and 2: every entry that is not a regular file inside the folder is named, with
    its link target; regular files and links inside pass."""
    (tmp_path / "secret").write_text("private")
    src = tmp_path / "a" / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "alias.json").symlink_to("config.json")  # inside: fine
    (src / "sub" / "up.json").symlink_to("../config.json")  # inside: fine
    (src / "README.md").symlink_to("/etc/hostname")
    (src / "sub" / "notes.txt").symlink_to("/etc/passwd")
    (src / "sub" / "s").symlink_to("../../../secret")
    (src / "zero").symlink_to("/dev/zero")
    os.mkfifo(src / "pipe")
    (src / "folder").symlink_to("sub")
    (src / "gone").symlink_to("nothing-here")
    (src / "loop").symlink_to("loop")
    found = unsafe_entries(src, [rel for rel, _ in folder_entries(src)])
    assert found == [
        "README.md -> /etc/hostname (outside the checkpoint folder)",
        "folder -> sub (a folder)",
        "gone -> nothing-here (a dangling link, pointing to nothing)",
        "loop -> loop (a symlink loop)",
        "pipe (a named pipe)",
        "sub/notes.txt -> /etc/passwd (outside the checkpoint folder)",
        f"sub/s -> ../../../secret = {tmp_path / 'secret'} (outside the checkpoint folder)",
        "zero -> /dev/zero (outside the checkpoint folder; a character device)",
    ]
    line = unsafe_message(src, found)
    assert line.startswith(f"{src}: 8 entries nvfp4lab will not read (README.md")
    assert "\n" not in line and "pipe (a named pipe) and 3 more)" in line  # thousands: one line
    inside = [Path("config.json"), Path("alias.json"), src / "sub/up.json"]
    assert unsafe_entries(src, inside) == []


def test_issue32_hf_cache_snapshot_links_into_its_blobs_pass(tmp_path: Path) -> None:
    """Case 14: a snapshot built as huggingface_hub lays it out (its own lookup finds every file
    there) passes the rule; a link to another repository's blobs does not."""
    from huggingface_hub import try_to_load_from_cache

    plain = tmp_path / "plain"
    (plain / "1_Pooling").mkdir(parents=True)
    (plain / "config.json").write_text('{"a": 1}')
    (plain / "model.safetensors").write_bytes(b"weights")
    (plain / "1_Pooling" / "config.json").write_text("{}")
    snapshot = hf_cache_layout(plain, tmp_path / "hub", "acme/tiny")
    for rel in ("config.json", "model.safetensors", "1_Pooling/config.json"):
        got = try_to_load_from_cache("acme/tiny", rel, cache_dir=tmp_path / "hub")
        assert got == str(snapshot / rel)  # huggingface_hub's own reading of the layout
        assert os.readlink(snapshot / rel).startswith("../" * (rel.count("/") + 2) + "blobs/")
    entries = [rel for rel, _ in folder_entries(snapshot)]
    assert len(entries) == 3 and unsafe_entries(snapshot, entries) == []
    assert unsafe_entries(snapshot / "1_Pooling", [Path("config.json")]) == []
    assert hf_blobs(snapshot) == (tmp_path / "hub" / "models--acme--tiny" / "blobs").resolve()
    other = hf_cache_layout(plain, tmp_path / "hub", "acme/other")
    stolen = snapshot / "stolen.json"
    stolen.symlink_to(os.readlink(other / "config.json").replace(
        "../../blobs", "../../../models--acme--other/blobs"))
    assert unsafe_entries(snapshot, [stolen]) == [
        f"stolen.json -> {os.readlink(stolen)} = {(other / 'config.json').resolve()} "
        "(outside the checkpoint folder)"]
    assert hf_blobs(plain) is None


def test_issue32_hf_repo_folder_resolves_to_its_refs_main_snapshot(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    snapshot = hf_cache_layout(plain, tmp_path / "hub", "acme/tiny", revision="a" * 40)
    repo = snapshot.parent.parent
    assert hf_snapshot(repo) == snapshot and hf_snapshot(snapshot) == snapshot
    assert hf_snapshot(plain) == plain
    for bad in ("../../../etc", "b" * 40, ""):
        (repo / "refs" / "main").write_text(bad)
        with pytest.raises(ValueError, match=rf"refs/main names no snapshot .*pass one of its "
                                             rf"snapshot folders \({snapshot}\)"):
            hf_snapshot(repo)


def test_issue32_lfs_pointers_are_told_from_files(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(LFS_POINTER)
    (tmp_path / "real.gguf").write_bytes(b"GGUF" + bytes(60))
    os.mkfifo(tmp_path / "pipe.gguf")  # never opened (it would block)
    assert lfs_pointer(tmp_path / "model.gguf")
    assert not lfs_pointer(tmp_path / "real.gguf") and not lfs_pointer(tmp_path / "pipe.gguf")
