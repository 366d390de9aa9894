"""A transformers GPT-2 on the embedded text, for the README's fine-tuning example (no download).

    PYTHONPATH=docs/examples ./launch_single_node.sh ddp_amp --model tiny_gpt2:model --data tiny_gpt2:data

With a pretrained model, build it from its config in `model()` (AutoConfig.from_pretrained(folder), then
AutoModelForCausalLM.from_config(config)) and pass the folder to --init-from: the run loads its weights.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from core.gpt import text


def model() -> GPT2LMHeadModel:
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


class Windows(torch.utils.data.Dataset):
    """The text windows as transformers wants them: labels are the inputs (the model shifts them itself)."""

    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        tokens = self.pairs[i][0]
        return {"input_ids": tokens, "labels": tokens}


def data():
    train, val = text(context=64)
    return Windows(train), Windows(val)
