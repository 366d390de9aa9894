"""The gradients' norm and clipping for every layout a recipe has: replicated (DDP), sharded DTensors
(fully_shard, tensor parallel), the two mixed, and disjoint plain tensors split over a group (pipeline stages)."""

from __future__ import annotations

import sys

import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm


def _dtensor() -> type | tuple:
    """DTensor's class once torch.distributed.tensor is loaded, else no class.

    Whoever made a DTensor loaded it: a ddp job never imports the DTensor machinery (a second of start-up)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module.DTensor if module is not None else ()


def _by_mesh(items: list, tensor_of) -> dict:
    """Items grouped by their tensor's DeviceMesh (None: plain tensors): torch's foreach kernels take one kind."""
    kinds: dict = {}
    for item in items:
        g = tensor_of(item)
        kinds.setdefault(g.device_mesh if isinstance(g, _dtensor()) else None, []).append(item)
    return kinds


def total_norm(grads: list[torch.Tensor], *, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all these gradients as one vector, a plain tensor, the same on every rank.

    DTensors (fully_shard, tensor parallel) and plain tensors may be mixed: tensor parallelism leaves the
    layers outside its plan plain and replicated, fsdp_tp puts them on the dp mesh and the TP layers on
    dp x tp, and torch's norm refuses such mixes. Each kind (each mesh)
    gets its own norm, a DTensor's reduced over its shards by full_tensor(); the parts combine as a vector
    of norms does: (sum of n^p)^(1/p), or the max for inf."""
    parts = []
    for part in _by_mesh(grads, lambda g: g).values():
        norm = get_total_norm(part, norm_type=norm_type)
        parts.append(norm.full_tensor() if isinstance(norm, _dtensor()) else norm)
    if not parts:
        return torch.zeros(())
    return parts[0] if len(parts) == 1 else get_total_norm(parts, norm_type=norm_type)


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, *, norm_type: float = 2.0, group=None) -> torch.Tensor:
    """Clip the gradients' total norm to max_norm, for any layout; returns the total norm.

    Layouts: replicated (DDP), DTensor (fully_shard, TP), the two mixed (TP), and disjoint plain tensors split over
    `group` (pipeline stages). Scales the gradients by one factor on every rank when max_norm > 0 and the norm
    exceeds it."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = total_norm([p.grad for p in parameters], norm_type=norm_type)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        if norm_type == float("inf"):
            torch.distributed.all_reduce(norm, op=torch.distributed.ReduceOp.MAX, group=group)
        else:  # p-norms combine as (sum of |g|^p)^(1/p)
            norm = norm.pow(norm_type)
            torch.distributed.all_reduce(norm, op=torch.distributed.ReduceOp.SUM, group=group)
            norm = norm.pow(1.0 / norm_type)
    if max_norm > 0:
        for kind in _by_mesh(parameters, lambda p: p.grad).values():  # fsdp_tp: the TP layers' mesh is 2-D
            clip_grads_with_norm_(kind, max_norm, norm)
    return norm
