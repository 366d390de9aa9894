"""One training step, evaluation, and metric sums that are reduced over ranks only when read.

Steps return their metrics as tensors on the device: no `.item()` (a host sync) per step.
A `Tally` adds them up and does one all-reduce when a number is actually logged.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from core.data import to_device
from core.dist import reduce_sum


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy for class logits (N, C) and for per-token logits (N, T, C) alike."""
    return nn.functional.cross_entropy(outputs.flatten(0, -2).float(), targets.flatten())


def batch_metrics(outputs: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums, not means, so that ranks with different batch sizes combine exactly."""
    count = torch.tensor(targets.numel(), device=targets.device, dtype=torch.float64)
    return {
        "loss_sum": loss.detach().double() * count,
        "correct": (outputs.detach().argmax(-1) == targets).sum().double(),
        "count": count,
    }


def step_plain(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """One optimizer step on one batch. Under DDP, backward() also averages the gradients."""
    inputs, targets = batch
    optimizer.zero_grad(set_to_none=True)
    outputs = model(inputs)
    loss = loss_fn(outputs, targets)
    loss.backward()
    optimizer.step()
    return batch_metrics(outputs, targets, loss)


class Tally:
    """Running sums of step metrics, kept on the device until `reduce` is called.

    `keys` fixes what is reduced, so a rank that saw no batch still joins the all-reduce.
    """

    def __init__(self, device: torch.device, keys: Iterable[str] = ("loss_sum", "correct", "count")):
        self.device = device
        self.sums = {key: torch.zeros((), dtype=torch.float64, device=device) for key in keys}

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        for key, value in metrics.items():
            self.sums[key] = self.sums[key] + value if key in self.sums else value.double()

    def reduce(self) -> dict[str, float]:
        """Sums over all ranks (one all-reduce), as floats: the same numbers on every rank."""
        keys = sorted(self.sums)
        totals = reduce_sum(torch.stack([self.sums[k].double() for k in keys])).tolist()
        return dict(zip(keys, totals))


def summarize(sums: dict[str, float], *, prefix: str = "") -> dict[str, float]:
    """loss_sum / correct / count sums -> mean loss and accuracy."""
    count = max(sums.get("count", 0.0), 1.0)
    return {f"{prefix}loss": sums.get("loss_sum", 0.0) / count, f"{prefix}acc": sums.get("correct", 0.0) / count}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
) -> dict[str, float]:
    """Loss and accuracy over the whole validation set, every rank's share counted once."""
    was_training = model.training
    model.eval()
    tally = Tally(device)
    for batch in loader:
        inputs, targets = to_device(batch, device)
        outputs = model(inputs)
        tally.add(batch_metrics(outputs, targets, loss_fn(outputs, targets)))
    model.train(was_training)
    return summarize(tally.reduce(), prefix="val_")


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


@contextmanager
def grad_sync(model: nn.Module, *, enabled: bool) -> Iterator[None]:
    """Whether the forward and backward inside reduce gradients across ranks.

    The hook point for accumulation: DDP (also under torch.compile, which forwards attributes to it)
    skips its all-reduce under no_sync() and keeps adding to .grad locally; a model without
    no_sync() has nothing to hold back. Another wrapper passes its own function of this shape to
    `step_amp(sync=...)` (fully_shard's: model.set_requires_gradient_sync(False) ... (True)).
    """
    no_sync = getattr(model, "no_sync", None)
    if enabled or no_sync is None:
        yield
    else:
        with no_sync():
            yield


def accumulate_grads(
    model: nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    sync: Callable[..., AbstractContextManager] = grad_sync,
) -> dict[str, torch.Tensor]:
    """Forward and backward over K micro-batches, adding their gradients up in .grad.

    Gradients are all-reduced once, in the last backward (`sync` holds it off for the first K-1).
    Each micro-batch's mean loss is weighted by its share of the group's samples (1/K when the
    sizes are equal), so the result is the gradient of one batch of K x N x B samples on one process.
    """
    device = micro_batches[0][1].device
    total = sum(targets.numel() for _, targets in micro_batches)
    tally = Tally(device)
    for i, (inputs, targets) in enumerate(micro_batches):
        with sync(model, enabled=i == len(micro_batches) - 1):  # backward must run inside no_sync too
            with autocast(precision, device=device):
                outputs = model(inputs)
                loss = loss_fn(outputs, targets)
            weighted = loss * (targets.numel() / total)
            (weighted if scaler is None else scaler.scale(weighted)).backward()
        tally.add(batch_metrics(outputs, targets, loss))
    return tally.sums


@torch.no_grad()
def clip_grad_norm(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The total norm of all ranks' gradients; when max_norm > 0, scale them so it is at most max_norm.

    "All ranks' gradients" depends on how parameters are laid out:
      replicated (DDP): every rank holds the same averaged gradient, so the local norm is the total;
      DTensor (fully_shard, tensor parallel): torch's norm is a DTensor and full_tensor() reduces it;
      disjoint plain tensors (pipeline stages): pass `group`, the ranks the parameters are split over.
    Every rank gets the same norm, so every rank scales by the same factor.
    """
    parameters = list(parameters)
    norm = get_total_norm([p.grad for p in parameters if p.grad is not None], norm_type=norm_type)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if group is not None and dist.get_world_size(group) > 1:
        if math.isinf(norm_type):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        else:  # p-norms combine as (sum of |g|^p)^(1/p)
            norm = norm.pow(norm_type)
            dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=group)
            norm = norm.pow(1.0 / norm_type)
    if max_norm > 0:
        clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did, as plain numbers (read with the one host sync a step takes)."""

    grad_norm: float  # total norm over all ranks, before clipping; inf or nan when the step was skipped
    skipped: bool  # gradients were not finite, so the parameters were left unchanged
    scale: float  # the loss scale used (1.0 unless fp16)
    scaled: bool = False  # SHIM: fp16 loss scaling on


def step_amp(
    model: nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    clip: float = 0.0,
    clip_group: dist.ProcessGroup | None = None,
    sync: Callable[..., AbstractContextManager] = grad_sync,
) -> tuple[dict[str, torch.Tensor], StepStats]:
    """One optimizer step over K micro-batches: autocast forward, scaled backward, unscale, clip, step.

    Never steps on inf/nan gradients: with fp16 the scaler skips the step and backs its scale off
    (that is routine), otherwise the step is skipped and `StepStats.skipped` says so: the caller decides
    whether that stops the run. Every rank decides alike: it reads the norm of all-reduced gradients.
    """
    optimizer.zero_grad(set_to_none=True)
    metrics = accumulate_grads(model, micro_batches, loss_fn=loss_fn, precision=precision, scaler=scaler, sync=sync)
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


train_step = step_amp  # SHIM (branch steps replaces)


def make_loss(spec: str):  # SHIM (branch steps replaces)
    return cross_entropy


def micro_batch_groups(loader: Iterable, k: int, *, device: torch.device) -> Iterator[list]:
    """The loader's batches K at a time, moved to `device`; an incomplete group at the end is dropped."""
    group = []
    for batch in loader:
        group.append(to_device(batch, device))
        if len(group) == k:
            yield group
            group = []
