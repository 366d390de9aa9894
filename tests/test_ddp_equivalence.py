"""Layer 2: DDP on 2 gloo ranks, each on half a global batch, equals one process on all of it."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from core.kernel.loss import Loss
from core.kernel.step import step_plain
from core.plugins.replicas import replicas_report
from world import GlooWorld


@pytest.fixture(scope="module")
def world2():
    with GlooWorld(2) as world:
        yield world


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(seed: int, steps: int, global_batch: int):
    gen = torch.Generator().manual_seed(seed + 1)
    return [
        (torch.randn(global_batch, 8, generator=gen), torch.randint(3, (global_batch,), generator=gen))
        for _ in range(steps)
    ]


def _train(model, batches, *, lr=0.05):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_fn = Loss()
    for batch in batches:
        step_plain(model, batch, optimizer=optimizer, loss_fn=loss_fn)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_ddp_share(topo, seed, steps, global_batch):
    """This rank's contiguous share of every global batch, through DDP."""
    share = global_batch // topo.world_size
    mine = [
        (x[topo.rank * share : (topo.rank + 1) * share], y[topo.rank * share : (topo.rank + 1) * share])
        for x, y in _batches(seed, steps, global_batch)
    ]
    return _train(DistributedDataParallel(_model(seed)), mine)


@pytest.mark.parametrize("steps", [1, 5])
def test_ddp_equals_single_process(world2, steps):
    seed, global_batch = 3, 16
    reference = _train(_model(seed), _batches(seed, steps, global_batch))
    per_rank = world2.run(train_ddp_share, seed, steps, global_batch)
    for rank_state in per_rank:
        for key, value in reference.items():
            # DDP keys carry a `module.` prefix; the arithmetic differs only in summation order.
            torch.testing.assert_close(rank_state["module." + key], value, rtol=1e-5, atol=1e-6)


def test_replicas_stay_identical(world2):
    first, second = world2.run(train_ddp_share, 7, 3, 8)
    for key in first:
        assert torch.equal(first[key], second[key]), key  # bitwise: every rank applies the same averaged gradient


def compare_across_ranks(topo):
    model = _model(0)
    model.register_buffer("seen", torch.zeros(2))  # a buffer forward would update from each rank's own batch
    if topo.rank == 1:
        with torch.no_grad():  # one bit of one weight, and the buffer, differ on rank 1
            flat = model[0].weight.view(-1).view(torch.int32)
            flat[0] ^= 1
            model.seen += 1
    return replicas_report(_model(0).state_dict()), replicas_report(model.state_dict())


def test_replica_check_sees_a_single_flipped_bit_and_names_every_tensor_that_differs(world2):
    """Every tensor is compared, not only BatchNorm's; the summary names those that differ (issue 20 item 6)."""
    for same, differ in world2.run(compare_across_ranks):
        assert same == {"replicas_identical": True}
        assert not differ["replicas_identical"] and differ["replicas_differ"].startswith("seen, 0.weight:")
