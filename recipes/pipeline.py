"""pipeline: ddp_amp's loop with the model cut into stages (torch.distributed.pipelining: GPipe, 1F1B, interleaved).

    ./launch_single_node.sh pipeline --schedule 1f1b --microbatches 8
    ./launch_single_node.sh pipeline --schedule interleaved1f1b --microbatches 4 --precision bf16
    NPROC_PER_NODE=4 ./launch_single_node.sh pipeline --pp 2     # 2 stages x 2 data-parallel replicas
    torchrun --standalone --nproc-per-node 2 -m recipes run pipeline --accum 2 --clip 1.0 --ckpt-every 50

split_pipeline cuts the model's blocks into --pp contiguous stages of about equal parameter count
(--balance time, in a copy made --with balance: of equal measured time), one per rank
(interleaved1f1b: two per rank, looped, so rank r holds stages r and r + pp). Each batch is cut into
--microbatches equal micro-batches that flow through the stages; the schedule decides the order of
forwards and backwards (GPipe: all forwards then all backwards; 1F1B: one of each in turn, holding
fewer activations) and sends activations and gradients between neighbouring ranks. The loss is
computed on the last stage: each micro-batch's sum over its counted targets (not -100) divided by
the global batch's count, so a step equals one process's on the whole batch whatever the
micro-batches hold. A smaller last batch is dropped (the schedule needs equal micro-batches).
--accum K runs K batches as one schedule of K x --microbatches micro-batches. With W = pp x dp
ranks, dp pipelines each train on their own share of the data and average their gradients. Global
batch: --batch-size x dp x --accum. --clip takes the norm over all stages; --precision bf16 runs the
stages under autocast. Checkpoints are sharded (every rank writes its stages).
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

import core.attach  # noqa: F401 - the package runs it with every plug-in; a standalone copy joins those --with names
from core.gpt_builtin import build_gpt, build_text, gpt_defaults
from core.kernel.job import Checkpointing, RecipeError, Training, cli_main, say
from core.kernel.seams import SEAMS, fire
from core.kernel.store import finished, open_run, write_weights
from core.kernel.train import (
    Tally,
    Topology,
    cleanup_pg,
    init_pg,
    log_eval,
    log_summary,
    log_train,
    make_loader,
    not_training,
    to_device,
)
from core.pipeline import STAGE_WEIGHTS, check_pipeline_model
from core.plugins import balance, trackers  # noqa: F401 - pipeline's own plug-ins: --balance, --log-to
from core.schedules import (
    Pipelining,
    TokenLoss,
    build_schedule,
    check_pipeline,
    evaluate_pipeline,
    gather_state_dict,
    root_module,
    split_pipeline,
    step_pipeline,
)
from core.shard_ckpt import load_sharded, save_sharded


def mesh(cfg: Config, world_size: int) -> dict[str, int]:
    """The device mesh: dp pipelines of pp ranks each."""
    return {"dp": max(world_size // (cfg.pp or world_size), 1), "pp": cfg.pp or world_size}


def check(cfg: Config) -> None:
    """Everything refusable, before any process starts: the loss, the mesh and the model's blocks."""
    if getattr(cfg, "loss", "auto") not in ("auto", "ce"):  # the schedule calls loss_fn(logits, targets) at the end
        raise RecipeError(f"--loss {cfg.loss}: pipeline computes cross-entropy on the last stage; use --loss ce")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with torch.device("meta"):  # shapes only: every parameter must be in model.blocks
        blocks = check_pipeline_model(build_gpt(cfg))
    shape = dict(world_size=world, pp=cfg.pp or world, schedule=cfg.schedule, num_blocks=blocks)
    for k in sorted({1, cfg.accum}):  # --accum K runs a schedule of K x --microbatches micro-batches
        check_pipeline(**shape, batch_size=cfg.batch_size * k, microbatches=cfg.microbatches * k)


def main(cfg: Config) -> dict:
    check(cfg)  # a copy has no pre-check: the same refusals here
    topo = init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; alone: a world of one
    try:
        return train(cfg, topo)
    finally:
        cleanup_pg()


