"""Data: each rank's share of a map-style data set, in a loader that resumes part-way through an epoch."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset

from core.kernel.options import RecipeError


def to_device(batch, device: torch.device):
    """A batch's tensors (in dicts, lists and tuples, nested) on `device`."""
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple | list):
        moved = [to_device(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)  # a namedtuple takes *args
    return batch.to(device, non_blocking=True) if isinstance(batch, torch.Tensor) else batch


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way through, for a mid-epoch resume."""

    skip = 0

    def set_epoch(self, epoch: int, *, skip: int = 0) -> None:
        super().set_epoch(epoch)  # the same shuffle on every rank
        self.skip = skip  # this rank's samples already trained

    def __iter__(self) -> Iterator[int]:
        return iter(list(super().__iter__())[self.skip :])

    def __len__(self) -> int:
        return self.num_samples - self.skip


def make_loader(dataset, topo, *, batch_size: int, collate_fn, seed: int = 0, train: bool = True):
    """This rank's share (None for None): shuffled apart from the global RNG (exact resume), or each sample once."""
    if dataset is None:
        return None
    on_gpu = topo.device.type == "cuda"
    options = dict(num_workers=2 if on_gpu else 0, pin_memory=on_gpu, persistent_workers=on_gpu, collate_fn=collate_fn)
    if not train:
        return DataLoader(Subset(dataset, range(topo.rank, len(dataset), topo.world_size)), batch_size, **options)
    sampler = ResumableSampler(dataset, num_replicas=topo.world_size, rank=topo.rank, seed=seed, drop_last=True)
    return DataLoader(dataset, batch_size, sampler=sampler, generator=torch.Generator().manual_seed(seed), **options)


def set_epoch(loader: DataLoader, epoch: int, *, consumed: int) -> None:
    """Every epoch's start; `consumed` samples of the epoch's global order were trained already (a resume)."""
    loader.sampler.set_epoch(epoch, skip=consumed // loader.sampler.num_replicas)


def total_steps(loader: DataLoader, *, epochs: int, max_steps: int) -> int:
    """Optimizer steps the run takes (the LR schedule's length): --epochs over the loader, or --max-steps."""
    if (share := loader.sampler.num_samples) < (batch := loader.batch_size):
        raise RecipeError(f"--batch-size {batch}: a rank has {share} samples to train; use less or fewer ranks")
    return min(epochs * len(loader), max_steps or epochs * len(loader))
