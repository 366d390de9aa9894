"""pipeline: pipeline parallelism with torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B).

    ./launch_single_node.sh pipeline --schedule 1f1b --microbatches 8
    ./launch_single_node.sh pipeline --schedule interleaved1f1b --microbatches 4
    NPROC_PER_NODE=4 ./launch_single_node.sh pipeline --pp 2     # 2 stages x 2 data-parallel replicas
    torchrun --standalone --nproc-per-node 2 -m recipes run pipeline --schedule gpipe

Builds on: ddp (the same loop; the model is cut into stages instead of copied).

split_pipeline cuts the model's blocks into --pp contiguous stages of about equal parameter
count (--balance time: of equal measured time), one per rank (interleaved1f1b: two per rank,
looped, so rank r holds stages r and r + pp). Each batch is cut into --microbatches equal
micro-batches that flow through the stages; the schedule decides the order of forwards and
backwards (GPipe: all forwards then all backwards; 1F1B: one of each in turn, holding fewer
activations) and sends activations and gradients between neighbouring ranks. The loss is
computed on the last stage, one mean per micro-batch; the schedule divides the summed
gradients by the micro-batch count, so a step equals one process's on the whole batch.
With world size W = pp x dp, ranks form a dp x pp mesh: dp pipelines, each on its own share
of the data, gradients averaged across them. Global batch: --batch-size x dp.
Loss and accuracy are reported for the whole job (the last stages' numbers, reduced).
Defaults: --model gpt --data text (any model whose forward is `model.blocks(x)` works).
"""
import dataclasses
import os
import time

import torch
from torch.distributed.pipelining import PipelineStage

from core import data, dist, models, parallel, pipeline, steps
from core.cli import main_for
from core.config import TrainConfig
from core.gpt import RECIPE_DEFAULTS
from core.log import setup_logging
from core.metrics import Meter, planned_steps
from core.registry import Option, register
from core.run import RunWriter


@register("pipeline", summary="torch.distributed.pipelining: gpipe / 1f1b / interleaved1f1b, x data parallel",
          builds_on="ddp", defaults=RECIPE_DEFAULTS,
          options={"microbatches": Option(4, "micro-batches per batch (must divide --batch-size)"),
                   "schedule": Option("1f1b", "pipeline schedule", pipeline.SCHEDULES),
                   "pp": Option(0, "ranks per pipeline (0: all of them); the rest is data parallel"),
                   "balance": Option("params", "balance stages by parameter count or measured time",
                                     ("params", "time"))})
def main(cfg: TrainConfig, *, microbatches: int = 4, schedule: str = "1f1b", pp: int = 0,
         balance: str = "params") -> dict:
    parallel.refuse_unsupported(cfg, "pipeline")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(cfg.seed)  # the same weights on every rank; each keeps its own stage
    model = models.build_model(cfg.model)
    pipeline.check_pipeline(world_size=world, pp=pp or world, schedule=schedule, batch_size=cfg.batch_size,
                            num_blocks=pipeline.check_block_model(model, num_stages=1), microbatches=microbatches)
    topo = dist.init_pg(timeout_s=cfg.timeout_s)
    try:
        return train(cfg, topo, model, microbatches=microbatches, schedule=schedule, pp=pp or world,
                     balance=balance)
    finally:
        dist.cleanup_pg()


