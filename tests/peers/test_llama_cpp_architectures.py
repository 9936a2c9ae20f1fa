"""llama.cpp itself (llama-cpp-python 0.3.36, CPU) runs the SmolLM3, Granite and Arcee GGUF files
nvfp4lab writes: the q/k row order, and which NVFP4 tensor scales llama.cpp's graphs apply.

llama.cpp's converter stores ``attn_q`` / ``attn_k`` rows permuted into its rotary order for
LLaMA and for the classes built on its LLaMA converter (SmolLM3, Granite, Arcee); nvfp4lab does
the same (``checkpoint.formats.gguf.GGUF_ARCHITECTURES``). Each test builds a tiny seeded model
from a transformers config (no download), quantizes it with nvfp4lab (RTN, weight-only, every
decoder Linear), saves it as GGUF and runs it in llama.cpp; nvfp4lab's emulation is the same
file read back with ``checkpoint.load(backend="q8_0")`` (llama.cpp's CPU arithmetic for every
NVFP4 Linear, as in tests/peers/test_llama_cpp_model.py).

What llama.cpp 0.3.36 does, measured here (docs/llama_cpp.md, "Architectures and q/k row
order"): in the smollm3, granite and arcee graphs the attention Linears (q, k, v, o) are
multiplied by their ``.scale`` sidecar, the FFN Linears (gate, up, down) are not (its llama graph
applies all seven). A file whose FFN tensor scales are not 1 therefore runs with FFN products
``1/scale`` too large (NaN logits for a tiny model). The logit comparison uses models whose
FFN tensor scales are exactly 1 (:func:`_sharp_attention_ffn_scale_one`), so that what it
measures is the q/k row order, with and without nvfp4lab's permutation.
"""

from __future__ import annotations

import copy
import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint.formats import gguf as gguf_format
from nvfp4lab.checkpoint.formats.gguf import gguf_order
from nvfp4lab.vocab import Backend

try:
    llama_cpp = importlib.import_module("llama_cpp")
except Exception as exc:  # pragma: no cover - depends on the peer install
    pytest.skip(
        f"llama-cpp-python does not import ({type(exc).__name__}: {exc}); run `make test-peers`",
        allow_module_level=True,
    )

from tests.peers.test_llama_cpp_model import _compare, _Graph  # after the skip: needs llama_cpp

pytestmark = pytest.mark.peers

#: The architectures built on llama.cpp's LLaMA converter, besides LLaMA itself (whose graph
#: tests/peers/test_llama_cpp_model.py checks on SmolLM2).
OTHERS = ("smollm3", "granite", "arcee")
VOCAB = 320
LAYERS = 4
PROMPT = 24
#: An NVFP4 tensor whose amax is 6 * 448 has tensor scale exactly 1.
AMAX_SCALE_ONE = 6.0 * 448.0
#: Measured (llama.cpp 0.3.36, F32 KV cache, these seeds; logit ranges 0.22..0.86): permuted
#: rows max |dlogit| 1.0e-7..4.2e-7 (LLaMA, natural weights: 3.6e-7), top-1 24/24; rows left
#: unpermuted max |dlogit| 0.16 (granite) .. 1.01 (arcee), top-1 2..7/24.
MAX_LOGIT_DIFF = 1e-3
#: What the unpermuted file must at least show: max |dlogit|, and at most this many same top-1.
UNPERMUTED_MIN_DIFF = 0.05
UNPERMUTED_MAX_TOP1 = PROMPT // 2
#: q and k weights are multiplied by this, so that attention depends on the rotary positions
#: (at the init scale, 0.02, every head attends almost uniformly and the row order hardly shows).
QK_GAIN = 10.0


