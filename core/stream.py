"""Streams: an IterableDataset sharded by rank and by DataLoader worker, without a sampler.

Training ranks take the same number of steps and stop together when any rank's share runs dry
(one tiny all-reduce per batch, for streams only); evaluation reads every rank's share once.
A recipe that takes streams says so with one visible line: `stream.make_loader` for an IterableDataset,
core.data's loader for the rest. The loader quacks like a DataLoader over a sampler, so core.data.set_epoch
serves both.

Evaluation over a stream: ranks may hold unequal numbers of batches, so an evaluate loop must
sum locally and reduce once at the end (never a collective per batch); where each forward is
itself a collective (fully_shard, tensor or pipeline parallel), it iterates `in_step(loader)`
and adds only the batches marked counted.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
import torch.distributed as torch_dist
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from core.dist import Topology, broadcast_object
from core.kernel.job import RecipeError


class StreamShard(IterableDataset):
    """This rank's share of a stream, as lists of `batch_size` samples (the DataLoader collates them).

    Global element g (after the `skip` already trained on) goes to rank g % world_size, so global
    step j trains elements [j*GB, (j+1)*GB) at any world size, as DistributedSampler's order does.
    A rank's k-th batch is read by worker k % num_workers: the DataLoader's round robin over its
    workers then yields this rank's batches in order, with any number of workers.
    """

    def __init__(self, source, *, rank: int, world_size: int, batch_size: int, drop_last: bool):
        # num_replicas: the name core.data.set_epoch reads, as on a DistributedSampler
        self.source, self.rank, self.num_replicas = source, rank, world_size
        self.batch_size, self.drop_last, self.skip = batch_size, drop_last, 0

    def set_epoch(self, epoch: int, *, skip: int = 0) -> None:
        """A new epoch (a shuffling Hugging Face stream takes a new order), leaving out this rank's first `skip`."""
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)
        self.skip = skip * self.num_replicas  # the elements of the global stream already trained on

    def __iter__(self) -> Iterator[list]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        mine = itertools.islice(self.source, self.skip + self.rank, None, self.num_replicas)
        for k in itertools.count():
            batch = list(itertools.islice(mine, self.batch_size))  # every worker reads all: only k's owner yields
            if not batch or (self.drop_last and len(batch) < self.batch_size):
                return
            if k % workers == worker:
                yield batch

    def __len__(self) -> int:
        """Batches per rank; TypeError for a stream without a length. Training: the fewest any rank has."""
        left = max(len(self.source) - self.skip, 0)
        if self.drop_last:
            return left // (self.num_replicas * self.batch_size)
        return -(-len(range(self.rank, left, self.num_replicas)) // self.batch_size)


class StreamLoader:
    """Iterates a DataLoader over a StreamShard. together=True (training): before every batch the ranks agree,
    with one MIN all-reduce of an "I have a batch" flag, so all take the same steps and stop when any runs dry."""

    def __init__(self, loader: DataLoader, *, device: torch.device, together: bool):
        self.loader, self.dataset, self.device, self.together = loader, loader.dataset, device, together
        self.sampler = self.dataset  # set_epoch(epoch, skip=...) and num_replicas, as core.data.set_epoch calls them

    def __iter__(self) -> Iterator:
        batches = iter(self.loader)
        while True:
            batch = next(batches, None)
            if self.together and not all_ranks(batch is not None, device=self.device) or batch is None:
                return  # together: a rank with a batch in hand drops it when another has none (never trained)
            yield batch

    def __len__(self) -> int:
        return len(self.dataset)


def all_ranks(flag: bool, *, device: torch.device) -> bool:
    """True when `flag` is true on every rank (a collective: every rank calls it at the same point)."""
    if not (torch_dist.is_available() and torch_dist.is_initialized()) or torch_dist.get_world_size() == 1:
        return flag
    agreed = torch.tensor([int(flag)], device=device)
    torch_dist.all_reduce(agreed, op=torch_dist.ReduceOp.MIN)
    return bool(agreed.item())


def in_step(loader, *, device: torch.device) -> Iterator[tuple[object, bool]]:
    """(batch, counted), the same number on every rank, for evaluating a sharded model (each forward a collective):
    a rank whose share ran out repeats its last batch with counted=False until every rank's share is done. A rank
    with no batch at all (fewer samples than ranks) runs rank 0's first one, never counted."""
    batches, last = iter(loader), None
    while True:
        batch = next(batches, None)
        last = last if batch is None else batch
        flags = torch.tensor([batch is not None, last is None], device=device, dtype=torch.int32)
        if torch_dist.is_available() and torch_dist.is_initialized():
            torch_dist.all_reduce(flags, op=torch_dist.ReduceOp.MAX)
        if not flags[0]:
            return
        if flags[1]:  # every rank sees the same flags: all take part in the broadcast (rank 0 has element 0)
            filler = broadcast_object(last)
            last = filler if last is None else last
        yield (last, batch is not None)


def is_stream(dataset) -> bool:
    """An IterableDataset, or anything iterable again and again without indexing: read in order, never sampled."""
    if isinstance(dataset, IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__") and iter(dataset) is not dataset


def make_loader(dataset, topo: Topology, *, batch_size: int, train: bool = True, collate_fn=None, workers: int = 0):
    """A loader over this rank's share of a stream (None for None): element g to rank g % world_size, in order.
    train=True: whole batches only, and every rank stops when any runs dry; train=False: every element once.
    Worker processes copy the data set: a stream that shards itself across workers (a Hugging Face stream does)
    needs workers=0."""
    if dataset is None:
        return None
    shard = StreamShard(dataset, rank=topo.rank, world_size=topo.world_size, batch_size=batch_size, drop_last=train)
    options = dict(num_workers=workers, pin_memory=topo.device.type == "cuda", collate_fn=collate_fn or default_collate)
    return StreamLoader(DataLoader(shard, batch_size=None, **options), device=topo.device, together=train)


def total_steps(loader: StreamLoader, *, epochs: int, max_steps: int, accum: int = 1) -> int:
    """core.data.total_steps for a stream: one without a length needs --max-steps for the LR schedule's length."""
    try:
        total = epochs * (len(loader) // accum)
    except TypeError:  # no length
        if not max_steps:
            raise RecipeError("--data: a stream without a length; set --max-steps (the LR schedule's length)") from None
        return max_steps
    return min(total, max_steps) if max_steps else total
