"""The checkpoint-format registry (nvfp4lab/checkpoint/formats/__init__.py): complete, each
format detected as itself, and no format knowledge outside the format modules."""

from __future__ import annotations

import ast
import importlib
import json
import struct
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

import nvfp4lab
from nvfp4lab import checkpoint, vocab
from nvfp4lab.checkpoint import CheckpointError, auditing
from nvfp4lab.checkpoint.formats import FORMATS, CheckpointFormatSpec, detect_format, format_spec
from nvfp4lab.checkpoint.records import Contents, Shard, Unquantized
from nvfp4lab.checkpoint.rows import stored_tensor
from nvfp4lab.vocab import CheckpointFormat, Scheme

PACKAGE = Path(nvfp4lab.__file__).parent
FORMAT_MODULES = {f"nvfp4lab/checkpoint/formats/{m.name.lower()}.py" for m in CheckpointFormat}


def _module(fmt: CheckpointFormat) -> object:
    return importlib.import_module(f"nvfp4lab.checkpoint.formats.{fmt.name.lower()}")


def test_every_format_has_a_module_and_a_registry_entry() -> None:
    assert list(FORMATS) == list(CheckpointFormat)
    for fmt in CheckpointFormat:
        spec = FORMATS[fmt]
        assert spec is _module(fmt).SPEC  # type: ignore[attr-defined]
        assert isinstance(spec, CheckpointFormatSpec)
        assert spec.format is fmt and format_spec(fmt.value) is spec
        assert spec.names.scalar_shape in spec.names.scalar_shapes
    assert checkpoint.detect_format is detect_format


def test_an_unknown_format_is_named_with_the_accepted_ones() -> None:
    accepted = ", ".join(repr(f.value) for f in FORMATS)
    assert accepted.startswith("'compressed-tensors', 'modelopt', 'gguf'")
    with pytest.raises(ValueError) as err:
        format_spec("awq")
    assert str(err.value) == f"unknown format 'awq'; accepted values: {accepted}"


def test_each_formats_tensor_scale_facts_come_from_the_one_table() -> None:
    """``vocab.TENSOR_SCALE_STORAGE`` states each format's stored scale form and fused-group
    sharing once: every spec and ``execution/shared_scales`` read it."""
    from nvfp4lab.checkpoint.formats.tensor_scales import TensorScaleForm
    from nvfp4lab.execution.shared_scales import MERGED_FORMATS

    assert set(vocab.TENSOR_SCALE_STORAGE) == set(FORMATS)
    for fmt, spec in FORMATS.items():
        storage = vocab.TENSOR_SCALE_STORAGE[fmt]
        assert spec.names.decode_form is storage.decode
        assert spec.shares_fused_scales is storage.shared_in_fused_groups
        assert isinstance(spec, TensorScaleForm)
    assert tuple(f for f, s in FORMATS.items() if s.shares_fused_scales) == MERGED_FORMATS
    # the facts themselves, as the sources say (module docstrings of each format)
    assert {f.value: (s.names.decode_form, s.shares_fused_scales) for f, s in FORMATS.items()
            if f.value in ("compressed-tensors", "modelopt", "gguf")} == {
        "compressed-tensors": (False, True), "modelopt": (True, True), "gguf": (True, False)}


@pytest.mark.parametrize("fmt", list(CheckpointFormat))
def test_the_fused_decode_scale_is_the_max_of_the_stored_scales(fmt: CheckpointFormat) -> None:
    """vLLM keeps ``max`` of the stored tensor scales of a fused group: DECODE formats that max,
    ENCODE formats its float32 reciprocal (independent float64 -> float32 oracle)."""
    spec = FORMATS[fmt]
    stored = [_f32(0.5), _f32(1 / 3), _f32(0.7)]
    top = max(stored)
    want = top if spec.names.decode_form else _f32(1 / top)
    got = spec.fused_decode_scale(stored)
    assert got.dtype == torch.float32 and tuple(got.shape) == (1,)
    assert torch.equal(got, torch.tensor([want], dtype=torch.float32))


#: One quantized Linear of a two-layer Llama (K = 64: every format can hold it).
LAYER = "model.layers.0.self_attn.q_proj"


#: Formats that hold W4A4 only (FP-Quant: every engine quantizes the activations).
W4A4_ONLY = {CheckpointFormat.FP_QUANT}


def _scheme(spec: CheckpointFormatSpec) -> Scheme:
    return Scheme.NVFP4 if spec.format in W4A4_ONLY else Scheme.NVFP4A16


