"""Seeded random tiny decoders of every architecture issue 34 names, a tiny tokenizer for them,
and a writer of the Hugging Face hub cache layout (sharded bf16 safetensors behind relative
links into ``blobs/``), so that tests can hand nvfp4lab "a user's model" without a download.

Every model: 2 decoder layers, hidden 64, 4 query / 2 key-value heads of 16 or 32 (a multiple of
16, as the NVFP4 KV cache needs), MLP 128, vocabulary 256, SDPA attention (eager where the
architecture has none: Gemma 2); the output head tied to the token embedding where the real
family's small models tie it. About 100,000 parameters: building one takes milliseconds.
"""

from __future__ import annotations

import copy
import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.checkpoint.hf_cache import hf_cache_layout

__all__ = [
    "ARCHITECTURES",
    "TINY_VOCAB",
    "cast_parameters",
    "save_hf_cache",
    "tiny_config",
    "tiny_model",
    "tiny_tokenizer",
]

#: The ``model_type`` of each architecture (transformers' names).
ARCHITECTURES: tuple[str, ...] = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3",
    "granite",
)

#: The models' vocabulary (token ids 0..255); :func:`tiny_tokenizer` uses fewer.
TINY_VOCAB = 256

#: Whether the family's small releases tie the output head to the embedding (Llama 3.2 1B,
#: Qwen2.5 0.5B, Qwen3 0.6B, Gemma, SmolLM3 do; Mistral 7B, Phi-3-mini, OLMo-2 1B, Granite 3 8B
#: do not).
_TIED: dict[str, bool] = {
    "llama": True, "mistral": False, "qwen2": True, "qwen3": True, "gemma2": True,
    "gemma3_text": True, "phi3": False, "olmo2": False, "smollm3": True, "granite": False,
}

#: head_dim where the config takes it apart from hidden / heads (others: 64 / 4 = 16).
_HEAD_DIM: dict[str, int] = {"llama": 32, "mistral": 32, "qwen3": 32, "gemma2": 32,
                             "gemma3_text": 32}

#: Family settings that change the forward pass (kept small so that a few tokens cross them).
_EXTRA: dict[str, dict[str, Any]] = {
    "gemma2": {"sliding_window": 8, "query_pre_attn_scalar": 32},
    "gemma3_text": {"sliding_window": 8, "query_pre_attn_scalar": 32},
    "mistral": {"sliding_window": 8},
    "granite": {"embedding_multiplier": 12.0, "logits_scaling": 8.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.03125},
}

#: The tokenizer's special tokens, ids 0..3 (the configs name them).
_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


def tiny_config(model_type: str) -> Any:
    """The tiny ``PretrainedConfig`` of ``model_type`` (one of :data:`ARCHITECTURES`)."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {model_type!r}; choose one of "
                         f"{', '.join(ARCHITECTURES)}")
    from transformers import AutoConfig

    kwargs: dict[str, Any] = dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=256,
        tie_word_embeddings=_TIED[model_type], pad_token_id=0, bos_token_id=1, eos_token_id=2,
        **_EXTRA.get(model_type, {}),
    )
    if model_type in _HEAD_DIM:
        kwargs["head_dim"] = _HEAD_DIM[model_type]
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = _attention(config)
    return config


def _attention(config: Any) -> str:
    """"sdpa" where the architecture's model class supports it (Gemma 2 does not), else
    "eager"."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def tiny_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A seeded random ``AutoModelForCausalLM`` of :func:`tiny_config` in eval mode, ``dtype``
    (``model(input_ids=[B, T]).logits`` is ``[B, T, 256]``). The same seed gives the same
    weights."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation=_attention(config))
    return model.to(dtype).eval()


def cast_parameters(model: Any, dtype: torch.dtype) -> Any:
    """A copy of ``model`` cast as transformers loads a checkpoint in ``dtype``: the parameters
    in ``dtype``, the buffers (RoPE's ``inv_freq``, float32) as they are. ``model.to(dtype)``
    would round ``inv_freq`` to ``dtype`` too, which a loaded model never does."""
    out = copy.deepcopy(model)
    for param in out.parameters():  # a tied head shares its Parameter: cast once
        param.data = param.data.to(dtype)
    return out


def tiny_tokenizer() -> Any:
    """A character-level tokenizer (``PreTrainedTokenizerFast``) built offline: ids 0..3 are
    ``<pad> <s> </s> <unk>``, then ``▁`` (a space, sentencepiece style), newline, tab and the
    printable ASCII characters: 101 tokens, all below the tiny models' vocabulary of 256.
    Anything else encodes as ``<unk>``; it adds no BOS/EOS token."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\u2581", "\n", "\t", *(chr(c) for c in range(33, 127))]
    vocab = {token: i for i, token in enumerate((*_SPECIALS, *chars))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    core.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="never")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def _shard_into(model: Any, out: Path, shards: int) -> None:
    """``model.save_pretrained(out)`` in exactly ``shards`` safetensors files (with the index
    when more than one): the largest shard size that still gives ``shards`` files."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if shards == 1:
        model.save_pretrained(str(out), max_shard_size=total * 2)
        return
    for size in range(total // shards + 1, total + 1, max(1, total // (64 * shards))):
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(str(out), max_shard_size=size)
        if len(list(out.glob("*.safetensors"))) == shards:
            return
        if len(list(out.glob("*.safetensors"))) < shards:
            break
    raise ValueError(f"cannot split this model's {total} bytes into exactly {shards} shards")


def save_hf_cache(model: Any, tokenizer: Any, cache_root: Path,
                  repo_id: str = "tiny-org/tiny-llama", shards: int = 2,
                  dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``model`` (cast to ``dtype`` on a copy; the caller's model is left as it is) and
    ``tokenizer`` into ``cache_root`` as the Hugging Face hub cache holds a download of
    ``repo_id``: ``models--<org>--<name>/blobs/<hash>``, ``snapshots/<rev>/<file> ->
    ../../blobs/<hash>`` (relative links), ``refs/main`` holding ``<rev>`` (40 hex digits, from
    the files' content). Weights in ``shards`` safetensors files
    (``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json`` when N > 1),
    config.json, generation_config.json and the tokenizer files. Returns the snapshot folder."""
    copy_ = copy.deepcopy(model).to(dtype)
    with tempfile.TemporaryDirectory(prefix="tiny-hf-") as tmp:
        out = Path(tmp) / "checkpoint"
        _shard_into(copy_, out, shards)
        tokenizer.save_pretrained(str(out))
        if not (out / "generation_config.json").is_file():
            copy_.generation_config.save_pretrained(str(out))
        digest = hashlib.sha1()
        for file in sorted(p for p in out.rglob("*") if p.is_file()):
            digest.update(file.relative_to(out).as_posix().encode() + b"\0" + file.read_bytes())
        return hf_cache_layout(out, Path(cache_root), repo_id=repo_id,
                               revision=digest.hexdigest())
