"""Hostile GGUF files (issue 32 cases 3, 4, 5, 6, 9, 10 and the GGUF block-scale messages):
``audit``, ``convert`` and ``load`` run as users run them on files built here, byte by byte
(the counts, dims and offsets of the layout as llama.cpp's ``gguf.cpp`` reads it, written
independently of nvfp4lab) or rewritten from a tiny W4A4 Llama with gguf's own reader and
writer.

A file whose counts or sizes the bytes cannot hold, whose tensors disagree with its config, or
whose config disagrees with its tensors is one line from all three, naming the file and the
tensor or key (exit 2 from the CLI; ``load``'s CheckpointError); ``convert`` writes nothing. A
layer whose values are wrong (block scales, tensor or input scale) is a flagged row in
``audit`` (exit 1) and a one-line refusal from ``load`` and ``convert``. The memory and time
bombs run in subprocesses under a 3 GB address-space limit and a 60 s timeout, so a regression
fails fast instead of eating the machine.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch import nn

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint import CheckpointError
from nvfp4lab.checkpoint.formats.gguf import CONFIG_KEY, WEIGHTS_FILE
from tests import processes
from tests.checkpoint.builders import modelopt_like, tiny_llama, token_batches
from tests.checkpoint.hostile import all_refuse, one_line, run

gguf = pytest.importorskip("gguf", reason="the GGUF format needs gguf (pip install "
                           "'nvfp4lab[llm]')")

NVFP4 = 40
Q = "model.layers.0.self_attn.q_proj"


def _all_refuse(file: Path, tmp_path: Path, *needles: str) -> None:
    all_refuse(file, tmp_path, "compressed-tensors", *needles)


# -- files written byte by byte (llama.cpp's gguf.cpp layout, little-endian, version 3) -------


def _string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv_string(key: str, value: str) -> bytes:
    return _string(key) + struct.pack("<I", 8) + _string(value)


def _config_json(**changes: Any) -> str:
    """The transformers config of the tiny Llama (hidden 64, 2 layers), with ``changes``."""
    config = json.loads(tiny_llama().config.to_json_string())
    config.update(changes)
    return json.dumps(config)


def _raw_gguf(path: Path, *, kvs: bytes = b"", n_kv: int = 0, infos: bytes = b"",
              n_tensors: int = 0, data: bytes = b"", config: str | None = None) -> Path:
    """A GGUF file: the header with these counts, ``general.architecture`` = llama and
    nvfp4lab's config key (``config``, default the tiny Llama's), then ``kvs``, the tensor
    ``infos``, padding to 32 bytes and ``data``."""
    head = _kv_string("general.architecture", "llama") + _kv_string(
        CONFIG_KEY, config if config is not None else _config_json())
    body = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv + 2) + head + kvs + infos
    body += b"\0" * (-len(body) % 32)
    path.write_bytes(body + data)
    return path


def _info(name: str, dims: list[int], kind: int = NVFP4, offset: int = 0) -> bytes:
    """One tensor info: name, n_dims, dims (ggml order: elements per row first), type, offset
    in the data section."""
    return (_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", kind, offset))


def test_a_metadata_array_of_2_62_elements_is_one_line(tmp_path: Path) -> None:
    """Case 3: 114 bytes claiming a 2**62-element array grew past 1.9 GB until killed."""
    bomb = tmp_path / "array.gguf"
    d = b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + _kv_string("general.architecture", "llama")
    d += _string("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 0, 2**62)
    bomb.write_bytes(d + b"\0" * (114 - len(d)))
    assert bomb.stat().st_size == 114
    _all_refuse(bomb, tmp_path, "array 'tokenizer.ggml.scores' claims 4611686018427387904 "
                "item(s)", "not a valid GGUF file")


COUNT_BOMBS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "tensor count": (lambda p: _raw_gguf(p, n_tensors=2**62), "the tensor count claims"),
    "key-value count": (lambda p: _raw_gguf(p, n_kv=2**60), "the key-value count claims"),
    "key length": (lambda p: _raw_gguf(p, kvs=struct.pack("<Q", 2**61), n_kv=1),
                   "a metadata key claims 2305843009213693952 item(s)"),
    "string array": (lambda p: _raw_gguf(
        p, kvs=_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**40), n_kv=1),
        "array 'tokenizer.ggml.tokens' claims 1099511627776 item(s)"),
    "n_dims": (lambda p: _raw_gguf(p, infos=_string("blk.0.attn_q.weight")
                                   + struct.pack("<I", 2**31), n_tensors=1),
               "tensor 'blk.0.attn_q.weight' has n_dims 2147483648"),
    "dims past the file": (lambda p: _raw_gguf(p, infos=_info("blk.0.attn_q.weight",
                                                              [64, 2**40]), n_tensors=1),
                           "tensor 'blk.0.attn_q.weight' (39582418599936 bytes at data offset "
                           "0"),
    "offset wraps": (lambda p: _raw_gguf(p, infos=_info("blk.0.attn_q.weight", [64, 64],
                                                        offset=2**64 - 64), n_tensors=1,
                                         data=bytes(64 * 36)),
                     "ends past the end of the file"),
}


@pytest.mark.parametrize("bomb", list(COUNT_BOMBS))
def test_counts_the_bytes_cannot_hold_are_one_line(bomb: str, tmp_path: Path) -> None:
    """Case 3: every count (key-values, tensors, string and array lengths, n_dims, a tensor's
    bytes and offset) is bounded by the bytes that remain before anything is read."""
    build, needle = COUNT_BOMBS[bomb]
    file = build(tmp_path / "bomb.gguf")
    result = run("audit", str(file))
    assert result.returncode == 2, (result.stdout, result.stderr)
    one_line(result, "nvfp4lab audit: ", str(file), needle)


@pytest.mark.parametrize("dims", [[0, 2**27], [2**27 * 64, 0], [0, 2**40]])
def test_an_nvfp4_tensor_without_elements_is_refused(dims: list[int], tmp_path: Path) -> None:
    """Case 4: dims [0, 2**27] and no data reached 5.7 GB and ran past 60 s in audit and
    convert; [0, 2**40] asked for 8.8 TB with a traceback."""
    file = _raw_gguf(tmp_path / "empty.gguf", infos=_info("blk.0.attn_q.weight", dims),
                     n_tensors=1)
    needles = ("tensor 'blk.0.attn_q.weight' has dims", "every dim holds at least one element")
    if dims == [0, 2**27]:
        _all_refuse(file, tmp_path, *needles)
    else:  # the same parse, whatever the command: audit alone
        audited = run("audit", str(file))
        assert audited.returncode == 2, (audited.stdout, audited.stderr)
        one_line(audited, "nvfp4lab audit: ", str(file), *needles)


def test_a_config_of_a_million_layers_is_refused_before_building(tmp_path: Path) -> None:
    """Case 5: nvfp4lab.config_json with num_hidden_layers 1,000,000 hung audit and load,
    growing 15 MB/s (the model was built on the meta device, layer by layer)."""
    file = _raw_gguf(tmp_path / "layers.gguf", config=_config_json(num_hidden_layers=10**6),
                     infos=_info("blk.0.attn_q.weight", [64, 64]) + _info(
                         "blk.1.attn_q.weight", [64, 64], offset=64 * 36),
                     n_tensors=2, data=bytes(2 * 64 * 36))
    _all_refuse(file, tmp_path, "num_hidden_layers is 1000000 but the weights hold layers 0-1",
                CONFIG_KEY)


def test_a_config_nested_50000_deep_is_one_line(tmp_path: Path,
                                                capfd: pytest.CaptureFixture[str]) -> None:
    """Case 6: the GGUF config key nested 50,000 levels deep: RecursionError traceback."""
    deep = _config_json()[:-1] + ', "x": ' + "[" * 50_000 + "]" * 50_000 + "}"
    file = _raw_gguf(tmp_path / "deep.gguf", config=deep,
                     infos=_info("blk.0.attn_q.weight", [64, 64]), n_tensors=1,
                     data=bytes(64 * 36))
    needle = f"{CONFIG_KEY} is JSON nested more than 64 levels deep"
    for argv in (["audit", str(file)], ["convert", str(file), str(tmp_path / "out"),
                                        "--format", "modelopt"]):
        result = processes.cli_here(argv, capfd)
        assert result.returncode == 2, (result.stdout, result.stderr)
        one_line(result, f"nvfp4lab {argv[0]}: ", str(file), needle)
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(file)
    assert "\n" not in str(err.value) and str(file) in str(err.value) and needle in str(err.value)


# -- files rewritten from a real one with gguf's own reader and writer -------------------------


@pytest.fixture(scope="module")
def w4a4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A W4A4 tiny Llama (seeded) written as GGUF by save_pretrained."""
    from nvfp4lab.execution import quantize_model

    model = tiny_llama(seed=11)
    quantize_model(model, backend="w4a16", share_global_scale="llama")
    modelopt_like(model, token_batches())
    folder = checkpoint.save_pretrained(model, tmp_path_factory.mktemp("w4a4") / "ckpt",
                                        format="gguf")
    return folder / WEIGHTS_FILE


