"""checkpoint.validation: the one validator ``load``, ``audit`` and ``convert`` share (issue 19,
cases 5 and 6), driven through the command line as users run it (``python -m nvfp4lab``).

Each defect is written into a small hand-made checkpoint (one quantized Linear ``layer``, 32 x
64): the safetensors header is patched in place, the tensors re-stored under other dtypes or
shapes, or the configuration edited. What makes the folder unreadable (header, configuration)
is a one-line error exit 2 from both commands; a layer whose tensors cannot be decoded is a
flagged row in ``audit`` (exit 1, the reason in its issues line) and a one-line refusal from
``convert``, which writes nothing.

The first case of each family runs ``python -m nvfp4lab`` in a subprocess, as users do; the
others call :func:`nvfp4lab.cli.main` in this process with stdout and stderr captured at the
file-descriptor level (``capfd``: what a pool worker printed would be caught too). The code path
is the same; the in-process cases save an interpreter start-up of about 4 s each (torch,
compressed-tensors and the transformers it imports), so the families cost seconds, not minutes.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import nvfp4lab
from nvfp4lab import checkpoint
from nvfp4lab.checkpoint import CheckpointError
from nvfp4lab.checkpoint.refusals import block_scale_error
from tests import processes

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = "model.safetensors"


def _nvfp4_tensors(n: int = 32, k: int = 64) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    q = nvfp4lab.quantize(torch.randn(n, k))
    return {"layer.weight_packed": q.packed, "layer.weight_scale": q.scales,
            "layer.weight_global_scale": q.global_scale}


def _ct_folder(path: Path, tensors: dict[str, torch.Tensor] | None = None,
               scheme: str = "NVFP4A16") -> Path:
    """A one-layer compressed-tensors checkpoint (config written by compressed-tensors)."""
    from compressed_tensors.compressors import ModelCompressor

    path.mkdir(parents=True)
    save_file(tensors or _nvfp4_tensors(), str(path / WEIGHTS), metadata={"format": "pt"})
    (path / "config.json").write_text("{}")
    config = checkpoint.quantization_config(scheme)
    ModelCompressor(quantization_config=config).update_config(str(path))
    return path


@pytest.fixture(scope="module")
def ct(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _ct_folder(tmp_path_factory.mktemp("ct") / "ckpt")


@pytest.fixture(scope="module")
def mo(ct: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same layer as a ModelOpt (W4A16_NVFP4) checkpoint, made by convert."""
    out = tmp_path_factory.mktemp("mo") / "ckpt"
    checkpoint.convert(ct, out, format="modelopt", workers=0)
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _patch_header(file: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the JSON header of ``file`` through ``edit`` (the data bytes are kept)."""
    raw = file.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size:])


Capture = pytest.CaptureFixture[str] | None


def _cli(*argv: str, capfd: Capture = None) -> subprocess.CompletedProcess[str]:
    """``nvfp4lab ARGV``: ``python -m nvfp4lab`` in a subprocess, or with ``capfd``, ``cli.main``
    in this process, its file descriptors 1 and 2 captured (see the module docstring)."""
    if capfd is None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.run([sys.executable, "-m", "nvfp4lab", *argv], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300, check=False)
    return processes.cli_here(list(argv), capfd)


def _first(case: str, cases: dict[str, Any], capfd: pytest.CaptureFixture[str]) -> Capture:
    """None (a subprocess) for the first case of a family, else ``capfd`` (in process)."""
    return None if case == next(iter(cases)) else capfd


def _one_line_error(result: subprocess.CompletedProcess[str], command: str,
                    *needles: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"nvfp4lab {command}: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _audit_and_convert_refuse(folder: Path, tmp_path: Path, fmt: str, *needles: str,
                              capfd: Capture = None) -> None:
    """Both commands stop with the same one-line error; convert writes nothing."""
    _one_line_error(_cli("audit", str(folder), capfd=capfd), "audit", *needles)
    dst = tmp_path / "out"
    _one_line_error(_cli("convert", str(folder), str(dst), "--format", fmt, capfd=capfd),
                    "convert", *needles)
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def _set(name: str, key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def edit(header: dict[str, Any]) -> None:
        header[name][key] = value
    return edit


def _replace(name: str, value: object) -> Callable[[dict[str, Any]], None]:
    def edit(header: dict[str, Any]) -> None:
        header[name] = value
    return edit


def _overlap(header: dict[str, Any]) -> None:
    """The block scales' byte range moved onto the codes' (same length): a well-formed file."""
    begin = header["layer.weight_packed"]["data_offsets"][0]
    length = header["layer.weight_scale"]["data_offsets"][1] - header[
        "layer.weight_scale"]["data_offsets"][0]
    header["layer.weight_scale"]["data_offsets"] = [begin, begin + length]


def _short(header: dict[str, Any]) -> None:
    begin, end = header["layer.weight_packed"]["data_offsets"]
    header["layer.weight_packed"]["data_offsets"] = [begin, end - 8]


def _negative(header: dict[str, Any]) -> None:
    begin, end = header["layer.weight_packed"]["data_offsets"]
    header["layer.weight_packed"]["data_offsets"] = [-8, end - begin - 8]


def _metadata(header: dict[str, Any]) -> None:
    header["__metadata__"] = {"format": {"nested": 1}}


# issue 19 case 6 (header) and the raw tracebacks / unclear messages of audit and convert:
# each header defect, the words the one-line error must hold (file name, tensor, what is wrong)
HEADER_DEFECTS = {
    "entry-is-an-int": (_replace("layer.weight_scale", 7),
                        ("'layer.weight_scale'", "header entry is 7")),
    "offsets-as-a-string": (_set("layer.weight_scale", "data_offsets", "0-512"),
                            ("'layer.weight_scale'", "data_offsets '0-512'")),
    "shape-as-an-int": (_set("layer.weight_packed", "shape", 32),
                        ("'layer.weight_packed'", "shape 32", "list of non-negative")),
    "negative-dimension": (_set("layer.weight_packed", "shape", [-32, -32]),
                           ("'layer.weight_packed'", "shape [-32, -32]")),
    "f4-dtype": (_set("layer.weight_packed", "dtype", "F4"),
                 ("'layer.weight_packed'", "dtype 'F4'", "U8 [N, K/2]")),
    "shape-vs-bytes": (_set("layer.weight_packed", "shape", [32, 16]),
                       ("'layer.weight_packed'", "U8 [32, 16], 512 bytes", "hold 1024 bytes")),
    "short-offsets": (_short, ("'layer.weight_packed'", "hold 1016 bytes")),
    "negative-offsets": (_negative, ("'layer.weight_packed'", "negative or reversed")),
    "overlapping-offsets": (_overlap, ("'layer.weight_scale'", "overlap")),
    "nested-metadata": (_metadata, ("__metadata__", "flat object of strings")),
}


@pytest.mark.slow
@pytest.mark.parametrize("defect", list(HEADER_DEFECTS))
def test_header_defects_are_one_line_errors_from_audit_and_convert(
    ct: Path, tmp_path: Path, defect: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """issue 19 case 6 (header checks before any output is written) and the tracebacks: a
    header entry that is an int, offsets as a string, a shape as an int, short offsets, F4,
    overlapping / negative offsets, shape vs byte count; case 5: a nested ``__metadata__``."""
    edit, needles = HEADER_DEFECTS[defect]
    folder = _copy(ct, tmp_path / "bad")
    _patch_header(folder / WEIGHTS, edit)
    _audit_and_convert_refuse(folder, tmp_path, "modelopt", str(folder / WEIGHTS), *needles,
                              capfd=_first(defect, HEADER_DEFECTS, capfd))


@pytest.mark.parametrize("defect", list(HEADER_DEFECTS))
def test_load_refuses_the_same_headers_in_the_same_words(ct: Path, tmp_path: Path,
                                                         defect: str) -> None:
    """issue 19 case 5: load, audit and convert share the header validator."""
    edit, needles = HEADER_DEFECTS[defect]
    folder = _copy(ct, tmp_path / "bad")
    _patch_header(folder / WEIGHTS, edit)
    with pytest.raises(CheckpointError) as caught:
        checkpoint.load(folder)
    for needle in (str(folder / WEIGHTS), *needles):
        assert needle in str(caught.value), (needle, str(caught.value))


def test_header_problem_accepts_library_headers_and_names_the_overlap() -> None:
    """issue 19 case 6: overlapping ranges are found from the header, not as bad scales."""
    from nvfp4lab.checkpoint.validation import header_problem  # new in issue 19

    good = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "U8", "shape": [0], "data_offsets": [8, 8]},
            "c": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [8, 16]},
            "__metadata__": {"format": "pt"}}
    assert header_problem(good) is None
    bad = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
           "b": {"dtype": "F32", "shape": [1], "data_offsets": [20, 24]},
           "c": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}
    assert "'a' (bytes up to 16) and 'c' (bytes 4-8) overlap" in str(header_problem(bad))


def _restored(**changes: torch.Tensor) -> dict[str, torch.Tensor]:
    tensors = _nvfp4_tensors()
    tensors.update(changes)
    return tensors


# issue 19 case 6 (layer): tensors whose header is valid but that are not NVFP4 as the format
# says; (tensors, the issue audit lists for the layer)
LAYER_DEFECTS = {
    "int8-codes": (lambda t: {"layer.weight_packed": t["layer.weight_packed"].view(torch.int8)},
                   "codes weight_packed are I8 [32, 32]; expected U8 [N, K/2]"),
    "fp16-codes": (lambda t: {"layer.weight_packed": t["layer.weight_packed"].view(torch.float16)},
                   "codes weight_packed are F16 [32, 16]; expected U8"),
    "uint8-block-scales": (lambda t: {"layer.weight_scale": t["layer.weight_scale"].view(
        torch.uint8)}, "block scales weight_scale are U8 [32, 4]; expected F8_E4M3"),
    "misshaped-block-scales": (lambda t: {"layer.weight_scale": t["layer.weight_scale"].reshape(
        16, 8)}, "block scales weight_scale are [16, 8]; expected plain [32, 4]"),
    "k-not-a-multiple-of-16": (lambda t: {
        "layer.weight_packed": t["layer.weight_packed"][:, :20].contiguous(),
        "layer.weight_scale": t["layer.weight_scale"][:, :2].contiguous()},
        "codes weight_packed are U8 [32, 20]: K = 40 elements per row is not a multiple of 16"),
}


@pytest.mark.slow
@pytest.mark.parametrize("defect", list(LAYER_DEFECTS))
def test_invalid_layer_tensors_are_flagged_by_audit_and_refused_by_convert(
    tmp_path: Path, defect: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """issue 19 case 6: int8 / fp16 codes, uint8 / misshaped block scales, K not a multiple of
    16 (a RuntimeError traceback before): convert copied them through with exit 0."""
    change, issue = LAYER_DEFECTS[defect]
    tensors = _nvfp4_tensors()
    folder = _ct_folder(tmp_path / "bad", _restored(**change(tensors)))
    run = _first(defect, LAYER_DEFECTS, capfd)
    audited = _cli("audit", str(folder), "--gpu", "B200", capfd=run)
    assert audited.returncode == 1 and "Traceback" not in audited.stderr, audited.stderr
    assert "1 quantized layers, 1 flagged" in audited.stdout
    assert f"  layer: {issue}" in audited.stdout, audited.stdout
    dst = tmp_path / "out"
    _one_line_error(_cli("convert", str(folder), str(dst), "--format", "modelopt", capfd=run),
                    "convert", str(folder / WEIGHTS), "layer 'layer'", issue,
                    "nothing was converted")
    assert not dst.exists()


@pytest.mark.parametrize("byte", [0x7F, 0xFF, 0x88])
def test_block_scales_load_refuses_are_refused_by_convert(
    tmp_path: Path, byte: int, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 32 (audit, load and convert agree): a NaN (0x7F, 0xFF) or negative (0x88) E4M3
    block scale was flagged by audit and refused by load, but convert copied it through with
    exit 0. Now convert refuses it in load's words before writing anything."""
    tensors = _nvfp4_tensors()
    raw = tensors["layer.weight_scale"].view(torch.uint8).clone()
    raw[5, 2] = byte
    folder = _ct_folder(tmp_path / "bad", _restored(
        **{"layer.weight_scale": raw.view(torch.float8_e4m3fn)}))
    nan, negative = {0x7F: (1, 0), 0xFF: (1, 1), 0x88: (0, 1)}[byte]  # 0xFF: both bits
    words = f"tensor 'layer.weight_scale' holds {nan} NaN and {negative} negative E4M3 block"
    run = None if byte == 0x7F else capfd
    audited = _cli("audit", str(folder), "--gpu", "B200", capfd=run)
    assert audited.returncode == 1 and "1 quantized layers, 1 flagged" in audited.stdout
    dst = tmp_path / "out"
    line = _one_line_error(
        _cli("convert", str(folder), str(dst), "--format", "modelopt", capfd=run), "convert",
        str(folder / WEIGHTS), words, f"first at (5, 2), byte 0x{byte:02x}",
        "nothing was converted")
    assert not dst.exists()
    # load's refusal (checkpoint/reader.py raises this one error) in the same words
    loads = block_scale_error(folder / WEIGHTS, "layer.weight_scale", raw.view(torch.float8_e4m3fn))
    assert loads is not None and str(loads) in line


def test_convert_names_a_bad_block_scale_past_its_first_chunk_of_rows(tmp_path: Path) -> None:
    """Convert reads block scales ``conversion.SCALE_ROWS`` (256) rows at a time: a NaN in row
    513 of 600 is named at its row in the whole tensor, as load names it."""
    tensors = _nvfp4_tensors(n=600)
    raw = tensors["layer.weight_scale"].view(torch.uint8).clone()
    raw[513, 1] = 0x7F
    scales = raw.view(torch.float8_e4m3fn)
    folder = _ct_folder(tmp_path / "bad", {**tensors, "layer.weight_scale": scales})
    with pytest.raises(CheckpointError, match=r"first at \(513, 1\), byte 0x7f") as err:
        checkpoint.convert(folder, tmp_path / "out", format="modelopt")
    loads = block_scale_error(folder / WEIGHTS, "layer.weight_scale", scales)
    assert loads is not None and str(loads) in str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [0.0, float("nan"), float("inf"), -5.0])
