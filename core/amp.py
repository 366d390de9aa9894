"""Mixed precision, gradient accumulation and clipping: the step of ddp_amp and of the model-parallel recipes.

    scaler = amp.make_scaler(cfg.precision, device=topo.device)      # fp16's dynamic loss scaling; else a no-op
    for micro_batches in amp.micro_batch_groups(loader, cfg.accum, device=topo.device):
        metrics, stats = amp.step_amp(ddp_model, micro_batches, optimizer=..., loss_fn=..., precision=..., scaler=...)

The forward runs under torch.autocast (bf16 or fp16) with fp32 weights; fp16 scales the loss so that small
gradients survive its 5-bit exponent, unscales before clipping, and skips a step whose gradients overflowed while
the scale backs off. K micro-batches make one step, their gradients reduced once, in the last backward.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset

from core.exact_loss import ExactLoss, forward_exact, global_count
from core.grads import clip_grad_norm
from core.kernel.job import Options, RecipeError, option
from core.kernel.seams import STREAMS
from core.kernel.train import make_loader, to_device


@dataclass(frozen=True)
class Precision(Options):
    title = "mixed precision"
    precision: str = option(
        "fp32",
        "compute precision (autocast; fp16 adds dynamic loss scaling)",
        choices=("fp32", "bf16", "fp16"),
        check=lambda precision: precision != "fp16" or torch.cuda.is_available(),
        fix="fp16 needs a CUDA GPU; on CPU use --precision bf16",
    )


@dataclass(frozen=True)
class Accumulation(Options):
    title = "gradient accumulation and clipping"
    accum: int = option(1, "micro-batches per optimizer step (accumulation)", low=1)
    clip: float = option(0.0, "clip the global gradient norm to this (0: off)", check=lambda v: v >= 0, fix="use 0+")


AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, *, device: torch.device):
    """The forward pass's context: torch.autocast to bf16/fp16, nothing for fp32. Weights stay fp32 either way."""
    dtype = AUTOCAST_DTYPES[precision]
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def make_scaler(precision: str, *, device: torch.device, **options) -> torch.amp.GradScaler:
    """Dynamic loss scaling for fp16; for bf16 and fp32 a disabled scaler that passes straight through.

    bf16 and fp32 share fp32's exponent range: the disabled scaler's scale(), unscale_(), step() and update() do
    nothing. Its state_dict() belongs in every checkpoint."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16", **options)


def micro_batch_groups(loader, k: int, *, device: torch.device) -> Iterator[list]:
    """The loader's batches K at a time, moved to `device`; an incomplete group at the end is dropped."""
    batches = iter(loader)
    while len(group := [to_device(batch, device) for batch in itertools.islice(batches, k)]) == k:
        yield group


