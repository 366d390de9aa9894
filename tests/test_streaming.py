"""Streams, dict batches and the data position: sharded by rank and worker, ranks that stop together,
and a resume that continues the global order exactly, at the same or another world size."""

import itertools
import math
from collections import namedtuple

import pytest
import torch
import torch.distributed as torch_dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from core.exact_loss import make_exact_loss
from core.kernel.loss import Loss
from core.kernel.train import Topology, make_loader, to_device
from core.mesh import evaluate_sharded
from core.plugins.stream import StreamShard, stream_loader
from world import GlooWorld


def batches_per_epoch(loader) -> int:
    return len(loader)


class Stream(IterableDataset):
    """Samples {"input_ids": [g, g], "labels": g} for g in range(n): a stream without a length."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return ({"input_ids": torch.tensor([g, g]), "labels": torch.tensor(g)} for g in range(self.n))


class SizedStream(Stream):
    def __len__(self) -> int:
        return self.n


def topology(rank: int, world_size: int) -> Topology:
    return Topology(rank, world_size, torch.device("cpu"))


# Layer 1: the data position, pure.


def map_steps(n: int, world_size: int, batch: int, *, consumed: int = 0, seed: int = 0) -> list[set[int]]:
    """The set of sample indices each global step trains, at `world_size` ranks of `batch`, after `consumed`."""
    dataset = TensorDataset(torch.arange(n))
    per_rank = []
    for rank in range(world_size):
        loader = make_loader(dataset, topology(rank, world_size), batch_size=batch, collate_fn=None, seed=seed)
        loader.sampler.set_epoch(3, consumed=consumed)
        per_rank.append([set(x.tolist()) for (x,) in loader])
    assert len({len(batches) for batches in per_rank}) == 1, "every rank takes the same number of steps"
    return [set().union(*step) for step in zip(*per_rank)]


def stream_steps(n: int, world_size: int, batch: int, *, consumed: int = 0) -> list[set[int]]:
    """The same for a stream: every rank stops when the first one runs dry (what the all-reduced flag does)."""
    per_rank = []
    for rank in range(world_size):
        shard = StreamShard(range(n), rank=rank, world_size=world_size, batch_size=batch, drop_last=True)
        shard.set_epoch(0, consumed=consumed)  # as the recipes hand it: the global position
        per_rank.append([set(b) for b in shard])
    return [set().union(*step) for step in zip(*per_rank)]


@pytest.mark.fast
@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 300),
    ws=st.sampled_from([(1, 2), (2, 4), (4, 2), (2, 1), (2, 3), (3, 4), (1, 1)]),
    unit=st.integers(1, 4),
    stopped=st.integers(0, 30),
    seed=st.integers(0, 2**16),
)
def test_a_resume_at_another_world_size_trains_the_same_samples_each_step(n, ws, unit, stopped, seed):
    world, world2 = ws
    global_batch = math.lcm(world, world2) * unit
    full = map_steps(n, world, global_batch // world, seed=seed)
    stopped = min(stopped, len(full))
    resumed = map_steps(n, world2, global_batch // world2, consumed=stopped * global_batch, seed=seed)
    # Step j trains the global positions [j*GB, (j+1)*GB) at any world size; only the tail that does not divide by
    # the world size differs (DistributedSampler's drop_last), so compare the steps that are whole in both runs.
    whole = min(n // world * world, n // world2 * world2) // global_batch
    assert resumed[: max(whole - stopped, 0)] == full[stopped:whole]
    assert all(len(step) == global_batch for step in full[:whole])
    assert batches_per_epoch(
        make_loader(
            TensorDataset(torch.arange(n)), topology(0, world), batch_size=global_batch // world, collate_fn=None
        )
    ) == len(full)


@pytest.mark.fast
@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 300),
    ws=st.sampled_from([(1, 2), (2, 4), (4, 2), (2, 1), (2, 3), (3, 4)]),
    unit=st.integers(1, 4),
    stopped=st.integers(0, 30),
)
def test_a_stream_resumes_at_another_world_size_on_the_same_global_order(n, ws, unit, stopped):
    world, world2 = ws
    global_batch = math.lcm(world, world2) * unit
    full = stream_steps(n, world, global_batch // world)
    assert full == [set(range(j * global_batch, (j + 1) * global_batch)) for j in range(n // global_batch)]
    stopped = min(stopped, len(full))
    assert stream_steps(n, world2, global_batch // world2, consumed=stopped * global_batch) == full[stopped:]
    loader = stream_loader(SizedStream(n), topology(0, world), batch_size=global_batch // world, collate_fn=None)
    assert batches_per_epoch(loader) == len(full) == len(loader)


# Layer 1: dict batches and to_device.


class Tokens(Dataset):
    """What a Hugging Face data set with set_format("torch") yields: dicts of tensors (and a string id)."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i):
        return {"input_ids": torch.full((4,), i), "labels": torch.tensor(i), "id": f"doc{i}"}


@pytest.mark.fast
def test_dict_samples_collate_to_dicts_and_move_to_the_device():
    loader = make_loader(Tokens(), topology(0, 1), batch_size=4, collate_fn=None, train=False)
    batch = to_device(next(iter(loader)), torch.device("cpu"))
    assert set(batch) == {"input_ids", "labels", "id"} and batch["input_ids"].shape == (4, 4)
    assert batch["labels"].tolist() == [0, 1, 2, 3] and batch["id"] == ["doc0", "doc1", "doc2", "doc3"]
    Pair = namedtuple("Pair", "input target")
    moved = to_device(Pair(torch.ones(2), [torch.zeros(1), "keep", 3]), torch.device("meta"))
    assert isinstance(moved, Pair) and moved.input.device.type == "meta" and moved.target[0].device.type == "meta"
    assert moved.target[1:] == ["keep", 3], "non-tensor values are left alone"
    x, y = to_device((torch.ones(2), torch.zeros(2)), torch.device("meta"))
    assert x.device.type == y.device.type == "meta"


