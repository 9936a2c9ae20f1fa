"""A mixed-precision model (issue 36 item 3: NVFP4, FP8 and MXFP4 Linears beside float ones)
saved as a compressed-tensors checkpoint with one config group per scheme: compressed-tensors
validates the config, transformers decompresses each layer to our weights, nvfp4lab reloads it
bit for bit, audit lists every layer, and what cannot be saved is refused before writing."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from transformers import AutoModelForCausalLM

from nvfp4lab import checkpoint, metrics
from nvfp4lab.checkpoint.auditing import audit_rows
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.execution.layers import NVFP4Linear
from nvfp4lab.execution.mixed import FP8Linear, MXFP4Linear, apply_mix
from tests.checkpoint.builders import file_tensors, raw, tiny_llama, token_batches

L0, L1 = "model.layers.0.", "model.layers.1."
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
MIX = {
    **{L0 + n: "nvfp4-rtn" for n in (*QKV, "mlp.gate_proj", "mlp.up_proj")},
    L0 + "self_attn.o_proj": "fp8", L0 + "mlp.down_proj": "bf16",
    **{L1 + n: "nvfp4-rtn" for n in QKV},
    L1 + "self_attn.o_proj": "fp8", L1 + "mlp.down_proj": "fp8-w8a16",
    L1 + "mlp.gate_proj": "mxfp4", L1 + "mlp.up_proj": "mxfp4",
}
KINDS = {"nvfp4-rtn": NVFP4Linear, "fp8": FP8Linear, "fp8-w8a16": FP8Linear,
         "mxfp4": MXFP4Linear}


def _names(fmt: str) -> list[str]:
    return [n for n, f in MIX.items() if f == fmt]


def _mixed(bias: bool = False) -> torch.nn.Module:
    model = tiny_llama(bias=bias)
    apply_mix(model, MIX)
    return model


def _save(model: torch.nn.Module, path: Path, **kwargs: object) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return checkpoint.save_pretrained(model, path, **kwargs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    model = _mixed()
    for name, fmt in MIX.items():
        assert isinstance(model.get_submodule(name), KINDS.get(fmt, torch.nn.Linear)), name
    return model, _save(model, tmp_path_factory.mktemp("mixed") / "ckpt")


def _block(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def test_compressed_tensors_validates_the_groups(saved: tuple[torch.nn.Module, Path]) -> None:
    _, path = saved
    block = _block(path)
    config = QuantizationConfig.model_validate(
        {k: v for k, v in block.items() if k in set(QuantizationConfig.model_fields)})
    assert config.format == "mixed-precision"
    assert config.ignore == [L0 + "mlp.down_proj", "lm_head"]
    groups = list(config.config_groups.values())
    expected = [("NVFP4A16", "nvfp4-pack-quantized", "nvfp4-rtn"),
                ("FP8_DYNAMIC", "float-quantized", "fp8"),
                ("FP8_DYNAMIC", "float-quantized", "fp8-w8a16"),  # its weights, no activations
                ("MXFP4A16", "mxfp4-pack-quantized", "mxfp4")]
    assert len(groups) == len(expected)
    for group, (preset, fmt, kind) in zip(groups, expected, strict=True):
        scheme = preset_name_to_scheme(preset, group.targets)
        if kind == "fp8-w8a16":
            scheme.input_activations = None
        for ours, preset_args in ((group.weights, scheme.weights),
                                  (group.input_activations, scheme.input_activations)):
            dumped = [None if a is None else a.model_dump(mode="json") for a in (ours, preset_args)]
            assert dumped[0] == dumped[1], preset  # as written (zp_dtype is never written)
        assert str(group.format.value if hasattr(group.format, "value") else group.format) == fmt
        assert group.targets == _names(kind)  # exact module names, in module order


def test_tensors_are_named_and_quantized_as_compressed_tensors_does(
        saved: tuple[torch.nn.Module, Path]) -> None:
    model, path = saved
    stored, float_model = file_tensors(path), tiny_llama()
    fp8 = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    mx = preset_name_to_scheme("MXFP4A16", ["Linear"])
    for name in _names("fp8") + _names("fp8-w8a16"):
        keys = {k.removeprefix(name + ".") for k in stored if k.startswith(name + ".")}
        assert keys == set(FloatQuantizationCompressor.compression_param_names(fp8)), name
        w = float_model.get_submodule(name).weight.detach()
        scale = w.float().abs().amax(dim=1, keepdim=True) / 448.0  # the oracle's own scale
        assert stored[f"{name}.weight_scale"].dtype == torch.float32
        assert torch.equal(stored[f"{name}.weight_scale"], scale), name
        theirs = FloatQuantizationCompressor.compress({"weight": w.float(), "weight_scale": scale},
                                                      fp8)["weight"]
        assert theirs.dtype == stored[f"{name}.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(raw(stored[f"{name}.weight"]), raw(theirs)), name
    for name in _names("mxfp4"):
        keys = {k.removeprefix(name + ".") for k in stored if k.startswith(name + ".")}
        assert keys == set(MXFP4PackedCompressor.compression_param_names(mx)), name
        layer = model.get_submodule(name)
        assert torch.equal(stored[f"{name}.weight_packed"], layer.weight_packed)
        assert torch.equal(stored[f"{name}.weight_scale"], layer.weight_scale)


def test_transformers_decompresses_each_layer_to_ours(
        saved: tuple[torch.nn.Module, Path]) -> None:
    model, path = saved
    theirs = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
    ids = token_batches(1, seed=9)[0]
    with torch.no_grad():  # the first forward decompresses every layer
        logits_t, logits_n = theirs(ids).logits, model(ids).logits
        logits_f = tiny_llama()(ids).logits
    assert metrics.sqnr_db(logits_t, logits_n) > metrics.sqnr_db(logits_f, logits_t) + 3.0
    for name, fmt in MIX.items():
        ours, w = model.get_submodule(name), theirs.get_submodule(name).weight
        assert w.dtype == torch.bfloat16, name
        if fmt.startswith("fp8"):  # compressed-tensors 0.20 holds the scale in the model's dtype
            expected = ours.weight.to(torch.bfloat16) * ours.weight_scale.to(torch.bfloat16)
        elif fmt == "mxfp4":
            expected = ours.dequantized_weight(torch.bfloat16)
        elif fmt == "nvfp4-rtn":
            expected = ours.weight_nvfp4().dequantize(torch.bfloat16)
        else:
            expected = ours.weight
        assert torch.equal(w, expected), name


@pytest.mark.parametrize("bias", [False, True])
def test_nvfp4lab_reloads_it_bit_for_bit(bias: bool, saved: tuple[torch.nn.Module, Path],
                                          tmp_path: Path) -> None:
    model, path = saved
    if bias:
        model = _mixed(bias=True)
        path = _save(model, tmp_path / "bias")
    loaded = checkpoint.load(path)
    for name, fmt in MIX.items():
        assert type(loaded.get_submodule(name)) is KINDS.get(fmt, torch.nn.Linear), name
        if fmt.startswith("fp8"):  # not in the state dict: the config group says it
            assert loaded.get_submodule(name).quantize_activations == (fmt == "fp8"), name
    original, state = model.state_dict(), loaded.state_dict()
    assert state.keys() == original.keys()
    for key, value in state.items():
        assert value.dtype == original[key].dtype, key
        assert torch.equal(raw(value), raw(original[key])), key
    ids = token_batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_audit_lists_every_layer(saved: tuple[torch.nn.Module, Path]) -> None:
    _, path = saved
    rows = {r["layer"]: r for r in audit_rows(path)}
    quantized = {n: f for n, f in MIX.items() if f != "bf16"}
    assert set(rows) == set(quantized)
    for name, fmt in quantized.items():
        row = rows[name]
        assert row["issues"] == "", name
        if fmt.startswith("fp8"):
            scheme = "FP8_DYNAMIC" if fmt == "fp8" else "FP8_W8A16"
            assert (row["format"], row["scheme"]) == (fmt, scheme)
            assert row["nan_scales"] == row["zero_scales"] == 0
        elif fmt == "mxfp4":
            assert (row["format"], row["scheme"]) == ("mxfp4", "MXFP4A16")
        else:
            assert row["scheme"] == "NVFP4A16"


# modelopt: test_modelopt_* below; gguf (use q8_0): formats/test_gguf_mixed.py
@pytest.mark.parametrize("fmt", ["fp-quant"])
def test_other_formats_refuse_fp8_layers_before_writing(fmt: str, tmp_path: Path) -> None:
    target = tmp_path / "out"
    with pytest.raises(ValueError, match=r"holds FP8 layers \(e\.g\. 'model\.layers\.0\.self_attn"
                                         r"\.o_proj'\).*save it as compressed-tensors"):
        _save(_mixed(), target, format=fmt)
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_what_vllm_cannot_load_is_refused(tmp_path: Path) -> None:
    split = tiny_llama()
    apply_mix(split, {L0 + "self_attn.q_proj": "fp8", L0 + "self_attn.k_proj": "nvfp4-rtn",
                      L0 + "self_attn.v_proj": "nvfp4-rtn"})
    with pytest.raises(ValueError, match=r"fused unit model\.layers\.0\.self_attn mixes formats "
                                         r"\(q_proj=fp8, k_proj=nvfp4, v_proj=nvfp4\)"):
        _save(split, tmp_path / "split")
    per_tensor = tiny_llama()
    apply_mix(per_tensor, {L0 + "self_attn.o_proj": "fp8"}, per_channel=False)
    with pytest.raises(ValueError, match=r"o_proj: FP8 weight scale \[1, 1\] is per tensor"):
        _save(per_tensor, tmp_path / "tensor")
    assert list(tmp_path.iterdir()) == []


def test_fp8_only_model_saves_and_reloads(tmp_path: Path) -> None:
    model = tiny_llama()
    apply_mix(model, {L1 + "self_attn.o_proj": "fp8"})
    path = _save(model, tmp_path / "fp8")
    block = _block(path)
    assert block["format"] == "float-quantized" and list(block["config_groups"]) == ["group_0"]
    ids = token_batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(checkpoint.load(path)(ids).logits, model(ids).logits)


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (lambda b: b.update(format="nvfp4-pack-quantized"),
         "format is 'nvfp4-pack-quantized' but its config groups hold fp8/fp8-w8a16/mxfp4/nvfp4"),
        (lambda b: b["config_groups"]["group_1"]["weights"].update(strategy="tensor"),
         "group 'group_1' has FP8 weights strategy=tensor"),
        (lambda b: b["config_groups"]["group_1"]["input_activations"].update(
            strategy="tensor", dynamic=False),
         "group 'group_1' has FP8 weights with input activations"),
        (lambda b: b["config_groups"]["group_3"].update(format="float-quantized"),
         "group 'group_3' has format 'float-quantized'; nvfp4lab reads mxfp4"),
    ],
)
def test_load_refuses_groups_it_cannot_run(edit: object, pattern: str,
                                           saved: tuple[torch.nn.Module, Path],
                                           tmp_path: Path) -> None:
    import shutil

    path = Path(shutil.copytree(saved[1], tmp_path / "c"))
    file = path / "config.json"
    data = json.loads(file.read_text())
    edit(data["quantization_config"])  # type: ignore[operator]
    file.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=pattern):
        checkpoint.load(path)


def test_audit_matches_w8a16_targets_as_compressed_tensors_does(
        saved: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    """A W8A16 group targeting its layer by a prefix regex (compressed-tensors' ``re:`` is
    ``re.match``) is audited as fp8-w8a16, as load reads it."""
    import shutil

    path = Path(shutil.copytree(saved[1], tmp_path / "c"))
    file = path / "config.json"
    data = json.loads(file.read_text())
    data["quantization_config"]["config_groups"]["group_2"]["targets"] = [
        r"re:model\.layers\.1\.mlp\.down"]
    file.write_text(json.dumps(data))
    name = L1 + "mlp.down_proj"
    assert not checkpoint.load(path).get_submodule(name).quantize_activations
    row = next(r for r in audit_rows(path) if r["layer"] == name)
    assert (row["format"], row["scheme"]) == ("fp8-w8a16", "FP8_W8A16")


def test_convert_refuses_what_the_target_cannot_declare(
        saved: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    """A mixed checkpoint converts through the model; ModelOpt has no MXFP4 / FP8 W8A16 layer:
    refused in one line, nothing written."""
    with pytest.raises(CheckpointError, match=r"cannot convert this mixed-precision checkpoint to "
                                              r"modelopt: .*MXFP4 layer") as err:
        checkpoint.convert(saved[1], tmp_path / "mo", format="modelopt")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "mo").exists()


# ---------------------------------------------------------------------------------------------
# ModelOpt MIXED_PRECISION (NVFP4 W4A16 + FP8 per channel / per token + float)
# ---------------------------------------------------------------------------------------------

#: L1 gate/up stay float; ModelOpt has no FP8 weight-only algorithm: L1 down_proj W8A8
MO_MIX = {k: "fp8" if v == "fp8-w8a16" else v for k, v in MIX.items() if v != "mxfp4"}


def _mo_expected(names: dict[str, str]) -> tuple[dict[str, object], dict[str, object]]:
    """(hf_quant_config.json, config.json quantization_config) as ModelOpt 0.47 writes them for
    these per-layer algorithms, written out by hand from its source:
    modelopt/torch/export/quant_utils.py ``process_layer_quant_config`` (entries; more than one
    distinct entry -> "MIXED_PRECISION", no exclude_modules) and
    modelopt/torch/export/convert_hf_config.py ``convert_hf_quant_config_format`` /
    ``_quant_algo_to_group_config`` (one group per distinct entry, first-seen order, sorted
    targets, quantized_layers again, ignore [])."""
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    entry = {"W4A16_NVFP4": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
             "FP8_PER_CHANNEL_PER_TOKEN": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}}
    layers = {n: entry[a] for n, a in names.items()}
    producer = {"name": "modelopt", "version": "0.47.0"}
    hf = {"producer": producer, "quantization": {"quant_algo": "MIXED_PRECISION",
                                                 "kv_cache_quant_algo": None,
                                                 "quantized_layers": layers}}
    fp8 = {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
           "weights": {"dynamic": False, "num_bits": 8, "type": "float", "strategy": "channel"}}
    first = [n for n, a in names.items() if a == "W4A16_NVFP4"]
    second = [n for n, a in names.items() if a != "W4A16_NVFP4"]
    config = {"config_groups": {"group_0": {"weights": fp4, "targets": sorted(first)},
                                "group_1": {**fp8, "targets": sorted(second)}},
              "quantized_layers": layers, "ignore": [], "quant_algo": "MIXED_PRECISION",
              "producer": producer, "quant_method": "modelopt"}
    return hf, config


@pytest.mark.parametrize("bias", [False, True])
def test_modelopt_mixed_round_trip(bias: bool, tmp_path: Path) -> None:
    model = tiny_llama(bias=bias)
    apply_mix(model, MO_MIX)
    path = _save(model, tmp_path / "mo", format="modelopt")
    algo = {"nvfp4-rtn": "W4A16_NVFP4", "fp8": "FP8_PER_CHANNEL_PER_TOKEN"}
    order = [n for n, _ in model.named_modules()]
    names = {n: algo[MO_MIX[n]] for n in order if MO_MIX.get(n, "bf16") != "bf16"}
    hf, config = _mo_expected(names)
    assert json.loads((path / "hf_quant_config.json").read_text()) == hf
    assert json.dumps(_block(path)) == json.dumps(config)
    stored = file_tensors(path)
    for name in _names("fp8"):
        layer = model.get_submodule(name)
        assert stored[f"{name}.weight_scale"].shape == (layer.out_features,)  # ModelOpt: [N]
        assert torch.equal(stored[f"{name}.weight_scale"], layer.weight_scale.reshape(-1))
        assert torch.equal(raw(stored[f"{name}.weight"]), raw(layer.weight))
        assert f"{name}.input_scale" not in stored
    for name in _names("nvfp4-rtn"):
        assert f"{name}.weight_scale_2" in stored and f"{name}.input_scale" not in stored
    loaded = checkpoint.load(path)
    for name, fmt in MO_MIX.items():
        assert type(loaded.get_submodule(name)) is KINDS.get(fmt, torch.nn.Linear), name
    original, state = model.state_dict(), loaded.state_dict()
    extra = set(state) - set(original)  # ModelOpt's DECODE tensor scales, kept exactly
    assert extra and all(k.endswith(".weight_decode_scale") for k in extra)
    for key in extra:  # the ENCODE buffer is its float32 reciprocal (modelopt.py docstring)
        owner = key.removesuffix(".weight_decode_scale")
        assert torch.equal(state[key], stored[f"{owner}.weight_scale_2"].reshape(1)), key
        assert torch.equal(state[f"{owner}.weight_global_scale"], 1 / state[key]), key
    for key, value in original.items():
        assert value.dtype == state[key].dtype, key
        if key.endswith(".weight_global_scale"):
            continue
        assert torch.equal(raw(value), raw(state[key])), key
    ids = token_batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    again = _save(loaded, tmp_path / "again", format="modelopt")
    back = file_tensors(again)
    assert list(back) == list(stored)
    assert all(torch.equal(raw(back[k]), raw(stored[k])) for k in stored)
    for file in ("hf_quant_config.json", "config.json"):
        assert (again / file).read_text() == (path / file).read_text(), file


def test_modelopt_refuses_what_it_cannot_express(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^model\.layers\.1\.mlp\.gate_proj: MXFP4 layer; vLLM "
                                         r"0\.33's ModelOpt MIXED_PRECISION loader has no MXFP4"):
        _save(_mixed(), tmp_path / "mx", format="modelopt")
    per_tensor = tiny_llama()
    apply_mix(per_tensor, {L0 + "self_attn.o_proj": "fp8", L0 + "mlp.down_proj": "nvfp4-rtn"},
              per_channel=False)
    with pytest.raises(ValueError, match=r"o_proj: FP8 weight scale \[1, 1\] is per tensor; "
                                         r"ModelOpt's per-tensor 'FP8' also needs a static input"):
        _save(per_tensor, tmp_path / "tensor", format="modelopt")
    weight_only = tiny_llama()
    apply_mix(weight_only, {L0 + "self_attn.o_proj": "fp8-w8a16",
                            L0 + "mlp.down_proj": "nvfp4-rtn"})
    with pytest.raises(ValueError, match=r"o_proj: FP8 W8A16 layer \(weights only\); ModelOpt's "
                                         r"MIXED_PRECISION has no FP8 weight-only algorithm"):
        _save(weight_only, tmp_path / "w8a16", format="modelopt")
    fp8_only = tiny_llama()
    apply_mix(fp8_only, {L1 + "self_attn.o_proj": "fp8"})
    with pytest.raises(ValueError, match="FP8 layers but no NVFP4Linear; ModelOpt writes that as "
                                         "a single-algorithm FP8_PER_CHANNEL_PER_TOKEN"):
        _save(fp8_only, tmp_path / "fp8", format="modelopt")
    split = tiny_llama()
    apply_mix(split, {L0 + "mlp.gate_proj": "fp8", L0 + "mlp.up_proj": "nvfp4-rtn"})
    with pytest.raises(ValueError, match=r"fused unit model\.layers\.0\.mlp mixes formats"):
        _save(split, tmp_path / "split", format="modelopt")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def mo_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_llama()
    apply_mix(model, MO_MIX)
    return _save(model, tmp_path_factory.mktemp("mo") / "ckpt", format="modelopt")


def _set_layer(name: str, entry: dict[str, object]) -> Callable[[dict], None]:
    return lambda q: q["quantized_layers"].update({name: entry})


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (_set_layer(L0 + "self_attn.o_proj", {"quant_algo": "FP8"}),
         r"quantized_layers\['model\.layers\.0\.self_attn\.o_proj'\] has quant_algo 'FP8' "
         r"\(per-tensor FP8 with a static input scale"),
        (_set_layer(L0 + "self_attn.o_proj", {"quant_algo": "MXFP8", "group_size": 32}),
         "has quant_algo 'MXFP8' \\(not a format nvfp4lab holds\\)"),
        (_set_layer(L0 + "self_attn.q_proj", {"quant_algo": "W4A16_NVFP4", "group_size": 32}),
         "has group_size 32; NVFP4 uses blocks of 16"),
        (_set_layer(L0 + "self_attn.q_proj", {"quant_algo": "NVFP4", "group_size": 16}),
         "mix NVFP4 \\(W4A4\\) and W4A16_NVFP4 layers"),
        (_set_layer("model.norm", {"quant_algo": "W4A16_NVFP4", "group_size": 16}),
         "quantized_layers names 'model.norm' \\(LlamaRMSNorm\\)"),
        (lambda q: q.update(quantized_layers={}), "'quantized_layers' map is missing or empty"),
    ],
)
def test_modelopt_load_refuses_layers_it_cannot_hold(edit: object, pattern: str, mo_saved: Path,
                                                     tmp_path: Path) -> None:
    import shutil

    path = Path(shutil.copytree(mo_saved, tmp_path / "c"))
    for name, key in (("config.json", "quantization_config"),
                      ("hf_quant_config.json", "quantization")):
        data = json.loads((path / name).read_text())
        edit(data[key])  # type: ignore[operator]
        (path / name).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=pattern):
        checkpoint.load(path)


def _same_layers(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Every Linear of ``a`` and ``b``: the same kind, codes, block scales and FP8 bytes (tensor
    scales converted by their float32 reciprocal may differ in the last bit)."""
    for name, mine in a.named_modules():
        theirs = b.get_submodule(name) if name else b
        assert type(theirs) is type(mine), name
        leaves = {NVFP4Linear: ("weight_packed", "weight_scale"),
                  FP8Linear: ("weight", "weight_scale")}.get(type(mine), ())
        for leaf in leaves:
            assert torch.equal(raw(getattr(mine, leaf)), raw(getattr(theirs, leaf))), (name, leaf)


