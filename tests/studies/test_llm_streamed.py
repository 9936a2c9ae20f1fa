"""studies.llm_streamed: the LLM study block by block from the safetensors.

Oracle: the in-memory path on the fully loaded model (``AutoModelForCausalLM.from_pretrained`` of
the same folder, same dtype): ``llm.reference_run`` and ``llm_configs.config_result``. Claimed
and checked bit for bit (``torch.equal`` on the per-token values, rows equal but for the timing
and memory fields), on seeded tiny decoders written as sharded safetensors in the Hugging Face
cache layout (links into ``blobs/``).
"""

from __future__ import annotations

import gc
import math
import os
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from nvfp4lab.studies import llm_configs as lc
from nvfp4lab.studies import llm_streamed as ls
from nvfp4lab.studies.llm import reference_run
from tests.tiny_decoders import ARCHITECTURES, TINY_VOCAB, save_hf_cache, tiny_model, tiny_tokenizer

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CONTEXT, BATCH = 8, 2
#: 45 tokens: five windows of 8 and one of 5, in batches [0, 1] [2, 3] [4] [5].
IDS = torch.randint(0, TINY_VOCAB, (45,), generator=torch.Generator().manual_seed(1))
#: Two calibration batches, the second with padding (GPTQ leaves it out of the Hessians).
_MASK = torch.ones(2, 16, dtype=torch.long)
_MASK[1, 12:] = 0
CALIBRATION = [
    {"input_ids": torch.randint(0, TINY_VOCAB, (2, 16), generator=torch.Generator().manual_seed(5)),
     "attention_mask": torch.ones(2, 16, dtype=torch.long)},
    {"input_ids": torch.randint(0, TINY_VOCAB, (2, 16), generator=torch.Generator().manual_seed(6)),
     "attention_mask": _MASK},
]
#: The configurations the streamed path runs (calibrated KV scales are computed on the whole
#: model in memory, and refused, as the W4A4 recipes are; the MXFP4 / INT4-g128 rows
#: (``weight_format``) are in-memory only: the streamed study drops them
#: (``llm_study._streamable``), and ``streamed_config_result`` refuses them.
CONFIGS = {c.label: c for c in lc.configurations()
           if getattr(c, "kv_scales", None) is None and getattr(c, "w4a4", None) is None
           and getattr(c, "weight_format", None) is None}
REFUSED = [c for c in lc.configurations() if c.label not in CONFIGS]
#: The configurations checked on both models (the rest on the bfloat16 Llama only).
REQUIRED = ("W4A16 RTN", "W4A16 GPTQ", "W4A4 RTN, dynamic", "KV nvfp4", "KV fp8")
#: Fields that measure this run (time, memory), not the model.
MEASURED = ("build_seconds", "peak_rss_mb")


def _snapshot(root: Path, model_type: str, dtype: torch.dtype) -> Path:
    return save_hf_cache(tiny_model(model_type, seed=3), tiny_tokenizer(), root,
                         repo_id=f"tiny/{model_type}", shards=2, dtype=dtype)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, torch.dtype], Path]:
    root = tmp_path_factory.mktemp("hf-cache")
    return {key: _snapshot(root / f"{key[0]}-{str(key[1])[6:]}", *key)
            for key in (("llama", torch.bfloat16), ("qwen3", torch.float32))}


def _loaded(folder: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True).eval()


