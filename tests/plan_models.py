"""Tiny transformers models for the memory plan's checks (`--model plan_models:gpt2`): built from configs, no
download, vocabulary 128 and 64 positions so they read the built-in `text` data."""

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
