"""dp: nn.DataParallel, one process driving every local GPU.

    ./launch_single_node.sh dp --epochs 5         # the launcher starts one process for dp
    python -m recipes run dp --epochs 5

DataParallel splits each batch over the visible GPUs, copies the model to every one of them on
every step, and gathers the outputs on the first: one Python process, held back by the GIL and
that first GPU. PyTorch recommends DistributedDataParallel even on one machine; this recipe is
here to show the difference with ddp. With fewer than two GPUs it trains as plain single-device
training and says so.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

import core.attach  # noqa: F401 - the package runs ddp with every plug-in; a standalone copy joins those --with names
from core.kernel.builtin import build_data, build_model
from core.kernel.job import Checkpointing, RecipeError, Training, cli_main, say
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
    topo = init_pg(timeout_s=cfg.timeout_s)  # a world of one: the kernel works unchanged
    try:
        if topo.world_size > 1:  # nn.DataParallel drives every GPU from one process
            how = "start one (`python -m recipes run dp`, or NPROC_PER_NODE=1 with a launcher), or use ddp for several"
            raise RecipeError(f"dp runs in one process, not {topo.world_size}: {how}")
        return train(cfg, topo)
    finally:
        cleanup_pg()


def train(cfg: Config, topo: Topology) -> dict:
    if done := finished(cfg, topo, recipe="dp"):  # resumed, finished: nothing is touched
        return done
    global_batch = cfg.batch_size  # one process: DataParallel splits each batch over the GPUs

    # Build. The same seed on every rank gives every replica the same initial weights.
    torch.manual_seed(cfg.seed)  # the same weights and data on every rank (--data's factory: its own seeds)
    train_set, val_set, collate = build_data(cfg)
    model = build_model(cfg).to(topo.device)
    fire("after_build", cfg, model)  # the plain model, before DDP wraps it (--init-from)
    gpus = torch.cuda.device_count()
    dp_model = nn.DataParallel(model) if gpus >= 2 else model  # the batch split over the GPUs inside forward
    train_loader = make_loader(train_set, topo, batch_size=cfg.batch_size, collate_fn=collate, seed=cfg.seed)
    val_loader = make_loader(val_set, topo, batch_size=cfg.batch_size, collate_fn=collate, train=False)
    optimizer = torch.optim.AdamW(dp_model.parameters(), lr=cfg.lr)
    total = total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = make_loss(cfg, model)  # the model's own loss, else cross-entropy on the logits

    # The run folder: a new one, or the one of the checkpoint --resume names, refused before it is touched when
    # the checkpoint cannot continue in this job. Then that checkpoint's state.
    run = open_run(cfg, topo, recipe="dp", global_batch=global_batch)
    state = dict(model=model, optimizer=optimizer, scheduler=scheduler)  # what a checkpoint holds, with the generators
    start = load_checkpoint(run, **state)
    totals = Tally(topo.device, start["window"])  # each log window's loss and accuracy (and the checkpoint's open one)
    single = f"DataParallel needs 2+ GPUs and found {gpus}: plain single-device training"
    say(run, f"DataParallel over {gpus} GPUs (replicas re-made every step: prefer ddp)" if gpus >= 2 else single)

    # Train. DataParallel scatters each batch from the first GPU and gathers the outputs back on it.
    step, skipped, evaluation = start["step"], start["skipped"], {}
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        train_loader.sampler.set_epoch(epoch, consumed=consumed)
        for batch in itertools.islice(train_loader, total - step):
            batch = to_device(batch, topo.device)
            metrics, grad_norm = step_plain(dp_model, batch, optimizer=optimizer, loss_fn=loss_fn)
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

    # Rank 0 writes the weights.
    saved = write_weights(run, model.state_dict())
    numbers = dict(steps=step, skipped_steps=skipped, weights=str(saved), devices=max(gpus, 1))
    return log_summary(cfg, run, model, totals, evaluation, **numbers)


# Options and start: in a standalone copy these come last, after everything they use.
@dataclass(frozen=True)
class Config(Training, Checkpointing, *SEAMS["option_groups"]):
    """dp's options, and those of the plug-ins it was joined with: --help lists them."""


if __name__ == "__main__":
    cli_main(main, Config)
