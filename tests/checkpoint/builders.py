"""Tiny seeded Llama models, compressed-tensors-made checkpoints and file helpers shared by the
checkpoint tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

VOCAB = 128


def tiny_llama(*, bias: bool = False, tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    """A random bf16 Llama: hidden 64, 2 layers, GQA (4 heads, 2 KV heads)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attention_bias=bias,
        mlp_bias=bias,
        tie_word_embeddings=tied,
    )
    # from_config(dtype=) as from_pretrained does: rotary frequencies stay float32 buffers
    # (``.to(torch.bfloat16)`` would round them and change every attention output)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def token_batches(n: int = 2, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 9), generator=gen) for _ in range(n)]


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes-comparable view (float8 has no torch.equal on every build)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(raw(a[key]), raw(b[key])), key


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
