"""One training step, evaluation, and metric sums that are reduced over ranks only when read.

Steps return their metrics as tensors on the device: no `.item()` (a host sync) per step.
A `Tally` adds them up and does one all-reduce when a number is actually logged.
The loss contract (model outputs, pair and dict batches, --loss, exact normalisation) is core.loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from core.dist import reduce_sum
from core.grads import clip_grad_norm, grad_sync  # noqa: F401  (grad_sync: recipes pass it)
from core.loss import (  # noqa: F401  (re-exported: recipes call steps.make_loss, steps.forward_loss, ...)
    IGNORE,
    Loss,
    as_loss,
    batch_device,
    cross_entropy,
    forward_loss,
    global_count,
    local_count,
    make_loss,
    split_outputs,
)
from core.stream import in_step as in_step_batches


def batch_metrics(outputs: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums, not means, so that ranks with different batch sizes combine exactly (`loss`: the mean over counted)."""
    counted = targets != IGNORE
    count = counted.sum().double()
    return {
        "loss_sum": loss.detach().double() * count,
        "correct": ((outputs.detach().argmax(-1) == targets) & counted).sum().double(),
        "count": count,
        "samples": torch.tensor(float(targets.shape[0]), dtype=torch.float64, device=targets.device),
    }


def step_plain(model: nn.Module, batch, *, optimizer: torch.optim.Optimizer, loss_fn) -> dict[str, torch.Tensor]:
    """One optimizer step on one batch: train_step with one micro-batch (kept for the recipes that call it)."""
    return train_step(model, [batch], optimizer=optimizer, loss_fn=loss_fn)[0]


# Fixed keys, so every rank (one that saw no batch too) joins one all-reduce of the same shape. `scored`: the
# targets of the batches that had an accuracy; none scored means no accuracy is reported (not 0).
TALLY_KEYS = ("loss_sum", "count", "samples", "correct", "scored")


class Tally:
    """Running sums of step metrics, kept on the device until `reduce` is called.

    `keys` fixes what is reduced, so a rank that saw no batch still joins the all-reduce.
    """

    def __init__(self, device: torch.device, keys: Iterable[str] = TALLY_KEYS):
        self.device = device
        self.sums = {key: torch.zeros((), dtype=torch.float64, device=device) for key in keys}

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        if "correct" in metrics and "scored" not in metrics:  # the targets accuracy was measured on
            metrics = {**metrics, "scored": metrics["count"]}
        for key, value in metrics.items():
            self.sums[key] = self.sums[key] + value if key in self.sums else value.double()

    def reduce(self) -> dict[str, float]:
        """Sums over all ranks (one all-reduce), as floats: the same numbers on every rank."""
        keys = sorted(self.sums)
        totals = reduce_sum(torch.stack([self.sums[k].double() for k in keys])).tolist()
        return dict(zip(keys, totals))


def summarize(sums: dict[str, float], *, prefix: str = "") -> dict[str, float]:
    """loss_sum / count / correct / scored sums -> mean loss, and accuracy only where one was measured."""
    record = {f"{prefix}loss": sums.get("loss_sum", 0.0) / max(sums.get("count", 0.0), 1.0)}
    scored = sums.get("scored", sums.get("count", 0.0) if "correct" in sums else 0.0)
    if scored > 0:
        record[f"{prefix}acc"] = sums.get("correct", 0.0) / scored
    return record


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: Iterable, *, loss_fn, device: torch.device, in_step: bool = False
) -> dict[str, float]:
    """Loss (summed over every counted target, divided by their count) and accuracy where it exists, over the
    whole validation set, every rank's share counted once: val_loss, and val_acc only for class logits.
    in_step: each forward is a collective (fully_shard, tensor parallel), so every rank runs as many batches;
    a rank whose share ran out repeats its last one, not counted (core.stream.in_step)."""
    was_training = model.training
    model.eval()
    loss_fn, tally = as_loss(loss_fn), Tally(device)
    for batch, counted in in_step_batches(loader, device=device) if in_step else ((b, True) for b in loader):
        metrics = forward_loss(model, _to_device(batch, device), loss_fn=loss_fn, normalizer=1.0)[1]
        if counted:
            tally.add(metrics)
    model.train(was_training)
    if hasattr(model, "reshard"):  # fully_shard keeps the root gathered after a forward with no backward: free it
        model.reshard()
    return summarize(tally.reduce(), prefix="val_")


def _to_device(batch, device: torch.device):
    """Pairs, lists and dicts of tensors; non_blocking overlaps the copy with compute from pinned memory."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


# Mixed precision, gradient accumulation and clipping: the pieces of the ddp_amp recipe.

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, *, device: torch.device) -> AbstractContextManager:
    """The forward pass's context: torch.autocast to bf16/fp16, nothing for fp32. Weights stay fp32 either way."""
    dtype = AUTOCAST_DTYPES[precision]
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def make_scaler(precision: str, *, device: torch.device, **options) -> torch.amp.GradScaler:
    """Dynamic loss scaling for fp16, whose 5-bit exponent flushes small gradients to zero.

    bf16 and fp32 share fp32's exponent range, so they get a disabled scaler: scale(), unscale_(),
    step() and update() then pass straight through. `options` go to GradScaler (init_scale,
    growth_interval, ...). The scaler's state_dict() belongs in every checkpoint.
    """
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16", **options)


