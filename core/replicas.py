"""What keeps data-parallel replicas equal, and the check that they are: BatchNorm, and every tensor compared."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from core.config import RecipeError
from core.dist import Topology, all_gather_object


def prepare_batchnorm(model: nn.Module, *, sync: bool, topo: Topology) -> nn.Module:
    """Before DDP wraps the model: BatchNorm layers become SyncBatchNorm when `sync` (statistics over the global
    batch; torch runs it on GPUs only, so CPU is one RecipeError line); without it, rank 0 says which layers keep
    per-rank statistics."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    synced = [n for n in names if isinstance(model.get_submodule(n), nn.SyncBatchNorm)]
    if (sync or synced) and topo.device.type != "cuda":  # DDP on CPU: "SyncBatchNorm layers only work with GPU modules"
        what = "--sync-batchnorm" if sync else f"the model's SyncBatchNorm layers ({', '.join(synced[:3])})"
        raise RecipeError(f"{what}: torch's SyncBatchNorm runs on GPUs only, and this job is on CPU; use BatchNorm")
    if sync:
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if names and topo.is_rank0:
        print(
            f"warning: BatchNorm layers {', '.join(names[:3])} normalise with each rank's own batch and keep per-rank "
            f"running statistics, so the replicas' buffers end up different; --sync-batchnorm (GPUs) shares them",
            flush=True,
        )
    return model


def replicas_report(tensors: dict[str, torch.Tensor]) -> dict:
    """{"replicas_identical": bool}, and when they differ "replicas_differ": which tensors (a collective: every rank
    calls it). Pass model.state_dict() for DDP, the buffers for fully_shard (its parameters are shards)."""
    mine = {k: _digest(t) for k, t in tensors.items()}
    everyone = all_gather_object(mine)
    differ = [k for k in mine if any(other.get(k) != mine[k] for other in everyone)]
    if not differ:
        return {"replicas_identical": True}
    shown = ", ".join(differ[:3]) + (f" (+{len(differ) - 3} more)" if len(differ) > 3 else "")
    why = "BatchNorm statistics are per rank" if any("running_" in k for k in differ) else "set from each rank's data"
    return {"replicas_identical": False, "replicas_differ": f"{shown}: {why}"}


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
