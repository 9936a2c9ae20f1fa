"""The GGUF NVFP4 format: save_pretrained(format="gguf"), load, convert both ways, audit, and the
refusals, with the gguf package (GGUFReader, its name map, gguf.quants.dequantize) and
transformers' GGUF q/k un-permutation as the independent oracles."""

from __future__ import annotations

import copy
import math
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint import CheckpointError
from nvfp4lab.checkpoint.formats.gguf import CONFIG_KEY, NAIVE_NOTE, WEIGHTS_FILE
from nvfp4lab.checkpoint.rows import RowReader
from nvfp4lab.codec import quantize
from nvfp4lab.execution import NVFP4Linear, quantize_model
from nvfp4lab.tensor import NVFP4Tensor
from tests.checkpoint.builders import (
    E2M1_VALUES,
    file_tensors,
    modelopt_like,
    raw,
    tiny_llama,
    token_batches,
    unpack_codes,
)

gguf = pytest.importorskip("gguf", reason="the GGUF format needs gguf (pip install "
                           "'nvfp4lab[llm]')")

NVFP4 = gguf.GGMLQuantizationType.NVFP4
REPO = Path(__file__).resolve().parents[3]


def _quantized(seed: int = 0, *, w4a4: bool = False) -> nn.Module:
    model = tiny_llama(seed=seed)
    quantize_model(model, backend="w4a16", share_global_scale="llama")
    return modelopt_like(model, token_batches()) if w4a4 else model


def _layers(model: nn.Module) -> dict[str, NVFP4Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path]:
    """A W4A4 tiny Llama (untied lm_head left float) written as GGUF."""
    model = _quantized(w4a4=True)
    path = checkpoint.save_pretrained(model, tmp_path_factory.mktemp("g") / "ckpt",
                                      format="gguf")
    return model, path


def _reader(path: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(path / WEIGHTS_FILE if path.is_dir() else path)


def _f32(x: float) -> float:
    return float(np.float32(x))


# -- the file, as the gguf package reads it --------------------------------------------------


def test_gguf_reader_parses_what_the_gguf_package_parses(saved: tuple[nn.Module, Path]) -> None:
    """``gguf_reader`` (the file as a plain array) against ``gguf.GGUFReader`` (a memmap):
    every field and tensor, part by part and byte for byte."""
    from nvfp4lab.checkpoint.formats.gguf import gguf_reader

    file = saved[1] / WEIGHTS_FILE
    plain, mapped = gguf_reader(file), gguf.GGUFReader(file)
    assert type(plain.data) is np.ndarray and isinstance(mapped.data, np.memmap)
    assert list(plain.fields) == list(mapped.fields) and len(plain.fields) > 10
    for name, field in mapped.fields.items():
        got = plain.fields[name]
        assert (got.offset, got.types, got.data) == (field.offset, field.types, field.data), name
        assert [(p.dtype, p.tobytes()) for p in got.parts] == [
            (p.dtype, p.tobytes()) for p in field.parts], name
    assert len(plain.tensors) == len(mapped.tensors) > 0
    for got, tensor in zip(plain.tensors, mapped.tensors, strict=True):
        assert (got.name, got.tensor_type, got.data_offset, got.n_bytes) == (
            tensor.name, tensor.tensor_type, tensor.data_offset, tensor.n_bytes)
        assert got.shape.tolist() == tensor.shape.tolist()
        assert got.data.dtype == tensor.data.dtype and got.data.tobytes() == tensor.data.tobytes()


def test_names_types_and_the_scale_convention(saved: tuple[nn.Module, Path]) -> None:
    """Every NVFP4Linear is a type-40 tensor under gguf's own name for it, with an F32 [1]
    ``.scale`` = its DECODE scale fl32(1/weight_global_scale) and an ``.input_scale`` = its exact
    DECODE input scale; the unquantized tensors keep their dtype (1-D ones F32)."""
    model, path = saved
    assert sorted(p.name for p in path.iterdir()) == ["generation_config.json", WEIGHTS_FILE]
    reader = _reader(path)
    tensors = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, model.config.num_hidden_layers)
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_NVFP4
    layers = _layers(model)
    assert len(layers) == 14
    for name, layer in layers.items():
        base = names.get_name(name)
        weight = tensors[f"{base}.weight"]
        assert weight.tensor_type == NVFP4 and int(weight.tensor_type) == 40
        assert list(weight.shape) == [layer.in_features, layer.out_features]  # ggml order
        scale, inp = tensors[f"{base}.scale"], tensors[f"{base}.input_scale"]
        assert scale.tensor_type == gguf.GGMLQuantizationType.F32 and list(scale.shape) == [1]
        gs = float(layer.weight_global_scale)
        assert float(scale.data[0]) == _f32(np.float32(1) / np.float32(gs))
        assert float(inp.data[0]) == float(layer.input_decode_scale)
    floats = {"token_embd.weight": "BF16", "output.weight": "BF16", "output_norm.weight": "F32",
              "blk.0.attn_norm.weight": "F32", "blk.1.ffn_norm.weight": "F32"}
    for name, kind in floats.items():
        assert tensors[name].tensor_type.name == kind, name
    assert len(tensors) == 3 * 14 + 3 + 2 * 2  # per layer 3 + embd, output, norm + 2 norms/block


