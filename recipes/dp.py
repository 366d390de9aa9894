"""dp: nn.DataParallel, one process driving every local GPU (the source's SimpleDataParallel).

    ./launch_single_node.sh dp --epochs 5         # the launcher starts one process for dp
    python -m recipes run dp --epochs 5

Builds on: ddp (the same loop, one process instead of one per device).

DataParallel splits each batch over the visible GPUs, copies the model to every one of them
on every step, and gathers the outputs on the first: one Python process, held back by the
GIL and that first GPU. PyTorch recommends DistributedDataParallel even on one machine;
this recipe is here to show the difference. With fewer than two GPUs it trains as plain
single-device training and says so.
"""
import os
import time

import torch

from core import data, dist, models, parallel, steps
from core.cli import main_for
from core.config import RecipeError, TrainConfig
from core.log import setup_logging
from core.metrics import Meter, planned_steps
from core.registry import register
from core.run import RunWriter


@register("dp", summary="nn.DataParallel in one process (plain training with <2 GPUs)", multi_node=False,
          builds_on="ddp")
def main(cfg: TrainConfig) -> dict:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RecipeError(f"dp runs in one process but was started with WORLD_SIZE={os.environ['WORLD_SIZE']}; "
                          f"use the ddp recipe for several processes")
    parallel.refuse_unsupported(cfg, "dp", precisions=("fp32",))  # the plain loop: none of the extras
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # a world of one, so the shared helpers work unchanged
    try:
        return train(cfg, topo)
    finally:
        dist.cleanup_pg()


def train(cfg: TrainConfig, topo: dist.Topology) -> dict:
    log = setup_logging(topo.rank)
    run = RunWriter.create(cfg.out, cfg.name, topo)
    run.write_config({"recipe": "dp", "world_size": 1, **cfg.to_dict()})

    torch.manual_seed(cfg.seed)
    train_set, val_set = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    dp_model, how = parallel.wrap_dp(model)
    log.info(how)
    train_loader = data.make_loader(train_set, topo, batch_size=cfg.batch_size, seed=cfg.seed)
    val_loader = None if val_set is None else data.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False)
    optimizer = torch.optim.AdamW(dp_model.parameters(), lr=cfg.lr)
    total = planned_steps(epochs=cfg.epochs, batches_per_epoch=len(train_loader), max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = steps.cross_entropy

    meter, step, evaluation = Meter(topo.device), 0, {}
    for epoch in range(cfg.epochs):
        train_loader.sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = data.to_device(batch, topo.device)  # DataParallel scatters from the first GPU
            meter.add(steps.step_plain(dp_model, batch, optimizer=optimizer, loss_fn=loss_fn))
            scheduler.step()
            step += 1
            if step % cfg.log_every == 0:  # a collective: every rank reads the meter at the same step
                run.log("train", step=step, epoch=epoch, lr=scheduler.get_last_lr()[0], **meter.read())
            run.progress(step, total, every=cfg.log_every, epoch=epoch, **meter.last)
            if step == cfg.max_steps:
                break
        if val_loader:
            started = time.perf_counter()
            evaluation = steps.evaluate(model, val_loader, loss_fn=loss_fn, device=topo.device)
            meter.exclude(started)
            run.log("eval", step=step, epoch=epoch, **evaluation)
            log.info(f"epoch {epoch} val_loss {evaluation['val_loss']:.4f} val_acc {evaluation['val_acc']:.4f}")
        if step == cfg.max_steps:
            break

    last = meter.read()
    weights = run.save_weights(model, metadata={"recipe": "dp", "model": cfg.model})
    summary = {**evaluation, "train_loss": last["loss"], "samples_per_s": meter.samples_per_s,
               "steps": step, "world_size": 1, "global_batch": cfg.batch_size, "weights": str(weights)}
    run.summary(**summary)
    return summary


if __name__ == "__main__":
    main_for(main)