def _tiny(model_type: str) -> torch.nn.Module:
    """A seeded ``model_type`` model (float32, 4 layers, hidden 128, 4 heads, 2 KV heads)."""
    import transformers

    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    extra: dict[str, Any] = {}
    if model_type == "granite":  # its four multipliers away from 1, so that each one matters
        extra = {"embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                 "attention_multiplier": 0.125, "logits_scaling": 4.0}
    config = transformers.CONFIG_MAPPING[model_type](
        hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _sharp_attention_ffn_scale_one(model: torch.nn.Module) -> None:
    """Multiply q/k weights by :data:`QK_GAIN`; give every FFN weight (gate, up, down) amax
    exactly 6 * 448, i.e. tensor scale 1, with outliers that meet only zeros: that of gate/up
    reads an input channel the FFN norm zeroes, that of down an intermediate channel whose up
    row is zero."""
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(QK_GAIN)
            mlp = layer.mlp
            layer.post_attention_layernorm.weight[-1] = 0.0
            for proj in (getattr(mlp, "gate_proj", None), mlp.up_proj):
                if proj is not None:
                    proj.weight[0, -1] = AMAX_SCALE_ONE
            mlp.up_proj.weight[-1, :] = 0.0
            mlp.down_proj.weight[0, -1] = AMAX_SCALE_ONE


def _write(model: torch.nn.Module, where: Path) -> Path:
    """``model`` quantized by nvfp4lab (RTN, W4A16, lm_head kept) and saved as GGUF with a
    tokenizer llama.cpp accepts (tests/checkpoint/gguf_tokenizer.py); the file's path."""
    from nvfp4lab.execution import quantize_model
    from tests.checkpoint.gguf_tokenizer import with_tokenizer

    quantize_model(model, backend="w4a16", ignore=["lm_head"])
    bare = checkpoint.save_pretrained(model, where / "bare", format="gguf")
    meta = with_tokenizer(bare / "model.gguf", where / "meta.gguf", VOCAB)
    return checkpoint.save_pretrained(model, where / "nvfp4", format="gguf",
                                      source=meta) / "model.gguf"


def _unpermuted(model: torch.nn.Module, model_type: str, where: Path,
                monkeypatch: pytest.MonkeyPatch) -> Path:
    """``model`` (already quantized) saved as nvfp4lab wrote it before q/k rows were permuted
    for ``model_type``: its GGUF_ARCHITECTURES entry says "not permuted"."""
    from tests.checkpoint.gguf_tokenizer import with_tokenizer

    name, _ = gguf_format.GGUF_ARCHITECTURES[model_type]
    with monkeypatch.context() as patch:
        patch.setitem(gguf_format.GGUF_ARCHITECTURES, model_type, (name, False))
        gguf_format._names.cache_clear()
        try:
            bare = checkpoint.save_pretrained(model, where / "bare", format="gguf")
            meta = with_tokenizer(bare / "model.gguf", where / "meta.gguf", VOCAB)
            file = checkpoint.save_pretrained(model, where / "nvfp4", format="gguf",
                                              source=meta) / "model.gguf"
        finally:
            gguf_format._names.cache_clear()
    return file


def _llama_cpp_logits(file: Path, prompt: list[int]) -> torch.Tensor:
    """llama.cpp's logits ``[len(prompt), VOCAB]`` (float32) of one batch, F32 KV cache."""
    llm = llama_cpp.Llama(model_path=str(file), n_threads=1, logits_all=True, verbose=False,
                          type_k=0, type_v=0)  # GGML_TYPE_F32 = 0
    llm.reset()
    llm.eval(prompt)
    return torch.from_numpy(np.array(llm.scores[: len(prompt)], dtype=np.float32))


def _prompt() -> list[int]:
    return torch.randint(3, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()


def _ffn_names(model_type: str) -> tuple[tuple[str, str, str], ...]:
    """(llama.cpp input tensor, output tensor before any scale multiply, module under
    ``model.layers.<i>``) of the FFN's input-side Linears in llama.cpp's graph."""
    if model_type == "arcee":  # ReLU² FFN: up and down only
        return (("ffn_norm", "ffn_up", "mlp.up_proj"),)
    return (("ffn_norm", "ffn_gate", "mlp.gate_proj"), ("ffn_norm", "ffn_up", "mlp.up_proj"))


#: (input tensor, output tensor after the ``.scale`` multiply, module, heads whose rows are
#: stored permuted): the attention Linears in llama.cpp's graphs (build_qkv / build_attn).
ATTENTION = (
    ("attn_norm", "Qcur", "self_attn.q_proj", "num_attention_heads"),
    ("attn_norm", "Kcur", "self_attn.k_proj", "num_key_value_heads"),
    ("attn_norm", "Vcur", "self_attn.v_proj", None),
    ("kqv_out", "attn_out", "self_attn.o_proj", None),
)


def _unscaled(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of an NVFP4 Linear whose tensor scale is 1: the product llama.cpp's
    ``ggml_mul_mat`` gives before (or without) its multiply by ``.scale``."""
    bare = copy.deepcopy(module)
    bare.weight_global_scale.fill_(1.0)
    if bare.weight_decode_scale is not None:
        bare.weight_decode_scale.fill_(1.0)
    return bare


@pytest.mark.parametrize("model_type", ["llama", *OTHERS])
def test_which_tensor_scales_llama_cpps_graph_applies(model_type: str, tmp_path: Path) -> None:
    """In llama.cpp 0.3.36 the attention Linears of every one of these graphs are multiplied by
    their ``.scale`` (bit-exact with nvfp4lab's ``q8_0`` layer); the FFN Linears of smollm3,
    granite and arcee are not (bit-exact with the same layer at tensor scale 1, and no
    ``ffn_*_s`` node), so a tiny model with tensor scales ~3e-5 gives NaN logits there."""
    model = _tiny(model_type)
    file = _write(model, tmp_path)
    emulation = checkpoint.load(file, backend=Backend.Q8_0)
    config = emulation.config
    ffn = _ffn_names(model_type)
    names = {f"{t}-{i}" for i in range(LAYERS) for row in (*ATTENTION, *ffn) for t in row[:2]}
    names |= {f"{out}_s-{i}" for i in range(LAYERS) for _, out, _ in ffn}
    graph = _Graph(file, names)
    try:
        graph.decode(_prompt()[:6])
    finally:
        graph.close()
    seen = graph.tensors
    for inp, out, module, heads in ATTENTION:  # layer 0: later layers' inputs may be NaN already
        layer = emulation.get_submodule(f"model.layers.0.{module}")
        assert float(layer.weight_global_scale) != 1.0, module
        with torch.no_grad():
            got = layer(seen[f"{inp}-0"])
        if heads is not None:
            got = got[:, gguf_order(got.shape[1], getattr(config, heads))]
        assert torch.equal(got, seen[f"{out}-0"]), f"{model_type} {module}: scale not applied"
    for inp, out, module in ffn:
        layer = emulation.get_submodule(f"model.layers.0.{module}")
        with torch.no_grad():
            scaled, unscaled = layer(seen[f"{inp}-0"]), _unscaled(layer)(seen[f"{inp}-0"])
        if model_type == "llama":
            assert torch.equal(seen[f"{out}-0"], unscaled) and torch.equal(
                seen[f"{out}_s-0"], scaled), module
        else:
            assert f"{out}_s-0" not in seen, f"{model_type}: llama.cpp now scales {module}"
            assert torch.equal(seen[f"{out}-0"], unscaled), f"{model_type} {module}"
    prompt = _prompt()
    theirs = _llama_cpp_logits(file, prompt)
    with torch.no_grad():
        ours = emulation(torch.tensor([prompt])).logits[0].float()
    assert bool(ours.isfinite().all())
    print(f"{model_type}: llama.cpp logits NaN {int(theirs.isnan().sum())}/{theirs.numel()}, "
          f"max |dlogit| {(ours - theirs).abs().max().item():.2e}")
    if model_type == "llama":
        assert (ours - theirs).abs().max().item() <= MAX_LOGIT_DIFF
    else:
        assert bool(theirs.isnan().all()), f"{model_type}: llama.cpp's logits are not all NaN"


@pytest.mark.parametrize("model_type", OTHERS)
def test_permuted_q_k_rows_agree_and_unpermuted_do_not(
    model_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every FFN tensor scale exactly 1 (what llama.cpp ignores can then not matter) the
    file nvfp4lab writes runs in llama.cpp with the logits of nvfp4lab's ``q8_0`` emulation
    (max |dlogit| <= 1e-3, every top-1 the same); the same weights written with q/k rows
    unpermuted (nvfp4lab before GGUF_ARCHITECTURES) are off by >= 0.05, top-1 <= 12/24."""
    model = _tiny(model_type)
    _sharp_attention_ffn_scale_one(model)
    file = _write(model, tmp_path / "permuted")
    emulation = checkpoint.load(file, backend=Backend.Q8_0)
    for name, module in emulation.named_modules():
        if name.split(".")[-1] in ("gate_proj", "up_proj", "down_proj"):
            assert float(module.weight_global_scale) == 1.0, name
        elif name.split(".")[-1] in ("q_proj", "k_proj"):
            assert float(module.weight_global_scale) != 1.0, name
    prompt = _prompt()
    with torch.no_grad():
        ours = emulation(torch.tensor([prompt])).logits[0].float()
    reports = {}
    for kind, path in (("permuted", file),
                       ("unpermuted", _unpermuted(model, model_type, tmp_path / "unpermuted",
                                                  monkeypatch))):
        c = _compare(ours, _llama_cpp_logits(path, prompt))
        reports[kind] = (c["max_diff"], int(c["same_top1"].sum()))
    report = (f"{model_type}: logit range {ours.abs().max().item():.2f}; " + "; ".join(
        f"{k}: max |dlogit| {d:.2e}, top-1 {t}/{PROMPT}" for k, (d, t) in reports.items()))
    print(report)
    (good, good_top1), (bad, bad_top1) = reports["permuted"], reports["unpermuted"]
    assert good <= MAX_LOGIT_DIFF and good_top1 == PROMPT, report
    assert bad >= UNPERMUTED_MIN_DIFF and bad_top1 <= UNPERMUTED_MAX_TOP1, report