@pytest.mark.fast
def test_a_factory_collate_fn_is_used_for_streams_and_maps():
    def pad(samples):
        return {"n": torch.tensor([s["labels"] for s in samples])}

    topo = topology(0, 1)  # no process group: the stream read as evaluation reads it (training agrees over ranks)
    loaders = [stream_loader(Stream(7), topo, batch_size=3, collate_fn=pad, train=False)]
    loaders.append(make_loader(Tokens(), topo, batch_size=3, collate_fn=pad))
    for loader in loaders:
        loader.sampler.set_epoch(0, consumed=0)
        assert all(set(batch) == {"n"} for batch in loader)


# Layer 2: two gloo ranks.


@pytest.fixture(scope="module")
def world2():
    with GlooWorld(2, timeout_s=60) as world:
        yield world


class RankStream(IterableDataset):
    """A stream whose length differs by rank (as files per host would): rank r's source has sizes[r] elements."""

    def __init__(self, sizes, rank, *, sized):
        self.n, self.sized = sizes[rank], sized

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        if not self.sized:
            raise TypeError("no length")
        return self.n


def _train_two_epochs(topo, sizes, sized):
    loader = stream_loader(RankStream(sizes, topo.rank, sized=sized), topo, batch_size=3, collate_fn=torch.tensor)
    counts = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch, consumed=0)
        steps = 0
        for batch in itertools.islice(loader, 100):  # as a recipe loops: islice up to the planned steps
            torch_dist.all_reduce(batch.clone())  # a stand-in for DDP's gradient all-reduce, one per step
            steps += 1
        counts.append(steps)
    after = torch.tensor([1])
    torch_dist.all_reduce(after)  # no collective was left dangling: the next one matches up
    return counts, after.item()


def check_streams_stop_together(topo):
    results = {}
    for sized in (False, True):
        # Rank 0's source: 30 elements (5 batches of its half); rank 1's: 12 (2 batches).
        results[sized] = _train_two_epochs(topo, (30, 12), sized)
    return results


def test_ranks_with_uneven_streams_take_the_same_steps_and_stop_together(world2):
    for result in world2.run(check_streams_stop_together):
        assert result == {False: ([2, 2], 2), True: ([2, 2], 2)}


def range_stream(n):
    return RankStream((n, n), 0, sized=True)


@pytest.mark.fast
@pytest.mark.parametrize("train", [True, False])
def test_two_workers_per_rank_read_each_rank_share_in_order(train):
    # No process group here (daemonic gloo ranks cannot start DataLoader workers): each rank's share alone.
    for rank in range(2):
        read = [
            [
                b.tolist()
                for b in DataLoader(
                    StreamShard(range_stream(23), rank=rank, world_size=2, batch_size=3, drop_last=train),
                    batch_size=None,
                    num_workers=workers,
                    collate_fn=torch.tensor,
                )
            ]
            for workers in (0, 2)
        ]
        assert read[0] == read[1] and sorted(x for b in read[1] for x in b)[:9] == list(range(rank, 18, 2))


def check_resume_skips_what_was_consumed(topo, consumed):
    loader = stream_loader(range_stream(40), topo, batch_size=2, collate_fn=torch.tensor)
    loader.sampler.set_epoch(1, consumed=consumed)
    return [b.tolist() for b in loader]


def test_a_resumed_stream_continues_where_the_global_order_stopped(world2):
    rank0, rank1 = world2.run(check_resume_skips_what_was_consumed, 12)
    steps = [sorted(a + b) for a, b in zip(rank0, rank1)]
    assert steps == [list(range(s, s + 4)) for s in range(12, 40, 4)]


def _pairs(samples):
    g = torch.tensor(samples)
    return g.float()[:, None], g % 3  # (input, target): a class for each element


def _by_hand(model, n: int) -> dict:
    """The whole stream's mean cross-entropy and accuracy in one process, each element once."""
    with torch.no_grad():
        x, y = _pairs(list(range(n)))
        logits = model(x)
    accuracy = logits.argmax(-1).eq(y).double().mean().item()
    return {"val_loss": nn.functional.cross_entropy(logits, y).item(), "val_acc": accuracy}


def check_evaluation(topo):
    # Rank 0's share of 23 is 12 samples (3 batches of 4), rank 1's 11 (3 batches, the last of 3).
    loader = stream_loader(range_stream(23), topo, batch_size=4, train=False, collate_fn=torch.tensor)
    plain = [b.tolist() for b in loader]
    torch.manual_seed(0)
    model = nn.Linear(1, 3)
    loss_fn = make_exact_loss(Loss(), model=model)
    evaluated = {}
    for n in (23, 9, 1):  # 9: rank 1 has one batch to rank 0's two; 1: rank 1 has none and runs rank 0's, uncounted
        loader = stream_loader(range_stream(n), topo, batch_size=4, train=False, collate_fn=_pairs)
        evaluated[n] = (evaluate_sharded(model, loader, loss_fn=loss_fn, device=topo.device), _by_hand(model, n))
    return plain, evaluated


def test_evaluation_reads_every_rank_share_once_and_a_sharded_eval_pads_the_shorter(world2):
    (plain0, evaluated0), (plain1, evaluated1) = world2.run(check_evaluation)
    assert sorted(x for b in plain0 + plain1 for x in b) == list(range(23))
    for n, (found, expected) in (evaluated0 | evaluated1).items():  # every rank reports the whole job's
        assert found == pytest.approx(expected, rel=1e-6), n
    assert evaluated0 == evaluated1
