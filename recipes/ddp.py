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

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

import core.attach  # noqa: F401 - the package runs ddp with every plug-in; a standalone copy joins those --with names
from core.kernel.builtin import build_data, build_model
from core.kernel.job import Checkpointing, Options, Training, cli_main, option
from core.kernel.loss import make_loss
from core.kernel.replica import evaluate, load_checkpoint, save_checkpoint
from core.kernel.seams import SEAMS, fire
from core.kernel.step import check_finite, step_plain, total_steps
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


def main(cfg: Config) -> dict:
    topo = init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; alone: a world of one
    try:
        return train(cfg, topo)
    finally:
        cleanup_pg()


def train(cfg: Config, topo: Topology) -> dict:
    if done := finished(cfg, topo, recipe="ddp"):  # resumed, finished: nothing is touched
        return done
    global_batch = cfg.batch_size * topo.world_size

    # Build. The same seed on every rank gives every replica the same initial weights.
    torch.manual_seed(cfg.seed)  # the same weights and data on every rank (--data's factory: its own seeds)
    train_set, val_set, collate = build_data(cfg)
    model = build_model(cfg).to(topo.device)
    fire("after_build", cfg, model)  # the plain model, before DDP wraps it (--init-from)
    if cfg.sync_batchnorm:  # BatchNorm statistics over the global batch (GPUs only: DDP refuses it on CPU)
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ids = [topo.device.index] if topo.device.type == "cuda" else None  # its GPU, or the CPU
    unused, static = cfg.find_unused_parameters, cfg.static_graph
    ddp_model = DistributedDataParallel(model, device_ids=ids, find_unused_parameters=unused, static_graph=static)
    torch.manual_seed(cfg.seed + topo.rank)  # from here each rank draws its own dropout, as one process would
    train_loader = make_loader(train_set, topo, batch_size=cfg.batch_size, collate_fn=collate, seed=cfg.seed)
    val_loader = make_loader(val_set, topo, batch_size=cfg.batch_size, collate_fn=collate, train=False)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr)
    total = total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = make_loss(cfg, model)  # the model's own loss, else cross-entropy on the logits

    # The run folder: a new one, or the one of the checkpoint --resume names, refused before it is touched when
    # the checkpoint cannot continue in this job. Then that checkpoint's state, every rank's own generator too.
    run = open_run(cfg, topo, recipe="ddp", global_batch=global_batch)
    state = dict(model=model, optimizer=optimizer, scheduler=scheduler)  # what a checkpoint holds, with the generators
    start = load_checkpoint(run, **state)
    totals = Tally(topo.device, start["window"])  # each log window's loss and accuracy (and the checkpoint's open one)

    # Train. DDP averages the gradients inside backward(): every replica takes the same step.
    step, skipped, evaluation = start["step"], start["skipped"], {}
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        train_loader.sampler.set_epoch(epoch, consumed=consumed)
        for batch in itertools.islice(train_loader, total - step):
            batch = to_device(batch, topo.device)
            metrics, grad_norm = step_plain(ddp_model, batch, optimizer=optimizer, loss_fn=loss_fn)
            step, consumed = step + 1, consumed + global_batch
            skipped += check_finite(grad_norm, step=step, on_nonfinite=cfg.on_nonfinite)
            scheduler.step()  # after the check: a stop at step 1 prints the error line alone
            totals.add(metrics)
            fire("on_step", metrics)  # the training clock
            if step % cfg.log_every == 0 or step == total:  # a collective: every rank reads at the same step
                lr = scheduler.get_last_lr()[0]
                log_train(run, totals, step=step, total=total, epoch=epoch, lr=lr, grad_norm=grad_norm, skipped=skipped)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == total:  # the last: it can go on
                with not_training():
                    progress = dict(epoch=epoch, samples=consumed, step=step, skipped=skipped, window=totals.reduce())
                    save_checkpoint(run, **state, progress=progress, keep=cfg.keep)
        with not_training():  # each rank evaluates its share of the validation set; the sums are all-reduced
            evaluation = evaluate(model, val_loader, loss_fn=loss_fn, device=topo.device)
        log_eval(run, evaluation, step=step, epoch=epoch)

    # Rank 0 alone writes the weights.
    saved = write_weights(run, model.state_dict())
    return log_summary(cfg, run, model, totals, evaluation, steps=step, skipped_steps=skipped, weights=str(saved))


# Options and start: in a standalone copy these come last, after everything they use.
@dataclass(frozen=True)
class DDPOptions(Options):
    """DistributedDataParallel"""

    find_unused_parameters: bool = option(False, "let DDP find parameters forward did not use (costs a graph walk)")
    static_graph: bool = option(False, "tell DDP the graph is the same every step (also fixes unused parameters)")
    sync_batchnorm: bool = option(False, "BatchNorm statistics over all ranks (SyncBatchNorm; GPUs)")


@dataclass(frozen=True)
class Config(Training, Checkpointing, DDPOptions, *SEAMS["option_groups"]):
    """ddp's options, and those of the plug-ins it was joined with: --help lists them."""


if __name__ == "__main__":
    cli_main(main, Config)
