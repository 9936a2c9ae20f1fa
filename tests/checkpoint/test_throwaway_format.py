"""The format recipe of docs/architecture.md, kept true by a throw-away format run through every
path: registered at run time (``tests/checkpoint/throwaway_format.py``), then save_pretrained ->
load, convert to and from compressed-tensors, audit and the CLI's ``--format`` choices in a
subprocess. Nothing outside the format module is edited for it."""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nvfp4lab import checkpoint, cli
from nvfp4lab.checkpoint.formats import FORMATS, detect_format, format_spec
from nvfp4lab.execution import NVFP4Linear, quantize_model
from nvfp4lab.vocab import CheckpointFormat
from tests.checkpoint import throwaway_format
from tests.checkpoint.builders import file_tensors, raw, tiny_llama, token_batches
from tests.checkpoint.throwaway_format import CONFIG_FILE, NAMES, SPEC, ThrowawayFormat
from tests.processes import ROOT, child_env

THROWAWAY = ThrowawayFormat.THROWAWAY.value


@pytest.fixture
def registered() -> Iterator[None]:
    with throwaway_format.registered():
        yield


@pytest.fixture(scope="module")
def quantized() -> torch.nn.Module:
    """A tiny Llama quantized RTN in the kernel order (weight-only)."""
    model = tiny_llama(seed=7)
    quantize_model(model, backend="w4a16", share_global_scale=None)
    return model


def _save(model: torch.nn.Module, path: Path, fmt: str) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoint.UnsharedGlobalScaleWarning)
        checkpoint.save_pretrained(model, path, format=fmt)
    return path


def _layers(model: torch.nn.Module) -> dict[str, NVFP4Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}


def _throwaway_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``nvfp4lab ARGV`` in a fresh interpreter that registered the throw-away format first."""
    code = "import tests.checkpoint.throwaway_format as t; t.main()"
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)


def test_the_format_is_registered_for_the_test_only(registered: None) -> None:
    assert FORMATS[THROWAWAY] is SPEC  # type: ignore[index]
    assert format_spec(THROWAWAY) is SPEC


def test_after_the_test_it_is_gone() -> None:
    assert THROWAWAY not in FORMATS
    with pytest.raises(ValueError, match="unknown format 'throwaway'"):
        format_spec(THROWAWAY)


def test_save_load_round_trip(registered: None, quantized: torch.nn.Module,
                              tmp_path: Path) -> None:
    path = _save(quantized, tmp_path / "ckpt", THROWAWAY)
    assert (path / CONFIG_FILE).is_file()
    assert detect_format(path) == THROWAWAY
    stored = file_tensors(path)
    layer = "model.layers.0.self_attn.q_proj"
    assert {f"{layer}.{NAMES.packed}", f"{layer}.{NAMES.block_scale}",
            f"{layer}.{NAMES.tensor_scale}"} <= stored.keys()
    loaded = checkpoint.load(path, backend="w4a16")
    want, got = _layers(quantized), _layers(loaded)
    assert want.keys() == got.keys() and want
    for name, layer_want in want.items():
        for leaf in ("weight_packed", "weight_scale", "weight_global_scale"):
            assert torch.equal(raw(getattr(got[name], leaf)), raw(getattr(layer_want, leaf))), \
                f"{name}.{leaf}"
    tokens = token_batches(1)[0]
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, quantized(tokens).logits)


def test_convert_to_and_from_compressed_tensors_is_lossless(
        registered: None, quantized: torch.nn.Module, tmp_path: Path) -> None:
    ours = _save(quantized, tmp_path / "ours", THROWAWAY)
    ct = tmp_path / "ct"
    checkpoint.convert(ours, ct, format=CheckpointFormat.COMPRESSED_TENSORS)
    assert detect_format(ct) is CheckpointFormat.COMPRESSED_TENSORS
    direct = file_tensors(_save(quantized, tmp_path / "direct",
                                CheckpointFormat.COMPRESSED_TENSORS))
    converted = file_tensors(ct)
    assert converted.keys() == direct.keys()
    for key in direct:
        assert torch.equal(raw(converted[key]), raw(direct[key])), key
    back = tmp_path / "back"
    checkpoint.convert(ct, back, format=THROWAWAY)
    assert detect_format(back) == THROWAWAY
    original, again = file_tensors(ours), file_tensors(back)
    assert original.keys() == again.keys()
    for key in original:
        assert torch.equal(raw(again[key]), raw(original[key])), key


def test_audit_through_the_python_api(registered: None, quantized: torch.nn.Module,
                                      tmp_path: Path) -> None:
    path = _save(quantized, tmp_path / "ckpt", THROWAWAY)
    rows = checkpoint.auditing.audit_rows(path)
    assert len(rows) == len(_layers(quantized))


def test_cli_offers_and_runs_the_format(quantized: torch.nn.Module, tmp_path: Path) -> None:
    """In a subprocess that registered it: ``convert --help`` lists it among the choices,
    ``audit --format throwaway`` reads it and ``convert --format throwaway`` writes it; the help
    texts name it by its title."""
    with throwaway_format.registered():
        path = _save(quantized, tmp_path / "ckpt", THROWAWAY)
        assert cli._format_titles().endswith("GGUF, FP-Quant NVFP4 or Throwaway NVFP4")
    ct = _save(quantized, tmp_path / "ct", CheckpointFormat.COMPRESSED_TENSORS)
    helped = _throwaway_cli("convert", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "{compressed-tensors,modelopt,gguf,fp-quant,throwaway}" in helped.stdout
    audited = _throwaway_cli("audit", str(path), "--format", THROWAWAY)
    assert audited.returncode == 0 and "Traceback" not in audited.stderr, audited.stderr
    assert f"{path}: 14 quantized layers, 0 flagged" in audited.stdout
    back = tmp_path / "back"
    done = _throwaway_cli("convert", str(ct), str(back), "--format", THROWAWAY)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert (back / CONFIG_FILE).is_file()
    assert file_tensors(back).keys() == file_tensors(path).keys()