def grad_sync(model: nn.Module, *, enabled: bool):
    """Whether the backward inside reduces gradients across ranks (DDP's no_sync() when it does not).

    no_sync() holds DDP's all-reduce back and keeps adding to .grad. Another wrapper passes its own function of this
    shape (core.parallel.fsdp_sync)."""
    return contextlib.nullcontext() if enabled or not hasattr(model, "no_sync") else model.no_sync()


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did: the gradient norm (before clipping), the loss scale, and whether it was skipped."""

    grad_norm: float
    skipped: bool  # gradients were not finite, so the parameters were left as they were
    scale: float = 1.0  # fp16's loss scale (1.0 otherwise)
    scaled: bool = False  # fp16 loss scaling is on: a skipped step is its routine back-off, not a failure


def step_amp(
    model: nn.Module,
    micro_batches: list,
    *,
    optimizer: torch.optim.Optimizer,
    loss_fn: ExactLoss,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    clip: float = 0.0,
    sync=grad_sync,
    dp_group=None,
) -> tuple[dict[str, torch.Tensor], StepStats]:
    """One optimizer step over K micro-batches: autocast forward, exact loss, (scaled) backward, unscale, clip, step.

    dp_group: the ranks whose gradients are averaged (None: a DDP model's own group, else this process alone, as for
    tensor parallelism, where every rank holds the same batch; pass fully_shard's mesh group). Never steps on inf/nan
    gradients; every rank decides alike, from the norm of all-reduced gradients."""
    optimizer.zero_grad(set_to_none=True)
    group = dp_group if dp_group is not None else getattr(model, "process_group", None)
    world = dist.get_world_size(group) if group is not None else 1
    count = global_count(micro_batches, loss_fn, group=group)
    normalizer = count.clamp(min=1.0) / world  # no counted target anywhere: zero gradients, not nan
    sums = {}
    for i, batch in enumerate(micro_batches):
        with sync(model, enabled=i == len(micro_batches) - 1):  # the backward must run inside no_sync too
            with autocast(precision, device=normalizer.device):
                loss, metrics = forward_exact(model, batch, loss_fn, normalizer=normalizer)
            (loss if scaler is None else scaler.scale(loss)).backward()
        sums = {k: sums[k] + v if k in sums else v for k, v in metrics.items()}
    if scaling := scaler is not None and scaler.is_enabled():
        scaler.unscale_(optimizer)  # true gradients before the norm is read or clipped
    scale = scaler.get_scale() if scaling else 1.0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norm = float(clip_grad_norm(params, clip))  # the step's one host sync
    if scaling:
        scaler.step(optimizer)  # skipped by the scaler itself when unscale_ found inf/nan
        scaler.update()
        skipped = scaler.get_scale() < scale
    elif not (skipped := not math.isfinite(norm)):
        optimizer.step()
    return sums, StepStats(norm, skipped, scale, scaling)


def check_step(stats: StepStats, *, step: int, on_nonfinite: str) -> int:
    """1 when a step with a non-finite gradient norm was skipped (--on-nonfinite skip); with stop, one line, on every
    rank alike. fp16's scaler skipping an overflowing step is its routine back-off (0)."""
    if stats.scaled or math.isfinite(stats.grad_norm):
        return 0
    if on_nonfinite == "stop":
        fix = "lower --lr, set --clip, or pass --on-nonfinite skip"
        raise RecipeError(
            f"step {step}: the loss or the gradients are not finite (gradient norm {stats.grad_norm}); {fix}"
        )
    return 1


def make_loaders(cfg, topo, train_set, val_set, collate_fn) -> tuple:
    """(train loader, val loader, optimizer steps): a stream (an IterableDataset) through the stream plug-in, read in
    order and dealt out by position; map-style data through make_loader's seeded sampler."""
    for make in STREAMS:  # the stream plug-in
        if found := make(cfg, topo, train_set, val_set, collate_fn):
            return found
    if isinstance(train_set, IterableDataset):
        raise RecipeError(
            f"the data set is a stream ({type(train_set).__name__}, an IterableDataset): give a map-style one "
            f"(__len__, __getitem__), or add the stream plug-in (a copy made `--with stream`)"
        )
    train = make_loader(train_set, topo, batch_size=cfg.batch_size, collate_fn=collate_fn, seed=cfg.seed)
    val = make_loader(val_set, topo, batch_size=cfg.batch_size, collate_fn=collate_fn, train=False)
    return train, val, accum_steps(train, epochs=cfg.epochs, max_steps=cfg.max_steps, accum=cfg.accum)


def accum_steps(loader, *, epochs: int, max_steps: int, accum: int) -> int:
    """Optimizer steps the run takes (the LR schedule's length) at --accum micro-batches a step: --epochs over the
    loader, or --max-steps; one line when a rank's share of the training set holds less than one step."""
    share, world, batch = loader.sampler.num_samples, loader.sampler.num_replicas, loader.batch_size
    if share < batch * accum:
        samples, what = len(loader.dataset), f"--batch-size {batch}" + (f" --accum {accum}" if accum > 1 else "")
        if share >= batch:
            whole = share // batch
            raise RecipeError(
                f"{what}: an epoch has only {whole} whole micro-batches per rank; use --accum {whole} or less"
            )
        fix = f"use --batch-size {share} or less" if share else f"use fewer than {world} rank(s)"
        gives = f"the training set ({samples} samples) gives each of {world} rank(s) {share}"
        raise RecipeError(f"{what}: {gives}, not one whole batch; {fix}")
    total = epochs * (len(loader) // accum)
    return min(total, max_steps) if max_steps else total
