"""The split of ``checkpoint/files.py`` and ``checkpoint/formats/gguf.py`` keeps every old name:
``files.py`` re-exports the same objects (and warns that it is deprecated), a patch through it
reaches the code that calls the name, and ``formats.gguf`` still offers its public names."""

from __future__ import annotations

import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

from nvfp4lab.checkpoint import folders, records, refusals, rows, safetensors_files
from nvfp4lab.checkpoint.formats import gguf, gguf_names, gguf_read, gguf_write
from nvfp4lab.vocab import Scheme

ROOT = Path(__file__).resolve().parents[2]

#: ``nvfp4lab.checkpoint.files.__all__`` before the split (the names callers may import).
OLD_FILES_NAMES = [
    "CONFIG_NAME",
    "LFS_POINTER_NOTE",
    "OWNER_MARKER",
    "PICKLE_SUFFIXES",
    "SOURCE_ATTRIBUTE",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "CheckpointError",
    "Contents",
    "LayerNames",
    "RowReader",
    "RowView",
    "SafetensorsContainer",
    "Shard",
    "StoredTensor",
    "StoredWeights",
    "TaskRunner",
    "TensorInfo",
    "TensorSource",
    "Unquantized",
    "WeightFiles",
    "block_scale_error",
    "check_readable",
    "check_target",
    "config_problem",
    "folder_entries",
    "fresh_dir",
    "lfs_pointer",
    "missing_tensor",
    "parse_json",
    "quantization_block",
    "read_exact",
    "read_header",
    "read_json",
    "read_like",
    "read_rows",
    "read_scalar",
    "refuse_pickle",
    "remove_stale_dirs",
    "replace_dir",
    "safetensors_config",
    "safetensors_weights",
    "stored_tensor",
    "tensor_bytes",
    "tensor_scale_error",
    "weight_files",
    "write_safetensors",
    "write_safetensors_checkpoint",
]

#: ``nvfp4lab.checkpoint.formats.gguf.__all__`` before the split.
OLD_GGUF_NAMES = [
    "CONFIG_KEY",
    "FFN_SCALE_IGNORED",
    "GGUF_ARCHITECTURES",
    "NAIVE_NOTE",
    "NAMES",
    "SPEC",
    "SUFFIX",
    "WEIGHTS_FILE",
    "Gguf",
    "GgufConfig",
    "GgufView",
    "LlamaCppScaleWarning",
    "gguf_file",
    "gguf_order",
    "gguf_reader",
]


def test_files_reexports_the_same_objects_and_warns() -> None:
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from nvfp4lab.checkpoint import files\n"
        "print([str(w.message) for w in caught if w.category is DeprecationWarning])\n"
        f"names = {OLD_FILES_NAMES!r}\n"
        "missing = [n for n in names if not hasattr(files, n)]\n"
        "print('missing', missing, sorted(set(names) - set(files.__all__)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    warned, found = done.stdout.splitlines()
    assert "nvfp4lab.checkpoint.files is deprecated" in warned
    assert found == "missing [] []"
    files = _old_files()
    homes = (folders, records, refusals, rows, safetensors_files)
    for name in OLD_FILES_NAMES:
        if name == "config_problem":
            continue
        (home,) = [m for m in homes if name in getattr(m, "__all__", ())]
        assert getattr(files, name) is getattr(home, name), name
    assert files._json_depth is refusals._json_depth  # private helpers resolve too


def _old_files() -> types.ModuleType:
    """The deprecated module, imported without its warning (checked in a fresh process)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from nvfp4lab.checkpoint import files
    return files


def test_a_patch_through_files_reaches_its_callers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``monkeypatch.setattr(files, "write_safetensors", ...)`` (as older tests do) patches the
    function the safetensors container calls, and undoing it restores both."""
    files = _old_files()

    original = safetensors_files.write_safetensors

    def broken(*args: object, **kwargs: object) -> int:
        raise OSError("write failed")

    with monkeypatch.context() as patch:
        patch.setattr(files, "write_safetensors", broken)
        assert safetensors_files.write_safetensors is broken
        shard = records.Shard("model.safetensors", ())
        contents = records.Contents((shard,), "{}", Scheme.NVFP4A16, records.Unquantized((), ()))
        with pytest.raises(OSError, match="write failed"):
            safetensors_files.write_safetensors_checkpoint(tmp_path, contents, lambda *a: None)
    assert safetensors_files.write_safetensors is original
    assert files.write_safetensors is original


def test_gguf_keeps_its_public_names() -> None:
    """Every old public name of ``formats.gguf`` is the object its new module defines."""
    for name in OLD_GGUF_NAMES:
        assert hasattr(gguf, name), name
    assert gguf.gguf_reader is gguf_read.gguf_reader
    assert gguf.GGUF_ARCHITECTURES is gguf_names.GGUF_ARCHITECTURES
    assert gguf.WEIGHTS_FILE == gguf_write.WEIGHTS_FILE == "model.gguf"
    assert gguf._names is gguf_names.model_names  # tests clear its cache through gguf
    assert callable(gguf._names.cache_clear)
