"""nvfp4lab.studies.llm_study: the LLM study on a user's model and text (issue 34).

The oracle of the study's numbers is the study written out by hand with transformers and the
study functions underneath: the model loaded by ``from_pretrained``, the text split by
``texts.split_text``, each text's windows scored on their own (``reference_run`` +
``token_fidelity`` of a ``quantize_model`` copy). The study runs both texts in one pass and
splits the per-token values back; the two must agree bit for bit."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from nvfp4lab import corpus, texts
from nvfp4lab.execution import quantize_model
from nvfp4lab.studies import llm, llm_study, llm_study_page
from nvfp4lab.studies import llm_configs as lc
from tests.tiny_decoders import save_hf_cache, tiny_model, tiny_tokenizer

WORDS = (
    "the", "cat", "sat", "on", "a", "mat", "while", "rain", "fell", "over", "quiet", "hills",
    "and", "rivers", "ran", "to", "the", "sea", "under", "grey", "skies", "some", "birds",
    "sang", "songs", "of", "old", "kings", "who", "ruled", "lands", "far", "away",
)


def write_text(path: Path, sections: int = 12, words: int = 60, seed: int = 0) -> Path:
    """A seeded markdown file of ``sections`` headed documents of ``words`` words each."""
    rng = random.Random(seed)
    parts = []
    for i in range(sections):
        body = " ".join(rng.choice(WORDS) for _ in range(words))
        parts.append(f"# Part {i}\n\n{body}.\n")
    path.write_text("\n".join(parts))
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama in the Hugging Face cache layout (bf16, two shards): its snapshot folder."""
    root = tmp_path_factory.mktemp("hf")
    return save_hf_cache(tiny_model("llama", seed=1), tiny_tokenizer(), root / "hub",
                         repo_id="tiny-org/tiny-llama")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text(tmp_path_factory.mktemp("text") / "notes.md")


