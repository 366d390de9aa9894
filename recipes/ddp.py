"""ddp: DistributedDataParallel, the base every other recipe builds on.

    ./launch_single_node.sh ddp --epochs 5
    torchrun --standalone --nproc-per-node 2 -m recipes run ddp --epochs 5
    python -m recipes run ddp --epochs 5          # one process, no launcher

Every rank holds a whole replica of the model and trains on its own share of each global batch
(--batch-size per rank x world size). backward() all-reduces the gradients, averaged, so every
replica takes the step one process would take on the whole global batch. The DistributedSampler
deals each epoch's shuffle out to the ranks (set_epoch: a new order every epoch, the same on every
rank); losses and accuracies are summed over all ranks before rank 0 logs them; rank 0 writes the
checkpoints and the final weights as safetensors, and a run resumes exactly where it stopped.
"""

import itertools
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from core import ckpt, data, dist, folder, hf, meter, models, replicas, steps, weights
from core.config import Checkpointing, DDPOptions, Training, cli_main
from core.loss import make_loss
from core.loss_options import choose_loss


@dataclass(frozen=True)
class Config(Training, Checkpointing, DDPOptions, weights.InitFrom, hf.HFExport):
    """The shared training and checkpoint options, and DDP's own."""


def main(cfg: Config) -> dict:
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; alone: a world of one
    try:
        return train(cfg, topo)
    finally:
        dist.cleanup_pg()


def train(cfg: Config, topo: dist.Topology) -> dict:
    totals = meter.Meter(topo.device)  # the loss and accuracy of each log window, summed over the ranks
    if done := folder.finished(cfg, topo, recipe="ddp"):  # resumed, finished: nothing is touched
        return done
    global_batch = cfg.batch_size * topo.world_size

    # Build. The same seed on every rank gives every replica the same initial weights.
    data.seed_all(cfg.seed)  # torch's, Python's and numpy's generators: the same weights and data on every rank
    train_set, val_set, collate = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    if cfg.init_from:  # a new run from earlier weights (a resumed run then takes its checkpoint's)
        weights.load_weights(model, cfg.init_from)
    if cfg.sync_batchnorm:  # BatchNorm statistics over the global batch (GPUs only: DDP refuses it on CPU)
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp_model = DistributedDataParallel(
        model,
        device_ids=[topo.device.index] if topo.device.type == "cuda" else None,
        find_unused_parameters=cfg.find_unused_parameters,
        static_graph=cfg.static_graph,
    )
    torch.manual_seed(cfg.seed + topo.rank)  # from here each rank draws its own dropout, as one process would
    train_loader = data.make_loader(train_set, topo, batch_size=cfg.batch_size, seed=cfg.seed, collate_fn=collate)
    val_loader = data.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False, collate_fn=collate)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr)
    total = data.total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = make_loss(model=model)  # the model's own loss, else cross-entropy on the logits (core.loss's table)
    loss_fn = choose_loss(cfg.loss, loss_fn, model=model)  # --loss ce, mse, model or module:function

    # The run folder: a new one, or the one of the checkpoint --resume names, refused before it is touched when
    # the checkpoint cannot continue in this job. Then that checkpoint's state, every rank's own generator too.
    run = folder.open_run(
        cfg, topo, recipe="ddp", global_batch=global_batch, newest=ckpt.newest_good, header=ckpt.read_metadata
    )
    start = ckpt.load_checkpoint(run, model=model, optimizer=optimizer, scheduler=scheduler)
    meter.carry_window(totals, start["window"], writer=run.writer)  # the log window open at the checkpoint

    # Train. DDP averages the gradients inside backward(): every replica takes the same step.
    step, skipped, evaluation = start["step"], start["skipped"], {}
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        data.set_epoch(train_loader, epoch, consumed=consumed)
        for batch in itertools.islice(train_loader, total - step):
            batch = data.to_device(batch, topo.device)
            metrics, grad_norm = steps.step_plain(ddp_model, batch, optimizer=optimizer, loss_fn=loss_fn)
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
        with meter.paused(totals):  # each rank evaluates its share of the validation set; the sums are all-reduced
            evaluation = steps.evaluate(model, val_loader, loss_fn=loss_fn, device=topo.device)
        meter.log_eval(run, evaluation, step=step, epoch=epoch)

    # Rank 0 alone writes the weights; every rank vouches that it holds the same ones.
    saved = weights.write_weights(run, model.state_dict())
    hf.write_hf_folder(run, model, model.state_dict(), attr=cfg.hf_attr, max_shard_mb=cfg.hf_shard_mb)
    same = replicas.replicas_report(model.state_dict())  # {"replicas_identical": ...}, in the summary
    return meter.log_summary(run, totals, evaluation, steps=step, skipped=skipped, weights=saved, **same)


if __name__ == "__main__":
    cli_main(main, Config)