def test_blocks_decode_as_gguf_quants_and_transformers_read_them(
        saved: tuple[nn.Module, Path]) -> None:
    """``gguf.quants.dequantize`` of each NVFP4 tensor, un-permuted by transformers' own
    LlamaTensorProcessor, equals nvfp4lab's codes times block scales bit for bit; times the
    ``.scale`` sidecar it is the correctly rounded product code * block scale * DECODE scale,
    which nvfp4lab's dequantize (code * fl32(block scale * DECODE scale)) matches within one
    float32 ulp, exactly wherever |code| is a power of two."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    model, path = saved
    processor = LlamaTensorProcessor(config=model.config.to_dict())
    tensors = {t.name: t for t in _reader(path).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, model.config.num_hidden_layers)
    permuted = differ = 0
    for name, layer in _layers(model).items():
        base = names.get_name(name)
        blocks = tensors[f"{base}.weight"]
        deq = gguf.quants.dequantize(blocks.data, blocks.tensor_type)
        deq = processor.process(deq, f"{base}.weight").weights
        codes = unpack_codes(layer.weight_packed).numpy()
        values = np.asarray(E2M1_VALUES, dtype=np.float32)[codes]
        block = layer.weight_scale.to(torch.float32).numpy()
        ours = (values.reshape(*block.shape, 16) * block[..., None]).reshape(codes.shape)
        assert np.array_equal(deq, ours), name
        permuted += not np.array_equal(gguf.quants.dequantize(blocks.data, blocks.tensor_type),
                                       ours)
        d = np.float32(tensors[f"{base}.scale"].data[0])
        product = (deq * d).astype(np.float32)
        exact = (deq.astype(np.float64) * np.float64(d)).astype(np.float32)
        assert np.array_equal(product, exact), name
        held = NVFP4Tensor(layer.weight_packed, layer.weight_scale, layer.weight_global_scale,
                           decode_scale=torch.tensor([float(d)]))
        decoded = held.dequantize(torch.float32).numpy()
        one_ulp = np.nextafter(product, decoded) == decoded  # equal or one float32 step
        assert one_ulp.all(), name
        differ += int((decoded != product).sum())
        powers = np.isin(np.abs(values), (0.0, 0.5, 1.0, 2.0, 4.0))
        assert np.array_equal(decoded[powers], product[powers]), name
    assert permuted == 2 * model.config.num_hidden_layers  # attn_q and attn_k of each block
    assert differ > 0  # the two orders of the float32 products do differ somewhere


def test_save_load_round_trip(saved: tuple[nn.Module, Path]) -> None:
    model, path = saved
    for where in (path, path / WEIGHTS_FILE):  # the folder, or the file itself
        back = checkpoint.load(where)
        assert back.nvfp4lab_source == where
        for name, layer in _layers(model).items():
            got = back.get_submodule(name)
            assert isinstance(got, NVFP4Linear)
            assert torch.equal(got.weight_packed, layer.weight_packed)
            assert torch.equal(raw(got.weight_scale), raw(layer.weight_scale))
            assert float(got.weight_decode_scale) == _f32(1 / float(layer.weight_global_scale))
            assert torch.equal(got.input_decode_scale, layer.input_decode_scale)
        with torch.no_grad():
            for ids in token_batches():
                assert torch.equal(back(ids).logits, model(ids).logits)


def test_biases_and_float_layers_keep_llama_cpps_row_order(tmp_path: Path) -> None:
    """q/k biases and a q_proj left in floating point are stored in llama.cpp's permuted row
    order too: transformers' own LlamaTensorProcessor turns the file's rows back into the
    model's; the model loads back with identical outputs."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    model = tiny_llama(seed=2, bias=True)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # transformers starts biases at 0, which any order keeps
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=gen))
    quantize_model(model, backend="w4a16", ignore=["lm_head", "model.layers.1.self_attn.q_proj"])
    path = checkpoint.save_pretrained(model, tmp_path / "b", format="gguf")
    tensors = {t.name: t for t in _reader(path).tensors}
    processor = LlamaTensorProcessor(config=model.config.to_dict())
    for block in range(2):
        for leaf, gname in (("q_proj", "attn_q"), ("k_proj", "attn_k")):
            module = model.get_submodule(f"model.layers.{block}.self_attn.{leaf}")
            wanted = {"bias": module.bias}
            if not isinstance(module, NVFP4Linear):
                wanted["weight"] = module.weight
            for kind, value in wanted.items():
                name = f"blk.{block}.{gname}.{kind}"
                stored = np.asarray(tensors[name].data)
                if tensors[name].tensor_type == gguf.GGMLQuantizationType.BF16:
                    stored = gguf.quants.dequantize(stored, tensors[name].tensor_type)
                back = processor.process(stored.astype(np.float32), name).weights
                assert np.array_equal(back, value.detach().float().numpy()), name
                assert not np.array_equal(stored, value.detach().float().numpy()), name
    assert tensors["blk.1.attn_q.weight"].tensor_type.name == "BF16"
    loaded = checkpoint.load(path)
    with torch.no_grad():
        ids = token_batches()[0]
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_other_ggml_types_are_read_dequantized(saved: tuple[nn.Module, Path],
                                               tmp_path: Path) -> None:
    """A GGUF whose embedding llama-quantize left in Q8_0 beside NVFP4 projections: the
    embedding loads as gguf.quants.dequantize gives it (row reads included)."""
    model, path = saved
    reader = _reader(path)
    file = tmp_path / "q8.gguf"
    writer = gguf.GGUFWriter(file, arch="llama")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            main = field.types[0]
            writer.add_key_value(key, field.contents(), main,
                                 field.types[-1] if main == gguf.GGUFValueType.ARRAY else None)
    embedding = model.model.embed_tokens.weight.detach().float().numpy()
    q8 = gguf.quants.quantize(embedding, gguf.GGMLQuantizationType.Q8_0)
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            writer.add_tensor(t.name, q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = torch.from_numpy(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0))
    info = checkpoint.format_spec("gguf").read_weights(file).tensors["model.embed_tokens.weight"]
    with RowReader(info) as rows:
        assert info.dtype == "F32" and torch.equal(rows.rows(3, 9), expected[3:9])
    loaded = checkpoint.load(file)
    assert torch.equal(loaded.model.embed_tokens.weight, expected.to(torch.bfloat16))


