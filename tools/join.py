"""The package's runner joins the job before the recipe's main: the workers' store bound to loopback only, where
torch's TCPStore would listen on every interface (docs/security.md); the recipe's init_pg then finds the group."""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from core.kernel.job import RecipeError
from tools.options import env_number


def check_nodes_alike() -> None:
    """torchrun allows nodes with different NPROC_PER_NODE; then the data shares would depend on the node."""
    local, nodes, world = (env_number(k, 0) for k in ("LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "WORLD_SIZE"))
    if nodes and local * nodes != world:
        raise RecipeError(
            f"NPROC_PER_NODE differs between nodes: this node runs {local} of {world} processes on {nodes} nodes; "
            f"start every node with the same NPROC_PER_NODE"
        )


def loopback_store(*, timeout_s: float) -> dist.Store | None:
    """The workers' TCPStore bound to loopback, where torchrun lets them host it on 127.x; else None."""
    addr, port = os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", "0") or 0)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "False" or not port:
        return None
    try:
        if not ipaddress.ip_address(addr).is_loopback:
            return None
    except ValueError:
        return None  # a host name: multi-node, the store must be reachable from the other nodes
    rank, world_size = env_number("RANK", 0), env_number("WORLD_SIZE", 1)
    # rank 0 binds the socket itself, to loopback only, and the store owns it from there
    listening = socket.create_server((addr, port), backlog=max(world_size, 128)).detach() if rank == 0 else None
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout, master_listen_fd=listening)


def join(*, timeout_s: float) -> None:
    """Before main: the nodes alike, and under the single-node launcher the group joined on a loopback store."""
    check_nodes_alike()
    if "RANK" not in os.environ:
        return  # one process, no launcher: the recipe's own init_pg opens no port
    try:
        store = loopback_store(timeout_s=timeout_s)
    except (RuntimeError, OSError) as err:
        raise RecipeError(
            f"rank {os.environ['RANK']} could not host or reach the job's store on loopback ({err})"
        ) from None
    if store is not None:  # the recipe's init_pg then finds the group joined (and sets its device)
        backend, timeout = "nccl" if torch.cuda.is_available() else "gloo", timedelta(seconds=timeout_s)
        rank, world_size = env_number("RANK", 0), env_number("WORLD_SIZE", 1)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
