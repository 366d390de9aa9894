"""fully_shard's pieces the fsdp recipes call: the blocks to shard one by one, the precision policy, the held sync."""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

BLOCKS: list = []  # fn(cfg, model) -> (name, container) or None: the blocks fully_shard wraps one by one (--blocks)


def find_blocks(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The ModuleList or Sequential of one repeated class holding the most parameters (GPT-2's transformer.h)."""
    containers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList | nn.Sequential) and len(m)]
    repeated = [(n, m) for n, m in containers if max(Counter(type(c) for c in m).values()) >= 2]
    return max(repeated, key=lambda nm: (sum(p.numel() for p in nm[1].parameters()), -nm[0].count(".")), default=None)


def shard_blocks(cfg, model: nn.Module) -> list[nn.Module]:
    """The blocks to fully_shard before the root, so a rank holds 1/N of the model plus the block that runs."""
    found = next(filter(None, (pick(cfg, model) for pick in BLOCKS)), None) or find_blocks(model)  # --blocks NAME
    if found is None:
        why = f"fsdp: {type(model).__name__} has no repeated blocks (a ModuleList of one class): sharded as one unit,"
        fix = "name them with --blocks (a standalone copy: made `--with blocks`)"
        warnings.warn(f"{why} gathered whole for each forward; {fix}", stacklevel=2)
    return list(found[1]) if found else []


def fsdp_policy(precision: str) -> dict:
    """fully_shard's mixed precision: bf16 computes in bf16 and reduces the gradients in fp32; fp32 is left as it is."""
    dtype = torch.bfloat16 if precision == "bf16" else None
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)}


def fsdp_sync(model: nn.Module, *, enabled: bool) -> contextlib.nullcontext:
    """step_amp's `sync`: enabled=False holds the reduce-scatter back while micro-batches add their gradients."""
    model.set_requires_gradient_sync(enabled)  # the step's last micro-batch turns it back on
    return contextlib.nullcontext()  # set already: the `with` around the micro-batch has nothing to undo
