"""Small seeded models and inputs shared by the execution tests."""

from __future__ import annotations

import math

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.o_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, h, d // h).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // h), dim=-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.norm2 = nn.LayerNorm(d)
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        y = self.norm2(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(y)) * self.up_proj(y))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 100, d: int = 64, heads: int = 4, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, heads, hidden) for _ in range(2)])
        self.odd = nn.Linear(d, 20)  # K=64 fine, but its consumer below has K=20
        self.odd_out = nn.Linear(20, d)  # K=20: not a multiple of 16
        self.mha = nn.MultiheadAttention(d, 4, batch_first=True)  # out_proj: Linear subclass
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        x = x + self.odd_out(torch.tanh(self.odd(x)))
        x = x + self.mha(x, x, x, need_weights=False)[0]
        return self.lm_head(self.norm(x))


def tiny_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().eval()


def token_batches(n: int = 4, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100, (2, 12), generator=g) for _ in range(n)]