def train(cfg: Config, topo: Topology) -> dict:
    if done := finished(cfg, topo, recipe="pipeline"):  # resumed, finished: nothing is touched
        return done
    dims = mesh(cfg, topo.world_size)
    device_mesh = dist.init_device_mesh(topo.device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    dp, pp, pp_rank = dims["dp"], dims["pp"], device_mesh["pp"].get_local_rank()
    dp_rank, global_batch = device_mesh["dp"].get_local_rank(), cfg.batch_size * dp * cfg.accum

    # Build: the same weights on every rank, cut into stages; this rank keeps its own (two, looped, for
    # interleaved1f1b), each wrapped in a PipelineStage that sends and receives between neighbouring ranks.
    torch.manual_seed(cfg.seed)  # the same weights and data on every rank (--data's factory: its own seeds)
    train_set, val_set, collate = build_text(cfg)
    model = build_gpt(cfg)
    fire("after_build", cfg, model)  # the whole weights into the plain model (--init-from): each rank keeps its stages
    per_rank = 2 if cfg.schedule == "interleaved1f1b" else 1
    num_stages, stage_ids = pp * per_rank, [pp_rank + v * pp for v in range(per_rank)]
    # None: the blocks' parameter counts, stages of about equal size; --balance time: of equal measured time
    weights = next(filter(None, (hook(cfg, model, train_set) for hook in STAGE_WEIGHTS)), None)
    cut = dict(num_stages=num_stages, weights=weights)
    stages = [split_pipeline(model, stage_index=i, **cut).to(topo.device) for i in stage_ids]
    pp_group, dp_group = device_mesh["pp"].get_group(), device_mesh["dp"].get_group()
    runners = [PipelineStage(m, i, num_stages, topo.device, group=pp_group) for m, i in zip(stages, stage_ids)]
    micro = cfg.microbatches * cfg.accum  # --accum K: K batches as one schedule run
    loss_fn = TokenLoss()  # on the last stage: summed cross-entropy over the global batch's counted targets
    schedule = build_schedule(cfg.schedule, runners, microbatches=micro, loss_fn=loss_fn)
    holds_last = stage_ids[-1] == num_stages - 1
    torch.manual_seed(cfg.seed + dp_rank)  # from here each pipeline draws its own dropout, as one process would
    # the stages of one pipeline share its batches; --accum K: K batches as one schedule run
    my_row, size = Topology(dp_rank, dp, topo.device), cfg.batch_size * cfg.accum
    train_loader = make_loader(train_set, my_row, batch_size=size, collate_fn=collate, seed=cfg.seed)
    train_loader.batch_sampler.drop_last = True  # the schedule needs its micro-batches whole: no smaller last batch
    if (share := train_loader.sampler.num_samples) < size:
        raise RecipeError(f"--batch-size {cfg.batch_size} --accum {cfg.accum}: a rank has {share} samples; use less")
    val_loader = make_loader(val_set, my_row, batch_size=size, collate_fn=collate, train=False)
    total = min(cfg.epochs * len(train_loader), cfg.max_steps or math.inf)  # optimizer steps; --max-steps 0: no cap
    optimizer = torch.optim.AdamW([p for m in stages for p in m.parameters()], lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))

    # The run folder, new or resumed, and the checkpoint's state: every rank reads its own stages.
    run = open_run(cfg, topo, recipe="pipeline", global_batch=global_batch)
    state = dict(model=root_module(stages), optimizer=optimizer, scheduler=scheduler)  # what a checkpoint holds
    start = load_sharded(run, **state)
    totals = Tally(topo.device, start["window"])  # each log window's loss and accuracy (and the checkpoint's open one)
    say(run, f"pipeline: {cfg.schedule}, {num_stages} stages on pp={pp} x dp={dp} ranks, {micro} micro-batches")

    # Train. Every rank calls the schedule with the whole batch; the first stage reads the inputs, the last the targets.
    step, skipped, evaluation = start["step"], start["skipped"], {}
    step_options = dict(loss_fn=loss_fn, optimizer=optimizer, holds_last=holds_last, precision=cfg.precision)
    step_options |= dict(clip=cfg.clip, dp_group=dp_group, pp_group=pp_group)
    eval_options = dict(model=state["model"], loss_fn=loss_fn, holds_last=holds_last, device=topo.device)
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        train_loader.sampler.set_epoch(epoch, consumed=consumed)
        for batch in itertools.islice(train_loader, total - step):  # --accum batches in one
            metrics, grad_norm = step_pipeline(schedule, to_device(batch, topo.device), **step_options)
            step, consumed = step + 1, consumed + global_batch
            if cfg.on_nonfinite == "stop" and not math.isfinite(grad_norm):  # every rank read the same norm: all stop
                why = f"the loss or the gradients are not finite (gradient norm {grad_norm})"
                raise RecipeError(f"step {step}: {why}; lower --lr, or pass --on-nonfinite skip")
            skipped += not math.isfinite(grad_norm)  # --on-nonfinite skip: step_pipeline left the parameters
            scheduler.step()  # after the check: a stop at step 1 prints the error line alone
            totals.add(metrics)  # the last stage's; the other stages add zeros
            fire("on_step", metrics)  # the training clock
            if step % cfg.log_every == 0 or step == total:  # a collective: every rank reads at the same step
                lr = scheduler.get_last_lr()[0]
                log_train(run, totals, step=step, total=total, epoch=epoch, lr=lr, grad_norm=grad_norm, skipped=skipped)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == total:  # the last: it can go on
                with not_training():  # every rank writes its own stages
                    progress = dict(epoch=epoch, samples=consumed, step=step, skipped=skipped, window=totals.reduce())
                    save_sharded(run, **state, progress=progress, keep=cfg.keep)
        with not_training():  # forward only, through the same schedule: the smaller last batch too
            evaluation = evaluate_pipeline(schedule, val_loader, **eval_options)
        log_eval(run, evaluation, step=step, epoch=epoch)

    # Every rank gathers the stages' tensors into the plain model (the summary's plug-ins read it); rank 0 writes them.
    model.load_state_dict(gather_state_dict(stages))
    numbers = dict(steps=step, skipped_steps=skipped, weights=str(write_weights(run, model.state_dict())), pp=pp, dp=dp)
    return log_summary(cfg, run, model, totals, evaluation, **numbers)


# Options and start: in a standalone copy these come last, after everything they use.
@dataclass(frozen=True)
class Config(*gpt_defaults([Pipelining, Training, Checkpointing, *SEAMS["option_groups"]])):
    """pipeline's options (the GPT on text by default), and those of the plug-ins it was joined with."""


if __name__ == "__main__":
    cli_main(main, Config)
