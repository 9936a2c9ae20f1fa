"""A mixed model (issue 36 item 3, GGUF part) saved as GGUF with per-tensor types: NVFP4Linear as
ggml type 40, Q8_0Linear as type 8 (block_q8_0: fp16 d, 32 int8 codes; q/k rows permuted), float
Linears in their dtype. gguf's own reader and dequantizer read the file; nvfp4lab loads it back
bit for bit; audit lists the Q8_0 rows beside the NVFP4 ones; convert, FP8 / MXFP4 layers in a
GGUF save and Q8_0 layers in other formats are refused in one line."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint.auditing import audit_rows
from nvfp4lab.checkpoint.formats.gguf import WEIGHTS_FILE, gguf_order
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.execution.layers import NVFP4Linear
from nvfp4lab.execution.mixed import apply_mix
from nvfp4lab.execution.mixed_q8_0 import Q8_0Linear
from nvfp4lab.vocab import CheckpointFormat, LayerFormat
from tests.checkpoint.builders import tiny_llama, token_batches

gguf = pytest.importorskip("gguf", reason="the GGUF format needs gguf (pip install "
                           "'nvfp4lab[llm]')")

L0, L1 = "model.layers.0.", "model.layers.1."
NV, Q8, BF = LayerFormat.NVFP4_RTN, LayerFormat.Q8_0, LayerFormat.BF16
MIX = {
    # a fused q/k/v unit may mix formats in GGUF (llama.cpp keeps separate tensors)
    L0 + "self_attn.q_proj": NV, L0 + "self_attn.k_proj": Q8, L0 + "self_attn.v_proj": Q8,
    L0 + "self_attn.o_proj": Q8, L0 + "mlp.gate_proj": NV, L0 + "mlp.up_proj": NV,
    L0 + "mlp.down_proj": BF,
    L1 + "self_attn.q_proj": Q8, L1 + "self_attn.k_proj": NV, L1 + "self_attn.v_proj": NV,
    L1 + "self_attn.o_proj": NV, L1 + "mlp.gate_proj": Q8, L1 + "mlp.up_proj": BF,
    L1 + "mlp.down_proj": Q8,
}
KINDS = {NV: NVFP4Linear, Q8: Q8_0Linear, BF: nn.Linear}


def _mixed(bias: bool = False) -> nn.Module:
    model = tiny_llama(bias=bias)
    apply_mix(model, MIX)
    return model


def _save(model: nn.Module, path: Path, **kwargs: object) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return checkpoint.save_pretrained(model, path, format=CheckpointFormat.GGUF, **kwargs)


@pytest.fixture(scope="module", params=[False, True], ids=["no-bias", "bias"])
def saved(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path]:
    model = _mixed(bias=request.param)
    for name, fmt in MIX.items():
        assert type(model.get_submodule(name)) is KINDS[fmt], name
    return model, _save(model, tmp_path_factory.mktemp("gguf-mix") / "ckpt")


def _tensors(path: Path) -> dict[str, object]:
    return {t.name: t for t in gguf.GGUFReader(path / WEIGHTS_FILE).tensors}


def _gguf_name(name: str) -> str:
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    return f"{names.get_name(name)}.weight"


def test_each_layer_has_its_ggml_type(saved: tuple[nn.Module, Path]) -> None:
    model, path = saved
    tensors = _tensors(path)
    q = gguf.GGMLQuantizationType
    want = {NV: q.NVFP4, Q8: q.Q8_0, BF: q.BF16}  # float Linears: the model's dtype (bf16)
    for name, fmt in MIX.items():
        t = tensors[_gguf_name(name)]
        assert t.tensor_type == want[fmt], name
        if fmt == Q8:
            assert f"{_gguf_name(name)[:-7]}.scale" not in tensors  # no NVFP4 sidecar
    config = model.config
    for name, fmt in MIX.items():  # gguf's dequantizer reads our Q8_0 blocks as ours
        if fmt != Q8:
            continue
        t = tensors[_gguf_name(name)]
        ours = model.get_submodule(name).dequantized_weight()
        leaf = name.rpartition(".")[2]
        heads = {"q_proj": config.num_attention_heads,
                 "k_proj": config.num_key_value_heads}.get(leaf)
        if heads:  # llama.cpp's rotary row order
            ours = ours[gguf_order(ours.shape[0], heads)]
        theirs = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        assert np.array_equal(theirs, ours.numpy()), name


def test_load_is_bit_for_bit(saved: tuple[nn.Module, Path]) -> None:
    model, path = saved
    loaded = checkpoint.load(path, backend="w4a16", dtype=torch.bfloat16)
    for name, fmt in MIX.items():
        mine, theirs = model.get_submodule(name), loaded.get_submodule(name)
        assert type(theirs) is KINDS[fmt], name
        for key, value in mine.state_dict().items():
            if key.endswith("scale_2") or "decode" in key or "global" in key:
                continue  # the tensor-scale forms GGUF stores (DECODE): checked in test_gguf
            assert torch.equal(value, theirs.state_dict()[key]), f"{name}.{key}"
    ids = token_batches(1)[0]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_audit_lists_q8_0_rows_beside_nvfp4(saved: tuple[nn.Module, Path]) -> None:
    _, path = saved
    rows = {r["layer"]: r for r in audit_rows(path, gpus=())}
    for name, fmt in MIX.items():
        if fmt == BF:
            assert name not in rows
            continue
        row = rows[name]
        assert row["format"] == ("q8_0" if fmt == Q8 else "gguf"), row
        assert not row["issues"], row
    q8 = rows[L1 + "mlp.down_proj"]
    assert q8["shape"] == [64, 128] and 0 < q8["scale_min"] <= q8["scale_max"]


def test_convert_is_refused(saved: tuple[nn.Module, Path], tmp_path: Path) -> None:
    _, path = saved
    for fmt in (CheckpointFormat.COMPRESSED_TENSORS, CheckpointFormat.MODELOPT):
        with pytest.raises(CheckpointError, match=r"cannot convert this mixed-precision "
                                                  r"checkpoint to .*: the model holds Q8_0") as err:
            checkpoint.convert(path, tmp_path / fmt.value, format=fmt)
        assert "\n" not in str(err.value)
        assert not (tmp_path / fmt.value).exists()


def test_damaged_q8_0_scales_are_refused_and_flagged(
        saved: tuple[nn.Module, Path], tmp_path: Path) -> None:
    _, path = saved
    file = tmp_path / "bad.gguf"
    file.write_bytes((path / WEIGHTS_FILE).read_bytes())
    t = _tensors(path)[_gguf_name(L0 + "self_attn.o_proj")]
    with open(file, "r+b") as handle:  # the first block's fp16 d := +inf
        handle.seek(int(t.data_offset))
        handle.write(np.float16(np.inf).tobytes())
    with pytest.raises(CheckpointError, match=r"Q8_0 block scales of .*o_proj are not all finite"):
        checkpoint.load(file)
    row = next(r for r in audit_rows(file, gpus=()) if r["layer"] == L0 + "self_attn.o_proj")
    assert row["nan_scales"] == 1 and "not finite" in row["issues"]


def test_what_gguf_cannot_hold_is_refused(tmp_path: Path) -> None:
    model = tiny_llama()
    apply_mix(model, {L0 + "self_attn.q_proj": NV, L0 + "self_attn.o_proj": LayerFormat.FP8})
    with pytest.raises(ValueError, match=r"o_proj: FP8 layer; GGUF has no llama.cpp type for "
                                         r"it: use 'q8_0'") as err:
        _save(model, tmp_path / "a")
    assert "\n" not in str(err.value) and not (tmp_path / "a").exists()
    mixed = _mixed()
    for fmt in (CheckpointFormat.COMPRESSED_TENSORS, CheckpointFormat.MODELOPT):
        with pytest.raises(ValueError, match=r"Q8_0 layers .*only GGUF stores"):
            checkpoint.save_pretrained(mixed, tmp_path / fmt.value, format=fmt)
