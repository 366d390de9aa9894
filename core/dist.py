"""The process group, and the few collectives every recipe needs.

The only state here is torch's own process group. Everything else is passed in and returned.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from core.config import env_int
from core.kernel.job import RecipeError


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job. Built once by `init_pg`, then passed around."""

    rank: int  # rank 0 decides what only one process can (the run folder), writes and prints
    world_size: int
    device: torch.device  # cuda:LOCAL_RANK, or the CPU
    backend: str


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the source's fixed 12355 collides between jobs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def env_number(name: str, default: int) -> int:
    if (number := env_int(name, default)) is None:  # the one reader of RANK, WORLD_SIZE, LOCAL_RANK (also fail's)
        raise RecipeError(f"environment variable {name}={os.environ[name]!r} is not an integer of 0 or more; unset it")
    return number


def pick_device(local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is there (never cuda:RANK, which breaks on the second node), else the CPU."""
    if os.environ.get("TDR_DEVICE") == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count and os.environ.get("TDR_BACKEND") != "gloo":  # gloo ranks may share a GPU (gpu_check)
        fix = f"launch at most {count} processes per node (NPROC_PER_NODE) or fix CUDA_VISIBLE_DEVICES"
        raise RecipeError(f"LOCAL_RANK {local_rank} but only {count} GPU(s) are visible: {fix}")
    return torch.device("cuda", local_rank % count)


def init_pg(*, timeout_s: float = 300.0, store: dist.Store | None = None) -> Topology:
    """Join the job's process group and return this process's Topology.

    Everything comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); from
    `mp.spawn`, set those in each process first. With none, a world of one that opens no port. `store`: a store made
    by the caller (the package's runner binds one to loopback, tools/join.py; the recipe's own call then finds the
    group joined).
    """
    rank, world_size, local_rank = env_number("RANK", 0), env_number("WORLD_SIZE", 1), env_number("LOCAL_RANK", 0)
    device = pick_device(local_rank)
    backend = os.environ.get("TDR_BACKEND") or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if store is None and "MASTER_PORT" not in os.environ and world_size == 1:  # no launcher: no port opened
        store = dist.HashStore()
    try:
        if not dist.is_initialized():  # store None: env:// (MASTER_ADDR, MASTER_PORT)
            timeout = timedelta(seconds=timeout_s)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except (RuntimeError, TimeoutError, OSError, ValueError) as err:  # Dist*Error are RuntimeErrors
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        where = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT')}"
        why = f"within {timeout_s:g}s ({first}); check MASTER_ADDR/MASTER_PORT and that node 0 is up"
        raise RecipeError(f"rank {rank} could not join the job at {where} {why}") from None
    return Topology(rank, world_size, device, backend)


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
