"""Data: the embedded data sets (no download), the factory contract and the distributed loader.

A data factory takes no arguments and returns `(train, val)` or `(train, val, collate_fn)`:
`val` may be None; each data set is map-style (`__getitem__` and `__len__`) or an
`IterableDataset` (a stream, with or without `__len__`); samples are `(input, target)` pairs
or dicts of tensors (`{"input_ids": ..., "labels": ...}`, as a Hugging Face data set with
`set_format("torch")` yields), unless the factory hands over its own `collate_fn`.
Built-in ones and a user's own take one path.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    TensorDataset,
    default_collate,
)

from core.config import RecipeError
from core.factory import call_factory
from core.stream import StreamLoader, StreamShard, in_step  # noqa: F401  (in_step: data.in_step for evaluate)


def digits(*, val_fraction: float = 0.2, split_seed: int = 0) -> tuple[Dataset, Dataset]:
    """scikit-learn's 8x8 handwritten digits (1797 images, shipped in the package): 64 floats in [0, 1]."""
    images, labels = _digits_table()
    inputs = torch.tensor(images, dtype=torch.float32) / 16.0
    targets = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(split_seed))
    n_val = int(len(targets) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(inputs[train], targets[train]), TensorDataset(inputs[val], targets[val])


def _digits_table():
    """load_digits(return_X_y=True) from the file sklearn ships: importing sklearn costs ~1 s a process."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    table = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if table is None or not table.is_file():  # another layout (or no sklearn): its own loader says what is wrong
        from sklearn.datasets import load_digits

        return load_digits(return_X_y=True)
    rows = np.loadtxt(table, delimiter=",")
    return rows[:, :-1], rows[:, -1].astype(int)


def synthetic(*, n: int = 8192, dim: int = 64, classes: int = 10, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Gaussian blobs, one per class, in digits' shape: learnable, any size, for benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=gen)
    targets = torch.randint(classes, (n,), generator=gen)
    inputs = centers[targets] + 0.8 * torch.randn(n, dim, generator=gen)
    n_val = n // 8
    return TensorDataset(inputs[n_val:], targets[n_val:]), TensorDataset(inputs[:n_val], targets[:n_val])


# Imported only when used: a built-in costs nothing until asked for.
DATASETS = {"digits": "core.data:digits", "synthetic": "core.data:synthetic", "text": "core.gpt:text"}


def is_stream(dataset) -> bool:
    """An IterableDataset, or anything iterable again and again without indexing (read in order, never sampled)."""
    if isinstance(dataset, IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__") and iter(dataset) is not dataset


def _size(dataset) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # a stream without a length
        return None


def build_data(spec: str) -> tuple:
    """`--data`: a built-in name or a user's `module:function`. Returns (train, val, collate_fn or None)."""
    result = call_factory(spec, DATASETS, option="--data")
    shape = "the factory must return (train, val) or (train, val, collate_fn)"
    if not (isinstance(result, (tuple, list)) and len(result) in (2, 3)):
        raise RecipeError(f"--data {spec}: {shape}; it returned {type(result).__name__}")
    train, val, collate = (*result, None)[:3]
    for name, dataset in (("train", train), ("val", val)):
        mapped = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__") and not isinstance(dataset, str)
        if not (dataset is None and name == "val" or mapped or is_stream(dataset)):
            raise RecipeError(
                f"--data {spec}: {shape}; its {name} is of type {type(dataset).__name__}, not a data set "
                f"(map-style with __getitem__ and __len__, or an IterableDataset)"
            )
    if collate is not None and not callable(collate):
        raise RecipeError(f"--data {spec}: {shape}; its collate_fn is of type {type(collate).__name__}, not a function")
    if _size(train) == 0:
        raise RecipeError(f"--data {spec}: the training set is empty")
    return train, val, collate


def check_data_factory(spec: str) -> dict:
    """The pre-check: call the factory once, read two samples and collate them. A summary, or one RecipeError line."""
    train, val, collate = build_data(spec)
    samples = first_samples(train, 2)
    if not samples:
        raise RecipeError(f"--data {spec}: the training set is empty")
    kind = "dict" if isinstance(samples[0], Mapping) else "pair"
    if collate is None and not (kind == "dict" or isinstance(samples[0], (tuple, list)) and len(samples[0]) >= 2):
        raise RecipeError(
            f"--data {spec}: a training sample is of type {type(samples[0]).__name__}; a sample must be an "
            f"(input, target) pair or a dict of tensors, or the factory must also return a collate_fn"
        )
    try:
        (collate or default_collate)(samples)
    except Exception as err:  # e.g. sequences of different lengths and no collate_fn to pad them
        message = " ".join(str(err).split())[:200]
        raise RecipeError(
            f"--data {spec}: collating two training samples raised {type(err).__name__}: {message}; "
            f"return a collate_fn as the third item of the factory's result"
        ) from None
    return {
        "train": _size(train),
        "val": None if val is None else _size(val),
        "stream": is_stream(train),
        "sample": kind,
        "collate_fn": collate is not None,
    }


def first_samples(dataset, n: int) -> list:
    """The first `n` samples (fewer if there are fewer), of a map-style data set or a stream."""
    if is_stream(dataset):
        return list(itertools.islice(dataset, n))
    return [dataset[i] for i in range(min(n, len(dataset)))]


def to_device(batch, device: torch.device):
    """Move a batch's tensors: pairs, tuples, lists and dicts, nested; other values (strings, ids) stay as they are.
    non_blocking overlaps the copy with compute from pinned memory."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        moved = [to_device(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)  # a namedtuple takes *args
    return batch


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
        return iter(indices[self.skip :])

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
    dataset,
    topo,
    *,
    batch_size: int,
    seed: int = 0,
    train: bool = True,
    drop_last: bool = True,
    collate_fn=None,
    num_workers: int | None = None,
):
    """A loader over this rank's share of `dataset` (None for None); call `set_epoch` every epoch.

    Map-style, train=True: shuffled by a DistributedSampler seeded with `seed`; every rank gets the
    same number of samples (drop_last=True drops the tail that does not divide by the world size,
    False pads it with repeated samples). train=False: each sample on exactly one rank, in order.
    A stream: element g to rank g % world_size, in order. train=True: only whole batches, and every
    rank stops when any runs dry; train=False: every element once, ranks may have unequal counts.
    num_workers: None is 2 on CUDA for map-style data, else 0. Worker processes copy the data set:
    a stream that shards itself across workers (a Hugging Face stream does) needs num_workers=0.
    """
    if dataset is None:
        return None
    on_gpu = topo.device.type == "cuda"
    stream = is_stream(dataset)
    workers = (2 if on_gpu and not stream else 0) if num_workers is None else num_workers
    options = dict(num_workers=workers, pin_memory=on_gpu, collate_fn=collate_fn or default_collate)
    if stream:
        shard = StreamShard(dataset, rank=topo.rank, world_size=topo.world_size, batch_size=batch_size, drop_last=train)
        loader = DataLoader(shard, batch_size=None, **options)  # a new worker copy each epoch: set_epoch reaches it
        return StreamLoader(loader, device=topo.device, together=train)
    if train:
        sampler = ResumableSampler(
            dataset, num_replicas=topo.world_size, rank=topo.rank, shuffle=True, seed=seed, drop_last=drop_last
        )
    else:
        sampler = ShardSampler(dataset, rank=topo.rank, world_size=topo.world_size)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(seed),  # leaves the global RNG alone: resume stays exact
        **options,
    )


def set_epoch(loader, epoch: int, *, consumed: int = 0) -> None:
    """Call at every epoch's start. `consumed`: samples of this epoch's global order already trained on (0 fresh).

    Global step j of an epoch trains global positions [j*GB, (j+1)*GB) (GB: the global batch) at any world
    size, so a checkpoint's `consumed` resumes at W' ranks exactly when it divides by W' (else up to W'-1
    samples are trained again). Map-style: each rank skips consumed // W of its list; a stream skips `consumed`.
    """
    if isinstance(loader, StreamLoader):
        loader.dataset.set_epoch(epoch, skip=consumed)
    elif loader is not None:
        loader.sampler.set_epoch(epoch, skip=consumed // loader.sampler.num_replicas)


def batches_per_epoch(loader) -> int | None:
    """Batches per rank in a whole epoch (the LR schedule's length), whatever was skipped; None for a stream
    without a length."""
    if isinstance(loader, StreamLoader):
        shard = loader.dataset
        skip, shard.skip = shard.skip, 0
        try:
            return len(shard)
        except TypeError:
            return None
        finally:
            shard.skip = skip
    sampler = loader.sampler
    samples = sampler.num_samples if isinstance(sampler, DistributedSampler) else len(sampler)
    return samples // loader.batch_size if loader.drop_last else -(-samples // loader.batch_size)


def too_few_batches(loader, batches: int, *, batch_size: int, accum: int, world_size: int) -> str:
    what = f"--batch-size {batch_size}" + (f" --accum {accum}" if accum > 1 else "")
    if batches:
        return f"{what}: an epoch has only {batches} micro-batches per rank; use --accum {batches} or less"
    per_rank = len(loader.dataset) // world_size
    fix = f"use --batch-size {per_rank} or less" if per_rank else f"use fewer than {world_size} rank(s)"
    return (
        f"{what}: the training set ({len(loader.dataset)} samples) gives each of {world_size} rank(s) "
        f"{per_rank}, not one whole batch; {fix}"
    )
