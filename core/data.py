"""Data: the embedded data sets (no download) and the distributed loader.

A data factory takes no arguments and returns `(train, val)`: two map-style data sets of
`(input, target)` pairs, `val` may be None. Built-in ones and a user's own take one path.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from core.config import RecipeError, resolve_factory


def digits(*, val_fraction: float = 0.2, split_seed: int = 0) -> tuple[Dataset, Dataset]:
    """scikit-learn's 8x8 handwritten digits (1797 images, shipped in the package): 64 floats in [0, 1]."""
    from sklearn.datasets import load_digits  # imported here: only this data set needs it

    images, labels = load_digits(return_X_y=True)
    inputs = torch.tensor(images, dtype=torch.float32) / 16.0
    targets = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(split_seed))
    n_val = int(len(targets) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(inputs[train], targets[train]), TensorDataset(inputs[val], targets[val])


def synthetic(*, n: int = 8192, dim: int = 64, classes: int = 10, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Gaussian blobs, one per class, in digits' shape: learnable, any size, for benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=gen)
    targets = torch.randint(classes, (n,), generator=gen)
    inputs = centers[targets] + 0.8 * torch.randn(n, dim, generator=gen)
    n_val = n // 8
    return TensorDataset(inputs[n_val:], targets[n_val:]), TensorDataset(inputs[:n_val], targets[:n_val])


DATASETS = {"digits": "core.data:digits", "synthetic": "core.data:synthetic", "text": "core.gpt:text"}  # imported when used


def check_data_factory(spec: str) -> None:  # SHIM (branch data replaces)
    build_data(spec)


def set_epoch(loader, epoch: int, *, consumed: int = 0) -> None:  # SHIM (branch data replaces)
    loader.sampler.set_epoch(epoch, skip=consumed // loader.sampler.num_replicas)


def build_data(spec: str):
    """`--data`: a built-in name or a user's `module:function` returning (train, val)."""
    result = resolve_factory(spec, DATASETS, option="--data")()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise RecipeError(f"--data {spec}: the factory must return (train, val); it returned {type(result).__name__}")
    train, val = result
    if len(train) == 0:
        raise RecipeError(f"--data {spec}: the training set is empty")
    return train, val, None


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way through, for a mid-epoch resume."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = 0

    def set_epoch(self, epoch: int, *, skip: int = 0) -> None:
        """Shuffle for `epoch` (the same order on every rank) and leave out its first `skip` samples."""
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip:])

    def __len__(self) -> int:
        return self.num_samples - self.skip


class ShardSampler(Sampler):
    """Every sample exactly once over all ranks, no padding: exact evaluation metrics."""

    def __init__(self, dataset: Dataset, *, rank: int, world_size: int):
        self.indices = range(rank, len(dataset), world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def make_loader(
    dataset: Dataset,
    topo,
    *,
    batch_size: int,
    seed: int = 0,
    train: bool = True,
    drop_last: bool = True,
    collate_fn=None,
) -> DataLoader:
    """A loader over this rank's share of `dataset`.

    train=True: shuffled by a DistributedSampler seeded with `seed` (call `set_epoch` every
    epoch). Every rank gets the same number of samples: drop_last=True drops the tail that
    does not divide by the world size, drop_last=False pads it with repeated samples.
    train=False: each sample on exactly one rank, in order, for evaluation.
    """
    if dataset is None:
        return None
    if train:
        sampler = ResumableSampler(
            dataset, num_replicas=topo.world_size, rank=topo.rank, shuffle=True, seed=seed,
            drop_last=drop_last,
        )
    else:
        sampler = ShardSampler(dataset, rank=topo.rank, world_size=topo.world_size)
    on_gpu = topo.device.type == "cuda"
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=2 if on_gpu else 0,  # in-memory CPU data: worker processes only cost time
        pin_memory=on_gpu,
        persistent_workers=on_gpu,
        generator=torch.Generator().manual_seed(seed),  # leaves the global RNG alone: resume stays exact
    )


def to_device(batch, device: torch.device):
    """Move an (input, target) batch; non_blocking overlaps the copy with compute from pinned memory."""
    return tuple(t.to(device, non_blocking=True) for t in batch)