def test_a_tensor_scale_load_refuses_is_refused_by_convert(
    tmp_path: Path, value: float, capfd: pytest.CaptureFixture[str]
) -> None:
    """A probe found convert copying a tensor scale of 0 / NaN / inf / -5 through with exit 0
    (load refuses each, in the same words: checkpoint/reader.py; audit flags each)."""
    folder = _ct_folder(tmp_path / "bad", _restored(
        **{"layer.weight_global_scale": torch.tensor([value], dtype=torch.float32)}))
    audited = _cli("audit", str(folder), "--gpu", "B200", capfd=capfd)
    assert audited.returncode == 1 and "1 quantized layers, 1 flagged" in audited.stdout
    dst = tmp_path / "out"
    _one_line_error(_cli("convert", str(folder), str(dst), "--format", "modelopt", capfd=capfd),
                    "convert", str(folder / WEIGHTS), "'layer.weight_global_scale' must be "
                    f"finite and > 0 (ENCODE form, 2688/amax), got {value}",
                    "nothing was converted")
    assert not dst.exists()


def _modelopt_algo(folder: Path, config_json: str, hf_json: str) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["quant_algo"] = config_json
    (folder / "config.json").write_text(json.dumps(config))
    hf = json.loads((folder / "hf_quant_config.json").read_text())
    hf["quantization"]["quant_algo"] = hf_json
    (folder / "hf_quant_config.json").write_text(json.dumps(hf))


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["FP8", "W4A8_AWQ", "NVFP4_AWQ"])
def test_audit_refuses_what_load_refuses_other_algorithms(
    mo: Path, tmp_path: Path, algo: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """issue 19 case 5: audit said "0 flagged" (exit 0) for a quant_algo load refuses."""
    folder = _copy(mo, tmp_path / "bad")
    _modelopt_algo(folder, algo, algo)
    with pytest.raises(CheckpointError, match=f"quant_algo '{algo}' is not NVFP4"):
        checkpoint.load(folder)
    _audit_and_convert_refuse(folder, tmp_path, "compressed-tensors", "config.json",
                              f"quant_algo '{algo}' is not NVFP4",
                              capfd=None if algo == "FP8" else capfd)


@pytest.mark.slow
def test_disagreeing_modelopt_configs_are_refused_everywhere(
    mo: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """issue 19 case 5: config.json and hf_quant_config.json name different algorithms."""
    folder = _copy(mo, tmp_path / "bad")
    _modelopt_algo(folder, "W4A16_NVFP4", "NVFP4")
    needles = ("config.json says quant_algo 'W4A16_NVFP4'", "hf_quant_config.json says 'NVFP4'",
               "must agree")
    with pytest.raises(CheckpointError) as caught:
        checkpoint.load(folder)
    assert all(n in str(caught.value) for n in needles), caught.value
    _audit_and_convert_refuse(folder, tmp_path, "compressed-tensors", *needles, capfd=capfd)


@pytest.mark.slow
def test_w4a4_config_without_input_scales_is_flagged_and_refused(
    mo: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """issue 19 case 5: an NVFP4 (W4A4) config whose layers store no input scale."""
    folder = _copy(mo, tmp_path / "bad")
    _modelopt_algo(folder, "NVFP4", "NVFP4")
    audited = _cli("audit", str(folder), "--gpu", "B200", capfd=capfd)
    assert audited.returncode == 1 and "1 flagged" in audited.stdout, audited
    assert "layer: missing tensor input_scale" in audited.stdout
    dst = tmp_path / "out"
    _one_line_error(_cli("convert", str(folder), str(dst), "--format", "compressed-tensors",
                         capfd=capfd), "convert", "layer 'layer'", "missing tensor input_scale")
    assert not dst.exists()


@pytest.mark.slow
def test_config_problems_are_named(ct: Path, tmp_path: Path,
                                   capfd: pytest.CaptureFixture[str]) -> None:
    """issue 19 unclear messages: a non-UTF-8 config.json (a bare codec error naming no file)
    and a quantization_config given as a list (reported as missing)."""
    folder = _copy(ct, tmp_path / "latin1")
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_bytes(text.replace("{", '{"note": "caf\xe9", ', 1)
                                         .encode("latin-1"))
    _audit_and_convert_refuse(folder, tmp_path, "modelopt", str(folder / "config.json"),
                              "not UTF-8")
    listed = _copy(ct, tmp_path / "listed")
    config = json.loads((listed / "config.json").read_text())
    config["quantization_config"] = [config["quantization_config"]]
    (listed / "config.json").write_text(json.dumps(config))
    _audit_and_convert_refuse(listed, tmp_path, "modelopt", str(listed / "config.json"),
                              "quantization_config is a list", "expected a JSON object",
                              capfd=capfd)
