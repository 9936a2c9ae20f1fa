"""What save_pretrained(format="gguf") writes: the q/k row order of every architecture llama.cpp's
converter permutes (GGUF_ARCHITECTURES), the refusal of the others, and the metadata of a GGUF
source that has since moved. The oracles: gguf.quants.dequantize of the stored blocks and
transformers' own LlamaTensorProcessor (the inverse of llama.cpp's permutation)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from torch import nn

from nvfp4lab import checkpoint
from nvfp4lab.checkpoint import CheckpointError
from nvfp4lab.checkpoint.formats.gguf import (
    FFN_SCALE_IGNORED,
    GGUF_ARCHITECTURES,
    WEIGHTS_FILE,
    LlamaCppScaleWarning,
)
from nvfp4lab.execution import NVFP4Linear, quantize_model
from tests.checkpoint.builders import E2M1_VALUES, unpack_codes

gguf = pytest.importorskip("gguf", reason="the GGUF format needs gguf (pip install "
                           "'nvfp4lab[llm]')")
from tests.checkpoint.gguf_tokenizer import with_tokenizer  # noqa: E402  (needs gguf)

VOCAB = 300


def tiny(model_type: str, seed: int = 0) -> nn.Module:
    """A random float32 causal LM of ``model_type``: hidden 128, 2 layers, 4 heads, 2 KV heads of
    32 (GQA, so q and k permute with different head counts)."""
    torch.manual_seed(seed)
    config = transformers.CONFIG_MAPPING[model_type](
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _quantized(model_type: str, seed: int = 0) -> nn.Module:
    model = tiny(model_type, seed)
    quantize_model(model, backend="w4a16", ignore=["lm_head"])
    return model


def _block_values(layer: NVFP4Linear) -> np.ndarray:
    """code value * E4M3 block scale of each weight element (no tensor scale), float32 [N, K]."""
    codes = unpack_codes(layer.weight_packed).numpy()
    values = np.asarray(E2M1_VALUES, dtype=np.float32)[codes]
    block = layer.weight_scale.to(torch.float32).numpy()
    return (values.reshape(*block.shape, 16) * block[..., None]).reshape(codes.shape)


@pytest.mark.parametrize("model_type", ["smollm3", "granite", "arcee", "llama", "qwen3"])
def test_qk_rows_are_in_llama_cpps_order_for_each_architecture(
        model_type: str, tmp_path: Path) -> None:
    """The stored attn_q / attn_k blocks, dequantized by gguf and un-permuted by transformers'
    LlamaTensorProcessor, are the model's rows exactly for every architecture llama.cpp's
    converter builds on LlamaModel (SmolLM3, Granite, Arcee, LLaMA); Qwen3's are stored as they
    are. The file names the architecture llama.cpp expects, and loads back bit for bit."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    model = _quantized(model_type)
    path = checkpoint.save_pretrained(model, tmp_path / "g", format="gguf")
    reader = gguf.GGUFReader(path / WEIGHTS_FILE)
    arch, permuted = GGUF_ARCHITECTURES[model_type]
    assert str(reader.fields["general.architecture"].contents()) == arch
    assert permuted == (model_type != "qwen3")
    tensors = {t.name: t for t in reader.tensors}
    processor = LlamaTensorProcessor(config=model.config.to_dict())
    for block in range(2):
        for leaf, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v")):
            layer = model.get_submodule(f"model.layers.{block}.self_attn.{leaf}")
            stored = tensors[f"blk.{block}.{name}.weight"]
            assert stored.tensor_type == gguf.GGMLQuantizationType.NVFP4
            rows = gguf.quants.dequantize(stored.data, stored.tensor_type)
            ours = _block_values(layer)
            if permuted and leaf != "v_proj":
                assert not np.array_equal(rows, ours), f"{name} of block {block}"
                rows = processor.process(rows, f"blk.{block}.{name}.weight").weights
            assert np.array_equal(rows, ours), f"{name} of block {block}"
    back = checkpoint.load(path)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