def _rewrite(src: Path, dst: Path, *, config: dict[str, Any] | None = None,
             tensors: Callable[[str, np.ndarray, int], tuple[np.ndarray, int] | None]
             = lambda name, data, kind: (data, kind)) -> Path:
    """``src`` copied to ``dst`` by gguf's reader and writer: the config key's values updated
    with ``config``; each tensor passed through ``tensors(name, bytes or values, ggml type)``,
    which returns its new (data, type) or None to leave it out."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == CONFIG_KEY and config is not None:
            value = json.dumps({**json.loads(value), **config})
        main = field.types[0]
        writer.add_key_value(key, value, main,
                             field.types[-1] if main == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        new = tensors(t.name, np.asarray(t.data), int(t.tensor_type))
        if new is not None:
            writer.add_tensor(t.name, new[0], raw_dtype=gguf.GGMLQuantizationType(new[1]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _replace(target: str, make: Callable[[np.ndarray], tuple[np.ndarray, int] | None]
             ) -> Callable[[str, np.ndarray, int], tuple[np.ndarray, int] | None]:
    return lambda name, data, kind: make(data) if name == target else (data, kind)


def _f32(value: float) -> Callable[[np.ndarray], tuple[np.ndarray, int]]:
    return lambda data: (np.array([value], dtype=np.float32), 0)


DISAGREEMENTS: dict[str, tuple[dict[str, Any], Callable[..., Any], tuple[str, ...]]] = {
    "K halved": ({}, _replace("blk.0.ffn_down.weight", lambda d: (d[:, : d.shape[1] // 2],
                                                                   NVFP4)),
                 ("NVFP4 tensor 'blk.0.ffn_down.weight' is [64, 64]",
                  "is an nn.Linear of [64, 128]")),
    "N = 0 rows": ({}, _replace("blk.0.attn_q.weight", lambda d: (d[:0], NVFP4)),
                   ("tensor 'blk.0.attn_q.weight' has dims [64, 0]",)),
    "hidden_size changed": ({"hidden_size": 128, "head_dim": 32}, lambda n, d, k: (d, k),
                            ("tensor 'token_embd.weight' has shape [128, 64] but the config's "
                             "LlamaForCausalLM has 'model.embed_tokens.weight' of shape "
                             "[128, 128]",)),
    "model_type bert": ({"model_type": "bert"}, lambda n, d, k: (d, k),
                        ("model_type 'bert'",)),
    "an embedding typed NVFP4": ({}, _replace("token_embd.weight", lambda d: (
        np.zeros((d.shape[0], d.shape[1] // 64 * 36), np.uint8), NVFP4)),
        ("tensor 'token_embd.weight' is NVFP4 but 'model.embed_tokens' is no nn.Linear",)),
    "an input scale on one layer only": ({}, lambda n, d, k: None if n.endswith(
        ".input_scale") and not n.startswith("blk.0.attn_q") else (d, k),
        ("some NVFP4 tensors have an input_scale sidecar and some not",)),
}


@pytest.mark.parametrize("case", list(DISAGREEMENTS))
def test_files_load_refuses_are_refused_by_audit_and_convert(
        case: str, w4a4: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Case 9 and the GGUF messages: a tensor that disagrees with the config (K halved, N = 0,
    hidden_size changed), a config of another architecture (bert), an embedding typed NVFP4,
    an input scale on one layer only: audit passed them with 0 flagged (or exited 2 naming
    neither file nor tensor) and convert wrote them while load refused. Now all three refuse
    in one line naming the file and the tensor."""
    config, tensors, needles = DISAGREEMENTS[case]
    file = _rewrite(w4a4, tmp_path / "bad.gguf", config=config, tensors=tensors)
    if case == next(iter(DISAGREEMENTS)):
        _all_refuse(file, tmp_path, *needles)
        return
    for argv in (["audit", str(file)],
                 ["convert", str(file), str(tmp_path / "out"), "--format", "modelopt"]):
        result = processes.cli_here(argv, capfd)
        assert result.returncode == 2, (result.stdout, result.stderr)
        one_line(result, f"nvfp4lab {argv[0]}: ", str(file), *needles)
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(file)
    assert "\n" not in str(err.value) and str(file) in str(err.value)
    assert all(n in str(err.value) for n in needles), str(err.value)


