"""dp: nn.DataParallel, one process driving every local GPU.

    ./launch_single_node.sh dp --epochs 5         # the launcher starts one process for dp
    python -m recipes run dp --epochs 5

DataParallel splits each batch over the visible GPUs, copies the model to every one of them on
every step, and gathers the outputs on the first: one Python process, held back by the GIL and
that first GPU. PyTorch recommends DistributedDataParallel even on one machine; this recipe is
here to show the difference with ddp. With fewer than two GPUs it trains as plain single-device
training and says so.
"""

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from core import ckpt, data, dist, folder, meter, models, steps, weights
from core.config import Checkpointing, Training, cli_main
from core.kernel.log import say
from core.kernel.options import RecipeError
from core.loss import make_loss
from core.loss_options import choose_loss
from core.plugins.hf import HFExport, write_hf_folder
from core.plugins.init_from import InitFrom, load_weights


@dataclass(frozen=True)
class Config(Training, Checkpointing, InitFrom, HFExport):
    """The shared training and checkpoint options."""


def main(cfg: Config) -> dict:
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # a world of one: the shared helpers work unchanged
    try:
        if topo.world_size > 1:
            raise RecipeError(f"dp runs in one process but was started as {topo.world_size}; use ddp for several")
        return train(cfg, topo)
    finally:
        dist.cleanup_pg()


def train(cfg: Config, topo: dist.Topology) -> dict:
    totals = meter.Meter(topo.device)  # the loss and accuracy of each log window, summed over the ranks
    if done := folder.finished(cfg, topo, recipe="dp"):  # resumed, finished: nothing is touched
        return done
    global_batch = cfg.batch_size  # one process: DataParallel splits each batch over the GPUs

    # Build.
    data.seed_all(cfg.seed)  # torch's, Python's and numpy's generators: the same weights and data on every rank
    train_set, val_set, collate = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    if cfg.init_from:  # a new run from earlier weights (a resumed run then takes its checkpoint's)
        load_weights(model, cfg.init_from)
    gpus = torch.cuda.device_count()
    dp_model = nn.DataParallel(model) if gpus >= 2 else model  # the batch split over the GPUs inside forward
    train_loader = data.make_loader(train_set, topo, batch_size=cfg.batch_size, seed=cfg.seed, collate_fn=collate)
    val_loader = data.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False, collate_fn=collate)
    optimizer = torch.optim.AdamW(dp_model.parameters(), lr=cfg.lr)
    total = data.total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = make_loss(model=model)  # the model's own loss, else cross-entropy on the logits (core.loss's table)
    loss_fn = choose_loss(cfg.loss, loss_fn, model=model)  # --loss ce, mse, model or module:function

    # The run folder: a new one, or the one of the checkpoint --resume names, refused before it is touched when
    # the checkpoint cannot continue in this job. Then that checkpoint's state.
    run = folder.open_run(
        cfg, topo, recipe="dp", global_batch=global_batch, newest=ckpt.newest_good, header=ckpt.read_metadata
    )
    start = ckpt.load_checkpoint(run, model=model, optimizer=optimizer, scheduler=scheduler)
    meter.carry_window(totals, start["window"], writer=run.writer)  # the log window open at the checkpoint
    single = f"DataParallel needs 2+ GPUs and found {gpus}: plain single-device training"
    say(run, f"DataParallel over {gpus} GPUs (replicas re-made every step: prefer ddp)" if gpus >= 2 else single)

    # Train. DataParallel scatters each batch from the first GPU and gathers the outputs back on it.
    step, skipped, evaluation = start["step"], start["skipped"], {}
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        data.set_epoch(train_loader, epoch, consumed=consumed)
        for batch in itertools.islice(train_loader, total - step):
            batch = data.to_device(batch, topo.device)
            metrics, grad_norm = steps.step_plain(dp_model, batch, optimizer=optimizer, loss_fn=loss_fn)
            step, consumed = step + 1, consumed + global_batch
            skipped += steps.check_finite(grad_norm, step=step, on_nonfinite=cfg.on_nonfinite)
            scheduler.step()  # after the check: a stop at step 1 prints the error line alone
            totals.add(metrics)
            if step % cfg.log_every == 0 or step == total:  # a collective: every rank reads at the same step
                lr = scheduler.get_last_lr()[0]
                meter.log_train(
                    run, totals, step=step, total=total, epoch=epoch, lr=lr, grad_norm=grad_norm, skipped=skipped
                )
            if cfg.ckpt_every and step % cfg.ckpt_every == 0:
                window = meter.open_window(totals)  # its sums so far: a resume goes on with them
                progress = dict(epoch=epoch, samples=consumed, step=step, skipped=skipped, window=window)
                with meter.paused(totals):
                    state = {"optimizer": optimizer, "scheduler": scheduler}  # the train state besides the model
                    ckpt.save_checkpoint(run, model=model, **state, progress=progress, keep=cfg.keep)
        with meter.paused(totals):
            evaluation = steps.evaluate(model, val_loader, loss_fn=loss_fn, device=topo.device)
        meter.log_eval(run, evaluation, step=step, epoch=epoch)

    # Rank 0 writes the weights.
    saved = weights.write_weights(run, model.state_dict())
    write_hf_folder(run, model, model.state_dict(), attr=cfg.hf_attr, max_shard_mb=cfg.hf_shard_mb)
    return meter.log_summary(run, totals, evaluation, steps=step, skipped=skipped, weights=saved, devices=max(gpus, 1))


if __name__ == "__main__":
    cli_main(main, Config)