def test_convert_a_mixed_checkpoint_both_ways(mo_saved: Path, tmp_path: Path) -> None:
    """ModelOpt MIXED_PRECISION -> compressed-tensors (config groups) -> ModelOpt: every layer's
    bytes kept, the last folder's config and tensors equal to the first's."""
    report = checkpoint.convert(mo_saved, tmp_path / "ct", format="compressed-tensors")
    assert report.through_model and "mixed-precision checkpoint" in report.summary()
    first, ct = checkpoint.load(mo_saved), checkpoint.load(tmp_path / "ct")
    _same_layers(first, ct)
    assert _block(tmp_path / "ct")["format"] == "mixed-precision"
    checkpoint.convert(tmp_path / "ct", tmp_path / "mo", format="modelopt")
    _same_layers(first, checkpoint.load(tmp_path / "mo"))
    assert (json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())
            == json.loads((mo_saved / "hf_quant_config.json").read_text()))
    ids = token_batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(checkpoint.load(tmp_path / "mo")(ids).logits, first(ids).logits)


def test_an_mr_gptq_mix_saves_its_rotation_for_the_nvfp4_layers_only(tmp_path: Path) -> None:
    """The search's mix (nvfp4-mr-gptq + fp8-w8a16): compressed-tensors validates the groups
    and a transform_config whose targets are exactly the NVFP4 layers (the FP8 ones are not
    rotated); nvfp4lab reloads every tensor, the rotation and the logits bit for bit."""
    from compressed_tensors.transform import TransformConfig

    from nvfp4lab.hadamard import ct_rotation

    model = tiny_llama()
    mix = {**{L0 + n: "nvfp4-mr-gptq" for n in (*QKV, "self_attn.o_proj", "mlp.down_proj")},
           L0 + "mlp.gate_proj": "fp8-w8a16", L0 + "mlp.up_proj": "fp8-w8a16",
           **{L1 + n: "fp8-w8a16" for n in QKV}, L1 + "mlp.down_proj": "nvfp4-mr-gptq"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_mix(model, mix, calibration=token_batches())
    path = _save(model, tmp_path / "mr")
    block = _block(path)
    config = QuantizationConfig.model_validate(
        {k: v for k, v in block.items() if k in set(QuantizationConfig.model_fields)})
    nvfp4 = [n for n, f in mix.items() if f == "nvfp4-mr-gptq"]
    order = [n for n, _ in model.named_modules()]
    groups = {tuple(g.targets): g for g in config.config_groups.values()}
    assert set(groups) == {tuple(sorted(nvfp4, key=order.index)),
                           tuple(n for n in order if mix.get(n) == "fp8-w8a16")}
    transform = TransformConfig.model_validate(block["transform_config"])
    (scheme,) = transform.config_groups.values()
    assert all(sorted(a.targets) == sorted(nvfp4) for a in scheme.apply)
    loaded = checkpoint.load(path)
    for name, fmt in mix.items():
        back = loaded.get_submodule(name)
        if fmt == "nvfp4-mr-gptq":
            assert isinstance(back, NVFP4Linear) and back.hadamard == ct_rotation(), name
        else:
            assert isinstance(back, FP8Linear) and not back.quantize_activations, name
    original, state = model.state_dict(), loaded.state_dict()
    assert state.keys() == original.keys()
    for key, value in state.items():
        assert torch.equal(raw(value), raw(original[key])), key
    ids = token_batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_audit_lists_a_modelopt_mix(mo_saved: Path) -> None:
    """ModelOpt MIXED_PRECISION: the FP8_PER_CHANNEL_PER_TOKEN layers (scale [N]) are audited
    beside the NVFP4 ones, their scales read from the file."""
    rows = {r["layer"]: r for r in audit_rows(mo_saved)}
    quantized = {n: f for n, f in MO_MIX.items() if f != "bf16"}
    assert set(rows) == set(quantized)
    for name, fmt in quantized.items():
        assert rows[name]["issues"] == "", (name, rows[name]["issues"])
        if fmt == "fp8":
            assert (rows[name]["format"], rows[name]["scheme"]) == (
                "fp8", "FP8_PER_CHANNEL_PER_TOKEN")
            scale = FP8Linear.from_linear(tiny_llama().get_submodule(name)).weight_scale
            assert rows[name]["scale_max"] == float(scale.max())
            kernels = [v for k, v in rows[name].items() if k.startswith("vllm ")]
            assert kernels and all(v.startswith("not modelled: vLLM's ModelOpt "
                                                "FP8_PER_CHANNEL_PER_TOKEN path") for v in kernels)
        else:
            assert rows[name]["scheme"] == "NVFP4A16"
