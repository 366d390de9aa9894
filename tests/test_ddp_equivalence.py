"""Layer 2: DDP on 2 gloo ranks, each on half a global batch, equals one process on all of it."""

import pytest
import torch
from torch import nn

from core.dist import same_on_all_ranks
from core.models import fingerprint
from core.parallel import wrap_ddp
from core.steps import step_plain
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
    for batch in batches:
        step_plain(model, batch, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_ddp_share(topo, seed, steps, global_batch):
    """This rank's contiguous share of every global batch, through DDP."""
    share = global_batch // topo.world_size
    mine = [
        (x[topo.rank * share : (topo.rank + 1) * share], y[topo.rank * share : (topo.rank + 1) * share])
        for x, y in _batches(seed, steps, global_batch)
    ]
    return _train(wrap_ddp(_model(seed), device=topo.device), mine)


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
    if topo.rank == 1:
        with torch.no_grad():  # one bit of one weight differs on rank 1
            flat = model[0].weight.view(-1).view(torch.int32)
            flat[0] ^= 1
    untouched, flipped = fingerprint(_model(0)), fingerprint(model)
    return same_on_all_ranks(untouched), same_on_all_ranks(flipped), same_on_all_ranks(topo.rank)


def test_replica_check_sees_a_single_flipped_bit(world2):
    assert world2.run(compare_across_ranks) == [(True, False, False)] * 2
