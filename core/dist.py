"""The collectives the older modules (core/ckpt.py, stream.py) still call; the
process group is the kernel's init_pg (core/kernel/train.py). Goes with the last of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job (the kernel's Topology, and its backend)."""

    rank: int  # rank 0 decides what only one process can (the run folder), writes and prints
    world_size: int
    device: torch.device  # cuda:LOCAL_RANK, or the CPU
    backend: str


def reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of `tensor` over all ranks, as a new tensor (the input is left alone)."""
    total = tensor.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total


def broadcast_object(obj):
    """Rank 0's Python object on every rank (for decisions only rank 0 can make)."""
    box = [obj]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone
