"""The process group: where this process sits in the job."""

from __future__ import annotations

import contextlib
import os
import sys
from collections import namedtuple
from datetime import timedelta

import torch
import torch.distributed as dist

from core.kernel.options import RecipeError

Topology = namedtuple("Topology", "rank world_size device")  # rank 0 decides, writes and prints; device: cuda or cpu


def init_pg(*, timeout_s: float) -> Topology:
    """Join torchrun's process group (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); alone, a world of one."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # tools/ checks them
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")  # not RANK
    if cuda:
        torch.cuda.set_device(device)
    store = dist.HashStore() if "MASTER_PORT" not in os.environ and world_size == 1 else None  # no launcher: no port
    try:
        if not dist.is_initialized():  # the package's runner may have joined already
            backend, timeout = "nccl" if cuda else "gloo", timedelta(seconds=timeout_s)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except (RuntimeError, OSError, ValueError):  # DistNetworkError is a RuntimeError, TimeoutError an OSError
        at = f"MASTER_ADDR:MASTER_PORT {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise RecipeError(f"rank {rank} could not reach {at} within {timeout_s:g}s; is node 0 up?") from None
    return Topology(rank, world_size, device)


def cleanup_pg() -> None:
    """Leave the process group; after a run that ended well, a bounded barrier first: no rank exits mid-talk."""
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1 and sys.exc_info()[1] is None:
        with contextlib.suppress(Exception):  # a peer that died or hung: leave anyway, the run's outcome stands
            dist.barrier(async_op=True).wait(timeout=timedelta(seconds=60))
    dist.destroy_process_group()
