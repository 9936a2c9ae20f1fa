"""Hostile compressed-tensors and ModelOpt checkpoints (issue 32 cases 4, 5, 6, 9, 10): the
tiny Llama written by nvfp4lab, then one file edited (a tensor re-stored, ``config.json`` or a
safetensors header rewritten); ``audit``, ``convert`` and ``load`` run as users run them (the
bombs in subprocesses under an address-space limit, :mod:`tests.checkpoint.hostile`).

What makes the folder unreadable (a config counting more layers than the tensors hold, JSON
nested 50,000 deep) is one line from all three naming the file; a layer whose tensors or scale
values load refuses is a flagged row in ``audit`` (exit 1) and a one-line refusal from
``convert`` (nothing written) and ``load``, in the same words.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint import CheckpointError
from tests.checkpoint.builders import copy_checkpoint, file_tensors
from tests.checkpoint.hostile import all_refuse, one_line, run
from tests.processes import cli_here

Q = "model.layers.0.self_attn.q_proj"
WEIGHTS = "model.safetensors"


def _edit(path: Path, **tensors: torch.Tensor) -> Path:
    stored = file_tensors(path)
    stored.update(tensors)
    save_file(stored, str(path / WEIGHTS), metadata={"format": "pt"})
    return path


def _config(path: Path, **changes: object) -> Path:
    file = path / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))
    return path


DEEP = "[" * 50_000 + "]" * 50_000


def test_k_0_is_a_flagged_layer_and_refused(nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    """Case 4: a ``weight_packed`` of [N, 0] crashed audit with a traceback and convert wrote
    it."""
    path = _edit(copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "k0"), **{
        f"{Q}.weight_packed": torch.zeros(64, 0, dtype=torch.uint8),
        f"{Q}.weight_scale": torch.zeros(64, 0, dtype=torch.float8_e4m3fn)})
    issue = "codes weight_packed are U8 [64, 0]: no elements"
    audited = run("audit", str(path))
    assert audited.returncode == 1 and "Traceback" not in audited.stderr, audited.stderr
    assert "14 quantized layers, 1 flagged" in audited.stdout
    assert f"  {Q}: {issue}" in audited.stdout, audited.stdout
    dst = tmp_path / "out"
    converted = run("convert", str(path), str(dst), "--format", "modelopt")
    assert converted.returncode == 2 and not dst.exists()
    one_line(converted, "nvfp4lab convert: ", str(path / WEIGHTS), f"layer '{Q}'", issue)
    with pytest.raises(CheckpointError, match=r"weight_packed' has shape \[64, 0\], expected "
                                              r"\[64, 32\]"):
        checkpoint.load(path)


def test_a_config_of_a_million_layers_is_refused_before_building(
        nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    """Case 5: ``config.json`` with num_hidden_layers 1,000,000: audit passed (0 flagged),
    load hung growing 15 MB/s, convert wrote it."""
    path = _config(copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "layers"),
                   num_hidden_layers=10**6)
    all_refuse(path, tmp_path, "modelopt", str(path / "config.json"),
               "num_hidden_layers is 1000000 but the weights hold layers 0-1 (2)")


@pytest.mark.parametrize(("key", "largest"), [
    ("vocab_size", "model.embed_tokens.weight [1000000000,"),
    ("intermediate_size", "mlp.gate_proj.weight [1000000000,"),
])
def test_config_sizes_the_weights_cannot_back_are_refused_before_building(
        key: str, largest: str, nvfp4lab_checkpoint: Path, tmp_path: Path) -> None:
    """Like case 5, other sizes: ``vocab_size`` or ``intermediate_size`` of 10**9 made load
    allocate 128 GB while building the model (a MemoryError traceback, or the machine's memory
    where the sizes fit); now one line naming the model's size and its largest tensor, from a
    build on the meta device, before anything real is built."""
    path = _config(copy_checkpoint(nvfp4lab_checkpoint, tmp_path / key), **{key: 10**9})
    loaded = run(str(path), load=True)
    assert loaded.returncode == 1, (loaded.stdout, loaded.stderr)
    one_line(loaded, "load: ", str(path), "its configuration describes a model of", largest,
             "do not match the stored weights: fix config.json")


@pytest.mark.parametrize("where", ["config.json", "header"])
def test_json_nested_50000_deep_is_one_line_naming_the_file(
        where: str, nvfp4lab_checkpoint: Path, tmp_path: Path,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Case 6: JSON nested 50,000 levels deep in ``config.json`` or a safetensors header:
    RecursionError traceback. Now one line naming the file from all three."""
    path = copy_checkpoint(nvfp4lab_checkpoint, tmp_path / "deep")
    if where == "config.json":
        file = path / "config.json"
        file.write_text(file.read_text().rstrip().removesuffix("}") + f', "x": {DEEP}}}')
    else:
        file = path / WEIGHTS
        raw = file.read_bytes()
        size = struct.unpack("<Q", raw[:8])[0]
        header = raw[8:8 + size].rstrip()[:-1] + b', "x": ' + DEEP.encode() + b"}"
        header += b" " * (-len(header) % 8)
        file.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + size:])
    needle = "JSON nested more than 64 levels deep"
    for argv in (["audit", str(path)], ["convert", str(path), str(tmp_path / "out"),
                                        "--format", "modelopt"]):
        result = cli_here(argv, capfd)
        assert result.returncode == 2, (result.stdout, result.stderr)
        one_line(result, f"nvfp4lab {argv[0]}: ", str(file), needle)
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(path)
    assert "\n" not in str(err.value) and str(file) in str(err.value) and needle in str(err.value)


