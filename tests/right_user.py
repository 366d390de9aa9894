"""The models and data a user brings, for the proofs that the recipes train what the user meant (tests/test_right.py).

A task with a known answer: tagging, `target[t] = (7 * x[t] + 3) % V`, aligned with the input position by position.
Its samples come in every shape the recipes take (the README's table): `(x, y)` pairs, `(x, mask, y)` triples,
dicts with `labels` in transformers' convention (the model shifts them, so the label of x[t] sits at t + 1) and
pairs padded with -100. Models from tiny configs (no download): transformers GPT-2 and Llama, a nanoGPT-style model
(forward(idx, targets=None), the last position's logits when no targets are given) and the built-in GPT.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

V, T = 16, 8  # vocabulary, sequence length
TRAIN, VAL = 256, 32  # samples


def tag(x: torch.Tensor) -> torch.Tensor:
    return (7 * x + 3) % V


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(V, (n, T), generator=torch.Generator().manual_seed(seed))


def lengths(n: int, seed: int) -> torch.Tensor:
    """How many leading positions of each sample count (2..T): the rest is padding."""
    return torch.randint(2, T + 1, (n,), generator=torch.Generator().manual_seed(seed))


def padded(y: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return y.masked_fill(torch.arange(T)[None] >= n[:, None], -100)


class Samples(torch.utils.data.Dataset):
    """Rows of tensors, one sample a row: a tuple of parts, or a dict of them."""

    def __init__(self, parts, keys=None):
        self.parts, self.keys = parts, keys

    def __len__(self) -> int:
        return len(self.parts[0])

    def __getitem__(self, i: int):
        row = tuple(p[i] for p in self.parts)
        return dict(zip(self.keys, row)) if self.keys else row


def _split(build):
    return build(TRAIN, 1), build(VAL, 2)


def pairs():
    """(x, y), y = tag(x) at every position."""
    return _split(lambda n, seed: Samples((x := tokens(n, seed), tag(x))))


def padded_pairs():
    """(x, y) with y -100 past each sample's length: every rank counts another number of targets."""
    return _split(lambda n, seed: Samples((x := tokens(n, seed), padded(tag(x), lengths(n, seed + 10)))))


def triples():
    """(x, mask, y): the mask 1 on each sample's counted positions, y -100 past them."""

    def build(n, seed):
        x, m = tokens(n, seed), lengths(n, seed + 10)
        mask = (torch.arange(T)[None] < m[:, None]).long()
        return Samples((x, mask, padded(tag(x), m)))

    return _split(build)


def dicts():
    """{"input_ids", "labels"}: labels[t + 1] = tag(x[t]), labels[0] = -100 (the model shifts them back)."""

    def build(n, seed):
        x = tokens(n, seed)
        labels = torch.cat([torch.full((n, 1), -100), tag(x)[:, :-1]], 1)
        return Samples((x, labels), keys=("input_ids", "labels"))

    return _split(build)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    zero = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=V, n_positions=T, bos_token_id=0, eos_token_id=0, **zero
    )
    return GPT2LMHeadModel(config)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=T,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


class NanoGPT(nn.Module):
    """nanoGPT's shape: transformer.wte/wpe/h, lm_head; forward(idx, targets=None) -> (logits, loss), its loss
    comparing logits[:, t] with targets[:, t] (-100 ignored), and logits[:, [-1], :] alone without targets."""

    def __init__(self, dim: int = 32):
        super().__init__()
        block = lambda: nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())  # noqa: E731
        self.transformer = nn.ModuleDict(
            dict(wte=nn.Embedding(V, dim), wpe=nn.Embedding(T, dim), h=nn.ModuleList([block() for _ in range(2)]))
        )
        self.lm_head = nn.Linear(dim, V)

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.transformer.h:
            x = x + block(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def nanogpt() -> nn.Module:
    return NanoGPT()


def gpt() -> nn.Module:
    """The built-in GPT, small: 2 blocks, d=32, over this task's vocabulary."""
    from core.gpt import GPT

    return GPT(vocab=V, context=T, dim=32, heads=2, layers=2)