def _by_hand(snapshot: Path, ids: torch.Tensor, context: int, configs: list[dict[str, Any]]
             ) -> list[Any]:
    """The oracle: the model loaded by transformers in float32, the windows of ``ids`` scored
    against each ``quantize_model`` copy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(snapshot), dtype=torch.float32,
                                                 local_files_only=True).eval()
    run = llm.reference_run(model, ids, context=context, batch_size=llm.DEFAULT_BATCH_SIZE,
                            progress=False)
    out = []
    for options in configs:
        q = copy.deepcopy(model)
        quantize_model(q, **options)
        with torch.no_grad():
            out.append(llm.token_fidelity(run, q, progress=False))
    return out


def _equal(a: Any, b: Any) -> None:
    for name in ("kld", "nll", "reference_nll", "top1"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.window_tokens == b.window_tokens and a.row() == b.row()


def test_both_texts_in_one_pass_equal_each_text_scored_alone(tiny_llama: Path,
                                                             text_file: Path) -> None:
    context, tokens = 32, 128  # 4 windows per text: the batches of 4 align with the texts
    result = llm_study.study(tiny_llama, text=text_file, configs=["w4a16-rtn", "kv-nvfp4"],
                             tokens=tokens, context=context, progress=False)
    tokenizer = tiny_tokenizer()
    split = texts.split_text(texts.read_documents(text_file))
    assert result.plan.split == split and result.plan.domain_name == texts.domain_text(split)[0]
    evaluation = corpus.token_ids(tokenizer, split.evaluation)[:tokens]
    second = corpus.token_ids(tokenizer, corpus.pydoc_split().evaluation)[:tokens]
    assert evaluation.numel() == second.numel() == tokens
    options = [dict(backend="w4a16"), dict(backend=None, kv_cache="nvfp4")]
    for got, want in zip(result.evaluation, _by_hand(tiny_llama, evaluation, context, options),
                         strict=True):
        _equal(got.fidelity, want)
    for got, want in zip(result.domain, _by_hand(tiny_llama, second, context, options),
                         strict=True):
        _equal(got.fidelity, want)
    assert [r["label"] for r in result.rows()] == ["W4A16 RTN", "KV nvfp4"] * 2
    assert {v.best.label for v in result.verdicts} == {"W4A16 RTN", "KV nvfp4"}


def test_kv_calibration_and_smoothing_share_one_pass_in_the_study(tiny_llama: Path,
                                                                   text_file: Path) -> None:
    """The in-memory study makes one float calibration pass for a KV-calibrated and a
    SmoothQuant configuration: each row equals that configuration built and scored alone."""
    from nvfp4lab.studies.llm_configs import config_result

    names = ["kv-nvfp4-calibrated-scales", "w4a4-rtn-smoothquant-0.5"]
    result = llm_study.study(tiny_llama, text=text_file, configs=names, tokens=128, context=32,
                             samples=2, streamed=False, progress=False)
    plan = result.plan
    reference, _ = llm_study.load_decoder(plan.source, dtype=plan.dtype)
    run = llm.reference_run(reference, plan.ids, context=plan.context,
                            batch_size=llm.DEFAULT_BATCH_SIZE, progress=False)
    for first, second, config in zip(result.evaluation, result.domain, plan.configs,
                                     strict=True):
        alone = config_result(reference, run, config, plan.batches).fidelity  # both texts
        for name in ("kld", "nll", "top1"):
            both = torch.cat([getattr(first.fidelity, name), getattr(second.fidelity, name)])
            assert torch.equal(both, getattr(alone, name)), (config.label, name)
        assert alone.kld_mean > 0


def test_streamed_study_equals_the_in_memory_study(tiny_llama: Path, text_file: Path) -> None:
    kwargs = dict(text=text_file, configs=["w4a16-rtn", "w4a16-gptq", "kv-fp8"], tokens=64,
                  context=32, samples=2, progress=False)
    memory = llm_study.study(tiny_llama, streamed=False, **kwargs)
    streamed = llm_study.study(tiny_llama, streamed=True, **kwargs)
    assert streamed.plan.streamed and not memory.plan.streamed
    for a, b in zip(memory.evaluation + memory.domain, streamed.evaluation + streamed.domain,
                    strict=True):
        _equal(a.fidelity, b.fidelity)


def test_saved_study_reads_back_for_the_page(tiny_llama: Path, text_file: Path,
                                             tmp_path: Path) -> None:
    result = llm_study.study(tiny_llama, text=text_file, configs=["w4a16-rtn", "kv-fp8"],
                             tokens=64, context=32, progress=False)
    result.save(tmp_path)
    saved = llm_study_page.load_saved(tmp_path)
    assert [r["label"] for r in saved.evaluation_rows()] == ["W4A16 RTN", "KV fp8"]
    assert saved.evaluation_rows()[0]["kld_mean"] == pytest.approx(
        result.evaluation[0].fidelity.kld_mean, rel=1e-12)
    assert saved.facts["verdict"] == result.verdict()
    header = saved.header()
    assert "tiny-org/tiny-llama" in header and "2 evaluation windows" in header
    assert [d["label"] for d in saved.facts["domain"]] == ["W4A16 RTN", "KV fp8"]


def test_configuration_names() -> None:
    names = llm_study.config_names()
    assert names["w4a16-mr-gptq"].label == "W4A16 MR-GPTQ"
    assert names["w4a4-kv-nvfp4"].label == "W4A4 + KV nvfp4"
    assert [c.label for c in llm_study.select_configs(["kv-fp8", "W4A16 RTN"])] == [
        "W4A16 RTN", "KV fp8"]  # the study's order, labels accepted too
    with pytest.raises(ValueError, match=r"unknown configuration 'w8a8'; accepted: w4a16-rtn"):
        llm_study.select_configs(["w8a8"])
    # the recipes measured beside the table run when named, or with "all"
    extra = [c.label for c in lc.more_configurations()]
    table = [c.label for c in lc.configurations()]
    assert not set(extra) & set(table) and "W4A4 RTN + AWQ" in extra
    assert names["w4a4-rtn-awq"].w4a4.awq and names["kv-nvfp4-qk-rotation-16"].kv_rotation == 16
    assert [c.label for c in llm_study.select_configs(["w4a4-rtn-awq", "kv-fp8"])] == [
        "KV fp8", "W4A4 RTN + AWQ"]
    assert [c.label for c in llm_study.select_configs(["ALL"])] == table + extra
    assert [c.label for c in llm_study.select_configs(None)] == table


def test_bad_inputs_are_refused_before_any_model_runs(tiny_llama: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.md"
    short.write_text("# A\n\nthe cat sat.\n\n# B\n\non the mat.\n\n# C\n\nrain fell.\n")
    with pytest.raises(ValueError, match=r"evaluation text holds \d+ tokens, fewer than one "
                       r"window of --context 256; give more text or a smaller --context"):
        llm_study.plan_study(tiny_llama, text=short)
    with pytest.raises(ValueError, match="--calibration needs --text"):
        llm_study.plan_study(tiny_llama, calibration=short)
    with pytest.raises(ValueError, match=r"--dtype 'int8' is not one of float32, bfloat16"):
        llm_study.plan_study(tiny_llama, dtype="int8", tokens=64, context=32)
