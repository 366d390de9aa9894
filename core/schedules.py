"""torch's pipeline schedules on core.pipeline's stages: options, refusals, the last stage's loss, step, evaluation."""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from core.kernel.job import Options, RecipeError, option
from core.kernel.seams import fire
from core.kernel.train import IGNORE, Tally, make_loader, metrics, summarize, to_device, total_steps
from core.pipeline import check_pipeline_model, plan_split

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


class Stage(nn.Module):
    """Blocks lo..hi-1 of a model, under their original names: forward = those blocks in order."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        self.blocks = nn.Sequential(OrderedDict((str(i), block) for i, block in blocks.items()))
        self.indices = list(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def split_pipeline(model: nn.Module, *, num_stages: int, stage_index: int, weights: list | None = None) -> Stage:
    """Stage `stage_index` of `num_stages`, cut by plan_split of `weights` (None: the blocks' parameter counts)."""
    check_pipeline_model(model)
    weights = weights or [float(sum(p.numel() for p in block.parameters())) for block in model.blocks]
    sizes = plan_split(weights, num_stages)
    lo = sum(sizes[:stage_index])
    return Stage({i: model.blocks[i] for i in range(lo, lo + sizes[stage_index])})


def root_module(stages: list[nn.Module]) -> nn.Module:
    """One module for a pipeline rank's stages, their blocks under their own names: what its checkpoints take."""
    root, blocks = nn.Module(), nn.Module()
    for stage in stages:
        for name, block in stage.blocks.named_children():
            blocks.add_module(name, block)
    root.add_module("blocks", blocks)
    return root


def check_pipeline(
    *, world_size: int, pp: int, schedule: str, num_blocks: int, batch_size: int, microbatches: int
) -> None:
    """Everything about a pipeline job that can be refused before any process group exists."""
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
    """(train loader, val loader, optimizer steps) of one pipeline (`row`: its dp rank), no smaller last batch."""
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
    """The last stage's cross-entropy SUMMED over counted targets over `normalizer`: every target weighs the same."""

    normalizer = torch.ones(())  # step_pipeline's global count over dp (scale_grads=False); evaluate_pipeline's 1

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        fire(
            "loss_checks", logits, targets
        )  # output[..., t] against target[..., t], as the kernel's loss compares them
        flat, total = logits.flatten(0, -2).float(), targets.flatten()
        summed = nn.functional.cross_entropy(flat, total, ignore_index=IGNORE, reduction="sum")
        return summed / self.normalizer.to(summed.device)


def build_schedule(name: str, stages: list, *, microbatches: int, loss_fn: TokenLoss):
    """torch's schedule for `name`; scale_grads=False: the loss already divided by the global count."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if name == "interleaved1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    return kind(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def gather_state_dict(stages: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """Every stage's tensors merged into the whole model's state dict, on every rank (a collective)."""
    mine = {k: v.detach().cpu() for stage in stages for k, v in stage.state_dict().items()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


@torch.no_grad()
def clip_over_stages(params: list[nn.Parameter], max_norm: float, *, group) -> torch.Tensor:
    """The norm of all stages' gradients (each rank holds its own, summed as squares over `group`), clipped to it."""
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
    """One optimizer step of the whole global batch through the schedule: (metric sums, gradient norm)."""
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
    for p in params if dp > 1 else []:  # data parallel across pipeline replicas: average each stage's gradients
        if p.grad is not None:
            dist.all_reduce(p.grad, group=dp_group)  # gloo has no AVG: sum, then divide
            p.grad /= dp
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
    """Validation loss and accuracy over every sample, forward only through the schedule (a short group padded)."""
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
