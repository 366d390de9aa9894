"""ddp: DistributedDataParallel, the base every other recipe builds on.

    ./launch_single_node.sh ddp --epochs 5
    torchrun --standalone --nproc-per-node 2 -m recipes run ddp --epochs 5
    python -m recipes run ddp --epochs 5          # one process, no launcher

Every rank holds a whole replica of the model and trains on its own share of each global
batch (--batch-size per rank x world size). backward() all-reduces the gradients, averaged,
so every replica takes the step one process would take on the whole global batch. The
DistributedSampler deals each epoch's shuffle out to the ranks (set_epoch: a new order every
epoch, the same on every rank); validation loss and accuracy are summed over all ranks before
rank 0 logs them; rank 0 writes checkpoints and the final weights as safetensors.
"""

import itertools
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from core import comm, data, dist, models, steps
from core.config import AsyncCheckpoints, Checkpointing, DDPOptions, Training, cli_main
from core.run import Run


@dataclass(frozen=True)
class Config(Training, Checkpointing, AsyncCheckpoints, DDPOptions):
    """The shared training and checkpoint options, and DDP's own."""


def main(cfg: Config) -> dict:
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, LOCAL_RANK, WORLD_SIZE; a world of one without
    try:
        with Run.start(cfg, topo, recipe="ddp", global_batch=cfg.batch_size * topo.world_size) as run:
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
    total = run.total_steps(train_loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = steps.make_loss(cfg.loss)
    progress = run.resume(model=model, optimizer=optimizer, scheduler=scheduler)

    # Train. DDP averages the gradients inside backward(): every replica takes the same step.
    step = progress["step"]
    for epoch in range(progress["epoch"], cfg.epochs):
        if step >= total:  # --max-steps reached; a resumed run that had finished stops here
            break
        data.set_epoch(train_loader, epoch, consumed=run.epoch(epoch))  # resumed mid-epoch: skip what was trained
        for batch in itertools.islice(train_loader, total - step):
            batch = data.to_device(batch, topo.device)
            metrics, stats = steps.train_step(ddp_model, [batch], optimizer=optimizer, loss_fn=loss_fn)
            scheduler.step()
            step += 1
            run.step(step, metrics=metrics, stats=stats, lr=scheduler.get_last_lr()[0], total=total)
            run.checkpoint(step, model=model, optimizer=optimizer, scheduler=scheduler)
        run.evaluate(model, val_loader, loss_fn=loss_fn, step=step)

    # Rank 0 alone writes the weights: every rank vouches that it holds the same ones.
    return run.finish(model, **comm.replicas_report(model))


if __name__ == "__main__":
    cli_main(main, Config)
