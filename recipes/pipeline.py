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
activations and gradients between neighbouring ranks. The loss is computed on the last stage: each
micro-batch's sum over its counted targets (not -100) divided by the global batch's count, so a step
equals one process's on the whole batch whatever the micro-batches hold. A smaller last batch is
dropped (the schedule needs equal micro-batches). --accum K runs K batches as one schedule of K x
--microbatches micro-batches. With W = pp x dp ranks, dp pipelines each train on their own share of
the data and average their gradients. Global batch: --batch-size x dp x --accum. --clip takes the
norm over all stages; --precision bf16 runs the stages under autocast. Checkpoints are sharded
(every rank writes its stages).
"""

import dataclasses
import itertools
import os
from dataclasses import dataclass

import torch
from torch.distributed.pipelining import PipelineStage

from core import (
    amp,
    data,
    dcp,
    dist,
    folder,
    meter,
    models,
    parallel,
    pipeline,
    schedules,
    steps,
    trackers,
    weights,
)
from core.amp import Accumulation
from core.config import Checkpointing, Training, cli_main, with_default
from core.kernel.loader import seed_all, set_epoch
from core.kernel.log import say
from core.kernel.options import RecipeError, at_least, option
from core.kernel.pg import cleanup_pg
from core.parallel import ShardedPrecision
from core.plugins.balance import block_times
from core.plugins.hf import HFExport, write_hf_folder
from core.plugins.init_from import InitFrom, load_weights


@dataclass(frozen=True)
class Config(Training, Checkpointing, ShardedPrecision, Accumulation, trackers.Tracking, InitFrom, HFExport):
    """The shared options and the pipeline's shape; the tiny GPT on the embedded text by default."""

    title = "pipeline parallelism"

    model: str = with_default(Training, "model", "gpt")
    data: str = with_default(Training, "data", "text")
    epochs: int = with_default(Training, "epochs", 1)
    lr: float = with_default(Training, "lr", 3e-3)
    pp: int = option(0, "ranks per pipeline (0: all of them); the rest is data parallel", **at_least(0))
    schedule: str = option("1f1b", "pipeline schedule", choices=schedules.SCHEDULES)
    microbatches: int = option(4, "micro-batches per batch (must divide the batch size)", **at_least(1))
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
        blocks = pipeline.check_pipeline_model(models.build_model(cfg.model))
    shape = dict(world_size=world, pp=cfg.pp or world, schedule=cfg.schedule, num_blocks=blocks)
    for k in sorted({1, cfg.accum}):  # --accum K runs a schedule of K x --microbatches micro-batches
        schedules.check_pipeline(**shape, batch_size=cfg.batch_size * k, microbatches=cfg.microbatches * k)


def main(cfg: Config) -> dict:
    check(cfg)  # a copy has no pre-check: the same refusals here
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; alone: a world of one
    try:
        return train(cfg, topo)
    finally:
        cleanup_pg()


