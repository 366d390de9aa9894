"""torch's pipeline schedules on core.pipeline's stages: options, refusals, the last stage's loss, step, evaluation."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from core.kernel.job import Options, RecipeError, option
from core.kernel.seams import fire
from core.kernel.train import IGNORE, Tally, metrics, summarize, to_device
from core.pipeline import check_pipeline_model, plan_split


@dataclass(frozen=True)
class Pipelining(Options):
    """pipeline parallelism, precision, accumulation"""

    pp: int = option(0, "ranks per pipeline (0: all of them); the rest is data parallel")
    schedule: str = option("1f1b", "pipeline schedule", choices=("gpipe", "1f1b", "interleaved1f1b"))
    microbatches: int = option(4, "micro-batches per batch (must divide the batch size)", low=1)
    precision: str = option("fp32", "compute precision (bf16: the stages under autocast)", choices=("fp32", "bf16"))
    accum: int = option(1, "micro-batches per optimizer step (accumulation)", low=1)
    clip: float = option(0.0, "clip the global gradient norm to this (0: off)", check=lambda v: v >= 0, fix="use 0+")


class Stage(nn.Sequential):
    """Blocks of a model under their original names (`indices`): forward = those blocks in order."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__(OrderedDict(blocks=nn.Sequential(OrderedDict((str(i), b) for i, b in blocks.items()))))
        self.indices = list(blocks)


def split_pipeline(model: nn.Module, *, num_stages: int, stage_index: int, weights: list | None = None) -> Stage:
    """Stage `stage_index` of `num_stages`, cut by plan_split of `weights` (None: the blocks' parameter counts)."""
    check_pipeline_model(model)
    sizes = plan_split(weights or [float(sum(p.numel() for p in b.parameters())) for b in model.blocks], num_stages)
    return Stage({i: model.blocks[i] for i in range(sum(sizes[:stage_index]), sum(sizes[: stage_index + 1]))})


def root_module(stages: list[Stage]) -> Stage:
    """One module for a pipeline rank's stages, their blocks under their own names: what its checkpoints take."""
    return Stage({i: block for stage in stages for i, block in zip(stage.indices, stage.blocks)})


def check_pipeline(*, world_size, pp, schedule, num_blocks, batch_size, microbatches) -> None:
    """Everything about a pipeline job that can be refused before any process group exists."""
    said = f"--microbatches {microbatches}:"  # the start of the micro-batch refusals
    if pp < 1 or world_size % pp:
        fix = "use a divisor of it"
        raise RecipeError(f"--pp {pp}: the world size {world_size} must be a multiple of the pipeline stages; {fix}")
    if num_blocks < (stages := pp * (2 if schedule == "interleaved1f1b" else 1)):
        raise RecipeError(f"the model has {num_blocks} blocks, fewer than the {stages} pipeline stages; lower --pp")
    if batch_size % microbatches:
        raise RecipeError(f"{said} must divide --batch-size {batch_size}; use a divisor of it")
    if schedule == "1f1b" and microbatches < pp:
        raise RecipeError(f"{said} 1f1b needs at least one per stage ({pp}); use {pp} or more")
    # torch's interleaved schedule runs the micro-batches in equal rounds
    if schedule == "interleaved1f1b" and microbatches % (rounds := max(1, microbatches // pp)):
        raise RecipeError(f"{said} interleaved1f1b on {pp} ranks needs a multiple of {pp}; use {pp * rounds}")


class TokenLoss:
    """The last stage's cross-entropy SUMMED over counted targets over `normalizer`: every target weighs the same."""

    normalizer = torch.ones(())  # step_pipeline's global count over dp (scale_grads=False); evaluate_pipeline's 1

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        fire("loss_checks", logits, targets)  # output[..., t] against target[..., t], as the kernel's loss compares
        flat = logits.flatten(0, -2).float()
        summed = nn.functional.cross_entropy(flat, targets.flatten(), ignore_index=IGNORE, reduction="sum")
        return summed / self.normalizer.to(summed.device)


def build_schedule(name: str, stages: list, *, microbatches: int, loss_fn: TokenLoss):
    """torch's schedule for `name` (interleaved: all of a rank's stages); scale_grads=False: the loss is divided."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B}[name]
    runs = stages if name == "interleaved1f1b" else stages[0]
    return kind(runs, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def gather_state_dict(stages: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """Every stage's tensors merged into the whole model's state dict, on every rank (a collective)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.detach().cpu() for stage in stages for k, v in stage.state_dict().items()})
    return {k: v for part in parts for k, v in part.items()}


