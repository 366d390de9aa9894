"""Tiny transformers models for the memory plan's checks (`--model plan_models:gpt2`): built from configs, no
download, vocabulary 128 and 64 positions so they read the built-in `text` data."""

import torch
from torch import nn


def gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


def llama_8b() -> nn.Module:
    """Llama-3-8B's shape (8.0 billion parameters), from its config: for plans, never trained here."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    return transformers.LlamaForCausalLM(config)


def tokens_4k():
    """Sixteen windows of 4096 random tokens below Llama-3's vocabulary, as (input, target) pairs: shapes for a plan."""
    from torch.utils.data import TensorDataset

    tokens = torch.randint(0, 128256, (16, 4097), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:]), None


class Numpy(torch.autograd.Function):
    """A custom autograd function computing in NumPy: no kernel a fake tensor can run."""

    @staticmethod
    def forward(ctx, x):
        return torch.from_numpy(x.detach().numpy() * 2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class Gate(nn.Module):
    """A step a plan cannot follow without running it."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x):
        if self.how == "value":  # a Python branch on a value: data-dependent control flow
            return x * 2 if x.mean() > 0 else x
        if self.how == "shape":  # boolean indexing: a data-dependent shape
            return x[x.sum(-1) > 0].sum() + x
        return Numpy.apply(x)


class Picky(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.embed, self.gate, self.out = nn.Embedding(128, 16), Gate(how), nn.Linear(16, 128)

    def forward(self, tokens):
        return self.out(self.gate(self.embed(tokens)))


def reads_value() -> nn.Module:
    return Picky("value")


def data_shape() -> nn.Module:
    return Picky("shape")


def numpy_function() -> nn.Module:
    return Picky("numpy")


def broken() -> nn.Module:
    raise ValueError("no weights at /nowhere")


# The plan's checks: each recipe with the models it takes, on one rank and on two (tests/test_plan.py and
# bench/bench_plan.py measure each against torch's MemTracker on real steps).
GPT = ["--model", "gpt", "--data", "text", "--batch-size", "2"]
GPT2 = ["--model", "plan_models:gpt2", "--data", "text", "--batch-size", "2"]
LLAMA = ["--model", "plan_models:llama", "--data", "text", "--batch-size", "2"]
ANY_WORLD = [
    ("ddp", GPT),
    ("ddp", GPT2),
    ("ddp", LLAMA),
    ("ddp_amp", [*GPT, "--precision", "bf16", "--accum", "2"]),
    ("ddp_amp", GPT2),
    ("ddp_amp", [*LLAMA, "--precision", "bf16"]),
    ("ddp_monitored", [*GPT, "--activation-checkpointing"]),
    ("ddp_monitored", GPT2),
    ("ddp_monitored", [*LLAMA, "--activation-checkpointing"]),
    ("fsdp", [*GPT, "--precision", "bf16"]),
    ("fsdp", [*GPT2, "--accum", "2"]),
    ("fsdp", LLAMA),
    ("tensor_parallel", GPT),
    ("tensor_parallel", [*LLAMA, "--precision", "bf16"]),
]
MATRIX = {
    1: [
        *ANY_WORLD,
        ("dp", GPT),
        ("dp", GPT2),
        ("dp", LLAMA),
        ("pipeline_naive", GPT),
        ("ddp_monitored", ["--model", "cnn", "--data", "digits", "--batch-size", "2", "--channels-last"]),
        ("fsdp_tp", [*GPT, "--tp", "1"]),
        ("fsdp_tp", [*LLAMA, "--tp", "1"]),
        ("pipeline", [*GPT, "--microbatches", "2"]),
    ],
    2: [
        *ANY_WORLD,
        ("ddp_monitored", [*GPT, "--grad-as-bucket-view"]),
        ("tensor_parallel", [*GPT, "--sequence-parallel"]),
        ("fsdp_tp", GPT),
        ("fsdp_tp", [*LLAMA, "--accum", "2"]),
        ("pipeline", [*GPT, "--microbatches", "2"]),
        ("pipeline", [*GPT, "--microbatches", "2", "--schedule", "gpipe"]),
        ("pipeline", [*GPT, "--batch-size", "4", "--schedule", "interleaved1f1b", "--precision", "bf16"]),
    ],
}