def train(cfg: Config, topo: dist.Topology) -> dict:
    totals = meter.Meter(topo.device)  # the loss and accuracy of each log window, summed over the ranks
    # resumed and finished, with the lengths it finished with: nothing is touched (larger ones: it trains longer)
    if done := folder.finished(cfg, topo, recipe="pipeline", header=dcp.read_metadata):
        return done
    device_mesh = parallel.build_mesh(topo, mesh(cfg, topo.world_size))
    dp, pp, pp_rank = device_mesh["dp"].size(), device_mesh["pp"].size(), device_mesh["pp"].get_local_rank()
    dp_rank, global_batch = device_mesh["dp"].get_local_rank(), cfg.batch_size * dp * cfg.accum

    # Build: the same weights on every rank, cut into stages; this rank keeps its own (two, looped, for
    # interleaved1f1b), each wrapped in a PipelineStage that sends and receives between neighbouring ranks.
    seed_all(cfg.seed)  # torch's, Python's and numpy's generators: the same weights and data on every rank
    train_set, val_set, collate = data.build_data(cfg.data)
    model = models.build_model(cfg.model)
    if cfg.init_from:  # the whole weights into the plain model: each rank then keeps its stages of them
        load_weights(model, cfg.init_from)
    per_rank = 2 if cfg.schedule == "interleaved1f1b" else 1
    num_stages, stage_ids = pp * per_rank, [pp_rank + v * pp for v in range(per_rank)]
    split = dict(num_stages=num_stages)  # stages of about equal parameter count
    if cfg.balance == "time":  # of equal measured time instead: the blocks timed on one micro-batch of inputs
        sample = torch.stack([train_set[i][0] for i in range(cfg.batch_size // cfg.microbatches)])
        split["weights"] = dist.broadcast_object(block_times(model, sample))  # rank 0's
    stages = [pipeline.split_pipeline(model, stage_index=i, **split).to(topo.device) for i in stage_ids]
    pp_group, dp_group = device_mesh["pp"].get_group(), device_mesh["dp"].get_group()
    runners = [PipelineStage(m, i, num_stages, topo.device, group=pp_group) for m, i in zip(stages, stage_ids)]
    micro = cfg.microbatches * cfg.accum  # --accum K: K batches as one schedule run
    loss_fn = schedules.TokenLoss()  # on the last stage: summed cross-entropy over the global batch's counted targets
    schedule = schedules.build_schedule(cfg.schedule, runners, microbatches=micro, loss_fn=loss_fn)
    holds_last = stage_ids[-1] == num_stages - 1
    torch.manual_seed(cfg.seed + dp_rank)  # from here each pipeline draws its own dropout, as one process would
    my_row = dataclasses.replace(topo, rank=dp_rank, world_size=dp)  # the stages of one pipeline share its batches
    train_loader = data.make_loader(  # the schedule cuts every batch into equal micro-batches: no smaller last one
        train_set, my_row, batch_size=cfg.batch_size, seed=cfg.seed, collate_fn=collate, drop_last=True
    )
    val_loader = data.make_loader(val_set, my_row, batch_size=cfg.batch_size, train=False, collate_fn=collate)
    total = data.total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps, accum=cfg.accum)
    optimizer = torch.optim.AdamW([p for m in stages for p in m.parameters()], lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))

    # The run folder, new or resumed, the checkpoint's state (every rank reads its stages), and the trackers.
    checkpoints = dict(newest=dcp.newest_good, header=dcp.read_metadata)  # how a resume finds and reads one
    run = folder.open_run(cfg, topo, recipe="pipeline", global_batch=global_batch, dp=dp, **checkpoints)
    start = dcp.load_checkpoint(run, model=pipeline.root_module(stages), optimizer=optimizer, scheduler=scheduler)
    meter.carry_window(totals, start["window"], writer=run.writer)  # the log window open at the checkpoint
    run = trackers.attach(run, cfg, step=start["step"], header=dcp.read_metadata)
    say(run, f"pipeline: {cfg.schedule}, {num_stages} stages on pp={pp} x dp={dp} ranks, {micro} micro-batches")

    # Train. Every rank calls the schedule with the whole batch; the first stage reads the inputs, the last the targets.
    step, skipped, evaluation = start["step"], start["skipped"], {}
    step_options = dict(loss_fn=loss_fn, optimizer=optimizer, holds_last=holds_last, precision=cfg.precision)
    step_options |= dict(clip=cfg.clip, dp_group=dp_group, pp_group=pp_group)
    eval_options = dict(stages=stages, loss_fn=loss_fn, accum=cfg.accum, holds_last=holds_last, device=topo.device)
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        set_epoch(train_loader, epoch, consumed=consumed)
        groups = amp.micro_batch_groups(train_loader, cfg.accum, device=topo.device)  # an incomplete tail is dropped
        for micro_batches in itertools.islice(groups, total - step):
            # schedule.step: forwards and backwards, stage to stage
            metrics, grad_norm = schedules.step_pipeline(schedule, micro_batches, **step_options)
            step, consumed = step + 1, consumed + global_batch
            skipped += steps.check_finite(grad_norm, step=step, on_nonfinite=cfg.on_nonfinite, clips=True)
            scheduler.step()  # after the check: a stop at step 1 prints the error line alone
            totals.add(metrics)  # the last stage's; the other stages add zeros
            if step % cfg.log_every == 0 or step == total:  # a collective: every rank reads at the same step
                numbers = {"lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm, "skipped": skipped}
                meter.log_train(run, totals, step=step, total=total, epoch=epoch, **numbers)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == total:  # the last: it can go on
                window = meter.open_window(totals)  # its sums so far: a resume goes on with them
                progress = dict(epoch=epoch, samples=consumed, step=step, skipped=skipped, window=window)
                with meter.paused(totals):  # every rank writes its own stages
                    state = {"model": pipeline.root_module(stages), "optimizer": optimizer, "scheduler": scheduler}
                    dcp.save_checkpoint(run, **state, progress=progress, keep=cfg.keep)
        with meter.paused(totals):  # forward only, through the same schedule: K batches a run, the smaller last one too
            evaluation = schedules.evaluate_pipeline(schedule, val_loader, **eval_options)
        meter.log_eval(run, evaluation, step=step, epoch=epoch)

    # The stages' tensors, merged on rank 0 into the plain model's state dict and written as one file (and a
    # Hugging Face folder for a transformers model: a meta-device model lends its config and class).
    full = schedules.gather_state_dict(stages)
    saved = weights.write_weights(run, full)
    with torch.device("meta"):
        lender = models.build_model(cfg.model)
    write_hf_folder(run, lender, full, attr=cfg.hf_attr, max_shard_mb=cfg.hf_shard_mb)
    summary = meter.log_summary(run, totals, evaluation, steps=step, skipped=skipped, weights=saved, pp=pp, dp=dp)
    trackers.close(run)
    return summary


if __name__ == "__main__":
    cli_main(main, Config)