BAD_VALUES: dict[str, tuple[Callable[..., Any], str, str]] = {
    "NaN input scale": (_replace("blk.0.attn_q.input_scale", _f32(float("nan"))),
                        "input scale input_scale must be finite and > 0 (DECODE form, "
                        "amax/2688), got nan",
                        f"tensor '{Q}.input_scale' must be finite and > 0"),
    "denormal tensor scale": (_replace("blk.0.attn_q.scale", _f32(1e-44)),
                              "tensor scale scale is 9.80909e-45, whose float32 reciprocal "
                              "overflows to inf",
                              f"tensor '{Q}.scale' is 9.80909e-45, whose float32 reciprocal "
                              "overflows to inf"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_scales_load_refuses_are_flagged_by_audit_and_refused_by_convert(
        case: str, w4a4: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Cases 9 and 10: a NaN ``.input_scale`` passed audit with 0 flagged; a ``.scale`` of
    1e-44 (a denormal whose reciprocal overflows float32) passed audit, convert wrote inf and
    load said "pass 1/scale" without naming file or tensor."""
    tensors, issue, refusal = BAD_VALUES[case]
    file = _rewrite(w4a4, tmp_path / "bad.gguf", tensors=tensors)
    audited = processes.cli_here(["audit", str(file)], capfd)
    assert audited.returncode == 1 and "14 quantized layers, 1 flagged" in audited.stdout
    assert f"  {Q}: {issue}" in audited.stdout, audited.stdout
    dst = tmp_path / "out"
    converted = processes.cli_here(["convert", str(file), str(dst), "--format",
                                    "compressed-tensors"], capfd)
    assert converted.returncode == 2 and not dst.exists()
    one_line(converted, "nvfp4lab convert: ", str(file), refusal)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(file)
    assert "\n" not in str(err.value) and str(file) in str(err.value)
    assert refusal in str(err.value)


@pytest.mark.parametrize("byte", [0x7F, 0x88])
def test_bad_block_scale_bytes_are_a_flagged_row_naming_the_layer(
        byte: int, w4a4: Path, tmp_path: Path) -> None:
    """A NaN (0x7F) or negative (0x88) UE4M3 scale byte: audit exited 2 naming neither file
    nor tensor. Now a flagged row naming the layer, as the same byte in compressed-tensors is;
    load and convert refuse in one line naming the file and the tensor."""
    data = bytearray(w4a4.read_bytes())
    q = next(t for t in gguf.GGUFReader(w4a4).tensors if t.name == "blk.0.attn_q.weight")
    data[q.data_offset + 5 * 36 + 2] = byte  # row 0, block 5, third sub-block's scale
    file = tmp_path / "scales.gguf"
    file.write_bytes(bytes(data))
    audited = run("audit", str(file))
    assert audited.returncode == 1 and "Traceback" not in audited.stderr, audited.stderr
    assert "14 quantized layers, 1 flagged" in audited.stdout
    nan, negative = (1, 0) if byte == 0x7F else (0, 1)
    assert f"  {Q}: {nan} NaN and {negative} negative block scale(s)" in audited.stdout
    dst = tmp_path / "out"
    converted = run("convert", str(file), str(dst), "--format", "modelopt")
    assert converted.returncode == 2 and not dst.exists()
    one_line(converted, "nvfp4lab convert: ", str(file), "tensor 'blk.0.attn_q.weight'",
              f"0x{byte:02x}")
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(file)
    assert "\n" not in str(err.value) and str(file) in str(err.value)
    assert "blk.0.attn_q.weight" in str(err.value) and f"0x{byte:02x}" in str(err.value)


def test_the_clean_file_still_passes(w4a4: Path, tmp_path: Path) -> None:
    """The checks refuse nothing real: the unmodified file (and its gguf rewrite) audits clean,
    converts and loads."""
    copy = _rewrite(w4a4, tmp_path / "same.gguf")
    for file in (w4a4, copy):
        rows = checkpoint.audit_rows(file)
        assert len(rows) == 14 and all(r["issues"] == "" for r in rows)
        assert isinstance(checkpoint.load(file), nn.Module)
    checkpoint.convert(copy, tmp_path / "ct", format="compressed-tensors")
