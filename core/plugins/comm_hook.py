"""Plug-in `comm_hook`: how DDP moves gradients (--comm-hook fp16, bf16, powersgd; --bucket-mb; bucket views)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from core.kernel.job import Options, RecipeError, option
from core.kernel.seams import SEAMS
from core.monitor import BEFORE_PG, DDP_OPTIONS, WRAPPED

HOOKS = ("none", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class CommOptions(Options):
    """gradient communication"""

    comm_hook: str = option(
        "none", "gradient all-reduce: plain, compressed to fp16/bf16, or PowerSGD low-rank", choices=HOOKS
    )
    bucket_mb: float = option(
        25.0,
        "DDP gradient bucket size in MB (one all-reduce per bucket)",
        check=lambda v: 0 < v <= 1e5,
        fix="use a size in MB from above 0 to 100000 (25: DDP's)",
    )
    grad_as_bucket_view: bool = option(False, "gradients are views into DDP's buckets (saves a copy and memory)")


def check_hook(name: str, *, backend: str) -> None:
    """One RecipeError line for a hook that does not exist, or that `backend` cannot run."""
    if name not in HOOKS:
        raise RecipeError(f"--comm-hook {name}: choose one of {', '.join(HOOKS)}")
    if name == "bf16" and backend != "nccl":  # gloo's all-reduce has no bfloat16 kernels
        raise RecipeError(
            f"--comm-hook bf16 needs the nccl backend (this job uses {backend}); use --comm-hook fp16 or powersgd"
        )


def check_comm(cfg) -> None:
    """Before launch: the hook, on the backend init_pg picks (nccl where there is a GPU)."""
    if hasattr(cfg, "comm_hook"):
        check_hook(cfg.comm_hook, backend="nccl" if torch.cuda.is_available() else "gloo")


def bucket_options(cfg) -> dict:
    """DistributedDataParallel's bucket keyword arguments (.grad as a bucket view saves a copy)."""
    if not hasattr(cfg, "bucket_mb"):
        return {}
    return {"bucket_cap_mb": cfg.bucket_mb, "gradient_as_bucket_view": cfg.grad_as_bucket_view}


def register(cfg, ddp):
    """Install the --comm-hook on the DDP module, once, before its first backward (`none`: DDP's own reducer)."""
    name = getattr(cfg, "comm_hook", "none")
    check_hook(name, backend=dist.get_backend())
    if name == "powersgd":  # rank-2 approximations; the first 10 steps plain all-reduces, as PowerSGD's paper advises
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    compress = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
    if name in compress:
        ddp.register_comm_hook(None, compress[name])  # state None: the default process group
    return ddp


SEAMS["option_groups"].append(CommOptions)
BEFORE_PG.append(check_comm)
DDP_OPTIONS.append(bucket_options)
WRAPPED.append(register)
