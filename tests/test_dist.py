"""The kernel's init_pg: joining a group from torchrun's environment, from mp.spawn, or alone."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from core.kernel.job import RecipeError
from core.kernel.train import cleanup_pg, init_pg
from helpers import free_port
from tools.options import env_number


def _as_torchrun(rank: int, world_size: int, port: int) -> None:
    """What torchrun sets, set by an mp.spawn'ed process itself before init_pg reads it."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _spawned(rank, world_size, port, results):
    _as_torchrun(rank, world_size, port)
    topo = init_pg(timeout_s=30)
    try:
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        dist.broadcast_object_list(choice := [f"rank {rank} decided" if topo.rank == 0 else None], src=0)
        dist.all_gather_object(everyone := [None] * world_size, rank * 10)
        results.put((rank, topo.world_size, topo.device.type, dist.get_backend(), total.item(), choice[0], everyone))
    finally:
        cleanup_pg()


def test_init_pg_from_mp_spawn_on_a_free_port():
    """The source's setup, fixed: a free port instead of 12355; rank and world size in torchrun's variables."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_spawned, args=(2, free_port(), results), nprocs=2, join=True, start_method="spawn")
    rows = sorted(results.get(timeout=10) for _ in range(2))
    assert rows == [
        (0, 2, "cpu", "gloo", 3.0, "rank 0 decided", [0, 10]),
        (1, 2, "cpu", "gloo", 3.0, "rank 0 decided", [0, 10]),
    ]


def test_world_of_one_without_a_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    topo = init_pg(timeout_s=10)
    try:
        assert (topo.rank, topo.world_size, topo.device.type) == (0, 1, "cpu")
        total = torch.tensor(2.0)
        dist.all_reduce(total)
        assert total.item() == 2.0
    finally:
        cleanup_pg()
    assert not dist.is_initialized()
    cleanup_pg()  # a second call is harmless


def test_device_comes_from_local_rank_never_rank(monkeypatch):
    """The source's set_device(rank) picks cuda:5 for rank 5 on a 4-GPU second node; LOCAL_RANK is right."""
    backends = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **k: backends.append(backend))
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    topo = init_pg(timeout_s=300)
    assert topo.device == torch.device("cuda", 1) and topo.rank == 5
    assert backends == ["nccl"]


def test_bad_environment_is_one_line(monkeypatch):
    """The package's runner reads torchrun's numbers before the recipe's init_pg does (tools/cli.py)."""
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(RecipeError, match="WORLD_SIZE='two' is not an integer"):
        env_number("WORLD_SIZE", 1)


def test_unreachable_master_fails_within_the_timeout(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody listens there
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match="could not reach MASTER_ADDR:MASTER_PORT 127.0.0.1"):
        init_pg(timeout_s=3)


def _leaving(rank, port, events, failing):
    """Rank 0 leaves first and records whether rank 1 had arrived at cleanup by the time it got out."""
    _as_torchrun(rank, 2, port)
    init_pg(timeout_s=60)
    if rank == 1:
        events["rank1_joined"].set()
        events["rank0_out"].wait(timeout=5 if failing else 0.5)  # failing: rank 0 must not wait for us
        events["rank1_in"].set()
        cleanup_pg()
        return
    events["rank1_joined"].wait(timeout=60)  # a group rank 0 left while rank 1 still connected: a failed join
    try:
        try:
            if failing:
                raise ValueError("this rank failed")
        finally:
            cleanup_pg()  # with an exception in flight: no barrier, leave at once
    except ValueError:
        pass
    events["order"].put(events["rank1_in"].is_set())
    events["rank0_out"].set()


@pytest.mark.world
@pytest.mark.parametrize("failing", [False, True])
def test_cleanup_waits_for_the_peers_only_after_a_good_run(failing):
    """After a good run the ranks meet before destroying the group (nothing of a peer's is still in flight when
    a rank exits: the tensor_parallel SIGABRT at exit); after an error nobody waits for peers that are elsewhere."""
    ctx = mp.get_context("spawn")
    events = {"rank1_joined": ctx.Event(), "rank1_in": ctx.Event(), "rank0_out": ctx.Event(), "order": ctx.Queue()}
    mp.start_processes(_leaving, args=(free_port(), events, failing), nprocs=2, join=True, start_method="spawn")
    rank1_was_in = events["order"].get(timeout=10)
    assert rank1_was_in is (not failing)