def test_a_gguf_model_saves_again_byte_identical(saved: tuple[nn.Module, Path],
                                                 tmp_path: Path) -> None:
    """load then save_pretrained(format="gguf") writes the very same file (the loaded model
    records its source; scales kept as the exact DECODE values read)."""
    _, path = saved
    back = checkpoint.load(path)
    again = checkpoint.save_pretrained(back, tmp_path / "again", format="gguf")
    assert (again / WEIGHTS_FILE).read_bytes() == (path / WEIGHTS_FILE).read_bytes()


def test_overwrite_rules(saved: tuple[nn.Module, Path], tmp_path: Path) -> None:
    model, _ = saved
    target = checkpoint.save_pretrained(model, tmp_path / "c", format="gguf")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        checkpoint.save_pretrained(model, target, format="gguf")
    checkpoint.save_pretrained(model, target, format="gguf", overwrite=True)
    (target / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        checkpoint.save_pretrained(model, target, format="gguf", overwrite=True)
    assert (target / "notes.txt").read_text() == "mine"


def test_k_not_a_multiple_of_64_is_one_clear_error(tmp_path: Path) -> None:
    model = tiny_llama()
    model.model.layers[0].mlp.down_proj = nn.Linear(48, 64, bias=False).to(torch.bfloat16)
    model.model.layers[0].mlp.up_proj = nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    model.model.layers[0].mlp.gate_proj = nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    quantize_model(model, backend="w4a16")
    with pytest.raises(CheckpointError) as err:
        checkpoint.save_pretrained(model, tmp_path / "x", format="gguf")
    message = str(err.value)
    assert "model.layers.0.mlp.down_proj: K = 48 is not a multiple of 64" in message
    assert "\n" not in message and not (tmp_path / "x").exists()


# -- conversion ------------------------------------------------------------------------------


def _quantized_tensors(tensors: dict[str, torch.Tensor], *leaves: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if k.rpartition(".")[2] in leaves}


def test_compressed_tensors_to_gguf_and_back(tmp_path: Path) -> None:
    """CT -> GGUF -> CT: codes and block scales byte-identical; the sidecar holds
    fl32(1/weight_global_scale); tensor scales come back unless the float32 reciprocal does not
    round-trip, and the report names exactly those."""
    model = _quantized(seed=3, w4a4=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoint.TransformersDtypeWarning)
        ct = checkpoint.save_pretrained(model, tmp_path / "ct")
    there = checkpoint.convert(ct, tmp_path / "g", format="gguf")
    back = checkpoint.convert(tmp_path / "g" / WEIGHTS_FILE, tmp_path / "ct2",
                              format="compressed-tensors")
    assert (there.src_format, there.dst_format, back.src_format) == (
        "compressed-tensors", "gguf", "gguf")
    a, b = file_tensors(ct), file_tensors(tmp_path / "ct2")
    assert a.keys() == b.keys()
    for key in _quantized_tensors(a, "weight_packed", "weight_scale"):
        assert a[key].dtype == b[key].dtype and torch.equal(raw(a[key]), raw(b[key])), key
    sidecars = {t.name: float(t.data[0]) for t in _reader(tmp_path / "g").tensors
                if t.name.endswith(".scale")}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    changed = []
    for key, value in _quantized_tensors(a, "weight_global_scale", "input_global_scale").items():
        module, _, leaf = key.rpartition(".")
        if leaf == "weight_global_scale":
            assert sidecars[f"{names.get_name(module)}.scale"] == _f32(1 / float(value))
        if not torch.equal(value, b[key]):
            changed.append(key)
            assert float(b[key]) == _f32(1 / _f32(1 / float(value)))
    assert sorted(changed) == sorted(back.not_round_trip)
    for key in a.keys() - _quantized_tensors(a, "weight_packed", "weight_scale",
                                             "weight_global_scale", "input_global_scale").keys():
        assert torch.equal(a[key].float(), b[key].float()), key  # norms: bf16 -> F32 -> F32


def test_modelopt_and_gguf_convert_losslessly(tmp_path: Path) -> None:
    """Both store DECODE scales: ModelOpt -> GGUF -> ModelOpt keeps codes, block scales and
    both tensor scales byte for byte, and GGUF -> ModelOpt -> GGUF writes the same file."""
    model = _quantized(seed=4, w4a4=True)
    mo = checkpoint.save_pretrained(model, tmp_path / "mo", format="modelopt")
    checkpoint.convert(mo, tmp_path / "g", format="gguf")
    report = checkpoint.convert(tmp_path / "g", tmp_path / "mo2", format="modelopt")
    assert report.not_round_trip == () and report.scales == 28
    a, b = file_tensors(mo), file_tensors(tmp_path / "mo2")
    assert a.keys() == b.keys()
    for key in _quantized_tensors(a, "weight", "weight_scale", "weight_scale_2", "input_scale"):
        if key.rpartition(".")[0] in _layers(model):
            assert a[key].dtype == b[key].dtype and torch.equal(raw(a[key]), raw(b[key])), key
    checkpoint.convert(tmp_path / "mo2", tmp_path / "g2", format="gguf")
    assert (tmp_path / "g2" / WEIGHTS_FILE).read_bytes() == \
        (tmp_path / "g" / WEIGHTS_FILE).read_bytes()


def test_the_cli_converts_and_audits(naive: tuple[nn.Module, Path], tmp_path: Path,
                                     capfd: pytest.CaptureFixture[str]) -> None:
    """``python -m nvfp4lab convert ... --format gguf`` writes the file; ``audit`` of a naive
    GGUF (through ``cli.main`` in this process, fd-captured: the command's start was paid once
    above) exits 1 and names the missing tensor scale on every layer."""
    model = _quantized(seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoint.TransformersDtypeWarning)
        ct = checkpoint.save_pretrained(model, tmp_path / "ct")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "nvfp4lab", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=600,
                              env={"PYTHONPATH": str(REPO), "NVFP4LAB_THREADS": "1",
                                   "PATH": "/usr/bin:/bin"})

    done = cli("convert", str(ct), str(tmp_path / "g"), "--format", "gguf")
    assert done.returncode == 0, done.stderr
    assert f"{ct} (compressed-tensors) -> {tmp_path / 'g'} (gguf)" in done.stdout
    assert torch.equal(checkpoint.load(tmp_path / "g").model.layers[1].mlp.up_proj.weight_packed,
                       model.model.layers[1].mlp.up_proj.weight_packed)
    from tests import processes

    done = processes.cli_here(["audit", str(naive[1])], capfd)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"{naive[1]}: 14 quantized layers, 14 flagged" in done.stdout
    assert done.stdout.count("llama.cpp #22858") == 14


