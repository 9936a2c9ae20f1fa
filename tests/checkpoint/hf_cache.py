"""A checkpoint laid out as huggingface_hub's cache lays out a downloaded repository, and
folders holding what a hostile or careless download can hold (links out of the folder,
devices, FIFOs, git-LFS pointers)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

#: The files huggingface_hub stores as LFS blobs (named by the sha256 of their content); every
#: other file is a git blob, named by git's sha1 of ``blob <size>\0<content>``.
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")

#: The text git leaves for an LFS file that ``git lfs pull`` has not fetched.
LFS_POINTER = (b"version https://git-lfs.github.com/spec/v1\n"
               b"oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
               b"size 71303168\n")


def blob_name(rel: Path, data: bytes) -> str:
    """The blob file name huggingface_hub gives ``rel``'s content ``data``: sha256 (64 hex)
    for an LFS file, git's blob sha1 (40 hex) otherwise."""
    if rel.suffix in LFS_SUFFIXES:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hf_cache_layout(checkpoint: Path, cache: Path, repo_id: str = "acme/tiny-nvfp4",
                    revision: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Copy the files of the folder ``checkpoint`` into ``cache`` as huggingface_hub does:
    ``models--<org>--<name>/blobs/<hash>``, ``snapshots/<revision>/<rel> -> ../../blobs/<hash>``
    (relative links, one ``../`` more per sub-folder), ``refs/main`` holding ``revision``.
    Returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    for file in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        rel = file.relative_to(checkpoint)
        data = file.read_bytes()
        blob = repo / "blobs" / blob_name(rel, data)
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def sharded_checkpoint(path: Path, seed: int = 0) -> Path:
    """``tiny_llama(seed)`` quantized (RTN) and saved at ``path`` as compressed-tensors in
    several shards with an index (``model.safetensors.index.json``)."""
    from nvfp4lab import checkpoint
    from nvfp4lab.execution import quantize_model
    from tests.checkpoint.builders import tiny_llama

    model = tiny_llama(seed=seed)
    quantize_model(model, backend="w4a16", share_global_scale="llama")
    checkpoint.save_pretrained(model, path, max_shard_bytes=40_000)
    assert len(list(path.glob("*.safetensors"))) > 1
    return path
