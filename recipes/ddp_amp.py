"""ddp_amp: ddp plus mixed precision, dynamic loss scaling, gradient accumulation, clipping and streams.

    ./launch_single_node.sh ddp_amp --precision bf16 --accum 4 --clip 1.0
    torchrun --standalone --nproc-per-node 2 -m recipes run ddp_amp --precision bf16 --accum 4 --clip 1.0
    python -m recipes run ddp_amp --precision bf16 --accum 4   # one process, no launcher
    ./launch_single_node.sh ddp_amp --precision fp16 --clip 1.0  # GPUs only: fp16 needs CUDA
    ./launch_single_node.sh ddp_amp --log-to tensorboard  # a copy made --with trackers; tensorboard --logdir runs

The forward runs under torch.autocast (bf16 on CPU or GPU, fp16 on GPU); weights, gradients and the
optimizer stay fp32. fp16 also gets a GradScaler: the loss is scaled up so small gradients survive
fp16, unscaled before clipping, and a step whose gradients overflowed is skipped while the scale
backs off. An optimizer step takes --accum K micro-batches: DDP's no_sync() holds the all-reduce
back for the first K-1, and every counted target of the global batch weighs the same (the loss is
normalised by the global count, not averaged per micro-batch), so the step is the one a single
process takes on batch size x world size x K samples, padded sequences included. --clip bounds the
total gradient norm over all ranks. Streams (an IterableDataset) are dealt out by position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

import core.attach  # noqa: F401 - the package runs ddp_amp with every plug-in; a standalone copy joins its --with ones
from core.accum import Accumulation, check_step, make_loaders, micro_batch_groups, step_amp
from core.amp import Precision, grad_sync
from core.exact_loss import make_exact_loss
from core.kernel.builtin import build_data, build_model
from core.kernel.job import Checkpointing, Options, RecipeError, Training, cli_main, option
from core.kernel.loss import make_loss
from core.kernel.replica import evaluate, load_checkpoint, save_checkpoint
from core.kernel.seams import SEAMS, fire
from core.kernel.store import finished, open_run, write_weights
from core.kernel.train import Tally, Topology, cleanup_pg, init_pg, log_eval, log_summary, log_train, not_training
from core.plugins import loss_counts, stream, trackers  # noqa: F401 - its own plug-ins (tools/registry.py)


def main(cfg: Config) -> dict:
    topo = init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; alone: a world of one
    try:
        return train(cfg, topo)
    finally:
        cleanup_pg()


def train(cfg: Config, topo: Topology) -> dict:
    if done := finished(cfg, topo, recipe="ddp_amp"):  # resumed, finished: nothing is touched
        return done
    global_batch = cfg.batch_size * topo.world_size * cfg.accum

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
    # A stream (an IterableDataset) is read in order and dealt out by position; map-style data by a seeded sampler.
    train_loader, val_loader, total = make_loaders(cfg, topo, train_set, val_set, collate)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    scaler = torch.amp.GradScaler(topo.device.type, enabled=cfg.precision == "fp16")  # bf16, fp32: a pass-through
    # The model's own loss, else cross-entropy; every counted target of the global batch weighs the same, across
    # ranks and micro-batches.
    loss_fn = make_exact_loss(make_loss(cfg, model), model=model)

    # The run folder: a new one, or the one of the checkpoint --resume names, refused before it is touched when
    # the checkpoint cannot continue in this job. Then that checkpoint's state, every rank's own generator too.
    run = open_run(cfg, topo, recipe="ddp_amp", global_batch=global_batch)
    state = dict(model=model, optimizer=optimizer, scheduler=scheduler)  # what a checkpoint holds, with the generators
    start = load_checkpoint(run, **state)
    if "scaler" in start:  # fp16's loss scale goes on where it was
        scaler.load_state_dict(start["scaler"])
    totals = Tally(topo.device, start["window"])  # each log window's loss and accuracy (and the checkpoint's open one)

    # Train. K micro-batches a step; DDP all-reduces in the last one's backward only (no_sync before).
    step, skipped, evaluation = start["step"], start["skipped"], {}
    step_options = dict(optimizer=optimizer, loss_fn=loss_fn, precision=cfg.precision, scaler=scaler, clip=cfg.clip)
    step_options |= dict(sync=grad_sync)  # no_sync() for the first K-1 micro-batches
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        train_loader.sampler.set_epoch(epoch, consumed=consumed)
        # K batches a step, an incomplete tail dropped; at most total - step of them (--max-steps)
        for _, group in zip(range(total - step), micro_batch_groups(train_loader, cfg.accum, device=topo.device)):
            metrics, stats = step_amp(ddp_model, group, **step_options)
            step, consumed = step + 1, consumed + global_batch
            skipped += check_step(stats, step=step, on_nonfinite=cfg.on_nonfinite)
            scheduler.step()  # after the check: a stop at step 1 prints the error line alone
            totals.add(metrics)
            fire("on_step", metrics)  # the training clock
            if step % cfg.log_every == 0 or step == total:  # a collective: every rank reads at the same step
                numbers = dict(lr=scheduler.get_last_lr()[0], grad_norm=stats.grad_norm, skipped=skipped)
                numbers |= {"loss_scale": stats.scale} if stats.scaled else {}  # fp16: the scaler's current scale
                log_train(run, totals, step=step, total=total, epoch=epoch, **numbers)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == total:  # the last: it can go on
                with not_training():
                    progress = dict(epoch=epoch, samples=consumed, step=step, skipped=skipped, window=totals.reduce())
                    progress |= {"scaler": scaler.state_dict()} if scaler.is_enabled() else {}  # fp16's scale
                    save_checkpoint(run, **state, progress=progress, keep=cfg.keep)
        with not_training():  # each rank evaluates its share of the validation set; the sums are all-reduced
            evaluation = evaluate(model, val_loader, loss_fn=loss_fn.loss, device=topo.device)
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
class Config(Training, Checkpointing, DDPOptions, Precision, Accumulation, *SEAMS["option_groups"]):
    """ddp_amp's options, and those of the plug-ins it was joined with: --help lists them."""

    epochs: int = option(10, "passes over the training set")  # --accum 4: 4x fewer steps an epoch

    def __post_init__(self):
        super().__post_init__()
        if self.static_graph and self.accum > 1:  # DDP's static graph asserts (or skips the all-reduce) in no_sync()
            raise RecipeError(
                f"--static-graph with --accum {self.accum}: DDP's static graph breaks under no_sync() "
                f"(pytorch/pytorch#143580); drop --static-graph or use --accum 1"
            )


if __name__ == "__main__":
    cli_main(main, Config)
