"""Plug-in `stream`: an IterableDataset read in order, element g to rank g % world_size (docs/mixed-precision.md)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from core.kernel.job import RecipeError
from core.kernel.seams import SEAMS


class StreamShard(IterableDataset):
    """This rank's share of a stream, as lists of `batch_size` samples; batch k is read by worker k % num_workers."""

    def __init__(self, source, *, rank: int, world_size: int, batch_size: int, drop_last: bool):
        # num_replicas: as on a DistributedSampler
        self.source, self.rank, self.num_replicas = source, rank, world_size
        self.batch_size, self.drop_last, self.skip = batch_size, drop_last, 0

    def set_epoch(self, epoch: int, *, consumed: int = 0) -> None:
        """A new epoch (a shuffling Hugging Face stream takes a new order), leaving out the `consumed` first."""
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)
        self.skip = consumed  # the elements of the global stream already trained on (a multiple of the ranks)

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
    """A DataLoader over a StreamShard; together=True: one MIN all-reduce a batch, so all ranks stop together."""

    def __init__(self, loader: DataLoader, *, device: torch.device, together: bool):
        self.loader, self.dataset, self.device, self.together = loader, loader.dataset, device, together
        self.sampler = self.dataset  # the recipes call loader.sampler.set_epoch(epoch, consumed=...)

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
    if dist.get_world_size() == 1:
        return flag
    agreed = torch.tensor([int(flag)], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


def is_stream(dataset) -> bool:
    """An IterableDataset, or anything iterable again and again without indexing: read in order, never sampled."""
    if isinstance(dataset, IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__") and iter(dataset) is not dataset


def stream_loader(dataset, topo, *, batch_size: int, collate_fn, train: bool = True) -> StreamLoader | None:
    """A loader over this rank's share of a stream (None for None): training stops when any rank runs dry."""
    if dataset is None:
        return None
    shard = StreamShard(dataset, rank=topo.rank, world_size=topo.world_size, batch_size=batch_size, drop_last=train)
    options = dict(num_workers=0, pin_memory=topo.device.type == "cuda", collate_fn=collate_fn or default_collate)
    return StreamLoader(DataLoader(shard, batch_size=None, **options), device=topo.device, together=train)


def stream_loaders(cfg, topo, train_set, val_set, collate_fn) -> tuple | None:
    """(train loader, val loader, optimizer steps) when the training set is a stream; None otherwise."""
    if not is_stream(train_set):
        return None
    train = stream_loader(train_set, topo, batch_size=cfg.batch_size, collate_fn=collate_fn)
    val = stream_loader(val_set, topo, batch_size=cfg.batch_size, collate_fn=collate_fn, train=False)
    try:
        total = cfg.epochs * (len(train) // cfg.accum)
    except TypeError:  # no length
        if not cfg.max_steps:
            raise RecipeError("--data: a stream without a length; set --max-steps (the LR schedule's length)") from None
        return train, val, cfg.max_steps
    return train, val, min(total, cfg.max_steps) if cfg.max_steps else total


SEAMS["streams"].append(stream_loaders)
