"""dp: nn.DataParallel, one process driving every local GPU.

    ./launch_single_node.sh dp --epochs 5         # the launcher starts one process for dp
    python -m recipes run dp --epochs 5

DataParallel splits each batch over the visible GPUs, copies the model to every one of them
on every step, and gathers the outputs on the first: one Python process, held back by the
GIL and that first GPU. PyTorch recommends DistributedDataParallel even on one machine;
this recipe is here to show the difference with ddp. With fewer than two GPUs it trains as
plain single-device training and says so.
"""

import itertools
import os
from dataclasses import dataclass

import torch
from torch import nn

from core import data, dist, models, steps
from core.config import AsyncCheckpoints, Checkpointing, RecipeError, Training, cli_main
from core.run import Run


@dataclass(frozen=True)
class Config(Training, Checkpointing, AsyncCheckpoints):
    """The shared training and checkpoint options."""


def check(cfg: Config) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RecipeError(
            f"dp runs in one process but was started with WORLD_SIZE={os.environ['WORLD_SIZE']}; "
            f"use the ddp recipe for several processes"
        )


def main(cfg: Config) -> dict:
    check(cfg)
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # a world of one: the shared helpers work unchanged
    try:
        with Run.start(cfg, topo, recipe="dp", global_batch=cfg.batch_size) as run:
            return train(cfg, topo, run)
    finally:
        dist.cleanup_pg()


def train(cfg: Config, topo: dist.Topology, run: Run) -> dict:
    torch.manual_seed(cfg.seed)
    train_set, val_set, collate = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    gpus = torch.cuda.device_count()
    if gpus >= 2:  # the batch is split over the GPUs inside forward; replicas are re-made every step
        dp_model = nn.DataParallel(model)
        run.print(f"DataParallel over {gpus} GPUs (replicas re-made every step: prefer ddp)")
    else:
        dp_model = model
        run.print(f"DataParallel needs 2+ GPUs and found {gpus}: plain single-device training")
    train_loader = data.make_loader(train_set, topo, batch_size=cfg.batch_size, seed=cfg.seed, collate_fn=collate)
    val_loader = data.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False, collate_fn=collate)
    optimizer = torch.optim.AdamW(dp_model.parameters(), lr=cfg.lr)
    total = run.total_steps(train_loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = steps.make_loss(cfg.loss)
    progress = run.resume(model=model, optimizer=optimizer, scheduler=scheduler)

    step = progress["step"]
    for epoch in range(progress["epoch"], cfg.epochs):
        if step >= total:  # --max-steps reached; a resumed run that had finished stops here
            break
        data.set_epoch(train_loader, epoch, consumed=run.epoch(epoch))
        for batch in itertools.islice(train_loader, total - step):
            batch = data.to_device(batch, topo.device)  # DataParallel scatters from the first GPU
            metrics, stats = steps.train_step(dp_model, [batch], optimizer=optimizer, loss_fn=loss_fn)
            scheduler.step()
            step += 1
            run.step(step, metrics=metrics, stats=stats, lr=scheduler.get_last_lr()[0], total=total)
            run.checkpoint(step, model=model, optimizer=optimizer, scheduler=scheduler)
        run.evaluate(model, val_loader, loss_fn=loss_fn, step=step)

    return run.finish(model, devices=max(gpus, 1))


if __name__ == "__main__":
    cli_main(main, Config, check=check)
