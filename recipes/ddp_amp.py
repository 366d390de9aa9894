"""ddp_amp: ddp plus mixed precision, dynamic loss scaling, gradient accumulation, clipping and streams.

    ./launch_single_node.sh ddp_amp --precision bf16 --accum 4 --clip 1.0
    torchrun --standalone --nproc-per-node 2 -m recipes run ddp_amp --precision bf16 --accum 4 --clip 1.0
    python -m recipes run ddp_amp --precision bf16 --accum 4   # one process, no launcher
    ./launch_single_node.sh ddp_amp --precision fp16 --clip 1.0  # GPUs only: fp16 needs CUDA
    ./launch_single_node.sh ddp_amp --log-to tensorboard        # then: tensorboard --logdir runs

The forward runs under torch.autocast (bf16 on CPU or GPU, fp16 on GPU); weights, gradients and the
optimizer stay fp32. fp16 also gets a GradScaler: the loss is scaled up so small gradients survive
fp16, unscaled before clipping, and a step whose gradients overflowed is skipped while the scale
backs off. An optimizer step takes --accum K micro-batches: DDP's no_sync() holds the all-reduce
back for the first K-1, and every counted target of the global batch weighs the same (the loss is
normalised by the global count, not averaged per micro-batch), so the step is the one a single
process takes on batch size x world size x K samples, padded sequences included. --clip bounds the
total gradient norm over all ranks. Streams (an IterableDataset) are dealt out by position.
"""

import itertools
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from core import (
    amp,
    ckpt,
    data,
    dist,
    exact_loss,
    folder,
    meter,
    models,
    steps,
    stream,
    trackers,
    weights,
)
from core.amp import Accumulation, Precision
from core.config import Checkpointing, DDPOptions, Training, cli_main, with_default
from core.kernel.loader import seed_all, set_epoch
from core.kernel.options import RecipeError
from core.kernel.pg import cleanup_pg
from core.loss import make_loss
from core.loss_options import choose_loss
from core.plugins.hf import HFExport, write_hf_folder
from core.plugins.init_from import InitFrom, load_weights
from core.plugins.replicas import replicas_report


@dataclass(frozen=True)
class Config(Training, Checkpointing, DDPOptions, Precision, Accumulation, trackers.Tracking, InitFrom, HFExport):
    """ddp's options, and precision, accumulation, clipping and trackers."""

    epochs: int = with_default(Training, "epochs", 10)  # --accum 4 takes 4x fewer steps per epoch than ddp

    def __post_init__(self):
        super().__post_init__()
        if self.static_graph and self.accum > 1:  # DDP's static graph asserts (or skips the all-reduce) in no_sync()
            raise RecipeError(
                f"--static-graph with --accum {self.accum}: DDP's static graph breaks under no_sync() "
                f"(pytorch/pytorch#143580); drop --static-graph or use --accum 1"
            )


def main(cfg: Config) -> dict:
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; alone: a world of one
    try:
        return train(cfg, topo)
    finally:
        cleanup_pg()


