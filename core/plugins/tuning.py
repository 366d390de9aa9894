"""Plug-in `tuning`: --channels-last and --activation-checkpointing before DDP wraps, --compile after."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_module

from core.kernel.builtin import build_model
from core.kernel.job import Options, RecipeError, option
from core.kernel.seams import SEAMS
from core.monitor import BEFORE_PG, WRAPPED


@dataclass(frozen=True)
class TuningOptions(Options):
    """computation"""

    compile: bool = option(False, "torch.compile the model (after DDP wraps it)")
    activation_checkpointing: bool = option(False, "recompute each block's activations in backward (less memory)")
    channels_last: bool = option(False, "channels-last memory format for conv models (GPU)")


def repeated_blocks(model: nn.Module) -> nn.Module | None:
    """The ModuleList / Sequential of one repeated class holding the most parameters (GPT-2's `h`), or None."""
    containers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList | nn.Sequential) and len(m)]
    repeated = [(n, m) for n, m in containers if max(Counter(type(c) for c in m).values()) >= 2]
    if not repeated:
        return None
    return max(repeated, key=lambda item: (sum(p.numel() for p in item[1].parameters()), -item[0].count(".")))[1]


def checkpoint_blocks(model: nn.Module) -> int:
    """Recompute each repeated block's activations in backward (hooks: the state-dict keys stay); returns how many."""
    found = repeated_blocks(model)
    if found is None:
        raise RecipeError(
            f"--activation-checkpointing: the model ({type(model).__name__}) has no repeated blocks "
            f"(an nn.ModuleList or nn.Sequential of one class) to checkpoint; leave the option off"
        )
    for block in found:
        checkpoint_module(block)
    return len(found)


def to_channels_last(model: nn.Module) -> nn.Module:
    """4-D conv weights (and so their outputs) in NHWC, the layout tensor cores read fastest."""
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        raise RecipeError(
            f"--channels-last: the model ({type(model).__name__}) has no Conv2d layer; "
            f"the option is for conv nets such as --model cnn"
        )
    return model.to(memory_format=torch.channels_last)


def tune_model(cfg, model: nn.Module) -> None:
    """The plain model, before DDP wraps it: channels-last, then each block checkpointed (in place)."""
    if getattr(cfg, "channels_last", False):
        to_channels_last(model)
    if getattr(cfg, "activation_checkpointing", False):
        checkpoint_blocks(model)


def check_tuning(cfg) -> None:
    """Before launch: the options on the model built on the meta device (its layers, without memory)."""
    if getattr(cfg, "channels_last", False) or getattr(cfg, "activation_checkpointing", False):
        with torch.device("meta"):
            tune_model(cfg, build_model(cfg))


def compiled(cfg, model: nn.Module) -> nn.Module:
    """--compile: torch.compile the wrapper the training step calls."""
    return torch.compile(model) if getattr(cfg, "compile", False) else model


SEAMS["option_groups"].append(TuningOptions)
BEFORE_PG.append(check_tuning)
SEAMS["after_build"].append(tune_model)
WRAPPED.append(compiled)
