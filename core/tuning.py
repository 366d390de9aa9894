"""Computation options that change the plain model before DDP wraps it: channels-last, activation checkpointing.

torch's order, as ddp_monitored shows it: change the plain model (these), wrap it in DDP, register the comm
hook, then torch.compile the wrapper (TorchDynamo splits the graph at bucket boundaries, so the all-reduce
still overlaps backward). None of these changes the arithmetic beyond float rounding, and none changes
parameter names: checkpoints and model.safetensors load into the plain model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_module

from core.kernel.job import Options, RecipeError, option


@dataclass(frozen=True)
class TuningOptions(Options):
    title = "computation"
    compile: bool = option(False, "torch.compile the model (after DDP wraps it)")
    activation_checkpointing: bool = option(False, "recompute each block's activations in backward (less memory)")
    channels_last: bool = option(False, "channels-last memory format for conv models (GPU)")


def checkpoint_blocks(model: nn.Module, *, blocks: str | None = None) -> int:
    """Recompute each repeated block's activations in backward instead of keeping them; returns how many.

    The blocks are core.parallel.find_blocks' (`model.blocks` here, `transformer.h` in GPT-2, `model.layers`
    in Llama-style models, or the path `blocks` names). Memory for activations drops from all blocks' to one
    block's at a time, for one more forward per block in backward. The composable API adds hooks, not a
    wrapper, so state-dict keys stay the same.
    """
    from core.parallel import find_blocks, named_blocks  # here: core.parallel pulls in the distributed APIs

    found = named_blocks(model, blocks) if blocks else find_blocks(model)
    if found is None:
        raise RecipeError(
            f"--activation-checkpointing: the model ({type(model).__name__}) has no repeated blocks "
            f"(an nn.ModuleList or nn.Sequential of one class) to checkpoint; leave the option off"
        )
    for block in found[1]:
        checkpoint_module(block)
    return len(found[1])


def to_channels_last(model: nn.Module) -> nn.Module:
    """4-D conv weights (and so their outputs) in NHWC, the layout tensor cores read fastest."""
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        raise RecipeError(
            f"--channels-last: the model ({type(model).__name__}) has no Conv2d layer; "
            f"the option is for conv nets such as --model cnn"
        )
    return model.to(memory_format=torch.channels_last)