@pytest.mark.parametrize("model_type", ["smollm3", "granite", "arcee", "llama", "qwen3"])
def test_architectures_whose_llama_cpp_graph_drops_ffn_scales_warn(
        model_type: str, tmp_path: Path) -> None:
    """llama.cpp's SmolLM3 / Granite / Arcee graphs skip the FFN .scale sidecars (measured in
    tests/peers/test_llama_cpp_architectures.py): saving such a model, whose FFN tensor scales
    are not 1, warns once naming an FFN tensor; LLaMA and Qwen3 save without a word."""
    model = _quantized(model_type)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.save_pretrained(model, tmp_path / "g", format="gguf")
    ours = [w for w in caught if issubclass(w.category, LlamaCppScaleWarning)]
    arch = GGUF_ARCHITECTURES[model_type][0]
    if arch in FFN_SCALE_IGNORED:
        assert len(ours) == 1, [str(w.message) for w in caught]
        text = str(ours[0].message)
        ffn = 2 * (2 if model_type == "arcee" else 3)  # 2 blocks; Arcee's MLP has no gate
        assert f"llama.cpp's {arch} graph" in text and f"{ffn} of this file's FFN" in text
        assert "(first blk.0.ffn_" in text
    else:
        assert ours == []


def test_granite_writes_its_multipliers(tmp_path: Path) -> None:
    """llama.cpp's granite architecture needs the logit scale (GraniteModel's
    set_gguf_parameters writes the four multipliers); nvfp4lab writes them from the config."""
    model = _quantized("granite")
    path = checkpoint.save_pretrained(model, tmp_path / "g", format="gguf")
    fields = gguf.GGUFReader(path / WEIGHTS_FILE).fields
    config = model.config
    for key, value in (("granite.logit_scale", config.logits_scaling),
                       ("granite.residual_scale", config.residual_multiplier),
                       ("granite.embedding_scale", config.embedding_multiplier),
                       ("granite.attention.scale", config.attention_multiplier)):
        assert float(fields[key].contents()) == float(np.float32(value)), key


def test_an_architecture_of_unknown_row_order_is_refused(tmp_path: Path) -> None:
    model = _quantized("gemma")
    with pytest.raises(CheckpointError) as err:
        checkpoint.save_pretrained(model, tmp_path / "g", format="gguf")
    message = str(err.value)
    assert "\n" not in message
    assert "'gemma'" in message and "smollm3" in message and "another format" in message
    assert not (tmp_path / "g").exists()


# -- the GGUF a model came from ----------------------------------------------------------------


@pytest.fixture
def from_gguf(tmp_path: Path) -> tuple[nn.Module, Path]:
    """A tiny Llama read back from a GGUF file that carries a tokenizer (as a llama.cpp model
    does), and that file."""
    model = _quantized("llama")
    bare = checkpoint.save_pretrained(model, tmp_path / "bare", format="gguf")
    meta = with_tokenizer(bare / WEIGHTS_FILE, tmp_path / "meta.gguf", VOCAB)
    full = checkpoint.save_pretrained(model, tmp_path / "full", format="gguf", source=meta)
    file = full / WEIGHTS_FILE
    return checkpoint.load(file), file


def _tokens(path: Path) -> list[str]:
    return list(gguf.GGUFReader(path / WEIGHTS_FILE).fields["tokenizer.ggml.tokens"].contents())


def test_a_moved_source_is_refused_naming_it(from_gguf: tuple[nn.Module, Path],
                                            tmp_path: Path) -> None:
    """The model's GGUF file moved after load: saving it as GGUF again would drop the tokenizer
    and metadata (llama.cpp could not load the result). One line naming the file and both fixes;
    nothing written."""
    model, file = from_gguf
    moved = tmp_path / "elsewhere.gguf"
    shutil.move(file, moved)
    with pytest.raises(CheckpointError) as err:
        checkpoint.save_pretrained(model, tmp_path / "again", format="gguf")
    message = str(err.value)
    assert "\n" not in message
    assert str(file) in message and "move it back" in message and "source=" in message
    assert not (tmp_path / "again").exists()
    # either fix keeps the tokenizer
    out = checkpoint.save_pretrained(model, tmp_path / "passed", format="gguf", source=moved)
    assert len(_tokens(out)) == VOCAB
    shutil.move(moved, file)
    out = checkpoint.save_pretrained(model, tmp_path / "back", format="gguf")
    assert _tokens(out) == _tokens(file.parent)


def test_a_moved_source_does_not_matter_to_other_formats(from_gguf: tuple[nn.Module, Path],
                                                         tmp_path: Path) -> None:
    """compressed-tensors and ModelOpt copy nothing from a GGUF file: they still save."""
    model, file = from_gguf
    file.unlink()
    for fmt in ("compressed-tensors", "modelopt"):
        assert (checkpoint.save_pretrained(model, tmp_path / fmt, format=fmt)
                / "config.json").is_file()