# -- the naive case and the audit --------------------------------------------------------------


def _without_sidecars(src: Path, dst: Path) -> Path:
    """Copy the GGUF file ``src`` with gguf's own reader and writer, leaving out the ``.scale``
    sidecars (llama.cpp's converter leaves out a scale of 1)."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), main, sub)
    return _write(writer, [t for t in reader.tensors if not t.name.endswith(".scale")], dst)


def _write(writer: gguf.GGUFWriter, tensors: list[Any], dst: Path) -> Path:
    """Add ``tensors`` (a GGUFReader's, bytes as stored) to ``writer``, write the file, ``dst``."""
    for t in tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def naive(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path]:
    """A tiny Llama quantized with tensor scale 1 (block scales amax_b/6 straight into E4M3),
    written as GGUF without ``.scale`` sidecars: the "naive" NVFP4 GGUF of llama.cpp #22858."""
    model = tiny_llama(seed=7)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name != "lm_head":
            parent, _, leaf = name.rpartition(".")
            q = quantize(module.weight.detach(), global_scale=1.0)
            setattr(model.get_submodule(parent), leaf, NVFP4Linear.from_quantized(q, None))
    folder = tmp_path_factory.mktemp("naive")
    saved = checkpoint.save_pretrained(model, folder / "with", format="gguf")
    assert {float(t.data[0]) for t in _reader(saved).tensors if t.name.endswith(".scale")} == {1.0}
    return model, _without_sidecars(saved / WEIGHTS_FILE, folder / "naive.gguf")


def test_a_naive_gguf_loads_with_tensor_scale_1(naive: tuple[nn.Module, Path]) -> None:
    model, file = naive
    assert not any(t.name.endswith(".scale") for t in _reader(file).tensors)
    back = checkpoint.load(file)
    for name, layer in _layers(model).items():
        got = back.get_submodule(name)
        assert torch.equal(got.weight_packed, layer.weight_packed)
        assert float(got.weight_global_scale) == 1.0 and float(got.weight_decode_scale) == 1.0
    with torch.no_grad():
        ids = token_batches()[0]
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_a_naive_gguf_converts_with_tensor_scale_1(naive: tuple[nn.Module, Path],
                                                  tmp_path: Path) -> None:
    model, file = naive
    report = checkpoint.convert(file, tmp_path / "mo", format="modelopt")
    assert report.scales == 14 and report.not_round_trip == ()
    tensors = file_tensors(tmp_path / "mo")
    for name, layer in _layers(model).items():
        assert float(tensors[f"{name}.weight_scale_2"]) == 1.0
        assert torch.equal(tensors[f"{name}.weight"], layer.weight_packed)
        assert torch.equal(raw(tensors[f"{name}.weight_scale"]), raw(layer.weight_scale))


def test_audit_flags_the_naive_gguf_and_not_the_scaled_one(
        naive: tuple[nn.Module, Path], saved: tuple[nn.Module, Path]) -> None:
    model, file = naive
    rows = checkpoint.audit_rows(file)
    assert [r["layer"] for r in rows] == list(_layers(model))
    for row in rows:
        assert row["format"] == "gguf" and row["tensor_scale"] is None
        assert NAIVE_NOTE in row["issues"] and "llama.cpp #22858" in row["issues"]
        # the oracle: block scales decoded from the file with gguf's own UE4M3 reading
        assert row["floor_frac"] > 0.9 and "piled at E4M3's floor" in row["issues"]
    floors = _floor_fraction(file, rows[0]["layer"])
    assert rows[0]["floor_frac"] == floors
    for row in checkpoint.audit_rows(saved[1]):
        assert row["issues"] == "" and row["floor_frac"] == 0.0
        assert row["fused_group"] is None  # llama.cpp merges no scales: no merge check


def _floor_fraction(file: Path, layer: str) -> float:
    """Independent count: the share of 16-element sub-blocks with a nonzero code whose UE4M3
    scale (gguf.quants.NVFP4's decoding, halved kvalues undone) is below 2^-6."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    tensor = next(t for t in _reader(file).tensors if t.name == f"{names.get_name(layer)}.weight")
    blocks = np.asarray(tensor.data).reshape(-1, 36)
    scales = 2 * gguf.quants.NVFP4.ue4m3_to_fp32(blocks[:, :4]).reshape(-1)
    codes = np.stack([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], -1).reshape(-1, 4, 16)
    nonzero = (codes & 0x7).any(-1).reshape(-1)
    return float(((scales < 2.0**-6) & nonzero).sum() / nonzero.sum())


# -- refusals --------------------------------------------------------------------------------


def _one_line(err: pytest.ExceptionInfo[BaseException], *needles: str) -> None:
    message = str(err.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)


def test_corrupt_truncated_and_non_nvfp4_files_are_one_line_errors(
        saved: tuple[nn.Module, Path], tmp_path: Path) -> None:
    data = (saved[1] / WEIGHTS_FILE).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(cut)
    _one_line(err, str(cut), "truncated")
    cut.write_bytes(data[:200])
    with pytest.raises(CheckpointError) as err:
        checkpoint.audit_rows(cut)
    _one_line(err, str(cut), "truncated")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + data[4:4096])
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(bad)
    _one_line(err, str(bad), "not a GGUF file")
    floats = _float_only(saved[1] / WEIGHTS_FILE, tmp_path / "f.gguf")
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(floats)
    _one_line(err, str(floats), "holds no NVFP4 tensor", "BF16", "F32")
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(saved[1] / WEIGHTS_FILE, two / "a.gguf")
    shutil.copy(saved[1] / WEIGHTS_FILE, two / "b.gguf")
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(two)
    _one_line(err, "holds 2 .gguf files", "pass the one to read")


def _float_only(src: Path, dst: Path) -> Path:
    """``src``'s metadata and its float tensors only."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch="llama")
    writer.add_string(CONFIG_KEY, reader.fields[CONFIG_KEY].contents())
    return _write(writer, [t for t in reader.tensors
                           if t.tensor_type != NVFP4 and math.prod(t.data.shape) > 1], dst)


# -- SmolLM2: the source GGUF's metadata and tokenizer are kept ------------------------------


@pytest.mark.slow
def test_smollm2_keeps_the_source_metadata_and_tokenizer(smollm2: tuple[nn.Module, object],
                                                         tmp_path: Path) -> None:
    from nvfp4lab import models

    model, _ = smollm2
    model = copy.deepcopy(model)
    quantize_model(model, backend="w4a16", ignore=r"re:^(?!model\.layers\.0\.).*")
    path = checkpoint.save_pretrained(model, tmp_path / "smol", format="gguf")
    from nvfp4lab.checkpoint.formats.gguf import gguf_reader

    source = gguf.GGUFReader(models._smollm2_gguf()[0])  # gguf's own reader, as the writer's
    ours = gguf_reader(path / WEIGHTS_FILE)  # gguf's parse, 1.5 s sooner (the test above)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.chat_template",
                "tokenizer.ggml.eos_token_id", "llama.block_count", "llama.embedding_length",
                "llama.attention.head_count", "llama.attention.head_count_kv",
                "llama.rope.freq_base", "llama.context_length", "general.name"):
        assert ours.fields[key].contents() == source.fields[key].contents(), key
    assert ours.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_NVFP4
    kinds = {t.name: t.tensor_type for t in ours.tensors}
    assert kinds["blk.0.attn_q.weight"] == NVFP4 and kinds["blk.1.attn_q.weight"].name == "F32"
    assert "output.weight" not in kinds  # tied, as in the source