@pytest.fixture(scope="module")
def modelopt_checkpoint(nvfp4lab_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                        ) -> Path:
    return checkpoint.convert(nvfp4lab_checkpoint, tmp_path_factory.mktemp("mo") / "ckpt",
                              format="modelopt").dst


#: (fixture, tensor, value, the audit issue, load's and convert's refusal)
BAD_SCALES = {
    "CT weight_global_scale 1e-44": (
        "nvfp4lab_checkpoint", "weight_global_scale", 1e-44,
        "tensor scale weight_global_scale is 9.80909e-45, whose float32 reciprocal overflows",
        f"tensor '{Q}.weight_global_scale' is 9.80909e-45, whose float32 reciprocal overflows "
        "to inf (ENCODE form, 2688/amax)"),
    "ModelOpt weight_scale_2 1e-44": (
        "modelopt_checkpoint", "weight_scale_2", 1e-44,
        "tensor scale weight_scale_2 is 9.80909e-45, whose float32 reciprocal overflows",
        f"tensor '{Q}.weight_scale_2' is 9.80909e-45, whose float32 reciprocal overflows to inf "
        "(DECODE form, amax/2688)"),
    "CT input_global_scale NaN": (
        "ct_w4a4_checkpoint", "input_global_scale", float("nan"),
        "input scale input_global_scale must be finite and > 0 (ENCODE form, "
        "2688/amax), got nan",
        f"tensor '{Q}.input_global_scale' must be finite and > 0"),
}


@pytest.mark.parametrize("case", list(BAD_SCALES))
def test_scales_load_refuses_are_flagged_by_audit_and_refused_by_convert(
        case: str, tmp_path: Path, capfd: pytest.CaptureFixture[str],
        request: pytest.FixtureRequest) -> None:
    """Cases 9 and 10: a denormal tensor scale (1e-44, whose reciprocal is inf in float32)
    passed audit, convert wrote inf and load said "pass 1/scale" naming neither file nor
    tensor; a NaN ``input_global_scale`` passed audit with 0 flagged."""
    fixture, leaf, value, issue, refusal = BAD_SCALES[case]
    source = request.getfixturevalue(fixture)
    path = _edit(copy_checkpoint(source, tmp_path / "bad"),
                 **{f"{Q}.{leaf}": torch.tensor([value], dtype=torch.float32).reshape(
                     file_tensors(source)[f"{Q}.{leaf}"].shape)})
    audited = cli_here(["audit", str(path)], capfd)
    assert audited.returncode == 1 and "14 quantized layers, 1 flagged" in audited.stdout
    assert f"  {Q}: {issue}" in audited.stdout, audited.stdout
    dst = tmp_path / "out"
    target = "compressed-tensors" if fixture == "modelopt_checkpoint" else "modelopt"
    converted = cli_here(["convert", str(path), str(dst), "--format", target], capfd)
    assert converted.returncode == 2 and not dst.exists()
    one_line(converted, "nvfp4lab convert: ", str(path / WEIGHTS), refusal)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(path)
    assert "\n" not in str(err.value) and str(path / WEIGHTS) in str(err.value)
    assert refusal in str(err.value)
