"""pipeline: ddp_amp's loop with the model cut into stages (torch.distributed.pipelining: GPipe, 1F1B, interleaved).

    ./launch_single_node.sh pipeline --schedule 1f1b --microbatches 8
    ./launch_single_node.sh pipeline --schedule interleaved1f1b --microbatches 4 --precision bf16
    NPROC_PER_NODE=4 ./launch_single_node.sh pipeline --pp 2     # 2 stages x 2 data-parallel replicas
    torchrun --standalone --nproc-per-node 2 -m recipes run pipeline --accum 2 --clip 1.0 --ckpt-every 50

split_pipeline cuts the model's blocks into --pp contiguous stages of about equal parameter count
(--balance time: of equal measured time), one per rank (interleaved1f1b: two per rank, looped, so
rank r holds stages r and r + pp). Each batch is cut into --microbatches equal micro-batches that
flow through the stages; the schedule decides the order of forwards and backwards (GPipe: all
forwards then all backwards; 1F1B: one of each in turn, holding fewer activations) and sends
activations and gradients between neighbouring ranks. The loss is computed on the last stage, one
mean per micro-batch; the schedule divides the summed gradients by the micro-batch count, so a step
equals one process's on the whole batch. --accum K runs K batches as one schedule of K x
--microbatches micro-batches. With W = pp x dp ranks, dp pipelines each train on their own share of
the data and average their gradients. Global batch: --batch-size x dp x --accum. --clip takes the
norm over all stages; --precision bf16 runs the stages under autocast. Checkpoints are sharded
(every rank writes its stages) and resume with the same --pp and schedule.
"""

import dataclasses
import functools
import itertools
import math
import os
from dataclasses import dataclass

import torch
from torch.distributed.pipelining import PipelineStage

from core import data, dist, models, parallel, pipeline, steps
from core.config import (
    Accumulation,
    Checkpointing,
    RecipeError,
    ShardedPrecision,
    Training,
    cli_main,
    option,
    with_default,
)
from core.sharded_run import ShardedRun


@dataclass(frozen=True)
class Config(Training, Checkpointing, ShardedPrecision, Accumulation):
    """The shared options and the pipeline's shape; the tiny GPT on the embedded text by default."""

    title = "pipeline parallelism"

    model: str = with_default(Training, "model", "gpt")
    data: str = with_default(Training, "data", "text")
    epochs: int = with_default(Training, "epochs", 1)
    lr: float = with_default(Training, "lr", 3e-3)
    pp: int = option(
        0,
        "ranks per pipeline (0: all of them); the rest is data parallel",
        check=lambda v: 0 <= v <= 2**16,
        fix="use 0 (all ranks) or a divisor of the world size",
    )
    schedule: str = option("1f1b", "pipeline schedule", choices=pipeline.SCHEDULES)
    microbatches: int = option(
        4, "micro-batches per batch (must divide the batch size)", check=lambda v: v >= 1, fix="use 1 or more"
    )
    balance: str = option(
        "params", "balance the stages by parameter count or measured time", choices=("params", "time")
    )


