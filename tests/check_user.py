"""A user's own models and data, shaped as the ecosystem shapes them, for tests/test_check.py.

Copied into a temporary folder as `usermodels.py`, the user's cwd, when `python -m recipes check` runs on them.
"""

import os

import torch
from torch import nn
from torch.utils.data import IterableDataset

V, T = 50, 12


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.spare = nn.Linear(32, 10)  # forward() never calls it

    def forward(self, x):
        return self.net(x)


def unused():
    return Unused()


def unused_dropout():
    """Unused's spare layer and a dropout: check compares the runs with dropout off, through its own factory."""
    model = Unused()
    model.net.insert(2, nn.Dropout(0.1))
    return model


def batchnorm():
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


def dropout():
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 10))


class Switch(nn.Module):
    """Which branch trains depends on the batch: DDP's unused set changes from step to step."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 10), nn.Linear(64, 10)

    def forward(self, x):
        return self.up(x) if x.mean() > 0 else self.down(x)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    zero = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V, n_positions=32, bos_token_id=0, eos_token_id=0, **zero)
    )


def bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


class NanoGPT(nn.Module):
    """nanoGPT's shape: forward(idx, targets=None) -> (logits, loss); without targets, the last position's logits
    only (its inference path), so a loss taken outside the model cannot work."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, 16), nn.Embedding(T, 16)
        self.mix, self.head = nn.Linear(16, 16), nn.Linear(16, V)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        x = x + torch.relu(self.mix(x.cumsum(1) / torch.arange(1, idx.shape[1] + 1)[:, None]))
        logits = self.head(x)
        if targets is None:
            return logits[:, [-1], :], None
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def nano():
    return NanoGPT()


def _tokens(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(V, (n, 1), generator=gen) + torch.arange(T + 1)) % V  # counting sequences: learnable


class Stream(IterableDataset):
    """A stream of samples without a length, as a real stream; SizedStream has one."""

    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


class SizedStream(Stream):
    def __len__(self):
        return len(self.samples)


def lm_stream():
    """Dict samples in an IterableDataset with __len__; labels -100 on a padded tail of varying length."""
    tokens = _tokens(96, 0)[:, :T]
    samples = []
    for i, row in enumerate(tokens):
        keep = T - i % 4
        mask = (torch.arange(T) < keep).long()
        samples.append({"input_ids": row, "attention_mask": mask, "labels": row.masked_fill(mask == 0, -100)})
    return SizedStream(samples), None


def classify():
    """Map-style dict samples of different lengths and a collate_fn that pads them (a tokenizer's shape)."""
    gen = torch.Generator().manual_seed(1)
    samples = []
    for i in range(96):
        ids = torch.randint(1, V, (4 + i % 7,), generator=gen)
        samples.append({"input_ids": ids, "labels": torch.tensor(int(ids.sum()) % 3)})

    def collate(batch):
        width = max(len(s["input_ids"]) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for j, s in enumerate(batch):
            ids[j, : len(s["input_ids"])], mask[j, : len(s["input_ids"])] = s["input_ids"], 1
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.stack([s["labels"] for s in batch])}

    return samples, samples[:32], collate


def pair_stream():
    """(input, target) pairs in an IterableDataset without __len__: next-token prediction."""
    tokens = _tokens(96, 2)
    return Stream([(row[:-1], row[1:]) for row in tokens]), None


class Failing(IterableDataset):
    def __iter__(self):
        yield torch.zeros(64), torch.tensor(0)
        raise ConnectionError("stream closed by the server")


def failing_stream():
    return Failing(), None


def broken_data():
    raise FileNotFoundError("/data/shards/train-00000.parquet")


def raising():
    return nn.Sequential(nn.Linear(64, 10), nn.Unflatten(1, (3, 3)))  # 10 is not 3 x 3: forward fails


def crashing():
    """Builds in one process, fails in every rank of a distributed run (as a model that needs a GPU per rank)."""
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise RuntimeError("this model needs one GPU per rank")
    return nn.Sequential(nn.Linear(64, 10))


def lm():
    """lm_stream's samples as a map-style data set (a list): what ddp, which reads no streams, trains on."""
    return list(lm_stream()[0].samples), None


def lm_val():
    """lm's samples, 16 of them held out for validation."""
    samples = lm()[0]
    return samples[16:], samples[:16]


class Masked(nn.Module):
    """forward(x, mask): (input, mask, target) samples are passed as model(input, mask)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x, mask):
        return self.linear(x * mask)


def masked():
    return Masked()


def triples():
    """(input, mask, target) samples: the digits with a mask that keeps every pixel."""
    from core.zoo import quick_digits as digits

    train, val = digits()
    return [(x, torch.ones_like(x), y) for x, y in train], [(x, torch.ones_like(x), y) for x, y in val]


def regression():
    """Float targets the shape of the output: --loss auto takes mse."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 8, generator=gen)
    y = x @ torch.randn(8, 2, generator=gen)
    return list(zip(x[:200], y[:200])), list(zip(x[200:], y[200:]))


def regressor():
    return nn.Linear(8, 2)


def syncbn():
    return nn.Sequential(nn.Linear(64, 32), nn.SyncBatchNorm(32), nn.ReLU(), nn.Linear(32, 10))


def exits():
    """A factory that ends the process (a script's main() called by mistake) instead of returning."""
    raise SystemExit(0)


def frozen():
    """Every parameter frozen: nothing to train."""
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).requires_grad_(False)


def small():
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def nan_weights():
    """small() with its first layer's weights nan (a factory's broken initialisation)."""
    model = small()
    with torch.no_grad():
        model[0].weight.fill_(float("nan"))
    return model


class MaskedClasses(nn.Module):
    """small() with two more classes that a frozen -inf mask rules out: a fixed additive mask, not a fault."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 12))
        self.mask = nn.Parameter(torch.tensor([0.0] * 10 + [float("-inf")] * 2), requires_grad=False)

    def forward(self, x):
        return self.net(x) + self.mask


def masked_classes():
    return MaskedClasses()
