"""ddp_amp: ddp plus mixed precision, dynamic loss scaling, gradient accumulation and clipping.

    ./launch_single_node.sh ddp_amp --precision bf16 --accum 4 --clip 1.0
    torchrun --standalone --nproc-per-node 2 -m recipes run ddp_amp --precision bf16 --accum 4 --clip 1.0
    python -m recipes run ddp_amp --precision bf16 --accum 4   # one process, no launcher
    ./launch_single_node.sh ddp_amp --precision fp16 --clip 1.0  # GPUs only: fp16 needs CUDA

The forward runs under torch.autocast (bf16 on CPU or GPU, fp16 on GPU); weights, gradients and
the optimizer stay fp32. fp16 also gets a GradScaler: the loss is scaled up so small gradients
survive fp16, unscaled before clipping, and a step whose gradients overflowed is skipped while
the scale backs off. An optimizer step takes --accum K micro-batches: DDP's no_sync() holds the
all-reduce back for the first K-1, and the loss is normalised by the targets of the whole global
batch, so the step is the one a single process takes on batch size x world size x K samples.
--clip bounds the total gradient norm over all ranks.
"""

import itertools
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from core import comm, data, dist, models, steps
from core.config import (
    Accumulation,
    AsyncCheckpoints,
    Checkpointing,
    DDPOptions,
    Precision,
    RecipeError,
    Training,
    cli_main,
    with_default,
)
from core.run import Run


@dataclass(frozen=True)
class Config(Training, Checkpointing, AsyncCheckpoints, DDPOptions, Precision, Accumulation):
    """ddp's options, and precision, accumulation and clipping."""

    epochs: int = with_default(Training, "epochs", 10)  # --accum 4 takes 4x fewer steps per epoch than ddp


def check(cfg: Config) -> None:
    if cfg.static_graph and cfg.accum > 1:  # DDP's static graph asserts (or skips the all-reduce) under no_sync()
        raise RecipeError(
            f"--static-graph with --accum {cfg.accum}: DDP's static graph breaks under no_sync() "
            f"(pytorch/pytorch#143580); drop --static-graph or use --accum 1"
        )


def main(cfg: Config) -> dict:
    check(cfg)
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, LOCAL_RANK, WORLD_SIZE; a world of one without
    try:
        global_batch = cfg.batch_size * topo.world_size * cfg.accum
        with Run.start(cfg, topo, recipe="ddp_amp", global_batch=global_batch) as run:
            return train(cfg, topo, run)
    finally:
        dist.cleanup_pg()


def train(cfg: Config, topo: dist.Topology, run: Run) -> dict:
    # Build. The same seed on every rank gives every replica the same initial weights.
    torch.manual_seed(cfg.seed)
    train_set, val_set, collate = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    model = comm.prepare_batchnorm(model, sync=cfg.sync_batchnorm, warn=run.print)
    ddp_model = DistributedDataParallel(
        model,
        device_ids=[topo.device.index] if topo.device.type == "cuda" else None,
        find_unused_parameters=cfg.find_unused_parameters,
        static_graph=cfg.static_graph,
    )
    train_loader = data.make_loader(train_set, topo, batch_size=cfg.batch_size, seed=cfg.seed, collate_fn=collate)
    val_loader = data.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False, collate_fn=collate)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr)
    total = run.total_steps(train_loader, accum=cfg.accum)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    scaler = steps.make_scaler(cfg.precision, device=topo.device)  # loss scaling for fp16; a pass-through otherwise
    loss_fn = steps.make_loss(cfg.loss)
    progress = run.resume(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)

    # Train. K micro-batches a step; DDP all-reduces in the last one's backward only (no_sync before).
    step = progress["step"]
    for epoch in range(progress["epoch"], cfg.epochs):
        if step >= total:  # --max-steps reached; a resumed run that had finished stops here
            break
        data.set_epoch(train_loader, epoch, consumed=run.epoch(epoch))  # resumed mid-epoch: skip what was trained
        groups = steps.micro_batch_groups(train_loader, cfg.accum, device=topo.device)  # an incomplete tail is dropped
        for micro_batches in itertools.islice(groups, total - step):
            metrics, stats = steps.train_step(
                ddp_model,
                micro_batches,
                optimizer=optimizer,
                loss_fn=loss_fn,
                precision=cfg.precision,
                scaler=scaler,
                clip=cfg.clip,
            )
            scheduler.step()
            step += 1
            run.step(step, metrics=metrics, stats=stats, lr=scheduler.get_last_lr()[0], total=total)
            run.checkpoint(step, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
        run.evaluate(model, val_loader, loss_fn=loss_fn, step=step)

    # Rank 0 alone writes the weights: every rank vouches that it holds the same ones.
    return run.finish(model, **comm.replicas_report(model))


if __name__ == "__main__":
    cli_main(main, Config, check=check)