def mesh(cfg: Config, world_size: int) -> dict[str, int]:
    """The device mesh: dp pipelines of pp ranks each."""
    pp = cfg.pp or world_size
    return {"dp": max(world_size // pp, 1), "pp": pp}


def check(cfg: Config) -> None:
    """Everything refusable, before any process starts: the loss, the mesh and the model's blocks."""
    if cfg.loss not in ("auto", "ce"):  # the schedule calls loss_fn(logits, targets) on the last stage
        raise RecipeError(f"--loss {cfg.loss}: pipeline computes cross-entropy on the last stage; use --loss ce")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with torch.device("meta"):  # shapes only: every parameter must be in model.blocks
        blocks = pipeline.check_pipeline_model(models.build_model(cfg.model), num_stages=1)
    for k in sorted({1, cfg.accum}):  # --accum K runs a schedule of K x --microbatches micro-batches
        pipeline.check_pipeline(
            world_size=world,
            pp=cfg.pp or world,
            schedule=cfg.schedule,
            num_blocks=blocks,
            batch_size=cfg.batch_size * k,
            microbatches=cfg.microbatches * k,
        )


def main(cfg: Config) -> dict:
    check(cfg)
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, LOCAL_RANK, WORLD_SIZE; a world of one without
    try:
        plan = mesh(cfg, topo.world_size)
        global_batch = cfg.batch_size * plan["dp"] * cfg.accum  # the stages of one pipeline share its batch
        with ShardedRun.start(cfg, topo, recipe="pipeline", global_batch=global_batch, mesh=plan) as run:
            return train(cfg, topo, run)
    finally:
        dist.cleanup_pg()


def train(cfg: Config, topo: dist.Topology, run: ShardedRun) -> dict:
    # Data: every stage of one pipeline reads the same batches; the dp pipelines read disjoint shares.
    torch.manual_seed(cfg.seed)  # the same weights on every rank; each keeps its own stages
    train_set, val_set, collate = data.build_data(cfg.data)
    device_mesh = parallel.build_mesh(topo, mesh(cfg, topo.world_size))
    dp, pp, pp_rank = device_mesh["dp"].size(), device_mesh["pp"].size(), device_mesh["pp"].get_local_rank()
    my_row = dataclasses.replace(topo, rank=device_mesh["dp"].get_local_rank(), world_size=dp)
    train_loader = data.make_loader(train_set, my_row, batch_size=cfg.batch_size, seed=cfg.seed, collate_fn=collate)
    val_loader = data.make_loader(val_set, my_row, batch_size=cfg.batch_size, train=False, collate_fn=collate)

    # Build: cut the blocks into stages and keep this rank's (two, looped, for interleaved1f1b).
    model, per_rank = models.build_model(cfg.model), 2 if cfg.schedule == "interleaved1f1b" else 1
    num_stages, stage_ids = pp * per_rank, [pp_rank + v * pp for v in range(per_rank)]
    timed = cfg.balance == "time"  # --balance time measures the blocks on one micro-batch of inputs
    sample = (
        torch.stack([x for x, _ in data.first_samples(train_set, cfg.batch_size // cfg.microbatches)])
        if timed
        else None
    )
    split = dict(num_stages=num_stages, balance=cfg.balance, sample=sample)
    stages = [pipeline.split_pipeline(model, stage_index=i, **split).to(topo.device) for i in stage_ids]
    pp_group, dp_group = device_mesh["pp"].get_group(), device_mesh["dp"].get_group()
    runners = [PipelineStage(m, i, num_stages, topo.device, group=pp_group) for m, i in zip(stages, stage_ids)]
    micro = cfg.microbatches * cfg.accum  # --accum K: K batches as one schedule run
    schedule = pipeline.build_schedule(cfg.schedule, runners, microbatches=micro, loss_fn=steps.cross_entropy)
    holds_last = stage_ids[-1] == num_stages - 1
    optimizer = torch.optim.AdamW([p for m in stages for p in m.parameters()], lr=cfg.lr)
    total = run.total_steps(train_loader, accum=cfg.accum)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    progress = run.resume(model=stages, optimizer=optimizer, scheduler=scheduler)  # every rank reads its stages
    run.print(f"pipeline: {cfg.schedule}, {num_stages} stages on pp={pp} x dp={dp} ranks, {micro} micro-batches")

    # Train. Every rank calls the schedule with the whole batch; the first stage reads the inputs, the last the targets.
    step = progress["step"]
    for epoch in range(progress["epoch"], cfg.epochs):
        if step >= total:  # --max-steps reached; a resumed run that had finished stops here
            break
        data.set_epoch(train_loader, epoch, consumed=run.epoch(epoch))  # resumed mid-epoch: skip what was trained
        batches = steps.micro_batch_groups(train_loader, cfg.accum, device=topo.device)  # an incomplete tail is dropped
        for micro_batches in itertools.islice(batches, total - step):
            metrics, stats = pipeline_step(
                schedule,
                micro_batches,
                optimizer=optimizer,
                holds_last=holds_last,
                precision=cfg.precision,
                clip=cfg.clip,
                dp=dp,
                dp_group=dp_group,
                pp_group=pp_group,
            )
            scheduler.step()
            step += 1
            run.step(step, metrics=metrics, stats=stats, lr=scheduler.get_last_lr()[0], total=total)
            run.checkpoint(step, model=stages, optimizer=optimizer, scheduler=scheduler)  # every rank its stages
        forward_only = functools.partial(  # through the same schedule
            evaluate, schedule, val_loader, accum=cfg.accum, holds_last=holds_last, device=topo.device
        )
        run.evaluate(stages, val_loader, step=step, compute=forward_only)

    # The stages' tensors, merged on rank 0 into the plain model's state dict and written as one file.
    return run.finish(stages, state=pipeline.gather_state_dict(stages), pp=pp, dp=dp)


def pipeline_step(schedule, micro_batches, *, optimizer, holds_last, precision, clip, dp, dp_group, pp_group):
    """One optimizer step: the K micro-batch groups through the schedule as one batch, gradients averaged over the
    dp pipelines, clipped by the norm over all stages; a step whose gradients are not finite is skipped."""
    inputs, targets = (torch.cat(parts) for parts in zip(*micro_batches))
    optimizer.zero_grad(set_to_none=True)
    losses = []
    with steps.autocast(precision, device=inputs.device):
        outputs = schedule.step(inputs, target=targets, losses=losses)  # forwards and backwards, stage to stage
    params = [p for group in optimizer.param_groups for p in group["params"]]
    pipeline.average_gradients(params, group=dp_group, size=dp)
    norm = float(parallel.clip_grad_norm(params, clip, group=pp_group))  # the dp replicas hold equal gradients
    if math.isfinite(norm):
        optimizer.step()
    metrics = steps.batch_metrics(outputs, targets, torch.stack(losses).mean()) if holds_last else {}
    return metrics, steps.StepStats(grad_norm=norm, skipped=not math.isfinite(norm), scale=1.0)


def evaluate(schedule, loader, *, accum: int, holds_last: bool, device: torch.device) -> dict:
    """Validation loss and accuracy over the loader's full batches, K at a time: the schedule's micro-batch count."""
    joined = (tuple(map(torch.cat, zip(*group))) for group in steps.micro_batch_groups(loader, accum, device=device))
    return pipeline.evaluate_pipeline(
        schedule, joined, holds_last=holds_last, device=device, batch_size=loader.batch_size * accum
    )


if __name__ == "__main__":
    cli_main(main, Config, check=check)
