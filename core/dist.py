"""Process-group set-up and the few collectives every recipe needs.

The only state here is torch's own process group. Everything else is passed in and returned.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import signal
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from core.config import RecipeError


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job. Built once by `init_pg`, then passed around."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the source's fixed 12355 collides between jobs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise RecipeError(f"environment variable {name}={value!r} is not an integer") from None


def pick_device(local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is there (never cuda:RANK, which breaks on the second node)."""
    if os.environ.get("TDR_DEVICE") == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if os.environ.get("TDR_SHARE_GPU"):  # several gloo processes on one GPU (bench/gpu_check.sh)
        return torch.device("cuda", local_rank % count)
    if local_rank >= count:
        raise RecipeError(
            f"LOCAL_RANK {local_rank} but only {count} GPU(s) are visible: "
            f"launch at most {count} processes per node (NPROC_PER_NODE) or fix CUDA_VISIBLE_DEVICES"
        )
    return torch.device("cuda", local_rank)


def die_with_launcher(*, signum: int = signal.SIGTERM) -> bool:
    """Under torchrun, have the kernel send `signum` to this worker when its agent dies, even by SIGKILL.

    torchrun starts each worker in a session of its own, so a killed agent's workers would be re-parented
    and train on. The signal fires when the parent *thread* that spawned us exits: torch 2.13's agent
    spawns workers (subprocess.Popen) from its main thread, so that is the agent's own death. True when armed.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False  # no launcher to outlive (mp.spawn, a plain `python -m recipes run`, nohup)
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, int(signum), 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        return False
    if parent == 1 or os.getppid() != parent:  # the agent died before prctl: no signal would ever come
        os.kill(os.getpid(), signum)
    return True


def _loopback_store(addr: str, port: int, *, rank: int, world_size: int, timeout: timedelta) -> dist.Store | None:
    """The workers' TCPStore bound to loopback only, where torchrun lets the workers host it on 127.x.

    TCPStore itself listens on every interface, with no authentication; a socket we bind ourselves and hand
    over (master_listen_fd) keeps a single-node job's store off the network. None: use torch's env:// store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "False":
        return None  # the agent hosts the store (torchrun's default, or static rendezvous): not ours to bind
    try:
        if not ipaddress.ip_address(addr).is_loopback:
            return None
    except ValueError:
        return None  # a host name: multi-node, the store must be reachable from the other nodes
    sock = None
    if rank == 0:
        sock = socket.create_server((addr, port), backlog=max(world_size, 128))
    return dist.TCPStore(
        addr,
        port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        master_listen_fd=None if sock is None else sock.detach(),  # the store owns the socket from here
    )


def init_pg(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> Topology:
    """Join the job's process group and return this process's Topology.

    Under torchrun everything comes from its environment (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT). From `mp.spawn`, pass rank, world_size and a free master_port.
    With neither, this is a world of one and no network is touched.
    """
    rank = _env_int("RANK", 0) if rank is None else rank
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    local_rank = _env_int("LOCAL_RANK", rank if "RANK" not in os.environ else 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    node_rank = _env_int("GROUP_RANK", 0)
    nodes = _env_int("GROUP_WORLD_SIZE", 1)  # set by torchrun: the number of nodes
    if "GROUP_WORLD_SIZE" in os.environ and local_world_size * nodes != world_size:  # torchrun allows it
        raise RecipeError(  # but then the global batch and the data shares would depend on the node
            f"NPROC_PER_NODE differs between nodes: this node runs {local_world_size} of {world_size} "
            f"processes on {nodes} nodes; start every node with the same NPROC_PER_NODE"
        )
    device = pick_device(local_rank)
    backend = backend or os.environ.get("TDR_BACKEND") or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = tmo = timedelta(seconds=timeout_s)

    if "MASTER_ADDR" not in os.environ and master_port is None and world_size == 1:
        # One process and no launcher: an in-memory store, so no port is ever opened.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = master_port or _env_int("MASTER_PORT", 0)
        if not port:
            raise RecipeError("MASTER_PORT is not set: launch with torchrun or pass master_port")
        try:
            # mp.spawn passes master_port and keeps tcp://; under torchrun, rank 0 may bind the store to loopback
            store = None if master_port else _loopback_store(addr, port, rank=rank, world_size=world_size, timeout=tmo)
            dist.init_process_group(
                backend,
                init_method=None if store else f"tcp://{addr}:{port}" if master_port else "env://",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
        except (RuntimeError, TimeoutError, OSError) as err:  # Dist*Error are RuntimeErrors; OSError: port taken
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise RecipeError(
                f"rank {rank} could not join the job at {addr}:{port} within {timeout_s:g}s "
                f"({first_line}); check MASTER_ADDR/MASTER_PORT and that node 0 is up"
            ) from err
    return Topology(rank, local_rank, world_size, local_world_size, node_rank, device, backend)


def cleanup_pg(*, timeout_s: float = 60.0) -> None:
    """Leave the process group; safe to call twice or when it was never joined.

    After a run that ended well, the ranks first meet at a barrier bounded by `timeout_s`: a rank that
    destroys its group, and exits, while a peer still talks to it (rank 0 may host the store) can leave
    that peer's C++ threads mid-operation at exit (std::terminate: "terminate called without an active
    exception"). With an exception in flight there is no barrier: the peers are elsewhere, and the
    error must not wait for them.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() > 1 and sys.exc_info()[1] is None:
        try:
            dist.barrier(async_op=True).wait(timeout=timedelta(seconds=timeout_s))
        except Exception:  # noqa: BLE001 - a peer that died or hung: leave anyway, the run's own outcome stands
            pass
    dist.destroy_process_group()


def is_rank0() -> bool:
    """True on the one process that prints and writes files (also when no group exists)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of `tensor` over all ranks, returned as a new tensor (the input is left alone)."""
    total = tensor.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean of `tensor` over all ranks (gloo has no ReduceOp.AVG, so sum and divide)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return reduce_sum(tensor.float() if not tensor.is_floating_point() else tensor) / world


def barrier() -> None:
    """Wait for every rank; a no-op in a world of one."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj, *, src: int = 0):
    """Rank `src`'s Python object on every rank (for decisions only rank 0 can make)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def same_on_all_ranks(value) -> bool:
    """True when every rank passes an equal `value` (one all-gather; a world of one: True)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return all(v == everyone[0] for v in everyone)
