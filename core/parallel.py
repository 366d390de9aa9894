"""Wrappers that make a plain model parallel. Each is one small function; recipes apply them in order."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def wrap_ddp(model: nn.Module, *, device: torch.device, **ddp_options) -> DDP:
    """DistributedDataParallel: params broadcast from rank 0 now, gradients averaged in backward()."""
    device_ids = [device.index] if device.type == "cuda" else None  # CPU modules take none
    return DDP(model, device_ids=device_ids, **ddp_options)


def wrap_dp(model: nn.Module) -> tuple[nn.Module, str]:
    """nn.DataParallel over all visible GPUs, in one process; with fewer than two, the model as it is.

    Returns the model and one line saying which it did.
    """
    gpus = torch.cuda.device_count()
    if gpus < 2:
        where = "one GPU" if gpus == 1 else "CPU"
        return model, f"DataParallel needs 2+ GPUs; found {gpus}: training on {where} as plain single-device training"
    return nn.DataParallel(model), f"DataParallel over {gpus} GPUs (replicas re-made every step: prefer ddp)"
