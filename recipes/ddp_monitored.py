"""ddp_monitored: ddp plus the monitoring, debugging and tuning a long job needs.

    ./launch_single_node.sh ddp_monitored --epochs 5 --ckpt-every 100 --ckpt-async
    torchrun --standalone --nproc-per-node 2 -m recipes run ddp_monitored --max-steps 200
    python -m recipes run ddp_monitored --profile --max-steps 20   # a copy made --with profile
    ./launch_single_node.sh ddp_monitored --hang-factor 20 --comm-hook fp16  # a copy made --with watchdog,comm_hook

Each train record gets where the step's time went (data, compute, comm_wait, optimizer; the
slowest rank's step), peak memory and, on a known GPU, MFU. A watchdog thread on every rank writes
every thread's stack and names the rank the others wait for when a step takes --hang-factor times
the median; --debug sets TORCH_DISTRIBUTED_DEBUG and the NCCL flight recorder; --profile writes a
torch.profiler trace per rank. Tuning: DDP comm hooks (fp16, bf16, PowerSGD compression), bucket
size, gradients as bucket views, torch.compile after wrapping, activation checkpointing per block,
channels-last; --ckpt-async writes checkpoints in a background thread (docs/monitoring.md). The
watchdog, --debug, --profile and the tuning are plug-ins: a copy has them `--with watchdog,profile,...`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

import core.attach  # noqa: F401 - the package runs ddp_monitored with every plug-in; a copy joins its --with ones
from core.ckpt_async import AsyncCheckpoints, CheckpointSaver
from core.kernel.builtin import build_data, build_model
from core.kernel.job import Checkpointing, Options, Training, cli_main, option, say
from core.kernel.loss import make_loss
from core.kernel.replica import evaluate, load_checkpoint
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
from core.monitor import BEFORE_PG, DDP_OPTIONS, WRAPPED, StepClock, breakdown, flops_per_sample, ms_line, peak_flops
from core.plugins import comm_hook, profile, trackers, tuning, watchdog  # noqa: F401 - its own (tools/registry.py)


def check(cfg: Config) -> None:
    """Before the process group exists (the pre-check calls it too): the plug-ins' checks and c10d's environment."""
    for hook in BEFORE_PG:
        hook(cfg)


def main(cfg: Config) -> dict:
    check(cfg)
    topo = init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; alone: a world of one
    try:
        return train(cfg, topo)
    finally:
        cleanup_pg()


def train(cfg: Config, topo: Topology) -> dict:
    if done := finished(cfg, topo, recipe="ddp_monitored"):  # resumed, finished: nothing is touched
        return done
    global_batch = cfg.batch_size * topo.world_size

    # Build. The same seed on every rank gives every replica the same initial weights. The order is torch's:
    # change the plain model, wrap it, register the comm hook, compile the wrapper.
    torch.manual_seed(cfg.seed)  # the same weights and data on every rank (--data's factory: its own seeds)
    train_set, val_set, collate = build_data(cfg)
    model = build_model(cfg).to(topo.device)
    fire("after_build", cfg, model)  # the plain model, before DDP wraps it (--init-from, --channels-last, ...)
    if cfg.sync_batchnorm:  # BatchNorm statistics over the global batch (GPUs only: DDP refuses it on CPU)
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ids = [topo.device.index] if topo.device.type == "cuda" else None  # its GPU, or the CPU
    more = dict(find_unused_parameters=cfg.find_unused_parameters, static_graph=cfg.static_graph)
    more |= {key: value for hook in DDP_OPTIONS for key, value in hook(cfg).items()}  # --bucket-mb, ...
    ddp_model = DistributedDataParallel(model, device_ids=ids, **more)
    train_model = ddp_model
    for wrap in WRAPPED:  # the comm hook on DDP, then torch.compile (graph breaks at DDP's buckets)
        train_model = wrap(cfg, train_model)
    torch.manual_seed(cfg.seed + topo.rank)  # from here each rank draws its own dropout, as one process would
    train_loader = make_loader(train_set, topo, batch_size=cfg.batch_size, collate_fn=collate, seed=cfg.seed)
    val_loader = make_loader(val_set, topo, batch_size=cfg.batch_size, collate_fn=collate, train=False)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr)
    total = total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = make_loss(cfg, model)  # the model's own loss, else cross-entropy on the logits
    timer = StepClock(train_model, optimizer, topo.device)  # each step's phases, from hooks: no code in the step
    peak = peak_flops(topo.device)  # MFU on a known GPU only: its peak FLOP/s, and one sample's FLOPs on meta
    flops = peak and flops_per_sample(lambda: build_model(cfg), train_set[0])

    # The run folder: a new one, or the one of the checkpoint --resume names, refused before it is touched when
    # the checkpoint cannot continue in this job. Then that checkpoint's state, every rank's own generator too.
    run = open_run(cfg, topo, recipe="ddp_monitored", global_batch=global_batch)
    state = dict(model=model, optimizer=optimizer, scheduler=scheduler)  # what a checkpoint holds, with the generators
    start = load_checkpoint(run, **state)
    totals = Tally(topo.device, start["window"])  # each log window's loss and accuracy (and the checkpoint's open one)
    saver = CheckpointSaver(background=cfg.ckpt_async)  # --ckpt-async: a thread writes the file

    # Train. DDP averages the gradients inside backward(): every replica takes the same step.
    step, skipped, evaluation = start["step"], start["skipped"], {}
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        train_loader.sampler.set_epoch(epoch, consumed=consumed)
        for batch in itertools.islice(train_loader, total - step):
            batch = to_device(batch, topo.device)
            metrics, grad_norm = step_plain(train_model, batch, optimizer=optimizer, loss_fn=loss_fn)
            step, consumed = step + 1, consumed + global_batch
            skipped += check_finite(grad_norm, step=step, on_nonfinite=cfg.on_nonfinite)
            scheduler.step()  # after the check: a stop at step 1 prints the error line alone
            totals.add(metrics)
            fire("on_step", metrics)  # the training clock, the watchdog's beat, the profiler
            if step % cfg.log_every == 0 or step == total:  # a collective: every rank reads at the same step
                numbers = dict(lr=scheduler.get_last_lr()[0], grad_norm=grad_norm, skipped=skipped)
                timing = breakdown(timer.take(), topo.device, global_batch, flops, peak)  # every rank's (a collective)
                log_train(run, totals, step=step, total=total, epoch=epoch, **numbers, **timing)
                say(run, ms_line(timing))  # where the window's steps went: the slow phase, the slow rank
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == total:  # the last: it can go on
                with not_training():  # not a step (nor for the watchdog)
                    progress = dict(epoch=epoch, samples=consumed, step=step, skipped=skipped, window=totals.reduce())
                    saver.save(run, **state, progress=progress, keep=cfg.keep)
                timer.paused()
        with not_training():  # each rank evaluates its share; the sums are all-reduced
            evaluation = evaluate(model, val_loader, loss_fn=loss_fn, device=topo.device)
        timer.paused()
        log_eval(run, evaluation, step=step, epoch=epoch)
    saver.wait()  # the last background write lands before the final weights (or its failure is one line)

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
class Config(Training, Checkpointing, AsyncCheckpoints, DDPOptions, *SEAMS["option_groups"]):
    """ddp_monitored's options, and those of the plug-ins it was joined with: --help lists them."""


if __name__ == "__main__":
    cli_main(main, Config)
