"""A tiny GPT (model.blocks = [Embed, Block x n, head], no dropout) and the stdlib's own source as its text."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

CORPUS_MODULES = "textwrap string heapq bisect fractions shlex calendar difflib argparse dataclasses functools".split()


def encode(text: str) -> torch.Tensor:
    """Characters -> int64 token ids (non-ASCII characters become '?')."""
    return torch.frombuffer(bytearray(text.encode("ascii", errors="replace")), dtype=torch.uint8).to(torch.int64)


def text(*, context: int = 64, val_fraction: float = 0.1) -> tuple[Dataset, Dataset]:
    """The `text` data factory: (train, val) windows of the stdlib's sources, each target its input shifted by one."""
    files = [Path(os.__file__).parent / f"{name}.py" for name in CORPUS_MODULES]  # the stdlib's folder
    parts = [file.read_text(encoding="utf-8") for file in files if file.is_file()]
    # a Python shipped without sources: torch's own Python files
    parts = parts or [p.read_text(encoding="utf-8") for p in sorted(Path(nn.__file__).parent.glob("modules/*.py"))]
    tokens = encode("\n".join(parts)[:400_000])
    parts = tokens.tensor_split([int(len(tokens) * (1 - val_fraction))])  # train, val: windows of `context` tokens
    return tuple(TensorDataset(p[:-1].unfold(0, context, context), p[1:].unfold(0, context, context)) for p in parts)


class Embed(nn.Module):
    """Token ids (B, T) -> token + position embeddings (B, T, d)."""

    def __init__(self, vocab: int, context: int, dim: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections (so each can be column-sharded)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # -1, not a stored head count: under tensor parallelism each rank holds only its heads
        q, k, v = (lin(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        mlp = OrderedDict(fc=nn.Linear(dim, 4 * dim), gelu=nn.GELU(), proj=nn.Linear(4 * dim, dim))
        self.ln2, self.mlp = nn.LayerNorm(dim), nn.Sequential(mlp)  # fc widens, proj narrows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """blocks = [Embed, Block x layers, head (ln, out)]; forward(tokens) = blocks(tokens) -> logits."""

    # vocab 128: 7-bit ASCII, so the model's shape never depends on which corpus was read
    def __init__(self, *, vocab: int = 128, context: int = 64, dim: int = 64, heads: int = 4, layers: int = 4):
        super().__init__()
        # the head (ln, out: next-token logits) is built last: the weights are drawn in the order the blocks run
        body = [Embed(vocab, context, dim), *(Block(dim, heads) for _ in range(layers))]
        self.blocks = nn.Sequential(*body, nn.Sequential(OrderedDict(ln=nn.LayerNorm(dim), out=nn.Linear(dim, vocab))))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.blocks(tokens)


gpt = GPT  # the `gpt` model factory, called with no arguments: 4 blocks, d=64, 4 heads, context 64 (~0.2M parameters)
