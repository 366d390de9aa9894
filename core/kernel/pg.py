"""The process group: where this process sits in the job, and the collectives of Python objects a recipe needs."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from core.kernel.log import env_int
from core.kernel.options import RecipeError


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job."""

    rank: int  # rank 0 decides what only one process can (the run folder), writes and prints
    world_size: int
    device: torch.device  # cuda:LOCAL_RANK, or the CPU


def init_pg(*, timeout_s: float) -> Topology:
    """Join torchrun's process group (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); without torchrun, a
    world of one that opens no port."""
    found = {name: env_int(name, default) for name, default in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0))}
    for name, value in found.items():
        if value is None:
            raise RecipeError(
                f"environment variable {name}={os.environ[name]!r} is not an integer of 0 or more; unset it"
            )
    rank, world_size, local_rank = found.values()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")  # cuda:LOCAL_RANK, never cuda:RANK
    if cuda:
        torch.cuda.set_device(device)
    store = dist.HashStore() if "MASTER_PORT" not in os.environ and world_size == 1 else None  # no launcher: no port
    try:
        if not dist.is_initialized():  # store None: env:// (MASTER_ADDR, MASTER_PORT)
            backend, timeout = "nccl" if cuda else "gloo", timedelta(seconds=timeout_s)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except (RuntimeError, TimeoutError, OSError, ValueError) as err:  # Dist*Error are RuntimeErrors
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        where = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT')}"
        why = f"within {timeout_s:g}s ({first}); check MASTER_ADDR/MASTER_PORT and that node 0 is up"
        raise RecipeError(f"rank {rank} could not join the job at {where} {why}") from None
    return Topology(rank, world_size, device)


def cleanup_pg(*, timeout_s: float = 60.0) -> None:
    """Leave the process group (safe to call twice); after a run that ended well, first a bounded barrier, so that
    no rank exits while a peer still talks to it."""
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1 and sys.exc_info()[1] is None:
        with contextlib.suppress(Exception):  # a peer that died or hung: leave anyway, the run's own outcome stands
            dist.barrier(async_op=True).wait(timeout=timedelta(seconds=timeout_s))
    dist.destroy_process_group()


def broadcast_object(obj):
    """Rank 0's Python object on every rank (for decisions only rank 0 can make)."""
    box = [obj]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    everyone = [obj] * dist.get_world_size()
    if dist.get_world_size() > 1:
        dist.all_gather_object(everyone, obj)
    return everyone