def _same_row(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if key in MEASURED:
            continue
        both_nan = isinstance(value, float) and math.isnan(value) and math.isnan(got[key])
        assert both_nan or got[key] == value, key


def _same_run(got: Any, expected: Any) -> None:
    assert torch.equal(got.nll, expected.nll) and got.batches == expected.batches
    assert got.windows == expected.windows and torch.equal(got.ids, expected.ids)
    assert (got.hidden is None) == (expected.hidden is None)
    if expected.hidden is not None:
        assert all(torch.equal(a, b) for a, b in zip(got.hidden, expected.hidden, strict=True))


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_reference_and_rtn_equal_the_loaded_model_on_every_architecture(
        model_type: str, tmp_path: Path) -> None:
    folder = _snapshot(tmp_path, model_type, torch.bfloat16)
    assert (folder / "model.safetensors.index.json").is_symlink()  # the HF cache layout
    full = _loaded(folder, torch.bfloat16)
    expected = reference_run(full, IDS, context=CONTEXT, batch_size=BATCH, progress=False)
    streamed = ls.StreamedModel(folder)
    assert streamed.dtype == torch.bfloat16  # the checkpoint's dtype by default
    run = ls.streamed_reference(streamed, IDS, context=CONTEXT, batch_size=BATCH,
                                progress=False)
    _same_run(run, expected)
    config = CONFIGS["W4A16 RTN"]
    got = ls.streamed_config_result(streamed, run, config, progress=False)
    assert run.hidden is not None or model_type != "llama"  # llama keeps its hidden states
    if run.hidden is not None:  # memory first: the head's logits are made again, never kept
        assert not run.keep_logits and run.logits(0) is not run.logits(0)
    want = lc.config_result(full, expected, config)
    assert torch.equal(got.fidelity.kld, want.fidelity.kld) and got.fidelity.kld_mean > 0
    _same_row(got.row(), want.row())


@pytest.mark.parametrize("key, label", [
    *((("llama", torch.bfloat16), label) for label in CONFIGS),
    *((("qwen3", torch.float32), label) for label in REQUIRED),
], ids=lambda v: v if isinstance(v, str) else f"{v[0]}-{str(v[1])[6:]}")
def test_each_configuration_equals_the_in_memory_row(
        folders: dict[tuple[str, torch.dtype], Path], key: tuple[str, torch.dtype],
        label: str) -> None:
    folder, dtype = folders[key], key[1]
    full = _loaded(folder, dtype)
    expected_run = reference_run(full, IDS, context=CONTEXT, batch_size=BATCH, progress=False)
    run = ls.streamed_reference(folder, IDS, context=CONTEXT, batch_size=BATCH, progress=False)
    config = CONFIGS[label]
    got = ls.streamed_config_result(folder, run, config, CALIBRATION, progress=False)
    want = lc.config_result(full, expected_run, config, CALIBRATION)
    for name in ("kld", "nll", "reference_nll"):
        assert torch.equal(getattr(got.fidelity, name), getattr(want.fidelity, name)), name
    assert got.fidelity.kld_mean > 0  # the configuration changed the model
    _same_row(got.row(), want.row())
    assert ls.streamed_config_row(folder, run, config, CALIBRATION, progress=False).keys() == \
        got.row().keys()
    assert got.build_seconds > 0 and (got.peak_rss_mb is None or got.peak_rss_mb > 0)


def test_a_bfloat16_checkpoint_studied_in_float32(
        folders: dict[tuple[str, torch.dtype], Path]) -> None:
    folder = folders[("llama", torch.bfloat16)]
    full = _loaded(folder, torch.float32)
    expected = reference_run(full, IDS, context=CONTEXT, batch_size=BATCH, progress=False)
    run = ls.streamed_reference(folder, IDS, context=CONTEXT, batch_size=BATCH,
                                dtype="float32", progress=False)
    _same_run(run, expected)
    assert run.hidden is not None and run.hidden[0].dtype == torch.float32
    bf16 = ls.streamed_reference(folder, IDS, context=CONTEXT, batch_size=BATCH,
                                 progress=False)
    assert not torch.equal(bf16.nll, run.nll)  # the dtype is what the run computes in


def test_one_block_in_memory_at_a_time(folders: dict[tuple[str, torch.dtype], Path],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    folder = folders[("llama", torch.bfloat16)]
    streamed = ls.StreamedModel(folder)
    loaded: list[weakref.ref[torch.nn.Module]] = []
    own = ls.StreamedModel.load_block

    def load_block(self: ls.StreamedModel, index: int) -> torch.nn.Module:
        gc.collect()
        assert all(ref() is None for ref in loaded), "an earlier block is still alive"
        outside = [t for n, t in self.model.named_parameters()
                   if not n.startswith(self.blocks.name)]
        assert outside and all(t.is_meta for t in outside)  # released while blocks run
        block = own(self, index)
        loaded.append(weakref.ref(block))
        return block

    monkeypatch.setattr(ls.StreamedModel, "load_block", load_block)
    run = ls.streamed_reference(streamed, IDS, context=CONTEXT, batch_size=BATCH, progress=False)
    ls.streamed_config_result(streamed, run, CONFIGS["W4A16 GPTQ"], CALIBRATION, progress=False)
    assert len(loaded) == 2 * streamed.num_blocks
    for tensor in (*streamed.blocks.modules.parameters(), *streamed.blocks.modules.buffers()):
        assert tensor.is_meta  # the model's own blocks never hold weights
    outside = [t for n, t in streamed.model.named_parameters()
               if not n.startswith(streamed.blocks.name)]
    assert outside and not any(t.is_meta for t in outside)
    # tied head: one tensor, as the loaded model has it
    model = streamed.model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    # read again after the blocks ran: the checkpoint's values
    whole = dict(_loaded(folder, torch.bfloat16).named_parameters())
    for name, tensor in streamed.model.named_parameters():
        if not name.startswith(streamed.blocks.name):
            assert torch.equal(tensor, whole[name]), name


def test_one_progress_line_per_configuration_counting_blocks(
        folders: dict[tuple[str, torch.dtype], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from nvfp4lab import settings

    bars: list[Any] = []
    disabled: list[bool] = []
    text_bar = settings.tqdm_class({settings.TEXT_PROGRESS_ENV: "1"})

    def recording(*args: Any, **kwargs: Any) -> Any:
        disabled.append(bool(kwargs.get("disable")))
        bars.append(text_bar(*args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(ls, "tqdm_class", lambda: recording)
    streamed = ls.StreamedModel(folders[("llama", torch.bfloat16)])
    run = ls.streamed_reference(streamed, IDS, context=CONTEXT, batch_size=BATCH)
    configs = [CONFIGS["W4A16 RTN"], CONFIGS["KV fp8"]]
    ls.streamed_config_results(streamed, run, configs)
    assert [b.desc for b in bars] == ["reference", "W4A16 RTN", "KV fp8"]
    assert all(b.total == b.n == streamed.num_blocks and b.unit == "block" for b in bars)
    assert disabled == [False] * 3
    bars.clear()
    ls.streamed_config_results(streamed, run, configs[:1], progress=False)
    assert len(bars) == 1 and disabled[3:] == [True]


def test_bad_input_is_one_clear_error(folders: dict[tuple[str, torch.dtype], Path],
                                      tmp_path: Path) -> None:
    folder = folders[("llama", torch.bfloat16)]
    with pytest.raises(ValueError, match=r"has no config\.json"):
        ls.StreamedModel(tmp_path)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        ls.StreamedModel(folder, dtype="float64")
    streamed = ls.StreamedModel(folder)
    with pytest.raises(ValueError, match="out of range"):
        ls.streamed_reference(streamed, torch.tensor([1, 2, TINY_VOCAB]), progress=False)
    with pytest.raises(ValueError, match="nothing to predict"):
        ls.streamed_reference(streamed, torch.tensor([1]), progress=False)
    run = ls.streamed_reference(streamed, IDS, context=CONTEXT, progress=False)
    with pytest.raises(ValueError, match="needs calibration_batches"):
        ls.streamed_config_result(streamed, run, CONFIGS["W4A16 GPTQ"], progress=False)
    for config in REFUSED:
        with pytest.raises(ValueError, match="run it in memory"):
            ls.streamed_config_result(streamed, run, config, CALIBRATION, progress=False)
    with pytest.raises(ValueError, match="open the folder again"):
        ls.streamed_config_result(streamed, run, CONFIGS["W4A16 RTN"], dtype="float32")
    assert run.hidden is not None
    finisher = ls._Finisher(streamed, [IDS[:8][None]], [run.hidden[0][:1]])
    with pytest.raises(RuntimeError, match="another order"):
        finisher(IDS[8:16][None])


def test_a_checkpoint_missing_a_block_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = tiny_model("qwen3", seed=3)
    model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if k != "model.layers.1.mlp.up_proj.weight" and k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        ls.StreamedModel(tmp_path)  # refused before anything runs