def data_parallel_group(model: nn.Module, group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The ranks whose gradients are averaged: `group` if given, else a DDP model's own group, else None
    (this process alone: a plain model, or one whose wrapper the caller did not name, such as fully_shard's)."""
    if group is not None:
        return group
    inner = getattr(model, "_orig_mod", model)  # torch.compile forwards to the module it wraps
    return getattr(inner, "process_group", None) if isinstance(inner, nn.parallel.DistributedDataParallel) else None


def accumulate_grads(
    model: nn.Module,
    micro_batches: list,
    *,
    loss_fn,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    sync: Callable[..., AbstractContextManager] = grad_sync,
    dp_group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Forward and backward over K micro-batches, adding their gradients up in .grad.

    Gradients are all-reduced once, in the last backward (`sync` holds it off for the first K-1). Every
    micro-batch's summed loss is divided by the global batch's counted targets over W (one all-reduce of the
    count over the data-parallel group), so the result is the gradient one process computes on the whole global
    batch, padded sequences of any lengths included.
    """
    loss_fn, group = as_loss(loss_fn), data_parallel_group(model, dp_group)
    world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    count = local_count(micro_batches, model=model, loss_fn=loss_fn)
    if world > 1:
        dist.all_reduce(count, group=group)
    normalizer = count.clamp(min=1.0) / world  # no counted target anywhere: zero gradients, not nan
    device, sums = batch_device(micro_batches[0]), {}
    for i, batch in enumerate(micro_batches):
        with sync(model, enabled=i == len(micro_batches) - 1):  # backward must run inside no_sync too
            with autocast(precision, device=device):
                loss, metrics = forward_loss(model, batch, loss_fn=loss_fn, normalizer=normalizer)
            (loss if scaler is None else scaler.scale(loss)).backward()
        sums = {k: sums[k] + v if k in sums else v for k, v in metrics.items()}
    return sums


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did, as plain numbers (read with the one host sync a step takes)."""

    grad_norm: float  # total norm over all ranks, before clipping; inf or nan when the step was skipped
    skipped: bool  # gradients were not finite, so the parameters were left unchanged
    scale: float  # the loss scale used (1.0 unless fp16)
    scaled: bool = False  # fp16 loss scaling was on (the scale is meaningful)


def train_step(
    model: nn.Module,
    micro_batches: list,
    *,
    optimizer: torch.optim.Optimizer,
    loss_fn,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    clip: float = 0.0,
    clip_group: dist.ProcessGroup | None = None,
    sync: Callable[..., AbstractContextManager] = grad_sync,
    dp_group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, torch.Tensor], StepStats]:
    """One optimizer step over K micro-batches: autocast forward, exact loss, scaled backward, unscale, clip, step.

    Batches: (input, target) pairs or dicts of tensors, already on the device; `loss_fn`: a core.loss.Loss
    (make_loss), or cross_entropy. `dp_group`: the data-parallel ranks (None: a DDP model's own, else this
    process alone; pass it for fully_shard). Never steps on inf/nan gradients: with fp16 the scaler skips the step
    and backs its scale off (that is routine), otherwise the step is skipped and `StepStats.skipped` says so: the
    caller decides whether that stops the run. Every rank decides alike: it reads the norm of all-reduced gradients.
    """
    optimizer.zero_grad(set_to_none=True)
    metrics = accumulate_grads(
        model, micro_batches, loss_fn=loss_fn, precision=precision, scaler=scaler, sync=sync, dp_group=dp_group
    )
    scaling = scaler is not None and scaler.is_enabled()
    scale = scaler.get_scale() if scaling else 1.0
    if scaling:
        scaler.unscale_(optimizer)  # true gradients before the norm is read or clipped
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norm = float(clip_grad_norm(params, clip, group=clip_group))  # the step's one host sync
    if scaling:
        scaler.step(optimizer)  # skipped by the scaler itself when unscale_ found inf/nan
        scaler.update()  # back off after inf/nan, grow after growth_interval clean steps in a row
        skipped = scaler.get_scale() < scale
    else:
        skipped = not math.isfinite(norm)
        if not skipped:
            optimizer.step()
    return metrics, StepStats(grad_norm=norm, skipped=skipped, scale=scale, scaled=scaling)


step_amp = train_step  # the old name, until every recipe calls train_step


def micro_batch_groups(loader: Iterable, k: int, *, device: torch.device) -> Iterator[list]:
    """The loader's batches K at a time, moved to `device`; an incomplete group at the end is dropped."""
    group = []
    for batch in loader:
        group.append(_to_device(batch, device))
        if len(group) == k:
            yield group
            group = []