def clip_over_stages(params: list[nn.Parameter], max_norm: float, *, group) -> torch.Tensor:
    """The norm of all stages' gradients (each rank holds its own, summed as squares over `group`), clipped to it."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if group is not None and dist.get_world_size(group) > 1:  # disjoint stages: sqrt(sum of squares)
        dist.all_reduce(norm := norm.pow(2.0), op=dist.ReduceOp.SUM, group=group)
        norm = norm.pow(1.0 / 2.0)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def step_pipeline(
    schedule, batch, *, loss_fn, optimizer, holds_last, precision="fp32", clip=0.0, dp_group=None, pp_group=None
) -> tuple[dict[str, torch.Tensor], float]:
    """One optimizer step of the whole (input, target) batch through the schedule: (metric sums, gradient norm)."""
    inputs, targets = batch
    if targets.is_floating_point():  # every rank holds the targets: all refuse at once, none waits for another
        kind = f"these targets are {targets.dtype} (soft labels or regression)"
        fix = "give int64 class indices (-100 ignored), or train with ddp_amp or fsdp (--loss mse)"
        raise RecipeError(f"pipeline's loss is cross-entropy over class indices; {kind}: {fix}")
    dp = dist.get_world_size(dp_group) if dp_group is not None else 1
    counted = targets.ne(IGNORE).sum().double()  # this pipeline's counted targets; every rank holds the targets
    if dp > 1:
        dist.all_reduce(counted, group=dp_group)
    loss_fn.normalizer = (counted.clamp(min=1) / dp).float()  # DDP's rule: the dp average below divides by dp
    optimizer.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):  # weights stay fp32
        outputs = schedule.step(inputs, target=targets, losses=losses)  # forwards and backwards, stage to stage
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for grad in [p.grad for p in params if p.grad is not None] if dp > 1 else []:  # average over the pipelines
        dist.all_reduce(grad, group=dp_group)  # gloo has no AVG: sum, then divide
        grad /= dp
    norm = float(clip_over_stages(params, clip, group=pp_group))  # the step's one host sync
    if math.isfinite(norm):
        optimizer.step()
    if not holds_last:  # nothing to add to the job's sums, under the keys the kernel's Tally reads
        return dict.fromkeys(("loss_sum", "count", "samples"), targets.new_zeros((), dtype=torch.float64)), norm
    loss_sum = torch.stack(losses).detach().double().sum() * loss_fn.normalizer.double()  # back to a plain sum
    return metrics(outputs, targets, loss_sum, samples=len(targets), shift=False) | {"loss_sum": loss_sum}, norm


@torch.no_grad()
def evaluate_pipeline(schedule, loader, *, model: nn.Module, loss_fn: TokenLoss, holds_last: bool, device) -> dict:
    """Validation loss and accuracy over every sample, forward only through the schedule (a short batch padded)."""
    if loader is None:
        return {}
    tally, loss_fn.normalizer, size = Tally(device), torch.ones(()), loader.batch_size
    model.eval()  # root_module's: every stage's blocks
    for batch in loader:
        (inputs, targets), real = to_device(batch, device), len(batch[0])
        if real < size:  # the schedule needs its micro-batches whole: pad, uncounted
            inputs = torch.cat([inputs, inputs[:1].expand(size - real, *inputs.shape[1:])])
            targets = torch.cat([targets, torch.full_like(targets[:1], IGNORE).expand(size - real, *targets.shape[1:])])
        losses: list[torch.Tensor] = []
        outputs = schedule.eval(inputs, target=targets, losses=losses)
        if holds_last:
            loss_sum = torch.stack(losses).double().sum()
            sums = metrics(outputs[:real], targets[:real], loss_sum, samples=real, shift=False)
            tally.add(sums | {"loss_sum": loss_sum})
    model.train()  # the stages train between evaluations
    return summarize(tally.reduce(), prefix="val_")
