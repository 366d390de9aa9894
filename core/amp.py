"""Mixed precision for ddp_amp: the --precision option, and DDP's no_sync() while micro-batches accumulate."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from core.kernel.job import Options, option


@dataclass(frozen=True)
class Precision(Options):
    """mixed precision"""

    precision: str = option(
        "fp32",
        "compute precision (autocast; fp16 adds dynamic loss scaling)",
        choices=("fp32", "bf16", "fp16"),
        check=lambda precision: precision != "fp16" or torch.cuda.is_available(),
        fix="fp16 needs a CUDA GPU; on CPU use --precision bf16",
    )


def grad_sync(model: nn.Module, *, enabled: bool):
    """step_amp's `sync` for DDP: no_sync() holds the all-reduce back (and .grad adds up) until `enabled`."""
    return contextlib.nullcontext() if enabled or not hasattr(model, "no_sync") else model.no_sync()