def train(cfg: Config, topo: dist.Topology) -> dict:
    totals = meter.Meter(topo.device)  # the loss and accuracy of each log window, summed over the ranks
    # resumed and finished, with the lengths it finished with: nothing is touched (larger ones: it trains longer)
    if done := folder.finished(cfg, topo, recipe="ddp_amp", header=ckpt.read_metadata):
        return done
    global_batch = cfg.batch_size * topo.world_size * cfg.accum

    # Build. The same seed on every rank gives every replica the same initial weights.
    seed_all(cfg.seed)  # torch's, Python's and numpy's generators: the same weights and data on every rank
    train_set, val_set, collate = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    if cfg.init_from:  # a new run from earlier weights (a resumed run then takes its checkpoint's)
        load_weights(model, cfg.init_from)
    if cfg.sync_batchnorm:  # BatchNorm statistics over the global batch (GPUs only; the pre-check says so on CPU)
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp_model = DistributedDataParallel(
        model,
        device_ids=[topo.device.index] if topo.device.type == "cuda" else None,
        find_unused_parameters=cfg.find_unused_parameters,
        static_graph=cfg.static_graph,
    )
    torch.manual_seed(cfg.seed + topo.rank)  # from here each rank draws its own dropout, as one process would
    if stream.is_stream(train_set):  # an IterableDataset: read in order and dealt out by position, no sampler
        train_loader = stream.make_loader(train_set, topo, batch_size=cfg.batch_size, collate_fn=collate)
        val_loader = stream.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False, collate_fn=collate)
        total = stream.total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps, accum=cfg.accum)
    else:
        train_loader = data.make_loader(train_set, topo, batch_size=cfg.batch_size, seed=cfg.seed, collate_fn=collate)
        val_loader = data.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False, collate_fn=collate)
        total = data.total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps, accum=cfg.accum)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    scaler = amp.make_scaler(cfg.precision, device=topo.device)  # loss scaling for fp16; a pass-through otherwise
    loss_fn = make_loss(model=model)  # the model's own loss, else cross-entropy on the logits (core.loss's table)
    loss_fn = choose_loss(cfg.loss, loss_fn, model=model)  # --loss ce, mse, model or module:function
    # Every counted target of the global batch weighs the same, across ranks and micro-batches.
    loss_fn = exact_loss.make_exact_loss(loss_fn, model=model)

    # The run folder, new or resumed (refused before it is touched when the checkpoint cannot continue), the
    # checkpoint's state, and the trackers --log-to names, which continue from the checkpoint's step.
    run = folder.open_run(
        cfg, topo, recipe="ddp_amp", global_batch=global_batch, newest=ckpt.newest_good, header=ckpt.read_metadata
    )
    start = ckpt.load_checkpoint(run, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    meter.carry_window(totals, start["window"], writer=run.writer)  # the log window open at the checkpoint
    run = trackers.attach(run, cfg, step=start["step"], header=ckpt.read_metadata)

    # Train. K micro-batches a step; DDP all-reduces in the last one's backward only (no_sync before).
    step, skipped, evaluation = start["step"], start["skipped"], {}
    step_options = dict(optimizer=optimizer, loss_fn=loss_fn, precision=cfg.precision, scaler=scaler, clip=cfg.clip)
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        set_epoch(train_loader, epoch, consumed=consumed)
        groups = amp.micro_batch_groups(train_loader, cfg.accum, device=topo.device)  # an incomplete tail is dropped
        for micro_batches in itertools.islice(groups, total - step):
            metrics, stats = amp.step_amp(ddp_model, micro_batches, **step_options)
            step, consumed = step + 1, consumed + global_batch
            skipped += amp.check_step(stats, step=step, on_nonfinite=cfg.on_nonfinite)
            scheduler.step()  # after the check: a stop at step 1 prints the error line alone
            totals.add(metrics)
            if step % cfg.log_every == 0 or step == total:  # a collective: every rank reads at the same step
                numbers = {"lr": scheduler.get_last_lr()[0], "grad_norm": stats.grad_norm, "skipped": skipped}
                scale = {"loss_scale": stats.scale} if stats.scaled else {}  # fp16: the scaler's current scale
                meter.log_train(run, totals, step=step, total=total, epoch=epoch, **numbers, **scale)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == total:  # the last: it can go on
                window = meter.open_window(totals)  # its sums so far: a resume goes on with them
                progress = dict(epoch=epoch, samples=consumed, step=step, skipped=skipped, window=window)
                with meter.paused(totals):
                    state = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
                    ckpt.save_checkpoint(run, model=model, **state, progress=progress, keep=cfg.keep)
        with meter.paused(totals):  # each rank evaluates its share of the validation set; the sums are all-reduced
            evaluation = steps.evaluate(
                model, val_loader, loss_fn=loss_fn, device=topo.device, forward=exact_loss.forward_sums
            )
        meter.log_eval(run, evaluation, step=step, epoch=epoch)

    # Rank 0 alone writes the weights; every rank vouches that it holds the same ones.
    saved = weights.write_weights(run, model.state_dict())
    write_hf_folder(run, model, model.state_dict(), attr=cfg.hf_attr, max_shard_mb=cfg.hf_shard_mb)
    report = replicas_report(model.state_dict())  # whether every rank holds the same weights
    summary = meter.log_summary(run, totals, evaluation, steps=step, skipped=skipped, weights=saved, **report)
    trackers.close(run)
    return summary


if __name__ == "__main__":
    cli_main(main, Config)
