"""Streams: an IterableDataset sharded by rank and by DataLoader worker, without a sampler.

Training ranks take the same number of steps and stop together when any rank's share runs dry
(one tiny all-reduce per batch, for streams only); evaluation reads every rank's share once.
`core.data.make_loader` builds these; recipes never touch them directly.

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
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from core.config import RecipeError


class StreamShard(IterableDataset):
    """This rank's share of a stream, as lists of `batch_size` samples (the DataLoader collates them).

    Global element g (after the `skip` already trained on) goes to rank g % world_size, so global
    step j trains elements [j*GB, (j+1)*GB) at any world size, as DistributedSampler's order does.
    A rank's k-th batch is read by worker k % num_workers: the DataLoader's round robin over its
    workers then yields this rank's batches in order, with any number of workers.
    """

    def __init__(self, source, *, rank: int, world_size: int, batch_size: int, drop_last: bool):
        self.source, self.rank, self.world_size = source, rank, world_size
        self.batch_size, self.drop_last, self.skip = batch_size, drop_last, 0

    def set_epoch(self, epoch: int, *, skip: int = 0) -> None:
        if hasattr(self.source, "set_epoch"):  # e.g. a shuffling Hugging Face stream: a new order each epoch
            self.source.set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[list]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        mine = itertools.islice(self.source, self.skip + self.rank, None, self.world_size)
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
            return left // (self.world_size * self.batch_size)
        return -(-len(range(self.rank, left, self.world_size)) // self.batch_size)


class StreamLoader:
    """Iterates a DataLoader over a StreamShard. together=True (training): before every batch the ranks agree,
    with one MIN all-reduce of an "I have a batch" flag, so all take the same steps and stop when any runs dry."""

    def __init__(self, loader: DataLoader, *, device: torch.device, together: bool):
        self.loader, self.dataset, self.device, self.together = loader, loader.dataset, device, together

    def __iter__(self) -> Iterator:
        batches = iter(self.loader)
        while True:
            batch = next(batches, None)
            if self.together and not all_ranks(batch is not None, device=self.device):
                return  # a rank with a batch in hand drops it: that batch was never trained, nor counted
            if batch is None:
                return
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
    a rank whose share ran out repeats its last batch with counted=False until every rank's share is done."""
    batches, last = iter(loader), None
    while True:
        batch = next(batches, None)
        last = last if batch is None else batch
        flags = torch.tensor([batch is not None, last is None], device=device, dtype=torch.int32)
        if torch_dist.is_available() and torch_dist.is_initialized():
            torch_dist.all_reduce(flags, op=torch_dist.ReduceOp.MAX)
        if not flags[0]:
            return
        if flags[1]:  # every rank sees the same flags: all raise together, none waits
            raise RecipeError("a rank has no validation batch at all: use fewer ranks or a larger validation set")
        yield (last, batch is not None)
