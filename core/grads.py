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


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The norm of all these gradients as one vector, a plain tensor, the same on every rank.

    DTensors (fully_shard, tensor parallel) and plain tensors may be mixed: tensor parallelism leaves the
    layers outside its plan plain and replicated, fsdp_tp puts them on the dp mesh and the TP layers on
    dp x tp, and torch's norm refuses such mixes. Each kind (each mesh)
    gets its own norm, a DTensor's reduced over its shards by full_tensor(); the parts combine as a vector
    of norms does: the square root of the sum of their squares."""
    parts = []
    for part in _by_mesh(grads, lambda g: g).values():
        norm = get_total_norm(part)
        parts.append(norm.full_tensor() if isinstance(norm, _dtensor()) else norm)
    if not parts:
        return torch.zeros(())
    return parts[0] if len(parts) == 1 else get_total_norm(parts)


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, *, group=None) -> torch.Tensor:
    """Clip the gradients' total norm to max_norm, for any layout; returns the total norm.

    Layouts: replicated (DDP), DTensor (fully_shard, TP), the two mixed (TP), and disjoint plain tensors split over
    `group` (pipeline stages). Scales the gradients by one factor on every rank when max_norm > 0 and the norm
    exceeds it."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = total_norm([p.grad for p in parameters])
    if group is not None and torch.distributed.get_world_size(group) > 1:  # disjoint shards: sqrt(sum of squares)
        norm = norm.pow(2.0)
        torch.distributed.all_reduce(norm, op=torch.distributed.ReduceOp.SUM, group=group)
        norm = norm.pow(1.0 / 2.0)
    if max_norm > 0:
        for kind in _by_mesh(parameters, lambda p: p.grad).values():  # fsdp_tp: the TP layers' mesh is 2-D
            clip_grads_with_norm_(kind, max_norm, norm)
    return norm
