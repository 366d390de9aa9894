"""torch's pipeline schedules on core.pipeline's stages: the pipeline recipe's options and what a job may refuse before
launch, the last stage's loss, the step (schedule.step, then the gradients averaged over the data-parallel pipelines
and clipped over the stages), the evaluation (schedule.eval), and the stages' weights gathered on rank 0.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from core.kernel.job import Options, RecipeError, option
from core.kernel.seams import LOSS_CHECKS
from core.kernel.train import IGNORE, Tally, make_loader, metrics, summarize, to_device, total_steps

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


@dataclass(frozen=True)
class Pipelining(Options):
    title = "pipeline parallelism"
    pp: int = option(0, "ranks per pipeline (0: all of them); the rest is data parallel")
    schedule: str = option("1f1b", "pipeline schedule", choices=SCHEDULES)
    microbatches: int = option(4, "micro-batches per batch (must divide the batch size)", low=1)


@dataclass(frozen=True)
class StagePrecision(Options):
    title = "mixed precision"
    precision: str = option(
        "fp32", "compute precision (bf16: the stages' forwards under autocast)", choices=("fp32", "bf16")
    )


@dataclass(frozen=True)
class StageAccumulation(Options):
    title = "gradient accumulation and clipping"
    accum: int = option(1, "micro-batches per optimizer step (accumulation)", low=1)
    clip: float = option(0.0, "clip the global gradient norm to this (0: off)", check=lambda v: v >= 0, fix="use 0+")


def check_pipeline(
    *, world_size: int, pp: int, schedule: str, num_blocks: int, batch_size: int, microbatches: int
) -> None:
    """Everything about a pipeline job that can be refused before any process group exists (`schedule`: one of
    SCHEDULES, as the option's choices hold it)."""
    if pp < 1 or world_size % pp:
        raise RecipeError(
            f"--pp {pp}: the world size {world_size} must be a multiple of the pipeline stages; "
            f"use --pp {world_size} (or a divisor of it)"
        )
    stages = pp * (2 if schedule == "interleaved1f1b" else 1)
    if num_blocks < stages:
        raise RecipeError(
            f"the model has {num_blocks} blocks, fewer than the {stages} pipeline stages "
            f"({schedule} on {pp} ranks); use fewer ranks per pipeline (--pp) or a deeper model"
        )
    if microbatches < 1 or batch_size % microbatches:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        near = min(divisors, key=lambda d: (abs(d - microbatches), d))
        raise RecipeError(
            f"--microbatches {microbatches}: must divide --batch-size {batch_size} (e.g. --microbatches {near})"
        )
    if schedule == "1f1b" and microbatches < pp:
        raise RecipeError(f"--microbatches {microbatches}: 1f1b needs at least one per stage ({pp}); use {pp} or more")
    rounds = max(1, microbatches // pp)  # torch's interleaved schedule runs the micro-batches in equal rounds
    if schedule == "interleaved1f1b" and microbatches % rounds:
        raise RecipeError(
            f"--microbatches {microbatches}: interleaved1f1b on {pp} ranks needs a multiple of {pp} "
            f"(or fewer than {2 * pp}); use {pp * rounds}"
        )


def pipeline_loaders(cfg, row, train_set, val_set, collate_fn) -> tuple:
    """(train loader, val loader, optimizer steps) of one pipeline's share (`row`: its dp rank and size): the kernel's
    loaders, the training one without a smaller last batch (the schedule cuts each batch into equal micro-batches),
    --accum of its batches a step."""
    kernel = make_loader(train_set, row, batch_size=cfg.batch_size, collate_fn=collate_fn, seed=cfg.seed)
    options = {k: getattr(kernel, k) for k in ("sampler", "generator", "num_workers", "pin_memory", "collate_fn")}
    train = DataLoader(train_set, cfg.batch_size, drop_last=True, persistent_workers=kernel.num_workers > 0, **options)
    val = make_loader(val_set, row, batch_size=cfg.batch_size, collate_fn=collate_fn, train=False)
    batches = total_steps(train, epochs=1, max_steps=0)  # refuses a share of less than one batch
    if batches < cfg.accum:
        raise RecipeError(
            f"--batch-size {cfg.batch_size} --accum {cfg.accum}: an epoch has only {batches} whole micro-batches per "
            f"rank; use --accum {batches} or less"
        )
    steps = cfg.epochs * (batches // cfg.accum)
    return train, val, min(steps, cfg.max_steps) if cfg.max_steps else steps


def batch_groups(loader, k: int, *, device: torch.device):
    """The loader's batches K at a time (--accum: one schedule run), on `device`; a short last group is dropped."""
    batches = iter(loader)
    while len(group := [to_device(batch, device) for batch in itertools.islice(batches, k)]) == k:
        yield group


class TokenLoss:
    """The last stage's loss, every counted target of the global batch weighing the same (core.exact_loss's rule,
    for a schedule): a micro-batch's cross-entropy SUMMED over its counted targets (not -100), divided by
    `normalizer`, the global batch's counted targets over the dp pipelines whose gradients are averaged.
    step_pipeline sets it every step and the schedule is built with scale_grads=False, so nothing else divides:
    a mean per micro-batch would weigh a micro-batch with fewer counted targets more, and one with none is 0/0.
    evaluate_pipeline sets 1: the losses are then plain sums. logits (..., classes)."""

    normalizer = torch.ones(())  # each instance's own once step_pipeline or evaluate_pipeline sets it

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for check in LOSS_CHECKS:  # output[..., t] against target[..., t], as the kernel's loss compares them
            check(logits, targets)
        flat, total = logits.flatten(0, -2).float(), targets.flatten()
        summed = nn.functional.cross_entropy(flat, total, ignore_index=IGNORE, reduction="sum")
        return summed / self.normalizer.to(summed.device)


def build_schedule(name: str, stages: list, *, microbatches: int, loss_fn: TokenLoss):
    """torch's schedule for `name`, calling `loss_fn` on the last stage. scale_grads=False: the summed
    micro-batch gradients are the step's as they are, the loss having divided by the global count."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if name == "interleaved1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    return kind(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def gather_state_dict(stages: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """Every stage's tensors merged, on every rank, into the whole model's state dict (a collective): stage keys are
    the model's own, so the merge is a dict union (data-parallel replicas of a stage hold equal tensors)."""
    mine = {k: v.detach().cpu() for stage in stages for k, v in stage.state_dict().items()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def average_gradients(params: Sequence[nn.Parameter], *, group) -> None:
    """Data parallel across pipeline replicas: average each stage's gradients over `group` (None: no replicas)."""
    size = dist.get_world_size(group) if group is not None else 1
    if size > 1:
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)  # gloo has no AVG: sum, then divide
                p.grad /= size


@torch.no_grad()
def clip_over_stages(params: list[nn.Parameter], max_norm: float, *, group) -> torch.Tensor:
    """The norm of the gradients of all stages, each rank holding its own (sqrt of the sum of their squares over
    `group`), and the gradients clipped to `max_norm` by it (0: not clipped)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if group is not None and dist.get_world_size(group) > 1:  # disjoint stages: sqrt(sum of squares)
        norm = norm.pow(2.0)
        dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=group)
        norm = norm.pow(1.0 / 2.0)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, norm)
    return norm


def step_pipeline(
    schedule,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    loss_fn: TokenLoss,
    optimizer: torch.optim.Optimizer,
    holds_last: bool,
    precision: str = "fp32",
    clip: float = 0.0,
    dp_group=None,
    pp_group=None,
) -> tuple[dict[str, torch.Tensor], float]:
    """One optimizer step through the pipeline. Every rank passes the whole batch (the first stage reads the inputs,
    the last the targets); the schedule cuts it into micro-batches and sums their gradients, each micro-batch's loss
    divided by the global batch's counted targets (`loss_fn`: one all-reduce over dp_group), so the step is the
    whole global batch's. --accum K: K batches to a schedule built for K x --microbatches, run as one. Then the
    gradients are averaged over the dp pipelines (dp_group), their norm taken over all stages (pp_group) and
    clipped; a step whose gradient norm is not finite is not taken. precision "bf16": the forwards under autocast.
    Returns the batch's metric sums (zeros but on the last stage) and the gradient norm."""
    inputs, targets = (torch.cat(parts) for parts in zip(*micro_batches))
    if targets.is_floating_point():  # every rank holds the targets: all refuse at once, none waits for another
        raise RecipeError(
            f"pipeline's loss is cross-entropy over class indices; these targets are {targets.dtype} (soft labels or "
            f"regression): give int64 class indices (-100 ignored), or train with ddp_amp or fsdp (--loss mse)"
        )
    dp = dist.get_world_size(dp_group) if dp_group is not None else 1
    counted = targets.ne(IGNORE).sum().double()  # this pipeline's counted targets; every rank holds the targets
    if dp > 1:
        dist.all_reduce(counted, group=dp_group)
    loss_fn.normalizer = (counted.clamp(min=1) / dp).float()  # DDP's rule: the dp average below divides by dp
    optimizer.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    bf16 = precision == "bf16"  # the weights stay fp32 either way
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16 if bf16 else None, enabled=bf16):
        outputs = schedule.step(inputs, target=targets, losses=losses)  # forwards and backwards, stage to stage
    params = [p for group in optimizer.param_groups for p in group["params"]]
    average_gradients(params, group=dp_group)
    norm = float(clip_over_stages(params, clip, group=pp_group))  # the step's one host sync
    if math.isfinite(norm):
        optimizer.step()
    if not holds_last:  # nothing to add to the job's sums, under the keys the kernel's Tally reads
        zero = torch.zeros((), dtype=torch.float64, device=inputs.device)
        return {"loss_sum": zero, "count": zero, "samples": zero}, norm
    loss_sum = torch.stack(losses).detach().double().sum() * loss_fn.normalizer.double()  # back to a plain sum
    return metrics(outputs, targets, loss_sum, samples=len(targets), shift=False) | {"loss_sum": loss_sum}, norm


@torch.no_grad()
def evaluate_pipeline(
    schedule, loader, *, stages: Sequence[nn.Module], loss_fn: TokenLoss, accum: int, holds_last: bool, device
) -> dict:
    """Validation loss and accuracy over every sample, forward only through the schedule, this rank's `stages` in
    eval mode. The schedule runs groups of one size (accum batches): the smaller last group is filled up with copies
    of its first sample whose targets are -100, counted by no sum. Sums all-reduced once at the end."""
    if loader is None:
        return {}
    tally, loss_fn.normalizer, size = Tally(device), torch.ones(()), loader.batch_size * accum
    for stage in stages:
        stage.eval()
    batches = iter(loader)
    while group := [to_device(batch, device) for batch in itertools.islice(batches, accum)]:
        inputs, targets = (torch.cat(parts) for parts in zip(*group))
        real = len(inputs)
        if real < size:  # the schedule needs its micro-batches whole: pad, uncounted
            inputs = torch.cat([inputs, inputs[:1].expand(size - real, *inputs.shape[1:])])
            targets = torch.cat([targets, torch.full_like(targets[:1], IGNORE).expand(size - real, *targets.shape[1:])])
        losses: list[torch.Tensor] = []
        outputs = schedule.eval(inputs, target=targets, losses=losses)
        if holds_last:
            loss_sum = torch.stack(losses).double().sum()
            sums = metrics(outputs[:real], targets[:real], loss_sum, samples=real, shift=False)
            tally.add(sums | {"loss_sum": loss_sum})
    for stage in stages:
        stage.train()  # the stages train between evaluations
    return summarize(tally.reduce(), prefix="val_")
