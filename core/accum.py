"""Gradient accumulation and clipping under autocast: the step of ddp_amp and the sharded recipes."""

from __future__ import annotations

import contextlib
import math
from collections import namedtuple
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from core.exact_loss import count_targets, forward_exact
from core.grads import clip_grad_norm
from core.kernel.job import Options, RecipeError, option
from core.kernel.seams import SEAMS
from core.kernel.train import make_loader, to_device


@dataclass(frozen=True)
class Accumulation(Options):
    """gradient accumulation and clipping"""

    accum: int = option(1, "micro-batches per optimizer step (accumulation)", low=1)
    clip: float = option(0.0, "clip the global gradient norm to this (0: off)")  # below 0, nan, inf: out of its range


# What one optimizer step did: its gradient norm before clipping, whether it was skipped (the gradients were not
# finite: the parameters were left as they were), fp16's loss scale (1.0 otherwise), and whether fp16 loss scaling is
# on (a skipped step is then its routine back-off, not a failure).
StepStats = namedtuple("StepStats", "grad_norm skipped scale scaled", defaults=(1.0, False))


def micro_batch_groups(loader, k: int, *, device: torch.device) -> Iterator[list]:
    """The loader's batches K at a time, moved to `device`; an incomplete group at the end is dropped."""
    for group in zip(*[iter(loader)] * k):  # one iterator k times: k batches a group, an incomplete tail dropped
        yield [to_device(batch, device) for batch in group]


def step_amp(
    model, micro_batches, *, optimizer, loss_fn, precision="fp32", scaler=None, clip=0.0, sync=None, dp_group=None
) -> tuple[dict[str, torch.Tensor], StepStats]:
    """One optimizer step over K micro-batches: autocast forward, exact loss, (scaled) backward, unscale, clip, step."""
    optimizer.zero_grad(set_to_none=True)
    group = dp_group if dp_group is not None else getattr(model, "process_group", None)  # DDP's own, or this rank
    world = dist.get_world_size(group) if group is not None else 1
    count = torch.stack([count_targets(batch, loss_fn) for batch in micro_batches]).sum()  # this rank's
    if world > 1:  # the global batch's counted targets, summed over the data-parallel ranks
        dist.all_reduce(count, group=group)
    normalizer = count.clamp(min=1.0) / world  # none counted: no nan
    dtype, sums = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision), {}  # the weights stay fp32
    for i, batch in enumerate(micro_batches):
        with sync(model, enabled=i == len(micro_batches) - 1) if sync else contextlib.nullcontext():  # backward too
            with torch.autocast(normalizer.device.type, dtype=dtype, enabled=dtype is not None):
                loss, metrics = forward_exact(model, batch, loss_fn, normalizer=normalizer)
            (loss if scaler is None else scaler.scale(loss)).backward()
        sums = {k: sums[k] + v if k in sums else v for k, v in metrics.items()}
    if scaling := scaler is not None and scaler.is_enabled():
        scaler.unscale_(optimizer)  # true gradients before the norm is read or clipped
    scale = scaler.get_scale() if scaling else 1.0
    # the step's one host sync; every rank decides alike
    norm = float(clip_grad_norm([p for group in optimizer.param_groups for p in group["params"]], clip))
    if scaling:
        scaler.step(optimizer)  # skipped by the scaler itself when unscale_ found inf/nan
        scaler.update()
        skipped = scaler.get_scale() < scale
    elif not (skipped := not math.isfinite(norm)):
        optimizer.step()
    return sums, StepStats(norm, skipped, scale, scaling)


def check_step(stats: StepStats, *, step: int, on_nonfinite: str) -> int:
    """1 for a step skipped on a non-finite gradient norm (fp16's routine back-off: 0); with stop, one line."""
    if (bad := not (stats.scaled or math.isfinite(stats.grad_norm))) and on_nonfinite == "stop":
        why = f"the loss or the gradients are not finite (gradient norm {stats.grad_norm})"
        raise RecipeError(f"step {step}: {why}; lower --lr, set --clip, or pass --on-nonfinite skip")
    return int(bad)


def make_loaders(cfg, topo, train_set, val_set, collate_fn) -> tuple:
    """(train loader, val loader, optimizer steps at --accum micro-batches a step); a stream through the plug-in."""
    # the stream plug-in: read in order, dealt out by position
    if found := next((f for make in SEAMS["streams"] if (f := make(cfg, topo, train_set, val_set, collate_fn))), None):
        return found
    if isinstance(train_set, IterableDataset):
        stream = f"the data set is a stream ({type(train_set).__name__}, an IterableDataset)"
        raise RecipeError(f"{stream}: give a map-style one or --with stream")
    train = make_loader(train_set, topo, batch_size=cfg.batch_size, collate_fn=collate_fn, seed=cfg.seed)
    val = make_loader(val_set, topo, batch_size=cfg.batch_size, collate_fn=collate_fn, train=False)
    if (whole := (share := train.sampler.num_samples) // cfg.batch_size) < cfg.accum:  # an epoch: not one step
        fix = f"--accum {whole} or less" if whole else f"--batch-size {share} or less" if share else "fewer ranks"
        gives = f"the training set ({len(train_set)} samples) gives each of {topo.world_size} rank(s) {share}"
        asked = f"--batch-size {cfg.batch_size}" + f" x --accum {cfg.accum}" * (cfg.accum > 1)
        raise RecipeError(f"{asked}: {gives}, not one optimizer step; use {fix}")
    return train, val, min(cfg.epochs * (len(train) // cfg.accum), cfg.max_steps or math.inf)  # --max-steps 0: no cap