def _contents(spec: CheckpointFormatSpec) -> Contents:
    """The smallest checkpoint: a Llama config and one NVFP4 layer (weight-only, W4A4 for a
    format that holds no other), under the format's names."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                         architectures=["LlamaForCausalLM"])
    names = spec.names
    scale = spec.to_disk(torch.tensor([2688.0]), None)
    tensors = (
        stored_tensor(f"{LAYER}.{names.packed}", torch.full((64, 32), 0x21, dtype=torch.uint8)),
        stored_tensor(f"{LAYER}.{names.block_scale}",
                      torch.full((64, 4), 1.0).to(torch.float8_e4m3fn)),
        stored_tensor(f"{LAYER}.{names.tensor_scale}", scale.contiguous()),
    )
    if _scheme(spec) == Scheme.NVFP4:
        tensors += (stored_tensor(f"{LAYER}.{names.input_scale}", scale.contiguous()),)
    return Contents((Shard("model.safetensors", tensors),), config.to_json_string(),
                    _scheme(spec), Unquantized(("lm_head",), ("lm_head",)))


@pytest.mark.parametrize("fmt", list(CheckpointFormat))
def test_each_formats_folder_is_detected_as_exactly_that_format(
    fmt: CheckpointFormat, tmp_path: Path
) -> None:
    spec = FORMATS[fmt]
    folder = tmp_path / fmt.name
    folder.mkdir()
    returned = spec.write_checkpoint(folder, _contents(spec))
    assert detect_format(folder) is fmt
    assert [f for f, other in FORMATS.items() if other.detect(folder)] == [fmt]
    config = spec.read_config(folder)
    assert config.checkpoint_scheme() == _scheme(spec)
    written = {p.name for p in folder.iterdir()}
    assert written == {*returned, *spec.config_files}
    assert set(spec.weight_files) <= written
    stored = spec.read_weights(folder)
    assert stored.tensors[f"{LAYER}.{spec.names.packed}"].shape == (64, 32)
    assert spec.model_config(folder)["hidden_size"] == 64


def test_an_unknown_quant_method_lists_every_format(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "awq"}}), encoding="utf-8")
    with pytest.raises(CheckpointError, match="quant_method is 'awq'") as err:
        detect_format(tmp_path)
    for spec in FORMATS.values():
        assert spec.description in str(err.value)


def _f32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


@pytest.mark.parametrize("fmt", list(CheckpointFormat))
def test_the_scale_convention_on_disk(fmt: CheckpointFormat) -> None:
    """ENCODE formats store the in-memory scale; DECODE formats its float32 reciprocal (or the
    exact DECODE value the layer holds); reading gives both back."""
    spec = FORMATS[fmt]
    encode = torch.tensor([2688 / 3.7], dtype=torch.float32)
    stored = spec.to_disk(encode, None)
    assert tuple(stored.shape) == spec.names.scalar_shape and stored.dtype == torch.float32
    expected = _f32(1 / float(encode)) if spec.names.decode_form else float(encode)
    assert float(stored) == expected
    back, exact = spec.from_disk(stored.reshape(1))
    if spec.names.decode_form:
        assert float(exact) == expected and float(back) == _f32(1 / expected)
        held = torch.tensor([0.123], dtype=torch.float32)
        assert float(spec.to_disk(torch.reciprocal(held), held)) == float(held)
    else:
        assert exact is None and float(back) == float(encode)


# -- no format knowledge outside the format modules ------------------------------------------

#: cli.py functions that make up the checkpoint commands.
CLI_CHECKPOINT = {"_format_titles", "_add_audit", "_audit_out", "_render_audit", "_run_audit",
                  "_add_convert", "_run_convert"}


def _format_names() -> set[str]:
    """On-disk names of the formats that no other module may spell."""
    out: set[str] = set()
    for fmt, spec in FORMATS.items():
        out |= {spec.names.tensor_scale, spec.names.input_scale, *spec.config_files}
        out |= set(spec.weight_files)
        module = _module(fmt)
        for attr in ("CT_FORMAT", "QUANT_METHOD", "HF_QUANT_CONFIG_NAME", "SUFFIX",
                     "CONFIG_KEY"):
            if hasattr(module, attr):
                out.add(getattr(module, attr))
        out |= set(getattr(module, "QUANT_ALGOS", {}))
    out |= {"quant_algo", "exclude_modules", "producer"}
    return out


def _vocabulary() -> set[str]:
    enums = (vocab.CheckpointFormat, vocab.Scheme, vocab.Backend, vocab.Numerics,
             vocab.OrderName)
    return {m.value for e in enums for m in e} | {vocab.AUTO}


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, value) of every string constant that is not a docstring."""
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
        and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def _of_a_format(rel: str) -> bool:
    """Whether ``rel`` is a format's module or one of the modules it is split into by job
    (``formats/gguf.py`` and ``formats/gguf_read.py``, ``gguf_names.py``, ...)."""
    return any(rel == m or rel.startswith(m.removesuffix(".py") + "_") for m in FORMAT_MODULES)


def _checked_sources() -> list[tuple[str, ast.AST]]:
    out = []
    for file in sorted((PACKAGE / "checkpoint").rglob("*.py")):
        rel = file.relative_to(PACKAGE.parent).as_posix()
        if not _of_a_format(rel):
            out.append((rel, ast.parse(file.read_text(encoding="utf-8"))))
    cli = ast.parse((PACKAGE / "cli.py").read_text(encoding="utf-8"))
    for node in cli.body:
        if isinstance(node, ast.FunctionDef) and node.name in CLI_CHECKPOINT:
            out.append((f"nvfp4lab/cli.py:{node.name}", node))
    return out


#: Literals a module may hold although a format spells them too: the audit table's own columns
#: (its "input_scale" column is the activation scale of any format).
ALLOWED = {"nvfp4lab/checkpoint/auditing.py": set(auditing.COLUMNS)}


def test_format_names_and_vocabulary_literals_live_only_in_the_format_modules() -> None:
    forbidden = _format_names() | _vocabulary()
    found = [f"{where}:{line}: {value!r}" for where, tree in _checked_sources()
             for line, value in _strings(tree)
             if value in forbidden and value not in ALLOWED.get(where, set())]
    assert found == []


def test_the_literal_check_can_fail() -> None:
    tree = ast.parse('"""doc"""\nx = "modelopt"\ny = "weight_scale_2"\n')
    assert [v for _, v in _strings(tree) if v in _format_names() | _vocabulary()] == [
        "modelopt", "weight_scale_2"]
