"""Plug-in `balance`: --balance time, pipeline stages of equal measured time instead of equal parameter count."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from core.kernel.job import Options, option
from core.kernel.seams import SEAMS
from core.pipeline import STAGE_WEIGHTS


@dataclass(frozen=True)
class Balance(Options):
    """pipeline parallelism"""

    balance: str = option(
        "params", "balance the stages by parameter count or measured time", choices=("params", "time")
    )


def block_times(model: nn.Module, sample: torch.Tensor) -> list[float]:
    """Seconds for each block's forward + backward on `sample`, fed through the blocks before it."""
    times, x = [], sample
    for block in model.blocks:
        x_in = x.detach().requires_grad_(x.is_floating_point())
        fastest = float("inf")
        for _ in range(3):  # the fastest of three: the least disturbed by other work
            started = time.perf_counter()
            out = block(x_in)
            out.float().sum().backward()
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            fastest = min(fastest, time.perf_counter() - started)
        block.zero_grad(set_to_none=True)
        times.append(fastest)
        x = out.detach()
    return times


def timed_weights(cfg, model: nn.Module, train_set) -> list[float] | None:
    """--balance time: the blocks' times on one micro-batch, rank 0's on every rank (all cut alike); else None."""
    if getattr(cfg, "balance", "params") != "time":  # a recipe without the option: its own cut
        return None
    sample = torch.stack([train_set[i][0] for i in range(cfg.batch_size // cfg.microbatches)])
    dist.broadcast_object_list(box := [block_times(model, sample)], src=0)  # rank 0's times, on every rank
    return box[0]


SEAMS["option_groups"].append(Balance)
STAGE_WEIGHTS.append(timed_weights)
