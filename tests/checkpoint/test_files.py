"""checkpoint.safetensors_files (with records, rows, refusals): safetensors headers read and
files written byte for byte (against hand-built bytes and the safetensors library), weight-file
discovery, the quantization_config block."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nvfp4lab.checkpoint.records import LayerNames, StoredTensor
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.checkpoint.safetensors_files import (
    quantization_block,
    read_header,
    weight_files,
    write_safetensors,
)


def _hand_built(header: dict[str, object], data: bytes) -> bytes:
    """A safetensors file from its definition: u64 little-endian header length, the JSON
    header padded with spaces to 8 bytes, the data."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def test_write_safetensors_is_the_format_byte_for_byte(tmp_path: Path) -> None:
    a = struct.pack("<3f", 1.0, -2.5, 3.25)
    b = bytes([7, 8, 9, 10])
    tensors = [StoredTensor("a", "F32", (3,), 12, a), StoredTensor("b", "U8", (2, 2), 4, b)]
    total = write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    expected = _hand_built({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
                            "b": {"dtype": "U8", "shape": [2, 2], "data_offsets": [12, 16]},
                            "__metadata__": {"format": "pt"}}, a + b)
    assert total == 16
    assert (tmp_path / "x.safetensors").read_bytes() == expected
    loaded = load_file(str(tmp_path / "x.safetensors"))  # the library reads it
    assert loaded["a"].tolist() == [1.0, -2.5, 3.25]
    assert loaded["b"].tolist() == [[7, 8], [9, 10]]


def test_tensors_copied_file_to_file_keep_their_bytes(tmp_path: Path) -> None:
    src = tmp_path / "src.safetensors"
    save_file({"w": torch.arange(40, dtype=torch.int16).reshape(4, 10),
               "s": torch.tensor(0.5)}, str(src))
    start, header = read_header(src)
    begin, end = header["w"]["data_offsets"]
    out = tmp_path / "out.safetensors"
    write_safetensors(out, [StoredTensor("renamed", "I16", (4, 10), end - begin,
                                         (src, start + begin))])
    assert torch.equal(load_file(str(out))["renamed"], torch.arange(40, dtype=torch.int16)
                       .reshape(4, 10))
    with pytest.raises(CheckpointError, match="3 bytes given, 4 due"):
        write_safetensors(out, [StoredTensor("x", "F32", (1,), 4, b"abc")])


def test_read_header_of_a_library_written_file(tmp_path: Path) -> None:
    file = tmp_path / "m.safetensors"
    save_file({"x": torch.ones(2, 3), "y": torch.zeros(5, dtype=torch.uint8)}, str(file),
              metadata={"k": "v"})
    raw = file.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    start, header = read_header(file)
    assert start == 8 + size
    assert header == json.loads(raw[8:8 + size])
    assert header["x"]["shape"] == [2, 3] and header["__metadata__"] == {"k": "v"}
    begin, end = header["x"]["data_offsets"]
    assert raw[start + begin:start + end] == struct.pack("<6f", *[1.0] * 6)


@pytest.mark.parametrize(("content", "message"), [
    (b"\x00" * 8, "bad header length"),
    (struct.pack("<Q", 4) + b"{no}", "not a safetensors file"),
    (_hand_built({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\x00" * 8),
     "truncated"),
])
def test_read_header_refuses_broken_files(tmp_path: Path, content: bytes, message: str) -> None:
    file = tmp_path / "bad.safetensors"
    file.write_bytes(content)
    with pytest.raises(CheckpointError, match=message):
        read_header(file)


def test_weight_files_single_index_glob_and_pickles(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    save_file({"x": torch.ones(1)}, str(tmp_path / "a" / "model.safetensors"))
    save_file({"y": torch.ones(1)}, str(tmp_path / "a" / "extra.safetensors"))
    found = weight_files(tmp_path / "a")
    assert found.files == [tmp_path / "a" / "model.safetensors"] and found.weight_map is None
    (tmp_path / "a" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "model.safetensors", "y": "extra.safetensors"}}))
    indexed = weight_files(tmp_path / "a")
    assert indexed.weight_map == {"x": tmp_path / "a" / "model.safetensors",
                                  "y": tmp_path / "a" / "extra.safetensors"}
    (tmp_path / "b").mkdir()
    save_file({"y": torch.ones(1)}, str(tmp_path / "b" / "z.safetensors"))
    assert weight_files(tmp_path / "b").files == [tmp_path / "b" / "z.safetensors"]
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "pytorch_model.bin").write_bytes(b"\x80")
    with pytest.raises(CheckpointError, match="pickle file"):
        weight_files(tmp_path / "c")


def test_quantization_block(tmp_path: Path) -> None:
    assert quantization_block(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": [1]}))
    with pytest.raises(CheckpointError, match="quantization_config is a list"):  # issue 19
        quantization_block(tmp_path)
    block = {"quant_method": "x", "n": 1}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": block}))
    assert quantization_block(tmp_path) == block


def test_layer_names() -> None:
    names = LayerNames("p", "s", "g", "i", (), True, ((1,),))
    assert names.roles() == {"packed": "p", "block": "s", "global": "g", "input": "i"}
    assert names.keys("a.b") == {"packed": "a.b.p", "block": "a.b.s", "global": "a.b.g",
                                 "input": "a.b.i"}
    assert names.scalar_shapes == ((), (1,))
