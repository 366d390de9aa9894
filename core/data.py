"""Data: the `--data` factory, and a loader over each rank's share that resumes mid-epoch.

A data factory takes no arguments and returns `(train, val)` or `(train, val, collate_fn)`; `val` may be
None. Samples are `(input, target)` pairs, `(input, ..., target)` tuples or dicts of tensors
(`{"input_ids": ..., "labels": ...}`, as a Hugging Face data set with `set_format("torch")` yields).
The data sets here are map-style (`__getitem__` and `__len__`); core.stream reads streams.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset, Subset

from core.factory import resolve_factory
from core.kernel.job import RecipeError
from core.kernel.train import ResumableSampler

DATASETS = {"digits": "core.datasets:digits", "synthetic": "core.datasets:synthetic", "text": "core.gpt:text"}


def build_data(spec: str) -> tuple:
    """`--data`: a built-in name or a user's `module:function`. Returns (train, val, collate_fn or None)."""
    result = resolve_factory(spec, DATASETS, option="--data")()  # called with no arguments
    return (*result, None)[:3] if isinstance(result, tuple | list) else (result, None, None)


def make_loader(dataset, topo, *, batch_size: int, seed: int = 0, train: bool = True, collate_fn=None, drop_last=False):
    """A DataLoader over this rank's share of a map-style data set (None for None); call `set_epoch` every epoch.

    train=True: shuffled by a DistributedSampler seeded with `seed`, the same number of samples on every rank
    (the tail that does not divide by the world size is dropped, so no sample is trained twice).
    train=False: each sample on exactly one rank, in order, none repeated: exact evaluation metrics.
    Two worker processes on CUDA, none on CPU. drop_last: a training epoch's smaller last batch is left out.
    """
    if dataset is None:
        return None
    if isinstance(dataset, IterableDataset):  # a stream has no length for a sampler to deal out
        raise RecipeError(
            f"the data set is a stream ({type(dataset).__name__}, an IterableDataset): give a map-style one (__len__, "
            f"__getitem__), or take ddp_amp, fsdp, fsdp_tp or tensor_parallel (a copy of one made `--with stream`)"
        )
    on_gpu = topo.device.type == "cuda"
    workers = 2 if on_gpu else 0
    options = dict(num_workers=workers, pin_memory=on_gpu, persistent_workers=workers > 0, collate_fn=collate_fn)
    if not train:
        return DataLoader(Subset(dataset, range(topo.rank, len(dataset), topo.world_size)), batch_size, **options)
    sampler = ResumableSampler(dataset, num_replicas=topo.world_size, rank=topo.rank, seed=seed, drop_last=True)
    generator = torch.Generator().manual_seed(seed)  # leaves the global RNG alone: resume stays exact
    return DataLoader(dataset, batch_size, sampler=sampler, generator=generator, drop_last=drop_last, **options)


def total_steps(loader: DataLoader, *, epochs: int, max_steps: int, accum: int = 1) -> int:
    """Optimizer steps the run takes (the LR schedule's length): --epochs over the loader, or --max-steps.
    One RecipeError line when a rank's share of the training set does not hold one whole step."""
    share, world = loader.sampler.num_samples, loader.sampler.num_replicas
    if share < loader.batch_size * accum:
        raise RecipeError(too_few_batches(len(loader.dataset), batch_size=loader.batch_size, accum=accum, world=world))
    total = epochs * (len(loader) // accum)
    return min(total, max_steps) if max_steps else total


def too_few_batches(samples: int, *, batch_size: int, accum: int, world: int) -> str:
    """The line for a training set whose share per rank holds less than one step: a whole batch, --accum times."""
    share, what = samples // world, f"--batch-size {batch_size}" + (f" --accum {accum}" if accum > 1 else "")
    if share >= batch_size:
        whole = share // batch_size
        return f"{what}: an epoch has only {whole} whole micro-batches per rank; use --accum {whole} or less"
    fix = f"use --batch-size {share} or less" if share else f"use fewer than {world} rank(s)"
    gives = f"the training set ({samples} samples) gives each of {world} rank(s) {share}"
    return f"{what}: {gives}, not one whole batch; {fix}"