def train(cfg: TrainConfig, topo: dist.Topology, model: torch.nn.Module, *, microbatches: int = 4,
          schedule: str = "1f1b", pp: int = 2, balance: str = "params") -> dict:
    log = setup_logging(topo.rank)
    run = RunWriter.create(cfg.out, cfg.name, topo)
    dp = topo.world_size // pp
    run.write_config({"recipe": "pipeline", "world_size": topo.world_size, "pp": pp, "dp": dp,
                      "schedule": schedule, "microbatches": microbatches, "balance": balance, **cfg.to_dict()})

    # Data: every stage of one pipeline reads the same batches; the dp pipelines read disjoint shares.
    mesh = parallel.build_mesh(topo, {"dp": dp, "pp": pp})
    train_set, val_set = data.build_data(cfg.data)
    my_row = dataclasses.replace(topo, rank=mesh["dp"].get_local_rank(), world_size=dp)
    train_loader = data.make_loader(train_set, my_row, batch_size=cfg.batch_size, seed=cfg.seed)
    val_loader = None if val_set is None else data.make_loader(val_set, my_row, batch_size=cfg.batch_size,
                                                               train=False)

    # Build: cut the blocks into stages and keep this rank's (two, looped, for interleaved1f1b).
    per_rank = 2 if schedule == "interleaved1f1b" else 1
    num_stages, pp_rank = pp * per_rank, mesh["pp"].get_local_rank()
    stage_ids = [pp_rank + v * pp for v in range(per_rank)]
    sample = torch.stack([train_set[i][0] for i in range(cfg.batch_size // microbatches)])  # one micro-batch
    modules = [pipeline.split_pipeline(model, num_stages=num_stages, stage_index=i, balance=balance, sample=sample)
               .to(topo.device) for i in stage_ids]
    stages = [PipelineStage(m, i, num_stages, topo.device, group=mesh["pp"].get_group())
              for m, i in zip(modules, stage_ids)]
    loss_fn = steps.cross_entropy
    sched = pipeline.build_schedule(schedule, stages, microbatches=microbatches, loss_fn=loss_fn)
    holds_last = stage_ids[-1] == num_stages - 1
    optimizer = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=cfg.lr)
    total = planned_steps(epochs=cfg.epochs, batches_per_epoch=len(train_loader), max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    log.info(f"pipeline: {schedule}, {num_stages} stages on pp={pp} x dp={dp} ranks, {microbatches} micro-batches, "
             f"blocks per stage {[len(m.indices) for m in modules]} (rank 0), global batch {cfg.batch_size * dp}, "
             f"{total} steps -> {run.run_dir}")

    # Train: every rank calls the schedule with the whole batch; the last stage's metrics count.
    meter, step, evaluation = Meter(topo.device), 0, {}
    for epoch in range(cfg.epochs):
        train_loader.sampler.set_epoch(epoch)
        for batch in train_loader:
            meter.add(pipeline.step_pipeline(sched, data.to_device(batch, topo.device), optimizer=optimizer,
                                             holds_last=holds_last, dp_group=mesh["dp"].get_group(), dp_size=dp))
            scheduler.step()
            step += 1
            if step % cfg.log_every == 0:  # a collective: every rank reads the meter at the same step
                run.log("train", step=step, epoch=epoch, lr=scheduler.get_last_lr()[0], **meter.read())
            run.progress(step, total, every=cfg.log_every, epoch=epoch, **meter.last)
            if step == cfg.max_steps:
                break
        if val_loader:
            started = time.perf_counter()
            evaluation = pipeline.evaluate_pipeline(sched, val_loader, holds_last=holds_last, device=topo.device,
                                                    batch_size=cfg.batch_size)
            meter.exclude(started)
            run.log("eval", step=step, epoch=epoch, **evaluation)
            log.info(f"epoch {epoch} val_loss {evaluation['val_loss']:.4f} val_acc {evaluation['val_acc']:.4f}")
        if step == cfg.max_steps:
            break

    # Save: the stages' tensors, merged on rank 0 into the plain model's state dict.
    last = meter.read()
    plain = models.build_model(cfg.model)
    full = pipeline.gather_state_dict(modules)
    if full:  # rank 0
        plain.load_state_dict(full)
    weights = run.save_weights(plain, metadata={"recipe": "pipeline", "model": cfg.model})
    summary = {**evaluation, "train_loss": last["loss"], "samples_per_s": meter.samples_per_s, "steps": step,
               "world_size": topo.world_size, "pp": pp, "dp": dp, "global_batch": cfg.batch_size * dp,
               "weights": str(weights)}
    run.summary(**summary)
    return summary


if __name__ == "__main__":
    main_for(main)
